//! A super-block unpacked into vectors of quants (in value order) and of i16 sub-block scales;
//! its lanes are Σ_c madd(scale_c, maddubs(q_c, y_c)) over chunks of 32 values (AVX2) or of
//! 64 with VNNI's dpwssd, folded to 8 lanes (the same integers). The mins of Q4_K/Q5_K are
//! unpacked once too, for the min term.

use super::super::avx2::{fold, join, load16, load32, load64};
use super::*;
use std::arch::x86_64::*;

#[derive(Clone, Copy)]
pub struct Unpacked {
    q: [__m256i; 8],
    sc: [__m256i; 8],
    mins: [u8; 8],
}

#[derive(Clone, Copy)]
pub struct Unpacked512 {
    q: [__m512i; 4],
    sc: [__m512i; 4],
    mins: [u8; 8],
}

/// Σ_c madd(sc_c, maddubs(q_c, y_c)) over the 8 chunks of 32 (u8 quants × i8 activations).
#[inline(always)]
unsafe fn ilanes_u8(u: &Unpacked, y: &BlockQ8K) -> __m256i {
    let mut sum = _mm256_setzero_si256();
    for c in 0..8 {
        let yc = load32(&y.qs[32 * c..32 * c + 32]);
        let p = _mm256_maddubs_epi16(u.q[c], yc);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[c], p));
    }
    sum
}

/// The same lanes with 64-byte maddubs and dpwssd (scale pairs times i16 pair sums, added).
#[inline(always)]
unsafe fn ilanes_u8_512(u: &Unpacked512, y: &BlockQ8K) -> __m256i {
    let mut sum = _mm512_setzero_si512();
    for c in 0..4 {
        let yc = load64(&y.qs[64 * c..64 * c + 64]);
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u.q[c], yc), u.sc[c]);
    }
    fold(sum)
}

/// The 4-bit quants of a Q4_K/Q5_K super-block, chunk c = values 32c..32c+32.
#[inline(always)]
unsafe fn nibbles(qs: &[u8; 128]) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut q = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        let bits = load32(&qs[32 * j..32 * j + 32]);
        q[2 * j] = _mm256_and_si256(bits, m4);
        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    }
    q
}

/// Q5_K's fifth bits added to chunk c's quants (bit c of each qh byte, moved to bit 4).
#[inline(always)]
unsafe fn fifth_bits(q: &mut [__m256i; 8], qh: &[u8; 32]) {
    let qh = load32(qh);
    let one = _mm256_set1_epi8(1);
    for (c, q) in q.iter_mut().enumerate() {
        let bit = match c {
            0 => qh,
            1 => _mm256_srli_epi16(qh, 1),
            2 => _mm256_srli_epi16(qh, 2),
            3 => _mm256_srli_epi16(qh, 3),
            4 => _mm256_srli_epi16(qh, 4),
            5 => _mm256_srli_epi16(qh, 5),
            6 => _mm256_srli_epi16(qh, 6),
            _ => _mm256_srli_epi16(qh, 7),
        };
        *q = _mm256_or_si256(*q, _mm256_slli_epi16(_mm256_and_si256(bit, one), 4));
    }
}

/// The min term from unpacked mins: the same integer and float operations as `min_term_k`.
#[inline(always)]
unsafe fn min_k(dmin: f16, mins: &[u8; 8], y: &BlockQ8K) -> f32 {
    // Sums of each 32 activations (pairs of 16-value sums), times the mins, added: exact.
    let b = load32(&y.bsums);
    let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
    let m = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
    let p = _mm_madd_epi16(m, pairs);
    let p = _mm_add_epi32(p, _mm_shuffle_epi32::<0b01_00_11_10>(p));
    let p = _mm_add_epi32(p, _mm_shuffle_epi32::<0b10_11_00_01>(p));
    let msum = _mm_cvtsi128_si32(p);
    -(y.d * dmin.to_f32()) * msum as f32
}

