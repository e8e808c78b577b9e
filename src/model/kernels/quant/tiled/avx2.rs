//! The AVX2 tile kernels: the VNNI kernels' tiles and results, 8 rows per register. A tile's 16
//! rows are taken as two halves (rows 0-7 are bytes 0..32 of each 64-byte group, rows 8-15 bytes
//! 32..64): a prefill runs each half through all blocks on its own, so accumulators for 4 tokens
//! fit AVX2's 16 registers; a decode (one token) takes both halves together.
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
    _mm256_set1_epi32(four(q))
}

/// The 32 bytes of half `h` (rows 8h..8h+8) of a 64-byte group.
#[inline(always)]
fn half(group: &[u8; 4 * TR], h: usize) -> __m256i {
    load32(&group[32 * h..])
}

/// The 8 rows' f16 values of half `h` as f32.
#[inline(always)]
unsafe fn half_f32(d: &[f16; TR], h: usize) -> __m256 {
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
/// present). `H` halves from `h0` are done together, each weight vector's two halves side by
/// side, so a decode (one token, both halves) consumes each cache line of a tile in one go.
pub trait TileKernel: Tiled {
    /// Halves `h0..h0 + H`: their 8 rows' integer sums of block `t` with `ys` (and `ysum` of
    /// each where `YSUM`), `[half][token]`.
    unsafe fn isum<const H: usize, const T: usize>(
        t: &Self::Tile,
        h0: usize,
        ys: [&Self::Act; T],
        ysums: [i32; T],
    ) -> [[__m256i; T]; H];
    /// Half `h`'s 8 rows' float scales with `y` (the same operations as `Format::scale`).
    unsafe fn scale(t: &Self::Tile, h: usize, y: &Self::Act) -> __m256;
    /// Half `h`'s 8 rows' min terms (the same operations as `Format::min_term`).
    unsafe fn min(_t: &Self::Tile, _h: usize, _y: &Self::Act) -> __m256 {
        _mm256_setzero_ps()
    }
}

/// Bit `from` of each byte of `v` moved to bit `to` (both 0..8; the other bits are masked off by
/// the caller). 16-bit shifts: bit `to` of either byte comes from bit `from` of that same byte,
/// whatever crosses between the two is among the bits masked off. Callers pass constants, so the
/// match folds to one immediate shift.
#[inline(always)]
unsafe fn move_bit(v: __m256i, from: usize, to: usize) -> __m256i {
    match to as isize - from as isize {
        7 => _mm256_slli_epi16::<7>(v),
        6 => _mm256_slli_epi16::<6>(v),
        5 => _mm256_slli_epi16::<5>(v),
        4 => _mm256_slli_epi16::<4>(v),
        3 => _mm256_slli_epi16::<3>(v),
        2 => _mm256_slli_epi16::<2>(v),
        1 => _mm256_slli_epi16::<1>(v),
        0 => v,
        -1 => _mm256_srli_epi16::<1>(v),
        -2 => _mm256_srli_epi16::<2>(v),
        -3 => _mm256_srli_epi16::<3>(v),
        -4 => _mm256_srli_epi16::<4>(v),
        -5 => _mm256_srli_epi16::<5>(v),
        -6 => _mm256_srli_epi16::<6>(v),
        _ => _mm256_srli_epi16::<7>(v),
    }
}

/// A nibble group's low and high values (plus fifth bits `2g`, `2g + 1` of `bits`) as u8.
#[inline(always)]
unsafe fn unpack_group(w: __m256i, bits: Option<__m256i>, g: usize) -> [__m256i; 2] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m10 = _mm256_set1_epi8(0x10);
    let mut lo = _mm256_and_si256(w, m4);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), m4);
    if let Some(b) = bits {
        lo = _mm256_or_si256(lo, _mm256_and_si256(move_bit(b, 2 * g, 4), m10));
        hi = _mm256_or_si256(hi, _mm256_and_si256(move_bit(b, 2 * g + 1, 4), m10));
    }
    [lo, hi]
}

