//! CPU matrix kernels for GGUF quantized weights: one driver, one dot product per block format.
//!
//! As in llama.cpp's ggml-cpu, each weight format pairs with an activation format (`Act`): the f32
//! input rows are quantized once per matmul (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for
//! the K-quants), and a row of the output is a sum of block dot products. A format states (trait
//! [`Format`]) its block layout, how to dequantize a block, and per block the exact integer dot
//! product in 8 lanes with the float scale it is multiplied by; [`dot_scalar`] sums those the one
//! way every path sums them, and the AVX2 paths (module `avx2` of each format file, and the driver's
//! [`avx2`]) reproduce that sum bit for bit (tested, per format).
//!
//! **The summation order** (the same for every format and path): lane `l` of a block holds the
//! integer sum over its elements `i` with `(i % 32) / 4 == l` — what AVX2's maddubs+madd leave in
//! lane `l` — of `w_i · y_i` (w_i the integer weight, times its sub-block scale for K-quants). Each
//! lane is converted to f32 and fused-multiply-added with the block's scale into its own
//! accumulator; a format with a min term (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) adds it to a separate f32 sum;
//! at the end the 8 lanes are added pairwise, ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then the min
//! sum. Decode (one token) and prefill (four tokens per unpacked block) sum identically, so a
//! prefill, a decode and a `--no-cache` recompute agree to the bit.
//!
//! Where AVX2 runs and a matrix's rows come in 16s (every real model's), its blocks are
//! interleaved at load into 16-row tiles ([`tiled`]: one VNNI `dpbusd`, or AVX2's
//! `maddubs`+`madd`, serves 8 or 16 rows; one FMA a block of 8 or 16 rows) with their own, simpler
//! summation order (one accumulator per row; the reference is [`dot_rows_scalar`]); elsewhere
//! (rows not in 16s, or a type with no tiles: Q2_K, Q3_K) the per-row layout and the 8-lane
//! order above run. The float types (F32, F16, BF16: [`floats`]) run per row with their own order.
//!
//! Work is split over candle's own barrier pool (as candle splits its matmuls: no second thread
//! pool competing with its spinning workers; packing tiles at load uses scoped threads). Weights
//! this driver runs are kept once (the GGUF blocks, or the tiles that replace them); stacked
//! matrices (q/k/v, gate/up) share one store.

pub(crate) mod floats;
mod kquants;
mod legacy;
mod tiled;

use super::disjoint::DisjointOut;
use anyhow::{bail, Context, Result};
use bytemuck::{Pod, Zeroable};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use std::sync::Arc;

pub use floats::{dot_ref, Floats};
pub use kquants::{Q2K, Q3K, Q4K, Q5K, Q6K};
pub use legacy::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use tiled::TileStore;
pub use tiled::{dot_rows_scalar, Tiled, TiledMatrix};

/// An activation block format: how an f32 input row is quantized before the dot products.
pub trait Act: Pod + Send + Sync {
    /// Values per block.
    const N: usize;
    fn quantize(xs: &[f32], ys: &mut [Self]);
}

/// A weight block format. `Block` is the GGUF block, byte for byte.
pub trait Format: Send + Sync + 'static {
    type Block: Pod + Send + Sync;
    type Act: Act;
    /// Values per block (32, or 256 for the K-quants); `Act::N` is the same.
    const N: usize;
    const DTYPE: GgmlDType;
    /// Whether the format has a min term (`min_term` is not zero).
    const HAS_MIN: bool;
    /// The block's `N` weights as f32 (GGUF's dequantization).
    fn dequantize(x: &Self::Block, out: &mut [f32]);
    /// The 8 integer lanes of the block's dot product with `y` (see the module's summation order).
    fn lanes(x: &Self::Block, y: &Self::Act) -> [i32; 8];
    /// The float factor of the block's lanes.
    fn scale(x: &Self::Block, y: &Self::Act) -> f32;
    /// The block's min term (0 where `HAS_MIN` is false).
    fn min_term(x: &Self::Block, y: &Self::Act) -> f32;
}

/// The 8 lane accumulators added in the fixed order every path uses.
#[inline(always)]
fn hsum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// The portable dot product of one weight row with one activation row: the reference every SIMD
/// path is tested against, bit for bit.
pub fn dot_scalar<F: Format>(xs: &[F::Block], ys: &[F::Act]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let lanes = F::lanes(x, y);
        let d = F::scale(x, y);
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = (l as f32).mul_add(d, *a);
        }
        if F::HAS_MIN {
            summ += F::min_term(x, y);
        }
    }
    hsum(acc) + summ
}

/// The lane of element `i` of a block (see the module's summation order).
#[inline(always)]
fn lane(i: usize) -> usize {
    (i % 32) / 4
}

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
fn q8_scale(x: &[f32]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    (d, if amax != 0.0 { 127.0 / amax } else { 0.0 })
}

