//! GGUF files: metadata and quantized weights, read once; matrices stay quantized (our CPU kernels
//! in `kernels::quant`, or candle's QMatMul where those do not run or are slower).

use super::config::Config;
use super::decoder::{
    expect_dims, Attention, Block, Decoder, Embedding, Ffn, Linear, Mixer, MoeBeside,
    PerLayerBlock, PerLayerEmbeddings, Weight,
};
use super::deltanet::DeltaNet;
use super::kernels::quant::{Kernels, Packer, QMatrix, WeightType};
use super::moe::{Expert, GateUp, Moe, SharedExpert};
use super::rope::Rope;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod assemble;

/// A matrix as read from the file: in our kernels' store, or candle's tensor.
enum Read {
    Ours(QMatrix),
    Candle(Arc<QTensor>),
}

/// A buffered file reader that keeps its own position: candle's GGUF reader asks for it around
/// every string, and on a `BufReader<File>` that is a system call (for Gemma 3's 262k-token
/// vocabulary, 70 ms of a 0.7 s load).
///
/// It also shows candle's header reader a placeholder type id where a tensor's type is one candle
/// does not know and kvchat runs (`patches`: file position and the 4 bytes to read there), so
/// that reading the header succeeds; kvchat keeps the true types ([`GgufFile::tensor_type`]).
struct Tracked {
    inner: BufReader<File>,
    pos: u64,
    /// Sorted by position, not overlapping.
    patches: Vec<(u64, [u8; 4])>,
}

impl Tracked {
    fn new(file: File, patches: Vec<(u64, [u8; 4])>) -> Self {
        Self {
            inner: BufReader::new(file),
            pos: 0,
            patches,
        }
    }
}

impl std::io::Read for Tracked {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let (from, to) = (self.pos, self.pos + n as u64);
        // The patches that overlap [from, to).
        let first = self.patches.partition_point(|(at, _)| at + 4 <= from);
        for (at, bytes) in self.patches[first..].iter().take_while(|(at, _)| *at < to) {
            for (k, b) in bytes.iter().enumerate() {
                let p = at + k as u64;
                if (from..to).contains(&p) {
                    buf[(p - from) as usize] = *b;
                }
            }
        }
        self.pos = to;
        Ok(n)
    }
}

impl std::io::Seek for Tracked {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        if to == std::io::SeekFrom::Current(0) {
            return Ok(self.pos);
        }
        // Any other move goes to the file (our own reads move it underneath, then seek).
        self.pos = self.inner.seek(to)?;
        Ok(self.pos)
    }
}

/// An opened GGUF file: its metadata is read, its tensors are read on demand.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    reader: Tracked,
    /// Dequantize every matrix to this dtype at load (`--dtype`); None keeps them quantized.
    pub dense: Option<DType>,
    /// Our CPU kernels or candle's QMatMul, per type.
    pub kernels: Kernels,
    /// The matrices [`GgufFile::pack_all`] read for our kernels, until the decoder takes them.
    packed: std::collections::HashMap<String, QMatrix>,
    /// The tensors whose type candle does not know (candle's header holds a placeholder for
    /// them): their true types. Only our kernels read them.
    own: std::collections::HashMap<String, WeightType>,
}

/// The type id candle's header reader is shown for a tensor of a type it does not know: Q8_K,
/// an activation format that no model stores, so no tensor kvchat runs through candle has it.
const PLACEHOLDER: WeightType = WeightType(15);