/// Halves `h0..h0+H`: Σ q·y over a 32-value block of nibbles (plus fifth bits from `qh`).
/// Bounds: a nibble pair sum is ≤ 2·15·127, eight of them (the whole block) ≤ 30 480; with
/// fifth bits (q ≤ 31) a pair is ≤ 7 874, so they are widened every two groups (≤ 31 496).
#[inline(always)]
unsafe fn isum_nibbles<const H: usize, const T: usize>(
    qs: &[[u8; 4 * TR]; 4],
    qh: Option<&[u8; 4 * TR]>,
    h0: usize,
    ys: [&[i8; 32]; T],
) -> [[__m256i; T]; H] {
    let one16 = _mm256_set1_epi16(1);
    let bits: [Option<__m256i>; H] = std::array::from_fn(|k| qh.map(|b| half(b, h0 + k)));
    let mut acc = [[_mm256_setzero_si256(); T]; H];
    let mut p16 = [[_mm256_setzero_si256(); T]; H];
    for g in 0..4 {
        for k in 0..H {
            let [lo, hi] = unpack_group(half(&qs[g], h0 + k), bits[k], g);
            for i in 0..T {
                let y = &ys[i][8 * g..];
                p16[k][i] = _mm256_add_epi16(p16[k][i], _mm256_maddubs_epi16(lo, bcast4(y)));
                p16[k][i] = _mm256_add_epi16(p16[k][i], _mm256_maddubs_epi16(hi, bcast4(&y[4..])));
            }
        }
        let widen = if qh.is_some() { g % 2 == 1 } else { g == 3 };
        if widen {
            for k in 0..H {
                for i in 0..T {
                    acc[k][i] = _mm256_add_epi32(acc[k][i], _mm256_madd_epi16(p16[k][i], one16));
                    p16[k][i] = _mm256_setzero_si256();
                }
            }
        }
    }
    acc
}

/// `acc[half][token] − ysums[token]` (the offset term of Q4_0's and Q5_0's unsigned quants).
#[inline(always)]
unsafe fn minus_ysums<const H: usize, const T: usize>(
    acc: [[__m256i; T]; H],
    ysums: [i32; T],
) -> [[__m256i; T]; H] {
    acc.map(|a| std::array::from_fn(|i| _mm256_sub_epi32(a[i], _mm256_set1_epi32(ysums[i]))))
}

impl TileKernel for Q4_0 {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ4_0,
        h0: usize,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [[__m256i; T]; H] {
        minus_ysums(isum_nibbles(&t.qs, None, h0, ys.map(|y| &y.qs)), ysums)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4_0, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(half_f32(&t.d, h), _mm256_set1_ps(y.d))
    }
}

impl TileKernel for Q4_1 {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ4_1,
        h0: usize,
        ys: [&BlockQ8_1; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        isum_nibbles(&t.qs, None, h0, ys.map(|y| &y.qs))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(half_f32(&t.d, h), _mm256_set1_ps(y.d))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ4_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(half_f32(&t.m, h), _mm256_set1_ps(y.s))
    }
}

impl TileKernel for Q5_0 {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ5_0,
        h0: usize,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [[__m256i; T]; H] {
        minus_ysums(
            isum_nibbles(&t.qs, Some(&t.qh), h0, ys.map(|y| &y.qs)),
            ysums,
        )
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5_0, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(half_f32(&t.d, h), _mm256_set1_ps(y.d))
    }
}

impl TileKernel for Q5_1 {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ5_1,
        h0: usize,
        ys: [&BlockQ8_1; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        isum_nibbles(&t.qs, Some(&t.qh), h0, ys.map(|y| &y.qs))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(half_f32(&t.d, h), _mm256_set1_ps(y.d))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ5_1, h: usize, y: &BlockQ8_1) -> __m256 {
        _mm256_mul_ps(half_f32(&t.m, h), _mm256_set1_ps(y.s))
    }
}

