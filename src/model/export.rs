//! GGUF → Hugging Face layout: the safetensors fixture the tests load through the HF path.
//!
//! Every tensor is dequantized to f32 and renamed to HF's names; Q/K rows of `llama`/`mistral`
//! files are put back from GGUF's interleaved rotary order into HF's half-split order (the inverse
//! of llama.cpp's convert permutation). config.json, tokenizer.json and tokenizer_config.json are
//! written from the GGUF metadata, so the directory is a complete HF-layout model.

use super::config::RopeStyle;
use super::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// HF's name for a GGUF tensor name (`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`).
pub fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (part, kind) = rest.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// GGUF's interleaved Q/K rows back to HF's half-split order. Within each head, GGUF row
/// `2j + s` holds HF row `s * hd/2 + j` (s = 0, 1; j < hd/2).
pub fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    Ok(
        w.reshape((heads, hd / 2, 2, cols))? // [heads, hd/2, 2, cols]
            .transpose(1, 2)? // [heads, 2, hd/2, cols]
            .contiguous()?
            .reshape((rows, cols))?,
    )
}

/// Writes `out_dir/{config.json, tokenizer.json, tokenizer_config.json, model.safetensors}`.
pub fn gguf_to_hf(gguf_path: &Path, out_dir: &Path) -> Result<()> {
    let dev = Device::Cpu;
    let mut gguf = GgufFile::open(gguf_path)?;
    let cfg = gguf.config()?;
    let hf_class = super::arch::find(&cfg.arch).and_then(|a| a.hf_class);
    let Some(architecture) = hf_class else {
        anyhow::bail!(
            "exporting a {} model to the HF layout is not supported ({} only): its extra norms would be lost",
            cfg.arch,
            super::arch::hf_names().join(", ")
        );
    };
    let interleaved = cfg.rope_style == RopeStyle::Interleaved;
    if interleaved && cfg.rope_dim != cfg.head_dim {
        bail!("partial rotary with interleaved pairs is not supported by the exporter");
    }
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;

    let mut names: Vec<String> = gguf.content.tensor_infos.keys().cloned().collect();
    names.sort();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for name in &names {
        let Some(hf) = hf_name(name) else {
            // rope_freqs.weight and the like: derived data, not weights.
            continue;
        };
        let mut t = gguf.tensor(name, &dev)?.dequantize(&dev)?;
        if interleaved && name.ends_with("attn_q.weight") {
            t = unpermute_rows(&t, cfg.n_head)?;
        } else if interleaved && name.ends_with("attn_k.weight") {
            t = unpermute_rows(&t, cfg.n_kv_head)?;
        }
        tensors.insert(hf, t);
    }
    let tied = !tensors.contains_key("lm_head.weight");
    candle_core::safetensors::save(&tensors, out_dir.join("model.safetensors"))?;
    drop(tensors);

    let mut config = serde_json::json!({
        "architectures": [architecture],
        "model_type": cfg.arch,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.ctx_train,
        "rope_theta": cfg.rope_base,
        "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    });
    if cfg.rope_linear_scale != 1.0 {
        config["rope_scaling"] =
            serde_json::json!({"rope_type": "linear", "factor": cfg.rope_linear_scale});
    }
    std::fs::write(
        out_dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;

    let tk = Tokenizer::from_gguf(&gguf.content)?;
    tk.to_hf()?
        .save(out_dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("cannot write tokenizer.json: {e}"))?;
    let mut tk_config = serde_json::json!({
        "bos_token": tk.bos_id.map(|_| tk.bos_text()),
        "eos_token": tk.eos_id.map(|_| tk.eos_text()),
        "add_bos_token": tk.add_bos,
    });
    if let Some(t) = gguf
        .content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
    {
        tk_config["chat_template"] = serde_json::Value::String(t.clone());
    }
    std::fs::write(
        out_dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tk_config)?,
    )?;
    Ok(())
}
