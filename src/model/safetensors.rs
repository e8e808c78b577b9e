//! Hugging Face checkpoints: `config.json` + `model*.safetensors` (one file or shards), loaded into
//! the same decoder as GGUF.
//!
//! The one layout difference that matters: GGUF `llama` files store Q/K rows permuted for
//! interleaved RoPE pairs (x0,x1),(x2,x3)…, HF keeps them in `rotate_half` order (x_i, x_{i+d/2}).
//! Both are the same model; here the weights are kept as stored and the rotary style is half-split.

use super::config::Config;
use super::decoder::{
    expect_dims, Attention, Block, Decoder, Embedding, Ffn, Linear, Mixer, Weight,
};
use super::files::HfFiles;
use super::rope::Rope;
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

/// An opened HF checkpoint: its config read, its tensors mapped.
pub struct HfCheckpoint {
    pub files: HfFiles,
    pub json: serde_json::Value,
    pub cfg: Config,
    st: MmapedSafetensors,
}

/// Parses `--dtype` for dense weights.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => bail!("dtype '{other}' is not one of f32, f16, bf16"),
    }
}

/// A `config.json`: the hyperparameters, and the JSON itself (for rope_scaling, tied embeddings).
pub fn read_config(path: &std::path::Path) -> Result<(Config, serde_json::Value)> {
    let json = crate::read_json(path)?;
    let cfg =
        Config::from_hf_json(&json).with_context(|| format!("model config {}", path.display()))?;
    Ok((cfg, json))
}

impl HfCheckpoint {
    pub fn open(files: &HfFiles) -> Result<Self> {
        let (cfg, json) = read_config(&files.config)?;
        if files.weights.is_empty() {
            bail!("{}: no model*.safetensors weights", files.label);
        }
        // SAFETY: the files are mapped read-only; like every mmap-based loader we assume nobody
        // truncates them while kvchat runs.
        let st = unsafe { MmapedSafetensors::multi(&files.weights) }.map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot read safetensors weights ({})",
                files.label,
                crate::first_line(e)
            )
        })?;
        Ok(Self {
            files: files.clone(),
            json,
            cfg,
            st,
        })
    }

    /// The number of weights, and the tensors' dtypes with their counts ("bf16 ×272").
    pub fn tensor_summary(&self) -> (u64, String) {
        let tensors = self.st.tensors();
        let params = tensors
            .iter()
            .map(|(_, t)| t.shape().iter().product::<usize>() as u64)
            .sum();
        let types = crate::tally(
            tensors
                .iter()
                .map(|(_, t)| format!("{:?}", t.dtype()).to_lowercase()),
        );
        (params, types)
    }

    /// sha256 over config.json and the tensor layout (names, dtypes, shapes), plus the load dtype.
    pub fn digest(&self, dtype: DType) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.json.to_string().as_bytes());
        let mut names: Vec<(String, String)> = self
            .st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, format!("{:?}{:?}", v.dtype(), v.shape())))
            .collect();
        names.sort();
        for (n, d) in names {
            h.update(format!("{n}:{d};").as_bytes());
        }
        h.update(format!("{dtype:?}").as_bytes());
        format!("{:x}", h.finalize())
    }

    fn has(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }

    /// A tensor checked against the shape config.json implies, converted to `dtype`.
    fn tensor(&self, name: &str, want: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let view = self
            .st
            .get(name)
            .map_err(|_| anyhow::anyhow!("{}: tensor {name} is missing", self.files.label))?;
        expect_dims(name, view.shape(), want)
            .with_context(|| format!("{} does not match its config.json", self.files.label))?;
        Ok(self.st.load(name, device)?.to_dtype(dtype)?)
    }

    fn linear(
        &self,
        name: &str,
        want: [usize; 2],
        dtype: DType,
        device: &Device,
    ) -> Result<Linear> {
        let w = self.tensor(&format!("{name}.weight"), &want, dtype, device)?;
        let bias = format!("{name}.bias");
        let b = if self.has(&bias) {
            Some(self.tensor(&bias, &[want[0]], DType::F32, device)?)
        } else {
            None
        };
        Ok(Linear {
            w: Weight::Dense(w),
            b,
        })
    }

    /// Builds the decoder with dense weights in `dtype`; norms, biases and activations stay f32.
    pub fn load_decoder(
        &self,
        device: &Device,
        dtype: DType,
        max_positions: usize,
    ) -> Result<Decoder> {
        let cfg = self.cfg.clone();
        let (h, nh, nkv, hd, ffn) = (cfg.hidden, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.ffn);
        let f32 = DType::F32;
        let embed = self.tensor("model.embed_tokens.weight", &[cfg.vocab, h], dtype, device)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("model.layers.{i}");
            let norm = |n: &str| self.tensor(&format!("{p}.{n}.weight"), &[h], f32, device);
            let lin = |n: &str, want| self.linear(&format!("{p}.{n}"), want, dtype, device);
            layers.push(Block {
                attn_norm: norm("input_layernorm")?,
                mixer: Mixer::Attention(Attention {
                    qkv: None,
                    wq: lin("self_attn.q_proj", [nh * hd, h])?,
                    wk: Some(lin("self_attn.k_proj", [nkv * hd, h])?),
                    wv: Some(lin("self_attn.v_proj", [nkv * hd, h])?),
                    wo: lin("self_attn.o_proj", [h, nh * hd])?,
                    v_norm: None,
                    sinks: None,
                    q_norm: None,
                    k_norm: None,
                }),
                out_scale: None,
                per_layer: None,
                moe_beside: None,
                ffn_norm: norm("post_attention_layernorm")?,
                ffn: Ffn::Dense {
                    gate_up: None,
                    gate: lin("mlp.gate_proj", [ffn, h])?,
                    up: lin("mlp.up_proj", [ffn, h])?,
                    down: lin("mlp.down_proj", [h, ffn])?,
                },
                post_attn_norm: None,
                post_ffn_norm: None,
            });
        }
        let norm = self.tensor("model.norm.weight", &[h], f32, device)?;
        let tied = self
            .json
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        // Tied embeddings: no lm_head.weight, the output projection is the embedding matrix.
        let output = if self.has("lm_head.weight") {
            self.linear("lm_head", [cfg.vocab, h], dtype, device)?
        } else if tied {
            Linear {
                w: Weight::Dense(embed.clone()),
                b: None,
            }
        } else {
            bail!(
                "{}: tensor lm_head.weight is missing (and config.json does not tie embeddings)",
                self.files.label
            );
        };
        let freq_factors = cfg.llama3_freq_factors(&self.json)?;
        let rope = Rope::new(&cfg, max_positions, freq_factors.as_deref(), f32, device)?;
        Ok(Decoder {
            cfg,
            embed: Embedding::Dense(embed),
            layers,
            norm,
            output,
            rope,
            per_layer: None,
            rope_local: None,
            device: device.clone(),
            prefill_chunk: super::decoder::PREFILL_CHUNK,
        })
    }
}