impl TileKernel for Q8_0 {
    /// The tile stores q + 128; xor 0x80 gives q as i8 back, and llama.cpp's sign trick
    /// (|q| times y with q's sign) makes it maddubs's unsigned operand: a pair is
    /// ≤ 2·128·127 = 32 512, widened at once.
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ8_0,
        h0: usize,
        ys: [&BlockQ8_0; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        let flip = _mm256_set1_epi8(0x80u8 as i8);
        let one16 = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_si256(); T]; H];
        for g in 0..8 {
            for (k, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_xor_si256(half(&t.qs[g], h0 + k), flip);
                let aw = _mm256_sign_epi8(w, w);
                for i in 0..T {
                    let sy = _mm256_sign_epi8(bcast4(&ys[i].qs[4 * g..]), w);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), one16);
                    acc[i] = _mm256_add_epi32(acc[i], p);
                }
            }
        }
        acc
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ8_0, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(half_f32(&t.d, h), _mm256_set1_ps(y.d))
    }
}

/// Halves `h0..h0+H`: Σ_j sc_j · Σ q·y over a Q4_K/Q5_K super-block (sub-block j: its 4
/// nibble groups `q[j][..4]` and, for Q5_K (N = 5), its fifth bits `q[j][4]`); `madd` with
/// the scales repeated per i16 both widens and scales. Bounds as [`isum_nibbles`]: a
/// sub-block's 16 nibble products per i16 ≤ 30 480; with fifth bits widened every two groups.
#[inline(always)]
unsafe fn isum_k<const N: usize, const H: usize, const T: usize>(
    q: &[[[u8; 4 * TR]; N]; 8],
    scales: &[[u8; TR]; 8],
    h0: usize,
    ys: [&BlockQ8K; T],
) -> [[__m256i; T]; H] {
    let fifths = N == 5;
    let mut total = [[_mm256_setzero_si256(); T]; H];
    for j in 0..8 {
        let bits: [Option<__m256i>; H] =
            std::array::from_fn(|k| fifths.then(|| half(&q[j][4], h0 + k)));
        let sc: [__m256i; H] = std::array::from_fn(|k| scales16(&scales[j], h0 + k, false));
        let mut p16 = [[_mm256_setzero_si256(); T]; H];
        for (gl, group) in q[j].iter().take(4).enumerate() {
            let g = 4 * j + gl;
            for k in 0..H {
                let [lo, hi] = unpack_group(half(group, h0 + k), bits[k], gl);
                for i in 0..T {
                    let y = &ys[i].qs[8 * g..];
                    p16[k][i] = _mm256_add_epi16(p16[k][i], _mm256_maddubs_epi16(lo, bcast4(y)));
                    p16[k][i] =
                        _mm256_add_epi16(p16[k][i], _mm256_maddubs_epi16(hi, bcast4(&y[4..])));
                }
            }
            let widen = if fifths { gl % 2 == 1 } else { gl == 3 };
            if widen {
                for k in 0..H {
                    for i in 0..T {
                        let p = _mm256_madd_epi16(p16[k][i], sc[k]);
                        total[k][i] = _mm256_add_epi32(total[k][i], p);
                        p16[k][i] = _mm256_setzero_si256();
                    }
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
    let dd = _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(dmin, h));
    // Negation as a sign flip (exact, −0 included), as the scalar `-(..)`.
    let neg = _mm256_xor_ps(dd, _mm256_set1_ps(-0.0));
    _mm256_mul_ps(neg, _mm256_cvtepi32_ps(msum))
}

impl TileKernel for Q4K {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ4K,
        h0: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        isum_k::<4, H, T>(bytemuck::cast_ref(&t.qs), &t.sc, h0, ys)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.d, h))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ4K, h: usize, y: &BlockQ8K) -> __m256 {
        min_k(&t.m, &t.dmin, h, y)
    }
}