/// 32 inputs as i8 quants (llama.cpp's AVX2 `quantize_row_q8_0`/`_q8_1`): the scale d of
/// [`q8_scale`], then each x·(127/max) rounded, ties to even (`_mm256_round_ps`), and clamped to
/// ±127 (a no-op but for blocks so tiny that 127/max is infinite, where 0·∞ gives NaN and so 0;
/// the SIMD kernels' sign trick holds for |y| ≤ 127). Returns d.
fn q8_row(x: &[f32], qs: &mut [i8; 32]) -> f32 {
    let (d, id) = q8_scale(x);
    for (q, v) in qs.iter_mut().zip(x) {
        *q = round_i8(v * id);
    }
    d
}

/// `v` rounded to the nearest integer, ties to even, clamped to ±127, NaN to 0: what
/// `v.round_ties_even().clamp(-127.0, 127.0) as i8` gives, written so that a loop of it
/// vectorizes (the compiler leaves an `as` cast from float scalar, lane by lane). Adding
/// 1.5·2^23 rounds to an integer in the current (nearest-even) mode, and leaves it in the low
/// mantissa bits.
#[inline(always)]
fn round_i8(v: f32) -> i8 {
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
            let (mut max, mut amax) = (0f32, 0f32);
            for &v in x {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
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

/// The instruction sets a kernel can use, best last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 (F, BW, VL) with VNNI, on top of AVX2.
    Vnni,
}

/// The best level this CPU runs, capped by `KVCHAT_SIMD=scalar|avx2|vnni` (for side-by-side
/// checks; the command line refuses other values, [`simd_cap`]); decided once per process.
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = simd_cap().ok().flatten().unwrap_or(Level::Vnni);
        cap.min(detected())
    })
}

/// The cap `KVCHAT_SIMD` sets, if any; an error names a value that is not a level.
pub fn simd_cap() -> anyhow::Result<Option<Level>> {
    match std::env::var("KVCHAT_SIMD") {
        Err(_) => Ok(None),
        Ok(v) => match v.as_str() {
            "scalar" => Ok(Some(Level::Scalar)),
            "avx2" => Ok(Some(Level::Avx2)),
            "vnni" => Ok(Some(Level::Vnni)),
            other => anyhow::bail!("KVCHAT_SIMD='{other}' is not scalar, avx2 or vnni"),
        },
    }
}

/// The best level of this CPU.
fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("fma") && has!("f16c")) {
            return Level::Scalar;
        }
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
            return Level::Vnni;
        }
        Level::Avx2
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Level::Scalar
    }
}

/// A format's SIMD kernels: the block unpacked into registers once, then its integer lanes with
/// any number of activation blocks (and its min term, from what was unpacked). `*512` are the
/// AVX-512 VNNI versions, giving the same lanes.
///
/// SAFETY contract (the one for every `unsafe fn` of this trait and of the `avx2` modules): call
/// the plain ones only when [`level`] is at least `Avx2`, the `*512` ones only when it is `Vnni`.
#[cfg(target_arch = "x86_64")]
pub trait Avx2: Format {
    type Unpacked: Copy;
    /// # Safety
    /// The trait's contract.
    unsafe fn unpack(x: &Self::Block) -> Self::Unpacked;
    /// # Safety
    /// The trait's contract.
    unsafe fn ilanes(u: &Self::Unpacked, y: &Self::Act) -> std::arch::x86_64::__m256i;
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn min_u(_u: &Self::Unpacked, x: &Self::Block, y: &Self::Act) -> f32 {
        Self::min_term(x, y)
    }
    type U512: Copy;
    /// # Safety
    /// The trait's contract.
    unsafe fn unpack512(x: &Self::Block) -> Self::U512;
    /// # Safety
    /// The trait's contract.
    unsafe fn ilanes512(u: &Self::U512, y: &Self::Act) -> std::arch::x86_64::__m256i;
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn min512(_u: &Self::U512, x: &Self::Block, y: &Self::Act) -> f32 {
        Self::min_term(x, y)
    }
}

/// Without x86-64 there is no SIMD path; every format runs `dot_scalar`.
#[cfg(not(target_arch = "x86_64"))]
pub trait Avx2: Format {}

