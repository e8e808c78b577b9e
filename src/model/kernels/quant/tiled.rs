//! Row-interleaved tiles: 16 rows' blocks at one column position stored so that one AVX-512 VNNI
//! `dpbusd` multiplies 4 values of each of the 16 rows by the same 4 activation values, leaving one
//! i32 lane per row (llama.cpp's and candle's "repack" idea). Scales are unpacked per tile once, at
//! load, so a block costs one fused multiply-add per 16 rows instead of one per row. The tile
//! replaces the GGUF layout (no second copy): Q8_0, Q6_K, Q2_K and IQ4_NL tiles are the same size
//! as their 16 blocks, Q4_K's, Q5_K's, IQ4_XS's and Q3_K's 1.5-4 % larger (their 6-bit scales,
//! mins or third bits kept apart).
//!
//! **Summation order** (tiled matrices; [`dot_rows_scalar`] is the reference): per row, per block,
//! the exact integer sum of the block's products (the format's `lanes`, added), converted to f32 and
//! fused-multiply-added with the block's scale into one accumulator; min terms added apart; then
//! the two added. Decode and prefill run the same per-block steps, so they agree to the bit.
//! The same tiles run on AVX2 (`avx2`: maddubs+madd for dpbusd, 8 rows per register) with the
//! same exact integer sums, so both levels give the same bits. Without AVX2 a matrix keeps the
//! per-row layout and the 8-lane order.

use super::iquants::{scale_xs, BlockIQ4NL, BlockIQ4XS, KVALUES};
use super::legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1};
use super::{
    BlockQ8K, BlockQ8_0, BlockQ8_1, Format, IQ1M, IQ1S, IQ2S, IQ2XS, IQ2XXS, IQ3S, IQ3XXS, IQ4NL,
    IQ4XS, Q2K, Q3K, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0,
};
use anyhow::Result;
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Rows per tile.
pub const TR: usize = 16;

/// Bytes of GGUF blocks read per step when packing a matrix from a file.
const CHUNK_BYTES: usize = 4 << 20;

/// A format whose blocks can be interleaved 16 rows to a tile.
pub trait Tiled: Format {
    type Tile: Pod + Send + Sync;
    /// Whether the kernel needs each activation block's offset term ([`Tiled::ysum`]).
    const YSUM: bool;
    /// The blocks of 16 consecutive rows at one column position, written into `t` (zero on
    /// entry).
    fn pack(rows: [&Self::Block; TR], t: &mut Self::Tile);
    /// Row `r` of the tile dequantized (`N` values), as `Format::dequantize` gives it.
    fn dequantize_row(t: &Self::Tile, r: usize, out: &mut [f32]);
    /// The offset term of an activation block (where `YSUM`): the format's quant offset (8, 16
    /// or 128, what the tile adds to make its quants unsigned) times the block's integer sum,
    /// computed once per block and token rather than in every tile's kernel.
    fn ysum(_y: &Self::Act) -> i32 {
        0
    }
    /// The activation blocks as the tile kernel reads them, changed once per matmul: by default
    /// as quantized; the grid tiles take each value + 128 (as u8, the unsigned operand of
    /// `dpbusd`/`maddubs`, their own values signed).
    fn bias(_ys: &mut [Self::Act]) {}
}

/// Four activation values (i8) as one little-endian word: what the tile kernels broadcast to
/// every 32-bit lane.
#[inline(always)]
fn four(q: &[i8]) -> i32 {
    let b: [u8; 4] = bytemuck::cast_slice::<i8, u8>(&q[..4])
        .try_into()
        .expect("4");
    i32::from_le_bytes(b)
}

/// The reference sum of one row (see the module's summation order).
pub fn dot_rows_scalar<F: Format>(xs: &[F::Block], ys: &[F::Act]) -> f32 {
    let mut acc = 0f32;
    let mut summ = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let isum: i32 = F::lanes(x, y).iter().sum();
        acc = (isum as f32).mul_add(F::scale(x, y), acc);
        if F::HAS_MIN {
            summ += F::min_term(x, y);
        }
    }
    acc + summ
}

/// Q8_0 tile: `d` of each row; `qs[g]` holds values 4g..4g+4 of the 16 rows (row r at bytes
/// 4r..4r+4), each stored + 128 as u8 (dpbusd multiplies u8 by i8; the 128·Σy is taken off).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ8_0 {
    pub d: [f16; TR],
    pub qs: [[u8; 4 * TR]; 8],
}

/// Q4_K tile: d, dmin, the 8 sub-block scales and mins of each row unpacked to bytes; `qs[g]`
/// holds values 8g..8g+8 of the 16 rows, row r's 4 bytes at 4r: value 8g+j in the low nibble of
/// byte j, value 8g+j+4 in its high nibble.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ4K {
    pub d: [f16; TR],
    pub dmin: [f16; TR],
    pub sc: [[u8; TR]; 8],
    pub m: [[u8; TR]; 8],
    pub qs: [[u8; 4 * TR]; 32],
}

/// Q5_K tile: Q4_K's scales and mins; then per sub-block j of 32 values `q[j] = [qs(4j),
/// .., qs(4j + 3), qh(j)]`: `qs(g)` as Q4_K's `qs[g]`, `qh(j)` the fifth bits of the sub-block,
/// laid out as a Q5_0 tile's `qh`. A sub-block's bytes lie together, so a tile is read as one
/// stream.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ5K {
    pub d: [f16; TR],
    pub dmin: [f16; TR],
    pub sc: [[u8; TR]; 8],
    pub m: [[u8; TR]; 8],
    pub q: [[[u8; 4 * TR]; 5]; 8],
}

