//! The 4-bit "non-linear" i-quants: IQ4_NL and IQ4_XS (GGUF layouts, ggml's `block_iq4_nl`,
//! `block_iq4_xs`). Their 4-bit quants index one table of 16 signed values ([`KVALUES`], denser
//! near zero, where weights are), instead of standing for themselves as Q4_0's do. IQ4_NL is a
//! Q4_0-like block of 32 values with one f16 scale, paired with Q8_0 activations; IQ4_XS a
//! super-block of 256 in 8 sub-blocks with 6-bit scales (as the K-quants), paired with Q8_K. The
//! integer weight of a value is its table entry (times its sub-block scale for IQ4_XS), so the
//! driver's one summation order applies unchanged; the AVX2 paths look the table up with one
//! byte shuffle (`pshufb`) per 32 values.
//!
//! MXFP4 (OCP microscaling FP4, gpt-oss's expert weights; ggml's `block_mxfp4`) is the same
//! 32-value layout with another table (E2M1's values, doubled: [`KVALUES_MXFP4`]) and a power of
//! two for a scale (one E8M0 byte, halved to undo the doubling: [`e8m0_half`]).

use super::{lane, Avx2, BlockQ8K, BlockQ8_0, Format, WeightType};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// The 16 values a 4-bit i-quant stands for (ggml's `kvalues_iq4nl`).
pub static KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4's 16 values: E2M1's 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, doubled (ggml's
/// `kvalues_mxfp4`), so that they are integers.
pub static KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// 2^(e − 128): an E8M0 scale 2^(e − 127) halved, undoing the table's doubling (ggml's
/// `GGML_E8M0_TO_FP32_HALF`; e = 0 and 1 give subnormals).
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// MXFP4: `{e: u8, qs: [u8; 16]}`, w = e8m0_half(e)·KVALUES_MXFP4[q], nibbles in Q4_0's order.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockMXFP4 {
    pub e: u8,
    pub qs: [u8; 16],
}

/// IQ4_NL: `{d: f16, qs: [u8; 16]}`, w = d·KVALUES[q]; low nibbles hold elements 0..16, high
/// 16..32 (Q4_0's order).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4NL {
    pub d: f16,
    pub qs: [u8; 16],
}

/// IQ4_XS: `{d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]}`; 8 sub-blocks of 32, each
/// with a 6-bit scale stored + 32 (its low 4 bits a nibble of `scales_l`, its high 2 bits two
/// bits of `scales_h`: see [`scale_xs`]), w = d·(ls − 32)·KVALUES[q]; sub-block `ib`'s quants are
/// `qs[16ib..16ib + 16]` in IQ4_NL's order.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4XS {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; 4],
    pub qs: [u8; 128],
}

/// Element `i`'s value in `table` from a 32-value run of nibbles.
#[inline(always)]
fn value_in(table: &[i8; 16], qs: &[u8], i: usize) -> i32 {
    let q = if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    };
    table[q as usize] as i32
}

/// Element `i`'s IQ4 table value in a 32-value run of nibbles.
#[inline(always)]
fn value(qs: &[u8], i: usize) -> i32 {
    value_in(&KVALUES, qs, i)
}

