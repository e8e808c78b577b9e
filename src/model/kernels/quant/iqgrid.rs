//! The grid i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (GGUF layouts,
//! ggml's `block_iq*`), super-blocks of 256 values paired with Q8_K activations. Each index in a
//! block selects a run of 4 or 8 values from a fixed grid ([`grids`](super::grids), the format's
//! definition), with sign bits (IQ2/IQ3) or a ±1/8 shift (IQ1) per run and an odd integer scale
//! (2s + 1) per 16 or 32 values.
//!
//! Every format unpacks a super-block into one shape, [`GridBlock`]: its 256 signed integer
//! values (grid value × sign, or 8·grid ± 1 for IQ1) and the integer scale of each 16 values; the
//! weight is `d · FACTOR · scale · value` with FACTOR a power of two (1/8, 1/4 or 1), so one
//! integer dot product serves all of them, in the driver's summation order (lane of element i:
//! `(i % 32) / 4`). Every index a block can hold is inside its grid (the index fields are exactly
//! as wide as the grids are long), so no file can make a lookup read out of bounds.

use super::grids::*;
use super::tiled::TileGrid;
use super::{lane, Avx2, BlockQ8K, Format, WeightType};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// A super-block unpacked: 256 signed values and the integer scale of each 16.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct GridBlock {
    pub q: [i8; 256],
    pub sc: [i16; 16],
}

impl GridBlock {
    fn new() -> Self {
        Self {
            q: [0; 256],
            sc: [0; 16],
        }
    }

    /// Values 8k..8k+8 from a little-endian word of 8 bytes.
    #[inline(always)]
    fn put8(&mut self, k: usize, w: u64) {
        self.q[8 * k..8 * k + 8].copy_from_slice(bytemuck::cast_slice(&w.to_le_bytes()));
    }

    /// The 8 integer lanes of Σ scale·value·y.
    fn lanes(&self, y: &BlockQ8K) -> [i32; 8] {
        let mut l = [0i32; 8];
        for (e, (&q, &y)) in self.q.iter().zip(&y.qs).enumerate() {
            l[lane(e)] += self.sc[e / 16] as i32 * q as i32 * y as i32;
        }
        l
    }
}

/// Byte j of entry s is 0xFF where bit j of s is set: a sign byte as a mask of 8 values.
static SIGN_MASKS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut s = 0;
    while s < 256 {
        let mut j = 0;
        while j < 8 {
            if s & (1 << j) != 0 {
                t[s] |= 0xFF << (8 * j);
            }
            j += 1;
        }
        s += 1;
    }
    t
};

/// ggml's `ksigns_iq2xs`: 7 stored sign bits completed by an eighth that makes their count even.
static KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | (((i as u32).count_ones() as u8 & 1) << 7);
        i += 1;
    }
    t
};

/// 8 grid values (each 1..=127) with the values whose bit is set in `signs` negated: per byte,
/// v ^ 0xFF + 1 = 256 − v, which never carries into the next byte for v ≥ 1.
#[inline(always)]
fn signed8(grid: u64, signs: u8) -> u64 {
    let m = SIGN_MASKS[signs as usize];
    (grid ^ m).wrapping_add(m & 0x0101_0101_0101_0101)
}

/// Two 4-value grid entries as one 8-value word.
#[inline(always)]
fn pair(lo: u32, hi: u32) -> u64 {
    lo as u64 | (hi as u64) << 32
}

/// The little-endian u32 at byte `at`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian u16 at byte `at`.
#[inline(always)]
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// IQ2_XXS: `{d: f16, qs: [u16; 32]}` (here as bytes). Per 32 values, 8 bytes: 4 grid indices
/// (8 values each, `IQ2XXS_GRID`), then a word holding 4 × 7 sign bits and the 4-bit scale s
/// (top); w = d · (0.5 + s) / 4 · value = d/8 · (2s + 1) · value.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ2XXS {
    pub d: f16,
    pub qs: [u8; 64],
}

/// IQ2_XS: `{d, qs: [u16; 32], scales: [u8; 8]}`; each u16 a 9-bit index (`IQ2XS_GRID`) and 7
/// sign bits; two 4-bit scales per 32 values (low nibble the first 16).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ2XS {
    pub d: f16,
    pub qs: [u8; 64],
    pub scales: [u8; 8],
}

/// IQ2_S: `{d, qs: [u8; 64], qh: [u8; 8], scales: [u8; 8]}`: `qs[..32]` the low 8 bits of 10-bit
/// indices (`IQ2S_GRID`, the high 2 in `qh`), `qs[32..]` 8 sign bits per 8 values; scales as
/// IQ2_XS's.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ2S {
    pub d: f16,
    pub qs: [u8; 64],
    pub qh: [u8; 8],
    pub scales: [u8; 8],
}

/// IQ3_XXS: `{d, qs: [u8; 96]}`: `qs[..64]` indices of 4 values each (`IQ3XXS_GRID`), then per 32
/// values a word of 4 × 7 sign bits and the 4-bit scale s; w = d · (0.5 + s) / 2 · value.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ3XXS {
    pub d: f16,
    pub qs: [u8; 96],
}

/// IQ3_S: `{d, qs: [u8; 64], qh: [u8; 8], signs: [u8; 32], scales: [u8; 4]}`: 9-bit indices of 4
/// values each (`IQ3S_GRID`, the ninth bit in `qh`), 8 sign bits per 8 values, a 4-bit scale s
/// per 32 values; w = d · (1 + 2s) · value.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ3S {
    pub d: f16,
    pub qs: [u8; 64],
    pub qh: [u8; 8],
    pub signs: [u8; 32],
    pub scales: [u8; 4],
}

/// IQ1_S: `{d, qs: [u8; 32], qh: [u16; 8]}`: 11-bit indices of 8 values in {−1, 0, 1}
/// (`IQ1S_GRID`; the high 3 bits in `qh`), per 32 values a 3-bit scale s and a shift sign in
/// `qh`; w = d · (2s + 1) · (grid ± 1/8).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ1S {
    pub d: f16,
    pub qs: [u8; 32],
    pub qh: [u8; 16],
}

/// IQ1_M: `{qs: [u8; 32], qh: [u8; 16], scales: [u8; 8]}`: IQ1_S's indices, a shift sign per 8
/// values, 3-bit scales per 16 values, and the f16 `d` spread over the top nibbles of the four
/// u16 words of `scales`.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ1M {
    pub qs: [u8; 32],
    pub qh: [u8; 16],
    pub scales: [u8; 8],
}

/// A grid i-quant: its unpacking, and the float factor `d · FACTOR` of its integer weights.
pub trait Grid: Send + Sync + 'static {
    type Block: Pod + Send + Sync;
    const DTYPE: WeightType;
    /// The block's `d` times the format's power-of-two factor.
    fn d(x: &Self::Block) -> f32;
    fn unpack(x: &Self::Block) -> GridBlock;
    /// Values 16k..16k+16 as ggml's dequantization computes them: the float scale of those 16
    /// (ggml's expression), times each value.
    fn dequantize(x: &Self::Block, out: &mut [f32]);
}

