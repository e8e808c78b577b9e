//! The AVX2 tile kernels: the VNNI kernels' tiles and results, 8 rows per register. A tile's 16
//! rows are taken as two halves (rows 0-7 are bytes 0..32 of each 64-byte group, rows 8-15 bytes
//! 32..64), each run through all blocks on its own, so accumulators for 4 tokens fit AVX2's 16
//! registers.
//!
//! AVX2 has no `dpbusd`; `maddubs` (u8 × i8, adjacent pairs added into i16) and `madd` (i16 pairs
//! into i32) take its place. The pair sums stay exact: an i16 holds at most
//! |q|·127·(products) ≤ 32 512 where the kernels below add them up before widening (each says its
//! bound), so the integer block sums equal the VNNI kernels' and [`dot_rows_scalar`]'s exactly.

use super::super::avx2::{load16, load32};
use super::*;
use std::arch::x86_64::*;

/// Four activation values (i8) broadcast to every i32 lane.
#[inline(always)]
unsafe fn bcast4(q: &[i8]) -> __m256i {
    let b: [u8; 4] = bytemuck::cast_slice::<i8, u8>(&q[..4])
        .try_into()
        .expect("4");
    _mm256_set1_epi32(i32::from_le_bytes(b))
}

/// The 32 bytes of half `h` (rows 8h..8h+8) of a 64-byte group.
#[inline(always)]
fn half(group: &[u8; 4 * TR], h: usize) -> __m256i {
    load32(&group[32 * h..])
}

/// The 8 rows' f16 values of half `h` as f32.
#[inline(always)]
unsafe fn halves(d: &[f16; TR], h: usize) -> __m256 {
    _mm256_cvtph_ps(load16(&d[8 * h..]))
}

/// The 8 bytes of half `h` of a per-row byte array, each repeated into both i16 halves of its
/// row's i32 lane (`signed`: sign-extended, else zero-extended), for `madd` to multiply a row's
/// pair sums by its scale.
#[inline(always)]
unsafe fn scales16(s: &[u8; TR], h: usize, signed: bool) -> __m256i {
    let b = _mm_loadl_epi64(s[8 * h..].as_ptr() as *const __m128i);
    let twice = _mm_unpacklo_epi8(b, b);
    if signed {
        _mm256_cvtepi8_epi16(twice)
    } else {
        _mm256_cvtepu8_epi16(twice)
    }
}

/// A format's AVX2 tile kernel (the module's SAFETY contract in `quant`: AVX2, FMA and F16C
/// present).
pub trait TileKernel: Tiled {
    /// Half `h`'s 8 rows' integer sums of block `t` with `ys` (and `ysum` of each where `YSUM`).
    unsafe fn isum<const T: usize>(
        t: &Self::Tile,
        h: usize,
        ys: [&Self::Act; T],
        ysums: [i32; T],
    ) -> [__m256i; T];
    /// The 8 rows' float scales with `y` (the same operations as `Format::scale`).
    unsafe fn scale(t: &Self::Tile, h: usize, y: &Self::Act) -> __m256;
    /// The 8 rows' min terms (the same operations as `Format::min_term`).
    unsafe fn min(_t: &Self::Tile, _h: usize, _y: &Self::Act) -> __m256 {
        _mm256_setzero_ps()
    }
}