/// The AVX2 drivers of one row's dot product, generic over the format (each format supplies only
/// `unpack` and `ilanes`). Summed in exactly [`dot_scalar`]'s order.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Avx2, Format};
    use std::arch::x86_64::*;

    /// The 8 f32 lanes added as [`super::hsum`] adds them.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum_ps(acc: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)); // a_i + a_i+4
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s)); // (0+4)+(2+6), (1+5)+(3+7)
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// One weight row with one activation row (decode), given a level's unpack, lanes and min.
    #[inline(always)]
    unsafe fn dot_body<F: Format, U>(
        xs: &[F::Block],
        ys: &[F::Act],
        unpack: impl Fn(&F::Block) -> U,
        ilanes: impl Fn(&U, &F::Act) -> __m256i,
        min: impl Fn(&U, &F::Block, &F::Act) -> f32,
    ) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summ = 0f32;
        for (x, y) in xs.iter().zip(ys) {
            let u = unpack(x);
            let p = ilanes(&u, y);
            let d = _mm256_set1_ps(F::scale(x, y));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc);
            if F::HAS_MIN {
                summ += min(&u, x, y);
            }
        }
        hsum_ps(acc) + summ
    }

    /// One weight row with four activation rows (prefill): each weight block unpacked once, each
    /// token's sum formed exactly as [`dot_body`] forms it.
    #[inline(always)]
    unsafe fn dot_x4_body<F: Format, U>(
        xs: &[F::Block],
        ys: [&[F::Act]; 4],
        unpack: impl Fn(&F::Block) -> U,
        ilanes: impl Fn(&U, &F::Act) -> __m256i,
        min: impl Fn(&U, &F::Block, &F::Act) -> f32,
    ) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summ = [0f32; 4];
        for (b, x) in xs.iter().enumerate() {
            let u = unpack(x);
            for i in 0..4 {
                let y = &ys[i][b];
                let p = ilanes(&u, y);
                let d = _mm256_set1_ps(F::scale(x, y));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[i]);
                if F::HAS_MIN {
                    summ[i] += min(&u, x, y);
                }
            }
        }
        [0, 1, 2, 3].map(|i| hsum_ps(acc[i]) + summ[i])
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot<F: Avx2>(xs: &[F::Block], ys: &[F::Act]) -> f32 {
        dot_body::<F, _>(
            xs,
            ys,
            |x| F::unpack(x),
            |u, y| F::ilanes(u, y),
            |u, x, y| F::min_u(u, x, y),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_x4<F: Avx2>(xs: &[F::Block], ys: [&[F::Act]; 4]) -> [f32; 4] {
        dot_x4_body::<F, _>(
            xs,
            ys,
            |x| F::unpack(x),
            |u, y| F::ilanes(u, y),
            |u, x, y| F::min_u(u, x, y),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot512<F: Avx2>(xs: &[F::Block], ys: &[F::Act]) -> f32 {
        dot_body::<F, _>(
            xs,
            ys,
            |x| F::unpack512(x),
            |u, y| F::ilanes512(u, y),
            |u, x, y| F::min512(u, x, y),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dot512_x4<F: Avx2>(xs: &[F::Block], ys: [&[F::Act]; 4]) -> [f32; 4] {
        dot_x4_body::<F, _>(
            xs,
            ys,
            |x| F::unpack512(x),
            |u, y| F::ilanes512(u, y),
            |u, x, y| F::min512(u, x, y),
        )
    }

    /// 64 bytes as a vector.
    #[inline(always)]
    pub(crate) fn load64<T: bytemuck::Pod>(a: &[T]) -> __m512i {
        let bytes: &[u8] = bytemuck::cast_slice(a);
        assert!(bytes.len() >= 64);
        // SAFETY: 64 readable bytes (checked above); unaligned load.
        unsafe { _mm512_loadu_si512(bytes.as_ptr() as *const __m512i) }
    }

    /// Two 256-bit halves as one 512-bit vector (`lo` in the low half).
    #[inline(always)]
    pub(crate) unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// The two 256-bit halves of 16 i32 lanes added: lane k = lane k + lane k+8.
    #[inline(always)]
    pub(crate) unsafe fn fold(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }

    /// Signed i8 × i8 dot products of 32 bytes into [8 x i32] with VNNI (sign trick as
    /// [`idot_i8`]).
    #[inline(always)]
    pub(crate) unsafe fn idot_i8_vnni(x: __m256i, y: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
    }

    /// Unsigned u8 × signed i8 dot products of 32 bytes into [8 x i32] with VNNI.
    #[inline(always)]
    pub(crate) unsafe fn idot_u8_vnni(x: __m256i, y: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), x, y)
    }

    /// A 32-byte array as a vector.
    #[inline(always)]
    pub(crate) fn load32<T: bytemuck::Pod>(a: &[T]) -> __m256i {
        let bytes: &[u8] = bytemuck::cast_slice(a);
        assert!(bytes.len() >= 32);
        // SAFETY: 32 readable bytes (checked above); unaligned load.
        unsafe { _mm256_loadu_si256(bytes.as_ptr() as *const __m256i) }
    }

    /// A 16-byte array as a vector.
    #[inline(always)]
    pub(crate) fn load16<T: bytemuck::Pod>(a: &[T]) -> __m128i {
        let bytes: &[u8] = bytemuck::cast_slice(a);
        assert!(bytes.len() >= 16);
        // SAFETY: 16 readable bytes (checked above); unaligned load.
        unsafe { _mm_loadu_si128(bytes.as_ptr() as *const __m128i) }
    }

    /// Signed i8 × i8 dot products of 32 bytes, pair-summed to [8 x i32] (llama.cpp's sign trick:
    /// |x| as u8 times y with x's sign, so maddubs can take them; exact for |x|, |y| ≤ 127).
    #[inline(always)]
    pub(crate) unsafe fn idot_i8(x: __m256i, y: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
    }

    /// Unsigned u8 × signed i8 dot products of 32 bytes, pair-summed to [8 x i32].
    #[inline(always)]
    pub(crate) unsafe fn idot_u8(x: __m256i, y: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
    }
}

/// A weight type as the per-row driver ([`Matrix`]) runs it: its blocks, the activation rows it
/// pairs with, and one row's dot product with one or four of them. Every quantized [`Format`]
/// is one (through [`dot`] and [`dot_x4`]); so are the float types ([`floats`]), whose
/// "activations" are the f32 inputs themselves.
pub trait RowFormat: Send + Sync + 'static {
    type Block: Pod + Send + Sync;
    type Act: Pod + Send + Sync;
    /// Values per block (1 for the float types).
    const N: usize;
    const DTYPE: GgmlDType;
    /// An f32 input row as activation blocks.
    fn quantize(xs: &[f32], ys: &mut [Self::Act]);
    /// The block's `N` weights as f32.
    fn dequantize(x: &Self::Block, out: &mut [f32]);
    /// One row with one activation row, at `level` (at most [`level()`]).
    fn dot(level: Level, xs: &[Self::Block], ys: &[Self::Act]) -> f32;
    /// One row with four activation rows, each summed exactly as [`RowFormat::dot`] sums it.
    fn dot_x4(level: Level, xs: &[Self::Block], ys: [&[Self::Act]; 4]) -> [f32; 4];
}

impl<F: Avx2> RowFormat for F {
    type Block = F::Block;
    type Act = F::Act;
    const N: usize = <F as Format>::N;
    const DTYPE: GgmlDType = <F as Format>::DTYPE;
    fn quantize(xs: &[f32], ys: &mut [F::Act]) {
        <F::Act as Act>::quantize(xs, ys)
    }
    fn dequantize(x: &F::Block, out: &mut [f32]) {
        <F as Format>::dequantize(x, out)
    }
    #[inline(always)]
    fn dot(level: Level, xs: &[F::Block], ys: &[F::Act]) -> f32 {
        dot::<F>(level, xs, ys)
    }
    #[inline(always)]
    fn dot_x4(level: Level, xs: &[F::Block], ys: [&[F::Act]; 4]) -> [f32; 4] {
        dot_x4::<F>(level, xs, ys)
    }
}

/// One row of `F` with one activation row, at `level` (at most [`level()`]).
#[inline]
fn dot<F: Avx2>(level: Level, xs: &[F::Block], ys: &[F::Act]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // Never above what this CPU runs (the SAFETY condition below).
        let level = level.min(self::level());
        match level {
            // SAFETY: the CPU has the level's instructions (`level()`, checked at run time).
            Level::Vnni => return unsafe { avx2::dot512::<F>(xs, ys) },
            Level::Avx2 => return unsafe { avx2::dot::<F>(xs, ys) },
            Level::Scalar => {}
        }
    }
    let _ = level;
    dot_scalar::<F>(xs, ys)
}

/// One row of `F` with four activation rows, at `level` (at most [`level()`]).
#[inline]
fn dot_x4<F: Avx2>(level: Level, xs: &[F::Block], ys: [&[F::Act]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        // Never above what this CPU runs (the SAFETY condition below).
        let level = level.min(self::level());
        match level {
            // SAFETY: the CPU has the level's instructions (`level()`, checked at run time).
            Level::Vnni => return unsafe { avx2::dot512_x4::<F>(xs, ys) },
            Level::Avx2 => return unsafe { avx2::dot_x4::<F>(xs, ys) },
            Level::Scalar => {}
        }
    }
    let _ = level;
    ys.map(|y| dot_scalar::<F>(xs, y))
}

/// Output rows per work item: enough to amortize the hand-off, small enough to balance two threads.
const ROWS_PER_ITEM: usize = 16;
/// Tokens per prefill work item: each weight block is unpacked once per four tokens and stays in
/// L1 across the tile.
pub(super) const TOKENS: usize = 16;

/// A weight matrix `[rows, cols]` of format `F`: rows `row0 .. row0 + rows` of a block store that
/// several matrices may share (see [`QMatrix::stack`]).
pub struct Matrix<F: RowFormat> {
    rows: usize,
    cols: usize,
    row0: usize,
    blocks: Arc<Vec<F::Block>>,
}

impl<F: RowFormat> Clone for Matrix<F> {
    fn clone(&self) -> Self {
        Self {
            rows: self.rows,
            cols: self.cols,
            row0: self.row0,
            blocks: self.blocks.clone(),
        }
    }
}

impl<F: RowFormat> Matrix<F> {
    /// The matrix of `[rows, cols]` GGUF blocks of this format read from `src`, straight into
    /// place (one copy; the pages are touched once).
    fn read_rows(rows: usize, cols: usize, src: &mut dyn std::io::Read) -> Result<Self> {
        check_cols(F::DTYPE, cols)?;
        let mut blocks: Vec<F::Block> = bytemuck::zeroed_vec(rows * cols / F::N);
        src.read_exact(bytemuck::cast_slice_mut(&mut blocks))?;
        Ok(Self {
            rows,
            cols,
            row0: 0,
            blocks: Arc::new(blocks),
        })
    }
}

impl<F: Avx2> Matrix<F> {
    /// The matrix as row-interleaved tiles (rows a multiple of 16), made from the GGUF blocks
    /// directly (no per-row copy in between).
    fn tiled_from(rows: usize, cols: usize, data: &[u8]) -> Result<TiledMatrix<F>>
    where
        F: Tiled,
    {
        with_blocks::<F, _>(rows, cols, data, TiledMatrix::from_blocks)?
    }
}

/// Refuses a matrix of `dtype` whose rows of `cols` values do not split into whole blocks.
fn check_cols(dtype: GgmlDType, cols: usize) -> Result<()> {
    let n = dtype.block_size();
    if !cols.is_multiple_of(n) {
        bail!("{dtype:?} matrix with {cols} columns, not a multiple of {n}");
    }
    Ok(())
}

/// Calls `f(rows, cols, blocks)` with the blocks in the GGUF bytes of a `[rows, cols]` matrix of
/// format `F`, checked for shape and size (read in place when aligned, else copied once).
fn with_blocks<F: Format, R>(
    rows: usize,
    cols: usize,
    data: &[u8],
    f: impl FnOnce(usize, usize, &[F::Block]) -> R,
) -> Result<R> {
    {
        check_cols(F::DTYPE, cols)?;
        let n = rows * cols / F::N;
        if data.len() != n * std::mem::size_of::<F::Block>() {
            bail!(
                "{:?} matrix data of {} bytes for [{rows}, {cols}]",
                F::DTYPE,
                data.len()
            );
        }
        Ok(match bytemuck::try_cast_slice::<u8, F::Block>(data) {
            Ok(blocks) => f(rows, cols, blocks),
            Err(_) => {
                let mut blocks = vec![F::Block::zeroed(); n];
                bytemuck::cast_slice_mut::<F::Block, u8>(&mut blocks).copy_from_slice(data);
                f(rows, cols, &blocks)
            }
        })
    }
}

impl<F: RowFormat> Matrix<F> {
    fn row(&self, r: usize) -> &[F::Block] {
        let kb = self.cols / F::N;
        &self.blocks[(self.row0 + r) * kb..(self.row0 + r + 1) * kb]
    }

    fn stack(parts: &[&Self]) -> Result<(Self, Vec<Self>)> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            bail!("stacking matrices of different widths");
        }
        let kb = cols / F::N;
        let mut blocks = Vec::new();
        let mut views = Vec::new();
        let mut row0 = 0;
        for p in parts {
            blocks.extend_from_slice(&p.blocks[p.row0 * kb..(p.row0 + p.rows) * kb]);
            views.push((row0, p.rows));
            row0 += p.rows;
        }
        let blocks = Arc::new(blocks);
        let view = |row0, rows| Matrix::<F> {
            rows,
            cols,
            row0,
            blocks: blocks.clone(),
        };
        let parts = views.into_iter().map(|(r0, n)| view(r0, n)).collect();
        Ok((view(0, row0), parts))
    }

    /// Row `r` dequantized into `out` (`cols` values): an embedding lookup.
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (x, o) in self.row(r).iter().zip(out.chunks_exact_mut(F::N)) {
            F::dequantize(x, o);
        }
    }

    /// `xs [m, cols]` (f32, row-major) times the transposed matrix into `out [m, rows]`.
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        let kb = k / F::N;
        let q = activations(xs, m, kb, F::quantize);
        let level = level();
        let dst = DisjointOut::new(out);
        let items = n.div_ceil(ROWS_PER_ITEM);
        let pool = candle_core::utils::barrier_pool();
        let act = |t: usize| &q[t * kb..(t + 1) * kb];
        if m == 1 {
            // Decode: work items are blocks of output rows.
            pool.execute_chunked(items, |range| {
                for item in range {
                    let (r0, r1) = (item * ROWS_PER_ITEM, n.min((item + 1) * ROWS_PER_ITEM));
                    // SAFETY (DisjointOut's contract): rows r0..r1 belong to this item alone.
                    let o = unsafe { dst.slice(r0, r1 - r0) };
                    for (r, o) in (r0..r1).zip(o) {
                        *o = F::dot(level, self.row(r), act(0));
                    }
                }
            });
        } else {
            // Prefill: work items are (block of output rows, tile of TOKENS tokens).
            let tiles = m.div_ceil(TOKENS);
            pool.execute_chunked(items * tiles, |range| {
                for item in range {
                    let (r0, t0) = ((item / tiles) * ROWS_PER_ITEM, (item % tiles) * TOKENS);
                    let (r1, t1) = (n.min(r0 + ROWS_PER_ITEM), m.min(t0 + TOKENS));
                    // SAFETY (DisjointOut's contract): rows r0..r1 of tokens t0..t1 belong to this
                    // item alone (one slice per token, as the output is [tokens, rows]).
                    let o: [&mut [f32]; TOKENS] = std::array::from_fn(|i| {
                        if t0 + i < t1 {
                            unsafe { dst.slice((t0 + i) * n + r0, r1 - r0) }
                        } else {
                            &mut []
                        }
                    });
                    for r in r0..r1 {
                        let w = self.row(r);
                        let mut t = t0;
                        while t + 4 <= t1 {
                            let v =
                                F::dot_x4(level, w, [act(t), act(t + 1), act(t + 2), act(t + 3)]);
                            for (i, v) in v.into_iter().enumerate() {
                                o[t + i - t0][r - r0] = v;
                            }
                            t += 4;
                        }
                        for t in t..t1 {
                            o[t - t0][r - r0] = F::dot(level, w, act(t));
                        }
                    }
                }
            });
        }
    }
}