/// The 8 sub-block scales of Q4_K/Q5_K, one i16 broadcast per chunk, and the mins.
#[inline(always)]
unsafe fn scales8(scales: &[u8; 12]) -> ([__m256i; 8], [u8; 8]) {
    let (sc, m) = scales_mins(scales);
    (sc.map(|s| _mm256_set1_epi16(s as i16)), m)
}

/// Chunks of 32 paired into chunks of 64, with their i16 scale vectors.
#[inline(always)]
unsafe fn to512(q: &[__m256i; 8], sc: &[__m256i; 8], mins: [u8; 8]) -> Unpacked512 {
    Unpacked512 {
        q: std::array::from_fn(|c| join(q[2 * c], q[2 * c + 1])),
        sc: std::array::from_fn(|c| join(sc[2 * c], sc[2 * c + 1])),
        mins,
    }
}

impl Avx2 for Q4K {
    type Unpacked = Unpacked;
    #[inline(always)]
    unsafe fn unpack(x: &BlockQ4K) -> Unpacked {
        let (sc, mins) = scales8(&x.scales);
        Unpacked {
            q: nibbles(&x.qs),
            sc,
            mins,
        }
    }
    #[inline(always)]
    unsafe fn ilanes(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        ilanes_u8(u, y)
    }
    #[inline(always)]
    unsafe fn min_u(u: &Unpacked, x: &BlockQ4K, y: &BlockQ8K) -> f32 {
        min_k(x.dmin, &u.mins, y)
    }
    type U512 = Unpacked512;
    #[inline(always)]
    unsafe fn unpack512(x: &BlockQ4K) -> Unpacked512 {
        let (sc, mins) = scales8(&x.scales);
        to512(&nibbles(&x.qs), &sc, mins)
    }
    #[inline(always)]
    unsafe fn ilanes512(u: &Unpacked512, y: &BlockQ8K) -> __m256i {
        ilanes_u8_512(u, y)
    }
    #[inline(always)]
    unsafe fn min512(u: &Unpacked512, x: &BlockQ4K, y: &BlockQ8K) -> f32 {
        min_k(x.dmin, &u.mins, y)
    }
}

impl Avx2 for Q5K {
    type Unpacked = Unpacked;
    #[inline(always)]
    unsafe fn unpack(x: &BlockQ5K) -> Unpacked {
        let mut q = nibbles(&x.qs);
        fifth_bits(&mut q, &x.qh);
        let (sc, mins) = scales8(&x.scales);
        Unpacked { q, sc, mins }
    }
    #[inline(always)]
    unsafe fn ilanes(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        ilanes_u8(u, y)
    }
    #[inline(always)]
    unsafe fn min_u(u: &Unpacked, x: &BlockQ5K, y: &BlockQ8K) -> f32 {
        min_k(x.dmin, &u.mins, y)
    }
    type U512 = Unpacked512;
    #[inline(always)]
    unsafe fn unpack512(x: &BlockQ5K) -> Unpacked512 {
        let mut q = nibbles(&x.qs);
        fifth_bits(&mut q, &x.qh);
        let (sc, mins) = scales8(&x.scales);
        to512(&q, &sc, mins)
    }
    #[inline(always)]
    unsafe fn ilanes512(u: &Unpacked512, y: &BlockQ8K) -> __m256i {
        ilanes_u8_512(u, y)
    }
    #[inline(always)]
    unsafe fn min512(u: &Unpacked512, x: &BlockQ5K, y: &BlockQ8K) -> f32 {
        min_k(x.dmin, &u.mins, y)
    }
}