/// Half `h`'s Σ q·y over a 32-value block of nibbles (plus fifth bits from `qh`). Bounds: a
/// nibble pair sum is ≤ 2·15·127, eight of them (the whole block) ≤ 30 480; with fifth bits
/// (q ≤ 31) a pair is ≤ 7 874, so they are widened every two groups (≤ 31 496).
#[inline(always)]
unsafe fn isum_nibbles<const T: usize>(
    qs: &[[u8; 4 * TR]; 4],
    qh: Option<&[u8; 4 * TR]>,
    h: usize,
    ys: [&[i8; 32]; T],
) -> [__m256i; T] {
    let m4 = _mm256_set1_epi8(0x0F);
    let one8 = _mm256_set1_epi8(1);
    let one16 = _mm256_set1_epi16(1);
    let bits = qh.map(|b| half(b, h));
    let mut acc = [_mm256_setzero_si256(); T];
    let mut p16 = [_mm256_setzero_si256(); T];
    for g in 0..4 {
        let w = half(&qs[g], h);
        let mut lo = _mm256_and_si256(w, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), m4);
        if let Some(b) = bits {
            // Bits 2g and 2g+1 of each byte, moved to bit 4.
            let (b0, b1) = match g {
                0 => (b, _mm256_srli_epi16::<1>(b)),
                1 => (_mm256_srli_epi16::<2>(b), _mm256_srli_epi16::<3>(b)),
                2 => (_mm256_srli_epi16::<4>(b), _mm256_srli_epi16::<5>(b)),
                _ => (_mm256_srli_epi16::<6>(b), _mm256_srli_epi16::<7>(b)),
            };
            lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(b0, one8)));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(b1, one8)));
        }
        for i in 0..T {
            let y = &ys[i][8 * g..];
            p16[i] = _mm256_add_epi16(p16[i], _mm256_maddubs_epi16(lo, bcast4(y)));
            p16[i] = _mm256_add_epi16(p16[i], _mm256_maddubs_epi16(hi, bcast4(&y[4..])));
        }
        let widen = if qh.is_some() { g % 2 == 1 } else { g == 3 };
        if widen {
            for i in 0..T {
                acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p16[i], one16));
                p16[i] = _mm256_setzero_si256();
            }
        }
    }
    acc
}

impl TileKernel for Q4_0 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ4_0,
        h: usize,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [__m256i; T] {
        let acc = isum_nibbles(&t.qs, None, h, ys.map(|y| &y.qs));
        std::array::from_fn(|i| _mm256_sub_epi32(acc[i], _mm256_set1_epi32(8 * ysums[i])))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4_0, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(halves(&t.d, h), _mm256_set1_ps(y.d.to_f32()))
    }
}

impl TileKernel for Q4_1 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ4_1,
        h: usize,
        ys: [&BlockQ8_1; T],
        _: [i32; T],
    ) -> [__m256i; T] {
        isum_nibbles(&t.qs, None, h, ys.map(|y| &y.qs))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(halves(&t.d, h), _mm256_set1_ps(y.d.to_f32()))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ4_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(halves(&t.m, h), _mm256_set1_ps(y.s.to_f32()))
    }
}

impl TileKernel for Q5_0 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ5_0,
        h: usize,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [__m256i; T] {
        let acc = isum_nibbles(&t.qs, Some(&t.qh), h, ys.map(|y| &y.qs));
        std::array::from_fn(|i| _mm256_sub_epi32(acc[i], _mm256_set1_epi32(16 * ysums[i])))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5_0, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(halves(&t.d, h), _mm256_set1_ps(y.d.to_f32()))
    }
}

impl TileKernel for Q5_1 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ5_1,
        h: usize,
        ys: [&BlockQ8_1; T],
        _: [i32; T],
    ) -> [__m256i; T] {
        isum_nibbles(&t.qs, Some(&t.qh), h, ys.map(|y| &y.qs))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(halves(&t.d, h), _mm256_set1_ps(y.d.to_f32()))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ5_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(halves(&t.m, h), _mm256_set1_ps(y.s.to_f32()))
    }
}

