//! Hyperparameters of a llama-family decoder, read once at load from GGUF metadata (or, later, config.json).

use super::layers::LayerMap;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (x0, x1), (x2, x3), …: llama.cpp's "normal" mode, used by GGUF `llama` files.
    Interleaved,
    /// Pairs (x_i, x_{i + d/2}): HF's `rotate_half`, and llama.cpp's NEOX mode (`qwen2`).
    HalfSplit,
}

/// The largest count or size kvchat takes from a file's metadata (2^31): anything larger is a damaged
/// or hostile file, not a model.
const MAX_DIM: u64 = 1 << 31;

/// Architectures whose decoder is the one in `model::decoder` (each a row of [`Block::of`]).
pub const SUPPORTED_ARCHS: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "gemma4",
    "gpt-oss",
    "qwen35",
    "qwen35moe",
];

/// The FFN's gate activation: the kernel's own enum (`kernels::glu`), one list of them.
pub use super::kernels::glu::Gate as Activation;

/// The optional pieces of a decoder block. One decoder grows by configuration: each architecture
/// is a row of [`Block::of`], saying which pieces it uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Block {
    /// Per-head RMSNorm of q and k (weights `attn_q_norm`, `attn_k_norm`) before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before each residual add (`post_attention_norm`,
    /// `post_ffw_norm`).
    pub post_norms: bool,
    /// The embeddings are multiplied by √hidden.
    pub embed_scale: bool,
    pub act: Activation,
    /// RoPE pairs dimensions (x_i, x_{i+d/2}) in GGUF files (llama.cpp's NEOX mode).
    pub neox_rope: bool,
    /// The name of the FFN's input norm (`ffn_norm`; gpt-oss: `post_attention_norm`).
    pub ffn_norm: &'static str,
    /// A learned logit per query head joins every softmax, with no value (`attn_sinks`: gpt-oss).
    pub attn_sinks: bool,
    /// The FFN is a mixture of experts with a router (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`:
    /// gpt-oss), instead of one gate/up/down.
    pub moe: bool,
    /// Values are RMS-normed without a weight after their projection, and a layer without
    /// `attn_v` uses its keys' projection (before `attn_k_norm`) as values (gemma4).
    pub v_norm: bool,
    /// Each block's output is multiplied by a learned scalar (`layer_output_scale`: gemma4).
    pub out_scale: bool,
    /// The q projection gives each head its queries and, beside them, a gate on its output:
    /// attention's output × sigmoid(gate) before `attn_output` (qwen35).
    pub q_gate: bool,
    /// Some layers are Gated DeltaNet layers with a recurrent state (`ssm.*` keys:
    /// `Config::recurrent`, qwen35).
    pub delta_net: bool,
    /// Which layers attend within a sliding window (`attention.sliding_window`), and the
    /// rotation those layers use.
    pub swa: Swa,
    /// What the attention scores are scaled by.
    pub attn_scale: AttnScale,
    /// Layers may differ in shape and carry extra inputs (gemma4): each layer's KV heads and
    /// FFN width, the local layers' head size, KV shared from earlier layers, per-layer token
    /// embeddings, and experts beside the dense FFN when the file has them.
    pub layer_shapes: bool,
    /// The logits pass through c·tanh(x / c), c the file's `final_logit_softcapping`, else this
    /// default (llama.cpp's: 0 for gemma3, 30 for gemma4); a c of 0 is none. None: the key is
    /// not read.
    pub softcap: Option<f32>,
}

/// Which layers attend within a sliding window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Swa {
    /// None: every layer attends to the whole sequence.
    None,
    /// Every other layer, starting with the first, at the global layers' rotation (llama.cpp's
    /// swa pattern 2: gpt-oss).
    Alternate,
    /// The file's `attention.sliding_window_pattern` (flags per layer, or every n-th layer
    /// global), else five local layers for every global one (llama.cpp's swa pattern 6: layer i
    /// is global when i % 6 == 5); the local layers rotate with the file's `rope.freq_base_swa`,
    /// else base 10,000 (llama.cpp's rope_freq_base_train_swa). A file without
    /// `attention.sliding_window` attends globally on every layer where `window_optional`
    /// (llama.cpp's gemma3); elsewhere it is refused.
    Pattern { window_optional: bool },
}

