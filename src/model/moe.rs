//! A mixture-of-experts FFN (gpt-oss; llama.cpp's `build_moe_ffn`): a router scores every
//! expert for each token, the `k` best run, and their outputs are summed weighted by the softmax
//! of their scores.
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
use super::kernels::quant::QMatrix;
use super::llama::Linear;
use anyhow::{bail, Result};
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
}

pub enum GateUp {
    Stacked(QMatrix),
    Apart(QMatrix, QMatrix),
}

impl GateUp {
    /// `x [1, n, hidden]` → gate then up of each row, `[n, 2·ffn]`.
    fn forward(&self, x: &Tensor) -> Result<Vec<f32>> {
        Ok(match self {
            GateUp::Stacked(w) => w.forward(x)?.flatten_all()?.to_vec1()?,
            GateUp::Apart(g, u) => Tensor::cat(&[g.forward(x)?, u.forward(x)?], 2)?
                .flatten_all()?
                .to_vec1()?,
        })
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
}

/// gpt-oss's gated activation (ggml's `swiglu_oai`, α = 1.702, limit 7): x = min(gate, 7),
/// y = up clamped to ±7, x·σ(αx)·(y + 1).
#[inline]
pub fn swiglu_oai(gate: f32, up: f32) -> f32 {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    let x = gate.min(LIMIT);
    let y = up.clamp(-LIMIT, LIMIT);
    x / (1.0 + (ALPHA * -x).exp()) * (y + 1.0)
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
    /// `x [1, t, hidden]` → `[1, t, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !x.device().is_cpu() {
            bail!("a mixture-of-experts FFN runs on the CPU only (kvchat's kernels)");
        }
        let (_, t, hidden) = x.dims3()?;
        let n_expert = self.experts.len();
        let logits = self.router.forward(x)?.flatten_all()?.to_vec1::<f32>()?; // [t, n_expert]
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
            let xe = Tensor::from_vec(xe, (1, n, hidden), &Device::Cpu)?;
            let gu = expert.gate_up.forward(&xe)?; // [n, 2f]
            let mut act = Vec::with_capacity(n * f);
            for row in gu.chunks_exact(2 * f) {
                let (gate, up) = row.split_at(f);
                let (bg, bu) = expert.gate_up_b.split_at(f);
                for j in 0..f {
                    let (g, u) = (gate[j] + bg[j], up[j] + bu[j]);
                    act.push(match self.act {
                        Activation::SwigluOai => swiglu_oai(g, u),
                        Activation::Silu => g / (1.0 + (-g).exp()) * u,
                        Activation::GeluTanh => super::kernels::glu::gelu_tanh(g) * u,
                    });
                }
            }
            let act = Tensor::from_vec(act, (1, n, f), &Device::Cpu)?;
            let y = expert.down.forward(&act)?.flatten_all()?.to_vec1::<f32>()?; // [n, hidden]
            for (&(tok, slot), y) in rows.iter().zip(y.chunks_exact(hidden)) {
                let w = weights[tok * self.used + slot];
                let out = &mut slots[(tok * self.used + slot) * hidden..][..hidden];
                for ((o, &y), &b) in out.iter_mut().zip(y).zip(&expert.down_b) {
                    *o = (y + b) * w;
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
        Ok(Tensor::from_vec(out, (1, t, hidden), &Device::Cpu)?)
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

    #[test]
    fn swiglu_oai_clamps_the_gate_above_and_the_up_both_ways() {
        let glu = |x: f32| x / (1.0 + (-1.702 * x).exp());
        assert_eq!(swiglu_oai(1.0, 2.0), glu(1.0) * 3.0);
        assert_eq!(swiglu_oai(9.0, 2.0), glu(7.0) * 3.0);
        assert_eq!(swiglu_oai(1.0, -9.0), glu(1.0) * -6.0);
        assert_eq!(swiglu_oai(-3.0, 9.0), glu(-3.0) * 8.0);
    }
}