/// Q6_K tile: d and the 16 sub-block scales of each row; then per sub-block h of 16 values,
/// `q[h] = [ql(2h), ql(2h + 1), qh(h)]`, where `ql(g)` holds the low 4 bits of values 8g..8g+8
/// (as Q4_K's `qs[g]`) and `qh(h)` the high 2 bits of values 16h..16h+16: row r's byte 4r+j
/// holds values 16h+j, +4, +8, +12 in bits 0-1, 2-3, 4-5, 6-7. A sub-block's bytes lie
/// together, so a tile is read as one stream.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ6K {
    pub d: [f16; TR],
    pub sc: [[i8; TR]; 16],
    pub q: [[[u8; 4 * TR]; 3]; 16],
}

/// Q4_0 tile: `d` of each row; `qs[g]` holds values 8g..8g+8 of the 16 rows as Q4_K's tile does
/// (unsigned nibbles; the 8·Σy is taken off).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ4_0 {
    pub d: [f16; TR],
    pub qs: [[u8; 4 * TR]; 4],
}

/// Q4_1 tile: `d` and `m` of each row, nibbles as Q4_0's.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ4_1 {
    pub d: [f16; TR],
    pub m: [f16; TR],
    pub qs: [[u8; 4 * TR]; 4],
}

/// Q5_0 tile: as Q4_0's, plus the fifth bits: row r's byte 4r+j of `qh` holds, in bit k, the
/// fifth bit of value 4k+j (so group g's low-nibble values have bit 2g, its high ones bit 2g+1).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ5_0 {
    pub d: [f16; TR],
    pub qs: [[u8; 4 * TR]; 4],
    pub qh: [u8; 4 * TR],
}

/// Q5_1 tile: Q5_0's with `m`.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ5_1 {
    pub d: [f16; TR],
    pub m: [f16; TR],
    pub qs: [[u8; 4 * TR]; 4],
    pub qh: [u8; 4 * TR],
}

/// Q2_K tile: d and dmin of each row; `scm[j][r]` sub-block j's 4-bit scale (low nibble) and min
/// (high) of row r, as the block stores them; `qs[g]` the 2-bit quants of values 16g..16g+16 of
/// the 16 rows: row r's byte 4r+j holds values 16g+j, +4, +8, +12 in bits 0-1, 2-3, 4-5, 6-7
/// (Q6_K tile's high-bit layout). The same size as its 16 blocks.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ2K {
    pub d: [f16; TR],
    pub dmin: [f16; TR],
    pub scm: [[u8; TR]; 16],
    pub qs: [[u8; 4 * TR]; 16],
}

/// Q3_K tile: d and the 16 sub-block scales (less 32) of each row; then per pair p of groups,
/// `q[p] = [qs of group 2p, qs of group 2p + 1, their third bits]` (`qs(g)`, `hb(g)`): the low
/// 2 bits of values 16g..16g+16 as Q2_K's tile holds them, and their third bits, bit 4(g % 2) + k
/// of row r's byte 4r+j being that of value 16g + 4k + j. A decode reads the pairs in order, one
/// stream (the third bits apart, after all the low bits, were a second stream the loads waited
/// on). 3.6 % larger than its 16 blocks.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileQ3K {
    pub d: [f16; TR],
    pub sc: [[i8; TR]; 16],
    pub q: [[[u8; 4 * TR]; 3]; 8],
}

impl TileQ3K {
    /// The low 2 bits of group `g`'s values.
    #[inline(always)]
    pub fn qs(&self, g: usize) -> &[u8; 4 * TR] {
        &self.q[g / 2][g % 2]
    }
    /// The third bits of group `g`'s values (shared with its pair's other group).
    #[inline(always)]
    pub fn hb(&self, g: usize) -> &[u8; 4 * TR] {
        &self.q[g / 2][2]
    }
}

/// Row `r`'s 2-bit values `v[16g..16g + 16]` (bits 0-1 used) written into `qs[g]` of a Q2_K/Q3_K
/// tile, for each g.
fn interleave_crumbs(v: &[u8; 256], r: usize, qs: &mut [[u8; 4 * TR]; 16]) {
    for (g, group) in qs.iter_mut().enumerate() {
        for j in 0..4 {
            group[4 * r + j] =
                (0..4).fold(0u8, |b, k| b | ((v[16 * g + 4 * k + j] & 3) << (2 * k)));
        }
    }
}

/// Value `e`'s 2-bit quant (row `r`) in `group`, the tile's low bits of its group `e / 16`.
fn crumb_at(group: &[u8; 4 * TR], r: usize, e: usize) -> u8 {
    let (k, j) = (e % 16 / 4, e % 4);
    (group[4 * r + j] >> (2 * k)) & 3
}

impl Tiled for Q2K {
    type Tile = TileQ2K;
    const YSUM: bool = false;
    fn pack(rows: [&super::kquants::BlockQ2K; TR], t: &mut TileQ2K) {
        for (r, x) in rows.iter().enumerate() {
            (t.d[r], t.dmin[r]) = (x.d, x.dmin);
            for j in 0..16 {
                t.scm[j][r] = x.scales[j];
            }
            let v: [u8; 256] = std::array::from_fn(|e| super::kquants::q2(&x.qs, e) as u8);
            interleave_crumbs(&v, r, &mut t.qs);
        }
    }
    fn dequantize_row(t: &TileQ2K, r: usize, out: &mut [f32]) {
        let (d, dmin) = (t.d[r].to_f32(), t.dmin[r].to_f32());
        for (e, o) in out.iter_mut().enumerate() {
            let s = t.scm[e / 16][r];
            let q = crumb_at(&t.qs[e / 16], r, e);
            *o = d * (s & 0xF) as f32 * q as f32 - dmin * (s >> 4) as f32;
        }
    }
}