/// The factor on q·k.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttnScale {
    /// 1/√head_dim.
    HeadDim,
    /// 1 (gemma4 norms q instead: llama.cpp's f_attention_scale).
    One,
    /// 1/√head_dim, but 1/√(hidden / heads) for the 62-layer model (Gemma 3 27B, as llama.cpp).
    Gemma3,
}

impl Block {
    /// The table: which pieces each architecture uses (as llama.cpp's `llm_build_*` for it).
    pub fn of(arch: &str) -> Option<Self> {
        let plain = Block {
            qk_norm: false,
            post_norms: false,
            embed_scale: false,
            act: Activation::Silu,
            neox_rope: false,
            ffn_norm: "ffn_norm",
            attn_sinks: false,
            moe: false,
            v_norm: false,
            out_scale: false,
            q_gate: false,
            delta_net: false,
            swa: Swa::None,
            attn_scale: AttnScale::HeadDim,
            layer_shapes: false,
            softcap: None,
        };
        Some(match arch {
            "llama" | "mistral" => plain,
            "qwen2" => Block {
                neox_rope: true,
                ..plain
            },
            "qwen3" => Block {
                qk_norm: true,
                neox_rope: true,
                ..plain
            },
            "gemma3" => Block {
                qk_norm: true,
                post_norms: true,
                embed_scale: true,
                act: Activation::GeluTanh,
                neox_rope: true,
                swa: Swa::Pattern {
                    window_optional: true,
                },
                attn_scale: AttnScale::Gemma3,
                softcap: Some(0.0),
                ..plain
            },
            "gemma4" => Block {
                qk_norm: true,
                post_norms: true,
                embed_scale: true,
                act: Activation::GeluTanh,
                neox_rope: true,
                v_norm: true,
                out_scale: true,
                swa: Swa::Pattern {
                    window_optional: false,
                },
                attn_scale: AttnScale::One,
                layer_shapes: true,
                softcap: Some(30.0),
                ..plain
            },
            "gpt-oss" => Block {
                act: Activation::SwigluOai,
                neox_rope: true,
                ffn_norm: "post_attention_norm",
                attn_sinks: true,
                moe: true,
                swa: Swa::Alternate,
                ..plain
            },
            // Attention layers between Gated DeltaNet ones (`Config::recurrent`); the MoE models'
            // FFN a mixture of experts with a shared expert beside it.
            "qwen35" | "qwen35moe" => Block {
                qk_norm: true,
                neox_rope: true,
                ffn_norm: "post_attention_norm",
                q_gate: true,
                delta_net: true,
                moe: arch == "qwen35moe",
                ..plain
            },
            _ => return None,
        })
    }
}

/// YaRN's rotation (gpt-oss): frequencies between interpolation (positions ÷ `factor`) and
/// extrapolation, by a ramp over the dimensions whose wavelengths fit the original context
/// between `beta_slow` and `beta_fast` turns; cos and sin scaled by 1 + 0.1·ln(factor). As
/// ggml's `rope_yarn` with llama.cpp's defaults (ext_factor 1, attn_factor 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// A mixture-of-experts FFN's sizes: `count` experts of `ffn` rows each, `used` per token, and
/// (Qwen3.5 MoE) a shared expert of `shared` rows that every token runs (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    pub count: usize,
    pub used: usize,
    pub ffn: usize,
    pub shared: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// Context length the model was trained with.
    pub ctx_train: usize,
    pub rope_base: f32,
    /// Number of dimensions of each head that are rotated (the rest pass through).
    pub rope_dim: usize,
    /// Linear RoPE scaling: positions are divided by this factor (1.0 = none).
    pub rope_linear_scale: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f64,
    /// A sliding window some layers attend within (Gemma 3's local layers): its width, and for
    /// each layer whether it is one of them. None: every layer attends to the whole sequence.
    pub sliding_window: Option<(usize, Vec<bool>)>,
    /// The RoPE base of the sliding-window layers, when it differs from `rope_base` (Gemma 3's
    /// local layers: 10,000 against the global layers' 1,000,000; and no linear scaling).
    pub rope_base_local: Option<f32>,
    /// Scores are q·k × this (1/√head_dim but for Gemma 3 27B).
    pub attn_scale: f32,
    /// Which optional pieces the blocks use.
    pub block: Block,
    /// YaRN scaling of the rotation, when the file asks for it (then `rope_linear_scale` is 1).
    pub yarn: Option<Yarn>,
    /// The experts of a mixture-of-experts FFN (`block.moe`).
    pub experts: Option<Experts>,
    /// Where layers differ in shape (Gemma 4): the sliding-window layers' head size and rotated
    /// dimensions, each layer's KV heads and FFN width, and how many last layers read an earlier
    /// layer's keys and values instead of keeping their own. None: every layer as above.
    pub layers: Option<LayerShapes>,
    /// Per-layer token embeddings of this width (Gemma 4 E2B/E4B's `per_layer_token_embd`); 0: none.
    pub per_layer_embd: usize,
    /// Logits pass through c·tanh(x / c) (Gemma's `final_logit_softcapping`: `Block::softcap`).
    pub final_softcap: Option<f32>,
    /// Layers whose mixer is a Gated DeltaNet with a recurrent state instead of attention
    /// (Qwen3.5), and the state's sizes. None: every layer attends.
    pub recurrent: Option<Recurrent>,
    /// Which memory each block reads, built from the fields above by [`Config::remap`] (every
    /// constructor's last step): the one conversion between block, KV-layer and state numbers.
    pub(crate) layer_map: LayerMap,
}

