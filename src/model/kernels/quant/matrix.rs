//! `Matrix`: a weight matrix kept per row (GGUF's own block order), and its matmul driver.

use super::*;
use anyhow::{bail, Result};
use bytemuck::Zeroable;
use std::sync::Arc;

/// Output rows per work item: enough to amortize the hand-off, small enough to balance two threads.
pub(super) const ROWS_PER_ITEM: usize = 16;
/// Tokens per prefill work item: each weight block is unpacked once per four tokens and stays in
/// L1 across the tile.
pub(super) const TOKENS: usize = 16;

/// A weight matrix `[rows, cols]` of format `F`: rows `row0 .. row0 + rows` of a block store that
/// several matrices may share (see [`QMatrix::stack`]).
pub struct Matrix<F: RowFormat> {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row0: usize,
    pub(super) blocks: Arc<Vec<F::Block>>,
}

impl<F: RowFormat> Clone for Matrix<F> {
    fn clone(&self) -> Self {
        Self {
            rows: self.rows,
            cols: self.cols,
            row0: self.row0,
            blocks: self.blocks.clone(),
        }
    }
}

impl<F: RowFormat> Matrix<F> {
    /// The matrix of `[rows, cols]` GGUF blocks of this format read from `src`, straight into
    /// place (one copy; the pages are touched once).
    pub(super) fn read_rows(rows: usize, cols: usize, src: &mut dyn std::io::Read) -> Result<Self> {
        check_cols(F::DTYPE, cols)?;
        let mut blocks: Vec<F::Block> = bytemuck::zeroed_vec(rows * cols / F::N);
        src.read_exact(bytemuck::cast_slice_mut(&mut blocks))?;
        Ok(Self {
            rows,
            cols,
            row0: 0,
            blocks: Arc::new(blocks),
        })
    }
}

impl<F: Avx2> Matrix<F> {
    /// The matrix as row-interleaved tiles (rows a multiple of 16), made from the GGUF blocks
    /// directly (no per-row copy in between).
    pub(super) fn tiled_from(rows: usize, cols: usize, data: &[u8]) -> Result<TiledMatrix<F>>
    where
        F: Tiled,
    {
        with_blocks::<F, _>(rows, cols, data, TiledMatrix::from_blocks)?
    }
}

/// Refuses a matrix of `dtype` whose rows of `cols` values do not split into whole blocks.
pub(super) fn check_cols(dtype: WeightType, cols: usize) -> Result<()> {
    let n = dtype.block_size();
    if !cols.is_multiple_of(n) {
        bail!("{dtype:?} matrix with {cols} columns, not a multiple of {n}");
    }
    Ok(())
}

/// Calls `f(rows, cols, blocks)` with the blocks in the GGUF bytes of a `[rows, cols]` matrix of
/// format `F`, checked for shape and size (read in place when aligned, else copied once).
pub(super) fn with_blocks<F: Format, R>(
    rows: usize,
    cols: usize,
    data: &[u8],
    f: impl FnOnce(usize, usize, &[F::Block]) -> R,
) -> Result<R> {
    {
        check_cols(F::DTYPE, cols)?;
        let n = rows * cols / F::N;
        if data.len() != n * std::mem::size_of::<F::Block>() {
            bail!(
                "{:?} matrix data of {} bytes for [{rows}, {cols}]",
                F::DTYPE,
                data.len()
            );
        }
        Ok(match bytemuck::try_cast_slice::<u8, F::Block>(data) {
            Ok(blocks) => f(rows, cols, blocks),
            Err(_) => {
                let mut blocks = vec![F::Block::zeroed(); n];
                bytemuck::cast_slice_mut::<F::Block, u8>(&mut blocks).copy_from_slice(data);
                f(rows, cols, &blocks)
            }
        })
    }
}

impl<F: RowFormat> Matrix<F> {
    pub(super) fn row(&self, r: usize) -> &[F::Block] {
        let kb = self.cols / F::N;
        &self.blocks[(self.row0 + r) * kb..(self.row0 + r + 1) * kb]
    }

    /// Rows `r .. r + 4`.
    fn rows4(&self, r: usize) -> [&[F::Block]; 4] {
        std::array::from_fn(|i| self.row(r + i))
    }

