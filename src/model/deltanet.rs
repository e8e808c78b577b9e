//! Qwen3.5's Gated DeltaNet mixer: a linear-attention layer whose memory is a fixed-size
//! recurrent state instead of keys and values that grow with the sequence (llama.cpp's
//! `build_layer_attn_linear` in src/models/qwen35.cpp, and ggml's `ssm_conv` and
//! `gated_delta_net` on the CPU).
//!
//! For a step of `t` tokens, `x [1, t, hidden]`:
//!
//! 1. `qkv = attn_qkv · x` `[t, C]` (C = 2·key_dim + value_dim channels: q, k, v side by side),
//!    `z = attn_gate · x` `[t, V]`, `β = sigmoid(ssm_beta · x)` and
//!    `g = softplus(ssm_alpha · x + dt_bias) · a` `[t, Hv]` (a = −exp(A_log), stored so).
//! 2. A causal convolution of `conv` taps per channel over the state's last `conv − 1` inputs
//!    and the step's, then SiLU; the state keeps the newest `conv − 1` inputs.
//! 3. Per token and value head h (key head h mod Hk): q and k L2-normed, then with S the head's
//!    `d × d` state: S ← S·exp(g); δ = β(v − Sᵀk); S ← S + k ⊗ δ; o = Sᵀq / √d.
//! 4. `o` RMS-normed per head (weight `ssm_norm`), × SiLU(z), then `ssm_out` `[V → hidden]`.
//!
//! Layout, stated once. [`RecurrentState::conv`]: `[conv − 1][C]`, the oldest input first.
//! [`RecurrentState::matrix`]: `[Hv][d][d]`, row j of head h holding column j of S (ggml's
//! transposed layout: `matrix[h][j][i] = S[i][j]`), so every update and read runs along rows.
//! Every token is a step of the recurrence, so a prefill, a decode and any split of a sequence
//! into steps give the same bits.

use super::config::Recurrent;
use super::decoder::{Linear, Weight};
use super::kernels::disjoint::for_each_row_pair;
use super::kernels::glu::{sigmoid, silu};
use super::kernels::norm;
use super::kernels::quant::QMatrix;
use anyhow::{bail, Result};
use candle_core::Tensor;

/// One DeltaNet layer's weights.
pub struct DeltaNet {
    /// qkv, gate, β and α stacked into one matrix (CPU kernels, one format): one pass over the
    /// input instead of four ([`DeltaNet::stack_projections`]).
    pub input: Option<QMatrix>,
    /// `[C, hidden]`.
    pub qkv: Linear,
    /// The output gate z, `[V, hidden]`.
    pub gate: Linear,
    /// `[Hv, hidden]` each.
    pub beta: Linear,
    pub alpha: Linear,
    /// The convolution's taps, `[conv][C]` (tap-major: each tap's weights for every channel in a
    /// row), the oldest input's tap first.
    pub conv: Vec<f32>,
    /// `[Hv]` each: added to α before softplus; the decay's scale (negative).
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    /// The output's per-head RMSNorm weight, `[d]`.
    pub norm: Vec<f32>,
    /// `[hidden, V]`.
    pub out: Linear,
}

/// One DeltaNet layer's memory of the sequence so far (see the module's layout). Its size does
/// not depend on the sequence's length.
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentState {
    pub conv: Vec<f32>,
    pub matrix: Vec<f32>,
}

impl RecurrentState {
    /// The state before any token: zeros.
    pub fn new(r: &Recurrent) -> Self {
        Self {
            conv: vec![0.0; r.conv_floats()],
            matrix: vec![0.0; r.matrix_floats()],
        }
    }

    pub fn clear(&mut self) {
        self.conv.fill(0.0);
        self.matrix.fill(0.0);
    }

    pub fn bytes(&self) -> usize {
        4 * (self.conv.len() + self.matrix.len())
    }
}

/// Heads from which the scan runs on candle's pool (one head a work item).
const PARALLEL_HEADS: usize = 2;

