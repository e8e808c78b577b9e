//! A gated FFN's activation in one pass: `act(gate) · up` per element, from the gate and up
//! halves of the stacked projection in place, for GeGLU (`gelu_tanh`, Gemma 3) and SwiGLU
//! (`silu`, the llama family). candle's `gelu`/`silu` then `*` made two passes over strided
//! halves, two tensors, and called libm's scalar `tanhf`/`expf` per element (7 % of Gemma 3's
//! prefill; SiLU's `expf` and the strided passes 4-5 % of SmolLM2's). Here GELU's tanh is built
//! from the vectorizable `exp_nonpositive` of the attention kernel, SiLU is candle's formula
//! (libm's `expf`), and rows are split over candle's pool.

use super::attention::exp_nonpositive;
use super::disjoint::for_each_row;
use anyhow::Result;
use candle_core::{CpuStorage, Storage, Tensor};

/// √(2/π), as candle's and llama.cpp's GELU use it.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// tanh(z) = sign(z)·(1 − e)/(1 + e) with e = e^(−2|z|) ≤ 1: no overflow anywhere; the absolute
/// error is a few ulp of 1 (what GELU's 1 + tanh keeps).
#[inline(always)]
fn tanh(z: f32) -> f32 {
    let e = exp_nonpositive(-2.0 * z.abs());
    ((1.0 - e) / (1.0 + e)).copysign(z)
}

/// GELU, tanh approximation: 0.5·v·(1 + tanh(√(2/π)·v·(1 + 0.044715·v²))).
#[inline(always)]
pub fn gelu_tanh(v: f32) -> f32 {
    0.5 * v * (1.0 + tanh(SQRT_2_OVER_PI * v * (1.0 + 0.044_715 * v * v)))
}

/// SiLU: v / (1 + e^(−v)) with libm's `expf`, candle's formula value for value. llama.cpp's
/// vectorized `ggml_v_silu` (its own exp polynomial) was tried (35cb69a): it moved perplexities
/// by up to 1 % on a 1,020-token text and pushed two comparisons that follow flipped int8/int4
/// roundings (Q3_K weights against candle's kernels, the int4 GPU-path check) past their bounds;
/// reverted until that is understood. The exp stays scalar here: the pass is still one, on the pool.
#[inline(always)]
pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// The activation a gated FFN applies to its gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    GeluTanh,
    Silu,
}

/// One row: `out[i] = act(gate[i]) · up[i]` (the loop written once per activation, so each
/// vectorizes with its function inlined).
fn row(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[inline(always)]
    fn each(act: impl Fn(f32) -> f32, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = act(g) * u;
        }
    }
    match act {
        Gate::GeluTanh => each(gelu_tanh, gate, up, out),
        Gate::Silu => each(silu, gate, up, out),
    }
}

/// Elements below which one thread does the whole tensor (a decode step's 2048).
const PARALLEL_FROM: usize = 1 << 15;
/// Rows per work item.
const ROWS_PER_ITEM: usize = 4;

