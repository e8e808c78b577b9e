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

use super::iquants::KVALUES;
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

/// Each format's tile and its `impl Tiled`.
mod formats;
pub use formats::*;

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