/// Activation rows below which one thread quantizes them all (a decode's one).
const QUANTIZE_SPLIT_FROM: usize = 8;

/// `xs [m, k]` as activation rows `[m, kb]` by `quantize`, a prefill's rows split over candle's
/// pool (each row's values are its own, whichever thread makes them).
fn activations<A: Pod + Send + Sync>(
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
    super::disjoint::for_each_row(&mut q, kb, 1, QUANTIZE_SPLIT_FROM * kb, |t, o| {
        quantize(&xs[t * k..(t + 1) * k], o)
    });
    q
}

/// Whether a matrix of a tiled type becomes tiles: AVX2 runs here (`level()`), its rows
/// come in 16s.
fn tileable(rows: usize) -> bool {
    level() >= Level::Avx2 && rows.is_multiple_of(tiled::TR)
}

/// The weight types this driver runs, declared once. A row: ggml's type id, its name, candle's
/// `GgmlDType`, and its format here (a block struct with `Format` and, for tiles, `Tiled` impls; or
/// `Floats<E>`). Rows under `tiled` become row-interleaved tiles where AVX2 runs and rows come in
/// 16s (per row otherwise); rows under `per_row` always run per row. From these rows come
/// [`FORMATS`], [`WEIGHT_TYPES`] (the GGUF reader's list of what kvchat runs), the per-row reader
/// and `tiled_format!`. A new type: its kernel file and one row (docs/architecture.md).
macro_rules! weight_types {
    ($d:tt
        tiled { $($tid:literal $tname:literal $tdt:ident => $TF:ty;)* }
        per_row { $($rid:literal $rname:literal $rdt:ident => $RF:ty;)* }
    ) => {
        /// Runs `$body` with `$F` the format of a tiled `$dtype`; `$none` for other types.
        macro_rules! tiled_format {
            ($d dtype:expr, |$d F:ident| $d body:expr, else $d none:expr) => {
                match $d dtype {
                    $( GgmlDType::$tdt => {
                        #[allow(dead_code)]
                        type $d F = $TF;
                        $d body
                    } )*
                    _ => $d none,
                }
            };
        }

        /// The GGUF types this driver runs.
        pub const FORMATS: [GgmlDType; [$($tname,)* $($rname,)*].len()] =
            [$(GgmlDType::$tdt,)* $(GgmlDType::$rdt,)*];

        /// The GGUF types this driver runs, as (ggml type id, name, candle's type).
        pub const WEIGHT_TYPES: [(u32, &str, GgmlDType); [$($tname,)* $($rname,)*].len()] =
            [$(($tid, $tname, GgmlDType::$tdt),)* $(($rid, $rname, GgmlDType::$rdt),)*];

        /// The per-row matrix of `[rows, cols]` blocks of `dtype` read from `src`; None for a
        /// type this driver does not run.
        fn read_per_row(
            dtype: GgmlDType,
            rows: usize,
            cols: usize,
            src: &mut dyn std::io::Read,
        ) -> Result<Option<QMatrix>> {
            Ok(Some(match dtype {
                $( GgmlDType::$tdt => QMatrix::new(Matrix::<$TF>::read_rows(rows, cols, src)?), )*
                $( GgmlDType::$rdt => QMatrix::new(Matrix::<$RF>::read_rows(rows, cols, src)?), )*
                _ => return Ok(None),
            }))
        }
    };
}

