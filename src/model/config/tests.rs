//! GGUF metadata read as llama.cpp's `load_hparams` reads it: a key it reads as optional
//! may be absent, and then holds llama.cpp's default; a key it needs is refused by name.

use super::*;
use candle_core::quantized::gguf_file;
use gguf_file::Value as V;
use std::collections::HashMap;

/// The metadata of a small model of `arch` that loads: every key llama.cpp needs for it, and
/// every optional key of [`OPTIONAL`] at a value other than its default.
fn sound(arch: &str) -> HashMap<String, V> {
    let s = |v: &str| V::String(v.into());
    let mut kv: Vec<(&str, V)> = vec![
        ("block_count", V::U32(8)),
        ("context_length", V::U32(131_072)),
        ("embedding_length", V::U32(256)),
        ("feed_forward_length", V::U32(512)),
        ("attention.head_count", V::U32(4)),
        ("attention.head_count_kv", V::U32(2)),
        ("attention.key_length", V::U32(128)),
        ("attention.value_length", V::U32(128)),
        ("attention.layer_norm_rms_epsilon", V::F32(1e-6)),
        ("rope.freq_base", V::F32(500_000.0)),
        ("rope.dimension_count", V::U32(64)),
        ("vocab_size", V::U32(1000)),
    ];
    let delta_net = || {
        vec![
            ("ssm.conv_kernel", V::U32(4)),
            ("ssm.state_size", V::U32(32)),
            ("ssm.group_count", V::U32(2)),
            ("ssm.time_step_rank", V::U32(4)),
            ("ssm.inner_size", V::U32(128)),
            ("full_attention_interval", V::U32(2)),
            (
                "rope.dimension_sections",
                V::Array([11, 11, 10, 0].map(V::I32).to_vec()),
            ),
        ]
    };
    kv.extend(match arch {
        "llama" => vec![
            ("rope.scaling.type", s("none")),
            ("rope.scaling.factor", V::F32(2.0)),
        ],
        "mistral" => vec![
            ("rope.scaling.type", s("linear")),
            ("rope.scaling.factor", V::F32(2.0)),
        ],
        "gemma3" => vec![
            ("attention.sliding_window", V::U32(512)),
            ("attention.sliding_window_pattern", V::U32(4)),
            ("rope.freq_base_swa", V::F32(20_000.0)),
            ("final_logit_softcapping", V::F32(30.0)),
        ],
        "gemma4" => vec![
            ("attention.sliding_window", V::U32(512)),
            (
                "attention.sliding_window_pattern",
                V::Array([1, 1, 1, 1, 1, 0, 1, 0].map(|w| V::Bool(w == 1)).to_vec()),
            ),
            ("attention.key_length_swa", V::U32(64)),
            ("attention.value_length_swa", V::U32(64)),
            ("rope.dimension_count_swa", V::U32(32)),
            ("rope.freq_base_swa", V::F32(20_000.0)),
            ("attention.shared_kv_layers", V::U32(2)),
            ("embedding_length_per_layer_input", V::U32(32)),
            ("final_logit_softcapping", V::F32(50.0)),
        ],
        "gpt-oss" => vec![
            ("expert_count", V::U32(8)),
            ("expert_used_count", V::U32(2)),
            ("expert_feed_forward_length", V::U32(64)),
            ("attention.sliding_window", V::U32(128)),
            ("rope.scaling.type", s("yarn")),
            ("rope.scaling.factor", V::F32(32.0)),
            ("rope.scaling.original_context_length", V::U32(4096)),
        ],
        "qwen35" => delta_net(),
        "qwen35moe" => {
            let mut moe = delta_net();
            moe.extend([
                ("expert_count", V::U32(8)),
                ("expert_used_count", V::U32(2)),
                ("expert_feed_forward_length", V::U32(64)),
                ("expert_shared_feed_forward_length", V::U32(128)),
            ]);
            moe
        }
        _ => vec![],
    });
    let mut md: HashMap<String, V> = kv
        .into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect();
    md.insert("general.architecture".into(), s(arch));
    md
}

fn load(metadata: HashMap<String, V>) -> Result<Config> {
    Config::from_gguf(&gguf_file::Content {
        magic: gguf_file::VersionedMagic::GgufV3,
        metadata,
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    })
}

/// [`sound`] metadata of `arch` without `{arch}.{key}`.
fn without(arch: &str, key: &str) -> HashMap<String, V> {
    let mut md = sound(arch);
    let gone = md.remove(&format!("{arch}.{key}"));
    assert!(gone.is_some(), "the sound {arch} metadata has no {key}");
    md
}