/// A grid i-quant with sign bits (the IQ2 and IQ3 types): each 32 values are 4 words of unsigned
/// grid values and 32 sign bits, so AVX2 can apply the signs to the activations in registers.
pub trait SignedGrid: Grid {
    /// Chunk c (values 32c..32c + 32): its 4 words of grid values (8 per word, in order) and its
    /// sign bits (bit i: value 32c + i negated).
    fn chunk(x: &Self::Block, c: usize) -> ([u64; 4], u32);
    /// The integer scale of each 16 values.
    fn scales(x: &Self::Block) -> [i16; 16];
}

/// A signed grid block unpacked in scalar code.
#[inline(always)]
fn unpack_signed<G: SignedGrid>(x: &G::Block) -> GridBlock {
    let mut g = GridBlock::new();
    g.sc = G::scales(x);
    for c in 0..8 {
        let (words, signs) = G::chunk(x, c);
        for (l, w) in words.into_iter().enumerate() {
            g.put8(4 * c + l, signed8(w, (signs >> (8 * l)) as u8));
        }
    }
    g
}

/// Four sign bytes as one word (byte l the signs of values 8l..8l + 8).
#[inline(always)]
fn sign_word(bytes: [u8; 4]) -> u32 {
    u32::from_le_bytes(bytes)
}

/// 16 scales from 8 bytes of two 4-bit scales each (low nibble the first 16 values): 2s + 1.
#[inline(always)]
fn nibble_scales(b: &[u8]) -> [i16; 16] {
    std::array::from_fn(|k| 2 * ((b[k / 2] >> (4 * (k % 2))) & 15) as i16 + 1)
}

pub struct IQ2XXS;
pub struct IQ2XS;
pub struct IQ2S;
pub struct IQ3XXS;
pub struct IQ3S;
pub struct IQ1S;
pub struct IQ1M;

/// `out[e] = db(e / 32) · q[e] · unit` (IQ2/IQ3: unit 1; IQ1: 1/8, so q/8 = grid ± 1/8 exactly).
fn dequantize_with(g: &GridBlock, db: impl Fn(usize) -> f32, unit: f32, out: &mut [f32]) {
    for (e, o) in out.iter_mut().enumerate() {
        let v = g.q[e] as f32;
        *o = db(e / 16) * if unit == 1.0 { v } else { v * unit };
    }
}

impl Grid for IQ2XXS {
    type Block = BlockIQ2XXS;
    const DTYPE: WeightType = WeightType::IQ2_XXS;
    fn d(x: &BlockIQ2XXS) -> f32 {
        x.d.to_f32() * 0.125
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ2XXS) -> GridBlock {
        unpack_signed::<Self>(x)
    }
    fn dequantize(x: &BlockIQ2XXS, out: &mut [f32]) {
        let d = x.d.to_f32();
        let db = |k: usize| d * (0.5 + (u32_at(&x.qs, 8 * (k / 2) + 4) >> 28) as f32) * 0.25;
        dequantize_with(&<Self as Grid>::unpack(x), db, 1.0, out)
    }
}

impl Grid for IQ2XS {
    type Block = BlockIQ2XS;
    const DTYPE: WeightType = WeightType::IQ2_XS;
    fn d(x: &BlockIQ2XS) -> f32 {
        x.d.to_f32() * 0.125
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ2XS) -> GridBlock {
        unpack_signed::<Self>(x)
    }
    fn dequantize(x: &BlockIQ2XS, out: &mut [f32]) {
        let d = x.d.to_f32();
        let db = |k: usize| {
            let s = x.scales[k / 2] >> (4 * (k % 2)) & 15;
            d * (0.5 + s as f32) * 0.25
        };
        dequantize_with(&<Self as Grid>::unpack(x), db, 1.0, out)
    }
}

impl Grid for IQ2S {
    type Block = BlockIQ2S;
    const DTYPE: WeightType = WeightType::IQ2_S;
    fn d(x: &BlockIQ2S) -> f32 {
        x.d.to_f32() * 0.125
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ2S) -> GridBlock {
        unpack_signed::<Self>(x)
    }
    fn dequantize(x: &BlockIQ2S, out: &mut [f32]) {
        let d = x.d.to_f32();
        let db = |k: usize| {
            let s = x.scales[k / 2] >> (4 * (k % 2)) & 15;
            d * (0.5 + s as f32) * 0.25
        };
        dequantize_with(&<Self as Grid>::unpack(x), db, 1.0, out)
    }
}

impl Grid for IQ3XXS {
    type Block = BlockIQ3XXS;
    const DTYPE: WeightType = WeightType::IQ3_XXS;
    fn d(x: &BlockIQ3XXS) -> f32 {
        x.d.to_f32() * 0.25
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ3XXS) -> GridBlock {
        unpack_signed::<Self>(x)
    }
    fn dequantize(x: &BlockIQ3XXS, out: &mut [f32]) {
        let d = x.d.to_f32();
        let db = |k: usize| d * (0.5 + (u32_at(&x.qs, 64 + 4 * (k / 2)) >> 28) as f32) * 0.5;
        dequantize_with(&<Self as Grid>::unpack(x), db, 1.0, out)
    }
}

impl Grid for IQ3S {
    type Block = BlockIQ3S;
    const DTYPE: WeightType = WeightType::IQ3_S;
    fn d(x: &BlockIQ3S) -> f32 {
        x.d.to_f32()
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ3S) -> GridBlock {
        unpack_signed::<Self>(x)
    }
    fn dequantize(x: &BlockIQ3S, out: &mut [f32]) {
        let d = x.d.to_f32();
        let db =
            |k: usize| d * (1 + 2 * ((x.scales[k / 4] >> (4 * (k / 2 % 2))) & 15) as i32) as f32;
        dequantize_with(&<Self as Grid>::unpack(x), db, 1.0, out)
    }
}

/// The 7-bit sign fields of a word (4 × 7 bits from bit 0) completed to 4 sign bytes.
#[inline(always)]
fn ksigns4(aux: u32) -> u32 {
    sign_word(std::array::from_fn(|l| {
        KSIGNS[((aux >> (7 * l)) & 127) as usize]
    }))
}

impl SignedGrid for IQ2XXS {
    #[inline(always)]
    fn chunk(x: &BlockIQ2XXS, c: usize) -> ([u64; 4], u32) {
        let aux = u32_at(&x.qs, 8 * c + 4);
        let words = std::array::from_fn(|l| IQ2XXS_GRID[x.qs[8 * c + l] as usize]);
        (words, ksigns4(aux))
    }
    #[inline(always)]
    fn scales(x: &BlockIQ2XXS) -> [i16; 16] {
        std::array::from_fn(|k| 2 * (u32_at(&x.qs, 8 * (k / 2) + 4) >> 28) as i16 + 1)
    }
}

impl SignedGrid for IQ2XS {
    #[inline(always)]
    fn chunk(x: &BlockIQ2XS, c: usize) -> ([u64; 4], u32) {
        let q: [u16; 4] = std::array::from_fn(|l| u16_at(&x.qs, 2 * (4 * c + l)));
        let words = q.map(|q| IQ2XS_GRID[(q & 511) as usize]);
        (words, sign_word(q.map(|q| KSIGNS[(q >> 9) as usize])))
    }
    #[inline(always)]
    fn scales(x: &BlockIQ2XS) -> [i16; 16] {
        nibble_scales(&x.scales)
    }
}

