//! The float weight types F32 and F16 through the same driver as the quantized ones
//! ([`RowFormat`]): the weights stay as the GGUF stores them (an F16 matrix is not widened to a
//! second, f32 copy, as candle's QMatMul widens it). F32 weights take the f32 inputs themselves;
//! F16 weights take them rounded to F16 once per matmul (to nearest, ties to even), as llama.cpp
//! pairs them (its `vec_dot_type` for F16): a 4 × 4 prefill tile's rows and tokens, 2,048 columns
//! each, then fit L1 together (32 KiB, where f32 inputs made it 48 and the tile ran from L2:
//! prefill 512 on the 1B shape 69–71 → 78 tok/s on an Intel Xeon). BF16 has its own file
//! ([`super::bf16`]): it rounds its inputs to BF16, as llama.cpp does, for AVX-512 BF16's dot
//! product.
//!
//! **The summation order** (every path): element `i` of a row goes to accumulator `i % 16` by a
//! fused multiply-add; the 16 accumulators are then folded, `a[l] + a[l + 8]`, and the 8 left added
//! as [`super::hsum`] adds them. AVX2 holds the 16 accumulators in two registers and converts 16
//! weights per step (F16C for F16); its four-rows-by-four-tokens prefill kernel,
//! which would need 32 registers of accumulators, walks each block of columns once per half of
//! them and pair of rows instead. The tail of a row that is not a multiple of 16 long, and the
//! fold, run as in the scalar reference [`dot_ref`].

use super::WeightType;
use super::{fold16 as fold, Level, RowFormat};
use half::f16;

/// Accumulators per row (two AVX2 registers).
const L: usize = 16;

/// A float weight: its value as f32 (exact for all three types).
pub trait Float: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: WeightType;
    fn value(self) -> f32;
    /// The nearest weight to `v`.
    fn from_f32(v: f32) -> Self;
    /// Each of `xs` as its nearest value, into `ys`: a matmul's inputs, which are of the
    /// weights' own type (F32's the f32 inputs, F16's rounded to F16, llama.cpp's `vec_dot_type`).
    fn from_f32_slice(xs: &[f32], ys: &mut [Self]);
}

impl Float for f32 {
    const DTYPE: WeightType = WeightType::F32;
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn from_f32_slice(xs: &[f32], ys: &mut [Self]) {
        ys.copy_from_slice(xs);
    }
}

