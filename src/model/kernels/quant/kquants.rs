//! The K-quants: super-blocks of 256 values in sub-blocks with their own integer scales (GGUF
//! layouts, ggml's `block_q2_K` … `block_q6_K`), paired with Q8_K activations.
//! Each gives its integer weights (sub-block scale × quant) per element for the driver's one
//! summation order, and an AVX2 unpack + integer dot in `avx2`.

use super::{lane, Avx2, BlockQ8K, Format};
use bytemuck::{Pod, Zeroable};
use candle_core::quantized::GgmlDType;
use half::f16;

/// Q4_K: `{d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]}`; 8 sub-blocks of 32 with 6-bit
/// scale and min, w = d·sc·q − dmin·m. In each 64 values, low nibbles of 32 bytes hold the first
/// 32, high nibbles the next 32.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// Q5_K: Q4_K plus `qh: [u8; 32]`, bit 2j (2j+1) of `qh[l]` the fifth bit of value 64j + l
/// (64j + 32 + l).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// Q6_K: `{ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16}`; 16 sub-blocks of 16 with i8
/// scales, w = d·sc·(q − 32), q of 6 bits (4 in `ql`, 2 in `qh`; see [`q6`]).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

/// Q2_K: `{scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16}`; 16 sub-blocks of 16, each byte of
/// `scales` a 4-bit scale (low) and min (high), w = d·sc·q − dmin·m, q of 2 bits (see [`q2`]).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: f16,
    pub dmin: f16,
}

/// Q3_K: `{hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16}`; 16 sub-blocks of 16 with
/// 6-bit scales stored +32 (see [`scales_q3`]), w = d·(sc − 32)·(q − 4), q of 3 bits: 2 in `qs`
/// as Q2_K's, the third in `hmask` (see [`q3`]).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: f16,
}

/// Value `e`'s 2-bit quant in a Q2_K/Q3_K super-block: in each 128 values, bits 2j..2j+2 of the
/// 32 bytes hold values 32j..32j+32.
#[inline(always)]
pub(super) fn q2(qs: &[u8; 64], e: usize) -> i32 {
    let (n, p) = (e / 128, e % 128);
    ((qs[32 * n + p % 32] >> (2 * (p / 32))) & 3) as i32
}

/// Value `e`'s 3-bit quant (0..8) in a Q3_K super-block: its 2 low bits, and bit `e / 32` of
/// `hmask[e % 32]` as 4.
#[inline(always)]
pub(super) fn q3(x: &BlockQ3K, e: usize) -> i32 {
    q2(&x.qs, e) | ((((x.hmask[e % 32] >> (e / 32)) & 1) as i32) << 2)
}

/// The 12 packed scale bytes of a Q3_K/Q4_K/Q5_K super-block as three little-endian words, as
/// ggml's unpacking reads them.
#[inline(always)]
fn words(q: &[u8; 12]) -> [u32; 3] {
    std::array::from_fn(|i| {
        u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]])
    })
}

/// The 16 6-bit scales of a Q3_K super-block, less 32 (ggml's unpacking: scale j's low 4 bits are
/// nibble j of bytes 0..8, its high 2 bits bits 2·(j / 4)… of byte 8 + j % 4).
#[inline(always)]
pub(super) fn scales_q3(q: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x03030303;
    const KMASK2: u32 = 0x0f0f0f0f;
    let [a0, a1, tmp] = words(q);
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, b) in out.iter_mut().zip(aux.iter().flat_map(|a| a.to_le_bytes())) {
        *o = b as i8 - 32;
    }
    out
}

/// The 8 6-bit scales and mins of a Q4_K/Q5_K super-block (ggml's `get_scale_min_k4`).
#[inline(always)]
/// Done on three u32 words as llama.cpp's kernels do: scale j < 4 is the low 6 bits of byte j,
/// min j < 4 those of byte j + 4; scale/min j ≥ 4 take their low 4 bits from byte j + 4 and their
/// high 2 from the top bits of byte j − 4 / j.
pub(super) fn scales_mins(q: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let [u0, u1, u2] = words(q);
    let sc_lo = u0 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let join = |lo: u32, hi: u32| (lo as u64 | ((hi as u64) << 32)).to_le_bytes();
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
}