/// Q6_K's quants as 0..64 (the −32 is taken off in the lanes), chunk c = values 32c..32c+32,
/// and the chunks' scales ([`scales16`]).
#[inline(always)]
unsafe fn unpack_q6(x: &BlockQ6K) -> ([__m256i; 8], [__m256i; 8]) {
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(3);
    let mut q = [_mm256_setzero_si256(); 8];
    for n in 0..2 {
        let a = load32(&x.ql[64 * n..64 * n + 32]);
        let b = load32(&x.ql[64 * n + 32..64 * n + 64]);
        let h = load32(&x.qh[32 * n..32 * n + 32]);
        let hi = |v: __m256i| _mm256_slli_epi16(_mm256_and_si256(v, m2), 4);
        q[4 * n] = _mm256_or_si256(_mm256_and_si256(a, m4), hi(h));
        q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(b, m4), hi(_mm256_srli_epi16(h, 2)));
        q[4 * n + 2] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
            hi(_mm256_srli_epi16(h, 4)),
        );
        q[4 * n + 3] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
            hi(_mm256_srli_epi16(h, 6)),
        );
    }
    (q, scales16(load16(&x.scales)))
}

/// Per chunk of 32 values, its two sub-blocks' i16 scales: `s[2c]` for the first 16 values (the
/// low 8 i16 lanes of the pair sums), `s[2c + 1]` for the rest; `s` the 16 i8 scales.
#[inline(always)]
unsafe fn scales16(s: __m128i) -> [__m256i; 8] {
    // i32 lane c of `w` holds s[2c] and s[2c + 1] as i16; broadcast it, then spread the first
    // i16 over the low 128 bits and the second over the high.
    let w = _mm256_cvtepi8_epi16(s);
    let spread = _mm256_set_epi64x(
        0x0302_0302_0302_0302,
        0x0302_0302_0302_0302,
        0x0100_0100_0100_0100,
        0x0100_0100_0100_0100,
    );
    std::array::from_fn(|c| {
        let pair = _mm256_permutevar8x32_epi32(w, _mm256_set1_epi32(c as i32));
        _mm256_shuffle_epi8(pair, spread)
    })
}

/// The 2-bit quants of a Q2_K/Q3_K super-block as bytes 0..4, chunk c = values 32c..32c+32.
#[inline(always)]
unsafe fn crumbs(qs: &[u8; 64]) -> [__m256i; 8] {
    let m2 = _mm256_set1_epi8(3);
    let mut q = [_mm256_setzero_si256(); 8];
    for n in 0..2 {
        let bits = load32(&qs[32 * n..32 * n + 32]);
        q[4 * n] = _mm256_and_si256(bits, m2);
        q[4 * n + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 2), m2);
        q[4 * n + 2] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m2);
        q[4 * n + 3] = _mm256_and_si256(_mm256_srli_epi16(bits, 6), m2);
    }
    q
}

/// Σ_c madd(sc_c, maddubs(q_c, y_c) − maddubs(off, y_c)) over the 8 chunks: the lanes of
/// weights sc·(q − off) with q unsigned (Q3_K's −4, Q6_K's −32; off = 0 for none).
#[inline(always)]
unsafe fn ilanes_offset(u: &Unpacked, y: &BlockQ8K, off: i8) -> __m256i {
    let m = _mm256_set1_epi8(off);
    let mut sum = _mm256_setzero_si256();
    for c in 0..8 {
        let yc = load32(&y.qs[32 * c..32 * c + 32]);
        let p = _mm256_sub_epi16(
            _mm256_maddubs_epi16(u.q[c], yc),
            _mm256_maddubs_epi16(m, yc),
        );
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[c], p));
    }
    sum
}

// Q2_K and Q3_K: AVX2's lanes under VNNI too (their AVX-512 unpacking would be the same
// integers; these formats are not on the speed targets' list).
impl Avx2 for Q2K {
    type Unpacked = Unpacked;
    #[inline(always)]
    unsafe fn unpack(x: &BlockQ2K) -> Unpacked {
        // u8 quants 0..4 times i8 activations: pair sums ≤ 2·3·128, exact in i16.
        Unpacked {
            q: crumbs(&x.qs),
            sc: scales16(_mm_and_si128(load16(&x.scales), _mm_set1_epi8(0x0F))),
            mins: [0; 8],
        }
    }
    #[inline(always)]
    unsafe fn ilanes(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        ilanes_u8(u, y)
    }
    #[inline(always)]
    unsafe fn min_u(_u: &Unpacked, x: &BlockQ2K, y: &BlockQ8K) -> f32 {
        min_q2(x, y)
    }
    type U512 = Unpacked;
    #[inline(always)]
    unsafe fn unpack512(x: &BlockQ2K) -> Unpacked {
        Self::unpack(x)
    }
    #[inline(always)]
    unsafe fn ilanes512(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        ilanes_u8(u, y)
    }
    #[inline(always)]
    unsafe fn min512(_u: &Unpacked, x: &BlockQ2K, y: &BlockQ8K) -> f32 {
        min_q2(x, y)
    }
}

