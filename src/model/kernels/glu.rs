//! A gated FFN's activation in one pass: `act(gate) · up` per element, from the gate and up
//! halves of the stacked projection in place, for GeGLU (`gelu_tanh`, Gemma 3) and SwiGLU
//! (`silu`, the llama family). candle's `gelu`/`silu` then `*` made two passes over strided
//! halves, two tensors, and called libm's scalar `tanhf`/`expf` per element (7 % of Gemma 3's
//! prefill; SiLU's `expf` and the strided passes 4-5 % of SmolLM2's). Here GELU's tanh is built
//! from the vectorizable `exp_nonpositive` of the attention kernel and SiLU is llama.cpp's own
//! vectorized formula (`expf_ggml`); rows are split over candle's pool.

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

/// e^x as llama.cpp's vectorized `ggml_v_expf` computes it (ggml-cpu/vec.h, AVX2 build; its
/// AVX-512 build has another, and it takes libm's `expf` for a row's last n mod 8), lane
/// for lane: x = n·ln2 + b with n = round(x·log2 e) (by adding 1.5·2^23), ln2 split in two, a
/// degree-5 polynomial in b, and 2^n built in the exponent bits; for |n| > 126 the scale is
/// split in two factors (and beyond 192 saturates to 0 or ∞). Each `mul_add` is one of its fused
/// multiply-adds, so the bits are the same; selects instead of its branch give the same lanes.
#[inline(always)]
pub fn expf_ggml(x: f32) -> f32 {
    let c = |bits: u32| f32::from_bits(bits);
    let Reduced { n, e, j, fast } = reduce(x);
    // |n| > 126: 2^n as s1·s2.
    let g = if n <= 0.0 { 0x8200_0000u32 } else { 0 };
    let s1 = c(g.wrapping_add(0x7f00_0000));
    let s2 = c(e.wrapping_sub(g));
    let split = if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    };
    if n.abs() > 126.0 {
        split
    } else {
        fast
    }
}

/// The largest |x| for which [`expf_ggml`] takes its first path (|n| ≤ 126: |x|·log2 e ≤ 125.6
/// rounds to at most 126), so that [`expf_ggml_normal`] gives its bits.
const NORMAL_LIMIT: f32 = 87.0;

/// [`expf_ggml`] for |x| ≤ [`NORMAL_LIMIT`], the same bits: its first path alone. A vectorized
/// loop computes both sides of every select in every lane, and the second path costs an Intel
/// Xeon ~4× the first (its products leave f32's normal range in ordinary lanes, 2^-126·(1 + j)
/// for n = 1): SwiGLU over a row ran 5× slower than by this path alone.
#[inline(always)]
pub fn expf_ggml_normal(x: f32) -> f32 {
    reduce(x).fast
}

/// x = n·ln2 + b reduced, and e^x where 2^n is a normal float.
struct Reduced {
    n: f32,
    /// n in the exponent bits.
    e: u32,
    /// e^b − 1 by the polynomial.
    j: f32,
    fast: f32,
}