/// ggml's softplus: x past 20 is its own softplus in f32.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// x / √(Σx² + eps), as llama.cpp's `build_gdn_l2_norm` (an RMSNorm with eps/n, × 1/√n).
fn l2_norm(x: &mut [f32], eps: f32) {
    let n = x.len() as f32;
    let sum2 = dot(x, x);
    let scale = 1.0 / (sum2 / n + eps / n).sqrt();
    let unit = 1.0 / n.sqrt();
    x.iter_mut().for_each(|v| *v = *v * scale * unit);
}

/// Σ aᵢbᵢ in 8 lanes (element i into lane i mod 8), the lanes then added in order: a fixed
/// order, whatever the caller, that the compiler turns into vector instructions.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The step's inputs to the recurrence, on the host: per token, the convolved and normed q and
/// k of every key head and v of every value head, and per token and value head its decay and β.
struct ScanInput<'a> {
    r: &'a Recurrent,
    t: usize,
    /// `[t][C]`: q `[Hk][d]`, k `[Hk][d]`, v `[Hv][d]`.
    qkv: &'a [f32],
    /// `[t][Hv]`: exp(g) and β.
    decay: &'a [f32],
    beta: &'a [f32],
}

impl ScanInput<'_> {
    /// Runs value head h's recurrence over the step's tokens, from its state `m` `[d][d]`,
    /// writing its outputs `[t][d]` to `out`.
    fn head(&self, h: usize, m: &mut [f32], out: &mut [f32]) {
        let (d, c) = (self.r.head_dim, self.r.channels());
        let (hk, hv) = (self.r.k_heads, self.r.v_heads);
        let kh = h % hk;
        let scale = 1.0 / (d as f32).sqrt();
        let mut delta = vec![0f32; d];
        for tok in 0..self.t {
            let row = &self.qkv[tok * c..(tok + 1) * c];
            let q = &row[kh * d..(kh + 1) * d];
            let k = &row[(hk + kh) * d..(hk + kh + 1) * d];
            let v = &row[(2 * hk + h) * d..(2 * hk + h + 1) * d];
            let (decay, beta) = (self.decay[tok * hv + h], self.beta[tok * hv + h]);
            // S ← S·exp(g), and δ_j = β(v_j − Σ_i S[i][j] k_i), one pass over the rows.
            for (j, mj) in m.chunks_exact_mut(d).enumerate() {
                mj.iter_mut().for_each(|x| *x *= decay);
                delta[j] = (v[j] - dot(mj, k)) * beta;
            }
            // S[i][j] += k_i δ_j, and o_j = Σ_i S[i][j] q_i / √d.
            let o = &mut out[tok * d..(tok + 1) * d];
            for (j, mj) in m.chunks_exact_mut(d).enumerate() {
                mj.iter_mut()
                    .zip(k)
                    .for_each(|(x, &ki)| *x += ki * delta[j]);
                o[j] = dot(mj, q) * scale;
            }
        }
    }
}

impl DeltaNet {
    /// Stacks the four input projections into one matrix where all run on our CPU kernels in
    /// one format, without biases (the separate ones become views of it).
    pub fn stack_projections(&mut self) -> Result<()> {
        let mats: Option<Vec<&QMatrix>> = [&self.qkv, &self.gate, &self.beta, &self.alpha]
            .iter()
            .map(|l| match (&l.w, &l.b) {
                (Weight::Cpu(m), None) => Some(m),
                _ => None,
            })
            .collect();
        if let Some(mats) = mats {
            if let Some((all, mut parts)) = QMatrix::stack(&mats)? {
                self.alpha.w = Weight::Cpu(parts.pop().expect("alpha"));
                self.beta.w = Weight::Cpu(parts.pop().expect("beta"));
                self.gate.w = Weight::Cpu(parts.pop().expect("gate"));
                self.qkv.w = Weight::Cpu(parts.pop().expect("qkv"));
                self.input = Some(all);
            }
        }
        Ok(())
    }

    /// The step's input projections on the host, one row a token: qkv `[C]`, z `[V]`, then the
    /// raw β and α `[Hv]` each — `[t, C + V + 2·Hv]`.
    fn project(&self, x: &Tensor) -> Result<Vec<f32>> {
        let host = |y: Tensor| -> Result<Vec<f32>> { Ok(y.flatten_all()?.to_vec1::<f32>()?) };
        let (_, t, _) = x.dims3()?;
        let Some(w) = &self.input else {
            // Four matmuls (weights our kernels do not run, or of several formats), concatenated.
            let parts = [&self.qkv, &self.gate, &self.beta, &self.alpha]
                .iter()
                .map(|l| l.forward(x))
                .collect::<Result<Vec<_>>>()?;
            return host(Tensor::cat(&parts, 2)?);
        };
        let mut all = vec![0f32; t * w.dims().0];
        w.matmul(&host(x.clone())?, t, &mut all)?;
        Ok(all)
    }

