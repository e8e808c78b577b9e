//! Activation formats: each f32 input row quantized once per matmul (Q8_0, Q8_1, Q8_K), as
//! llama.cpp's `quantize_row_q8_*` do, and the rows of a prefill split over candle's pool.

use super::*;
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Q8_0 activations: `{d, qs: [i8; 32]}`, x ≈ d·q. `d` is llama.cpp's f16 scale, kept widened
/// to f32 (the same value), so that no kernel converts it again per weight row.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; 32],
}

/// Q8_1 activations: Q8_0 plus `s = d·Σq` (for the min term of Q4_1/Q5_1).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

/// Q8_K activations: `{d: f32, qs: [i8; 256], bsums: [i16; 16]}` (sums of each 16 values).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

/// The scale of llama.cpp's `quantize_row_q8_0`: d = max|x| / 127, and the multiplier 127 / max|x|
/// (computed as llama.cpp computes it; 1 / d differs from it in the last bit at times, and on
/// SmolLM2, where one flipped activation quant moves a logit by percents, such bits move a
/// perplexity by ±0.2 %).
/// A block holding a NaN gets a NaN scale, so that the NaN reaches the output: `max` passes
/// over NaNs and [`round_i8`] makes them 0, and a damaged weight upstream would otherwise vanish
/// into a silently wrong answer.
///
/// max|x| is taken in eight lanes and then across them, so that the loop vectorizes (a fold
/// through one accumulator ran serially, ~4 cycles a value: 6 % of a batched decode step's
/// serial time); a maximum is exact, so any order gives the same value. (Not through
/// [`largest_magnitude`]: keeping each lane's place, which this scale does not need, made
/// SmolLM2's decode 4–6 % slower.)
pub(super) fn q8_scale(x: &[f32]) -> (f32, f32) {
    let mut lanes = [0f32; 8];
    let mut nan = [false; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] = lanes[i].max(c[i].abs());
            nan[i] |= c[i].is_nan();
        }
    }
    let amax = lanes.iter().chain(tail).fold(0f32, |a, v| a.max(v.abs()));
    if nan.contains(&true) || tail.iter().any(|v| v.is_nan()) {
        return (f32::NAN, 0.0);
    }
    let d = amax / 127.0;
    (d, if amax != 0.0 { 127.0 / amax } else { 0.0 })
}

/// 32 inputs as i8 quants (llama.cpp's AVX2 `quantize_row_q8_0`/`_q8_1`): the scale d of
/// [`q8_scale`], then each x·(127/max) rounded, ties to even (`_mm256_round_ps`), and clamped to
/// ±127 (a no-op but for blocks so tiny that 127/max is infinite, where 0·∞ gives NaN and so 0;
/// the SIMD kernels' sign trick holds for |y| ≤ 127). Returns d.
pub(super) fn q8_row(x: &[f32], qs: &mut [i8; 32]) -> f32 {
    let (d, id) = q8_scale(x);
    for (q, v) in qs.iter_mut().zip(x) {
        *q = round_i8(v * id);
    }
    d
}

/// `v` rounded to the nearest integer, ties to even, clamped to ±127, NaN to 0 (its block's
/// scale is then NaN: `q8_scale`): what
/// `v.round_ties_even().clamp(-127.0, 127.0) as i8` gives, written so that a loop of it
/// vectorizes (the compiler leaves an `as` cast from float scalar, lane by lane). Adding
/// 1.5·2^23 rounds to an integer in the current (nearest-even) mode, and leaves it in the low
/// mantissa bits.
#[inline(always)]
pub(super) fn round_i8(v: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    let c = if v.is_nan() {
        0.0
    } else {
        v.clamp(-127.0, 127.0)
    };
    ((c + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits())) as i8
}

impl Act for BlockQ8_0 {
    const N: usize = 32;
    fn quantize(xs: &[f32], ys: &mut [Self]) {
        for (x, y) in xs.chunks_exact(32).zip(ys) {
            y.d = f16::from_f32(q8_row(x, &mut y.qs)).to_f32();
        }
    }
}