impl SignedGrid for IQ2S {
    #[inline(always)]
    fn chunk(x: &BlockIQ2S, c: usize) -> ([u64; 4], u32) {
        let qh = x.qh[c] as usize;
        let words = std::array::from_fn(|l| {
            IQ2S_GRID[x.qs[4 * c + l] as usize | ((qh << (8 - 2 * l)) & 0x300)]
        });
        (words, u32_at(&x.qs, 32 + 4 * c))
    }
    #[inline(always)]
    fn scales(x: &BlockIQ2S) -> [i16; 16] {
        nibble_scales(&x.scales)
    }
}

impl SignedGrid for IQ3XXS {
    #[inline(always)]
    fn chunk(x: &BlockIQ3XXS, c: usize) -> ([u64; 4], u32) {
        let q = &x.qs[8 * c..8 * c + 8];
        let words = std::array::from_fn(|l| {
            pair(
                IQ3XXS_GRID[q[2 * l] as usize],
                IQ3XXS_GRID[q[2 * l + 1] as usize],
            )
        });
        (words, ksigns4(u32_at(&x.qs, 64 + 4 * c)))
    }
    #[inline(always)]
    fn scales(x: &BlockIQ3XXS) -> [i16; 16] {
        std::array::from_fn(|k| 2 * (u32_at(&x.qs, 64 + 4 * (k / 2)) >> 28) as i16 + 1)
    }
}

impl SignedGrid for IQ3S {
    #[inline(always)]
    fn chunk(x: &BlockIQ3S, c: usize) -> ([u64; 4], u32) {
        let (q, qh) = (&x.qs[8 * c..8 * c + 8], x.qh[c] as usize);
        let words = std::array::from_fn(|l| {
            let i1 = q[2 * l] as usize | ((qh << (8 - 2 * l)) & 256);
            let i2 = q[2 * l + 1] as usize | ((qh << (7 - 2 * l)) & 256);
            pair(IQ3S_GRID[i1], IQ3S_GRID[i2])
        });
        (words, u32_at(&x.signs, 4 * c))
    }
    #[inline(always)]
    fn scales(x: &BlockIQ3S) -> [i16; 16] {
        std::array::from_fn(|k| 2 * ((x.scales[k / 4] >> (4 * (k / 2 % 2))) & 15) as i16 + 1)
    }
}

/// 8 IQ1 grid values (i8 −1, 0, 1) as 8·g + delta (delta ±1: the ±1/8 shift in eighths).
#[inline(always)]
fn shifted8(grid: u64, delta: i8) -> u64 {
    let b = grid.to_le_bytes().map(|v| (8 * v as i8 + delta) as u8);
    u64::from_le_bytes(b)
}

/// An IQ1 grid: each 32 values are 4 words of grid values in {−1, 0, 1}, a ±1/8 shift per 8
/// values and a scale per 16, so AVX2 can take Σ (8g + δ)·y as 8·Σ (g + 1)·y + (δ − 8)·Σ y with
/// unsigned g + 1.
pub trait ShiftedGrid: Grid {
    /// Chunk c (values 32c..32c + 32): its 4 grid words and the shift of each (±1, in eighths).
    fn chunk(x: &Self::Block, c: usize) -> ([u64; 4], [i8; 4]);
    /// The integer scale of each 16 values.
    fn scales(x: &Self::Block) -> [i16; 16];
}

/// An IQ1 block unpacked in scalar code.
#[inline(always)]
fn unpack_shifted<G: ShiftedGrid>(x: &G::Block) -> GridBlock {
    let mut g = GridBlock::new();
    g.sc = G::scales(x);
    for c in 0..8 {
        let (words, deltas) = G::chunk(x, c);
        for l in 0..4 {
            g.put8(4 * c + l, shifted8(words[l], deltas[l]));
        }
    }
    g
}

impl ShiftedGrid for IQ1S {
    #[inline(always)]
    fn chunk(x: &BlockIQ1S, c: usize) -> ([u64; 4], [i8; 4]) {
        let qh = u16_at(&x.qh, 2 * c) as usize;
        let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
        let words = std::array::from_fn(|l| {
            IQ1S_GRID[x.qs[4 * c + l] as usize | (((qh >> (3 * l)) & 7) << 8)]
        });
        (words, [delta; 4])
    }
    #[inline(always)]
    fn scales(x: &BlockIQ1S) -> [i16; 16] {
        std::array::from_fn(|k| 2 * ((u16_at(&x.qh, 2 * (k / 2)) >> 12) & 7) as i16 + 1)
    }
}

impl ShiftedGrid for IQ1M {
    /// Entries 4c..4c + 4: `qh[2c]` holds the high index bits of the first two (bits 0-2, 4-6)
    /// and their shifts' signs (bits 3, 7); `qh[2c + 1]` those of the next two.
    #[inline(always)]
    fn chunk(x: &BlockIQ1M, c: usize) -> ([u64; 4], [i8; 4]) {
        let (h0, h1) = (x.qh[2 * c] as usize, x.qh[2 * c + 1] as usize);
        let q = |l: usize| x.qs[4 * c + l] as usize;
        let idx = [
            q(0) | (h0 & 0x07) << 8,
            q(1) | (h0 & 0x70) << 4,
            q(2) | (h1 & 0x07) << 8,
            q(3) | (h1 & 0x70) << 4,
        ];
        let deltas =
            [h0 & 0x08, h0 & 0x80, h1 & 0x08, h1 & 0x80].map(|b| if b != 0 { -1 } else { 1 });
        (idx.map(|i| IQ1S_GRID[i]), deltas)
    }
    #[inline(always)]
    fn scales(x: &BlockIQ1M) -> [i16; 16] {
        let sc = Self::sc(x);
        std::array::from_fn(|k| 2 * Self::s_of(sc, k) as i16 + 1)
    }
}

impl Grid for IQ1S {
    type Block = BlockIQ1S;
    const DTYPE: WeightType = WeightType::IQ1_S;
    fn d(x: &BlockIQ1S) -> f32 {
        x.d.to_f32() * 0.125
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ1S) -> GridBlock {
        unpack_shifted::<Self>(x)
    }
    fn dequantize(x: &BlockIQ1S, out: &mut [f32]) {
        let d = x.d.to_f32();
        let db = |k: usize| d * (2 * ((u16_at(&x.qh, 2 * (k / 2)) >> 12) & 7) + 1) as f32;
        dequantize_with(&<Self as Grid>::unpack(x), db, 0.125, out)
    }
}

impl IQ1M {
    /// The four u16 words of `scales`.
    #[inline(always)]
    fn sc(x: &BlockIQ1M) -> [u16; 4] {
        std::array::from_fn(|i| u16_at(&x.scales, 2 * i))
    }

    /// The block's f16 `d`, gathered from the top nibbles of the scale words.
    fn d16(x: &BlockIQ1M) -> f16 {
        let sc = Self::sc(x);
        let bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        f16::from_bits(bits)
    }

    /// The 3-bit scale of values 16k..16k+16, from the scale words.
    #[inline(always)]
    fn s_of(sc: [u16; 4], k: usize) -> u16 {
        let (ib, half) = (k / 2, k % 2);
        (sc[ib / 2] >> (6 * (ib % 2) + 3 * half)) & 7
    }
}