impl Float for f16 {
    const DTYPE: WeightType = WeightType::F16;
    #[inline(always)]
    fn value(self) -> f32 {
        self.to_f32()
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn from_f32_slice(xs: &[f32], ys: &mut [Self]) {
        // F16C where the CPU has it (`half` checks at run time); the same rounding, to nearest.
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(ys, xs);
    }
}

/// Elements `from..` of a row added into the accumulators (the scalar order).
#[inline(always)]
fn accumulate<W: Float>(acc: &mut [f32; L], xs: &[W], ys: &[W], from: usize) {
    for (i, (&w, &y)) in xs.iter().zip(ys).enumerate().skip(from) {
        acc[i % L] = w.value().mul_add(y.value(), acc[i % L]);
    }
}

/// The portable dot product of one weight row with one input row: the reference every SIMD path
/// is tested against, bit for bit.
pub fn dot_ref<W: Float>(xs: &[W], ys: &[W]) -> f32 {
    let mut acc = [0f32; L];
    accumulate(&mut acc, xs, ys, 0);
    fold(acc)
}

/// A matrix of float weights of type `W` (F32 or F16 as GGUF stores them).
pub struct Floats<W>(std::marker::PhantomData<W>);

impl<W: Float + Simd> RowFormat for Floats<W> {
    type Block = W;
    type Act = W;
    const N: usize = 1;
    const DTYPE: WeightType = W::DTYPE;
    fn quantize(xs: &[f32], ys: &mut [W]) {
        W::from_f32_slice(xs, ys);
    }
    fn dequantize(x: &W, out: &mut [f32]) {
        out[0] = x.value();
    }
    #[inline]
    fn dot(level: Level, xs: &[W], ys: &[W]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Vnni {
            // SAFETY: the CPU runs AVX-512 (`level()`, checked at run time).
            return unsafe { avx2::dot512(xs, ys) };
        }
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Avx2 {
            // SAFETY: the CPU runs AVX2, FMA and F16C (`level()`, checked at run time).
            return unsafe { avx2::dot(xs, ys) };
        }
        let _ = level;
        dot_ref(xs, ys)
    }
    #[inline]
    fn dot_x4(level: Level, xs: &[W], ys: [&[W]; 4]) -> [f32; 4] {
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Vnni {
            // SAFETY: as in `dot`.
            return unsafe { avx2::dot512_x4(xs, ys) };
        }
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Avx2 {
            // SAFETY: as in `dot`.
            return unsafe { avx2::dot_x4(xs, ys) };
        }
        let _ = level;
        ys.map(|y| dot_ref(xs, y))
    }
    #[inline]
    fn dot_rows4(level: Level, xs: [&[W]; 4], y: &[W]) -> [f32; 4] {
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Vnni {
            // SAFETY: as in `dot`.
            return unsafe { avx2::dot512_rows4(xs, y) };
        }
        xs.map(|x| Self::dot(level, x, y))
    }
    #[inline]
    fn dot_4x4(level: Level, xs: [&[W]; 4], ys: [&[W]; 4]) -> [[f32; 4]; 4] {
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Vnni {
            // SAFETY: as in `dot`.
            return unsafe { avx2::dot512_4x4(xs, ys) };
        }
        #[cfg(target_arch = "x86_64")]
        if level.min(super::level()) >= Level::Avx2 {
            // SAFETY: as in `dot`.
            return unsafe { avx2::dot_4x4(xs, ys) };
        }
        xs.map(|x| Self::dot_x4(level, x, ys))
    }
}

/// How AVX2 widens 8 weights of a float type to f32.
#[cfg(target_arch = "x86_64")]
pub trait Simd: Float {
    /// Weights `xs[0..8]` as f32 lanes.
    ///
    /// # Safety
    /// The CPU runs AVX2 and F16C (the contract of [`super::Avx2`]); `xs` holds 8 values.
    unsafe fn load8(xs: &[Self]) -> std::arch::x86_64::__m256;
    /// Weights `xs[0..16]` as f32 lanes.
    ///
    /// # Safety
    /// The CPU runs AVX-512F (level `Vnni`); `xs` holds 16 values.
    unsafe fn load16(xs: &[Self]) -> std::arch::x86_64::__m512;
}

#[cfg(not(target_arch = "x86_64"))]
pub trait Simd: Float {}

#[cfg(not(target_arch = "x86_64"))]
impl<W: Float> Simd for W {}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2::{hsum16_ps, hsum_ps};
    use super::super::shortest;
    use super::{accumulate, fold, Simd, L};
    use half::f16;
    use std::arch::x86_64::*;

    impl Simd for f32 {
        #[inline(always)]
        unsafe fn load8(xs: &[f32]) -> __m256 {
            assert!(xs.len() >= 8);
            _mm256_loadu_ps(xs.as_ptr())
        }
        #[inline(always)]
        unsafe fn load16(xs: &[f32]) -> __m512 {
            assert!(xs.len() >= 16);
            _mm512_loadu_ps(xs.as_ptr())
        }
    }

    impl Simd for f16 {
        #[inline(always)]
        unsafe fn load8(xs: &[f16]) -> __m256 {
            assert!(xs.len() >= 8);
            _mm256_cvtph_ps(_mm_loadu_si128(xs.as_ptr() as *const __m128i))
        }
        #[inline(always)]
        unsafe fn load16(xs: &[f16]) -> __m512 {
            assert!(xs.len() >= 16);
            _mm512_cvtph_ps(_mm256_loadu_si256(xs.as_ptr() as *const __m256i))
        }
    }

