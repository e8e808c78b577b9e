//! A mixture-of-experts FFN (gpt-oss, Gemma 4, Qwen3.5; llama.cpp's `build_moe_ffn`): a router
//! scores every expert for each token, the `k` best run, and their outputs are summed weighted by
//! the softmax of their scores; Qwen3.5's shared expert runs on every token beside them, its
//! output × sigmoid(g·x) added last.
//!
//! Per token, as the math reads: logits = router·x + b (`[n_expert]`); the k largest, in
//! descending order, are its experts; w = softmax(those k logits); each expert e computes
//! y_e = down_e·act(gate_e·x + bg_e, up_e·x + bu_e) + bd_e; out = Σ_j w_j·y_(e_j), summed in that
//! order. Only the routed experts' rows are read: in a step of t tokens, expert e's matmuls take
//! the tokens routed to it together (a prefill reads each expert's weights once for all of them),
//! and since the CPU kernels compute each row alone, a token's output has the same bits in a
//! prefill, a decode and a recompute.
//!
//! Shapes: `x [1, t, hidden]`; an expert's `gate_up [2·ffn, hidden]` (gate then up, stacked),
//! `down [hidden, ffn]`; the biases `[2·ffn]` and `[hidden]`.

use super::config::Activation;
use super::decoder::Linear;
use super::kernels::glu;
use super::kernels::quant::QMatrix;
use anyhow::Result;
use candle_core::{Device, Tensor};

/// One expert's weights.
pub struct Expert {
    /// gate and up stacked, `[2·ffn, hidden]`: one store, or the two `[ffn, hidden]` halves
    /// where they could not be stacked (of two formats).
    pub gate_up: GateUp,
    /// The gate's then the up's bias, `[2·ffn]` (zeros where the file has none).
    pub gate_up_b: Vec<f32>,
    pub down: QMatrix,
    /// `[hidden]`.
    pub down_b: Vec<f32>,
    /// The expert's output is multiplied by this (Gemma 4's `ffn_down_exps.scale`; else 1).
    pub scale: f32,
}

pub enum GateUp {
    Stacked(QMatrix),
    Apart(QMatrix, QMatrix),
}

impl GateUp {
    /// `xs [n, hidden]` → gate then up of each row, `[n, 2·ffn]`.
    fn matmul(&self, xs: &[f32], n: usize, ffn: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; n * 2 * ffn];
        match self {
            GateUp::Stacked(w) => w.matmul(xs, n, &mut out)?,
            GateUp::Apart(g, u) => {
                let (mut gate, mut up) = (vec![0f32; n * ffn], vec![0f32; n * ffn]);
                g.matmul(xs, n, &mut gate)?;
                u.matmul(xs, n, &mut up)?;
                for ((o, g), u) in out
                    .chunks_exact_mut(2 * ffn)
                    .zip(gate.chunks_exact(ffn))
                    .zip(up.chunks_exact(ffn))
                {
                    o[..ffn].copy_from_slice(g);
                    o[ffn..].copy_from_slice(u);
                }
            }
        }
        Ok(out)
    }
}

pub struct Moe {
    /// `[n_expert, hidden]`, with its bias.
    pub router: Linear,
    pub experts: Vec<Expert>,
    /// Experts per token.
    pub used: usize,
    pub ffn: usize,
    pub act: Activation,
    /// An expert every token runs beside the routed ones (Qwen3.5 MoE).
    pub shared: Option<SharedExpert>,
}

/// The shared expert: y = down·act(gate·x, up·x), added × sigmoid(g·x) to the routed experts' sum.
pub struct SharedExpert {
    /// `[2·ffn, hidden]`.
    pub gate_up: GateUp,
    /// `[hidden, ffn]`.
    pub down: QMatrix,
    /// `[hidden]`: the gate's weights (`ffn_gate_inp_shexp`).
    pub gate: Vec<f32>,
    pub ffn: usize,
}

impl SharedExpert {
    /// Adds the gated shared expert's output for `xs [t, hidden]` to `out [t, hidden]`.
    fn add(&self, xs: &[f32], t: usize, act_kind: Activation, out: &mut [f32]) -> Result<()> {
        let (f, hidden) = (self.ffn, self.gate.len());
        let gu = self.gate_up.matmul(xs, t, f)?; // [t, 2f]
        let mut act = vec![0f32; t * f];
        for (row, a) in gu.chunks_exact(2 * f).zip(act.chunks_exact_mut(f)) {
            let (gate, up) = row.split_at(f);
            glu::row(act_kind, gate, up, a);
        }
        let mut y = vec![0f32; t * hidden];
        self.down.matmul(&act, t, &mut y)?; // [t, hidden]
        for ((o, y), x) in out
            .chunks_exact_mut(hidden)
            .zip(y.chunks_exact(hidden))
            .zip(xs.chunks_exact(hidden))
        {
            let g = glu::sigmoid(x.iter().zip(&self.gate).map(|(a, b)| a * b).sum());
            for (o, &y) in o.iter_mut().zip(y) {
                *o += y * g;
            }
        }
        Ok(())
    }
}