/// Qwen3.5's Gated DeltaNet layers (llama.cpp's `ssm.*` keys): a short causal convolution over
/// the q, k and v channels (`conv` taps; its state the last `conv − 1` inputs), then per value
/// head a `head_dim × head_dim` state matrix S updated by the delta rule at every token:
/// S ← S·exp(g); S ← S + k ⊗ β(v − Sᵀk); out = Sᵀq / √head_dim.
#[derive(Debug, Clone, PartialEq)]
pub struct Recurrent {
    /// For each layer, whether it is a Gated DeltaNet layer (the rest attend).
    pub layers: Vec<bool>,
    /// Convolution taps (`ssm.conv_kernel`).
    pub conv: usize,
    /// Key heads (`ssm.group_count`); value head h reads key head h mod `k_heads`.
    pub k_heads: usize,
    /// Value heads (`ssm.time_step_rank`), each with a state of its own.
    pub v_heads: usize,
    /// Size of a key and of a value head (`ssm.state_size`).
    pub head_dim: usize,
}

impl Recurrent {
    /// Width of the keys (and of the queries).
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.head_dim
    }
    /// Width of the values (`ssm.inner_size`).
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.head_dim
    }
    /// Channels the convolution runs over: q, k and v side by side.
    pub fn channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// f32 values of one layer's convolution state: the last `conv − 1` inputs of each channel.
    pub fn conv_floats(&self) -> usize {
        (self.conv - 1) * self.channels()
    }
    /// f32 values of one layer's delta-rule state: a `head_dim²` matrix per value head.
    pub fn matrix_floats(&self) -> usize {
        self.v_heads * self.head_dim * self.head_dim
    }
    /// Bytes of one layer's whole state (f32), whatever the sequence's length.
    pub fn layer_bytes(&self) -> usize {
        4 * (self.conv_floats() + self.matrix_floats())
    }
    /// How many layers keep a recurrent state.
    pub fn count(&self) -> usize {
        self.layers.iter().filter(|&&r| r).count()
    }
}

/// How layers differ in shape (Gemma 4). Each vector has one entry per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerShapes {
    /// Head size of the sliding-window layers (`attention.key_length_swa`); the others have
    /// `Config::head_dim`.
    pub head_dim_local: usize,
    /// Dimensions rotated on the sliding-window layers (`rope.dimension_count_swa`).
    pub rope_dim_local: usize,
    pub kv_heads: Vec<usize>,
    pub ffn: Vec<usize>,
    /// The last `shared_kv` layers keep no keys and values: each attends over those of the last
    /// earlier layer of its kind (window or global), as llama.cpp's `n_layer_kv_from_start`.
    pub shared_kv: usize,
}

impl Config {
    /// The model's declared sliding window and how many layers attend within it, if it has one.
    pub fn window_layers(&self) -> Option<(usize, usize)> {
        let (w, layers) = self.sliding_window.as_ref()?;
        Some((*w, layers.iter().filter(|&&l| l).count()))
    }