weight_types! {$
    tiled {
        2 "Q4_0" Q4_0 => Q4_0;
        3 "Q4_1" Q4_1 => Q4_1;
        6 "Q5_0" Q5_0 => Q5_0;
        7 "Q5_1" Q5_1 => Q5_1;
        8 "Q8_0" Q8_0 => Q8_0;
        12 "Q4_K" Q4K => Q4K;
        13 "Q5_K" Q5K => Q5K;
        14 "Q6_K" Q6K => Q6K;
    }
    per_row {
        0 "F32" F32 => Floats<f32>;
        1 "F16" F16 => Floats<f16>;
        30 "BF16" BF16 => Floats<half::bf16>;
        10 "Q2_K" Q2K => Q2K;
        11 "Q3_K" Q3K => Q3K;
    }
}

/// Reads a model's matrices for our kernels: those that become tiles into one [`TileStore`]
/// (huge pages, faulted once; q, k, v and gate, up end to end, so stacking them copies nothing),
/// the others per row. Each matrix is read straight into its layout, a few MiB at a time.
pub struct Packer {
    store: TileStore,
    /// The matrices told of, in order, with where each one's tiles go.
    plan: Vec<Planned>,
    /// How many of them `read` has been given.
    next: usize,
    slots: Vec<Slot>,
}