impl TileKernel for Q8_0 {
    /// The tile stores q + 128; xor 0x80 gives q as i8 back, and llama.cpp's sign trick
    /// (|q| times y with q's sign) makes it maddubs's unsigned operand: a pair is
    /// ≤ 2·128·127 = 32 512, widened at once.
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ8_0,
        h: usize,
        ys: [&BlockQ8_0; T],
        _: [i32; T],
    ) -> [__m256i; T] {
        let flip = _mm256_set1_epi8(0x80u8 as i8);
        let one16 = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_si256(); T];
        for g in 0..8 {
            let w = _mm256_xor_si256(half(&t.qs[g], h), flip);
            let aw = _mm256_sign_epi8(w, w);
            for i in 0..T {
                let sy = _mm256_sign_epi8(bcast4(&ys[i].qs[4 * g..]), w);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), one16);
                acc[i] = _mm256_add_epi32(acc[i], p);
            }
        }
        acc
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ8_0, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(halves(&t.d, h), _mm256_set1_ps(y.d.to_f32()))
    }
}

/// Half `h`'s Σ_j sc_j · Σ q·y over a Q4_K/Q5_K super-block (`qh`: Q5_K's fifth bits); `madd`
/// with the scales repeated per i16 both widens and scales. Bounds as [`isum_nibbles`]: a
/// sub-block's 16 nibble products per i16 ≤ 30 480; with fifth bits widened every two groups.
#[inline(always)]
unsafe fn isum_k<const T: usize>(
    qs: &[[u8; 4 * TR]; 32],
    qh: Option<&[[u8; 4 * TR]; 8]>,
    scales: &[[u8; TR]; 8],
    h: usize,
    ys: [&BlockQ8K; T],
) -> [__m256i; T] {
    let m4 = _mm256_set1_epi8(0x0F);
    let one8 = _mm256_set1_epi8(1);
    let mut total = [_mm256_setzero_si256(); T];
    for j in 0..8 {
        let bits = qh.map(|b| half(&b[j], h));
        let sc = scales16(&scales[j], h, false);
        let mut p16 = [_mm256_setzero_si256(); T];
        for gl in 0..4 {
            let g = 4 * j + gl;
            let w = half(&qs[g], h);
            let mut lo = _mm256_and_si256(w, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), m4);
            if let Some(b) = bits {
                let (b0, b1) = match gl {
                    0 => (b, _mm256_srli_epi16::<1>(b)),
                    1 => (_mm256_srli_epi16::<2>(b), _mm256_srli_epi16::<3>(b)),
                    2 => (_mm256_srli_epi16::<4>(b), _mm256_srli_epi16::<5>(b)),
                    _ => (_mm256_srli_epi16::<6>(b), _mm256_srli_epi16::<7>(b)),
                };
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(b0, one8)));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(b1, one8)));
            }
            for i in 0..T {
                let y = &ys[i].qs[8 * g..];
                p16[i] = _mm256_add_epi16(p16[i], _mm256_maddubs_epi16(lo, bcast4(y)));
                p16[i] = _mm256_add_epi16(p16[i], _mm256_maddubs_epi16(hi, bcast4(&y[4..])));
            }
            let widen = if qh.is_some() { gl % 2 == 1 } else { gl == 3 };
            if widen {
                for i in 0..T {
                    total[i] = _mm256_add_epi32(total[i], _mm256_madd_epi16(p16[i], sc));
                    p16[i] = _mm256_setzero_si256();
                }
            }
        }
    }
    total
}

/// −(d_y · dmin) · Σ_j m_j · (Σ of y over sub-block j), per row of half `h` (Q4_K/Q5_K); the
/// products m_j · s_j (≤ 63 · 4 064) by `madd` of the zero-extended mins with s_j in each i16.
#[inline(always)]
unsafe fn min_k(mins: &[[u8; TR]; 8], dmin: &[f16; TR], h: usize, y: &BlockQ8K) -> __m256 {
    let mut msum = _mm256_setzero_si256();
    for (j, mins) in mins.iter().enumerate() {
        let s = y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32;
        let m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(mins[8 * h..].as_ptr() as *const __m128i));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, _mm256_set1_epi32(s & 0xFFFF)));
    }
    let dd = _mm256_mul_ps(_mm256_set1_ps(y.d), halves(dmin, h));
    // Negation as a sign flip (exact, −0 included), as the scalar `-(..)`.
    let neg = _mm256_xor_ps(dd, _mm256_set1_ps(-0.0));
    _mm256_mul_ps(neg, _mm256_cvtepi32_ps(msum))
}

