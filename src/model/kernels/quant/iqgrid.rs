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
mod avx2;

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
