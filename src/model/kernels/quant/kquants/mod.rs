//! The K-quants: super-blocks of 256 values in sub-blocks with their own integer scales (GGUF
//! layouts, ggml's `block_q2_K` … `block_q6_K`), paired with Q8_K activations.
//! Each gives its integer weights (sub-block scale × quant) per element for the driver's one
//! summation order, and an AVX2 unpack + integer dot in `avx2`.

use super::WeightType;
use super::{lane, Avx2, BlockQ8K, Format};
use bytemuck::{Pod, Zeroable};
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
    const DTYPE: WeightType = WeightType::Q2K;
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
    const DTYPE: WeightType = WeightType::Q3K;
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
    const DTYPE: WeightType = WeightType::Q4K;
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
    const DTYPE: WeightType = WeightType::Q5K;
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
    const DTYPE: WeightType = WeightType::Q6K;
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
mod avx2;

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