    /// The window layer `i` attends within, if the model declares one for it: the cache need
    /// keep no more than that on this layer.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let (w, layers) = self.sliding_window.as_ref()?;
        layers.get(i).copied().unwrap_or(false).then_some(*w)
    }

    /// Layer `i`'s KV heads and head size.
    pub fn layer_kv_shape(&self, i: usize) -> (usize, usize) {
        match &self.layers {
            Some(l) => {
                let hd = match self.layer_window(i) {
                    Some(_) => l.head_dim_local,
                    None => self.head_dim,
                };
                (l.kv_heads[i], hd)
            }
            None => (self.n_kv_head, self.head_dim),
        }
    }

    /// Layer `i`'s FFN width.
    pub fn layer_ffn(&self, i: usize) -> usize {
        self.layers.as_ref().map_or(self.ffn, |l| l.ffn[i])
    }

    /// Rebuilds the layer map: every constructor's last step; call it after changing
    /// `n_layer`, `recurrent`, `layers` or `sliding_window` by hand.
    pub fn remap(&mut self) {
        self.layer_map = LayerMap::of(self);
    }

    /// The map of blocks to KV layers and states.
    pub fn layer_map(&self) -> &LayerMap {
        &self.layer_map
    }

    /// Checks the numbers, builds the layer map, checks what depends on it: what every
    /// constructor ends with.
    pub(crate) fn finish(mut self) -> Result<Self> {
        // (A layer count beyond any real model's is refused before a map of it is made.)
        self.validate_sizes()?;
        self.remap();
        self.validate()?;
        Ok(self)
    }

    /// Whether layer `i` keeps a recurrent state instead of attending (Qwen3.5's DeltaNet layers).
    pub fn is_recurrent(&self, i: usize) -> bool {
        self.layer_map.is_recurrent(i)
    }

    /// Whether layer `i` keeps keys and values of its own: an attention layer that shares no
    /// earlier layer's (Gemma 4's last `shared_kv` layers do).
    pub fn own_kv(&self, i: usize) -> bool {
        self.layer_map.own_kv(i)
    }

    /// How many layers keep keys and values of their own: the KV cache's layers.
    pub fn kv_layers(&self) -> usize {
        self.layer_map.kv_layers()
    }

    /// The block whose keys and values the KV cache's layer `c` holds.
    pub fn kv_block(&self, c: usize) -> usize {
        self.layer_map.kv_block(c)
    }

    /// KV layer `c`'s heads and head size (those of the block it holds).
    pub fn kv_shape(&self, c: usize) -> (usize, usize) {
        self.layer_kv_shape(self.kv_block(c))
    }

    /// Every KV layer's heads and head size, in order.
    pub fn kv_shapes(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.layer_map
            .kv_blocks()
            .iter()
            .map(|&i| self.layer_kv_shape(i))
    }

    /// The KV cache layer that attention block `i` attends over: its own, or for a shared block
    /// llama.cpp's choice for Gemma 4 (`LayerMap::new`).
    pub fn kv_source(&self, i: usize) -> usize {
        self.layer_map
            .kv_source(i)
            .expect("kv_source of an attention block")
    }

    /// The recurrent state of DeltaNet block `i`.
    pub fn state_index(&self, i: usize) -> usize {
        self.layer_map
            .state_index(i)
            .expect("state_index of a DeltaNet block")
    }

    /// Reads the hyperparameters from GGUF metadata (`{arch}.block_count`, …).
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let md = &ct.metadata;
        let arch = md
            .get("general.architecture")
            .context("GGUF has no general.architecture")?
            .to_string()?
            .clone();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            bail!(
                "unsupported model architecture '{arch}' (supported: {})",
                SUPPORTED_ARCHS.join(", ")
            );
        }
        let block = Block::of(&arch).expect("checked against SUPPORTED_ARCHS");
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
        let beside = block.layer_shapes && md.contains_key(&format!("{arch}.expert_count"));
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
            let (expert_ffn, shared) = match arch == "qwen35moe" {
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
        if arch == "qwen35moe" {
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
        let attn_scale = match block.attn_scale {
            AttnScale::Gemma3 if n_layer == 62 => 1.0 / ((hidden / n_head.max(1)) as f32).sqrt(),
            AttnScale::One => 1.0,
            AttnScale::HeadDim | AttnScale::Gemma3 => 1.0 / (head_dim as f32).sqrt(),
        };
        let uniform = kv_heads.iter().all(|&k| k == n_kv_head) && ffns.iter().all(|&f| f == ffn);
        let layers = if block.layer_shapes {
            Some(LayerShapes {
                head_dim_local: opt_u("attention.key_length_swa")?.unwrap_or(head_dim),
                rope_dim_local: opt_u("rope.dimension_count_swa")?.unwrap_or(rope_dim),
                kv_heads,
                ffn: ffns,
                shared_kv: opt_u("attention.shared_kv_layers")?.unwrap_or(0),
            })
        } else if !uniform {
            bail!(
                "GGUF {arch}: layers of different KV heads or FFN widths are read for gemma4 only"
            );
        } else {
            None
        };
        let per_layer_embd = match block.layer_shapes {
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
            block,
            yarn,
            experts,
            layers,
            per_layer_embd,
            final_softcap,
            layer_map: LayerMap::default(),
        };
        cfg.finish()
    }

    /// Reads the hyperparameters from a Hugging Face `config.json`. HF checkpoints keep Q/K rows in
    /// the half-split rotary order (`rotate_half`), whatever the architecture.
    pub fn from_hf_json(json: &serde_json::Value) -> Result<Self> {
        let arch = json
            .get("model_type")
            .and_then(|v| v.as_str())
            .context("config.json has no model_type")?
            .to_string();
        const HF_ARCHS: &[&str] = &["llama", "mistral", "qwen2"];
        if !HF_ARCHS.contains(&arch.as_str()) {
            bail!(
                "unsupported model_type '{arch}' in config.json (supported in the safetensors layout: {}; qwen3 and gemma3 run from GGUF)",
                HF_ARCHS.join(", ")
            );
        }
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
            block: Block::of(&arch).expect("a supported arch"),
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

    /// Gemma 4's per-layer shapes: sizes in range, and each shared layer's source of its own
    /// kind and shape.
    fn validate_recurrent(&self, r: &Recurrent) -> Result<()> {
        if r.layers.len() != self.n_layer {
            bail!(
                "recurrent layer flags for {} layers in a model of {}",
                r.layers.len(),
                self.n_layer
            );
        }
        if self.kv_layers() == 0 {
            bail!(
                "model has no attention layer: every layer is recurrent, which kvchat does not run"
            );
        }
        if !(2..=64).contains(&r.conv) {
            bail!(
                "model ssm.conv_kernel = {} is not usable (2 to 64 taps)",
                r.conv
            );
        }
        if r.head_dim == 0 || r.head_dim > 1024 || r.k_heads == 0 || r.v_heads > 4096 {
            bail!(
                "model ssm.state_size = {}, ssm.group_count = {} is not usable (heads of 1 to 1024 values, at least one key head)",
                r.head_dim,
                r.k_heads
            );
        }
        if r.v_heads == 0 || !r.v_heads.is_multiple_of(r.k_heads) {
            bail!(
                "model ssm.time_step_rank = {} value heads are not a multiple of ssm.group_count = {} key heads",
                r.v_heads,
                r.k_heads
            );
        }
        Ok(())
    }

    fn validate_layers(&self, l: &LayerShapes) -> Result<()> {
        let (hl, rl) = (l.head_dim_local, l.rope_dim_local);
        if hl == 0 || hl > 4096 || rl == 0 || rl > hl || !rl.is_multiple_of(2) {
            bail!(
                "sliding-window layers' head size {hl} with {rl} rotated dimensions is not usable"
            );
        }
        for (i, (&k, &f)) in l.kv_heads.iter().zip(&l.ffn).enumerate() {
            if k == 0 || k > 4096 || !self.n_head.is_multiple_of(k) {
                bail!(
                    "layer {i}'s head_count_kv = {k} does not divide its {} attention heads",
                    self.n_head
                );
            }
            if f == 0 || f > 1 << 20 {
                bail!("layer {i}'s feed_forward_length = {f} is out of range");
            }
        }
        if l.shared_kv == 0 {
            return Ok(());
        }
        let own = self
            .n_layer
            .checked_sub(l.shared_kv)
            .filter(|&own| own >= 2);
        let Some(own) = own else {
            bail!(
                "GGUF {}.attention.shared_kv_layers = {} leaves fewer than 2 of {} layers with KV of their own",
                self.arch,
                l.shared_kv,
                self.n_layer
            );
        };
        for i in own..self.n_layer {
            let s = self.kv_block(self.kv_source(i));
            let kind = |l: usize| self.layer_window(l).is_some();
            if kind(s) != kind(i) || self.layer_kv_shape(s) != self.layer_kv_shape(i) {
                bail!(
                    "layer {i} shares the keys and values of layer {s} (GGUF {}.attention.shared_kv_layers = {}), which is not of its kind and shape",
                    self.arch,
                    l.shared_kv
                );
            }
        }
        Ok(())
    }

    /// The counts and sizes in range (what a layer map may be built from).
    fn validate_sizes(&self) -> Result<()> {
        if self.n_layer == 0 || self.n_head == 0 || self.n_kv_head == 0 || self.head_dim == 0 {
            bail!(
                "model has zero layers, heads or head size ({} layers, {} heads, {} KV heads, head size {})",
                self.n_layer,
                self.n_head,
                self.n_kv_head,
                self.head_dim
            );
        }
        // Limits far above any real model: a file beyond them is damaged, and taking it on trust
        // would mean allocations that abort.
        for (name, v, max) in [
            ("block_count", self.n_layer, 4096),
            ("head_count", self.n_head, 4096),
            ("head_count_kv", self.n_kv_head, 4096),
            ("head size", self.head_dim, 4096),
            ("embedding_length", self.hidden, 1 << 17),
            ("feed_forward_length", self.ffn, 1 << 20),
            ("vocabulary", self.vocab, 1 << 23),
            ("context_length", self.ctx_train, 1 << 26),
        ] {
            if v > max {
                bail!("model {name} = {v} is beyond any real model's (at most {max}); the file is damaged");
            }
        }
        Ok(())
    }

    /// Checks a config as a whole: sizes, shapes and the layer map's sense. Each constructor
    /// calls it (through `finish`); call it again after changing a config by hand.
    pub fn validate(&self) -> Result<()> {
        self.validate_sizes()?;
        // A mixture of experts has no dense FFN: its width may be 0 (`Experts` has the sizes).
        if self.hidden == 0 || (self.ffn == 0 && !self.block.moe) || self.vocab == 0 {
            bail!(
                "model has a zero embedding, feed-forward or vocabulary size ({}, {}, {})",
                self.hidden,
                self.ffn,
                self.vocab
            );
        }
        if self.rope_dim == 0 {
            bail!("RoPE dimension is 0");
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            bail!("RoPE base {} is not a positive number", self.rope_base);
        }
        if let Some((w, layers)) = &self.sliding_window {
            if *w == 0 || layers.len() != self.n_layer {
                bail!(
                    "sliding window of {w} over {} of {} layers is not a usable pattern",
                    layers.len(),
                    self.n_layer
                );
            }
        }
        if let Some(y) = &self.yarn {
            if !(y.factor.is_finite() && y.factor >= 1.0) || y.orig_ctx == 0 {
                bail!(
                    "YaRN scaling factor {} over an original context of {} is not usable (factor ≥ 1, context > 0)",
                    y.factor,
                    y.orig_ctx
                );
            }
        }
        if let Some(e) = &self.experts {
            if e.count == 0 || e.used == 0 || e.used > e.count || e.count > 4096 {
                bail!(
                    "model expert_count = {} with expert_used_count = {} is not usable (1 ≤ used ≤ count ≤ 4096)",
                    e.count,
                    e.used
                );
            }
            if e.ffn == 0 || e.ffn > 1 << 20 {
                bail!(
                    "model expert_feed_forward_length = {} is out of range",
                    e.ffn
                );
            }
        }
        if let Some(l) = &self.layers {
            self.validate_layers(l)?;
        }
        if let Some(r) = &self.recurrent {
            self.validate_recurrent(r)?;
        }
        if let Some(c) = self.final_softcap {
            if !(c.is_finite() && c > 0.0) {
                bail!("model final_logit_softcapping = {c} is not a positive number");
            }
        }
        if self.per_layer_embd > 1 << 16 {
            bail!(
                "model embedding_length_per_layer_input = {} is out of range",
                self.per_layer_embd
            );
        }
        if !(self.rope_linear_scale.is_finite() && self.rope_linear_scale > 0.0) {
            bail!(
                "RoPE scaling factor {} is not a positive number",
                self.rope_linear_scale
            );
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            bail!("RMSNorm epsilon {} is not in (0, 1)", self.rms_eps);
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            bail!(
                "{} attention heads are not a multiple of {} KV heads",
                self.n_head,
                self.n_kv_head
            );
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            bail!(
                "RoPE dimension {} does not fit head size {}",
                self.rope_dim,
                self.head_dim
            );
        }
        Ok(())
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

#[cfg(test)]
mod tests;
