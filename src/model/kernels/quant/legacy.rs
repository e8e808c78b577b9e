//! The 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (GGUF layouts, ggml's `block_*`).
//! Each gives its integer weights per element (`weight`), its lanes and scale for the driver's
//! one summation order, and an AVX2 unpack + integer dot in `avx2`.

use super::WeightType;
use super::{lane, Avx2, BlockQ8_0, BlockQ8_1, Format};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Q4_0: `{d: f16, qs: [u8; 16]}`, w = d·(q − 8); low nibbles hold elements 0..16, high 16..32.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

/// Q4_1: `{d: f16, m: f16, qs: [u8; 16]}`, w = d·q + m.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// Q5_0: `{d: f16, qh: [u8; 4], qs: [u8; 16]}`, w = d·(q − 16), bit i of qh (little-endian) is
/// element i's fifth bit.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// Q5_1: `{d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]}`, w = d·q + m.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// Q8_0 weights: `{d: f16, qs: [i8; 32]}`, w = d·q (the activation block, [`BlockQ8_0`], keeps
/// its scale as f32).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0W {
    pub d: f16,
    pub qs: [i8; 32],
}

/// Element `i`'s 4-bit value.
#[inline(always)]
fn nibble(qs: &[u8; 16], i: usize) -> i32 {
    if i < 16 {
        (qs[i] & 0x0F) as i32
    } else {
        (qs[i - 16] >> 4) as i32
    }
}

/// Element `i`'s fifth bit, as 16 or 0.
#[inline(always)]
fn fifth(qh: &[u8; 4], i: usize) -> i32 {
    (((u32::from_le_bytes(*qh) >> i) & 1) << 4) as i32
}

/// The 8 lanes of Σ w(i)·y(i) over a 32-value block.
#[inline(always)]
pub(super) fn lanes32(w: impl Fn(usize) -> i32, y: &[i8; 32]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (i, &y) in y.iter().enumerate() {
        l[lane(i)] += w(i) * y as i32;
    }
    l
}

pub struct Q4_0;
pub struct Q4_1;
pub struct Q5_0;
pub struct Q5_1;
pub struct Q8_0;

impl Format for Q4_0 {
    type Block = BlockQ4_0;
    type Act = BlockQ8_0;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::Q4_0;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockQ4_0, out: &mut [f32]) {
        let d = x.d.to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (nibble(&x.qs, i) - 8) as f32 * d;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ4_0, y: &BlockQ8_0) -> [i32; 8] {
        lanes32(|i| nibble(&x.qs, i) - 8, &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ4_0, y: &BlockQ8_0) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(_: &BlockQ4_0, _: &BlockQ8_0) -> f32 {
        0.0
    }
}