impl TileKernel for Q5K {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ5K,
        h0: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        isum_k::<5, H, T>(&t.q, &t.sc, h0, ys)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.d, h))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ5K, h: usize, y: &BlockQ8K) -> __m256 {
        min_k(&t.m, &t.dmin, h, y)
    }
}

impl TileKernel for Q6K {
    /// Per 16-value sub-block j: the unsigned 6-bit q (0..=63) by maddubs, two pair sums added
    /// in i16 (≤ 2·2·63·127 = 32 004) and widened by `madd` with the signed scale; the offset
    /// by the block sums once per sub-block: Σ_j sc_j·Σ(q − 32)·y = Σ_j sc_j·Σ q·y − 32·Σ_j
    /// sc_j·bsum_j, the latter by `madd` of the scale with bsum_j (≤ 16·127 in i16).
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ6K,
        h0: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut total = [[_mm256_setzero_si256(); T]; H];
        let mut offset = [[_mm256_setzero_si256(); T]; H];
        for j in 0..16 {
            for k in 0..H {
                let h = h0 + k;
                let (l0, l1, hb) = (
                    half(&t.q[j][0], h),
                    half(&t.q[j][1], h),
                    half(&t.q[j][2], h),
                );
                // Value k's high 2 bits are bits 2k..2k+2 of hb's byte, moved to bits 4-5
                // (16-bit shifts: what crosses a byte boundary is masked off).
                let v = [
                    _mm256_or_si256(
                        _mm256_and_si256(l0, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<4>(hb), m30),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                        _mm256_and_si256(_mm256_slli_epi16::<2>(hb), m30),
                    ),
                    _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(hb, m30)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(hb), m30),
                    ),
                ];
                let sc = scales16(bytemuck::cast_ref(&t.sc[j]), h, true);
                for i in 0..T {
                    let y = &ys[i].qs[16 * j..];
                    let p = |n: usize| _mm256_maddubs_epi16(v[n], bcast4(&y[4 * n..]));
                    let a = _mm256_madd_epi16(_mm256_add_epi16(p(0), p(1)), sc);
                    let b = _mm256_madd_epi16(_mm256_add_epi16(p(2), p(3)), sc);
                    total[k][i] = _mm256_add_epi32(total[k][i], _mm256_add_epi32(a, b));
                    let bsum = _mm256_set1_epi32(ys[i].bsums[j] as u16 as i32);
                    offset[k][i] = _mm256_add_epi32(offset[k][i], _mm256_madd_epi16(sc, bsum));
                }
            }
        }
        std::array::from_fn(|k| {
            std::array::from_fn(|i| {
                _mm256_sub_epi32(total[k][i], _mm256_slli_epi32::<5>(offset[k][i]))
            })
        })
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ6K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.d, h))
    }
}

/// The 8 bytes of half `h` of a per-row byte array, nibble `high` of each, repeated into both
/// i16 halves of its row's i32 lane (as [`scales16`]).
#[inline(always)]
unsafe fn nibbles16(s: &[u8; TR], h: usize, high: bool) -> __m256i {
    let b = _mm_loadl_epi64(s[8 * h..].as_ptr() as *const __m128i);
    let b = if high { _mm_srli_epi16::<4>(b) } else { b };
    let b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b))
}