impl Tiled for Q3K {
    type Tile = TileQ3K;
    const YSUM: bool = false;
    fn pack(rows: [&super::kquants::BlockQ3K; TR], t: &mut TileQ3K) {
        let mut qs = [[0u8; 4 * TR]; 16];
        let mut hb = [[0u8; 4 * TR]; 8];
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            let sc = super::kquants::scales_q3(&x.scales);
            for (row, s) in t.sc.iter_mut().zip(sc) {
                row[r] = s;
            }
            let v: [u8; 256] = std::array::from_fn(|e| super::kquants::q3(x, e) as u8);
            interleave_crumbs(&v, r, &mut qs);
            for (g, chunk) in v.chunks_exact(16).enumerate() {
                for j in 0..4 {
                    let bits = (0..4).fold(0u8, |b, k| b | ((chunk[4 * k + j] >> 2) << k));
                    hb[g / 2][4 * r + j] |= bits << (4 * (g % 2));
                }
            }
        }
        for (p, q) in t.q.iter_mut().enumerate() {
            *q = [qs[2 * p], qs[2 * p + 1], hb[p]];
        }
    }
    fn dequantize_row(t: &TileQ3K, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (e, o) in out.iter_mut().enumerate() {
            let (g, k, j) = (e / 16, e % 16 / 4, e % 4);
            let hi = (t.hb(g)[4 * r + j] >> (4 * (g % 2) + k)) & 1;
            let q = (crumb_at(t.qs(g), r, e) | (hi << 2)) as i32 - 4;
            *o = d * t.sc[g][r] as f32 * q as f32;
        }
    }
}

/// A grid i-quant's super-block for 16 rows, staged for the tile kernels during a matmul (never
/// stored: the unpacked values are 4× the bytes of IQ2's blocks): each row's d·2^-k, its 16
/// integer scales, its 256 signed values (`q[g]`: values 4g..4g+4 of the 16 rows, row r's at
/// bytes 4r..4r+4), and the term the activations' bias adds to each row's sum:
/// `bias[r] = 128 · Σ_j sc_j · Σ_{e in j} q_e` (the kernels read y + 128, [`Tiled::bias`]:
/// Σ sc·q·(y + 128) − bias = Σ sc·q·y, one subtraction per block instead of one per 16 values).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileGrid {
    pub d: [f32; TR],
    pub sc: [[i16; TR]; 16],
    pub q: [[u8; 4 * TR]; 64],
    pub bias: [i32; TR],
}

/// `Tiled` for the grid i-quants: `pack` stages a row group (each block unpacked once),
/// `dequantize_row` gives ggml's bits ((d·2^-k·scale)·value and ggml's (d·(0.5 + s)·2^-j)·value are
/// the same real number, rounded once each).
macro_rules! staged_tiles {
    ($($f:ty),*) => {$(
        impl Tiled for $f {
            type Tile = TileGrid;
            const YSUM: bool = false;
            fn pack(rows: [&<$f as Format>::Block; TR], t: &mut TileGrid) {
                for (r, x) in rows.iter().enumerate() {
                    <$f as super::iqgrid::Stage>::stage(x, r, t);
                }
            }
            fn dequantize_row(t: &TileGrid, r: usize, out: &mut [f32]) {
                for (e, o) in out.iter_mut().enumerate() {
                    let q = t.q[e / 4][4 * r + e % 4] as i8;
                    *o = t.d[r] * t.sc[e / 16][r] as f32 * q as f32;
                }
            }
            fn bias(ys: &mut [BlockQ8K]) {
                for y in ys {
                    for v in y.qs.iter_mut() {
                        *v ^= i8::MIN;
                    }
                }
            }
        }
    )*};
}

staged_tiles!(IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S, IQ1M);

/// IQ4_NL tile: `d` of each row; `qs[g]` holds the table indices of values 8g..8g+8 of the 16
/// rows as a Q4_0 tile holds its nibbles (the kernels look the values up).
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileIQ4NL {
    pub d: [f16; TR],
    pub qs: [[u8; 4 * TR]; 4],
}

/// IQ4_XS tile: d and the 8 sub-block scales (less 32) of each row; `qs[g]` the table indices
/// of values 8g..8g+8 as Q4_K's tile holds its nibbles.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct TileIQ4XS {
    pub d: [f16; TR],
    pub sc: [[i8; TR]; 8],
    pub qs: [[u8; 4 * TR]; 32],
}

/// A 32-value block's quants in value order (low nibbles are values 0..16, high 16..32), with
/// Q5's fifth bits (bit i of `qh`, little-endian) at bit 4.
fn legacy_values(qs: &[u8; 16], qh: Option<&[u8; 4]>) -> [u8; 32] {
    // Four values per word (packing is a load-time cost: Gemma 3 packs 246 MB).
    let h = qh.map_or(0, |h| u32::from_le_bytes(*h));
    let mut v = [0u8; 32];
    for (i, out) in v.chunks_exact_mut(4).enumerate() {
        let w = word(&qs[4 * (i % 4)..]);
        let n = if i < 4 { w & LOW } else { (w >> 4) & LOW };
        out.copy_from_slice(&(n | (spread4((h >> (4 * i)) & 0xF) << 4)).to_le_bytes());
    }
    v
}

/// Low nibbles of four bytes.
const LOW: u32 = 0x0F0F_0F0F;

/// The little-endian word of the first four bytes of `b`.
#[inline(always)]
fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Bits 0-3 of `x` moved to bit 0 of bytes 0-3.
#[inline(always)]
fn spread4(x: u32) -> u32 {
    (x * 0x0020_4081) & 0x0101_0101
}

