//! `Config::from_gguf`: the hyperparameters read from GGUF metadata (`{arch}.block_count`, …), as
//! llama.cpp's `load_hparams` reads them: a key it reads as optional may be absent and then holds
//! its default; a key it needs is refused by name.

use super::*;
use anyhow::{bail, Context};
use candle_core::quantized::gguf_file;

/// The largest count or size kvchat takes from a file's metadata (2^31): anything larger is a damaged
/// or hostile file, not a model.
const MAX_DIM: u64 = 1 << 31;

impl Config {
    /// Reads the hyperparameters from GGUF metadata (`{arch}.block_count`, …).
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let md = &ct.metadata;
        let arch = md
            .get("general.architecture")
            .context("GGUF has no general.architecture")?
            .to_string()?
            .clone();
        let Some(row) = crate::model::arch::find(&arch) else {
            bail!(
                "unsupported model architecture '{arch}' (supported: {})",
                crate::model::arch::names().join(", ")
            );
        };
        let block = row.pieces;
        // Keys are required (`get*`) or optional (`opt*`: None when absent, as llama.cpp's
        // `get_key(.., false)`; a value of the wrong kind is an error either way).
        let opt = |key: &str| md.get(&format!("{arch}.{key}"));
        let get = |key: &str| opt(key).with_context(|| format!("GGUF metadata lacks {arch}.{key}"));
        let as_u = |key: &str, v: &gguf_file::Value| -> Result<usize> {
            use gguf_file::Value as V;
            let n: i128 = match v {
                V::U8(x) => (*x).into(),
                V::U16(x) => (*x).into(),
                V::U32(x) => (*x).into(),
                V::U64(x) => (*x).into(),
                V::I8(x) => (*x).into(),
                V::I16(x) => (*x).into(),
                V::I32(x) => (*x).into(),
                V::I64(x) => (*x).into(),
                _ => bail!("GGUF {arch}.{key} is not an integer"),
            };
            usize::try_from(n)
                .ok()
                .filter(|&n| n as u64 <= MAX_DIM)
                .with_context(|| format!("GGUF {arch}.{key} = {n} is out of range"))
        };
        let as_f = |key: &str, v: &gguf_file::Value| -> Result<f32> {
            v.to_f32()
                .or_else(|_| v.to_f64().map(|x| x as f32))
                .with_context(|| format!("GGUF {arch}.{key} is not a float"))
        };
        let get_u = |key: &str| -> Result<usize> { as_u(key, get(key)?) };
        let opt_u =
            |key: &str| -> Result<Option<usize>> { opt(key).map(|v| as_u(key, v)).transpose() };
        let get_f = |key: &str| -> Result<f32> { as_f(key, get(key)?) };
        let opt_f =
            |key: &str| -> Result<Option<f32>> { opt(key).map(|v| as_f(key, v)).transpose() };
        // An integer per layer: an array of `n` of them, or one for every layer (llama.cpp's
        // `get_key_or_arr`).
        let opt_per_layer = |key: &str, n: usize| -> Result<Option<Vec<usize>>> {
            Ok(Some(match opt(key) {
                None => return Ok(None),
                Some(gguf_file::Value::Array(a)) => {
                    if a.len() != n {
                        bail!("GGUF {arch}.{key} has {} entries for {n} layers", a.len());
                    }
                    a.iter()
                        .map(|v| as_u(key, v))
                        .collect::<Result<Vec<usize>>>()?
                }
                Some(v) => vec![as_u(key, v)?; n],
            }))
        };
        let get_per_layer = |key: &str, n: usize| -> Result<Vec<usize>> {
            opt_per_layer(key, n)?.with_context(|| format!("GGUF metadata lacks {arch}.{key}"))
        };
        let hidden = get_u("embedding_length")?;
        // llama.cpp reads a missing head count as 0, and then finds no attention tensor of
        // that shape: every architecture here needs it.
        let n_head = get_u("attention.head_count")?;
        let n_layer = get_u("block_count")?;
        if n_layer > 4096 {
            bail!("model block_count = {n_layer} is beyond any real model's (at most 4096); the file is damaged");
        }
        // Gemma 4 states KV heads and FFN width per layer.
        let kv_heads = opt_per_layer("attention.head_count_kv", n_layer)?
            .unwrap_or_else(|| vec![n_head; n_layer]);
        // The dense FFN's width: llama.cpp reads a missing one as 0, and then finds no `ffn_*`
        // tensor of that shape, so a block with a dense FFN needs it; a mixture of experts
        // (gpt-oss, Qwen3.5 MoE) has none, and uses it only as its experts' fallback width.
        let ffns = match block.moe {
            true => {
                opt_per_layer("feed_forward_length", n_layer)?.unwrap_or_else(|| vec![0; n_layer])
            }
            false => get_per_layer("feed_forward_length", n_layer)?,
        };
        let n_kv_head = kv_heads.iter().copied().max().unwrap_or(n_head);
        let head_dim = opt_u("attention.key_length")?.unwrap_or(hidden / n_head.max(1));
        let ffn = ffns.iter().copied().max().unwrap_or(0);
        let ctx_train = get_u("context_length")?;
        let rms_eps = get_f("attention.layer_norm_rms_epsilon")? as f64;
        let rope_base = opt_f("rope.freq_base")?.unwrap_or(10_000.0);
        let rope_dim = opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        // llama.cpp's defaults: scaling is linear, by `rope.scaling.factor` (or the older
        // `rope.scale_linear`) when the file gives one, else by 1; YaRN's original context is
        // the trained one.
        let factor = match opt_f("rope.scaling.factor")? {
            Some(f) => Some(f),
            None => opt_f("rope.scale_linear")?,
        }
        .unwrap_or(1.0);
        let mut yarn = None;
        let rope_linear_scale = match opt("rope.scaling.type") {
            None => factor,
            Some(t) => match t.to_string()?.as_str() {
                "none" => 1.0,
                "linear" => factor,
                "yarn" => {
                    yarn = Some(Yarn {
                        factor,
                        orig_ctx: opt_u("rope.scaling.original_context_length")?
                            .unwrap_or(ctx_train),
                        beta_fast: get_f("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                        beta_slow: get_f("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
                    });
                    1.0
                }
                other => {
                    bail!("unsupported RoPE scaling type '{other}' (supported: none, linear, yarn)")
                }
            },
        };
        // The embedding matrix is the authority on vocabulary size; metadata is the fallback.
        let vocab = match ct.tensor_infos.get("token_embd.weight") {
            Some(info) => *info.shape.dims().first().with_context(|| {
                format!("tensor token_embd.weight has no dimensions (expected [vocab, {hidden}])")
            })?,
            None => match get_u("vocab_size") {
                Ok(v) => v,
                Err(_) => md
                    .get("tokenizer.ggml.tokens")
                    .context("GGUF has no token_embd.weight, vocab_size or tokenizer.ggml.tokens")?
                    .to_vec()?
                    .len(),
            },
        };
        let rope_style = if block.neox_rope {
            RopeStyle::HalfSplit
        } else {
            RopeStyle::Interleaved
        };
        // Experts beside each dense FFN (Gemma 4 26B-A4B).
        let beside = block.experts_beside && md.contains_key(&format!("{arch}.expert_count"));
        // llama.cpp reads a missing expert count (or count used) as 0, and then finds no
        // router of that shape (or asserts): a mixture needs both.
        let experts = if block.moe || beside {
            let (count, used) = (get_u("expert_count")?, get_u("expert_used_count")?);
            // Qwen3.5 MoE's widths fall back on the dense one where the file gives none (or 0),
            // as llama.cpp's tensor loader: `n_ff_exp ? n_ff_exp : n_ff / n_expert_used`,
            // `n_ff_shexp ? n_ff_shexp : n_ff`. The other architectures' experts need their
            // width (llama.cpp finds no expert tensors of width 0) and have no shared expert.
            let or_dense = |key: &str, dense: usize| -> Result<usize> {
                match opt_u(key)?.filter(|&f| f != 0).unwrap_or(dense) {
                    0 => bail!(
                        "GGUF metadata lacks {arch}.{key} (and {arch}.feed_forward_length, its fallback)"
                    ),
                    f => Ok(f),
                }
            };
            let (expert_ffn, shared) = match block.shared_expert {
                true => (
                    or_dense("expert_feed_forward_length", ffn / used.max(1))?,
                    or_dense("expert_shared_feed_forward_length", ffn)?,
                ),
                false => (get_u("expert_feed_forward_length")?, 0),
            };
            Some(Experts {
                count,
                used,
                ffn: expert_ffn,
                shared,
            })
        } else {
            None
        };
        if block.shared_expert {
            // kvchat's router is the softmax of the chosen experts' logits, unscaled (what
            // llama.cpp's softmax, top-k and renormalization give).
            if let Ok(v) = get_f("expert_weights_scale") {
                if v != 0.0 && v != 1.0 {
                    bail!("GGUF {arch}.expert_weights_scale = {v}: scaled expert weights are not supported");
                }
            }
            if let Ok(g) = get_u("expert_gating_func") {
                if g != 1 {
                    bail!("GGUF {arch}.expert_gating_func = {g}: only softmax gating (1) is supported");
                }
            }
        }
        // Which layers attend within the window (`Swa::Pattern`).
        let window_pattern = || -> Result<Vec<bool>> {
            let key = "attention.sliding_window_pattern";
            Ok(match opt(key) {
                Some(gguf_file::Value::Array(a)) => {
                    if a.len() != n_layer {
                        bail!(
                            "GGUF {arch}.{key} has {} entries for {n_layer} layers",
                            a.len()
                        );
                    }
                    a.iter()
                        .map(|v| {
                            v.to_bool().map_err(|_| {
                                anyhow::anyhow!("GGUF {arch}.{key} holds a non-boolean")
                            })
                        })
                        .collect::<Result<Vec<bool>>>()?
                }
                Some(v) => {
                    let n = as_u(key, v)?;
                    if n == 0 {
                        bail!("GGUF {arch}.{key} is 0");
                    }
                    (0..n_layer).map(|i| i % n < n - 1).collect()
                }
                None => (0..n_layer).map(|i| i % 6 < 5).collect(),
            })
        };
        let (sliding_window, rope_base_local) = match block.swa {
            Swa::None => (None, None),
            Swa::Alternate => {
                let w = get_u("attention.sliding_window")?;
                (Some((w, (0..n_layer).map(|i| i % 2 == 0).collect())), None)
            }
            Swa::Pattern { window_optional } => match opt_u("attention.sliding_window")? {
                Some(0) => bail!("GGUF {arch}.attention.sliding_window is 0"),
                Some(w) => (
                    Some((w, window_pattern()?)),
                    Some(opt_f("rope.freq_base_swa")?.unwrap_or(10_000.0)),
                ),
                // llama.cpp's gemma3 without a window: every layer attends globally.
                None if window_optional => (None, None),
                None => bail!("GGUF metadata lacks {arch}.attention.sliding_window"),
            },
        };
        let attn_scale = block.attn_scale.factor(n_layer, hidden, n_head, head_dim);
        let uniform = kv_heads.iter().all(|&k| k == n_kv_head) && ffns.iter().all(|&f| f == ffn);
        let layers = if block.layer_shapes {
            Some(LayerShapes {
                head_dim_local: opt_u("attention.key_length_swa")?.unwrap_or(head_dim),
                rope_dim_local: opt_u("rope.dimension_count_swa")?.unwrap_or(rope_dim),
                kv_heads,
                ffn: ffns,
                shared_kv: match block.shared_kv {
                    true => opt_u("attention.shared_kv_layers")?.unwrap_or(0),
                    false => 0,
                },
            })
        } else if !uniform {
            let shaped = crate::model::arch::names_where(|a| a.pieces.layer_shapes);
            bail!(
                "GGUF {arch}: layers of different KV heads or FFN widths are read for {} only",
                shaped.join(", ")
            );
        } else {
            None
        };
        let per_layer_embd = match block.per_layer_embd {
            true => opt_u("embedding_length_per_layer_input")?.unwrap_or(0),
            false => 0,
        };
        // llama.cpp: a softcap of 0 is none.
        let softcap = match block.softcap {
            Some(default) => opt_f("final_logit_softcapping")?.unwrap_or(default),
            None => 0.0,
        };
        let final_softcap = Some(softcap).filter(|&c| c != 0.0);
        let recurrent = match block.delta_net {
            true => {
                let r = Recurrent {
                    layers: Vec::new(),
                    conv: get_u("ssm.conv_kernel")?,
                    k_heads: get_u("ssm.group_count")?,
                    v_heads: get_u("ssm.time_step_rank")?,
                    head_dim: get_u("ssm.state_size")?,
                };
                let inner = get_u("ssm.inner_size")?;
                if inner != r.value_dim() {
                    bail!(
                        "GGUF {arch}.ssm.inner_size = {inner} is not ssm.time_step_rank × ssm.state_size = {} × {}",
                        r.v_heads,
                        r.head_dim
                    );
                }
                // Which layers are recurrent: stated per layer, or every layer but each
                // `full_attention_interval`-th (llama.cpp's default 4).
                let key = format!("{arch}.attention.recurrent_layers");
                let layers = match md.get(&key) {
                    Some(gguf_file::Value::Array(a)) if a.len() == n_layer => a
                        .iter()
                        .map(|v| match v {
                            gguf_file::Value::Bool(b) => Ok(*b),
                            v => Ok(as_u("attention.recurrent_layers", v)? != 0),
                        })
                        .collect::<Result<Vec<bool>>>()?,
                    Some(_) => bail!("GGUF {key} is not an array of {n_layer} flags"),
                    None => {
                        let every = opt_u("full_attention_interval")?.unwrap_or(4);
                        if every == 0 {
                            bail!("GGUF {arch}.full_attention_interval is 0");
                        }
                        (0..n_layer).map(|i| (i + 1) % every != 0).collect()
                    }
                };
                check_text_rope_sections(md, &arch, rope_dim)?;
                Some(Recurrent { layers, ..r })
            }
            false => None,
        };
        let cfg = Self {
            recurrent,
            arch,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            hidden,
            ffn,
            vocab,
            ctx_train,
            rope_base,
            rope_dim,
            rope_linear_scale,
            rope_style,
            rms_eps,
            sliding_window,
            rope_base_local,
            attn_scale,
            pieces: block,
            yarn,
            experts,
            layers,
            per_layer_embd,
            final_softcap,
            layer_map: LayerMap::default(),
        };
        cfg.finish()
    }
}

