//! Row-interleaved tiles: 16 rows' blocks at one column position stored so that one AVX-512 VNNI
//! `dpbusd` multiplies 4 values of each of the 16 rows by the same 4 activation values, leaving one
//! i32 lane per row (llama.cpp's and candle's "repack" idea). Scales are unpacked per tile once, at
//! load, so a block costs one fused multiply-add per 16 rows instead of one per row. The tile
//! replaces the GGUF layout (no second copy): Q8_0 and Q6_K tiles are the same size as their 16
//! blocks, Q4_K's and Q5_K's 2-3 % larger (their 6-bit scales and mins kept as bytes).
//!
//! **Summation order** (tiled matrices; [`dot_rows_scalar`] is the reference): per row, per block,
//! the exact integer sum of the block's products (the format's `lanes`, added), converted to f32 and
//! fused-multiply-added with the block's scale into one accumulator; min terms added apart; then
//! the two added. Decode and prefill run the same per-block steps, so they agree to the bit.
//! The same tiles run on AVX2 (`avx2`: maddubs+madd for dpbusd, 8 rows per register) with the
//! same exact integer sums, so both levels give the same bits. Without AVX2 a matrix keeps the
//! per-row layout and the 8-lane order.

use super::legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1};
use super::{BlockQ8K, BlockQ8_0, BlockQ8_1, Format, Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Rows per tile.
pub const TR: usize = 16;

/// A format whose blocks can be interleaved 16 rows to a tile.
pub trait Tiled: Format {
    type Tile: Pod + Send + Sync;
    /// Whether the kernel needs each activation block's integer sum ([`Tiled::ysum`]).
    const YSUM: bool;
    /// The blocks of 16 consecutive rows at one column position.
    fn pack(rows: &[Self::Block; TR]) -> Self::Tile;
    /// Row `r` of the tile dequantized (`N` values), as `Format::dequantize` gives it.
    fn dequantize_row(t: &Self::Tile, r: usize, out: &mut [f32]);
    /// The integer sum of an activation block's values (where `YSUM`).
    fn ysum(_y: &Self::Act) -> i32 {
        0
    }
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

/// A 32-value block's quants in value order (low nibbles are values 0..16, high 16..32), with
/// Q5's fifth bits (bit i of `qh`, little-endian) at bit 4.
fn legacy_values(qs: &[u8; 16], qh: Option<&[u8; 4]>) -> [u8; 32] {
    let h = qh.map_or(0, |h| u32::from_le_bytes(*h));
    std::array::from_fn(|i| {
        let n = if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        };
        n | ((((h >> i) & 1) as u8) << 4)
    })
}

/// The fifth bit of value `e` of row `r` in a Q5 tile's `qh`.
fn fifth_at(qh: &[u8; 4 * TR], r: usize, e: usize) -> u8 {
    (qh[4 * r + e % 4] >> (e / 4)) & 1
}

impl Tiled for Q4_0 {
    type Tile = TileQ4_0;
    const YSUM: bool = true;
    fn pack(rows: &[BlockQ4_0; TR]) -> TileQ4_0 {
        let mut t = TileQ4_0::zeroed();
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            interleave_nibbles(&legacy_values(&x.qs, None), r, &mut t.qs);
        }
        t
    }
    fn dequantize_row(t: &TileQ4_0, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (nibble_at(&t.qs, r, i) as i32 - 8) as f32 * d;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        y.qs.iter().map(|&q| q as i32).sum()
    }
}

impl Tiled for Q4_1 {
    type Tile = TileQ4_1;
    const YSUM: bool = false;
    fn pack(rows: &[BlockQ4_1; TR]) -> TileQ4_1 {
        let mut t = TileQ4_1::zeroed();
        for (r, x) in rows.iter().enumerate() {
            (t.d[r], t.m[r]) = (x.d, x.m);
            interleave_nibbles(&legacy_values(&x.qs, None), r, &mut t.qs);
        }
        t
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
    fn pack(rows: &[BlockQ5_0; TR]) -> TileQ5_0 {
        let mut t = TileQ5_0::zeroed();
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            let v = legacy_values(&x.qs, Some(&x.qh));
            interleave_nibbles(&v, r, &mut t.qs);
            interleave_fifths(&v, r, &mut t.qh);
        }
        t
    }
    fn dequantize_row(t: &TileQ5_0, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            let q = (nibble_at(&t.qs, r, i) | (fifth_at(&t.qh, r, i) << 4)) as i32 - 16;
            *o = q as f32 * d;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        y.qs.iter().map(|&q| q as i32).sum()
    }
}