/// The fifth bit of value `e` of row `r` in a Q5 tile's `qh`.
fn fifth_at(qh: &[u8; 4 * TR], r: usize, e: usize) -> u8 {
    (qh[4 * r + e % 4] >> (e / 4)) & 1
}

impl Tiled for Q4_0 {
    type Tile = TileQ4_0;
    const YSUM: bool = true;
    fn pack(rows: [&BlockQ4_0; TR], t: &mut TileQ4_0) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            interleave_nibbles(&legacy_values(&x.qs, None), r, &mut t.qs);
        }
    }
    fn dequantize_row(t: &TileQ4_0, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (nibble_at(&t.qs, r, i) as i32 - 8) as f32 * d;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        8 * y.qs.iter().map(|&q| q as i32).sum::<i32>()
    }
}

impl Tiled for Q4_1 {
    type Tile = TileQ4_1;
    const YSUM: bool = false;
    fn pack(rows: [&BlockQ4_1; TR], t: &mut TileQ4_1) {
        for (r, x) in rows.iter().enumerate() {
            (t.d[r], t.m[r]) = (x.d, x.m);
            interleave_nibbles(&legacy_values(&x.qs, None), r, &mut t.qs);
        }
    }
    fn dequantize_row(t: &TileQ4_1, r: usize, out: &mut [f32]) {
        let (d, m) = (t.d[r].to_f32(), t.m[r].to_f32());
        for (i, o) in out.iter_mut().enumerate() {
            *o = nibble_at(&t.qs, r, i) as f32 * d + m;
        }
    }
}

impl Tiled for Q5_0 {
    type Tile = TileQ5_0;
    const YSUM: bool = true;
    fn pack(rows: [&BlockQ5_0; TR], t: &mut TileQ5_0) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            let v = legacy_values(&x.qs, Some(&x.qh));
            interleave_nibbles(&v, r, &mut t.qs);
            interleave_fifths(&v, r, &mut t.qh);
        }
    }
    fn dequantize_row(t: &TileQ5_0, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            let q = (nibble_at(&t.qs, r, i) | (fifth_at(&t.qh, r, i) << 4)) as i32 - 16;
            *o = q as f32 * d;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        16 * y.qs.iter().map(|&q| q as i32).sum::<i32>()
    }
}

impl Tiled for Q5_1 {
    type Tile = TileQ5_1;
    const YSUM: bool = false;
    fn pack(rows: [&BlockQ5_1; TR], t: &mut TileQ5_1) {
        for (r, x) in rows.iter().enumerate() {
            (t.d[r], t.m[r]) = (x.d, x.m);
            let v = legacy_values(&x.qs, Some(&x.qh));
            interleave_nibbles(&v, r, &mut t.qs);
            interleave_fifths(&v, r, &mut t.qh);
        }
    }
    fn dequantize_row(t: &TileQ5_1, r: usize, out: &mut [f32]) {
        let (d, m) = (t.d[r].to_f32(), t.m[r].to_f32());
        for (i, o) in out.iter_mut().enumerate() {
            let q = nibble_at(&t.qs, r, i) | (fifth_at(&t.qh, r, i) << 4);
            *o = q as f32 * d + m;
        }
    }
}

impl Tiled for Q8_0 {
    type Tile = TileQ8_0;
    const YSUM: bool = true;
    fn pack(rows: [&super::legacy::BlockQ8_0W; TR], t: &mut TileQ8_0) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            // Four values at a time, each + 128 (the sign bit flipped).
            let q: &[u8] = bytemuck::cast_slice(&x.qs);
            for (g, q) in q.chunks_exact(4).enumerate() {
                let w = u32::from_le_bytes(q.try_into().expect("4")) ^ 0x8080_8080;
                t.qs[g][4 * r..4 * r + 4].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
    fn dequantize_row(t: &TileQ8_0, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (t.qs[i / 4][4 * r + i % 4] as i32 - 128) as f32 * d;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        128 * y.qs.iter().map(|&q| q as i32).sum::<i32>()
    }
}

impl Tiled for IQ4NL {
    type Tile = TileIQ4NL;
    /// The VNNI kernel looks up KVALUES + 128 (unsigned, for dpbusd) and takes 128·Σy off.
    const YSUM: bool = true;
    fn pack(rows: [&BlockIQ4NL; TR], t: &mut TileIQ4NL) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            interleave_nibbles(&legacy_values(&x.qs, None), r, &mut t.qs);
        }
    }
    fn dequantize_row(t: &TileIQ4NL, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = d * KVALUES[nibble_at(&t.qs, r, i) as usize] as f32;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        128 * y.qs.iter().map(|&q| q as i32).sum::<i32>()
    }
}

impl Tiled for IQ4XS {
    type Tile = TileIQ4XS;
    const YSUM: bool = false;
    fn pack(rows: [&BlockIQ4XS; TR], t: &mut TileIQ4XS) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            let mut v = [0u8; 256];
            for ib in 0..8 {
                t.sc[ib][r] = scale_xs(x, ib) as i8;
                let qs: &[u8; 16] = x.qs[16 * ib..16 * ib + 16].try_into().expect("16");
                v[32 * ib..32 * ib + 32].copy_from_slice(&legacy_values(qs, None));
            }
            interleave_nibbles(&v, r, &mut t.qs);
        }
    }
    fn dequantize_row(t: &TileIQ4XS, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (e, o) in out.iter_mut().enumerate() {
            let dl = d * t.sc[e / 32][r] as f32;
            *o = dl * KVALUES[nibble_at(&t.qs, r, e) as usize] as f32;
        }
    }
}

