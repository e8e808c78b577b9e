//! Staged matrices (the grid i-quants): the GGUF blocks kept per row, as loaded, and staged into
//! row-interleaved tiles during each matmul, a group of 16 rows at a time, where AVX2 runs and
//! rows come in 16s (`tiled::staged_matmul`). Their unpacked form is several times their bytes,
//! so tiles are never stored; each block is unpacked once per matmul and its tile serves every
//! token, and decode and prefill both sum in the tiles' order (bit for bit alike). Elsewhere the
//! per-row driver runs them.

use super::*;

/// A matrix of a grid i-quant: its blocks per row.
pub struct Staged<F: RowFormat>(pub(super) Matrix<F>);

/// Tokens from which a matmul stages tiles. Below, each row runs on its own (its blocks unpacked
/// in registers, as the per-row driver does) but sums in the tiles' order, so the bits are the
/// same either way: a decode step (1 token) unpacks every block once whichever way it runs, and
/// staging it cost 2.5× (2048×2048 IQ2_XXS, 2 threads: 0.59 against 0.24 ms).
const STAGE_FROM: usize = 4;

#[cfg(target_arch = "x86_64")]
impl<F: tiled::TileKernels + Avx2> Staged<F> {
    /// `xs [m, cols]` times the transposed matrix, each row on its own in the tiles' order.
    fn per_row_in_tile_order(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        let (n, kb) = (self.0.rows, self.0.cols / <F as Format>::N);
        let q = activations(xs, m, kb, <<F as Format>::Act as Act>::quantize);
        let dst = DisjointOut::new(out);
        let items = n.div_ceil(ROWS_PER_ITEM);
        // The SAFETY condition of `dot_rows_order*`, checked once: AVX2 runs (`tileable`).
        let level = level();
        assert!(level >= Level::Avx2);
        let vnni = level == Level::Vnni && F::vnni_decode();
        candle_core::utils::barrier_pool().execute_chunked(items * m, |range| {
            for item in range {
                let (t, r0) = (item / items, (item % items) * ROWS_PER_ITEM);
                let r1 = n.min(r0 + ROWS_PER_ITEM);
                // SAFETY (DisjointOut's contract): rows r0..r1 of token t belong to this item.
                let o = unsafe { dst.slice(t * n + r0, r1 - r0) };
                let y = &q[t * kb..(t + 1) * kb];
                for (r, o) in (r0..r1).zip(o) {
                    let x = self.0.row(r);
                    // SAFETY: the CPU runs `level`'s instructions (`level()`, asserted above).
                    *o = unsafe {
                        if vnni {
                            avx2::dot_rows_order512::<F>(x, y)
                        } else {
                            avx2::dot_rows_order::<F>(x, y)
                        }
                    };
                }
            }
        });
    }
}

impl<F: tiled::TileKernels + Avx2> Kernel for Staged<F> {
    fn dtype(&self) -> WeightType {
        <F as Format>::DTYPE
    }
    fn dims(&self) -> (usize, usize) {
        (self.0.rows, self.0.cols)
    }
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if tileable(self.0.rows) {
            if m < STAGE_FROM {
                return self.per_row_in_tile_order(xs, m, out);
            }
            let row = |r: usize| -> &[<F as Format>::Block] { self.0.row(r) };
            return tiled::staged_matmul::<F>(level(), row, self.0.rows, self.0.cols, xs, m, out);
        }
        self.0.matmul(xs, m, out)
    }
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        self.0.dequantize_row(r, out)
    }
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(typed) = all_of::<Self>(parts) else {
            return Ok(None);
        };
        let inner: Vec<&Matrix<F>> = typed.iter().map(|s| &s.0).collect();
        let (all, views) = Matrix::stack(&inner)?;
        Ok(Some(wrapped((
            Staged(all),
            views.into_iter().map(Staged).collect(),
        ))))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