impl Tiled for Q5_1 {
    type Tile = TileQ5_1;
    const YSUM: bool = false;
    fn pack(rows: &[BlockQ5_1; TR]) -> TileQ5_1 {
        let mut t = TileQ5_1::zeroed();
        for (r, x) in rows.iter().enumerate() {
            (t.d[r], t.m[r]) = (x.d, x.m);
            let v = legacy_values(&x.qs, Some(&x.qh));
            interleave_nibbles(&v, r, &mut t.qs);
            interleave_fifths(&v, r, &mut t.qh);
        }
        t
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
    fn pack(rows: &[BlockQ8_0; TR]) -> TileQ8_0 {
        let mut t = TileQ8_0::zeroed();
        for (r, x) in rows.iter().enumerate() {
            t.d[r] = x.d;
            for (i, &q) in x.qs.iter().enumerate() {
                t.qs[i / 4][4 * r + i % 4] = (q as i32 + 128) as u8;
            }
        }
        t
    }
    fn dequantize_row(t: &TileQ8_0, r: usize, out: &mut [f32]) {
        let d = t.d[r].to_f32();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (t.qs[i / 4][4 * r + i % 4] as i32 - 128) as f32 * d;
        }
    }
    fn ysum(y: &BlockQ8_0) -> i32 {
        y.qs.iter().map(|&q| q as i32).sum()
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
        for j in 0..4 {
            group[4 * r + j] = (v[8 * g + j] & 0x0F) | ((v[8 * g + j + 4] & 0x0F) << 4);
        }
    }
}

/// Bit 4 of each of row `r`'s 32 values `v` written into a Q5 tile's `qh` (see [`TileQ5_0`]).
fn interleave_fifths(v: &[u8], r: usize, qh: &mut [u8; 4 * TR]) {
    for j in 0..4 {
        qh[4 * r + j] = (0..8).fold(0u8, |b, k| b | (((v[4 * k + j] >> 4) & 1) << k));
    }
}