/// Value `e` of a row in a nibble-interleaved array (`qs[g]`: values 8g..8g+8).
fn nibble_at<const G: usize>(qs: &[[u8; 4 * TR]; G], r: usize, e: usize) -> u8 {
    let (g, j) = (e / 8, e % 8);
    let b = qs[g][4 * r + j % 4];
    if j < 4 {
        b & 0x0F
    } else {
        b >> 4
    }
}

/// Row `r`'s values `v` (one per byte, low 4 bits used) written into a nibble-interleaved array.
fn interleave_nibbles<const G: usize>(v: &[u8], r: usize, qs: &mut [[u8; 4 * TR]; G]) {
    for (g, group) in qs.iter_mut().enumerate() {
        let (lo, hi) = (word(&v[8 * g..]), word(&v[8 * g + 4..]));
        let w = (lo & LOW) | ((hi & LOW) << 4);
        group[4 * r..4 * r + 4].copy_from_slice(&w.to_le_bytes());
    }
}

/// Bit 4 of each of row `r`'s 32 values `v` written into a Q5 tile's `qh` (see [`TileQ5_0`]).
fn interleave_fifths(v: &[u8], r: usize, qh: &mut [u8; 4 * TR]) {
    // Byte j of the word gathers, in bit k, bit 4 of value 4k + j.
    let w = (0..8).fold(0u32, |w, k| {
        w | (((word(&v[4 * k..]) >> 4) & 0x0101_0101) << k)
    });
    qh[4 * r..4 * r + 4].copy_from_slice(&w.to_le_bytes());
}

/// A Q4_K/Q5_K super-block's 256 quants in value order (with Q5_K's fifth bits at bit 4).
fn k_values(qs: &[u8; 128], qh: Option<&[u8; 32]>) -> [u8; 256] {
    // Four values per word, as `legacy_values`.
    let mut v = [0u8; 256];
    for j in 0..4 {
        for l in (0..32).step_by(4) {
            let b = word(&qs[32 * j + l..]);
            let h = qh.map_or(0, |qh| word(&qh[l..]));
            let fifth = |bit: usize| ((h >> bit) & 0x0101_0101) << 4;
            let (lo, hi) = (
                (b & LOW) | fifth(2 * j),
                ((b >> 4) & LOW) | fifth(2 * j + 1),
            );
            v[64 * j + l..][..4].copy_from_slice(&lo.to_le_bytes());
            v[64 * j + 32 + l..][..4].copy_from_slice(&hi.to_le_bytes());
        }
    }
    v
}

impl Tiled for Q4K {
    type Tile = TileQ4K;
    const YSUM: bool = false;
    fn pack(rows: [&super::kquants::BlockQ4K; TR], t: &mut TileQ4K) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            t.dmin[r] = x.dmin;
            let (sc, m) = super::kquants::scales_mins(&x.scales);
            for j in 0..8 {
                t.sc[j][r] = sc[j];
                t.m[j][r] = m[j];
            }
            interleave_nibbles(&k_values(&x.qs, None), r, &mut t.qs);
        }
    }
    fn dequantize_row(t: &TileQ4K, r: usize, out: &mut [f32]) {
        let (d, dmin) = (t.d[r].to_f32(), t.dmin[r].to_f32());
        for (e, o) in out.iter_mut().enumerate() {
            let j = e / 32;
            *o = d * t.sc[j][r] as f32 * nibble_at(&t.qs, r, e) as f32 - dmin * t.m[j][r] as f32;
        }
    }
}

impl Tiled for Q5K {
    type Tile = TileQ5K;
    const YSUM: bool = false;
    fn pack(rows: [&super::kquants::BlockQ5K; TR], t: &mut TileQ5K) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            t.dmin[r] = x.dmin;
            let (sc, m) = super::kquants::scales_mins(&x.scales);
            for j in 0..8 {
                t.sc[j][r] = sc[j];
                t.m[j][r] = m[j];
            }
            let v = k_values(&x.qs, Some(&x.qh));
            for (j, q) in t.q.iter_mut().enumerate() {
                let sub = &v[32 * j..32 * j + 32];
                let mut qs = [q[0], q[1], q[2], q[3]];
                interleave_nibbles(sub, r, &mut qs);
                [q[0], q[1], q[2], q[3]] = qs;
                interleave_fifths(sub, r, &mut q[4]);
            }
        }
    }
    fn dequantize_row(t: &TileQ5K, r: usize, out: &mut [f32]) {
        let (d, dmin) = (t.d[r].to_f32(), t.dmin[r].to_f32());
        for (e, o) in out.iter_mut().enumerate() {
            let (j, k) = (e / 32, e % 32);
            let q = &t.q[j];
            let q = nibble_at(&[q[0], q[1], q[2], q[3]], r, k) | (fifth_at(&q[4], r, k) << 4);
            *o = d * t.sc[j][r] as f32 * q as f32 - dmin * t.m[j][r] as f32;
        }
    }
}

