//! `QMatrix`: a CPU weight matrix of any format and layout, and which kernels run a GGUF (`Kernels`).

use super::*;
use anyhow::{bail, Result};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// A matrix of one format in one layout (per row or tiles): what a [`QMatrix`] holds.
pub(super) trait Kernel: Send + Sync + 'static {
    fn dtype(&self) -> WeightType;
    /// `[rows, cols]`.
    fn dims(&self) -> (usize, usize);
    /// `xs [m, cols]` (f32, row-major) times the transposed matrix into `out [m, rows]`.
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]);
    /// Row `r` dequantized into `out` (`cols` values).
    fn dequantize_row(&self, r: usize, out: &mut [f32]);
    /// `parts` stacked, where all are of this one's format and layout (else None).
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>>;
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A stacked matrix and its parts' views, as QMatrix values.
pub(super) fn wrapped<M: Kernel>((all, views): (M, Vec<M>)) -> (QMatrix, Vec<QMatrix>) {
    (
        QMatrix::new(all),
        views.into_iter().map(QMatrix::new).collect(),
    )
}

/// The typed matrices behind `parts`, where every one is an `M`.
pub(super) fn all_of<'a, M: 'static>(parts: &[&'a QMatrix]) -> Option<Vec<&'a M>> {
    parts.iter().map(|p| p.downcast::<M>()).collect()
}

impl<F: RowFormat> Kernel for Matrix<F> {
    fn dtype(&self) -> WeightType {
        F::DTYPE
    }
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        Matrix::matmul(self, xs, m, out)
    }
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        Matrix::dequantize_row(self, r, out)
    }
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(typed) = all_of::<Self>(parts) else {
            return Ok(None);
        };
        Ok(Some(wrapped(Matrix::stack(&typed)?)))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl<F: tiled::TileKernels> Kernel for TiledMatrix<F> {
    fn dtype(&self) -> WeightType {
        <F as Format>::DTYPE
    }
    fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }
    fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) {
        TiledMatrix::matmul(self, xs, m, out)
    }
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        TiledMatrix::dequantize_row(self, r, out)
    }
    fn stack(&self, parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(typed) = all_of::<Self>(parts) else {
            return Ok(None);
        };
        Ok(TiledMatrix::stack(&typed)?.map(wrapped))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A weight matrix on the CPU, of any format this driver runs: per row ([`Matrix`]; the float
/// types and the grid i-quants always) or as row-interleaved tiles ([`TiledMatrix`], made where AVX2
/// runs and rows come in 16s). Cloning shares the weights.
#[derive(Clone)]
pub struct QMatrix(Arc<dyn Kernel>);

/// Which CPU matmul runs a GGUF's quantized matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Ours where [`preferred`] says they are faster, candle's QMatMul elsewhere.
    #[default]
    Preferred,
    /// Ours for every type they run.
    Ours,
    /// candle's QMatMul for every type.
    Candle,
    /// The GPU's path on the CPU: candle's QMatMul for every type, KV rows as tensors attended
    /// with candle ops (`Engine::kv_device`); to check that path where there is no GPU.
    Gpu,
}

impl Kernels {
    /// Whether our kernels take a matrix of `dtype`.
    pub fn ours_for(self, dtype: WeightType) -> bool {
        match self {
            Kernels::Preferred => preferred(dtype),
            Kernels::Ours => FORMATS.contains(&dtype),
            // Types candle does not know run on ours whatever is asked.
            Kernels::Candle | Kernels::Gpu => FORMATS.contains(&dtype) && dtype.candle().is_none(),
        }
    }
}

impl std::str::FromStr for Kernels {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "preferred" => Kernels::Preferred,
            "ours" => Kernels::Ours,
            "candle" => Kernels::Candle,
            "gpu" => Kernels::Gpu,
            other => bail!("unknown kernels {other:?}: preferred, ours, candle or gpu"),
        })
    }
}

/// Whether our kernels are the better choice on the CPU for a matrix of `dtype` (where not,
/// candle's QMatMul runs it): wherever AVX2 runs. Rows in 16s run as row-interleaved tiles
/// (`tiled`), others per row. Even where candle's QMatMul decodes a type faster from memory (Q5_K,
/// Q6_K), ours are kept: candle's tiles sum decode and prefill differently, and bit-identical
/// prefill and decode is this project's rule (the per-type figures: `tests::speed`, and
/// docs/perf-notes.md).
///
/// With no SIMD path here (not x86-64, or no AVX2: `level()` is `Scalar`), candle's QMatMul runs
/// everything (it has NEON kernels; ours would run their scalar reference) but the types candle
/// does not know (the i-quants), which only ours run.
pub fn preferred(dtype: WeightType) -> bool {
    FORMATS.contains(&dtype) && (level() >= Level::Avx2 || dtype.candle().is_none())
}