impl Grid for IQ1M {
    type Block = BlockIQ1M;
    const DTYPE: WeightType = WeightType::IQ1_M;
    fn d(x: &BlockIQ1M) -> f32 {
        Self::d16(x).to_f32() * 0.125
    }
    #[inline(always)]
    fn unpack(x: &BlockIQ1M) -> GridBlock {
        unpack_shifted::<Self>(x)
    }
    fn dequantize(x: &BlockIQ1M, out: &mut [f32]) {
        let (d, sc) = (Self::d16(x).to_f32(), Self::sc(x));
        let db = |k: usize| d * (2 * Self::s_of(sc, k) + 1) as f32;
        dequantize_with(&<Self as Grid>::unpack(x), db, 0.125, out)
    }
}

/// Row `r` of a staged tile ([`TileGrid`]) from a block: its `d`, scales, values (row r's
/// bytes of each 4-value group) and bias term (`128 · Σ_j sc_j · Σ_{e in j} q_e`).
pub trait Stage: Grid {
    fn stage(x: &Self::Block, r: usize, t: &mut TileGrid) {
        stage_scalar::<Self>(x, r, t)
    }
}

/// [`Stage::stage`] from the scalar unpacking.
pub(super) fn stage_scalar<G: Grid + ?Sized>(x: &G::Block, r: usize, t: &mut TileGrid) {
    let g = G::unpack(x);
    t.d[r] = G::d(x);
    for (row, s) in t.sc.iter_mut().zip(g.sc) {
        row[r] = s;
    }
    let q: &[u8] = bytemuck::cast_slice(&g.q);
    for (group, four) in t.q.iter_mut().zip(q.chunks_exact(4)) {
        group[4 * r..4 * r + 4].copy_from_slice(four);
    }
    let sums =
        g.q.chunks_exact(16)
            .map(|v| v.iter().map(|&q| q as i32).sum::<i32>());
    t.bias[r] = 128
        * g.sc
            .iter()
            .zip(sums)
            .map(|(&s, v)| s as i32 * v)
            .sum::<i32>();
}

impl Stage for IQ1S {}
impl Stage for IQ1M {}

/// The signed grids stage their values in registers where AVX2 runs (the scalar way elsewhere:
/// the same bytes, tested through the tiles).
macro_rules! signed_stage {
    ($($f:ty),*) => {$(
        impl Stage for $f {
            fn stage(x: &Self::Block, r: usize, t: &mut TileGrid) {
                #[cfg(target_arch = "x86_64")]
                if super::level() >= super::Level::Avx2 {
                    // SAFETY: AVX2 runs (checked above).
                    return unsafe { avx2::stage_signed::<$f>(x, r, t) };
                }
                stage_scalar::<$f>(x, r, t)
            }
        }
    )*};
}

signed_stage!(IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S);

/// `Format` for a grid format: the lanes of its unpacked block.
macro_rules! grid_format {
    ($($f:ty),*) => {$(
        impl Format for $f {
            type Block = <$f as Grid>::Block;
            type Act = BlockQ8K;
            const N: usize = 256;
            const DTYPE: WeightType = <$f as Grid>::DTYPE;
            const HAS_MIN: bool = false;
            fn dequantize(x: &Self::Block, out: &mut [f32]) {
                <$f as Grid>::dequantize(x, out)
            }
            #[inline(always)]
            fn lanes(x: &Self::Block, y: &BlockQ8K) -> [i32; 8] {
                <$f as Grid>::unpack(x).lanes(y)
            }
            #[inline(always)]
            fn scale(x: &Self::Block, y: &BlockQ8K) -> f32 {
                <$f as Grid>::d(x) * y.d
            }
            #[inline(always)]
            fn min_term(_: &Self::Block, _: &BlockQ8K) -> f32 {
                0.0
            }
        }

        #[cfg(not(target_arch = "x86_64"))]
        impl Avx2 for $f {}
    )*};
}

grid_format!(IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S, IQ1M);

/// `Avx2` for a signed grid: the grid words, sign bits and scales in registers, the signs
/// applied to the activations (`avx2::ilanes_signed`: as byte masks; `ilanes_signed512`: as an
/// AVX-512 mask register).
macro_rules! signed_avx2 {
    ($($f:ty: $eights:expr),*) => {$(
        #[cfg(target_arch = "x86_64")]
        impl Avx2 for $f {
            const SUMS_IN_EIGHTS: bool = $eights;
            type Unpacked = avx2::SignedRegs;
            #[inline(always)]
            unsafe fn unpack(x: &Self::Block) -> avx2::SignedRegs {
                avx2::unpack_signed::<$f>(x)
            }
            #[inline(always)]
            unsafe fn ilanes(u: &avx2::SignedRegs, y: &BlockQ8K) -> std::arch::x86_64::__m256i {
                avx2::ilanes_signed(u, y)
            }
            type U512 = avx2::SignedRegs512;
            // An AVX-512 path that gathers the grid entries decodes slower than the AVX2 path's
            // scalar loads where gathers are slow (Zen 4: l1b-IQ3_XXS 57 against 39 ms/token).
            fn vnni_decode() -> bool {
                !<$f as avx2::SignedVec>::GATHERS || super::level::gathers_fast()
            }
            #[inline(always)]
            unsafe fn unpack512(x: &Self::Block) -> avx2::SignedRegs512 {
                avx2::unpack_signed512::<$f>(x)
            }
            #[inline(always)]
            unsafe fn ilanes512(u: &avx2::SignedRegs512, y: &BlockQ8K) -> std::arch::x86_64::__m256i {
                avx2::ilanes_signed512(u, y)
            }
        }
    )*};
}

signed_avx2!(IQ2XXS: true, IQ2XS: true, IQ2S: true, IQ3XXS: false, IQ3S: false);

/// `Avx2` for the IQ1 types: grid words, shifts and scales in registers (`avx2::ilanes_shifted`).
macro_rules! shifted_avx2 {
    ($($f:ty: $eights:expr),*) => {$(
        #[cfg(target_arch = "x86_64")]
        impl Avx2 for $f {
            const SUMS_IN_EIGHTS: bool = $eights;
            type Unpacked = avx2::ShiftedRegs;
            #[inline(always)]
            unsafe fn unpack(x: &Self::Block) -> avx2::ShiftedRegs {
                avx2::unpack_shifted::<$f>(x)
            }
            #[inline(always)]
            unsafe fn ilanes(u: &avx2::ShiftedRegs, y: &BlockQ8K) -> std::arch::x86_64::__m256i {
                avx2::ilanes_shifted(u, y)
            }
            #[inline(always)]
            unsafe fn itotal(u: &avx2::ShiftedRegs, y: &BlockQ8K) -> std::arch::x86_64::__m256i {
                avx2::itotal_shifted(u, y)
            }
            type U512 = avx2::ShiftedRegs;
            #[inline(always)]
            unsafe fn unpack512(x: &Self::Block) -> avx2::ShiftedRegs {
                avx2::unpack_shifted::<$f>(x)
            }
            #[inline(always)]
            unsafe fn ilanes512(u: &avx2::ShiftedRegs, y: &BlockQ8K) -> std::arch::x86_64::__m256i {
                avx2::ilanes_shifted(u, y)
            }
            #[inline(always)]
            unsafe fn itotal512(u: &avx2::ShiftedRegs, y: &BlockQ8K) -> std::arch::x86_64::__m256i {
                avx2::itotal_shifted(u, y)
            }
        }
    )*};
}