impl Tiled for Q6K {
    type Tile = TileQ6K;
    const YSUM: bool = false;
    fn pack(rows: [&super::kquants::BlockQ6K; TR], t: &mut TileQ6K) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            for j in 0..16 {
                t.sc[j][r] = x.scales[j];
            }
            // The 6-bit values in order (ggml's dequantization loop).
            let mut v = [0u8; 256];
            for n in 0..2 {
                let (ql, qh) = (&x.ql[64 * n..], &x.qh[32 * n..]);
                for l in 0..32 {
                    let e = 128 * n + l;
                    v[e] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                    v[e + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                    v[e + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    v[e + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            for (h, q) in t.q.iter_mut().enumerate() {
                let mut ql = [q[0], q[1]];
                interleave_nibbles(&v[16 * h..16 * h + 16], r, &mut ql);
                [q[0], q[1]] = ql;
                for j in 0..4 {
                    q[2][4 * r + j] =
                        (0..4).fold(0u8, |b, k| b | ((v[16 * h + 4 * k + j] >> 4) << (2 * k)));
                }
            }
        }
    }
    fn dequantize_row(t: &TileQ6K, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (e, o) in out.iter_mut().enumerate() {
            let (h, k) = (e / 16, e % 16);
            let q = &t.q[h];
            let hi = (q[2][4 * r + k % 4] >> (2 * (k / 4))) & 3;
            let q = (nibble_at(&[q[0], q[1]], r, k) | (hi << 4)) as i32 - 32;
            *o = d * t.sc[h][r] as f32 * q as f32;
        }
    }
}

/// The AVX2 kernels (same tiles, 8 rows per register).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2;
/// The VNNI kernels.
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni;

/// The tiles of one or more matrices (a whole model's, as the loader packs them), in anonymous
/// memory that the kernel is asked to back with 2 MiB pages (Linux's transparent huge pages in
/// their default `madvise` mode): tiles are written once, at load, and faulting them in 4 KiB at
/// a time was a third of Gemma 3's load time. Zero until written; read-only once shared.
pub(super) struct TileArena {
    map: memmap2::MmapMut,
}

impl TileArena {
    /// `bytes` zero bytes.
    pub(super) fn zeroed(bytes: usize) -> std::io::Result<Self> {
        // A mapping cannot be empty; one byte stands in for none.
        let map = memmap2::MmapOptions::new().len(bytes.max(1)).map_anon()?;
        // Advice only: where the kernel has no huge pages to give, 4 KiB pages serve.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Self { map })
    }

    /// The `n` tiles at byte `at` (a multiple of the tile's alignment: the mapping itself is
    /// page-aligned).
    fn tiles<T: Pod>(&self, at: usize, n: usize) -> &[T] {
        bytemuck::cast_slice(&self.map[at..at + n * std::mem::size_of::<T>()])
    }

    fn tiles_mut<T: Pod>(&mut self, at: usize, n: usize) -> &mut [T] {
        bytemuck::cast_slice_mut(&mut self.map[at..at + n * std::mem::size_of::<T>()])
    }
}

/// A matrix `[rows, cols]` of tiles, `[row group][block]` from byte `at` of a store that other
/// matrices may share (a model's matrices, and stacked views of neighbours).
pub struct TiledMatrix<F: Tiled> {
    pub(super) rows: usize,
    pub(super) cols: usize,
    at: usize,
    store: std::sync::Arc<TileArena>,
    _format: std::marker::PhantomData<fn() -> F>,
}

impl<F: Tiled> Clone for TiledMatrix<F> {
    fn clone(&self) -> Self {
        Self::view(&self.store, self.at, self.rows, self.cols)
    }
}

/// Packs row groups: `out` holds whole groups of `kb` tiles, `blocks` the same groups' 16 rows of
/// `kb` blocks each (GGUF order). Split over the threads kvchat runs with (--threads).
fn pack_groups<F: Tiled>(kb: usize, blocks: &[F::Block], out: &mut [F::Tile]) {
    let groups = out.len() / kb;
    debug_assert_eq!(blocks.len(), groups * TR * kb);
    let threads = candle_core::utils::get_num_threads().max(1);
    let per = groups.div_ceil(threads).max(1);
    let pack = |g0: usize, chunk: &mut [F::Tile]| {
        for (i, tile) in chunk.iter_mut().enumerate() {
            let (g, b) = (g0 + i / kb, i % kb);
            F::pack(
                std::array::from_fn(|r| &blocks[(g * TR + r) * kb + b]),
                tile,
            );
        }
    };
    if threads == 1 || groups < 2 {
        return pack(0, out);
    }
    std::thread::scope(|s| {
        for (c, chunk) in out.chunks_mut(per * kb).enumerate() {
            s.spawn(move || pack(c * per, chunk));
        }
    });
}

impl<F: Tiled> TiledMatrix<F> {
    /// Bytes of the tiles of a `[rows, cols]` matrix (rows a multiple of 16).
    pub(super) fn bytes(rows: usize, cols: usize) -> usize {
        rows / TR * (cols / F::N) * std::mem::size_of::<F::Tile>()
    }

    /// Where the tiles may start in a store: the first multiple of their alignment from `at`.
    pub(super) fn align(at: usize) -> usize {
        at.next_multiple_of(std::mem::align_of::<F::Tile>())
    }

    /// The matrix whose tiles are at byte `at` of `store`.
    pub(super) fn view(
        store: &std::sync::Arc<TileArena>,
        at: usize,
        rows: usize,
        cols: usize,
    ) -> Self {
        Self {
            rows,
            cols,
            at,
            store: store.clone(),
            _format: std::marker::PhantomData,
        }
    }

    /// The blocks of a `[rows, cols]` matrix (rows a multiple of 16), interleaved into tiles in a
    /// store of their own.
    pub(super) fn from_blocks(rows: usize, cols: usize, blocks: &[F::Block]) -> Result<Self> {
        assert!(rows.is_multiple_of(TR) && blocks.len() == rows * cols / F::N);
        let kb = cols / F::N;
        let mut store = TileArena::zeroed(Self::bytes(rows, cols))?;
        pack_groups::<F>(kb, blocks, store.tiles_mut(0, rows / TR * kb));
        Ok(Self::view(&std::sync::Arc::new(store), 0, rows, cols))
    }

    /// Packs the `[rows, cols]` matrix (rows a multiple of 16, cols of `F::N`) whose GGUF blocks
    /// `src` gives into `store` at byte `at` (aligned by [`Self::align`]), as they are read: a
    /// few MiB at a time through one buffer, never the whole matrix (Gemma 3's embedding table is
    /// 178 MB).
    pub(super) fn read_into(
        store: &mut TileArena,
        at: usize,
        rows: usize,
        cols: usize,
        src: &mut dyn std::io::Read,
    ) -> Result<()> {
        assert!(rows.is_multiple_of(TR) && cols.is_multiple_of(F::N));
        let kb = cols / F::N;
        let tiles = store.tiles_mut::<F::Tile>(at, rows / TR * kb);
        let group_bytes = TR * kb * std::mem::size_of::<F::Block>();
        let per_read = (CHUNK_BYTES / group_bytes.max(1)).max(1);
        let mut buf: Vec<F::Block> = bytemuck::zeroed_vec(per_read.min(rows / TR) * TR * kb);
        for out in tiles.chunks_mut(per_read * kb) {
            let blocks = &mut buf[..out.len() * TR];
            src.read_exact(bytemuck::cast_slice_mut(blocks))?;
            pack_groups::<F>(kb, blocks, out);
        }
        Ok(())
    }

    fn kb(&self) -> usize {
        self.cols / F::N
    }

    /// Whether `other` lies in the same store.
    #[cfg(test)]
    pub(super) fn shares_store(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.store, &other.store)
    }

    /// The tiles of row group `g`.
    fn group(&self, g: usize) -> &[F::Tile] {
        let kb = self.kb();
        let at = self.at + g * kb * std::mem::size_of::<F::Tile>();
        self.store.tiles(at, kb)
    }

    /// `parts` stacked into one matrix (None when their widths differ), and a view of each: over
    /// the same store where the parts lie end to end in it (as the loader places q, k, v and
    /// gate, up), else copied into a new one.
    pub(super) fn stack(parts: &[&Self]) -> Result<Option<(Self, Vec<Self>)>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        let cols = first.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return Ok(None);
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let end_to_end = parts.windows(2).all(|w| {
            std::sync::Arc::ptr_eq(&w[0].store, &w[1].store)
                && w[1].at == w[0].at + Self::bytes(w[0].rows, cols)
        });
        if end_to_end {
            let views = parts.iter().map(|p| (*p).clone()).collect();
            return Ok(Some((
                Self::view(&first.store, first.at, rows, cols),
                views,
            )));
        }
        let mut store = TileArena::zeroed(Self::bytes(rows, cols))?;
        let mut at = 0;
        let mut views = Vec::new();
        for p in parts {
            let n = p.rows / TR * p.kb();
            store
                .tiles_mut::<F::Tile>(at, n)
                .copy_from_slice(p.store.tiles::<F::Tile>(p.at, n));
            views.push((at, p.rows));
            at += Self::bytes(p.rows, cols);
        }
        let store = std::sync::Arc::new(store);
        let views = views
            .into_iter()
            .map(|(at, n)| Self::view(&store, at, n, cols))
            .collect();
        Ok(Some((Self::view(&store, 0, rows, cols), views)))
    }

    pub(super) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (t, o) in self.group(r / TR).iter().zip(out.chunks_exact_mut(F::N)) {
            F::dequantize_row(t, r % TR, o);
        }
    }
}