// What kvchat read, as a number, for the table below.
type Read = fn(&Config) -> f64;
fn kv_heads(c: &Config) -> f64 {
    c.n_kv_head as f64
}
fn head_dim(c: &Config) -> f64 {
    c.head_dim as f64
}
fn rope_dim(c: &Config) -> f64 {
    c.rope_dim as f64
}
fn rope_base(c: &Config) -> f64 {
    c.rope_base as f64
}
fn linear_scale(c: &Config) -> f64 {
    c.rope_linear_scale as f64
}
fn yarn_factor(c: &Config) -> f64 {
    c.yarn.map_or(0.0, |y| y.factor as f64)
}
fn yarn_ctx(c: &Config) -> f64 {
    c.yarn.map_or(0.0, |y| y.orig_ctx as f64)
}
fn ffn(c: &Config) -> f64 {
    c.ffn as f64
}
fn expert_ffn(c: &Config) -> f64 {
    c.experts.map_or(0.0, |e| e.ffn as f64)
}
fn shared_ffn(c: &Config) -> f64 {
    c.experts.map_or(0.0, |e| e.shared as f64)
}
fn window_layers(c: &Config) -> f64 {
    c.window_layers().map_or(0, |(_, n)| n) as f64
}
fn local_base(c: &Config) -> f64 {
    c.rope_base_local.unwrap_or(0.0) as f64
}
fn softcap(c: &Config) -> f64 {
    c.final_softcap.unwrap_or(0.0) as f64
}
fn shared_kv(c: &Config) -> f64 {
    c.layers.as_ref().map_or(0.0, |l| l.shared_kv as f64)
}
fn rope_dim_local(c: &Config) -> f64 {
    c.layers.as_ref().map_or(0.0, |l| l.rope_dim_local as f64)
}
fn recurrent_layers(c: &Config) -> f64 {
    c.recurrent.as_ref().map_or(0, |r| r.count()) as f64
}

/// Keys llama.cpp reads as optional (`get_key(.., false)`): (architecture, "*" for every
/// supported one; key; what kvchat reads; llama.cpp's default). A file of that architecture
/// without the key loads, with the default.
#[rustfmt::skip]
const OPTIONAL: &[(&str, &str, Read, f64)] = &[
    // Read for every architecture at the top of llama.cpp's `load_hparams`.
    ("*",         "attention.head_count_kv",               kv_heads,         4.0), // head_count
    ("*",         "attention.key_length",                  head_dim,         64.0), // embedding ÷ heads
    ("*",         "rope.dimension_count",                  rope_dim,         128.0), // key_length
    ("*",         "rope.freq_base",                        rope_base,        10_000.0),
    // Scaling is linear (here by the file's factor, 2), by a factor of 1.
    ("llama",     "rope.scaling.type",                     linear_scale,     2.0),
    ("mistral",   "rope.scaling.factor",                   linear_scale,     1.0),
    ("gpt-oss",   "rope.scaling.type",                     linear_scale,     32.0),
    ("gpt-oss",   "rope.scaling.factor",                   yarn_factor,      1.0),
    ("gpt-oss",   "rope.scaling.original_context_length",  yarn_ctx,         131_072.0), // context_length
    // A mixture of experts has no dense FFN; Qwen3.5 MoE's experts fall back on its width.
    ("gpt-oss",   "feed_forward_length",                   ffn,              0.0),
    ("qwen35moe", "feed_forward_length",                   ffn,              0.0),
    ("qwen35moe", "expert_feed_forward_length",            expert_ffn,       256.0), // 512 ÷ 2 used
    ("qwen35moe", "expert_shared_feed_forward_length",     shared_ffn,       512.0), // feed_forward_length
    // Gemma: no window, no layer attends within one; else swa pattern 6 (Gemma 3).
    ("gemma3",    "attention.sliding_window",              window_layers,    0.0),
    ("gemma3",    "attention.sliding_window_pattern",      window_layers,    7.0),
    ("gemma3",    "rope.freq_base_swa",                    local_base,       10_000.0),
    ("gemma3",    "final_logit_softcapping",               softcap,          0.0),
    ("gemma4",    "final_logit_softcapping",               softcap,          30.0),
    ("gemma4",    "rope.freq_base_swa",                    local_base,       10_000.0),
    ("gemma4",    "attention.shared_kv_layers",            shared_kv,        0.0),
    ("gemma4",    "rope.dimension_count_swa",              rope_dim_local,   64.0), // rope.dimension_count
    // Every fourth layer attends.
    ("qwen35",    "full_attention_interval",               recurrent_layers, 6.0),
    ("qwen35moe", "full_attention_interval",               recurrent_layers, 6.0),
];

