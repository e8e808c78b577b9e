//! Hyperparameters of a llama-family decoder, read once at load from GGUF metadata (or, later, config.json).

use super::layers::LayerMap;
use anyhow::Result;

mod gguf;
mod hf;
mod validate;

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (x0, x1), (x2, x3), …: llama.cpp's "normal" mode, used by GGUF `llama` files.
    Interleaved,
    /// Pairs (x_i, x_{i + d/2}): HF's `rotate_half`, and llama.cpp's NEOX mode (`qwen2`).
    HalfSplit,
}

pub use super::arch::{Activation, AttnScale, Pieces, Swa};

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
    /// Which optional pieces the blocks use (the architecture's row of `arch::ARCHS`).
    pub pieces: Pieces,
    /// YaRN scaling of the rotation, when the file asks for it (then `rope_linear_scale` is 1).
    pub yarn: Option<Yarn>,
    /// The experts of a mixture-of-experts FFN (`pieces.moe`).
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
}

/// A config with `nkv` KV heads of `hd` values, for unit tests.
#[cfg(test)]
pub(crate) fn test_config(nkv: usize, hd: usize) -> Config {
    let mut cfg = Config {
        arch: "llama".into(),
        n_layer: 1,
        n_head: nkv,
        n_kv_head: nkv,
        head_dim: hd,
        hidden: nkv * hd,
        ffn: 2,
        vocab: 2,
        ctx_train: 4096,
        rope_base: 10_000.0,
        rope_dim: hd,
        rope_linear_scale: 1.0,
        rope_style: RopeStyle::Interleaved,
        rms_eps: 1e-5,
        sliding_window: None,
        rope_base_local: None,
        attn_scale: 0.125,
        pieces: crate::model::arch::find("llama").unwrap().pieces,
        yarn: None,
        experts: None,
        layers: None,
        per_layer_embd: 0,
        final_softcap: None,
        recurrent: None,
        layer_map: Default::default(),
    };
    cfg.remap();
    cfg
}

#[cfg(test)]
mod tests;