/// A format with both tile kernels.
#[cfg(target_arch = "x86_64")]
pub trait TileKernels: vnni::TileKernel + avx2::TileKernel {}
#[cfg(target_arch = "x86_64")]
impl<F: vnni::TileKernel + avx2::TileKernel> TileKernels for F {}
/// Elsewhere no tiles are made: every tiled format qualifies (its matmul is never called).
#[cfg(not(target_arch = "x86_64"))]
pub trait TileKernels: Tiled {}
#[cfg(not(target_arch = "x86_64"))]
impl<F: Tiled> TileKernels for F {}

#[cfg(target_arch = "x86_64")]
impl<F: TileKernels> TiledMatrix<F> {
    /// `xs [m, cols]` times the transposed matrix into `out [m, rows]`. Only called when
    /// `level()` is at least `Avx2` (tiles are made only then).
    pub(super) fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_at(super::level(), xs, m, out)
    }

    /// [`Self::matmul`] by the kernels of `level` (tests run each level this CPU has).
    pub(super) fn matmul_at(&self, level: super::Level, xs: &[f32], m: usize, out: &mut [f32]) {
        assert_tile_level(level);
        let n = self.rows;
        let inputs = TileInputs::<F>::new(xs, m, self.kb());
        let dst = super::DisjointOut::new(out);
        let groups = n / TR;
        use super::TOKENS;
        let tiles = m.div_ceil(TOKENS);
        let pool = candle_core::utils::barrier_pool();
        pool.execute_chunked(groups * tiles, |range| {
            for item in range {
                let (g, t0) = (item / tiles, (item % tiles) * TOKENS);
                let t1 = m.min(t0 + TOKENS);
                // SAFETY: `level` is asserted above; tokens t0..t1 of group g are this item's.
                unsafe { tokens_through(level, self.group(g), &inputs, t0..t1, (&dst, n, g)) };
            }
        });
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl<F: Tiled> TiledMatrix<F> {
    pub(super) fn matmul(&self, _: &[f32], _: usize, _: &mut [f32]) {
        unreachable!("tiles are made only where AVX2 runs")
    }
}

/// The tile kernels' SAFETY condition, checked once per matmul: `level` runs tiles (AVX2 or
/// more) and this CPU runs it.
#[cfg(target_arch = "x86_64")]
fn assert_tile_level(level: super::Level) {
    assert!(
        level >= super::Level::Avx2 && level <= super::level(),
        "tile kernels at {level:?} on a CPU that runs {:?}",
        super::level()
    );
}

/// A matmul's inputs as the tile kernels take them: each token's activation row (quantized,
/// biased where the format wants it) and, where the format needs them, its blocks' sums.
#[cfg(target_arch = "x86_64")]
struct TileInputs<F: TileKernels> {
    q: Vec<F::Act>,
    ysums: Vec<i32>,
    kb: usize,
}

#[cfg(target_arch = "x86_64")]
impl<F: TileKernels> TileInputs<F> {
    /// `xs [m, kb · F::N]`.
    fn new(xs: &[f32], m: usize, kb: usize) -> Self {
        let mut q = super::activations(xs, m, kb, <F::Act as super::Act>::quantize);
        F::bias(&mut q);
        let ysums = if F::YSUM {
            q.iter().map(F::ysum).collect()
        } else {
            Vec::new()
        };
        Self { q, ysums, kb }
    }

    fn act(&self, t: usize) -> &[F::Act] {
        &self.q[t * self.kb..(t + 1) * self.kb]
    }

    /// Token `t`'s block sums (empty where the format needs none).
    fn ysum(&self, t: usize) -> &[i32] {
        self.ysums
            .get(t * self.kb..(t + 1) * self.kb)
            .unwrap_or(&[])
    }
}

/// Tokens `ts` against the tiles `w` of row group `g`, each token's 16 sums written to rows
/// 16g..16g + 16 of its row of `dst` (`rows` wide): four tokens a call, then the 1–3 left in one
/// call for as many, so a 6-token step unpacks each tile twice, not three times. Each token's
/// sums are the same whatever else a call holds.
///
/// # Safety
/// As [`dot16_at`]: `level` is what the CPU runs (callers assert it once per matmul); and, as
/// `DisjointOut`'s contract, no other work item writes rows 16g..16g + 16 of tokens `ts`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tokens_through<F: TileKernels>(
    level: super::Level,
    w: &[F::Tile],
    inputs: &TileInputs<F>,
    ts: std::ops::Range<usize>,
    (dst, rows, g): (&super::DisjointOut<f32>, usize, usize),
) {
    /// Tokens `t..t + T` in one call.
    #[inline(always)]
    unsafe fn call<F: TileKernels, const T: usize>(
        level: super::Level,
        w: &[F::Tile],
        inputs: &TileInputs<F>,
        t: usize,
        (dst, rows, g): (&super::DisjointOut<f32>, usize, usize),
    ) {
        let ys = std::array::from_fn(|i| inputs.act(t + i));
        let sums = std::array::from_fn(|i| inputs.ysum(t + i));
        // SAFETY: passed on from `tokens_through`'s caller.
        let v = unsafe { dot16_at::<F, T>(level, w, ys, sums) };
        for (i, v) in v.into_iter().enumerate() {
            // SAFETY: passed on from `tokens_through`'s caller (these rows of token t + i).
            let o = unsafe { dst.slice((t + i) * rows + g * TR, TR) };
            o.copy_from_slice(&v);
        }
    }
    let out = (dst, rows, g);
    let mut t = ts.start;
    while t + 4 <= ts.end {
        // SAFETY: as this fn's.
        unsafe { call::<F, 4>(level, w, inputs, t, out) };
        t += 4;
    }
    // SAFETY: as this fn's.
    unsafe {
        match ts.end - t {
            1 => call::<F, 1>(level, w, inputs, t, out),
            2 => call::<F, 2>(level, w, inputs, t, out),
            3 => call::<F, 3>(level, w, inputs, t, out),
            _ => {}
        }
    }
}