shifted_avx2!(IQ1S: false, IQ1M: true);

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2::{bit_bytes, load32};
    use super::*;
    use std::arch::x86_64::*;

    /// `[e(0), …, e(7)]`, one per chunk, by a plain loop: a closure given to `array::from_fn`
    /// is not inlined into a `#[target_feature]` caller (perf: a call per chunk).
    macro_rules! per_chunk {
        (|$c:ident| $e:expr) => {{
            let mut a = [_mm256_setzero_si256(); 8];
            for ($c, v) in a.iter_mut().enumerate() {
                *v = $e;
            }
            a
        }};
    }

    /// A signed grid block in registers for AVX2: per 32 values the unsigned grid values, the
    /// mask of those negated (0xFF bytes), and the scales as i16 (first 16 values low, next 16
    /// high).
    #[derive(Clone, Copy)]
    pub struct SignedRegs {
        g: [__m256i; 8],
        m: [__m256i; 8],
        sc: [__m256i; 8],
    }

    /// The same for AVX-512: the sign bits stay bits, one mask register per 32 values.
    #[derive(Clone, Copy)]
    pub struct SignedRegs512 {
        g: [__m256i; 8],
        k: [__mmask32; 8],
        sc: [__m256i; 8],
    }

    #[inline(always)]
    pub unsafe fn unpack_signed<G: SignedVec>(x: &G::Block) -> SignedRegs {
        let signs = G::sign_words(x);
        SignedRegs {
            g: per_chunk!(|c| G::grid(x, c)),
            m: per_chunk!(|c| bit_bytes(signs[c])),
            sc: scale_regs(G::scale_bytes(x)),
        }
    }

    #[inline(always)]
    pub unsafe fn unpack_signed512<G: SignedVec>(x: &G::Block) -> SignedRegs512 {
        SignedRegs512 {
            g: per_chunk!(|c| G::grid_gather(x, c)),
            k: G::sign_words(x),
            sc: scale_regs(G::scale_bytes(x)),
        }
    }

    /// Each chunk's scales as i16 lanes (values 32c..32c + 16 low, the next 16 high) from the
    /// block's 16 scale bytes (byte k: the scale of values 16k..16k + 16): one byte shuffle each.
    #[inline(always)]
    unsafe fn scale_regs(bytes: __m128i) -> [__m256i; 8] {
        let both = _mm256_broadcastsi128_si256(bytes);
        // i16 lane = byte k, then a zero byte (0x80 selects zero).
        let pick = |k: usize| _mm_set1_epi16((0x8000 | k) as i16);
        per_chunk!(|c| _mm256_shuffle_epi8(both, _mm256_set_m128i(pick(2 * c + 1), pick(2 * c))))
    }

    /// 16 scales (each < 128) as bytes in a vector.
    #[inline(always)]
    unsafe fn bytes_of(scales: [i16; 16]) -> __m128i {
        let s = scales.map(|s| s as u8);
        _mm_loadu_si128(s.as_ptr() as *const __m128i)
    }

    /// 2s + 1 of each byte s.
    #[inline(always)]
    unsafe fn odd(s: __m128i) -> __m128i {
        _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1))
    }

    /// 16 nibbles from 8 bytes (low nibble first): 2s + 1 of each.
    #[inline(always)]
    unsafe fn nibble_scale_bytes(b: &[u8; 8]) -> __m128i {
        let v = _mm_loadl_epi64(b.as_ptr() as *const __m128i);
        let m4 = _mm_set1_epi8(15);
        let lo = _mm_and_si128(v, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
        odd(_mm_unpacklo_epi8(lo, hi))
    }

    /// The 16 scale bytes of a format with one scale per 32 values (both halves alike), from
    /// the 8 scales s in the low byte of each u32 lane: 2s + 1 of each, twice.
    #[inline(always)]
    unsafe fn per32_scale_bytes(s: __m256i) -> __m128i {
        // Byte 0 of each u32 to the low 4 bytes of its 128-bit lane, then the two lanes' words
        // side by side.
        let pick = _mm256_set1_epi32(0x0C08_0400);
        let b = _mm256_shuffle_epi8(s, pick);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 4, 0));
        let s8 = _mm256_castsi256_si128(b);
        odd(_mm_unpacklo_epi8(s8, s8))
    }

    /// Each byte f (< 128) completed by an eighth bit that makes its count of ones even
    /// ([`KSIGNS`] in registers): the parity of the nibble (f ^ f >> 4) & 15 from a 16-entry
    /// table.
    #[inline(always)]
    unsafe fn ksigns_bytes(f: __m256i) -> __m256i {
        let odd_parity = _mm256_set_epi64x(
            0x0080_8000_8000_0080,
            0x8000_0080_0080_8000_u64 as i64,
            0x0080_8000_8000_0080,
            0x8000_0080_0080_8000_u64 as i64,
        );
        let p = _mm256_and_si256(
            _mm256_xor_si256(f, _mm256_srli_epi16::<4>(f)),
            _mm256_set1_epi8(15),
        );
        _mm256_or_si256(f, _mm256_shuffle_epi8(odd_parity, p))
    }

    /// A vector's 8 u32 lanes.
    #[inline(always)]
    unsafe fn words(v: __m256i) -> [u32; 8] {
        std::mem::transmute(v)
    }

    /// The sign words of the 8 chunks whose 4 × 7 sign bits are the low 28 bits of lane c of
    /// `aux` (IQ2_XXS, IQ3_XXS), each 7 completed by [`KSIGNS`]' eighth.
    #[inline(always)]
    unsafe fn ksigns_of_aux(aux: __m256i) -> [u32; 8] {
        let field = |v: __m256i, m: i32| _mm256_and_si256(v, _mm256_set1_epi32(m));
        let f = _mm256_or_si256(
            _mm256_or_si256(field(aux, 0x7F), field(_mm256_slli_epi32::<1>(aux), 0x7F00)),
            _mm256_or_si256(
                field(_mm256_slli_epi32::<2>(aux), 0x7F_0000),
                field(_mm256_slli_epi32::<3>(aux), 0x7F00_0000),
            ),
        );
        words(ksigns_bytes(f))
    }

    /// A signed grid's block in vectors: by default from the scalar [`SignedGrid`] methods;
    /// each format computes what it can in registers instead. All give the scalar methods' bits
    /// (tested through the dot products at every level).
    pub trait SignedVec: SignedGrid {
        /// Whether [`SignedVec::grid_gather`] gathers (else it is [`SignedVec::grid`]).
        const GATHERS: bool = false;
        /// Chunk c (values 32c..32c + 32) as one vector of its 32 unsigned grid values.
        ///
        /// # Safety
        /// AVX2 runs (the contract of [`Avx2`]).
        #[inline(always)]
        unsafe fn grid(x: &Self::Block, c: usize) -> __m256i {
            let (w, _) = Self::chunk(x, c);
            _mm256_set_epi64x(w[3] as i64, w[2] as i64, w[1] as i64, w[0] as i64)
        }
        /// [`SignedVec::grid`] where gathers pay: decode at the AVX-512 level, and staging
        /// (many blocks, each once) at every level.
        ///
        /// # Safety
        /// AVX2 runs.
        #[inline(always)]
        unsafe fn grid_gather(x: &Self::Block, c: usize) -> __m256i {
            Self::grid(x, c)
        }
        /// The 8 chunks' sign words (bit i of word c: value 32c + i negated).
        ///
        /// # Safety
        /// AVX2 runs.
        #[inline(always)]
        unsafe fn sign_words(x: &Self::Block) -> [u32; 8] {
            let mut w = [0u32; 8];
            for (c, w) in w.iter_mut().enumerate() {
                *w = Self::chunk(x, c).1;
            }
            w
        }
        /// The 16 integer scales (each ≤ 31) as bytes.
        ///
        /// # Safety
        /// AVX2 runs.
        #[inline(always)]
        unsafe fn scale_bytes(x: &Self::Block) -> __m128i {
            bytes_of(Self::scales(x))
        }
    }

    /// 8 bytes zero-extended to 8 i32 lanes.
    #[inline(always)]
    unsafe fn bytes8(b: &[u8]) -> __m256i {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(b[..8].as_ptr() as *const __m128i))
    }

    impl IQ2XXS {
        /// The 8 chunks' sign-and-scale words (the u32 after each chunk's 4 index bytes).
        #[inline(always)]
        unsafe fn aux(x: &BlockIQ2XXS) -> __m256i {
            let a = _mm256_castsi256_ps(load32(&x.qs[..32]));
            let b = _mm256_castsi256_ps(load32(&x.qs[32..]));
            // Odd words of each lane: [a0 a1 b4 b5 | a2 a3 b6 b7], then in chunk order.
            let odd = _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(a, b));
            _mm256_permute4x64_epi64::<0b11_01_10_00>(odd)
        }
    }

    impl SignedVec for IQ2XXS {
        #[inline(always)]
        unsafe fn sign_words(x: &BlockIQ2XXS) -> [u32; 8] {
            ksigns_of_aux(Self::aux(x))
        }
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ2XXS) -> __m128i {
            per32_scale_bytes(_mm256_srli_epi32::<28>(Self::aux(x)))
        }
    }

    impl SignedVec for IQ2XS {
        /// Each u16's top 7 bits, completed.
        #[inline(always)]
        unsafe fn sign_words(x: &BlockIQ2XS) -> [u32; 8] {
            let a = _mm256_srli_epi16::<9>(load32(&x.qs[..32]));
            let b = _mm256_srli_epi16::<9>(load32(&x.qs[32..]));
            // [a0..7 b0..7 | a8..15 b8..15] as bytes, then in order.
            let f = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(a, b));
            words(ksigns_bytes(f))
        }
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ2XS) -> __m128i {
            nibble_scale_bytes(&x.scales)
        }
    }

    impl SignedVec for IQ2S {
        #[inline(always)]
        unsafe fn sign_words(x: &BlockIQ2S) -> [u32; 8] {
            words(load32(&x.qs[32..]))
        }
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ2S) -> __m128i {
            nibble_scale_bytes(&x.scales)
        }
    }

    /// Eight 4-value entries of an IQ3 grid by scalar loads: entry j's index is byte j of `q`
    /// with bit j of `hi` as its ninth bit.
    #[inline(always)]
    unsafe fn entries8<const N: usize>(table: &[u32; N], q: &[u8], hi: usize) -> __m256i {
        let q: &[u8; 8] = q[..8].try_into().expect("8 index bytes");
        macro_rules! e {
            ($j:literal) => {
                table[q[$j] as usize | (hi >> $j & 1) << 8] as i32
            };
        }
        _mm256_set_epi32(e!(7), e!(6), e!(5), e!(4), e!(3), e!(2), e!(1), e!(0))
    }

    /// The IQ3 types look their 4-value entries up by scalar loads in decode at the AVX2 level,
    /// and gather them with one `vpgatherdd` per 32 values elsewhere (indices computed in
    /// registers: 8 bits for IQ3_XXS's 256 entries, 9 for IQ3_S's 512, so every gathered load
    /// is inside its table). Gathers are slow on the CPUs that stop at AVX2 (Zen 2: IQ3_XXS
    /// decode 0.73× llama.cpp's with them), and on Intel's since the Gather Data Sampling fix;
    /// on AMD's AVX-512 cores decode takes the AVX2 path (`level::gathers_fast`).
    impl SignedVec for IQ3XXS {
        const GATHERS: bool = true;
        #[inline(always)]
        unsafe fn grid(x: &BlockIQ3XXS, c: usize) -> __m256i {
            entries8(&IQ3XXS_GRID, &x.qs[8 * c..], 0)
        }
        #[inline(always)]
        unsafe fn grid_gather(x: &BlockIQ3XXS, c: usize) -> __m256i {
            let idx = bytes8(&x.qs[8 * c..]);
            _mm256_i32gather_epi32::<4>(IQ3XXS_GRID.as_ptr() as *const i32, idx)
        }
        #[inline(always)]
        unsafe fn sign_words(x: &BlockIQ3XXS) -> [u32; 8] {
            ksigns_of_aux(load32(&x.qs[64..]))
        }
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ3XXS) -> __m128i {
            per32_scale_bytes(_mm256_srli_epi32::<28>(load32(&x.qs[64..])))
        }
    }

    impl SignedVec for IQ3S {
        const GATHERS: bool = true;
        /// Entry j's ninth index bit is bit j of `qh[c]`.
        #[inline(always)]
        unsafe fn grid(x: &BlockIQ3S, c: usize) -> __m256i {
            entries8(&IQ3S_GRID, &x.qs[8 * c..], x.qh[c] as usize)
        }
        #[inline(always)]
        unsafe fn grid_gather(x: &BlockIQ3S, c: usize) -> __m256i {
            let hi = _mm256_srlv_epi32(
                _mm256_set1_epi32(x.qh[c] as i32),
                _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
            );
            let hi = _mm256_slli_epi32::<8>(_mm256_and_si256(hi, _mm256_set1_epi32(1)));
            let idx = _mm256_or_si256(bytes8(&x.qs[8 * c..]), hi);
            _mm256_i32gather_epi32::<4>(IQ3S_GRID.as_ptr() as *const i32, idx)
        }
        #[inline(always)]
        unsafe fn sign_words(x: &BlockIQ3S) -> [u32; 8] {
            words(load32(&x.signs))
        }
        /// One nibble per 32 values (low nibble first), each for both halves.
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ3S) -> __m128i {
            let v = _mm_cvtsi32_si128(u32::from_le_bytes(x.scales) as i32);
            let m4 = _mm_set1_epi8(15);
            let s = _mm_unpacklo_epi8(
                _mm_and_si128(v, m4),
                _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
            );
            odd(_mm_unpacklo_epi8(s, s))
        }
    }

    /// [`Stage::stage`] for a signed grid: each chunk's values with their signs applied in
    /// registers ((g ^ m) − m), scattered to the tile 4 bytes at a time; the bias term from
    /// maddubs/madd sums.
    #[inline(always)]
    pub unsafe fn stage_signed<G: SignedVec>(x: &G::Block, r: usize, t: &mut TileGrid) {
        let signs = G::sign_words(x);
        let sb = G::scale_bytes(x);
        let sc = scale_regs(sb);
        let mut bias = _mm256_setzero_si256();
        for (c, s) in signs.into_iter().enumerate() {
            let m = bit_bytes(s);
            let v = _mm256_sub_epi8(_mm256_xor_si256(G::grid_gather(x, c), m), m);
            let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), v);
            bias = _mm256_add_epi32(bias, _mm256_madd_epi16(pairs, sc[c]));
            let w = words(v);
            for (i, w) in w.into_iter().enumerate() {
                t.q[8 * c + i][4 * r..4 * r + 4].copy_from_slice(&w.to_le_bytes());
            }
        }
        let b = words(bias);
        t.bias[r] = 128 * b.iter().map(|&v| v as i32).sum::<i32>();
        let s: [u8; 16] = std::mem::transmute(sb);
        for (row, s) in t.sc.iter_mut().zip(s) {
            row[r] = s as i16;
        }
        t.d[r] = G::d(x);
    }

    /// Σ_c madd(scales_c, maddubs(g_c, ±y_c)): the signs applied to the activations ((y ^ m) −
    /// m negates y where m is −1; |y| ≤ 127), the grid values (≤ 62) as maddubs's unsigned
    /// operand: a pair ≤ 2·62·127 = 15 748.
    #[inline(always)]
    pub unsafe fn ilanes_signed(u: &SignedRegs, y: &BlockQ8K) -> __m256i {
        let mut sum = _mm256_setzero_si256();
        for c in 0..8 {
            let yc = load32(&y.qs[32 * c..32 * c + 32]);
            let sy = _mm256_sub_epi8(_mm256_xor_si256(yc, u.m[c]), u.m[c]);
            let p = _mm256_maddubs_epi16(u.g[c], sy);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[c], p));
        }
        sum
    }

    /// [`ilanes_signed`] with the signs as mask registers: y negated where its bit is set (0 − y
    /// under the mask), the same lanes.
    #[inline(always)]
    pub unsafe fn ilanes_signed512(u: &SignedRegs512, y: &BlockQ8K) -> __m256i {
        let zero = _mm256_setzero_si256();
        let mut sum = _mm256_setzero_si256();
        for c in 0..8 {
            let yc = load32(&y.qs[32 * c..32 * c + 32]);
            let sy = _mm256_mask_sub_epi8(yc, u.k[c], zero, yc);
            let p = _mm256_maddubs_epi16(u.g[c], sy);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[c], p));
        }
        sum
    }

    /// An IQ1 block in registers: per 32 values the grid values + 1 (0, 1, 2), and two scale
    /// vectors in the i16 lanes of the value pairs: 8·scale, and (δ − 8)·scale (δ the shift of
    /// the pair's 8 values; scales first 16 values low); where a shift covers 16 values or more
    /// (IQ1_S), also (δ − 8)·scale once per 16 values, for the activations' sums of 16 (`bsums`).
    #[derive(Clone, Copy)]
    pub struct ShiftedRegs {
        g1: [__m256i; 8],
        sc8: [__m256i; 8],
        scd: [__m256i; 8],
        d16: Option<__m256i>,
    }

    /// An IQ1 block in vectors: its grid words by default from [`ShiftedGrid::chunk`]; each
    /// format computes its shifts and scales in registers (tested through the dot products).
    pub trait ShiftedVec: ShiftedGrid {
        /// Chunk c's 32 grid values (−1, 0, 1).
        ///
        /// # Safety
        /// AVX2 runs (the contract of [`Avx2`]).
        #[inline(always)]
        unsafe fn grid(x: &Self::Block, c: usize) -> __m256i {
            let (w, _) = Self::chunk(x, c);
            _mm256_set_epi64x(w[3] as i64, w[2] as i64, w[1] as i64, w[0] as i64)
        }
        /// Each chunk's δ − 8 (−7 or −9) in the i16 lanes of its value pairs.
        ///
        /// # Safety
        /// AVX2 runs.
        unsafe fn dm8(x: &Self::Block) -> [__m256i; 8];
        /// (δ − 8)·scale for each 16 values in i16 lanes, where one shift covers them, given
        /// the scale bytes ([`ShiftedVec::scale_bytes`]).
        ///
        /// # Safety
        /// AVX2 runs.
        #[inline(always)]
        unsafe fn d16(_x: &Self::Block, _scale_bytes: __m128i) -> Option<__m256i> {
            None
        }
        /// The 16 integer scales (each ≤ 15) as bytes.
        ///
        /// # Safety
        /// AVX2 runs.
        #[inline(always)]
        unsafe fn scale_bytes(x: &Self::Block) -> __m128i {
            bytes_of(Self::scales(x))
        }
    }

    /// −7 where a mask byte is 0, −9 where it is −1: δ − 8 for δ = +1 and −1.
    #[inline(always)]
    unsafe fn minus_7_or_9(neg: __m128i) -> __m128i {
        _mm_add_epi8(_mm_set1_epi8(-7), _mm_add_epi8(neg, neg))
    }

    /// IQ1_S's δ − 8 (−7 or −9) of chunk c in i16 lane c: bit 15 of its `qh` word.
    #[inline(always)]
    unsafe fn iq1s_dm(x: &BlockIQ1S) -> __m128i {
        let neg = _mm_srai_epi16::<15>(_mm_loadu_si128(x.qh.as_ptr() as *const __m128i));
        _mm_add_epi16(_mm_set1_epi16(-7), _mm_add_epi16(neg, neg))
    }

    impl ShiftedVec for IQ1S {
        /// One shift per 32 values: bit 15 of the chunk's `qh` word.
        #[inline(always)]
        unsafe fn dm8(x: &BlockIQ1S) -> [__m256i; 8] {
            let both = _mm256_broadcastsi128_si256(iq1s_dm(x));
            per_chunk!(|c| {
                let pick = _mm256_set1_epi16((((2 * c + 1) << 8) | (2 * c)) as i16);
                _mm256_shuffle_epi8(both, pick)
            })
        }
        #[inline(always)]
        unsafe fn d16(x: &BlockIQ1S, sb: __m128i) -> Option<__m256i> {
            // Chunk c's δ − 8 in i16 lanes 2c and 2c + 1.
            let dm = iq1s_dm(x);
            let dm = _mm256_set_m128i(_mm_unpackhi_epi16(dm, dm), _mm_unpacklo_epi16(dm, dm));
            Some(_mm256_mullo_epi16(dm, _mm256_cvtepu8_epi16(sb)))
        }
        /// Bits 12..=14 of each chunk's `qh` word, for both halves.
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ1S) -> __m128i {
            let qh = _mm_loadu_si128(x.qh.as_ptr() as *const __m128i);
            let s = _mm_and_si128(_mm_srli_epi16::<12>(qh), _mm_set1_epi16(7));
            let s = _mm_packus_epi16(s, s);
            odd(_mm_unpacklo_epi8(s, s))
        }
    }

    impl ShiftedVec for IQ1M {
        /// Scale k is bits 3(k % 4).. of scale word k / 4: each word in four u16 lanes, shifted
        /// left by 9 − 3(k % 4) (a multiply), then right by 9.
        #[inline(always)]
        unsafe fn scale_bytes(x: &BlockIQ1M) -> __m128i {
            let w = _mm_loadl_epi64(x.scales.as_ptr() as *const __m128i);
            let lo = _mm_shuffle_epi8(
                w,
                _mm_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 1, 0, 1, 0, 1, 0, 1, 0),
            );
            let hi = _mm_shuffle_epi8(
                w,
                _mm_set_epi8(7, 6, 7, 6, 7, 6, 7, 6, 5, 4, 5, 4, 5, 4, 5, 4),
            );
            let mult = _mm_set_epi16(1, 8, 64, 512, 1, 8, 64, 512);
            let take = |v: __m128i| {
                let v = _mm_srli_epi16::<9>(_mm_mullo_epi16(v, mult));
                _mm_and_si128(v, _mm_set1_epi16(7))
            };
            odd(_mm_packus_epi16(take(lo), take(hi)))
        }
        /// One shift per 8 values: bits 3 and 7 of each `qh` byte (runs 2i and 2i + 1).
        #[inline(always)]
        unsafe fn dm8(x: &BlockIQ1M) -> [__m256i; 8] {
            let qh = _mm_loadu_si128(x.qh.as_ptr() as *const __m128i);
            let bit = |b: i8| {
                let m = _mm_set1_epi8(b);
                _mm_cmpeq_epi8(_mm_and_si128(qh, m), m)
            };
            let (lo, hi) = (bit(0x08), bit(0x80u8 as i8));
            // Runs 0..16 and 16..32 in order, as −7 / −9 bytes.
            let runs = [
                minus_7_or_9(_mm_unpacklo_epi8(lo, hi)),
                minus_7_or_9(_mm_unpackhi_epi8(lo, hi)),
            ];
            per_chunk!(|c| {
                // Byte 4c + n (n = 0..4) of the runs, each in 4 i16 lanes.
                let k = (4 * (c % 4)) as i8;
                let pick = _mm_set_epi8(
                    k + 3,
                    k + 3,
                    k + 3,
                    k + 3,
                    k + 2,
                    k + 2,
                    k + 2,
                    k + 2,
                    k + 1,
                    k + 1,
                    k + 1,
                    k + 1,
                    k,
                    k,
                    k,
                    k,
                );
                _mm256_cvtepi8_epi16(_mm_shuffle_epi8(runs[c / 4], pick))
            })
        }
    }

    #[inline(always)]
    pub unsafe fn unpack_shifted<G: ShiftedVec>(x: &G::Block) -> ShiftedRegs {
        let one = _mm256_set1_epi8(1);
        let sb = G::scale_bytes(x);
        // 8·scale ≤ 120: the bytes shifted within their i16 lanes carry nothing across.
        let sc8 = scale_regs(_mm_slli_epi16::<3>(sb));
        let sc = scale_regs(sb);
        let dm8 = G::dm8(x);
        ShiftedRegs {
            g1: per_chunk!(|c| _mm256_add_epi8(G::grid(x, c), one)),
            sc8,
            scd: per_chunk!(|c| _mm256_mullo_epi16(sc[c], dm8[c])),
            d16: G::d16(x, sb),
        }
    }

    /// Lanes whose total is [`ilanes_shifted`]'s, for the tiles' order (which adds a block's
    /// lanes first): where one shift covers 16 values, the shifts' Σ (δ − 8)·scale·y is one
    /// madd with the activations' sums of 16 per block (bsums ≤ 16·127), not a maddubs and a
    /// madd per 32 values.
    #[inline(always)]
    pub unsafe fn itotal_shifted(u: &ShiftedRegs, y: &BlockQ8K) -> __m256i {
        let Some(d16) = u.d16 else {
            return ilanes_shifted(u, y);
        };
        let mut sum = _mm256_madd_epi16(d16, load32(&y.bsums));
        for c in 0..8 {
            let yc = load32(&y.qs[32 * c..32 * c + 32]);
            sum = _mm256_add_epi32(sum, grid_part(u, c, yc));
        }
        sum
    }

    /// Chunk `c`'s madd(8·scales_c, maddubs(g + 1, y)): the grid values' share of its pair sums.
    #[inline(always)]
    unsafe fn grid_part(u: &ShiftedRegs, c: usize, yc: __m256i) -> __m256i {
        _mm256_madd_epi16(u.sc8[c], _mm256_maddubs_epi16(u.g1[c], yc))
    }

    /// Σ_c madd(8·scales_c, maddubs(g + 1, y)) + madd((δ − 8)·scales_c, maddubs(1, y)): the
    /// exact Σ scale·(8g + δ)·y of each pair (pair sums ≤ 2·2·127, times ≤ 9·15).
    #[inline(always)]
    pub unsafe fn ilanes_shifted(u: &ShiftedRegs, y: &BlockQ8K) -> __m256i {
        let one = _mm256_set1_epi8(1);
        let mut sum = _mm256_setzero_si256();
        for c in 0..8 {
            let yc = load32(&y.qs[32 * c..32 * c + 32]);
            let p = grid_part(u, c, yc);
            let s = _mm256_madd_epi16(u.scd[c], _mm256_maddubs_epi16(one, yc));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(p, s));
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksigns_complete_seven_bits_to_an_even_count_as_ggml_lists_them() {
        // ggml-common.h's ksigns_iq2xs begins 0, 129, 130, 3, 132, 5, 6, 135 and ends 255.
        assert_eq!(KSIGNS[..8], [0, 129, 130, 3, 132, 5, 6, 135]);
        assert_eq!(KSIGNS[127], 255);
        assert!(KSIGNS.iter().all(|s| s.count_ones() % 2 == 0));
    }

    #[test]
    fn signed_grid_bytes_are_each_value_negated_where_its_bit_is_set() {
        // The sign trick needs every sign-bearing grid value in 1..=127.
        let bytes = |w: u64| w.to_le_bytes();
        for w in IQ2XXS_GRID.iter().chain(&IQ2XS_GRID).chain(&IQ2S_GRID) {
            assert!(bytes(*w).iter().all(|&b| (1..=127).contains(&b)));
        }
        for w in IQ3XXS_GRID.iter().chain(&IQ3S_GRID) {
            assert!(w.to_le_bytes().iter().all(|&b| (1..=127).contains(&b)));
        }
        let grid = IQ2XS_GRID[300];
        for s in [0u8, 1, 0x80, 0xA5, 0xFF] {
            let got = bytes(signed8(grid, s));
            for (j, (&g, &v)) in bytes(grid).iter().zip(&got).enumerate() {
                let want = if s >> j & 1 == 1 { -(g as i8) } else { g as i8 };
                assert_eq!(v as i8, want, "sign byte {s:#x} value {j}");
            }
        }
    }

    #[test]
    fn iq1_values_are_eight_times_the_grid_plus_the_shift() {
        let w = IQ1S_GRID[5]; // 0xffffffffff00ff00 ... bytes −1, 0, 1
        for delta in [-1i8, 1] {
            let got = shifted8(w, delta).to_le_bytes();
            for (g, v) in w.to_le_bytes().iter().zip(got) {
                assert_eq!(v as i8, 8 * (*g as i8) + delta);
            }
        }
    }
}
