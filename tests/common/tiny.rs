//! Tiny random models written as GGUF files inside the tests.
#![allow(dead_code)]

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = HIDDEN / HEADS;
pub const FFN: usize = 128;
pub const VOCAB: usize = 40;
pub const LAYERS: usize = 2;

/// Writes a random qwen2-architecture GGUF (biases on q/k/v, 4 heads sharing 2 KV heads, no
/// output.weight) with Q8_0 matrices, and returns its path.
pub fn write_tiny_qwen2(name: &str) -> PathBuf {
    write_tiny(name, Vec::new())
}

/// As `write_tiny_qwen2`, with extra metadata (a tokenizer, say).
pub fn write_tiny(name: &str, extra: Vec<(String, Value)>) -> PathBuf {
    write_tiny_arch(name, "qwen2", extra)
}

/// Gemma 3's sliding window in the tiny gemma3: layer 0 keeps 8 positions, layer 1 is global
/// (`sliding_window_pattern` 2).
pub const TINY_WINDOW: usize = 8;

/// A tiny random model of architecture `arch`: qwen2 (q/k/v biases), qwen3 (per-head q/k norms)
/// or gemma3 (q/k norms, norms after attention and FFN, a sliding window of 8 on layer 0).
pub fn write_tiny_arch(name: &str, arch: &str, extra: Vec<(String, Value)>) -> PathBuf {
    let dev = Device::Cpu;
    let rand = |shape: &[usize], q: GgmlDType| {
        let t = Tensor::randn(0f32, 0.2, shape, &dev).unwrap();
        QTensor::quantize(&t, q).unwrap()
    };
    let ones = |n: usize| {
        QTensor::quantize(&Tensor::ones(n, DType::F32, &dev).unwrap(), GgmlDType::F32).unwrap()
    };
    // A norm weight around 1 (so a norm applied or left out changes the output).
    let norm_w = |n: usize| {
        let t = (Tensor::randn(0f32, 0.3, n, &dev).unwrap() + 1.0).unwrap();
        QTensor::quantize(&t, GgmlDType::F32).unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            rand(&[VOCAB, HIDDEN], GgmlDType::Q8_0),
        ),
        ("output_norm.weight".into(), ones(HIDDEN)),
    ];
    for i in 0..LAYERS {
        let p = format!("blk.{i}");
        let q8 = GgmlDType::Q8_0;
        tensors.extend([
            (format!("{p}.attn_norm.weight"), ones(HIDDEN)),
            (
                format!("{p}.attn_q.weight"),
                rand(&[HEADS * HEAD_DIM, HIDDEN], q8),
            ),
            (
                format!("{p}.attn_k.weight"),
                rand(&[KV_HEADS * HEAD_DIM, HIDDEN], q8),
            ),
            (
                format!("{p}.attn_v.weight"),
                rand(&[KV_HEADS * HEAD_DIM, HIDDEN], q8),
            ),
            (
                format!("{p}.attn_output.weight"),
                rand(&[HIDDEN, HEADS * HEAD_DIM], q8),
            ),
            (format!("{p}.ffn_norm.weight"), ones(HIDDEN)),
            (format!("{p}.ffn_gate.weight"), rand(&[FFN, HIDDEN], q8)),
            (format!("{p}.ffn_up.weight"), rand(&[FFN, HIDDEN], q8)),
            (format!("{p}.ffn_down.weight"), rand(&[HIDDEN, FFN], q8)),
        ]);
        if arch == "qwen2" {
            for (w, n) in [("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)] {
                tensors.push((
                    format!("{p}.attn_{w}.bias"),
                    rand(&[n * HEAD_DIM], GgmlDType::F32),
                ));
            }
        }
        if arch == "qwen3" || arch == "gemma3" {
            tensors.push((format!("{p}.attn_q_norm.weight"), norm_w(HEAD_DIM)));
            tensors.push((format!("{p}.attn_k_norm.weight"), norm_w(HEAD_DIM)));
        }
        if arch == "gemma3" {
            tensors.push((format!("{p}.post_attention_norm.weight"), norm_w(HIDDEN)));
            tensors.push((format!("{p}.post_ffw_norm.weight"), norm_w(HIDDEN)));
        }
    }
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), Value::U32(LAYERS as u32)),
        (format!("{arch}.context_length"), Value::U32(128)),
        (
            format!("{arch}.embedding_length"),
            Value::U32(HIDDEN as u32),
        ),
        (
            format!("{arch}.feed_forward_length"),
            Value::U32(FFN as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(HEADS as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(KV_HEADS as u32),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(1_000_000.0)),
    ];
    if arch == "gemma3" {
        md.push((
            "gemma3.attention.sliding_window".into(),
            Value::U32(TINY_WINDOW as u32),
        ));
        md.push((
            "gemma3.attention.sliding_window_pattern".into(),
            Value::U32(2),
        ));
    }
    md.extend(extra);
    let path = std::env::temp_dir().join(format!("kvchat-tiny-{name}-{}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&path).unwrap();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    path
}

/// A SentencePiece-style (tokenizer.ggml.model = llama) vocabulary, as GGUF metadata.
/// (piece, score, type): 1 normal, 2 unknown, 3 control, 6 byte
pub const SPM_VOCAB: &[(&str, f32, i32)] = &[
    ("<unk>", 0.0, 2),
    ("<s>", 0.0, 3),
    ("</s>", 0.0, 3),
    ("<0xC3>", 0.0, 6),
    ("<0xA9>", 0.0, 6),
    ("▁", -1.0, 1),
    ("h", -2.0, 1),
    ("e", -3.0, 1),
    ("l", -4.0, 1),
    ("o", -5.0, 1),
    ("▁h", -6.0, 1),
    ("ll", -7.0, 1),
    ("llo", -8.0, 1),
    ("▁he", -9.0, 1),
    ("▁hello", -10.0, 1),
];

pub fn spm_content() -> gguf_file::Content {
    gguf_file::Content {
        magic: gguf_file::VersionedMagic::GgufV3,
        metadata: spm_metadata(0).into_iter().collect(),
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    }
}

/// The SentencePiece vocabulary above as GGUF metadata, padded with unused tokens to `pad_to` entries.
pub fn spm_metadata(pad_to: usize) -> Vec<(String, Value)> {
    let mut vocab: Vec<(String, f32, i32)> = SPM_VOCAB
        .iter()
        .map(|(a, b, c)| (a.to_string(), *b, *c))
        .collect();
    while vocab.len() < pad_to {
        vocab.push((format!("<extra_{}>", vocab.len()), -100.0, 1));
    }
    let list =
        |f: &dyn Fn(&(String, f32, i32)) -> Value| Value::Array(vocab.iter().map(f).collect());
    vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            list(&|v| Value::String(v.0.clone())),
        ),
        ("tokenizer.ggml.scores".into(), list(&|v| Value::F32(v.1))),
        (
            "tokenizer.ggml.token_type".into(),
            list(&|v| Value::I32(v.2)),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
    ]
}

/// A tiny model with a tokenizer: a complete GGUF that `Engine::load` accepts.
pub fn write_tiny_with_tokenizer(name: &str) -> PathBuf {
    write_tiny(name, spm_metadata(VOCAB))
}