/// Value `e`'s 4-bit quant in a Q4_K/Q5_K super-block.
#[inline(always)]
pub(super) fn nibble(qs: &[u8; 128], e: usize) -> i32 {
    let (j, p) = (e / 64, e % 64);
    let b = qs[32 * j + p % 32];
    (if p < 32 { b & 0x0F } else { b >> 4 }) as i32
}

/// Value `e`'s fifth bit in a Q5_K super-block, as 16 or 0.
#[inline(always)]
pub(super) fn fifth(qh: &[u8; 32], e: usize) -> i32 {
    (((qh[e % 32] >> (e / 32)) & 1) << 4) as i32
}

/// Value `e`'s 6-bit quant (0..64) in a Q6_K super-block.
#[inline(always)]
pub(super) fn q6(x: &BlockQ6K, e: usize) -> i32 {
    let (n, p) = (e / 128, e % 128);
    let (k, l) = (p / 32, p % 32);
    let ql = x.ql[64 * n + 32 * (k % 2) + l];
    let low = if k < 2 { ql & 0x0F } else { ql >> 4 };
    let high = (x.qh[32 * n + l] >> (2 * k)) & 3;
    (low | (high << 4)) as i32
}

/// The 8 lanes of Σ w(e)·y(e) over a 256-value super-block.
#[inline(always)]
fn lanes256(w: impl Fn(usize) -> i32, y: &[i8; 256]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (e, &y) in y.iter().enumerate() {
        l[lane(e)] += w(e) * y as i32;
    }
    l
}

/// The min term of a Q4_K/Q5_K super-block: −dmin·d_y·Σ_j m_j·(sum of y over sub-block j).
#[inline(always)]
fn min_term_k(dmin: f16, mins: &[u8; 8], y: &BlockQ8K) -> f32 {
    let msum: i32 = (0..8)
        .map(|j| mins[j] as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32))
        .sum();
    -(y.d * dmin.to_f32()) * msum as f32
}

/// The min term of a Q2_K super-block: −dmin·d_y·Σ_j m_j·(sum of y over sub-block j of 16).
#[inline(always)]
fn min_term_q2(x: &BlockQ2K, y: &BlockQ8K) -> f32 {
    let msum: i32 = (0..16)
        .map(|j| (x.scales[j] >> 4) as i32 * y.bsums[j] as i32)
        .sum();
    -(y.d * x.dmin.to_f32()) * msum as f32
}

pub struct Q2K;
pub struct Q3K;
pub struct Q4K;
pub struct Q5K;
pub struct Q6K;