    /// The mixer over a step `x [1, t, hidden]`, continuing from `state` and leaving it after the
    /// step's last token: `[1, t, hidden]`.
    pub fn forward(
        &self,
        r: &Recurrent,
        eps: f32,
        x: &Tensor,
        state: &mut RecurrentState,
    ) -> Result<Tensor> {
        let (_, t, _) = x.dims3()?;
        let (c, d, hk, hv) = (r.channels(), r.head_dim, r.k_heads, r.v_heads);
        if state.conv.len() != r.conv_floats() || state.matrix.len() != r.matrix_floats() {
            bail!("a recurrent state of another shape was given to a DeltaNet layer");
        }
        let v = r.value_dim();
        let width = c + v + 2 * hv;
        let projected = self.project(x)?; // [t, width]: qkv, z, β, α
        let rows = || projected.chunks_exact(width);

        // The causal convolution: the kept inputs, then the step's, `[conv − 1 + t][C]`; output
        // row `tok` sums taps 0..conv over rows tok..tok + conv, in that order.
        let k1 = r.conv - 1;
        let mut window = Vec::with_capacity((k1 + t) * c);
        window.extend_from_slice(&state.conv);
        rows().for_each(|row| window.extend_from_slice(&row[..c]));
        let mut qkv = vec![0f32; t * c];
        for (tok, out) in qkv.chunks_exact_mut(c).enumerate() {
            for (k, taps) in self.conv.chunks_exact(c).enumerate() {
                let input = &window[(tok + k) * c..(tok + k + 1) * c];
                for ((o, &w), &v) in out.iter_mut().zip(taps).zip(input) {
                    *o += w * v;
                }
            }
            out.iter_mut().for_each(|o| *o = silu(*o));
        }
        state.conv.copy_from_slice(&window[t * c..(t + k1) * c]);
        // q and k L2-normed per key head.
        for row in qkv.chunks_exact_mut(c) {
            for head in row[..2 * hk * d].chunks_exact_mut(d) {
                l2_norm(head, eps);
            }
        }
        let (mut decay, mut beta) = (Vec::with_capacity(t * hv), Vec::with_capacity(t * hv));
        for row in rows() {
            let (beta_raw, alpha) = row[c + v..].split_at(hv);
            for h in 0..hv {
                decay.push((softplus(alpha[h] + self.dt_bias[h]) * self.a[h]).exp());
                beta.push(sigmoid(beta_raw[h]));
            }
        }
        let input = ScanInput {
            r,
            t,
            qkv: &qkv,
            decay: &decay,
            beta: &beta,
        };
        let mut out = vec![0f32; hv * t * d]; // [Hv][t][d]
        for_each_row_pair(
            &mut state.matrix,
            d * d,
            &mut out,
            t * d,
            PARALLEL_HEADS,
            |h, m, o| input.head(h, m, o),
        );

        // RMS-normed per head, × SiLU(z): [t][Hv][d].
        let mut y = vec![0f32; t * hv * d];
        for (tok, (yt, row)) in y.chunks_exact_mut(v).zip(rows()).enumerate() {
            let z = &row[c..c + v];
            for (h, (yh, zh)) in yt.chunks_exact_mut(d).zip(z.chunks_exact(d)).enumerate() {
                norm::row(&out[(h * t + tok) * d..][..d], &self.norm, eps, yh);
                yh.iter_mut().zip(zh).for_each(|(y, &z)| *y *= silu(z));
            }
        }
        let y = Tensor::from_vec(y, (1, t, hv * d), x.device())?; // [1, t, V]
        self.out.forward(&y) // [1, t, hidden]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Recurrent {
        Recurrent {
            layers: vec![true],
            conv: 4,
            k_heads: 2,
            v_heads: 4,
            head_dim: 8,
        }
    }

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                x as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn input<'a>(r: &'a Recurrent, t: usize, qkv: &'a [f32], db: &'a [f32]) -> ScanInput<'a> {
        let n = t * r.v_heads;
        ScanInput {
            r,
            t,
            qkv,
            decay: &db[..n],
            beta: &db[n..],
        }
    }

    /// The recurrence written with S as an explicit matrix, S[i][j], one token at a time.
    fn reference(r: &Recurrent, x: &ScanInput, h: usize, s: &mut [Vec<f32>]) -> Vec<f32> {
        let (d, c, hk, hv) = (r.head_dim, r.channels(), r.k_heads, r.v_heads);
        let kh = h % hk;
        let mut out = Vec::new();
        for tok in 0..x.t {
            let row = &x.qkv[tok * c..];
            let q = &row[kh * d..];
            let k = &row[(hk + kh) * d..];
            let v = &row[(2 * hk + h) * d..];
            let (g, b) = (x.decay[tok * hv + h], x.beta[tok * hv + h]);
            s.iter_mut().flatten().for_each(|e| *e *= g);
            let delta: Vec<f32> = (0..d)
                .map(|j| (v[j] - (0..d).map(|i| s[i][j] * k[i]).sum::<f32>()) * b)
                .collect();
            for i in 0..d {
                for j in 0..d {
                    s[i][j] += k[i] * delta[j];
                }
            }
            out.extend(
                (0..d).map(|j| (0..d).map(|i| s[i][j] * q[i]).sum::<f32>() / (d as f32).sqrt()),
            );
        }
        out
    }

    #[test]
    fn the_scan_is_the_delta_rule_on_the_explicit_matrix() {
        let r = shape();
        let (t, d) = (5, r.head_dim);
        let qkv = values(t * r.channels(), 1);
        let db: Vec<f32> = values(2 * t * r.v_heads, 2)
            .iter()
            .map(|v| 0.5 + 0.5 * v.abs())
            .collect();
        let x = input(&r, t, &qkv, &db);
        for h in 0..r.v_heads {
            let mut m = vec![0f32; d * d];
            let mut out = vec![0f32; t * d];
            x.head(h, &mut m, &mut out);
            let mut s = vec![vec![0f32; d]; d];
            let want = reference(&r, &x, h, &mut s);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "head {h}: {a} vs {b}");
            }
            // The kept matrix is Sᵀ.
            for i in 0..d {
                for j in 0..d {
                    assert!((m[j * d + i] - s[i][j]).abs() < 1e-5);
                }
            }
        }
    }

    #[test]
    fn a_step_of_several_tokens_leaves_the_bits_of_one_token_at_a_time() {
        let r = shape();
        let (t, d) = (6, r.head_dim);
        let qkv = values(t * r.channels(), 3);
        let db: Vec<f32> = values(2 * t * r.v_heads, 4)
            .iter()
            .map(|v| 0.5 + 0.5 * v.abs())
            .collect();
        let whole = input(&r, t, &qkv, &db);
        let mut m_whole = vec![0f32; d * d];
        let mut out_whole = vec![0f32; t * d];
        whole.head(1, &mut m_whole, &mut out_whole);
        let mut m = vec![0f32; d * d];
        let (c, hv) = (r.channels(), r.v_heads);
        for tok in 0..t {
            let mut one = vec![0f32; 2 * hv];
            one[..hv].copy_from_slice(&db[tok * hv..(tok + 1) * hv]);
            one[hv..].copy_from_slice(&db[t * hv + tok * hv..t * hv + (tok + 1) * hv]);
            let x = input(&r, 1, &qkv[tok * c..(tok + 1) * c], &one);
            let mut out = vec![0f32; d];
            x.head(1, &mut m, &mut out);
            assert_eq!(out, out_whole[tok * d..(tok + 1) * d]);
        }
        assert_eq!(m, m_whole);
    }

    #[test]
    fn l2_norm_gives_unit_length() {
        let mut x = vec![3.0, 4.0];
        l2_norm(&mut x, 0.0);
        assert!((x[0] - 0.6).abs() < 1e-6 && (x[1] - 0.8).abs() < 1e-6);
    }

    #[test]
    fn softplus_follows_ggml_past_twenty() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