/// `act(gate) · up` for `gate` and `up` `[1, t, f]` f32 on the CPU, each with its last
/// dimension contiguous (the halves of a `[1, t, 2f]` matmul output qualify); other tensors go
/// through candle's ops.
pub fn gated(act: Gate, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (b, t, f) = gate.dims3()?;
    let fallback = || -> Result<Tensor> {
        let a = match act {
            Gate::GeluTanh => gate.gelu()?,
            Gate::Silu => gate.silu()?,
        };
        Ok((a * up)?)
    };
    if b != 1 || up.dims3()? != (b, t, f) || !gate.device().is_cpu() {
        return fallback();
    }
    let (gs, gl) = gate.storage_and_layout();
    let (us, ul) = up.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(g)), Storage::Cpu(CpuStorage::F32(u))) = (&*gs, &*us) else {
        drop((gs, us));
        return fallback();
    };
    // Row r of a tensor: `len` values from offset + r·stride.
    let rows = |l: &candle_core::Layout| -> Option<(usize, usize)> {
        let s = l.stride();
        (s[2] == 1 || f == 1).then_some((l.start_offset(), if t == 1 { f } else { s[1] }))
    };
    let (Some((go, gstride)), Some((uo, ustride))) = (rows(gl), rows(ul)) else {
        drop((gs, us));
        return fallback();
    };
    let g_row = |r: usize| &g[go + r * gstride..go + r * gstride + f];
    let u_row = |r: usize| &u[uo + r * ustride..uo + r * ustride + f];
    let mut out = vec![0f32; t * f];
    for_each_row(&mut out, f, ROWS_PER_ITEM, PARALLEL_FROM, |r, o| {
        row(act, g_row(r), u_row(r), o)
    });
    let device = gate.device().clone();
    drop((gs, us));
    Ok(Tensor::from_vec(out, (1, t, f), &device)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// candle's formula, with libm's tanh.
    fn reference(v: f32) -> f32 {
        0.5 * v * (1.0 + (SQRT_2_OVER_PI * v * (1.0 + 0.044_715 * v * v)).tanh())
    }

    #[test]
    fn gelu_tanh_is_within_a_few_ulp_of_one_of_the_libm_formula() {
        let mut worst = 0f32;
        for i in -200_000..=200_000 {
            let v = i as f32 * 1e-4; // -20 … 20
            let (a, b) = (gelu_tanh(v), reference(v));
            // Error relative to the magnitude GELU computes at: 0.5·|v|·(1 + tanh) ≤ |v|.
            let err = (a - b).abs() / v.abs().max(1e-30);
            worst = worst.max(err);
        }
        assert!(worst < 4.0 * f32::EPSILON, "worst error {worst:e} of |v|");
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert_eq!(gelu_tanh(100.0), 100.0);
        assert_eq!(gelu_tanh(-100.0), -0.0);
        assert!(gelu_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn silu_is_within_a_few_ulp_of_the_libm_formula() {
        let mut worst = 0f32;
        for i in -160_000..=200_000 {
            let v = i as f32 * 5e-4; // -80 … 100
            let (a, b) = (silu(v), v / (1.0 + (-v).exp()));
            worst = worst.max((a - b).abs() / b.abs().max(1e-30));
        }
        assert!(worst < 4.0 * f32::EPSILON, "worst relative error {worst:e}");
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(silu(100.0), 100.0);
        assert_eq!(silu(-200.0).to_bits(), (-0.0f32).to_bits());
        assert!(silu(f32::NAN).is_nan());
    }

    /// `gated(act, ..)` on the halves of one `[1, t, 2f]` tensor, flattened.
    fn fused(act: Gate, gu: &Tensor, f: usize) -> Vec<f32> {
        let (gate, up) = (gu.narrow(2, 0, f).unwrap(), gu.narrow(2, f, f).unwrap());
        gated(act, &gate, &up)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn the_halves_of_a_stacked_output_give_the_product_of_separate_tensors() {
        let (t, f) = (70, 600); // 42,000 elements: the parallel path
        let gu = Tensor::randn(0f32, 2.0, (1, t, 2 * f), &Device::Cpu).unwrap();
        let flat: Vec<f32> = gu.flatten_all().unwrap().to_vec1().unwrap();
        for (act, fun) in [
            (Gate::GeluTanh, gelu_tanh as fn(f32) -> f32),
            (Gate::Silu, silu),
        ] {
            let want: Vec<f32> = flat
                .chunks_exact(2 * f)
                .flat_map(|r| r[..f].iter().zip(&r[f..]).map(|(&g, &u)| fun(g) * u))
                .collect();
            assert_eq!(
                fused(act, &gu, f),
                want,
                "{act:?}: whichever rows a thread computed"
            );
            // One row at a time (a decode step) gives the same values as the whole prompt.
            let last = gu.narrow(1, t - 1, 1).unwrap();
            assert_eq!(fused(act, &last, f), want[(t - 1) * f..], "{act:?}");
        }
    }

    #[test]
    fn silu_gating_agrees_with_candles_ops_to_a_few_ulp() {
        let (t, f) = (8, 300);
        let gu = Tensor::randn(0f32, 3.0, (1, t, 2 * f), &Device::Cpu).unwrap();
        let (gate, up) = (gu.narrow(2, 0, f).unwrap(), gu.narrow(2, f, f).unwrap());
        let candle: Vec<f32> = (gate.silu().unwrap() * &up)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in fused(Gate::Silu, &gu, f).iter().zip(&candle) {
            assert!(
                (a - b).abs() <= 8.0 * f32::EPSILON * b.abs(),
                "{a} against {b}"
            );
        }
    }
}