/// Sub-block `ib`'s scale of an IQ4_XS super-block, less 32 (−32..=31).
#[inline(always)]
pub fn scale_xs(x: &BlockIQ4XS, ib: usize) -> i32 {
    let lo = (x.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
    let hi = ((x.scales_h >> (2 * ib)) & 3) as u8;
    (lo | (hi << 4)) as i32 - 32
}

pub struct IQ4NL;
pub struct IQ4XS;
pub struct MXFP4;

impl Format for MXFP4 {
    type Block = BlockMXFP4;
    type Act = BlockQ8_0;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::MXFP4;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockMXFP4, out: &mut [f32]) {
        let d = e8m0_half(x.e);
        for (i, o) in out.iter_mut().enumerate() {
            *o = d * value_in(&KVALUES_MXFP4, &x.qs, i) as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockMXFP4, y: &BlockQ8_0) -> [i32; 8] {
        super::legacy::lanes32(|i| value_in(&KVALUES_MXFP4, &x.qs, i), &y.qs)
    }
    /// A power of two times the activations' scale: exact, so ggml's order of the two factors
    /// gives the same bits.
    #[inline(always)]
    fn scale(x: &BlockMXFP4, y: &BlockQ8_0) -> f32 {
        e8m0_half(x.e) * y.d
    }
    #[inline(always)]
    fn min_term(_: &BlockMXFP4, _: &BlockQ8_0) -> f32 {
        0.0
    }
}

impl Format for IQ4NL {
    type Block = BlockIQ4NL;
    type Act = BlockQ8_0;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::IQ4_NL;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockIQ4NL, out: &mut [f32]) {
        let d = x.d.to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = d * value(&x.qs, i) as f32;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockIQ4NL, y: &BlockQ8_0) -> [i32; 8] {
        super::legacy::lanes32(|i| value(&x.qs, i), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockIQ4NL, y: &BlockQ8_0) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(_: &BlockIQ4NL, _: &BlockQ8_0) -> f32 {
        0.0
    }
}

impl Format for IQ4XS {
    type Block = BlockIQ4XS;
    type Act = BlockQ8K;
    const N: usize = 256;
    const DTYPE: WeightType = WeightType::IQ4_XS;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockIQ4XS, out: &mut [f32]) {
        let d = x.d.to_f32();
        for (ib, o) in out.chunks_exact_mut(32).enumerate() {
            // ggml's order: the sub-block's float scale first, then each value.
            let dl = d * scale_xs(x, ib) as f32;
            for (i, o) in o.iter_mut().enumerate() {
                *o = dl * value(&x.qs[16 * ib..], i) as f32;
            }
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockIQ4XS, y: &BlockQ8K) -> [i32; 8] {
        let mut l = [0i32; 8];
        for ib in 0..8 {
            let s = scale_xs(x, ib);
            for i in 0..32 {
                l[lane(i)] += s * value(&x.qs[16 * ib..], i) * y.qs[32 * ib + i] as i32;
            }
        }
        l
    }
    #[inline(always)]
    fn scale(x: &BlockIQ4XS, y: &BlockQ8K) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(_: &BlockIQ4XS, _: &BlockQ8K) -> f32 {
        0.0
    }
}

/// A reference quantizer for tests and test files (not llama.cpp's, which searches scales): per
/// 32 values the scale that maps the largest magnitude to ±127's neighbourhood, then each value's
/// nearest table entry.
#[cfg(test)]
pub mod reference {
    use super::*;

    fn nearest(v: f32) -> u8 {
        (0..16u8)
            .min_by(|&a, &b| {
                let da = (v - KVALUES[a as usize] as f32).abs();
                let db = (v - KVALUES[b as usize] as f32).abs();
                da.total_cmp(&db)
            })
            .expect("16 entries")
    }

    /// 32 values as nibbles (Q4_0's order) of `x / d`.
    fn nibbles(x: &[f32], d: f32, qs: &mut [u8]) {
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for j in 0..16 {
            qs[j] = nearest(x[j] * id) | (nearest(x[j + 16] * id) << 4);
        }
    }

    pub fn iq4_nl(xs: &[f32]) -> Vec<BlockIQ4NL> {
        xs.chunks_exact(32)
            .map(|x| {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let mut b = BlockIQ4NL::zeroed();
                b.d = f16::from_f32(amax / 127.0);
                nibbles(x, b.d.to_f32(), &mut b.qs);
                b
            })
            .collect()
    }

    /// gguf-py's MXFP4 quantizer: e = ⌊log2 amax⌋ − 2 + 127 (amax then maps near the table's
    /// 12 · 2^(e − 128) = 1.5 · 2^⌊log2 amax⌋), each value its nearest entry.
    pub fn mxfp4(xs: &[f32]) -> Vec<BlockMXFP4> {
        xs.chunks_exact(32)
            .map(|x| {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let mut b = BlockMXFP4::zeroed();
                b.e = if amax > 0.0 {
                    (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
                } else {
                    0
                };
                let d = e8m0_half(b.e);
                let near = |v: f32| {
                    (0..16u8)
                        .min_by(|&a, &c| {
                            let da = (d * KVALUES_MXFP4[a as usize] as f32 - v).abs();
                            let dc = (d * KVALUES_MXFP4[c as usize] as f32 - v).abs();
                            da.total_cmp(&dc)
                        })
                        .expect("16 entries")
                };
                for j in 0..16 {
                    b.qs[j] = near(x[j]) | (near(x[j + 16]) << 4);
                }
                b
            })
            .collect()
    }

    pub fn iq4_xs(xs: &[f32]) -> Vec<BlockIQ4XS> {
        xs.chunks_exact(256)
            .map(|x| {
                let amax: Vec<f32> = x
                    .chunks_exact(32)
                    .map(|s| s.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0)
                    .collect();
                let top = amax.iter().fold(0f32, |a, &v| a.max(v));
                let mut b = BlockIQ4XS::zeroed();
                b.d = f16::from_f32(top / 31.0);
                let d = b.d.to_f32();
                for (ib, s) in x.chunks_exact(32).enumerate() {
                    let ls = if d != 0.0 {
                        (amax[ib] / d).round().clamp(-32.0, 31.0) as i32
                    } else {
                        0
                    };
                    let stored = (ls + 32) as u8;
                    b.scales_l[ib / 2] |= (stored & 0x0F) << (4 * (ib % 2));
                    b.scales_h |= ((stored >> 4) as u16) << (2 * ib);
                    nibbles(s, d * ls as f32, &mut b.qs[16 * ib..16 * ib + 16]);
                }
                b
            })
            .collect()
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The nibbles unpacked in element order and looked up in the table (one `pshufb` per 32
    //! values), then signed dot products (the sign trick of `idot_i8`: |KVALUES| ≤ 127, so each
    //! maddubs pair stays within i16); IQ4_XS's sub-block sums are scaled by `madd` with the
    //! scale, as the K-quants' are.
    use super::super::avx2::{idot_i8, idot_i8_vnni, load16, load32};
    use super::*;
    use std::arch::x86_64::*;

    /// `table` in both 128-bit lanes (`pshufb` looks up within each lane).
    #[inline(always)]
    unsafe fn table(table: &[i8; 16]) -> __m256i {
        let t = load16(table);
        _mm256_set_m128i(t, t)
    }

    /// 32 values of a 16-byte run of nibbles (low nibbles, then high), looked up in `t`.
    #[inline(always)]
    unsafe fn values_in(t: &[i8; 16], qs: &[u8]) -> __m256i {
        let mask = _mm_set1_epi8(0x0F);
        let q = load16(qs);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        _mm256_shuffle_epi8(table(t), _mm256_set_m128i(hi, lo))
    }

    /// 32 IQ4 table values of a run of nibbles.
    #[inline(always)]
    unsafe fn values(qs: &[u8]) -> __m256i {
        values_in(&KVALUES, qs)
    }

    impl Avx2 for MXFP4 {
        type Unpacked = __m256i;
        #[inline(always)]
        unsafe fn unpack(x: &BlockMXFP4) -> __m256i {
            values_in(&KVALUES_MXFP4, &x.qs)
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &BlockMXFP4) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8_vnni(*u, load32(&y.qs))
        }
    }

    impl Avx2 for IQ4NL {
        type Unpacked = __m256i;
        #[inline(always)]
        unsafe fn unpack(x: &BlockIQ4NL) -> __m256i {
            values(&x.qs)
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &BlockIQ4NL) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8_vnni(*u, load32(&y.qs))
        }
    }

    #[derive(Clone, Copy)]
    pub struct UnpackedXS {
        q: [__m256i; 8],
        sc: [__m256i; 8],
    }

    #[inline(always)]
    unsafe fn unpack_xs(x: &BlockIQ4XS) -> UnpackedXS {
        UnpackedXS {
            q: std::array::from_fn(|ib| values(&x.qs[16 * ib..])),
            sc: std::array::from_fn(|ib| _mm256_set1_epi16(scale_xs(x, ib) as i16)),
        }
    }

    impl Avx2 for IQ4XS {
        type Unpacked = UnpackedXS;
        #[inline(always)]
        unsafe fn unpack(x: &BlockIQ4XS) -> UnpackedXS {
            unpack_xs(x)
        }
        /// Σ_ib madd(ls_ib, maddubs(|q|, ±y)): each i16 pair sum ≤ 2·127·127, times |ls| ≤ 32.
        #[inline(always)]
        unsafe fn ilanes(u: &UnpackedXS, y: &BlockQ8K) -> __m256i {
            let mut sum = _mm256_setzero_si256();
            for ib in 0..8 {
                let q = u.q[ib];
                let yc = load32(&y.qs[32 * ib..32 * ib + 32]);
                let p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(yc, q));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[ib], p));
            }
            sum
        }
        type U512 = UnpackedXS;
        #[inline(always)]
        unsafe fn unpack512(x: &BlockIQ4XS) -> UnpackedXS {
            unpack_xs(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &UnpackedXS, y: &BlockQ8K) -> __m256i {
            Self::ilanes(u, y)
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for IQ4NL {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for IQ4XS {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for MXFP4 {}