/// A matrix [`Packer::new`] was told of: its type and shape, and the first byte of its tiles in
/// the store (None: rows not in 16s, read on their own).
struct Planned {
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    at: Option<usize>,
}

enum Slot {
    Ready(QMatrix),
    Tiles {
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        at: usize,
    },
}

impl Packer {
    /// Room for the tiles of `mats` (`[dtype, rows, cols]` each, shapes already checked), read
    /// afterwards in this order.
    pub fn new(mats: &[(GgmlDType, usize, usize)]) -> Result<Self> {
        let mut end = 0usize;
        let plan: Vec<Planned> = mats
            .iter()
            .map(|&(dtype, rows, cols)| {
                let at = tileable(rows)
                    .then(|| {
                        tiled_format!(dtype, |F| {
                            let at = TiledMatrix::<F>::align(end);
                            end = at + TiledMatrix::<F>::bytes(rows, cols);
                            Some(at)
                        }, else None)
                    })
                    .flatten();
                Planned {
                    dtype,
                    rows,
                    cols,
                    at,
                }
            })
            .collect();
        let store = TileStore::zeroed(end)
            .with_context(|| format!("cannot allocate {end} bytes for the weights"))?;
        Ok(Self {
            store,
            plan,
            next: 0,
            slots: Vec::new(),
        })
    }