impl Act for BlockQ8_1 {
    const N: usize = 32;
    /// llama.cpp's AVX2 `quantize_row_q8_1`, value for value: Q8_0's quants, and s = d·Σq
    /// rounded once to f16 (d unrounded).
    fn quantize(xs: &[f32], ys: &mut [Self]) {
        for (x, y) in xs.chunks_exact(32).zip(ys) {
            let d = q8_row(x, &mut y.qs);
            let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
            y.d = f16::from_f32(d).to_f32();
            y.s = f16::from_f32(d * sum as f32).to_f32();
        }
    }
}

impl Act for BlockQ8K {
    const N: usize = 256;
    /// llama.cpp's `quantize_row_q8_K_ref`: scale from the value of largest magnitude, sign kept.
    fn quantize(xs: &[f32], ys: &mut [Self]) {
        for (x, y) in xs.chunks_exact(256).zip(ys) {
            // A NaN input: a NaN scale carries it to the output (as `q8_scale` does).
            let Some((max, amax)) = largest_magnitude(x) else {
                *y = Zeroable::zeroed();
                y.d = f32::NAN;
                continue;
            };
            if amax == 0.0 {
                *y = Zeroable::zeroed();
                continue;
            }
            let iscale = -127.0 / max;
            for (q, v) in y.qs.iter_mut().zip(x) {
                // Ties to even, as llama.cpp's `nearest_int`.
                *q = round_i8(iscale * v);
            }
            for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
                *s = q.iter().map(|&v| v as i16).sum();
            }
            y.d = 1.0 / iscale;
        }
    }
}

/// The first value of largest magnitude and that magnitude, as one pass of
/// `if |v| > amax { amax = |v|; max = v }` finds them (0, 0 for an empty or all-zero slice);
/// None where a value is NaN. Taken in eight lanes, each keeping its first largest and where it
/// was, then across them the largest with the earliest place: the same value, in a loop that
/// vectorizes (the one-accumulator pass ran serially, ~4 cycles a value).
pub(super) fn largest_magnitude(x: &[f32]) -> Option<(f32, f32)> {
    let mut amax = [0f32; 8];
    let mut at = [usize::MAX; 8];
    let mut nan = [false; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for (c, v) in chunks.enumerate() {
        for i in 0..8 {
            let a = v[i].abs();
            let larger = a > amax[i];
            amax[i] = if larger { a } else { amax[i] };
            at[i] = if larger { 8 * c + i } else { at[i] };
            nan[i] |= v[i].is_nan();
        }
    }
    if nan.contains(&true) || tail.iter().any(|v| v.is_nan()) {
        return None;
    }
    let (mut best, mut best_at) = (0f32, usize::MAX);
    for i in 0..8 {
        if amax[i] > best || (amax[i] == best && at[i] < best_at) {
            (best, best_at) = (amax[i], at[i]);
        }
    }
    let head = x.len() - tail.len();
    for (j, v) in tail.iter().enumerate() {
        if v.abs() > best {
            (best, best_at) = (v.abs(), head + j);
        }
    }
    Some(if best > 0.0 {
        (x[best_at], best)
    } else {
        (0.0, 0.0)
    })
}

/// Activation rows below which one thread quantizes them all (a decode's one).
pub(super) const QUANTIZE_SPLIT_FROM: usize = 8;

/// `xs [m, k]` as activation rows `[m, kb]` by `quantize`, a prefill's rows split over candle's
/// pool (each row's values are its own, whichever thread makes them).
pub(super) fn activations<A: Pod + Send + Sync>(
    xs: &[f32],
    m: usize,
    kb: usize,
    quantize: fn(&[f32], &mut [A]),
) -> Vec<A> {
    if m == 0 {
        return Vec::new();
    }
    let k = xs.len() / m;
    let mut q = vec![A::zeroed(); m * kb];
    // Serial below QUANTIZE_SPLIT_FROM rows: one row per work item.
    crate::model::kernels::disjoint::for_each_row(
        &mut q,
        kb,
        1,
        QUANTIZE_SPLIT_FROM * kb,
        |t, o| quantize(&xs[t * k..(t + 1) * k], o),
    );
    q
}
