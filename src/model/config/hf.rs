//! `Config::from_hf_json`: the hyperparameters of an HF-layout (safetensors) model's `config.json`.

use super::*;
use anyhow::{bail, Context};

impl Config {
    /// Reads the hyperparameters from a Hugging Face `config.json`. HF checkpoints keep Q/K rows in
    /// the half-split rotary order (`rotate_half`), whatever the architecture.
    pub fn from_hf_json(json: &serde_json::Value) -> Result<Self> {
        let arch = json
            .get("model_type")
            .and_then(|v| v.as_str())
            .context("config.json has no model_type")?
            .to_string();
        let hf = crate::model::arch::find(&arch).filter(|a| a.hf_class.is_some());
        let Some(row) = hf else {
            let gguf_only = crate::model::arch::names_where(|a| a.hf_class.is_none());
            bail!(
                "unsupported model_type '{arch}' in config.json (supported in the safetensors layout: {}; {} run from GGUF only)",
                crate::model::arch::hf_names().join(", "),
                gguf_only.join(", ")
            );
        };
        let get_u = |key: &str| -> Result<usize> {
            json.get(key)
                .with_context(|| format!("config.json lacks {key}"))?
                .as_u64()
                .map(|v| v as usize)
                .with_context(|| format!("config.json {key} is not a non-negative integer"))
        };
        let get_f = |key: &str| -> Option<f64> { json.get(key).and_then(|v| v.as_f64()) };
        let n_head = get_u("num_attention_heads")?;
        let hidden = get_u("hidden_size")?;
        let head_dim = match json.get("head_dim") {
            Some(v) if !v.is_null() => get_u("head_dim")?,
            _ => hidden / n_head.max(1),
        };
        let rope_linear_scale = match json.get("rope_scaling") {
            None | Some(serde_json::Value::Null) => 1.0,
            Some(rs) => {
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                match kind {
                    "default" => 1.0,
                    "linear" => rs
                        .get("factor")
                        .and_then(|v| v.as_f64())
                        .context("config.json rope_scaling (linear) lacks factor")?
                        as f32,
                    // Per-frequency factors, computed by the loader (`llama3_freq_factors`).
                    "llama3" => 1.0,
                    other => bail!(
                        "unsupported rope_scaling type '{other}' in config.json (supported: linear, llama3)"
                    ),
                }
            }
        };
        let cfg = Self {
            n_layer: get_u("num_hidden_layers")?,
            n_head,
            n_kv_head: match json.get("num_key_value_heads") {
                Some(v) if !v.is_null() => get_u("num_key_value_heads")?,
                _ => n_head,
            },
            head_dim,
            hidden,
            ffn: get_u("intermediate_size")?,
            vocab: get_u("vocab_size")?,
            ctx_train: get_u("max_position_embeddings")?,
            rope_base: get_f("rope_theta").unwrap_or(10_000.0) as f32,
            rope_dim: head_dim,
            rope_linear_scale,
            rope_style: RopeStyle::HalfSplit,
            rms_eps: get_f("rms_norm_eps").context("config.json lacks rms_norm_eps")?,
            sliding_window: None,
            rope_base_local: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            pieces: row.pieces,
            yarn: None,
            experts: None,
            layers: None,
            per_layer_embd: 0,
            final_softcap: None,
            recurrent: None,
            arch,
            layer_map: LayerMap::default(),
        };
        cfg.finish()
    }

    /// Llama 3's `rope_scaling` (type llama3) as per-frequency divisors, the same numbers GGUF stores
    /// in `rope_freqs.weight`; None when config.json asks for no such scaling.
    pub fn llama3_freq_factors(&self, json: &serde_json::Value) -> Result<Option<Vec<f32>>> {
        let Some(rs) = json.get("rope_scaling").filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let kind = rs.get("rope_type").or_else(|| rs.get("type"));
        if kind.and_then(|v| v.as_str()) != Some("llama3") {
            return Ok(None);
        }
        let f = |k: &str| {
            rs.get(k)
                .and_then(|v| v.as_f64())
                .with_context(|| format!("config.json rope_scaling (llama3) lacks {k}"))
        };
        let (factor, low, high, old_ctx) = (
            f("factor")?,
            f("low_freq_factor")?,
            f("high_freq_factor")?,
            f("original_max_position_embeddings")?,
        );
        let (low_wavelen, high_wavelen) = (old_ctx / low, old_ctx / high);
        let half = self.rope_dim / 2;
        Ok(Some(
            (0..half)
                .map(|i| {
                    let freq =
                        1.0 / (self.rope_base as f64).powf(2.0 * i as f64 / self.rope_dim as f64);
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    let scaled = if wavelen < high_wavelen {
                        freq
                    } else if wavelen > low_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    };
                    (freq / scaled) as f32
                })
                .collect(),
        ))
    }
}