    pub(super) fn stack(parts: &[&Self]) -> Result<(Self, Vec<Self>)> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            bail!("stacking matrices of different widths");
        }
        let kb = cols / F::N;
        let mut blocks = Vec::new();
        let mut views = Vec::new();
        let mut row0 = 0;
        for p in parts {
            blocks.extend_from_slice(&p.blocks[p.row0 * kb..(p.row0 + p.rows) * kb]);
            views.push((row0, p.rows));
            row0 += p.rows;
        }
        let blocks = Arc::new(blocks);
        let view = |row0, rows| Matrix::<F> {
            rows,
            cols,
            row0,
            blocks: blocks.clone(),
        };
        let parts = views.into_iter().map(|(r0, n)| view(r0, n)).collect();
        Ok((view(0, row0), parts))
    }

    /// Row `r` dequantized into `out` (`cols` values): an embedding lookup.
    pub(super) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (x, o) in self.row(r).iter().zip(out.chunks_exact_mut(F::N)) {
            F::dequantize(x, o);
        }
    }

    /// `xs [m, cols]` (f32, row-major) times the transposed matrix into `out [m, rows]`.
    pub(super) fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        let kb = k / F::N;
        let q = activations(xs, m, kb, F::quantize);
        let level = level();
        let dst = DisjointOut::new(out);
        let items = n.div_ceil(ROWS_PER_ITEM);
        let pool = candle_core::utils::barrier_pool();
        let act = |t: usize| &q[t * kb..(t + 1) * kb];
        if m == 1 {
            // Decode: work items are blocks of output rows.
            pool.execute_chunked(items, |range| {
                for item in range {
                    let (r0, r1) = (item * ROWS_PER_ITEM, n.min((item + 1) * ROWS_PER_ITEM));
                    // SAFETY (DisjointOut's contract): rows r0..r1 belong to this item alone.
                    let o = unsafe { dst.slice(r0, r1 - r0) };
                    let mut r = r0;
                    while r + 4 <= r1 {
                        let w = self.rows4(r);
                        o[r - r0..r - r0 + 4].copy_from_slice(&F::dot_rows4(level, w, act(0)));
                        r += 4;
                    }
                    for (r, o) in (r..r1).zip(&mut o[r - r0..]) {
                        *o = F::dot(level, self.row(r), act(0));
                    }
                }
            });
        } else {
            // Prefill: work items are (block of output rows, tile of TOKENS tokens).
            let tiles = m.div_ceil(TOKENS);
            pool.execute_chunked(items * tiles, |range| {
                for item in range {
                    let (r0, t0) = ((item / tiles) * ROWS_PER_ITEM, (item % tiles) * TOKENS);
                    let (r1, t1) = (n.min(r0 + ROWS_PER_ITEM), m.min(t0 + TOKENS));
                    // SAFETY (DisjointOut's contract): rows r0..r1 of tokens t0..t1 belong to this
                    // item alone (one slice per token, as the output is [tokens, rows]).
                    let o: [&mut [f32]; TOKENS] = std::array::from_fn(|i| {
                        if t0 + i < t1 {
                            unsafe { dst.slice((t0 + i) * n + r0, r1 - r0) }
                        } else {
                            &mut []
                        }
                    });
                    let act4 = |t: usize| [act(t), act(t + 1), act(t + 2), act(t + 3)];
                    let mut r = r0;
                    // Four rows at a time (four tokens each), then the rows left one by one.
                    while r + 4 <= r1 {
                        let w = self.rows4(r);
                        let mut t = t0;
                        while t + 4 <= t1 {
                            let v = F::dot_4x4(level, w, act4(t));
                            for (i, v) in v.into_iter().enumerate() {
                                for (k, v) in v.into_iter().enumerate() {
                                    o[t + k - t0][r + i - r0] = v;
                                }
                            }
                            t += 4;
                        }
                        for t in t..t1 {
                            o[t - t0][r - r0..r - r0 + 4].copy_from_slice(&F::dot_rows4(
                                level,
                                w,
                                act(t),
                            ));
                        }
                        r += 4;
                    }
                    for r in r..r1 {
                        let w = self.row(r);
                        let mut t = t0;
                        while t + 4 <= t1 {
                            let v = F::dot_x4(level, w, act4(t));
                            for (i, v) in v.into_iter().enumerate() {
                                o[t + i - t0][r - r0] = v;
                            }
                            t += 4;
                        }
                        for t in t..t1 {
                            o[t - t0][r - r0] = F::dot(level, w, act(t));
                        }
                    }
                }
            });
        }
    }
}

/// Whether a matrix of a tiled type becomes tiles: AVX2 runs here (`level()`), its rows
/// come in 16s.
pub(super) fn tileable(rows: usize) -> bool {
    level() >= Level::Avx2 && rows.is_multiple_of(tiled::TR)
}