/// Qwen3.5 rotates with llama.cpp's interleaved multi-section RoPE (`rope.dimension_sections`:
/// pairs split between time, height, width and an extra position). A text token has the same
/// position in the first three and 0 in the fourth, so where every rotated pair falls in one of
/// the first three, the rotation is the plain half-split one over `rope.dimension_count`
/// dimensions: that is what kvchat runs, and a file that puts pairs in the fourth is refused.
fn check_text_rope_sections(
    md: &std::collections::HashMap<String, gguf_file::Value>,
    arch: &str,
    rope_dim: usize,
) -> Result<()> {
    let key = format!("{arch}.rope.dimension_sections");
    let Some(v) = md.get(&key) else {
        return Ok(());
    };
    let sections = match v {
        gguf_file::Value::Array(a) if a.len() <= 4 => {
            let mut s = [0i64; 4];
            for (d, v) in s.iter_mut().zip(a) {
                *d = v
                    .to_i32()
                    .map(i64::from)
                    .or_else(|_| v.to_u32().map(i64::from))
                    .map_err(|_| anyhow::anyhow!("GGUF {key} holds a non-integer"))?;
            }
            s
        }
        _ => bail!("GGUF {key} is not an array of at most 4 integers"),
    };
    if sections.iter().any(|&s| !(0..=4096).contains(&s)) {
        bail!("GGUF {key} = {sections:?} is out of range");
    }
    let all: i64 = sections.iter().sum();
    if all == 0 {
        bail!("GGUF {key} = {sections:?} gives no pair a section");
    }
    // ggml's `ggml_mrope_cache_init` for the interleaved kind: pair i's sector is i mod the
    // sections' sum; sectors ≡ 1, 2, 0 (mod 3) below 3 × the section's size take the second,
    // third and first position; every other sector the fourth.
    for i in 0..(rope_dim / 2) as i64 {
        let sector = i % all;
        let first_three = (sector % 3 == 1 && sector < 3 * sections[1])
            || (sector % 3 == 2 && sector < 3 * sections[2])
            || (sector % 3 == 0 && sector < 3 * sections[0]);
        if !first_three {
            bail!("GGUF {key} = {sections:?} rotates pair {i} by a fourth position (images' or video's): kvchat runs text only, where it would stay at 0 — this rotation is not supported");
        }
    }
    Ok(())
}