    /// Reads the next matrix, `[rows, cols]` GGUF blocks of `dtype` from `src`; it must be the
    /// next one [`Packer::new`] was told of. False (and nothing read) for a type this driver
    /// does not run.
    pub fn read(
        &mut self,
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        src: &mut dyn std::io::Read,
    ) -> Result<bool> {
        let told = self.plan.get(self.next);
        let Some(&Planned { at, .. }) =
            told.filter(|p| (p.dtype, p.rows, p.cols) == (dtype, rows, cols))
        else {
            bail!("{dtype:?} matrix [{rows}, {cols}] was not among those planned");
        };
        self.next += 1;
        if !FORMATS.contains(&dtype) {
            return Ok(false);
        }
        check_cols(dtype, cols)?;
        let slot = match at {
            Some(at) => tiled_format!(dtype, |F| {
                TiledMatrix::<F>::read_into(&mut self.store, at, rows, cols, src)?;
                Slot::Tiles { dtype, rows, cols, at }
            }, else unreachable!("only tiled types are planned a place")),
            None => match QMatrix::read_rows(dtype, rows, cols, src)? {
                Some(m) => Slot::Ready(m),
                None => return Ok(false),
            },
        };
        self.slots.push(slot);
        Ok(true)
    }

    /// The matrices read, in order.
    pub fn finish(self) -> Vec<QMatrix> {
        let store = Arc::new(self.store);
        self.slots
            .into_iter()
            .map(|slot| match slot {
                Slot::Ready(m) => m,
                Slot::Tiles {
                    dtype,
                    rows,
                    cols,
                    at,
                } => tiled_format!(dtype, |F| {
                    QMatrix::new(TiledMatrix::<F>::view(&store, at, rows, cols))
                }, else unreachable!("only tiled types are placed")),
            })
            .collect()
    }
}

/// A matrix of one format in one layout (per row or tiles): what a [`QMatrix`] holds.
trait Kernel: Send + Sync + 'static {
    fn dtype(&self) -> GgmlDType;
    /// `[rows, cols]`.
    fn dims(&self) -> (usize, usize);
    /// `xs [m, cols]` (f32, row-major) times the transposed matrix into `out [m, rows]`.
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]);
    /// Row `r` dequantized into `out` (`cols` values).
    fn dequantize_row(&self, r: usize, out: &mut [f32]);
    /// `parts` stacked, where all are of this one's format and layout (else None).
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>>;
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A stacked matrix and its parts' views, as QMatrix values.
fn wrapped<M: Kernel>((all, views): (M, Vec<M>)) -> (QMatrix, Vec<QMatrix>) {
    (
        QMatrix::new(all),
        views.into_iter().map(QMatrix::new).collect(),
    )
}

/// The typed matrices behind `parts`, where every one is an `M`.
fn all_of<'a, M: 'static>(parts: &[&'a QMatrix]) -> Option<Vec<&'a M>> {
    parts.iter().map(|p| p.downcast::<M>()).collect()
}

impl<F: RowFormat> Kernel for Matrix<F> {
    fn dtype(&self) -> GgmlDType {
        F::DTYPE
    }
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        Matrix::matmul(self, xs, m, out)
    }
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        Matrix::dequantize_row(self, r, out)
    }
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(typed) = all_of::<Self>(parts) else {
            return Ok(None);
        };
        Ok(Some(wrapped(Matrix::stack(&typed)?)))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl<F: tiled::TileKernels> Kernel for TiledMatrix<F> {
    fn dtype(&self) -> GgmlDType {
        <F as Format>::DTYPE
    }
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        TiledMatrix::matmul(self, xs, m, out)
    }
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        TiledMatrix::dequantize_row(self, r, out)
    }
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(typed) = all_of::<Self>(parts) else {
            return Ok(None);
        };
        Ok(TiledMatrix::stack(&typed)?.map(wrapped))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A weight matrix on the CPU, of any format this driver runs: per row ([`Matrix`]; the float
/// types, Q2_K and Q3_K always) or as row-interleaved tiles ([`TiledMatrix`], made where AVX2
/// runs and rows come in 16s). Cloning shares the weights.
#[derive(Clone)]
pub struct QMatrix(Arc<dyn Kernel>);

/// Which CPU matmul runs a GGUF's quantized matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Ours where [`preferred`] says they are faster, candle's QMatMul elsewhere.
    #[default]
    Preferred,
    /// Ours for every type they run.
    Ours,
    /// candle's QMatMul for every type.
    Candle,
    /// The GPU's path on the CPU: candle's QMatMul for every type, KV rows as tensors attended
    /// with candle ops (`Engine::kv_device`); to check that path where there is no GPU.
    Gpu,
}