/// Q2_K's min term: the same integer and float operations as `min_term_q2`.
#[inline(always)]
unsafe fn min_q2(x: &BlockQ2K, y: &BlockQ8K) -> f32 {
    // The 16 mins (high nibbles) times the 16 sums of 16 activations, added: exact.
    let m = _mm256_cvtepu8_epi16(_mm_and_si128(
        _mm_srli_epi16(load16(&x.scales), 4),
        _mm_set1_epi8(0x0F),
    ));
    let p = _mm256_madd_epi16(m, load32(&y.bsums));
    let p = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256::<1>(p));
    let p = _mm_add_epi32(p, _mm_shuffle_epi32::<0b01_00_11_10>(p));
    let p = _mm_add_epi32(p, _mm_shuffle_epi32::<0b10_11_00_01>(p));
    -(y.d * x.dmin.to_f32()) * _mm_cvtsi128_si32(p) as f32
}

impl Avx2 for Q3K {
    type Unpacked = Unpacked;
    #[inline(always)]
    unsafe fn unpack(x: &BlockQ3K) -> Unpacked {
        // The third bit of chunk c is bit c of each hmask byte, moved to bit 2.
        let mut q = crumbs(&x.qs);
        let h = load32(&x.hmask);
        let one = _mm256_set1_epi8(1);
        for (c, q) in q.iter_mut().enumerate() {
            let bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(c as i32)), one);
            *q = _mm256_or_si256(*q, _mm256_slli_epi16(bit, 2));
        }
        Unpacked {
            q,
            sc: scales16(load16(&scales_q3(&x.scales))),
            mins: [0; 8],
        }
    }
    #[inline(always)]
    unsafe fn ilanes(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        // q of 0..8: each maddubs pair sum ≤ 2·7·128, their difference exact in i16.
        ilanes_offset(u, y, 4)
    }
    type U512 = Unpacked;
    #[inline(always)]
    unsafe fn unpack512(x: &BlockQ3K) -> Unpacked {
        Self::unpack(x)
    }
    #[inline(always)]
    unsafe fn ilanes512(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        ilanes_offset(u, y, 4)
    }
}

impl Avx2 for Q6K {
    type Unpacked = Unpacked;
    #[inline(always)]
    unsafe fn unpack(x: &BlockQ6K) -> Unpacked {
        let (q, sc) = unpack_q6(x);
        Unpacked {
            q,
            sc,
            mins: [0; 8],
        }
    }
    #[inline(always)]
    unsafe fn ilanes(u: &Unpacked, y: &BlockQ8K) -> __m256i {
        ilanes_offset(u, y, 32)
    }
    type U512 = Unpacked512;
    #[inline(always)]
    unsafe fn unpack512(x: &BlockQ6K) -> Unpacked512 {
        let (q, sc) = unpack_q6(x);
        to512(&q, &sc, [0; 8])
    }
    #[inline(always)]
    unsafe fn ilanes512(u: &Unpacked512, y: &BlockQ8K) -> __m256i {
        let m32 = _mm512_set1_epi8(32);
        let mut sum = _mm512_setzero_si512();
        for c in 0..4 {
            let yc = load64(&y.qs[64 * c..64 * c + 64]);
            let p = _mm512_sub_epi16(
                _mm512_maddubs_epi16(u.q[c], yc),
                _mm512_maddubs_epi16(m32, yc),
            );
            sum = _mm512_dpwssd_epi32(sum, p, u.sc[c]);
        }
        fold(sum)
    }
}