/// The `k` experts with the largest logits, in descending order (ties: the lower index first),
/// and their softmax weights.
pub fn route(logits: &[f32], k: usize) -> (Vec<usize>, Vec<f32>) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(k);
    let top = order.iter().map(|&e| logits[e]);
    let m = top.clone().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = top.map(|l| (l - m).exp()).collect();
    let sum: f32 = exps.iter().sum();
    (order, exps.iter().map(|e| e / sum).collect())
}

impl Moe {
    /// `x [1, t, hidden]` → `[1, t, hidden]`, the router reading `x` too.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_routed_by(x, x)
    }

    /// `x [1, t, hidden]` → `[1, t, hidden]`, the router reading `router_x [1, t, hidden]`
    /// (Gemma 4 routes on its own norm of the block's input, the experts run on another).
    pub fn forward_routed_by(&self, x: &Tensor, router_x: &Tensor) -> Result<Tensor> {
        // The experts live in host memory and run on kvchat's CPU kernels whatever the device
        // (llama.cpp's --cpu-moe): the router's logits and the step's rows come to the host, the
        // sum goes back to `x`'s device.
        let (_, t, hidden) = x.dims3()?;
        let n_expert = self.experts.len();
        let logits = self
            .router
            .forward(router_x)?
            .flatten_all()?
            .to_vec1::<f32>()?; // [t, n_expert]
        let xs = x.flatten_all()?.to_vec1::<f32>()?; // [t, hidden]

        // Each token's experts and weights; each expert's (token, slot) list.
        let mut routed: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_expert];
        let mut weights = vec![0f32; t * self.used];
        for tok in 0..t {
            let (chosen, w) = route(&logits[tok * n_expert..][..n_expert], self.used);
            for (slot, (e, w)) in chosen.into_iter().zip(w).enumerate() {
                routed[e].push((tok, slot));
                weights[tok * self.used + slot] = w;
            }
        }
        // Each slot's weighted expert output, `[t, used, hidden]`.
        let mut slots = vec![0f32; t * self.used * hidden];
        let f = self.ffn;
        for (e, rows) in routed.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let expert = &self.experts[e];
            let n = rows.len();
            let mut xe = Vec::with_capacity(n * hidden);
            for &(tok, _) in rows {
                xe.extend_from_slice(&xs[tok * hidden..][..hidden]);
            }
            let mut gu = expert.gate_up.matmul(&xe, n, f)?; // [n, 2f]
            let mut act = vec![0f32; n * f];
            for (row, a) in gu.chunks_exact_mut(2 * f).zip(act.chunks_exact_mut(f)) {
                for (v, b) in row.iter_mut().zip(&expert.gate_up_b) {
                    *v += b;
                }
                let (gate, up) = row.split_at(f);
                glu::row(self.act, gate, up, a);
            }
            let mut y = vec![0f32; n * hidden];
            expert.down.matmul(&act, n, &mut y)?; // [n, hidden]
            for (&(tok, slot), y) in rows.iter().zip(y.chunks_exact(hidden)) {
                let w = weights[tok * self.used + slot];
                let out = &mut slots[(tok * self.used + slot) * hidden..][..hidden];
                for ((o, &y), &b) in out.iter_mut().zip(y).zip(&expert.down_b) {
                    *o = (y + b) * expert.scale * w;
                }
            }
        }
        // Σ over the slots, in order.
        let mut out = vec![0f32; t * hidden];
        for (tok, o) in out.chunks_exact_mut(hidden).enumerate() {
            for slot in 0..self.used {
                let s = &slots[(tok * self.used + slot) * hidden..][..hidden];
                for (o, &s) in o.iter_mut().zip(s) {
                    *o += s;
                }
            }
        }
        if let Some(shared) = &self.shared {
            shared.add(&xs, t, self.act, &mut out)?;
        }
        Ok(Tensor::from_vec(out, (1, t, hidden), &Device::Cpu)?.to_device(x.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_the_largest_logits_in_order_and_softmaxes_them() {
        let (e, w) = route(&[0.5, 2.0, -1.0, 2.0, 1.0], 3);
        assert_eq!(e, vec![1, 3, 4]);
        let z = 1.0 + 1.0 + (-1f32).exp();
        assert_eq!(w, vec![1.0 / z, 1.0 / z, (-1f32).exp() / z]);
    }
}