#[inline(always)]
fn reduce(x: f32) -> Reduced {
    let c = |bits: u32| f32::from_bits(bits);
    let r = c(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(c(0x3fb8_aa3b), r); // log2 e
    let n = z - r;
    // b = x − n·ln2, ln2 = 0x1.62e4p-1 + 0x1.7f7d1cp-20 (fnmadd(a, b, c) = −a·b + c, exact).
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = c(e.wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    Reduced {
        n,
        e,
        j,
        fast: j.mul_add(k, k),
    }
}

/// 1 / (1 + e^(−v)): Qwen3.5's gates (DeltaNet's β, the shared expert's weight).
pub fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// SiLU as llama.cpp's vectorized `ggml_v_silu`: v / (1 + e^(−v)), e^x by [`expf_ggml`]. Its
/// SwiGLU (`ggml_vec_swiglu_f32`) multiplies this by up; so does [`gated`], so that the FFN's
/// input to the down projection is llama.cpp's value for value (where the row length is a
/// multiple of 8: llama.cpp takes libm's `expf` for the rest; on SmolLM2, a few ulp here move a
/// perplexity by over 1 %, as the activation quantizers' last bits did).
#[inline(always)]
pub fn silu(v: f32) -> f32 {
    v / (1.0 + expf_ggml(-v))
}

/// [`silu`] for |v| ≤ [`NORMAL_LIMIT`], the same bits ([`expf_ggml_normal`]).
#[inline(always)]
fn silu_normal(v: f32) -> f32 {
    v / (1.0 + expf_ggml_normal(-v))
}

/// gpt-oss's gated activation (ggml's `swiglu_oai`, α = 1.702, limit 7): x = min(gate, 7),
/// y = up clamped to ±7, x·σ(αx)·(y + 1), computed as ggml computes it.
#[inline(always)]
pub fn swiglu_oai(gate: f32, up: f32) -> f32 {
    let x = gate.min(OAI_LIMIT);
    let y = up.clamp(-OAI_LIMIT, OAI_LIMIT);
    x / (1.0 + (OAI_ALPHA * -x).exp()) * (y + 1.0)
}

const OAI_ALPHA: f32 = 1.702;
const OAI_LIMIT: f32 = 7.0;

/// The activation a gated FFN applies to its gate and up (the architectures' table,
/// `arch::ARCHS`, names it as `arch::Activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// SwiGLU: silu(gate) · up.
    Silu,
    /// GeGLU with the tanh approximation of GELU: gelu_tanh(gate) · up (Gemma).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU ([`swiglu_oai`]).
    SwigluOai,
}

/// One row: `out[i] = act(gate[i], up[i])` (the loop written once per activation, so each
/// vectorizes with its function inlined).
pub fn row(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[inline(always)]
    fn each(act: impl Fn(f32, f32) -> f32, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = act(g, u);
        }
    }
    match act {
        Gate::GeluTanh => each(|g, u| gelu_tanh(g) * u, gate, up, out),
        // Every gate within ±87 (what a model's rows hold; a NaN or ∞ is not): e^x by its first
        // path alone, the same bits.
        Gate::Silu if max_abs_within(gate, NORMAL_LIMIT) => {
            each(|g, u| silu_normal(g) * u, gate, up, out)
        }
        Gate::Silu => each(|g, u| silu(g) * u, gate, up, out),
        Gate::SwigluOai => each(swiglu_oai, gate, up, out),
    }
}

/// Whether every |x| ≤ `limit` (a NaN is not): an integer maximum of the magnitudes' bits,
/// which vectorizes (a float one folds serially).
fn max_abs_within(xs: &[f32], limit: f32) -> bool {
    xs.iter()
        .fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff))
        <= limit.to_bits()
}

/// Rows from which they are split over candle's pool: one row (a decode step's) stays on this
/// thread; a batched decode step's rows (one a sequence) are split, one to a work item.
const PARALLEL_FROM_ROWS: usize = 2;
/// Rows per work item in a prefill.
const ROWS_PER_ITEM: usize = 4;

