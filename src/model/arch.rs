//! The architectures kvchat runs, one row each ([`ARCHS`]): which optional pieces its decoder
//! blocks use (as llama.cpp's `llm_build_*` for it) and which layouts it is read from. One
//! decoder (`model::decoder`) grows by configuration; a new architecture is a row here, and
//! every list of supported names derives from the table.

/// The FFN's gate activation: the kernel's own enum (`kernels::glu`), one list of them.
pub use super::kernels::glu::Gate as Activation;

/// One architecture: its name, the pieces of its blocks, and the layouts it is read from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arch {
    /// `general.architecture` in GGUF (and `model_type` in an HF config.json).
    pub name: &'static str,
    pub pieces: Pieces,
    /// The HF (safetensors) layout's model class, where kvchat reads and writes that layout
    /// (`Config::from_hf_json`, `export::gguf_to_hf`); None: GGUF only (its extra norms or
    /// tensors have no HF-layout loader here).
    pub hf_class: Option<&'static str>,
}

/// The optional pieces of a decoder block (an architecture's row says which it uses).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pieces {
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
    /// Beside the routed experts, a shared expert every token runs, the experts' widths falling
    /// back on the dense FFN's, softmax gating only (Qwen3.5 MoE, as llama.cpp).
    pub shared_expert: bool,
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
    /// Layers may differ in shape (gemma4): each layer's KV heads and FFN width, and the
    /// sliding-window layers' head size and rotated dimensions (`Config::layers`).
    pub layer_shapes: bool,
    /// The last `attention.shared_kv_layers` layers read an earlier layer's keys and values
    /// (gemma4: `LayerShapes::shared_kv`).
    pub shared_kv: bool,
    /// Per-layer token embeddings (`embedding_length_per_layer_input`: gemma4 E2B/E4B).
    pub per_layer_embd: bool,
    /// A mixture of experts beside each dense FFN where the file has `expert_count` (gemma4
    /// 26B-A4B).
    pub experts_beside: bool,
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
    /// 1/√head_dim, but 1/√(hidden / heads) for the 62-layer model (Gemma 3 27B, as llama.cpp:
    /// its query_pre_attn_scalar, which the GGUF does not state).
    Gemma3,
}

impl AttnScale {
    /// The factor for a model of these sizes.
    pub fn factor(self, n_layer: usize, hidden: usize, n_head: usize, head_dim: usize) -> f32 {
        match self {
            AttnScale::Gemma3 if n_layer == 62 => 1.0 / ((hidden / n_head.max(1)) as f32).sqrt(),
            AttnScale::One => 1.0,
            AttnScale::HeadDim | AttnScale::Gemma3 => 1.0 / (head_dim as f32).sqrt(),
        }
    }
}

/// A block with none of the optional pieces (llama's).
const PLAIN: Pieces = Pieces {
    qk_norm: false,
    post_norms: false,
    embed_scale: false,
    act: Activation::Silu,
    neox_rope: false,
    ffn_norm: "ffn_norm",
    attn_sinks: false,
    moe: false,
    shared_expert: false,
    v_norm: false,
    out_scale: false,
    q_gate: false,
    delta_net: false,
    swa: Swa::None,
    attn_scale: AttnScale::HeadDim,
    layer_shapes: false,
    shared_kv: false,
    per_layer_embd: false,
    experts_beside: false,
    softcap: None,
};

/// Qwen3.5: attention layers between Gated DeltaNet ones (`Config::recurrent`).
const QWEN35: Pieces = Pieces {
    qk_norm: true,
    neox_rope: true,
    ffn_norm: "post_attention_norm",
    q_gate: true,
    delta_net: true,
    ..PLAIN
};

/// Gemma 3 and 4's common pieces: q/k norms, post norms, scaled embeddings, GeGLU, NEOX rotation.
const GEMMA: Pieces = Pieces {
    qk_norm: true,
    post_norms: true,
    embed_scale: true,
    act: Activation::GeluTanh,
    neox_rope: true,
    ..PLAIN
};