    /// The two registers' accumulators as the scalar order's 16.
    #[inline(always)]
    unsafe fn spill(a0: __m256, a1: __m256) -> [f32; L] {
        let mut acc = [0f32; L];
        _mm256_storeu_ps(acc.as_mut_ptr(), a0);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot<W: Simd>(xs: &[W], ys: &[W]) -> f32 {
        let n = xs.len().min(ys.len());
        let body = n - n % L;
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (x, y) in xs[..body].chunks_exact(L).zip(ys[..body].chunks_exact(L)) {
            a0 = _mm256_fmadd_ps(W::load8(&x[..8]), W::load8(&y[..8]), a0);
            a1 = _mm256_fmadd_ps(W::load8(&x[8..]), W::load8(&y[8..]), a1);
        }
        let mut acc = spill(a0, a1);
        accumulate(&mut acc, &xs[..n], &ys[..n], body);
        fold(acc)
    }

    /// The 16 accumulators of one AVX-512 register, in the scalar order's places (lane l holds
    /// the elements i ≡ l mod 16).
    #[inline(always)]
    unsafe fn spill512(a: __m512) -> [f32; L] {
        let mut acc = [0f32; L];
        _mm512_storeu_ps(acc.as_mut_ptr(), a);
        acc
    }

    /// [`dot`] with one AVX-512 register holding the 16 accumulators (the same operations on
    /// each, in the same order).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot512<W: Simd>(xs: &[W], ys: &[W]) -> f32 {
        let n = xs.len().min(ys.len());
        let body = n - n % L;
        let mut a = _mm512_setzero_ps();
        for (x, y) in xs[..body].chunks_exact(L).zip(ys[..body].chunks_exact(L)) {
            a = _mm512_fmadd_ps(W::load16(x), W::load16(y), a);
        }
        let mut acc = spill512(a);
        accumulate(&mut acc, &xs[..n], &ys[..n], body);
        fold(acc)
    }