/// A Q4_K/Q5_K super-block's 256 quants in value order (with Q5_K's fifth bits at bit 4).
fn k_values(qs: &[u8; 128], qh: Option<&[u8; 32]>) -> [u8; 256] {
    let mut v = [0u8; 256];
    for j in 0..4 {
        for l in 0..32 {
            let b = qs[32 * j + l];
            v[64 * j + l] = b & 0x0F;
            v[64 * j + 32 + l] = b >> 4;
            if let Some(qh) = qh {
                v[64 * j + l] |= ((qh[l] >> (2 * j)) & 1) << 4;
                v[64 * j + 32 + l] |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
        }
    }
    v
}

impl Tiled for Q4K {
    type Tile = TileQ4K;
    const YSUM: bool = false;
    fn pack(rows: &[super::kquants::BlockQ4K; TR]) -> TileQ4K {
        let mut t = TileQ4K::zeroed();
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
        t
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
    fn pack(rows: &[super::kquants::BlockQ5K; TR]) -> TileQ5K {
        let mut t = TileQ5K::zeroed();
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
        t
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
    fn pack(rows: &[super::kquants::BlockQ6K; TR]) -> TileQ6K {
        let mut t = TileQ6K::zeroed();
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
        t
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

/// A matrix `[rows, cols]` of tiles, `[row group][block]`; rows in 16s. Rows `row0 .. row0 + rows`
/// (`row0` a multiple of 16) of a tile store several matrices may share (stacking).
pub struct TiledMatrix<F: Tiled> {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row0: usize,
    tiles: std::sync::Arc<Vec<F::Tile>>,
}

impl<F: Tiled> Clone for TiledMatrix<F> {
    fn clone(&self) -> Self {
        Self {
            rows: self.rows,
            cols: self.cols,
            row0: self.row0,
            tiles: self.tiles.clone(),
        }
    }
}

impl<F: Tiled> TiledMatrix<F> {
    /// The blocks of a `[rows, cols]` matrix (rows a multiple of 16), interleaved into tiles.
    pub(super) fn from_blocks(rows: usize, cols: usize, blocks: &[F::Block]) -> Self {
        assert!(rows.is_multiple_of(TR) && blocks.len() == rows * cols / F::N);
        let kb = cols / F::N;
        let groups = rows / TR;
        // Fresh zero pages from the allocator (no pass writing zeros before the tiles).
        let mut tiles: Vec<F::Tile> = bytemuck::zeroed_vec(groups * kb);
        // Row groups split over the threads kvchat runs with (--threads; packing a 1B model's
        // weights is seconds on one).
        let threads = candle_core::utils::get_num_threads();
        let per = groups.div_ceil(threads.max(1)).max(1);
        std::thread::scope(|s| {
            for (c, chunk) in tiles.chunks_mut(per * kb).enumerate() {
                s.spawn(move || {
                    for (i, tile) in chunk.iter_mut().enumerate() {
                        let (g, b) = (c * per + i / kb, i % kb);
                        let group: [F::Block; TR] =
                            std::array::from_fn(|r| blocks[(g * TR + r) * kb + b]);
                        *tile = F::pack(&group);
                    }
                });
            }
        });
        Self {
            rows,
            cols,
            row0: 0,
            tiles: std::sync::Arc::new(tiles),
        }
    }

    fn kb(&self) -> usize {
        self.cols / F::N
    }

    /// The tiles of row group `g` (of this matrix).
    fn group(&self, g: usize) -> &[F::Tile] {
        let kb = self.kb();
        let g = self.row0 / TR + g;
        &self.tiles[g * kb..(g + 1) * kb]
    }

    pub(super) fn stack(parts: &[&Self]) -> Option<(Self, Vec<Self>)> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let kb = cols / F::N;
        let mut tiles = Vec::new();
        let mut views = Vec::new();
        let mut row0 = 0;
        for p in parts {
            tiles.extend_from_slice(&p.tiles[p.row0 / TR * kb..(p.row0 + p.rows) / TR * kb]);
            views.push((row0, p.rows));
            row0 += p.rows;
        }
        let tiles = std::sync::Arc::new(tiles);
        let view = |row0, rows| Self {
            rows,
            cols,
            row0,
            tiles: tiles.clone(),
        };
        let parts = views.into_iter().map(|(r0, n)| view(r0, n)).collect();
        Some((view(0, row0), parts))
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

#[cfg(target_arch = "x86_64")]
impl<F: TileKernels> TiledMatrix<F> {
    /// `xs [m, cols]` times the transposed matrix into `out [m, rows]`. Only called when
    /// `level()` is at least `Avx2` (tiles are made only then).
    pub(super) fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_at(super::level(), xs, m, out)
    }

    /// [`Self::matmul`] by the kernels of `level` (tests run each level this CPU has).
    pub(super) fn matmul_at(&self, level: super::Level, xs: &[f32], m: usize, out: &mut [f32]) {
        use super::{Act, Level};
        // The tile kernels' SAFETY condition, checked once per matmul.
        assert!(
            level >= Level::Avx2 && level <= super::level(),
            "tile kernels at {level:?} on a CPU that runs {:?}",
            super::level()
        );
        /// The 16 rows' dot products with T tokens, by the level's kernel.
        #[inline(always)]
        fn dot16<F: TileKernels, const T: usize>(
            level: Level,
            w: &[F::Tile],
            ys: [&[F::Act]; T],
            ysums: [&[i32]; T],
        ) -> [[f32; TR]; T] {
            // SAFETY: the CPU runs `level` (asserted in `matmul_at`, from `level()`'s run-time
            // check; this fn is private to it).
            unsafe {
                if level == Level::Vnni {
                    vnni::dot16::<F, T>(w, ys, ysums)
                } else {
                    avx2::dot16::<F, T>(w, ys, ysums)
                }
            }
        }
        let (n, k, kb) = (self.rows, self.cols, self.kb());
        let mut q = vec![<F::Act as Zeroable>::zeroed(); m * kb];
        for (row, qrow) in xs.chunks_exact(k).zip(q.chunks_exact_mut(kb)) {
            F::Act::quantize(row, qrow);
        }
        let ysums: Vec<i32> = if F::YSUM {
            q.iter().map(F::ysum).collect()
        } else {
            vec![0; m * kb]
        };
        let act = |t: usize| &q[t * kb..(t + 1) * kb];
        let ysum = |t: usize| &ysums[t * kb..(t + 1) * kb];
        let dst = super::DisjointOut::new(out);
        let groups = n / TR;
        use super::TOKENS;
        let tiles = m.div_ceil(TOKENS);
        let pool = candle_core::utils::barrier_pool();
        pool.execute_chunked(groups * tiles, |range| {
            for item in range {
                let (g, t0) = (item / tiles, (item % tiles) * TOKENS);
                let t1 = m.min(t0 + TOKENS);
                let w = self.group(g);
                let put = |t: usize, v: [f32; TR]| {
                    // SAFETY (DisjointOut's contract): rows 16g..16g+16 of token t belong to this
                    // item alone.
                    let o = unsafe { dst.slice(t * n + g * TR, TR) };
                    o.copy_from_slice(&v);
                };
                let mut t = t0;
                while t + 4 <= t1 {
                    let v = dot16::<F, 4>(
                        level,
                        w,
                        [act(t), act(t + 1), act(t + 2), act(t + 3)],
                        [ysum(t), ysum(t + 1), ysum(t + 2), ysum(t + 3)],
                    );
                    for (i, v) in v.into_iter().enumerate() {
                        put(t + i, v);
                    }
                    t += 4;
                }
                for t in t..t1 {
                    let [v] = dot16::<F, 1>(level, w, [act(t)], [ysum(t)]);
                    put(t, v);
                }
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