/// Halves `h0..h0+H`: Σ q·y over the 16 values of group `g` of a Q2_K/Q3_K tile as i16 pair sums
/// (q ≤ 7: four maddubs steps ≤ 4·2·7·127 = 7 112), ready for `madd` with the scales. Q3_K's
/// third bits are bits `4·ODD + n` of `hb` (`ODD` = g % 2, a constant so every shift is an
/// immediate).
#[inline(always)]
unsafe fn isum_crumbs<const ODD: usize, const H: usize, const T: usize>(
    qs: &[u8; 4 * TR],
    hb: Option<[__m256i; H]>,
    g: usize,
    h0: usize,
    ys: [&BlockQ8K; T],
) -> [[__m256i; T]; H] {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm256_set1_epi8(4);
    let mut p16 = [[_mm256_setzero_si256(); T]; H];
    for (k, p16) in p16.iter_mut().enumerate() {
        let w = half(qs, h0 + k);
        let crumbs = [
            _mm256_and_si256(w, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(w), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(w), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(w), m3),
        ];
        let v = match hb {
            Some(hb) => {
                let h = hb[k];
                let third: [__m256i; 4] = std::array::from_fn(|n| move_bit(h, 4 * ODD + n, 2));
                std::array::from_fn(|n| _mm256_or_si256(crumbs[n], _mm256_and_si256(third[n], m4)))
            }
            None => crumbs,
        };
        for (n, v) in v.iter().enumerate() {
            for (p, y) in p16.iter_mut().zip(ys) {
                let y = bcast4(&y.qs[16 * g + 4 * n..]);
                *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(*v, y));
            }
        }
    }
    p16
}

/// Σ_j s_j · bsum_j over the 16 sub-blocks, per row of half `h`: `s_j` the rows' bytes
/// `per_row[j]` (`signed`, or the high nibbles when not), two sub-blocks a `madd` (each row's
/// i32 lane holds (s_j, s_j+1) as i16 against the activations' adjacent bsums).
#[inline(always)]
unsafe fn sub_block_sums(
    per_row: &[[u8; TR]; 16],
    h: usize,
    signed: bool,
    y: &BlockQ8K,
) -> __m256i {
    let mut sum = _mm256_setzero_si256();
    for j in (0..16).step_by(2) {
        let a = _mm_loadl_epi64(per_row[j][8 * h..].as_ptr() as *const __m128i);
        let b = _mm_loadl_epi64(per_row[j + 1][8 * h..].as_ptr() as *const __m128i);
        let pairs = _mm_unpacklo_epi8(a, b);
        let s = if signed {
            _mm256_cvtepi8_epi16(pairs)
        } else {
            _mm256_cvtepu8_epi16(_mm_and_si128(
                _mm_srli_epi16::<4>(pairs),
                _mm_set1_epi8(0x0F),
            ))
        };
        let bsums = _mm256_set1_epi32(pair_i16(&y.bsums[j..]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(s, bsums));
    }
    sum
}

/// Two adjacent i16 as one i32 (the first in the low half).
#[inline(always)]
fn pair_i16(v: &[i16]) -> i32 {
    (v[0] as u16 as u32 | (v[1] as u16 as u32) << 16) as i32
}

impl TileKernel for Q2K {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ2K,
        h0: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        let mut total = [[_mm256_setzero_si256(); T]; H];
        for g in 0..16 {
            let p16 = isum_crumbs::<0, H, T>(&t.qs[g], None, g, h0, ys);
            for k in 0..H {
                let sc = nibbles16(&t.scm[g], h0 + k, false);
                for i in 0..T {
                    total[k][i] = _mm256_add_epi32(total[k][i], _mm256_madd_epi16(p16[k][i], sc));
                }
            }
        }
        total
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ2K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.d, h))
    }
    /// −(d_y · dmin) · Σ_j m_j · bsum_j, per row of half `h` (|m · bsum| ≤ 15 · 2 032: a pair
    /// of them fits madd's i32).
    #[inline(always)]
    unsafe fn min(t: &TileQ2K, h: usize, y: &BlockQ8K) -> __m256 {
        let msum = sub_block_sums(&t.scm, h, false, y);
        let dd = _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.dmin, h));
        let neg = _mm256_xor_ps(dd, _mm256_set1_ps(-0.0));
        _mm256_mul_ps(neg, _mm256_cvtepi32_ps(msum))
    }
}