impl Kernels {
    /// Whether our kernels take a matrix of `dtype`.
    pub fn ours_for(self, dtype: GgmlDType) -> bool {
        match self {
            Kernels::Preferred => preferred(dtype),
            Kernels::Ours => FORMATS.contains(&dtype),
            Kernels::Candle | Kernels::Gpu => false,
        }
    }
}

impl std::str::FromStr for Kernels {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "preferred" => Kernels::Preferred,
            "ours" => Kernels::Ours,
            "candle" => Kernels::Candle,
            "gpu" => Kernels::Gpu,
            other => bail!("unknown kernels {other:?}: preferred, ours, candle or gpu"),
        })
    }
}

/// Whether our kernels are the better choice on the CPU for a matrix of `dtype` (where not,
/// candle's QMatMul runs it): wherever AVX2 runs. Rows in 16s run as row-interleaved tiles
/// (`tiled`), others per row. Even where candle's QMatMul decodes a type faster from memory (Q5_K,
/// Q6_K), ours are kept: candle's tiles sum decode and prefill differently, and bit-identical
/// prefill and decode is this project's rule (the per-type figures: `tests::speed`, and
/// docs/perf-notes.md).
///
/// With no SIMD path here (not x86-64, or no AVX2: `level()` is `Scalar`), candle's QMatMul runs
/// everything (it has NEON kernels; ours would run their scalar reference).
pub fn preferred(dtype: GgmlDType) -> bool {
    FORMATS.contains(&dtype) && level() >= Level::Avx2
}

impl QMatrix {
    /// The matrix of a `QTensor [rows, cols]`; None for a type this driver does not run.
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        let (rows, cols) = t.shape().dims2()?;
        Self::from_bytes(t.dtype(), rows, cols, &t.data()?)
    }

    /// The per-row matrix of `[rows, cols]` GGUF blocks of `dtype` that `src` gives.
    fn read_rows(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        src: &mut dyn std::io::Read,
    ) -> Result<Option<Self>> {
        read_per_row(dtype, rows, cols, src)
    }

    /// The matrix of a GGUF tensor's bytes, `[rows, cols]` of `dtype`; None for a type this
    /// driver does not run.
    pub fn from_bytes(
        dtype: GgmlDType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Option<Self>> {
        if !tileable(rows) || !tiled_format!(dtype, |_F| true, else false) {
            let want = rows * cols / dtype.block_size() * dtype.type_size();
            if data.len() != want {
                bail!(
                    "{dtype:?} matrix data of {} bytes for [{rows}, {cols}]",
                    data.len()
                );
            }
            return Self::read_rows(dtype, rows, cols, &mut &data[..]);
        }
        Ok(Some(tiled_format!(dtype, |F| {
            Self::new(Matrix::<F>::tiled_from(rows, cols, data)?)
        }, else unreachable!("a tiled type"))))
    }

    fn new(m: impl Kernel) -> Self {
        Self(Arc::new(m))
    }

    /// The typed matrix inside, where it is an `M` (`Matrix<F>` or `TiledMatrix<F>`).
    pub fn downcast<M: 'static>(&self) -> Option<&M> {
        self.0.as_any().downcast_ref()
    }

    pub fn dtype(&self) -> GgmlDType {
        self.0.dtype()
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> (usize, usize) {
        self.0.dims()
    }

    /// The rows of `parts` stacked into one matrix (so one pass computes all their outputs: q, k
    /// and v, or gate and up), and each part as a view into it; no weight is stored twice. None
    /// when the parts are not all of one format and layout (per row or tiles).
    pub fn stack(parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        first.0.stack(parts)
    }

    /// `x [.., cols]` (f32) times the transposed matrix: `[.., rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, k) = self.dims();
        let dims = x.dims().to_vec();
        if dims.last() != Some(&k) {
            bail!(
                "{:?} matmul: input of shape {dims:?}, the matrix has {k} columns",
                self.dtype()
            );
        }
        let m = x.elem_count() / k;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; m * n];
        self.0.matmul(&xs, m, &mut out);
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dim") = n;
        Ok(Tensor::from_vec(out, out_dims, &Device::Cpu)?)
    }

    /// The rows `ids` dequantized: `[ids.len(), cols]` (an embedding lookup; nothing else of the
    /// table is dequantized).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let (n, k) = self.dims();
        let mut out = vec![0f32; ids.len() * k];
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
            let id = id as usize;
            if id >= n {
                bail!("token id {id} is outside the embedding table of {n} rows");
            }
            self.0.dequantize_row(id, o);
        }
        Ok(Tensor::from_vec(out, (ids.len(), k), &Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests;