/// `act(gate) · up` for `gate` and `up` `[1, t, f]` f32 on the CPU, each with its last
/// dimension contiguous (the halves of a `[1, t, 2f]` matmul output qualify); other tensors go
/// through candle's ops.
pub fn gated(act: Gate, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (b, t, f) = gate.dims3()?;
    let fallback = || -> Result<Tensor> {
        Ok(match act {
            Gate::GeluTanh => (gate.gelu()? * up)?,
            Gate::Silu => (gate.silu()? * up)?,
            Gate::SwigluOai => {
                let x = gate.minimum(OAI_LIMIT as f64)?;
                let y = (up.clamp(-OAI_LIMIT, OAI_LIMIT)? + 1.0)?;
                ((&x * candle_nn::ops::sigmoid(&(&x * OAI_ALPHA as f64)?)?)? * y)?
            }
        })
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
    let per_item = if t < 4 * ROWS_PER_ITEM {
        1
    } else {
        ROWS_PER_ITEM
    };
    for_each_row(&mut out, f, per_item, PARALLEL_FROM_ROWS * f, |r, o| {
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
    fn swiglu_oai_clamps_the_gate_above_and_the_up_both_ways() {
        let glu = |x: f32| x / (1.0 + (-1.702 * x).exp());
        assert_eq!(swiglu_oai(1.0, 2.0), glu(1.0) * 3.0);
        assert_eq!(swiglu_oai(9.0, 2.0), glu(7.0) * 3.0);
        assert_eq!(swiglu_oai(1.0, -9.0), glu(1.0) * -6.0);
        assert_eq!(swiglu_oai(-3.0, 9.0), glu(-3.0) * 8.0);
    }

    #[test]
    fn the_first_path_of_expf_is_its_bits_up_to_the_normal_limit() {
        for i in -8_700_000..=8_700_000 {
            let x = i as f32 * 1e-5;
            assert_eq!(expf_ggml_normal(x).to_bits(), expf_ggml(x).to_bits(), "{x}");
        }
        for x in [NORMAL_LIMIT, -NORMAL_LIMIT] {
            assert_eq!(expf_ggml_normal(x).to_bits(), expf_ggml(x).to_bits(), "{x}");
        }
    }

    #[test]
    fn a_silu_row_gives_silus_bits_whether_or_not_it_holds_a_value_past_the_limit() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
        let up: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos()).collect();
        for wild in [
            None,
            Some(100.0),
            Some(-100.0),
            Some(f32::NAN),
            Some(f32::INFINITY),
        ] {
            let mut g = gate.clone();
            if let Some(w) = wild {
                g[500] = w;
            }
            let mut out = vec![0f32; 1000];
            row(Gate::Silu, &g, &up, &mut out);
            for ((o, &g), &u) in out.iter().zip(&g).zip(&up) {
                let want = silu(g) * u;
                assert!(
                    o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                    "{g}"
                );
            }
        }
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

    /// llama.cpp's `ggml_v_expf` for AVX2 (ggml-cpu/vec.h of the llama-cpp-python 0.3.36 sdist),
    /// transcribed intrinsic for intrinsic.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn ggml_v_expf(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let f = |b: u32| _mm256_set1_ps(f32::from_bits(b));
        let r = f(0x4b40_0000);
        let z = _mm256_fmadd_ps(x, f(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, f(0x35bf_be8e), _mm256_fnmadd_ps(n, f(0x3f31_7200), x));
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(
            e,
            _mm256_castps_si256(_mm256_set1_ps(1.0)),
        ));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let c = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0)));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(f(0x3c07_2010), b, f(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(f(0x3e2a_af33), b, f(0x3eff_fedb)),
            ),
            u,
            _mm256_mul_ps(f(0x3f7f_fff6), b),
        );
        if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let le = _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps());
        let g = _mm256_and_si256(
            _mm256_castps_si256(le),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0)));
        let (c, d) = (_mm256_castsi256_ps(c), _mm256_castsi256_ps(d));
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn silu_is_llama_cpps_avx2_silu_bit_for_bit() {
        use std::arch::x86_64::*;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        // Small steps around 0, then the whole range out to where e^(−v) overflows, in lanes of
        // eight: some vectors mix lanes of |n| ≤ 126 with larger ones (llama.cpp's slow branch).
        let mut vs: Vec<f32> = (-400_000..400_000).map(|i| i as f32 * 2.5e-4).collect();
        vs.extend((-2_000..2_000).map(|i| i as f32 * 0.1)); // ±200
        vs.extend([
            f32::MAX,
            -f32::MAX,
            1e-30,
            -1e-30,
            0.0,
            -0.0,
            88.5,
            -88.5,
            150.0,
            -150.0,
        ]);
        vs.resize(vs.len().next_multiple_of(8), 1.0);
        for v in vs.chunks_exact(8) {
            // SAFETY: AVX2 and FMA are present (checked above).
            let want: [f32; 8] = unsafe {
                let x = _mm256_loadu_ps(v.as_ptr());
                let neg = _mm256_sub_ps(_mm256_setzero_ps(), x);
                let one_plus = _mm256_add_ps(_mm256_set1_ps(1.0), ggml_v_expf(neg));
                std::mem::transmute(_mm256_div_ps(x, one_plus))
            };
            for (&x, w) in v.iter().zip(want) {
                assert_eq!(
                    silu(x).to_bits(),
                    w.to_bits(),
                    "silu({x}) = {} against {w}",
                    silu(x)
                );
            }
        }
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
