//! The per-row dot products: a format's SIMD kernels (`Avx2`), the generic AVX2 drivers that sum
//! them in `dot_scalar`'s order, and `RowFormat`, what the per-row matrix runs.

use super::*;
use bytemuck::Pod;

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
    /// Lanes whose total is [`Avx2::ilanes`]'s, however distributed: what the tiles' order
    /// adds (`dot_rows_order`), for a format with a cheaper way to the total.
    ///
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn itotal(u: &Self::Unpacked, y: &Self::Act) -> std::arch::x86_64::__m256i {
        Self::ilanes(u, y)
    }
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn min_u(_u: &Self::Unpacked, x: &Self::Block, y: &Self::Act) -> f32 {
        Self::min_term(x, y)
    }
    type U512: Copy;
    /// Whether a decode step runs the `*512` kernels at the AVX-512 level (else the AVX2 ones,
    /// the same sums): no for a format whose AVX-512 path is slower on this CPU.
    fn vnni_decode() -> bool {
        true
    }
    /// Whether a decode step in the tiles' order (`dot_rows_order`) forms eight blocks' integer
    /// totals together (`vphaddd`) instead of each block's alone: the same integers, so the same
    /// bits. Yes where measured faster on Zen 4 (l1b decode: IQ1_M 48.8 → 42.1 ms/token,
    /// IQ2_S 45.1 → 41.1, IQ2_XS 40.6 → 37.4, IQ2_XXS 34.8 → 33.8); it made IQ1_S and IQ3_XXS
    /// slower there (33 → 53, 40 → 59: their unpacking spilled with eight blocks' lanes held)
    /// and IQ3_S no faster.
    const SUMS_IN_EIGHTS: bool = false;
    /// # Safety
    /// The trait's contract.
    unsafe fn unpack512(x: &Self::Block) -> Self::U512;
    /// # Safety
    /// The trait's contract.
    unsafe fn ilanes512(u: &Self::U512, y: &Self::Act) -> std::arch::x86_64::__m256i;
    /// [`Avx2::itotal`] at the AVX-512 level.
    ///
    /// # Safety
    /// The trait's contract.
    #[inline(always)]
    unsafe fn itotal512(u: &Self::U512, y: &Self::Act) -> std::arch::x86_64::__m256i {
        Self::ilanes512(u, y)
    }
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
pub(super) mod avx2 {
    use super::{Avx2, Format};
    use std::arch::x86_64::*;