impl Format for Q4_1 {
    type Block = BlockQ4_1;
    type Act = BlockQ8_1;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::Q4_1;
    const HAS_MIN: bool = true;
    fn dequantize(x: &BlockQ4_1, out: &mut [f32]) {
        let (d, m) = (x.d.to_f32(), x.m.to_f32());
        for (i, o) in out.iter_mut().enumerate() {
            *o = nibble(&x.qs, i) as f32 * d + m;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ4_1, y: &BlockQ8_1) -> [i32; 8] {
        lanes32(|i| nibble(&x.qs, i), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ4_1, y: &BlockQ8_1) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(x: &BlockQ4_1, y: &BlockQ8_1) -> f32 {
        x.m.to_f32() * y.s
    }
}

impl Format for Q5_0 {
    type Block = BlockQ5_0;
    type Act = BlockQ8_0;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::Q5_0;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockQ5_0, out: &mut [f32]) {
        let d = x.d.to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = ((nibble(&x.qs, i) | fifth(&x.qh, i)) - 16) as f32 * d;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ5_0, y: &BlockQ8_0) -> [i32; 8] {
        lanes32(|i| (nibble(&x.qs, i) | fifth(&x.qh, i)) - 16, &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ5_0, y: &BlockQ8_0) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(_: &BlockQ5_0, _: &BlockQ8_0) -> f32 {
        0.0
    }
}

impl Format for Q5_1 {
    type Block = BlockQ5_1;
    type Act = BlockQ8_1;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::Q5_1;
    const HAS_MIN: bool = true;
    fn dequantize(x: &BlockQ5_1, out: &mut [f32]) {
        let (d, m) = (x.d.to_f32(), x.m.to_f32());
        for (i, o) in out.iter_mut().enumerate() {
            *o = (nibble(&x.qs, i) | fifth(&x.qh, i)) as f32 * d + m;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ5_1, y: &BlockQ8_1) -> [i32; 8] {
        lanes32(|i| nibble(&x.qs, i) | fifth(&x.qh, i), &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ5_1, y: &BlockQ8_1) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(x: &BlockQ5_1, y: &BlockQ8_1) -> f32 {
        x.m.to_f32() * y.s
    }
}

impl Format for Q8_0 {
    type Block = BlockQ8_0W;
    type Act = BlockQ8_0;
    const N: usize = 32;
    const DTYPE: WeightType = WeightType::Q8_0;
    const HAS_MIN: bool = false;
    fn dequantize(x: &BlockQ8_0W, out: &mut [f32]) {
        let d = x.d.to_f32();
        for (q, o) in x.qs.iter().zip(out) {
            *o = *q as f32 * d;
        }
    }
    #[inline(always)]
    fn lanes(x: &BlockQ8_0W, y: &BlockQ8_0) -> [i32; 8] {
        lanes32(|i| x.qs[i] as i32, &y.qs)
    }
    #[inline(always)]
    fn scale(x: &BlockQ8_0W, y: &BlockQ8_0) -> f32 {
        x.d.to_f32() * y.d
    }
    #[inline(always)]
    fn min_term(_: &BlockQ8_0W, _: &BlockQ8_0) -> f32 {
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Unpacking to 32 bytes in element order, then llama.cpp's integer dot products.
    use super::super::avx2::{
        bit_bytes, idot_i8, idot_i8_vnni, idot_u8, idot_u8_vnni, load16, load32,
    };
    use super::*;
    use std::arch::x86_64::*;

    /// The 32 nibbles of a block as u8, in element order (low nibbles, then high).
    #[inline(always)]
    unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
        let mask = _mm_set1_epi8(0x0F);
        let q = load16(qs);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    /// The 32 bits of `qh` as bytes: 0xFF where element i's bit is set, 0 elsewhere.
    #[inline(always)]
    unsafe fn bits(qh: &[u8; 4]) -> __m256i {
        bit_bytes(u32::from_le_bytes(*qh))
    }

    impl Avx2 for Q4_0 {
        type Unpacked = __m256i;
        #[inline(always)]
        unsafe fn unpack(x: &BlockQ4_0) -> __m256i {
            _mm256_sub_epi8(nibbles(&x.qs), _mm256_set1_epi8(8))
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &Self::Block) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &Self::Act) -> __m256i {
            idot_i8_vnni(*u, load32(&y.qs))
        }
    }

    impl Avx2 for Q4_1 {
        type Unpacked = __m256i;
        #[inline(always)]
        unsafe fn unpack(x: &BlockQ4_1) -> __m256i {
            nibbles(&x.qs)
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_1) -> __m256i {
            idot_u8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &Self::Block) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &Self::Act) -> __m256i {
            idot_u8_vnni(*u, load32(&y.qs))
        }
    }

    impl Avx2 for Q5_0 {
        type Unpacked = __m256i;
        /// q | 0xF0 where the fifth bit is clear is q − 16 as i8; where set, q + 16 − 16 = q.
        #[inline(always)]
        unsafe fn unpack(x: &BlockQ5_0) -> __m256i {
            let hi = _mm256_andnot_si256(bits(&x.qh), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles(&x.qs), hi)
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &Self::Block) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &Self::Act) -> __m256i {
            idot_i8_vnni(*u, load32(&y.qs))
        }
    }

    impl Avx2 for Q5_1 {
        type Unpacked = __m256i;
        #[inline(always)]
        unsafe fn unpack(x: &BlockQ5_1) -> __m256i {
            let hi = _mm256_and_si256(bits(&x.qh), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles(&x.qs), hi)
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_1) -> __m256i {
            idot_u8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &Self::Block) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &Self::Act) -> __m256i {
            idot_u8_vnni(*u, load32(&y.qs))
        }
    }

    impl Avx2 for Q8_0 {
        type Unpacked = __m256i;
        #[inline(always)]
        unsafe fn unpack(x: &BlockQ8_0W) -> __m256i {
            load32(&x.qs)
        }
        #[inline(always)]
        unsafe fn ilanes(u: &__m256i, y: &BlockQ8_0) -> __m256i {
            idot_i8(*u, load32(&y.qs))
        }
        type U512 = __m256i;
        #[inline(always)]
        unsafe fn unpack512(x: &Self::Block) -> __m256i {
            Self::unpack(x)
        }
        #[inline(always)]
        unsafe fn ilanes512(u: &__m256i, y: &Self::Act) -> __m256i {
            idot_i8_vnni(*u, load32(&y.qs))
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q4_0 {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q4_1 {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q5_0 {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q5_1 {}
#[cfg(not(target_arch = "x86_64"))]
impl Avx2 for Q8_0 {}