impl Format for Q2K {
    type Block = BlockQ2K;
    type Act = BlockQ8K;
    const N: usize = 256;
    const DTYPE: GgmlDType = GgmlDType::Q2K;
    const HAS_MIN: bool = true;
    fn dequantize(x: &BlockQ2K, out: &mut [f32]) {
        let (d, dmin) = (x.d.to_f32(), x.dmin.to_f32());
        for (e, o) in out.iter_mut().enumerate() {
            let s = x.scales[e / 16];
            // ggml's order of operations: (d·sc)·q − (dmin·m).
            *o = d * (s & 0xF) as f32 * q2(&x.qs, e) as f32 - dmin * (s >> 4) as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ2K, y: &BlockQ8K) -> [i32; 8] {
        lanes256(|e| (x.scales[e / 16] & 0xF) as i32 * q2(&x.qs, e), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ2K, y: &BlockQ8K) -> f32 {
        y.d * x.d.to_f32()
    }
    #[inline(always)]
    fn min_term(x: &BlockQ2K, y: &BlockQ8K) -> f32 {
        min_term_q2(x, y)
    }
}

impl Format for Q3K {
    type Block = BlockQ3K;
    type Act = BlockQ8K;
    const N: usize = 256;
    const DTYPE: GgmlDType = GgmlDType::Q3K;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockQ3K, out: &mut [f32]) {
        let d = x.d.to_f32();
        let sc = scales_q3(&x.scales);
        for (e, o) in out.iter_mut().enumerate() {
            *o = d * sc[e / 16] as f32 * (q3(x, e) - 4) as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ3K, y: &BlockQ8K) -> [i32; 8] {
        let sc = scales_q3(&x.scales);
        lanes256(|e| sc[e / 16] as i32 * (q3(x, e) - 4), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ3K, y: &BlockQ8K) -> f32 {
        y.d * x.d.to_f32()
    }
    #[inline(always)]
    fn min_term(_: &BlockQ3K, _: &BlockQ8K) -> f32 {
        0.0
    }
}

impl Format for Q4K {
    type Block = BlockQ4K;
    type Act = BlockQ8K;
    const N: usize = 256;
    const DTYPE: GgmlDType = GgmlDType::Q4K;
    const HAS_MIN: bool = true;
    fn dequantize(x: &BlockQ4K, out: &mut [f32]) {
        let (sc, m) = scales_mins(&x.scales);
        let (d, dmin) = (x.d.to_f32(), x.dmin.to_f32());
        for (e, o) in out.iter_mut().enumerate() {
            let j = e / 32;
            *o = d * sc[j] as f32 * nibble(&x.qs, e) as f32 - dmin * m[j] as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ4K, y: &BlockQ8K) -> [i32; 8] {
        let (sc, _) = scales_mins(&x.scales);
        lanes256(|e| sc[e / 32] as i32 * nibble(&x.qs, e), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ4K, y: &BlockQ8K) -> f32 {
        y.d * x.d.to_f32()
    }
    #[inline(always)]
    fn min_term(x: &BlockQ4K, y: &BlockQ8K) -> f32 {
        min_term_k(x.dmin, &scales_mins(&x.scales).1, y)
    }
}

impl Format for Q5K {
    type Block = BlockQ5K;
    type Act = BlockQ8K;
    const N: usize = 256;
    const DTYPE: GgmlDType = GgmlDType::Q5K;
    const HAS_MIN: bool = true;
    fn dequantize(x: &BlockQ5K, out: &mut [f32]) {
        let (sc, m) = scales_mins(&x.scales);
        let (d, dmin) = (x.d.to_f32(), x.dmin.to_f32());
        for (e, o) in out.iter_mut().enumerate() {
            let j = e / 32;
            let q = nibble(&x.qs, e) | fifth(&x.qh, e);
            *o = d * sc[j] as f32 * q as f32 - dmin * m[j] as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ5K, y: &BlockQ8K) -> [i32; 8] {
        let (sc, _) = scales_mins(&x.scales);
        lanes256(
            |e| sc[e / 32] as i32 * (nibble(&x.qs, e) | fifth(&x.qh, e)),
            &y.qs,
        )
    }
    #[inline(always)]
    fn scale(x: &BlockQ5K, y: &BlockQ8K) -> f32 {
        y.d * x.d.to_f32()
    }
    #[inline(always)]
    fn min_term(x: &BlockQ5K, y: &BlockQ8K) -> f32 {
        min_term_k(x.dmin, &scales_mins(&x.scales).1, y)
    }
}

impl Format for Q6K {
    type Block = BlockQ6K;
    type Act = BlockQ8K;
    const N: usize = 256;
    const DTYPE: GgmlDType = GgmlDType::Q6K;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockQ6K, out: &mut [f32]) {
        let d = x.d.to_f32();
        for (e, o) in out.iter_mut().enumerate() {
            *o = d * x.scales[e / 16] as f32 * (q6(x, e) - 32) as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ6K, y: &BlockQ8K) -> [i32; 8] {
        lanes256(|e| x.scales[e / 16] as i32 * (q6(x, e) - 32), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ6K, y: &BlockQ8K) -> f32 {
        y.d * x.d.to_f32()
    }
    #[inline(always)]
    fn min_term(_: &BlockQ6K, _: &BlockQ8K) -> f32 {
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
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
}

#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q2K {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q3K {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q4K {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q5K {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q6K {}