impl QMatrix {
    /// The matrix of a `QTensor [rows, cols]`; None for a type this driver does not run.
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        let (rows, cols) = t.shape().dims2()?;
        Self::from_bytes(WeightType::from_candle(t.dtype()), rows, cols, &t.data()?)
    }

    /// The per-row matrix of `[rows, cols]` GGUF blocks of `dtype` that `src` gives.
    pub(super) fn read_rows(
        dtype: WeightType,
        rows: usize,
        cols: usize,
        src: &mut dyn std::io::Read,
    ) -> Result<Option<Self>> {
        read_per_row(dtype, rows, cols, src)
    }

    /// The matrix of a GGUF tensor's bytes, `[rows, cols]` of `dtype`; None for a type this
    /// driver does not run.
    pub fn from_bytes(
        dtype: WeightType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Option<Self>> {
        if !tileable(rows) || !tiled_format!(dtype, |_F| true, else false) {
            let want = rows * cols / dtype.block_size() * dtype.type_size();
            if data.len() != want {
                bail!(
                    "{dtype:?} matrix data of {} bytes for [{rows}, {cols}]",
                    data.len()
                );
            }
            return Self::read_rows(dtype, rows, cols, &mut &data[..]);
        }
        Ok(Some(tiled_format!(dtype, |F| {
            Self::new(Matrix::<F>::tiled_from(rows, cols, data)?)
        }, else unreachable!("a tiled type"))))
    }

    pub(super) fn new(m: impl Kernel) -> Self {
        Self(Arc::new(m))
    }

    /// The typed matrix inside, where it is an `M` (`Matrix<F>` or `TiledMatrix<F>`).
    pub fn downcast<M: 'static>(&self) -> Option<&M> {
        self.0.as_any().downcast_ref()
    }

    pub fn dtype(&self) -> WeightType {
        self.0.dtype()
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> (usize, usize) {
        self.0.dims()
    }

    /// The rows of `parts` stacked into one matrix (so one pass computes all their outputs: q, k
    /// and v, or gate and up), and each part as a view into it; no weight is stored twice. None
    /// when the parts are not all of one format and layout (per row or tiles).
    pub fn stack(parts: &[&QMatrix]) -> Result<Option<(QMatrix, Vec<QMatrix>)>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        first.0.stack(parts)
    }

    /// `x [.., cols]` (f32) times the transposed matrix: `[.., rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, k) = self.dims();
        let dims = x.dims().to_vec();
        if dims.last() != Some(&k) {
            bail!(
                "{:?} matmul: input of shape {dims:?}, the matrix has {k} columns",
                self.dtype()
            );
        }
        let m = x.elem_count() / k;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; m * n];
        self.matmul(&xs, m, &mut out)?;
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dim") = n;
        // The matrix runs on the host; the product goes where `x` is (a GPU's model runs the
        // matrices candle cannot on the host: `Weight::Cpu`).
        Ok(Tensor::from_vec(out, out_dims, &Device::Cpu)?.to_device(x.device())?)
    }

    /// `xs [m, cols]` (row-major) times the transposed matrix into `out [m, rows]`: [`forward`]
    /// on slices, for callers that keep their rows on the host (a mixture of experts gathers
    /// each expert's tokens).
    ///
    /// [`forward`]: QMatrix::forward
    pub fn matmul(&self, xs: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = self.dims();
        if xs.len() != m * k || out.len() != m * n {
            bail!(
                "{:?} matmul of [{n}, {k}]: {} inputs and {} outputs for {m} rows",
                self.dtype(),
                xs.len(),
                out.len()
            );
        }
        self.0.matmul(xs, m, out);
        Ok(())
    }

    /// The rows `ids` dequantized: `[ids.len(), cols]` (an embedding lookup; nothing else of the
    /// table is dequantized).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let (n, k) = self.dims();
        let mut out = vec![0f32; ids.len() * k];
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
            let id = id as usize;
            if id >= n {
                bail!("token id {id} is outside the embedding table of {n} rows");
            }
            self.0.dequantize_row(id, o);
        }
        Ok(Tensor::from_vec(out, (ids.len(), k), &Device::Cpu)?)
    }
}