/// The table.
pub const ARCHS: &[Arch] = &[
    Arch {
        name: "llama",
        pieces: PLAIN,
        hf_class: Some("LlamaForCausalLM"),
    },
    Arch {
        name: "mistral",
        pieces: PLAIN,
        hf_class: Some("MistralForCausalLM"),
    },
    Arch {
        name: "qwen2",
        pieces: Pieces {
            neox_rope: true,
            ..PLAIN
        },
        hf_class: Some("Qwen2ForCausalLM"),
    },
    Arch {
        name: "qwen3",
        pieces: Pieces {
            qk_norm: true,
            neox_rope: true,
            ..PLAIN
        },
        hf_class: None,
    },
    Arch {
        name: "gemma3",
        pieces: Pieces {
            swa: Swa::Pattern {
                window_optional: true,
            },
            attn_scale: AttnScale::Gemma3,
            softcap: Some(0.0),
            ..GEMMA
        },
        hf_class: None,
    },
    Arch {
        name: "gemma4",
        pieces: Pieces {
            v_norm: true,
            out_scale: true,
            swa: Swa::Pattern {
                window_optional: false,
            },
            attn_scale: AttnScale::One,
            layer_shapes: true,
            shared_kv: true,
            per_layer_embd: true,
            experts_beside: true,
            softcap: Some(30.0),
            ..GEMMA
        },
        hf_class: None,
    },
    Arch {
        name: "gpt-oss",
        pieces: Pieces {
            act: Activation::SwigluOai,
            neox_rope: true,
            ffn_norm: "post_attention_norm",
            attn_sinks: true,
            moe: true,
            swa: Swa::Alternate,
            ..PLAIN
        },
        hf_class: None,
    },
    Arch {
        name: "qwen35",
        pieces: QWEN35,
        hf_class: None,
    },
    Arch {
        name: "qwen35moe",
        pieces: Pieces {
            moe: true,
            shared_expert: true,
            ..QWEN35
        },
        hf_class: None,
    },
];

/// The row of `name`, if kvchat runs it.
pub fn find(name: &str) -> Option<&'static Arch> {
    ARCHS.iter().find(|a| a.name == name)
}

/// The names of the rows that `keep` keeps, in the table's order.
pub fn names_where(keep: impl Fn(&Arch) -> bool) -> Vec<&'static str> {
    ARCHS.iter().filter(|a| keep(a)).map(|a| a.name).collect()
}

/// Every architecture's name, in the table's order.
pub fn names() -> Vec<&'static str> {
    names_where(|_| true)
}

/// The names of those read from the HF (safetensors) layout.
pub fn hf_names() -> Vec<&'static str> {
    names_where(|a| a.hf_class.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_one_row() {
        let mut names = names();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ARCHS.len());
    }

    #[test]
    fn pieces_read_only_beside_per_layer_shapes_come_with_them() {
        // config/gguf.rs reads shared_kv_layers where a row has layer_shapes.
        for a in ARCHS {
            assert!(!a.pieces.shared_kv || a.pieces.layer_shapes, "{}", a.name);
        }
    }

    #[test]
    fn the_hf_layout_is_read_for_llama_mistral_and_qwen2() {
        assert_eq!(hf_names(), ["llama", "mistral", "qwen2"]);
        assert_eq!(find("qwen2").unwrap().hf_class, Some("Qwen2ForCausalLM"));
    }

    #[test]
    fn the_gemma3_27b_scale_is_by_hidden_over_heads() {
        // Gemma 3 27B: 62 layers, hidden 5376, 32 heads of 128 (5376 / 32 = 168).
        let s = AttnScale::Gemma3;
        assert_eq!(s.factor(62, 5376, 32, 128), 1.0 / 168f32.sqrt());
        assert_eq!(s.factor(26, 640, 4, 256), 1.0 / 16.0);
    }
}