impl TileKernel for Q3K {
    /// Per group g: madd of the pair sums with the signed scale; then less 4 · Σ_g sc_g · bsum_g
    /// (the −4 offset, [`sub_block_sums`]). A pair of groups shares its `hb` bytes, so the groups
    /// go in pairs, each with its own constant shifts.
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileQ3K,
        h0: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        let mut total = [[_mm256_setzero_si256(); T]; H];
        let mut add = |g: usize, p16: [[__m256i; T]; H]| {
            for k in 0..H {
                let sc = scales16(bytemuck::cast_ref(&t.sc[g]), h0 + k, true);
                for i in 0..T {
                    total[k][i] = _mm256_add_epi32(total[k][i], _mm256_madd_epi16(p16[k][i], sc));
                }
            }
        };
        for pair in 0..8 {
            let hb: [__m256i; H] = std::array::from_fn(|k| half(t.hb(2 * pair), h0 + k));
            let g = 2 * pair;
            add(g, isum_crumbs::<0, H, T>(t.qs(g), Some(hb), g, h0, ys));
            add(
                g + 1,
                isum_crumbs::<1, H, T>(t.qs(g + 1), Some(hb), g + 1, h0, ys),
            );
        }
        let sc: &[[u8; TR]; 16] = bytemuck::cast_ref(&t.sc);
        std::array::from_fn(|k| {
            std::array::from_fn(|i| {
                let offset = sub_block_sums(sc, h0 + k, true, ys[i]);
                _mm256_sub_epi32(total[k][i], _mm256_slli_epi32::<2>(offset))
            })
        })
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ3K, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.d, h))
    }
}

/// Halves `h0..h0+H`: Σ_j sc_j · Σ q·y over a staged grid tile. Per 4 values, maddubs of the
/// biased activations (y + 128, unsigned) with the signed values (a pair ≤ 2·255·62 = 31 620),
/// widened by `madd` with the rows' i16 scales; the bias's term taken off once per block.
#[inline(always)]
unsafe fn isum_grid<const H: usize, const T: usize>(
    t: &TileGrid,
    h0: usize,
    ys: [&BlockQ8K; T],
) -> [[__m256i; T]; H] {
    let mut acc = [[_mm256_setzero_si256(); T]; H];
    for j in 0..16 {
        for (k, acc) in acc.iter_mut().enumerate() {
            let h = h0 + k;
            // Row r's i16 scale in both i16 halves of its i32 lane.
            let s = _mm256_cvtepi16_epi32(load16(&t.sc[j][8 * h..]));
            let sc = _mm256_or_si256(
                _mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)),
                _mm256_slli_epi32::<16>(s),
            );
            for g in 4 * j..4 * j + 4 {
                let w = half(&t.q[g], h);
                for (a, y) in acc.iter_mut().zip(&ys) {
                    let p = _mm256_maddubs_epi16(bcast4(&y.qs[4 * g..]), w);
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(p, sc));
                }
            }
        }
    }
    for (k, acc) in acc.iter_mut().enumerate() {
        let bias = load32(&t.bias[8 * (h0 + k)..]);
        for a in acc.iter_mut() {
            *a = _mm256_sub_epi32(*a, bias);
        }
    }
    acc
}

macro_rules! grid_tile_kernel {
    ($($f:ty),*) => {$(
        impl TileKernel for $f {
            #[inline(always)]
            unsafe fn isum<const H: usize, const T: usize>(
                t: &TileGrid,
                h0: usize,
                ys: [&BlockQ8K; T],
                _: [i32; T],
            ) -> [[__m256i; T]; H] {
                isum_grid(t, h0, ys)
            }
            #[inline(always)]
            unsafe fn scale(t: &TileGrid, h: usize, y: &BlockQ8K) -> __m256 {
                _mm256_mul_ps(_mm256_set1_ps(y.d), _mm256_loadu_ps(t.d[8 * h..].as_ptr()))
            }
        }
    )*};
}

grid_tile_kernel!(IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S, IQ1M);