    /// [`dot_x4`] with AVX-512: each 16 weights widened once, one register per token.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot512_x4<W: Simd>(xs: &[W], ys: [&[W]; 4]) -> [f32; 4] {
        let n = ys.iter().fold(xs.len(), |n, y| n.min(y.len()));
        let body = n - n % L;
        let mut a = [_mm512_setzero_ps(); 4];
        for (c, x) in xs[..body].chunks_exact(L).enumerate() {
            let w = W::load16(x);
            for (a, y) in a.iter_mut().zip(&ys) {
                *a = _mm512_fmadd_ps(w, W::load16(&y[L * c..]), *a);
            }
        }
        std::array::from_fn(|t| {
            let mut acc = spill512(a[t]);
            accumulate(&mut acc, xs, ys[t], body);
            fold(acc)
        })
    }

    /// Four rows with one token (decode): four chains of multiply-adds in flight where
    /// [`dot512`]'s one waits on each add, each 16 activations widened once for the four rows.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot512_rows4<W: Simd>(xs: [&[W]; 4], y: &[W]) -> [f32; 4] {
        let n = shortest(xs, [y]);
        let body = n - n % L;
        let mut a = [_mm512_setzero_ps(); 4];
        for c in (0..body).step_by(L) {
            let y = W::load16(&y[c..c + L]);
            for (a, x) in a.iter_mut().zip(&xs) {
                *a = _mm512_fmadd_ps(W::load16(&x[c..c + L]), y, *a);
            }
        }
        if body == n {
            // No tail: folded in registers, as in `dot512_4x4`.
            return a.map(|a| hsum16_ps(a));
        }
        std::array::from_fn(|i| {
            let mut acc = spill512(a[i]);
            accumulate(&mut acc, &xs[i][..n], &y[..n], body);
            fold(acc)
        })
    }

    /// Four rows with four tokens: 16 registers of accumulators, each 16 weights widened once
    /// and each 16 activations loaded once per step (4 + 4 loads for 16 fused multiply-adds).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot512_4x4<W: Simd>(xs: [&[W]; 4], ys: [&[W]; 4]) -> [[f32; 4]; 4] {
        let n = shortest(xs, ys);
        let body = n - n % L;
        let mut a = [[_mm512_setzero_ps(); 4]; 4];
        for c in (0..body).step_by(L) {
            let y = ys.map(|y| W::load16(&y[c..c + L]));
            for (a, x) in a.iter_mut().zip(&xs) {
                let w = W::load16(&x[c..c + L]);
                for (a, y) in a.iter_mut().zip(&y) {
                    *a = _mm512_fmadd_ps(w, *y, *a);
                }
            }
        }
        if body == n {
            // No tail (every real model's rows): folded in registers, where a closure that read
            // `a` kept the accumulators stored to memory at every step (as in `super::super::bf16`).
            let mut sums = [[0f32; 4]; 4];
            for (s, a) in sums.iter_mut().zip(&a) {
                for (s, a) in s.iter_mut().zip(a) {
                    *s = hsum16_ps(*a);
                }
            }
            return sums;
        }
        let mut spilled = [[[0f32; L]; 4]; 4];
        for (s, a) in spilled.iter_mut().zip(&a) {
            for (s, a) in s.iter_mut().zip(a) {
                *s = spill512(*a);
            }
        }
        finish_4x4(|i, t| spilled[i][t], xs, ys, n)
    }

    /// A 4×4 kernel's sums: each pair's 16 accumulators (`acc(row, token)`, holding the first
    /// `n − n % 16` elements), the tail added and the accumulators folded as [`super::dot_ref`] does.
    fn finish_4x4<W: Simd>(
        acc: impl Fn(usize, usize) -> [f32; L],
        xs: [&[W]; 4],
        ys: [&[W]; 4],
        n: usize,
    ) -> [[f32; 4]; 4] {
        std::array::from_fn(|i| {
            std::array::from_fn(|t| {
                let mut a = acc(i, t);
                accumulate(&mut a, &xs[i][..n], &ys[t][..n], n - n % L);
                fold(a)
            })
        })
    }

    /// Columns per block of [`dot_4x4`]: four tokens' activations (8 KiB of f32) and four rows'
    /// weights stay in L1 across the block's four passes.
    const KC: usize = 512;

    /// Four rows with four tokens on AVX2's 16 registers, where the 16 accumulators of each of
    /// the 16 (row, token) pairs take 32: each block of [`KC`] columns is walked four times, once
    /// per half of the accumulators (lanes 0–7, then 8–15) and pair of rows, with 8 accumulators
    /// in registers, 2 + 4 loads for 8 fused multiply-adds. Each accumulator still takes its
    /// elements in increasing order, so the sums are [`super::dot_ref`]'s.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_4x4<W: Simd>(xs: [&[W]; 4], ys: [&[W]; 4]) -> [[f32; 4]; 4] {
        let n = shortest(xs, ys);
        let body = n - n % L;
        // acc[half][pair][row of the pair][token]: lanes 8·half..8·half + 8 of the 16.
        let mut acc = [[[[_mm256_setzero_ps(); 4]; 2]; 2]; 2];
        let mut c0 = 0;
        while c0 < body {
            let steps = (body - c0).min(KC) / L;
            for (h, acc) in acc.iter_mut().enumerate() {
                for (p, acc) in acc.iter_mut().enumerate() {
                    let at = c0 + 8 * h;
                    let x = [xs[2 * p][at..].as_ptr(), xs[2 * p + 1][at..].as_ptr()];
                    let y = [
                        ys[0][at..].as_ptr(),
                        ys[1][at..].as_ptr(),
                        ys[2][at..].as_ptr(),
                        ys[3][at..].as_ptr(),
                    ];
                    // SAFETY: the last element read is `at + 16·(steps − 1) + 7 = c0 + 8·h +
                    // 16·steps − 9 < c0 + 16·steps ≤ body ≤ n`, inside every row and token.
                    pass(acc, x, y, steps);
                }
            }
            c0 += steps * L;
        }
        if body == n {
            // No tail: folded in registers, as in `dot512_4x4`.
            let mut sums = [[0f32; 4]; 4];
            for (i, s) in sums.iter_mut().enumerate() {
                for (t, s) in s.iter_mut().enumerate() {
                    let (lo, hi) = (acc[0][i / 2][i % 2][t], acc[1][i / 2][i % 2][t]);
                    *s = hsum_ps(_mm256_add_ps(lo, hi));
                }
            }
            return sums;
        }
        let pair = |i: usize, t: usize| spill(acc[0][i / 2][i % 2][t], acc[1][i / 2][i % 2][t]);
        finish_4x4(pair, xs, ys, n)
    }

    /// One pass of [`dot_4x4`]: two rows' 8 weights at `x[i] + 16·s` and four tokens' 8
    /// activations at `y[t] + 16·s` for `s < steps`, into `acc[i][t]`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C run; every pointer has `16·(steps − 1) + 8` elements after it.
    #[inline(always)]
    unsafe fn pass<W: Simd>(
        acc: &mut [[__m256; 4]; 2],
        x: [*const W; 2],
        y: [*const W; 4],
        steps: usize,
    ) {
        let [[mut a0, mut a1, mut a2, mut a3], [mut b0, mut b1, mut b2, mut b3]] = *acc;
        for s in 0..steps {
            let o = s * L;
            let w0 = W::load8(std::slice::from_raw_parts(x[0].add(o), 8));
            let w1 = W::load8(std::slice::from_raw_parts(x[1].add(o), 8));
            let y0 = W::load8(std::slice::from_raw_parts(y[0].add(o), 8));
            a0 = _mm256_fmadd_ps(w0, y0, a0);
            b0 = _mm256_fmadd_ps(w1, y0, b0);
            let y1 = W::load8(std::slice::from_raw_parts(y[1].add(o), 8));
            a1 = _mm256_fmadd_ps(w0, y1, a1);
            b1 = _mm256_fmadd_ps(w1, y1, b1);
            let y2 = W::load8(std::slice::from_raw_parts(y[2].add(o), 8));
            a2 = _mm256_fmadd_ps(w0, y2, a2);
            b2 = _mm256_fmadd_ps(w1, y2, b2);
            let y3 = W::load8(std::slice::from_raw_parts(y[3].add(o), 8));
            a3 = _mm256_fmadd_ps(w0, y3, a3);
            b3 = _mm256_fmadd_ps(w1, y3, b3);
        }
        *acc = [[a0, a1, a2, a3], [b0, b1, b2, b3]];
    }

    /// Four tokens at once: each 16 weights widened once, 8 accumulators in registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_x4<W: Simd>(xs: &[W], ys: [&[W]; 4]) -> [f32; 4] {
        let n = ys.iter().fold(xs.len(), |n, y| n.min(y.len()));
        let body = n - n % L;
        let z = _mm256_setzero_ps();
        let (mut a0, mut b0, mut a1, mut b1) = (z, z, z, z);
        let (mut a2, mut b2, mut a3, mut b3) = (z, z, z, z);
        let [c0, c1, c2, c3] = ys.map(|y| y[..body].chunks_exact(L));
        let steps = xs[..body].chunks_exact(L).zip(c0).zip(c1);
        for (((x, y0), y1), (y2, y3)) in steps.zip(c2.zip(c3)) {
            let (w0, w1) = (W::load8(&x[..8]), W::load8(&x[8..]));
            let lo = |y: &[W]| W::load8(&y[..8]);
            let hi = |y: &[W]| W::load8(&y[8..16]);
            a0 = _mm256_fmadd_ps(w0, lo(y0), a0);
            b0 = _mm256_fmadd_ps(w1, hi(y0), b0);
            a1 = _mm256_fmadd_ps(w0, lo(y1), a1);
            b1 = _mm256_fmadd_ps(w1, hi(y1), b1);
            a2 = _mm256_fmadd_ps(w0, lo(y2), a2);
            b2 = _mm256_fmadd_ps(w1, hi(y2), b2);
            a3 = _mm256_fmadd_ps(w0, lo(y3), a3);
            b3 = _mm256_fmadd_ps(w1, hi(y3), b3);
        }
        let acc = [spill(a0, b0), spill(a1, b1), spill(a2, b2), spill(a3, b3)];
        std::array::from_fn(|t| {
            let mut acc = acc[t];
            accumulate(&mut acc, xs, ys[t], body);
            fold(acc)
        })
    }
}