impl TileKernel for Q4K {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ4K,
        h: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [__m256i; T] {
        isum_k(&t.qs, None, &t.sc, h, ys)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), halves(&t.d, h))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ4K, h: usize, y: &BlockQ8K) -> __m256 {
        min_k(&t.m, &t.dmin, h, y)
    }
}

impl TileKernel for Q5K {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ5K,
        h: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [__m256i; T] {
        isum_k(&t.qs, Some(&t.qh), &t.sc, h, ys)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), halves(&t.d, h))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ5K, h: usize, y: &BlockQ8K) -> __m256 {
        min_k(&t.m, &t.dmin, h, y)
    }
}

impl TileKernel for Q6K {
    /// Per 16-value sub-block: q − 32 (in −32..=31) by the sign trick, so each of the 4 pair
    /// sums is ≤ 2·32·127 and their i16 sum ≤ 32 512; `madd` with the signed scales widens.
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ6K,
        h: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [__m256i; T] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(3);
        let m32 = _mm256_set1_epi8(32);
        let mut total = [_mm256_setzero_si256(); T];
        for j in 0..16 {
            let (l0, l1, hb) = (
                half(&t.ql[2 * j], h),
                half(&t.ql[2 * j + 1], h),
                half(&t.qh[j], h),
            );
            let hi = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, m2));
            let v = [
                _mm256_or_si256(_mm256_and_si256(l0, m4), hi(hb)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                    hi(_mm256_srli_epi16::<2>(hb)),
                ),
                _mm256_or_si256(_mm256_and_si256(l1, m4), hi(_mm256_srli_epi16::<4>(hb))),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                    hi(_mm256_srli_epi16::<6>(hb)),
                ),
            ]
            .map(|v| _mm256_sub_epi8(v, m32));
            let av = v.map(|v| _mm256_sign_epi8(v, v));
            let sc = scales16(bytemuck::cast_ref(&t.sc[j]), h, true);
            for i in 0..T {
                let y = &ys[i].qs[16 * j..];
                let mut p16 = _mm256_setzero_si256();
                for k in 0..4 {
                    let sy = _mm256_sign_epi8(bcast4(&y[4 * k..]), v[k]);
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(av[k], sy));
                }
                total[i] = _mm256_add_epi32(total[i], _mm256_madd_epi16(p16, sc));
            }
        }
        total
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ6K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), halves(&t.d, h))
    }
}

/// The 16 rows' dot products over all blocks with T activation rows (`ys[i]`, `ysums[i]` per
/// block), in [`dot_rows_scalar`]'s order; rows 0-7 first, then 8-15.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot16<F: TileKernel, const T: usize>(
    tiles: &[F::Tile],
    ys: [&[F::Act]; T],
    ysums: [&[i32]; T],
) -> [[f32; TR]; T] {
    let mut out = [[0f32; TR]; T];
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut summ = [_mm256_setzero_ps(); T];
        for (b, tile) in tiles.iter().enumerate() {
            let y: [&F::Act; T] = std::array::from_fn(|i| &ys[i][b]);
            let s: [i32; T] = std::array::from_fn(|i| if F::YSUM { ysums[i][b] } else { 0 });
            let isum = F::isum::<T>(tile, h, y, s);
            for i in 0..T {
                acc[i] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(isum[i]),
                    <F as TileKernel>::scale(tile, h, y[i]),
                    acc[i],
                );
                if F::HAS_MIN {
                    summ[i] = _mm256_add_ps(summ[i], <F as TileKernel>::min(tile, h, y[i]));
                }
            }
        }
        for i in 0..T {
            _mm256_storeu_ps(out[i][8 * h..].as_mut_ptr(), _mm256_add_ps(acc[i], summ[i]));
        }
    }
    out
}