/// The 16 rows' dot products with T tokens by `level`'s tile kernel (the one dispatch for
/// stored and staged tiles).
///
/// # Safety
/// `level` is at least `Avx2` and at most what [`super::level()`] reports (callers assert it
/// once per matmul).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot16_at<F: TileKernels, const T: usize>(
    level: super::Level,
    w: &[F::Tile],
    ys: [&[F::Act]; T],
    ysums: [&[i32]; T],
) -> [[f32; TR]; T] {
    if level == super::Level::Vnni {
        vnni::dot16::<F, T>(w, ys, ysums)
    } else {
        avx2::dot16::<F, T>(w, ys, ysums)
    }
}

/// `xs [m, cols]` times the transposed `[rows, cols]` matrix whose row `r` is `row(r)` (GGUF
/// blocks; rows a multiple of 16) into `out [m, rows]`, staging each group of 16 rows into tiles
/// once ([`Tiled::pack`]) and running the tile kernels of `level` over every token: the tiles'
/// summation order, so the result is [`dot_rows_scalar`]'s. Work items are row groups, each with
/// all the tokens, so every block is unpacked once per matmul.
#[cfg(target_arch = "x86_64")]
pub(super) fn staged_matmul<'a, F: TileKernels>(
    level: super::Level,
    row: impl Fn(usize) -> &'a [F::Block] + Sync,
    rows: usize,
    cols: usize,
    xs: &[f32],
    m: usize,
    out: &mut [f32],
) where
    F::Block: 'a,
{
    assert_tile_level(level);
    let kb = cols / F::N;
    let inputs = TileInputs::<F>::new(xs, m, kb);
    let dst = super::DisjointOut::new(out);
    let pool = candle_core::utils::barrier_pool();
    pool.execute_chunked(rows / TR, |range| {
        let mut tiles: Vec<F::Tile> = bytemuck::zeroed_vec(kb);
        for g in range {
            let group: [&[F::Block]; TR] = std::array::from_fn(|r| row(g * TR + r));
            for (b, tile) in tiles.iter_mut().enumerate() {
                *tile = F::Tile::zeroed();
                F::pack(std::array::from_fn(|r| &group[r][b]), tile);
            }
            // SAFETY: `level` is asserted above; group g (every token) is this item's.
            unsafe { tokens_through(level, &tiles, &inputs, 0..m, (&dst, rows, g)) };
        }
    });
}