    /// The 8 f32 lanes added as [`super::hsum`] adds them.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in super::super) unsafe fn hsum_ps(acc: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)); // a_i + a_i+4
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s)); // (0+4)+(2+6), (1+5)+(3+7)
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// A float row's 16 accumulators in one AVX-512 register folded as [`super::fold16`] folds
    /// them: `a[l] + a[l + 8]`, then [`hsum_ps`].
    #[inline]
    #[target_feature(enable = "avx2,avx512f")]
    pub(in super::super) unsafe fn hsum16_ps(acc: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(acc), hi))
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

    /// One row with one activation row in the tiles' order ([`super::dot_rows_scalar`]'s: per
    /// block the exact integer sum of its lanes, times its scale, fused into one accumulator),
    /// given a level's unpack, lanes and min: for a matrix whose prefill runs as tiles (staged)
    /// and whose decode runs per row.
    #[inline(always)]
    unsafe fn dot_rows_order_body<F: Avx2, U>(
        mut xs: &[F::Block],
        mut ys: &[F::Act],
        unpack: impl Fn(&F::Block) -> U,
        ilanes: impl Fn(&U, &F::Act) -> __m256i,
        min: impl Fn(&U, &F::Block, &F::Act) -> f32,
    ) -> f32 {
        let mut acc = 0f32;
        let mut summ = 0f32;
        if F::SUMS_IN_EIGHTS {
            // Eight blocks' lanes at a time, their eight exact integer totals formed together
            // (three levels of `vphaddd` and a cross-half add), then each times its block's
            // scale into the accumulator in block order.
            let whole = xs.len().min(ys.len()) / 8 * 8;
            for (xg, yg) in xs[..whole].chunks_exact(8).zip(ys[..whole].chunks_exact(8)) {
                let mut l = [_mm256_setzero_si256(); 8];
                for ((l, x), y) in l.iter_mut().zip(xg).zip(yg) {
                    let u = unpack(x);
                    *l = ilanes(&u, y);
                    if F::HAS_MIN {
                        summ += min(&u, x, y);
                    }
                }
                let h01 = _mm256_hadd_epi32(l[0], l[1]);
                let h23 = _mm256_hadd_epi32(l[2], l[3]);
                let h45 = _mm256_hadd_epi32(l[4], l[5]);
                let h67 = _mm256_hadd_epi32(l[6], l[7]);
                let h0123 = _mm256_hadd_epi32(h01, h23);
                let h4567 = _mm256_hadd_epi32(h45, h67);
                let sums = _mm256_add_epi32(
                    _mm256_permute2x128_si256::<0x20>(h0123, h4567),
                    _mm256_permute2x128_si256::<0x31>(h0123, h4567),
                );
                let isums: [f32; 8] = bytemuck::cast(_mm256_cvtepi32_ps(sums));
                for ((isum, x), y) in isums.iter().zip(xg).zip(yg) {
                    acc = isum.mul_add(F::scale(x, y), acc);
                }
            }
            (xs, ys) = (&xs[whole..], &ys[whole..]);
        }
        for (x, y) in xs.iter().zip(ys) {
            let u = unpack(x);
            let l = ilanes(&u, y);
            // The 8 lanes' exact integer sum.
            let s = _mm_add_epi32(_mm256_castsi256_si128(l), _mm256_extracti128_si256::<1>(l));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            let isum = _mm_cvtsi128_si32(s);
            acc = (isum as f32).mul_add(F::scale(x, y), acc);
            if F::HAS_MIN {
                summ += min(&u, x, y);
            }
        }
        acc + summ
    }

    /// Each body at both SIMD levels: `$avx2` runs it with the AVX2 kernels, `$vnni` with the
    /// VNNI ones (AVX-512: `unpack512`, `ilanes512`, `min512`).
    macro_rules! at_both_levels {
        ($body:ident => $avx2:ident, $vnni:ident ($ys:ident: $yty:ty) -> $ret:ty) => {
            at_both_levels!($body => $avx2, $vnni ($ys: $yty) -> $ret, ilanes, ilanes512);
        };
        ($body:ident => $avx2:ident, $vnni:ident ($ys:ident: $yty:ty) -> $ret:ty,
         $lanes:ident, $lanes512:ident) => {
            #[inline]
            #[target_feature(enable = "avx2,fma")]
            pub(crate) unsafe fn $avx2<F: Avx2>(xs: &[F::Block], $ys: $yty) -> $ret {
                $body::<F, _>(
                    xs,
                    $ys,
                    |x| F::unpack(x),
                    |u, y| F::$lanes(u, y),
                    |u, x, y| F::min_u(u, x, y),
                )
            }

            #[inline]
            #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
            pub(crate) unsafe fn $vnni<F: Avx2>(xs: &[F::Block], $ys: $yty) -> $ret {
                $body::<F, _>(
                    xs,
                    $ys,
                    |x| F::unpack512(x),
                    |u, y| F::$lanes512(u, y),
                    |u, x, y| F::min512(u, x, y),
                )
            }
        };
    }

    at_both_levels!(dot_body => dot, dot512 (ys: &[F::Act]) -> f32);
    at_both_levels!(dot_x4_body => dot_x4, dot512_x4 (ys: [&[F::Act]; 4]) -> [f32; 4]);
    at_both_levels!(dot_rows_order_body => dot_rows_order, dot_rows_order512 (ys: &[F::Act]) -> f32,
        itotal, itotal512);

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

    /// The 32 bits of `x` as bytes: 0xFF where bit i is set, 0 elsewhere (byte i; llama.cpp's
    /// `bytes_from_bits_32`).
    #[inline(always)]
    pub(crate) unsafe fn bit_bytes(x: u32) -> __m256i {
        let shuf = _mm256_set_epi64x(
            0x0303030303030303,
            0x0202020202020202,
            0x0101010101010101,
            0x0000000000000000,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
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
/// is one (through [`dot`] and [`dot_x4`]); so are the float types ([`floats`], [`super::bf16`]),
/// whose "activations" are the f32 inputs themselves (F32) or rounded to the weights' type.
pub trait RowFormat: Send + Sync + 'static {
    type Block: Pod + Send + Sync;
    type Act: Pod + Send + Sync;
    /// Values per block (1 for the float types).
    const N: usize;
    const DTYPE: WeightType;
    /// An f32 input row as activation blocks.
    fn quantize(xs: &[f32], ys: &mut [Self::Act]);
    /// The block's `N` weights as f32.
    fn dequantize(x: &Self::Block, out: &mut [f32]);
    /// One row with one activation row, at `level` (at most [`level()`]).
    fn dot(level: Level, xs: &[Self::Block], ys: &[Self::Act]) -> f32;
    /// One row with four activation rows, each summed exactly as [`RowFormat::dot`] sums it.
    fn dot_x4(level: Level, xs: &[Self::Block], ys: [&[Self::Act]; 4]) -> [f32; 4];
    /// Four rows with four activation rows, `[row][token]`, each summed exactly as
    /// [`RowFormat::dot`] sums it (a format whose registers hold 16 such sums overrides it).
    #[inline(always)]
    fn dot_4x4(level: Level, xs: [&[Self::Block]; 4], ys: [&[Self::Act]; 4]) -> [[f32; 4]; 4] {
        xs.map(|x| Self::dot_x4(level, x, ys))
    }
    /// Four rows with one activation row (decode), each summed exactly as [`RowFormat::dot`]
    /// sums it (a float format overrides it: four independent chains of multiply-adds where one
    /// row's is bound by the adds' latency).
    #[inline(always)]
    fn dot_rows4(level: Level, xs: [&[Self::Block]; 4], y: &[Self::Act]) -> [f32; 4] {
        xs.map(|x| Self::dot(level, x, y))
    }
}

impl<F: Avx2> RowFormat for F {
    type Block = F::Block;
    type Act = F::Act;
    const N: usize = <F as Format>::N;
    const DTYPE: WeightType = <F as Format>::DTYPE;
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
pub(super) fn dot<F: Avx2>(level: Level, xs: &[F::Block], ys: &[F::Act]) -> f32 {
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
pub(super) fn dot_x4<F: Avx2>(level: Level, xs: &[F::Block], ys: [&[F::Act]; 4]) -> [f32; 4] {
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
