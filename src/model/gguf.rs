//! GGUF files: metadata and quantized weights, read once; matrices stay quantized (our CPU kernels
//! in `kernels::quant`, or candle's QMatMul where those do not run or are slower).

use super::config::Config;
use super::kernels::quant::{Kernels, QMatrix};
use super::llama::{expect_dims, Embedding, Layer, Linear, Llama, Weight};
use super::rope::Rope;
use anyhow::{Context, Result};
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The matrix in our CPU kernels' block store, when the device is the CPU and `kernels` picks
/// ours for its type.
fn own_kernels(kernels: Kernels, device: &Device, w: &QTensor) -> Result<Option<QMatrix>> {
    let (rows, cols) = match w.shape().dims() {
        &[rows, cols] => (rows, cols),
        _ => return Ok(None),
    };
    if !device.is_cpu() || !kernels.ours_for(w.dtype(), rows, cols) {
        return Ok(None);
    }
    QMatrix::from_qtensor(w)
}

/// An opened GGUF file: its metadata is read, its tensors are read on demand.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
    reader: BufReader<File>,
    /// Dequantize every matrix to this dtype at load (`--dtype`); None keeps them quantized.
    pub dense: Option<DType>,
    /// Our CPU kernels or candle's QMatMul, per type.
    pub kernels: Kernels,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        // A regular file only: opening a pipe would block, a device would never end.
        crate::fsx::check_regular(path, u64::MAX, "model file")?;
        let file = File::open(path)
            .with_context(|| format!("cannot open model file {}", path.display()))?;
        let mut reader = BufReader::new(file);
        // candle's reader divides by `general.alignment` unchecked (0 panics): read the header
        // under a guard that turns such a panic into an error about the file.
        let content = crate::guard::no_panic(|| gguf_file::Content::read(&mut reader))
            .map_err(|why| {
                anyhow::anyhow!(
                    "{} is not a readable GGUF file ({why}); is it damaged?",
                    path.display()
                )
            })?
            .map_err(|e| match super::gguf_types::unsupported_tensor(path) {
                // A tensor type candle's reader does not know: name it, not "damaged".
                Some(why) => anyhow::anyhow!("{}: {why}", path.display()),
                None => anyhow::anyhow!(
                    "{} is not a readable GGUF file ({e}); is it truncated or of another format?",
                    path.display(),
                    e = crate::first_line(e)
                ),
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
            dense: None,
            kernels: Kernels::default(),
        })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
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

    /// A dense f32 tensor (norm weights, biases), dequantized if stored quantized.
    fn dense(&mut self, name: &str, device: &Device) -> Result<Tensor> {
        Ok(self.tensor(name, device)?.dequantize(device)?)
    }

    fn linear(
        &mut self,
        name: &str,
        bias: bool,
        want: [usize; 2],
        device: &Device,
    ) -> Result<Linear> {
        let w = self.tensor(&format!("{name}.weight"), device)?;
        expect_dims(&format!("{name}.weight"), w.shape().dims(), &want)?;
        let b = if bias {
            Some(self.dense(&format!("{name}.bias"), device)?)
        } else {
            None
        };
        Ok(Linear {
            w: self.weight(Arc::new(w), device)?,
            b,
        })
    }

    /// A matrix as the decoder uses it: quantized, or dequantized to `self.dense`.
    fn weight(&self, w: Arc<QTensor>, device: &Device) -> Result<Weight> {
        Ok(match self.dense {
            Some(dtype) => Weight::Dense(w.dequantize(device)?.to_dtype(dtype)?),
            None => match own_kernels(self.kernels, device, &w)? {
                Some(m) => Weight::Cpu(m),
                None => Weight::Quantized(QMatMul::from_arc(w)?),
            },
        })
    }

    /// The hyperparameters in this file's metadata.
    pub fn config(&self) -> Result<Config> {
        Config::from_gguf(&self.content)
            .with_context(|| format!("model file {}", self.path.display()))
    }

    /// Builds the decoder. `max_positions` sizes the RoPE table (the most positions a run may reach).
    pub fn load_llama(&mut self, device: &Device, max_positions: usize) -> Result<Llama> {
        let cfg = self.config()?;
        self.load_llama_with(cfg, device, max_positions)
    }

    /// Builds the decoder from hyperparameters already read with [`GgufFile::config`].
    pub fn load_llama_with(
        &mut self,
        cfg: Config,
        device: &Device,
        max_positions: usize,
    ) -> Result<Llama> {
        let (h, nh, nkv, hd, ffn) = (cfg.hidden, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.ffn);
        let embed = Arc::new(self.tensor("token_embd.weight", device)?);
        expect_dims("token_embd.weight", embed.shape().dims(), &[cfg.vocab, h])?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let block = cfg.block;
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let qkv_bias = self.has_tensor(&format!("{p}.attn_q.bias"));
            // A norm weight the architecture's block uses, of `n` values.
            let mut norm = |used: bool, name: &str, n: usize| -> Result<Option<Tensor>> {
                if !used {
                    return Ok(None);
                }
                let name = format!("{p}.{name}.weight");
                let w = self.dense(&name, device)?;
                expect_dims(&name, w.dims(), &[n])?;
                Ok(Some(w))
            };
            let q_norm = norm(block.qk_norm, "attn_q_norm", hd)?;
            let k_norm = norm(block.qk_norm, "attn_k_norm", hd)?;
            let post_attn_norm = norm(block.post_norms, "post_attention_norm", h)?;
            let post_ffn_norm = norm(block.post_norms, "post_ffw_norm", h)?;
            let mut layer = Layer {
                qkv: None,
                gate_up: None,
                attn_norm: self.dense(&format!("{p}.attn_norm.weight"), device)?,
                wq: self.linear(&format!("{p}.attn_q"), qkv_bias, [nh * hd, h], device)?,
                wk: self.linear(&format!("{p}.attn_k"), qkv_bias, [nkv * hd, h], device)?,
                wv: self.linear(&format!("{p}.attn_v"), qkv_bias, [nkv * hd, h], device)?,
                wo: self.linear(&format!("{p}.attn_output"), false, [h, nh * hd], device)?,
                ffn_norm: self.dense(&format!("{p}.ffn_norm.weight"), device)?,
                w_gate: self.linear(&format!("{p}.ffn_gate"), false, [ffn, h], device)?,
                w_up: self.linear(&format!("{p}.ffn_up"), false, [ffn, h], device)?,
                w_down: self.linear(&format!("{p}.ffn_down"), false, [h, ffn], device)?,
                q_norm,
                k_norm,
                post_attn_norm,
                post_ffn_norm,
            };
            layer.stack_projections()?;
            layers.push(layer);
        }
        let norm = self.dense("output_norm.weight", device)?;
        // Tied embeddings: with no output.weight, the output projection is the embedding matrix.
        // The table in our kernels' store when they run its type (no dequantized copy; with tied
        // embeddings, the output matrix is the same store).
        let embed_own = match self.dense {
            None => own_kernels(self.kernels, device, &embed)?,
            Some(_) => None,
        };
        // Tied embeddings: with no output.weight, the output projection is the embedding matrix.
        let output = if self.has_tensor("output.weight") {
            self.linear("output", false, [cfg.vocab, h], device)?
        } else {
            Linear {
                w: match &embed_own {
                    Some(m) => Weight::Cpu(m.clone()),
                    None => self.weight(embed.clone(), device)?,
                },
                b: None,
            }
        };
        let freq_factors = if self.has_tensor("rope_freqs.weight") {
            Some(self.dense("rope_freqs.weight", device)?.to_vec1::<f32>()?)
        } else {
            None
        };
        let rope = Rope::new(
            &cfg,
            max_positions,
            freq_factors.as_deref(),
            DType::F32,
            device,
        )?;
        let rope_local = Rope::local(&cfg, max_positions, DType::F32, device)?;
        let embed = match (embed.dtype(), self.dense) {
            (_, None) if embed_own.is_some() => Embedding::Cpu(embed_own.expect("checked")),
            (_, Some(dtype)) => Embedding::Dense(embed.dequantize(device)?.to_dtype(dtype)?),
            (candle_core::quantized::GgmlDType::F32, None) => {
                Embedding::Dense(embed.dequantize(device)?)
            }
            _ => Embedding::Quantized(embed),
        };
        Ok(Llama {
            cfg,
            embed,
            layers,
            norm,
            output,
            rope,
            rope_local,
            device: device.clone(),
            prefill_chunk: super::llama::PREFILL_CHUNK,
        })
    }
}