/// Halves `h0..h0+H`: per 32-value group run of table indices (`qs[g]`: values 8g..8g+8 of each
/// row), the values looked up (signed KVALUES) and multiplied by `y` with the sign trick
/// (|v| times y with v's sign: a pair ≤ 2·127·127 = 32 258, so each is widened by `madd` at
/// once, with `sc`: 1, or the rows' sub-block scales), added to `acc`.
#[inline(always)]
unsafe fn isum_table<const H: usize, const T: usize>(
    qs: &[[u8; 4 * TR]],
    y0: usize,
    h0: usize,
    ys: [&[i8]; T],
    sc: [__m256i; H],
    mut acc: [[__m256i; T]; H],
) -> [[__m256i; T]; H] {
    let table = {
        let t = load16(&KVALUES);
        _mm256_set_m128i(t, t)
    };
    for (g, group) in qs.iter().enumerate() {
        for k in 0..H {
            let [lo, hi] = unpack_group(half(group, h0 + k), None, g);
            let v = [
                _mm256_shuffle_epi8(table, lo),
                _mm256_shuffle_epi8(table, hi),
            ];
            let a = v.map(|v| _mm256_sign_epi8(v, v));
            for i in 0..T {
                let y = &ys[i][y0 + 8 * g..];
                for (n, (v, a)) in v.iter().zip(a).enumerate() {
                    let sy = _mm256_sign_epi8(bcast4(&y[4 * n..]), *v);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, sy), sc[k]);
                    acc[k][i] = _mm256_add_epi32(acc[k][i], p);
                }
            }
        }
    }
    acc
}

impl TileKernel for IQ4NL {
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileIQ4NL,
        h0: usize,
        ys: [&BlockQ8_0; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        let one = [_mm256_set1_epi16(1); H];
        let zero = [[_mm256_setzero_si256(); T]; H];
        isum_table(&t.qs, 0, h0, ys.map(|y| &y.qs[..]), one, zero)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileIQ4NL, h: usize, y: &BlockQ8_0) -> __m256 {
        _mm256_mul_ps(half_f32(&t.d, h), _mm256_set1_ps(y.d))
    }
}

impl TileKernel for IQ4XS {
    /// Per sub-block j, the products widened by `madd` with the rows' signed scales
    /// (|32 258 · 2 · 32| per lane and step: far within i32).
    #[inline(always)]
    unsafe fn isum<const H: usize, const T: usize>(
        t: &TileIQ4XS,
        h0: usize,
        ys: [&BlockQ8K; T],
        _: [i32; T],
    ) -> [[__m256i; T]; H] {
        let mut acc = [[_mm256_setzero_si256(); T]; H];
        for j in 0..8 {
            let sc: [__m256i; H] =
                std::array::from_fn(|k| scales16(bytemuck::cast_ref(&t.sc[j]), h0 + k, true));
            let qs = &t.qs[4 * j..4 * j + 4];
            acc = isum_table(qs, 32 * j, h0, ys.map(|y| &y.qs[..]), sc, acc);
        }
        acc
    }
    #[inline(always)]
    unsafe fn scale(t: &TileIQ4XS, h: usize, y: &BlockQ8K) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(y.d), half_f32(&t.d, h))
    }
}