/// The architectures a row of a table names ("*": every supported one).
fn archs(arch: &'static str) -> Vec<&'static str> {
    match arch {
        "*" => crate::model::arch::names(),
        a => vec![a],
    }
}

#[test]
fn a_key_llama_cpp_reads_as_optional_may_be_absent_and_then_holds_its_default() {
    for &(arch, key, read, want) in OPTIONAL {
        for arch in archs(arch) {
            let whole = load(sound(arch)).unwrap_or_else(|e| panic!("sound {arch}: {e:#}"));
            assert_ne!(
                read(&whole),
                want,
                "{arch}.{key}: the sound metadata already holds the default"
            );
            let cfg =
                load(without(arch, key)).unwrap_or_else(|e| panic!("{arch} without {key}: {e:#}"));
            assert_eq!(read(&cfg), want, "{arch} without {key}");
        }
    }
}

/// Keys llama.cpp needs: read as required (`get_key(..)`), or read as optional but then its
/// tensors (or an assertion) refuse the default — each of these is refused by name.
const REQUIRED: &[(&str, &str)] = &[
    ("*", "block_count"),
    ("*", "context_length"),
    ("*", "embedding_length"),
    ("*", "attention.head_count"),
    ("*", "attention.layer_norm_rms_epsilon"),
    ("llama", "feed_forward_length"),
    ("mistral", "feed_forward_length"),
    ("qwen2", "feed_forward_length"),
    ("qwen3", "feed_forward_length"),
    ("gemma3", "feed_forward_length"),
    ("gemma4", "feed_forward_length"),
    ("qwen35", "feed_forward_length"),
    ("gemma4", "attention.sliding_window"),
    ("gpt-oss", "attention.sliding_window"),
    ("gpt-oss", "expert_count"),
    ("gpt-oss", "expert_used_count"),
    ("gpt-oss", "expert_feed_forward_length"),
    ("qwen35moe", "expert_count"),
    ("qwen35moe", "expert_used_count"),
    ("qwen35", "ssm.conv_kernel"),
    ("qwen35", "ssm.inner_size"),
    ("qwen35", "ssm.state_size"),
    ("qwen35", "ssm.time_step_rank"),
    ("qwen35", "ssm.group_count"),
    ("qwen35moe", "ssm.conv_kernel"),
    ("qwen35moe", "ssm.inner_size"),
    ("qwen35moe", "ssm.state_size"),
    ("qwen35moe", "ssm.time_step_rank"),
    ("qwen35moe", "ssm.group_count"),
];

#[test]
fn a_key_llama_cpp_needs_is_refused_by_name_when_absent() {
    for &(arch, key) in REQUIRED {
        for arch in archs(arch) {
            let Err(e) = load(without(arch, key)) else {
                panic!("{arch} without {key} loads");
            };
            let want = format!("GGUF metadata lacks {arch}.{key}");
            assert!(format!("{e:#}").contains(&want), "{arch}: {e:#}");
        }
    }
}

#[test]
fn a_qwen35moe_file_without_feed_forward_length_loads_with_its_experts_widths() {
    let c = load(without("qwen35moe", "feed_forward_length")).unwrap();
    assert_eq!(c.ffn, 0);
    assert_eq!(
        c.experts,
        Some(Experts {
            count: 8,
            used: 2,
            ffn: 64,
            shared: 128
        })
    );
}

#[test]
fn a_qwen35moe_shared_expert_without_a_width_or_its_fallback_is_refused_by_name() {
    let mut md = without("qwen35moe", "feed_forward_length");
    md.remove("qwen35moe.expert_shared_feed_forward_length");
    let e = format!("{:#}", load(md).unwrap_err());
    assert!(
        e.contains("GGUF metadata lacks qwen35moe.expert_shared_feed_forward_length (and qwen35moe.feed_forward_length, its fallback)"),
        "{e}"
    );
}

#[test]
fn gemma3_without_a_window_attends_globally_on_every_layer() {
    let c = load(without("gemma3", "attention.sliding_window")).unwrap();
    assert_eq!((c.sliding_window, c.rope_base_local), (None, None));
}

#[test]
fn the_older_rope_scale_linear_key_scales_as_rope_scaling_factor() {
    let mut md = without("llama", "rope.scaling.type");
    md.remove("llama.rope.scaling.factor");
    md.insert("llama.rope.scale_linear".into(), V::F32(4.0));
    assert_eq!(load(md).unwrap().rope_linear_scale, 4.0);
}

#[test]
fn an_optional_key_of_the_wrong_kind_is_refused_not_defaulted() {
    let mut md = sound("llama");
    md.insert("llama.attention.key_length".into(), V::String("128".into()));
    let e = format!("{:#}", load(md).unwrap_err());
    assert!(
        e.contains("GGUF llama.attention.key_length is not an integer"),
        "{e}"
    );
}

#[test]
fn a_config_changed_by_hand_without_a_remap_is_refused_by_validate() {
    let mut c = test_config(2, 8);
    c.n_layer = 4;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("Config::remap"), "{e}");
    c.remap();
    c.validate().unwrap();
    assert_eq!(c.kv_layers(), 4);
}