/// A matrix in the file: `[rows, cols]` of `dtype`, `size` bytes from byte `start`.
#[derive(Clone)]
struct Located {
    dtype: WeightType,
    rows: usize,
    cols: usize,
    start: u64,
    size: u64,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        // A regular file only: opening a pipe would block, a device would never end.
        crate::fsx::check_regular(path, u64::MAX, "model file")?;
        // The tensors' true types first (a walk of the header's tensor list, milliseconds):
        // candle's reader refuses a type it does not know, and its error carries a backtrace
        // that RUST_BACKTRACE=1 makes it capture and symbolize (180 MB and a second on
        // SmolLM2). A type kvchat cannot run is named here; those it runs and candle does not
        // are shown to candle as a placeholder.
        let types = super::gguf_types::tensor_types(path).unwrap_or_default();
        if let Some(why) = super::gguf_types::unsupported_tensor(&types) {
            bail!("{}: {why}", path.display());
        }
        let own: Vec<_> = types
            .into_iter()
            .filter(|t| t.ty.candle().is_none())
            .collect();
        let patches = own
            .iter()
            .map(|t| (t.at, PLACEHOLDER.0.to_le_bytes()))
            .collect();
        let file = File::open(path)
            .with_context(|| format!("cannot open model file {}", path.display()))?;
        let (content, mut reader) = Self::read_header(Tracked::new(file, patches), path)?;
        reader.patches.clear();
        let own = own.into_iter().map(|t| (t.name, t.ty)).collect();
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
            dense: None,
            kernels: Kernels::default(),
            packed: Default::default(),
            own,
        })
    }

    /// candle's reading of the header through `reader`, and the reader.
    fn read_header(mut reader: Tracked, path: &Path) -> Result<(gguf_file::Content, Tracked)> {
        // candle's reader divides by `general.alignment` unchecked (0 panics): read the header
        // under a guard that turns such a panic into an error about the file.
        let content = crate::guard::no_panic(|| gguf_file::Content::read(&mut reader))
            .map_err(|why| {
                anyhow::anyhow!(
                    "{} is not a readable GGUF file ({why}); is it damaged?",
                    path.display()
                )
            })?
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} is not a readable GGUF file ({e}); is it truncated or of another format?",
                    path.display(),
                    e = crate::first_line(e)
                )
            })?;
        Ok((content, reader))
    }

    /// The type of tensor `name` as the file gives it (None when the file has no such tensor).
    pub fn tensor_type(&self, name: &str) -> Option<WeightType> {
        self.own.get(name).copied().or_else(|| {
            let info = self.content.tensor_infos.get(name)?;
            Some(WeightType::from_candle(info.ggml_dtype))
        })
    }

    /// sha256 of the file's header: every byte before the tensor data (its metadata and tensor
    /// layout: names, types, shapes, offsets). Cheap (Gemma 3's 6 MB header: milliseconds), and
    /// two files with the same digest hold the same model in the same layout.
    pub fn digest(&mut self) -> Result<String> {
        use sha2::{Digest, Sha256};
        use std::io::{Read, Seek, SeekFrom};
        let cannot = |e: std::io::Error| {
            anyhow::anyhow!("cannot read the header of {}: {e}", self.path.display())
        };
        let file = self.reader.inner.get_mut();
        file.seek(SeekFrom::Start(0)).map_err(cannot)?;
        let mut header = (&mut *file).take(self.content.tensor_data_offset);
        let mut h = Sha256::new();
        std::io::copy(&mut header, &mut h).map_err(cannot)?;
        Ok(format!("{:x}", h.finalize()))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name` as candle's `QTensor`. A tensor of a type candle does not know (an i-quant)
    /// is dequantized by our kernels into an F32 tensor (for `--dtype`, another device, or
    /// export; the decoder on the CPU runs such matrices with our kernels and never asks here).
    pub fn tensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        if let Some(&ty) = self.own.get(name) {
            return self.dequantized(name, ty, device);
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot read tensor {name} from {} ({e}); the file may be truncated or corrupt",
                    self.path.display(),
                    e = crate::first_line(e)
                )
            })
    }

    /// A tensor of a type only our kernels read, dequantized to F32 row by row.
    fn dequantized(&mut self, name: &str, ty: WeightType, device: &Device) -> Result<QTensor> {
        let dims = self.content.tensor_infos[name].shape.dims().to_vec();
        // [rows, cols] with cols the innermost dimension (a vector is one row).
        let cols = *dims.last().unwrap_or(&1);
        let rows = dims.iter().rev().skip(1).product::<usize>();
        let at = self.locate_as(name, ty, rows, cols)?;
        let m = self
            .read_located(&[(name, at)])?
            .remove(name)
            .with_context(|| {
                format!(
                    "tensor {name} in {} has {ty}, which kvchat cannot run",
                    self.path.display()
                )
            })?;
        let ids: Vec<u32> = (0..rows as u32).collect();
        let t = m.rows(&ids)?.reshape(dims)?.to_device(device)?;
        Ok(QTensor::quantize(
            &t,
            candle_core::quantized::GgmlDType::F32,
        )?)
    }

    /// `[rows, cols]` of a 2-D tensor (candle's order: rows first) and its type; an error naming
    /// the tensor when the file has none of that name.
    fn dims2(&self, name: &str) -> Result<Option<(usize, usize, WeightType)>> {
        let info = self.content.tensor_infos.get(name).with_context(|| {
            format!(
                "cannot read tensor {name} from {} (the file has no such tensor); the file may be \
                 truncated or corrupt",
                self.path.display()
            )
        })?;
        let ty = self.tensor_type(name).unwrap_or(PLACEHOLDER);
        Ok(match info.shape.dims() {
            &[rows, cols] => Some((rows, cols, ty)),
            _ => None,
        })
    }

    /// Where the file holds a matrix our CPU kernels run: its type, shape, first byte and size,
    /// checked against `want` and against the file's length; None when candle or a dense copy runs
    /// it.
    fn locate(&mut self, name: &str, want: [usize; 2], device: &Device) -> Result<Option<Located>> {
        if self.dense.is_some() || !device.is_cpu() {
            return Ok(None);
        }
        let Some((rows, cols, dtype)) = self.dims2(name)? else {
            return Ok(None);
        };
        if !self.kernels.ours_for(dtype) {
            return Ok(None);
        }
        expect_dims(name, &[rows, cols], &want)?;
        self.locate_as(name, dtype, rows, cols).map(Some)
    }

    /// Where the file holds tensor `name`, `[rows, cols]` of `dtype`, checked against the file's
    /// length.
    fn locate_as(
        &mut self,
        name: &str,
        dtype: WeightType,
        rows: usize,
        cols: usize,
    ) -> Result<Located> {
        let info = &self.content.tensor_infos[name];
        let elems = rows * cols;
        if !elems.is_multiple_of(dtype.block_size()) {
            return Err(self.unreadable(
                name,
                format!(
                    "{elems} elements are not whole blocks of {}",
                    dtype.block_size()
                ),
            ));
        }
        let size = (elems / dtype.block_size() * dtype.type_size()) as u64;
        let start = self.content.tensor_data_offset.saturating_add(info.offset);
        let len = self
            .reader
            .inner
            .get_ref()
            .metadata()
            .map_err(|e| self.unreadable(name, e.to_string()))?
            .len();
        if len.saturating_sub(start) < size {
            return Err(self.unreadable(
                name,
                format!(
                    "its {dtype} blocks need {size} bytes at offset {start}, the file has {len}"
                ),
            ));
        }
        Ok(Located {
            dtype,
            rows,
            cols,
            start,
            size,
        })
    }

    fn unreadable(&self, name: &str, why: String) -> anyhow::Error {
        anyhow::anyhow!(
            "cannot read tensor {name} from {} ({why}); the file may be truncated or corrupt",
            self.path.display()
        )
    }

    /// Reads every matrix of `wanted` (name, expected `[rows, cols]`) that our CPU kernels run,
    /// in this order, straight from the file into their layout: one tile store for all (see
    /// [`Packer`]), no candle `QTensor`, no copy of a whole tensor (Gemma 3's embedding table is
    /// 178 MB). [`GgufFile::matrix`] hands them out. Every shape and extent is checked before
    /// anything is allocated; a matrix that fails a check is left for `matrix` to report when the
    /// decoder asks for it, so errors come in load order.
    fn pack_all(&mut self, wanted: &[(String, [usize; 2])], device: &Device) -> Result<()> {
        let mut found = Vec::new();
        for (name, want) in wanted {
            if let Ok(Some(at)) = self.locate(name, *want, device) {
                found.push((name.as_str(), at));
            }
        }
        self.packed = self.read_located(&found)?;
        Ok(())
    }

    /// The located matrices read into one store, by name.
    fn read_located(
        &mut self,
        found: &[(&str, Located)],
    ) -> Result<std::collections::HashMap<String, QMatrix>> {
        let shapes: Vec<_> = found
            .iter()
            .map(|(_, m)| (m.dtype, m.rows, m.cols))
            .collect();
        let mut packer = Packer::new(&shapes)?;
        let mut read = Vec::new();
        for (name, m) in found {
            use std::io::{Read, Seek, SeekFrom};
            let file = self.reader.inner.get_mut();
            // The BufReader's position is stale after this; candle's reads seek first.
            let mut src = file
                .seek(SeekFrom::Start(m.start))
                .map(|_| (&mut *file).take(m.size));
            let ours = match &mut src {
                Ok(src) => packer.read(m.dtype, m.rows, m.cols, src),
                Err(e) => Err(anyhow::anyhow!("{e}")),
            }
            .map_err(|e| self.unreadable(name, crate::first_line(e)))?;
            if ours {
                read.push(name.to_string());
            }
        }
        Ok(read.into_iter().zip(packer.finish()).collect())
    }
}