/// Asks for tile `b`'s cache lines ahead of their use, for tiles under 2 KB: the legacy formats'
/// (288–544 B) and Q2_K's and Q3_K's (1.3 and 1.8 KB), [`AHEAD`] tiles ahead into L1. A decode
/// reads each weight once, from memory, and for these the hardware prefetcher alone left the
/// loads waiting (perf on l1b-Q3_K_M: half the decode kernel's samples on the first load of a
/// tile's third bits). l1b-Q3_K_M decode at 128, alternating, on the AVX2-only EPYC, 2026-12-04:
/// 61.9 / 59.1 / 70.4 ms/token without, 56.0 / 53.1 / 62.4 with; l1b-Q2_K 43.9 / 44.2 / 50.5
/// against 44.1 / 40.4 / 43.6. Larger tiles (Q4_K's and up, 2.2–3.4 KB) are left to the hardware
/// prefetcher: asking for them too measured no faster on Q3_K_M (its Q4_K/Q5_K matrices), and 6
/// tiles ahead into L2 (as from 4046dbf) measured slower than not asking, 2026-12-02 on the same
/// CPU: a 32768×2048 / 8192×8192 Q6_K decode 4.46 / 4.71 ms against 3.48 / 3.89
/// (`quant::tests::speed`), and `kvchat bench --contexts 128 --gen 32` on the 1B-shaped files,
/// alternating, medians of 5 / 2 / 3 rounds: Q6_K 76.9 against 70.6 ms/token, Q5_K_M 80.0 against
/// 76.9, Q4_K_M 69.1 against 53.3.
#[inline(always)]
unsafe fn prefetch<Tile>(tiles: &[Tile], b: usize) {
    if std::mem::size_of::<Tile>() >= 2048 {
        return;
    }
    if let Some(t) = tiles.get(b + AHEAD) {
        let p = t as *const Tile as *const i8;
        for off in (0..std::mem::size_of::<Tile>()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
        }
    }
}

/// Tiles ahead that [`prefetch`] asks for.
const AHEAD: usize = 2;

/// The 16 rows' dot products over all blocks with T activation rows (`ys[i]`, `ysums[i]` per
/// block), in [`dot_rows_scalar`]'s order. One token (decode) takes both halves of each weight
/// vector at once, so each tile is read once, in order; more tokens run the halves one after
/// the other (their accumulators for 4 tokens fill AVX2's registers).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot16<F: TileKernel, const T: usize>(
    tiles: &[F::Tile],
    ys: [&[F::Act]; T],
    ysums: [&[i32]; T],
) -> [[f32; TR]; T] {
    if T == 1 {
        dot_halves::<F, 2, T>(tiles, 0, ys, ysums)
    } else {
        let (a, b) = (
            dot_halves::<F, 1, T>(tiles, 0, ys, ysums),
            dot_halves::<F, 1, T>(tiles, 1, ys, ysums),
        );
        std::array::from_fn(|i| std::array::from_fn(|r| if r < 8 { a[i][r] } else { b[i][r] }))
    }
}

/// Rows of halves `h0..h0+H` (the rest of each output row left 0).
#[inline(always)]
unsafe fn dot_halves<F: TileKernel, const H: usize, const T: usize>(
    tiles: &[F::Tile],
    h0: usize,
    ys: [&[F::Act]; T],
    ysums: [&[i32]; T],
) -> [[f32; TR]; T] {
    let mut acc = [[_mm256_setzero_ps(); T]; H];
    let mut summ = [[_mm256_setzero_ps(); T]; H];
    for (b, tile) in tiles.iter().enumerate() {
        if h0 == 0 {
            prefetch(tiles, b);
        }
        let y: [&F::Act; T] = std::array::from_fn(|i| &ys[i][b]);
        let s: [i32; T] = std::array::from_fn(|i| if F::YSUM { ysums[i][b] } else { 0 });
        let isum = F::isum::<H, T>(tile, h0, y, s);
        for k in 0..H {
            for i in 0..T {
                acc[k][i] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(isum[k][i]),
                    <F as TileKernel>::scale(tile, h0 + k, y[i]),
                    acc[k][i],
                );
                if F::HAS_MIN {
                    summ[k][i] =
                        _mm256_add_ps(summ[k][i], <F as TileKernel>::min(tile, h0 + k, y[i]));
                }
            }
        }
    }
    let mut out = [[0f32; TR]; T];
    for k in 0..H {
        for i in 0..T {
            let at = out[i][8 * (h0 + k)..].as_mut_ptr();
            _mm256_storeu_ps(at, _mm256_add_ps(acc[k][i], summ[k][i]));
        }
    }
    out
}
