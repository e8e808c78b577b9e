//! The tiles of each block format: its 16 rows' blocks interleaved for the tile kernels
//! (`Tiled::pack`), and back to ggml's values (`Tiled::dequantize_row`). One struct and one
//! `impl Tiled` per format; the driver that packs and multiplies them is `tiled.rs`.

use super::super::iquants::{scale_xs, BlockIQ4NL, BlockIQ4XS, KVALUES};
use super::super::legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1};
use super::super::{
    BlockQ8K, BlockQ8_0, Format, IQ1M, IQ1S, IQ2S, IQ2XS, IQ2XXS, IQ3S, IQ3XXS, IQ4NL, IQ4XS, Q2K,
    Q3K, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0,
};
use super::{Tiled, TR};
use bytemuck::{Pod, Zeroable};
use half::f16;

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
    fn pack(rows: [&super::super::kquants::BlockQ2K; TR], t: &mut TileQ2K) {
        for (r, x) in rows.iter().enumerate() {
            (t.d[r], t.dmin[r]) = (x.d, x.dmin);
            for j in 0..16 {
                t.scm[j][r] = x.scales[j];
            }
            let v: [u8; 256] = std::array::from_fn(|e| super::super::kquants::q2(&x.qs, e) as u8);
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
    fn pack(rows: [&super::super::kquants::BlockQ3K; TR], t: &mut TileQ3K) {
        let mut qs = [[0u8; 4 * TR]; 16];
        let mut hb = [[0u8; 4 * TR]; 8];
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            let sc = super::super::kquants::scales_q3(&x.scales);
            for (row, s) in t.sc.iter_mut().zip(sc) {
                row[r] = s;
            }
            let v: [u8; 256] = std::array::from_fn(|e| super::super::kquants::q3(x, e) as u8);
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
                    <$f as super::super::iqgrid::Stage>::stage(x, r, t);
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
    fn pack(rows: [&super::super::legacy::BlockQ8_0W; TR], t: &mut TileQ8_0) {
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
    fn pack(rows: [&super::super::kquants::BlockQ4K; TR], t: &mut TileQ4K) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            t.dmin[r] = x.dmin;
            let (sc, m) = super::super::kquants::scales_mins(&x.scales);
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
    fn pack(rows: [&super::super::kquants::BlockQ5K; TR], t: &mut TileQ5K) {
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            t.dmin[r] = x.dmin;
            let (sc, m) = super::super::kquants::scales_mins(&x.scales);
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
    fn pack(rows: [&super::super::kquants::BlockQ6K; TR], t: &mut TileQ6K) {
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
