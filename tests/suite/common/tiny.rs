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
    write_tiny_typed(name, arch, GgmlDType::Q8_0, extra)
}

/// As `write_tiny_arch`, with the embedding table and every projection of type `matrices`.
pub fn write_tiny_typed(
    name: &str,
    arch: &str,
    matrices: GgmlDType,
    extra: Vec<(String, Value)>,
) -> PathBuf {
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
        ("token_embd.weight".into(), rand(&[VOCAB, HIDDEN], matrices)),
        ("output_norm.weight".into(), ones(HIDDEN)),
    ];
    for i in 0..LAYERS {
        let p = format!("blk.{i}");
        let q8 = matrices;
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

/// A deterministic stream of numbers in [-1, 1) (splitmix64): the same file on every machine.
struct Rng(u64);

/// The GGUF whose tokenizer a random model takes: its content and vocabulary size.
fn tokenizer_source(path: &std::path::Path) -> (gguf_file::Content, usize) {
    let src = gguf_file::Content::read(&mut std::fs::File::open(path).unwrap()).unwrap();
    let vocab = match src.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a.len(),
        _ => panic!("no tokenizer in {}", path.display()),
    };
    (src, vocab)
}

impl Rng {
    /// A tensor of `dims` holding Uniform(offset − scale, offset + scale) values in order, quantized.
    fn tensor(&mut self, dims: &[usize], scale: f32, offset: f32, q: GgmlDType) -> QTensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + self.next() * scale).collect();
        QTensor::quantize(&Tensor::from_vec(v, dims, &Device::Cpu).unwrap(), q).unwrap()
    }

    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A random-weight `qwen3` model in a small real shape (2 layers, hidden 256, 4 heads of 96 over 2
/// KV heads — head size ≠ hidden/heads, as in Qwen3 —, FFN 512) with the real model's SmolLM2
/// tokenizer, Q8_0 matrices, tied embeddings. Bit-identical on every machine (a fixed generator,
/// metadata in sorted order), so llama.cpp's perplexity of this file is a constant the tests can
/// hold. Written to `path`.
pub fn write_random_qwen3(path: &std::path::Path, tokenizer_from: &std::path::Path) {
    let (hidden, heads, kv_heads, hd, ffn, layers) =
        (256usize, 4usize, 2usize, 96usize, 512usize, 2usize);
    let (src, vocab) = tokenizer_source(tokenizer_from);
    let dev = Device::Cpu;
    let mut rng = Rng(0x0005_eed0_f0e3);
    // Uniform(offset - scale, offset + scale) values, quantized.
    let mut mat = |rows: usize, cols: usize, scale: f32, offset: f32, q: GgmlDType| {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| offset + rng.next() * scale)
            .collect();
        let t = match rows {
            1 => Tensor::from_vec(v, cols, &dev), // a vector (norm weights)
            _ => Tensor::from_vec(v, (rows, cols), &dev),
        };
        QTensor::quantize(&t.unwrap(), q).unwrap()
    };
    let q8 = GgmlDType::Q8_0;
    let f32t = GgmlDType::F32;
    // Uniform(-s, s) has standard deviation s/√3: s = √3/√in keeps activations at unit scale.
    let s = |inputs: usize| (3.0 / inputs as f32).sqrt();
    let mut tensors: Vec<(String, QTensor)> = vec![(
        "token_embd.weight".into(),
        mat(vocab, hidden, 0.27, 0.0, q8),
    )];
    for i in 0..layers {
        let p = format!("blk.{i}");
        tensors.push((
            format!("{p}.attn_q.weight"),
            mat(heads * hd, hidden, s(hidden), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.attn_k.weight"),
            mat(kv_heads * hd, hidden, s(hidden), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.attn_v.weight"),
            mat(kv_heads * hd, hidden, s(hidden), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.attn_output.weight"),
            mat(hidden, heads * hd, s(heads * hd), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.ffn_gate.weight"),
            mat(ffn, hidden, s(hidden), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.ffn_up.weight"),
            mat(ffn, hidden, s(hidden), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.ffn_down.weight"),
            mat(hidden, ffn, s(ffn), 0.0, q8),
        ));
        tensors.push((
            format!("{p}.attn_norm.weight"),
            mat(1, hidden, 0.5, 1.0, f32t),
        ));
        tensors.push((
            format!("{p}.ffn_norm.weight"),
            mat(1, hidden, 0.5, 1.0, f32t),
        ));
        // q/k norm weights of about 2.5 make attention sharp (scores of several units), so
        // that leaving either norm out, or rotating wrongly, changes the answer.
        tensors.push((
            format!("{p}.attn_q_norm.weight"),
            mat(1, hd, 1.0, 2.5, f32t),
        ));
        tensors.push((
            format!("{p}.attn_k_norm.weight"),
            mat(1, hd, 1.0, 2.5, f32t),
        ));
    }
    let ones = Tensor::ones(hidden, DType::F32, &dev).unwrap();
    tensors.push((
        "output_norm.weight".into(),
        QTensor::quantize(&ones, f32t).unwrap(),
    ));
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("qwen3".into())),
        (
            "general.name".into(),
            Value::String("kvchat random qwen3".into()),
        ),
        ("qwen3.block_count".into(), Value::U32(layers as u32)),
        ("qwen3.context_length".into(), Value::U32(4096)),
        ("qwen3.embedding_length".into(), Value::U32(hidden as u32)),
        ("qwen3.feed_forward_length".into(), Value::U32(ffn as u32)),
        (
            "qwen3.attention.head_count".into(),
            Value::U32(heads as u32),
        ),
        (
            "qwen3.attention.head_count_kv".into(),
            Value::U32(kv_heads as u32),
        ),
        ("qwen3.attention.key_length".into(), Value::U32(hd as u32)),
        ("qwen3.attention.value_length".into(), Value::U32(hd as u32)),
        (
            "qwen3.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-6),
        ),
        ("qwen3.rope.freq_base".into(), Value::F32(1_000_000.0)),
    ];
    write_with_tokenizer(path, md, &src, &tensors);
}

/// Writes a GGUF of `md` plus the tokenizer of `src` (less its chat template), metadata in
/// sorted order (so that the bytes are the same on every machine), and `tensors`.
fn write_with_tokenizer(
    path: &std::path::Path,
    mut md: Vec<(String, Value)>,
    src: &gguf_file::Content,
    tensors: &[(String, QTensor)],
) {
    md.extend(
        src.metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer.") && *k != "tokenizer.chat_template")
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = std::fs::File::create(path).unwrap();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md_refs, &t_refs).unwrap();
}

/// Rewrites, in the header of the GGUF at `path`, the type of every tensor of type `from` to `to`
/// (ggml ids): a file of a type candle cannot write, made from one of the same block layout (Q4_0
/// and IQ4_NL: 32 values in 18 bytes, a scale and 16 bytes of nibbles).
pub fn retype(path: &std::path::Path, from: u32, to: u32) {
    use std::io::{Seek, SeekFrom, Write};
    let types = kvchat::model::gguf_types::tensor_types(path).expect("a readable header");
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    for t in types.iter().filter(|t| t.ty.0 == from) {
        f.seek(SeekFrom::Start(t.at)).unwrap();
        f.write_all(&to.to_le_bytes()).unwrap();
    }
}

/// A random-weight `gpt-oss` model in a small shape (2 layers, hidden 256, 4 query heads of 64
/// over 2 KV heads, 8 experts of 256 rows with 4 used per token, a 64-position window on layer 0,
/// learned sinks, biases everywhere gpt-oss has them, YaRN ×32 over 4,096 positions) with the
/// real model's SmolLM2 tokenizer. Attention matrices Q8_0, router and expert biases F32, experts
/// MXFP4 (candle cannot write MXFP4: the experts are written as Q8_0 of the same shape, then
/// retyped and their first bytes overwritten with MXFP4 blocks, see `overwrite_tensor`).
/// Bit-identical on every machine, so llama.cpp's perplexity of it is a constant tests hold.
pub fn write_random_gpt_oss(path: &std::path::Path, tokenizer_from: &std::path::Path) {
    let (hidden, heads, kv_heads, hd, layers) = (256usize, 4usize, 2usize, 64usize, 2usize);
    let (experts, used, ffn) = (8usize, 4usize, 256usize);
    let (src, vocab) = tokenizer_source(tokenizer_from);
    let mut rng = Rng(0x0005_eed0_9055);
    let mut tensor =
        |dims: &[usize], scale: f32, offset: f32, q: GgmlDType| rng.tensor(dims, scale, offset, q);
    let (q8, f32t) = (GgmlDType::Q8_0, GgmlDType::F32);
    // Uniform(-s, s) has standard deviation s/√3: s = √3/√in keeps activations at unit scale;
    // q and k twice that, so that attention is sharp and positions, windows and sinks matter.
    let s = |inputs: usize| (3.0 / inputs as f32).sqrt();
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            tensor(&[vocab, hidden], 0.27, 0.0, q8),
        ),
        (
            "output_norm.weight".into(),
            tensor(&[hidden], 0.2, 1.0, f32t),
        ),
        // gpt-oss has its own output matrix (llama.cpp requires it).
        (
            "output.weight".into(),
            tensor(&[vocab, hidden], 0.27, 0.0, q8),
        ),
    ];
    let mut mxfp4 = Vec::new();
    for i in 0..layers {
        let p = format!("blk.{i}");
        let mut push = |name: &str, t: QTensor| tensors.push((format!("{p}.{name}"), t));
        push("attn_norm.weight", tensor(&[hidden], 0.2, 1.0, f32t));
        push(
            "post_attention_norm.weight",
            tensor(&[hidden], 0.2, 1.0, f32t),
        );
        for (name, rows, cols, sc) in [
            ("attn_q", heads * hd, hidden, 2.0 * s(hidden)),
            ("attn_k", kv_heads * hd, hidden, 2.0 * s(hidden)),
            ("attn_v", kv_heads * hd, hidden, s(hidden)),
            ("attn_output", hidden, heads * hd, s(heads * hd)),
        ] {
            push(
                &format!("{name}.weight"),
                tensor(&[rows, cols], sc, 0.0, q8),
            );
            push(&format!("{name}.bias"), tensor(&[rows], 0.2, 0.0, f32t));
        }
        push("attn_sinks.weight", tensor(&[heads], 2.0, 0.0, f32t));
        push(
            "ffn_gate_inp.weight",
            tensor(&[experts, hidden], s(hidden), 0.0, f32t),
        );
        push("ffn_gate_inp.bias", tensor(&[experts], 0.5, 0.0, f32t));
        for (name, rows, cols) in [
            ("gate", ffn, hidden),
            ("up", ffn, hidden),
            ("down", hidden, ffn),
        ] {
            // A Q8_0 stand-in of the same shape (twice MXFP4's bytes), replaced below.
            let name = format!("ffn_{name}_exps");
            push(
                &format!("{name}.weight"),
                tensor(&[experts, rows, cols], 0.0, 0.0, q8),
            );
            push(
                &format!("{name}.bias"),
                tensor(&[experts, rows], 0.2, 0.0, f32t),
            );
            mxfp4.push((format!("{p}.{name}.weight"), experts * rows * cols / 32));
        }
    }
    let md: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("gpt-oss".into()),
        ),
        (
            "general.name".into(),
            Value::String("kvchat random gpt-oss".into()),
        ),
        ("gpt-oss.block_count".into(), Value::U32(layers as u32)),
        ("gpt-oss.context_length".into(), Value::U32(131072)),
        ("gpt-oss.embedding_length".into(), Value::U32(hidden as u32)),
        ("gpt-oss.feed_forward_length".into(), Value::U32(ffn as u32)),
        (
            "gpt-oss.expert_feed_forward_length".into(),
            Value::U32(ffn as u32),
        ),
        ("gpt-oss.expert_count".into(), Value::U32(experts as u32)),
        ("gpt-oss.expert_used_count".into(), Value::U32(used as u32)),
        (
            "gpt-oss.attention.head_count".into(),
            Value::U32(heads as u32),
        ),
        (
            "gpt-oss.attention.head_count_kv".into(),
            Value::U32(kv_heads as u32),
        ),
        ("gpt-oss.attention.key_length".into(), Value::U32(hd as u32)),
        (
            "gpt-oss.attention.value_length".into(),
            Value::U32(hd as u32),
        ),
        (
            "gpt-oss.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("gpt-oss.attention.sliding_window".into(), Value::U32(64)),
        ("gpt-oss.rope.freq_base".into(), Value::F32(150_000.0)),
        (
            "gpt-oss.rope.scaling.type".into(),
            Value::String("yarn".into()),
        ),
        ("gpt-oss.rope.scaling.factor".into(), Value::F32(32.0)),
        (
            "gpt-oss.rope.scaling.original_context_length".into(),
            Value::U32(4096),
        ),
    ];
    write_with_tokenizer(path, md, &src, &tensors);
    // The experts as MXFP4: per block a scale byte in 118..=121 (2^-10..2^-7) and random nibbles.
    let mut bits = Rng(0x0005_eed0_f4f4);
    let mut patches = Vec::new();
    for (name, blocks) in mxfp4 {
        let mut bytes = Vec::with_capacity(blocks * 17);
        for _ in 0..blocks {
            bytes.push(118 + ((bits.next() + 1.0) * 2.0) as u8);
            bytes.extend((0..16).map(|_| ((bits.next() + 1.0) * 128.0) as u8));
        }
        patches.push((name, 39, bytes));
    }
    overwrite_tensors(path, &patches);
}

/// Gives each tensor `name` of the GGUF at `path` the type `ty` (a ggml id) and the data
/// `bytes` (no more than it had), and lays the tensors out again end to end (at GGUF's alignment
/// of 32, as llama.cpp checks): tensors of a type candle cannot write, in a file candle wrote.
pub fn overwrite_tensors(path: &std::path::Path, patches: &[(String, u32, Vec<u8>)]) {
    let content = gguf_file::Content::read(&mut std::fs::File::open(path).unwrap()).unwrap();
    let types = kvchat::model::gguf_types::tensor_types(path).expect("a readable header");
    let old = std::fs::read(path).unwrap();
    let base = content.tensor_data_offset as usize;
    let mut header = old[..base].to_vec();
    // Tensors in file order, each with its data (patched or as it was).
    let mut infos: Vec<_> = content.tensor_infos.iter().collect();
    infos.sort_by_key(|(_, i)| i.offset);
    let mut data = Vec::new();
    for (name, info) in infos {
        let d = info.ggml_dtype;
        let size = info.shape.elem_count() / d.block_size() * d.type_size();
        let from = base + info.offset as usize;
        let at = types
            .iter()
            .find(|t| &t.name == name)
            .expect("the tensor")
            .at as usize;
        let bytes = match patches.iter().find(|p| &p.0 == name) {
            Some((_, ty, bytes)) => {
                assert!(
                    bytes.len() <= size,
                    "{name}: {} bytes for {size}",
                    bytes.len()
                );
                header[at..at + 4].copy_from_slice(&ty.to_le_bytes());
                &bytes[..]
            }
            None => &old[from..from + size],
        };
        header[at + 4..at + 12].copy_from_slice(&(data.len() as u64).to_le_bytes());
        data.extend_from_slice(bytes);
        data.resize(data.len().next_multiple_of(32), 0);
    }
    header.extend(data);
    std::fs::write(path, header).unwrap();
}

/// A random model written once per test run by `write` (from the real model's tokenizer) at
/// target/tmp/`name`; `cell` keeps its path for the tests that share it.
pub fn written_once(
    cell: &'static std::sync::OnceLock<PathBuf>,
    name: &str,
    write: fn(&std::path::Path, &std::path::Path),
) -> PathBuf {
    cell.get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
        write(&p, &crate::common::model_path());
        p
    })
    .clone()
}

/// The perplexity of the pinned random model at `path` (its sha256 checked first: a reference
/// measured on other bytes says nothing) over bench-text in chunks of 256, as
/// `llama-perplexity -f assets/bench-text.txt -c 256` scores it.
pub fn pinned_perplexity(path: &std::path::Path, sha256: &str) -> f64 {
    pinned_perplexity_in(path, sha256, "full")
}

/// [`pinned_perplexity`] through a cache of `mode` (`full+f32`, …).
pub fn pinned_perplexity_in(path: &std::path::Path, sha256: &str, mode: &str) -> f64 {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(
        crate::common::hub::sha256_hex(&bytes),
        sha256,
        "the random model changed"
    );
    let e = kvchat::engine::Engine::load(&kvchat::engine::LoadOptions {
        ctx: Some(256),
        ..kvchat::engine::LoadOptions::for_path(path)
    })
    .unwrap();
    let ids = e
        .tokenizer()
        .encode(kvchat::eval::bench::BENCH_TEXT)
        .unwrap();
    kvchat::eval::ppl::perplexity(&e, mode.parse().unwrap(), &ids, 256, 0, false)
        .unwrap()
        .ppl
}

/// Logits at every position of `tokens`: one prefill, then token by token, through `spec` (a
/// session of `max_positions`).
pub fn prefill_and_decode(
    m: &kvchat::model::Decoder,
    spec: &kvchat::kv::CacheSpec,
    tokens: &[u32],
    max_positions: usize,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use kvchat::session::Session;
    let session = || Session::new(m, spec.build(&m.cfg, None), max_positions);
    let all = session()
        .feed_with(tokens, kvchat::model::Logits::All)
        .unwrap();
    let prefill = (0..tokens.len())
        .map(|i| all.get(i).unwrap().to_vec1::<f32>().unwrap())
        .collect();
    let mut s = session();
    let decode = tokens
        .iter()
        .map(|&t| s.feed(&[t]).unwrap().to_vec1::<f32>().unwrap())
        .collect();
    (prefill, decode)
}

/// The layers of the random Gemma 4 (`write_random_gemma4`): window layers alternate with global
/// ones, and the last 2 of 6 share the keys and values of layers 2 (window) and 3 (global), as
/// llama.cpp maps Gemma 4's shared layers.
pub const GEMMA4_WINDOW: [bool; 6] = [true, false, true, false, true, false];

/// Writes a random `gemma4` GGUF in Gemma 4 E2B's pieces, small: 6 layers of hidden 256 and 4
/// query heads; window layers (16 positions) of head size 32 with 2 KV heads, rotated at base
/// 10,000; global layers of head size 64 with 1 KV head, rotated "proportionally" (only the
/// first quarter of the pairs turn: `rope_freqs` 1, then 1e30) at base 1,000,000; layer 1 with
/// no `attn_v` (its values are its keys' projection); the last 2 layers sharing keys and values
/// and twice as wide in their FFN; per-layer token embeddings of 32; an output scale per layer;
/// logits soft-capped at 30. Q8_0 matrices, the tokenizer of `tokenizer_from`.
pub fn write_random_gemma4(path: &std::path::Path, tokenizer_from: &std::path::Path) {
    write_gemma4(path, tokenizer_from, false)
}

/// `write_random_gemma4`'s model with experts beside each dense FFN, as Gemma 4 26B-A4B: 4
/// experts of 128 (gate and up stacked in one `ffn_gate_up_exps`, a scale per expert), 2 a
/// token, routed on `ffn_gate_inp.scale ⊙ rms(x)`.
pub fn write_random_gemma4_moe(path: &std::path::Path, tokenizer_from: &std::path::Path) {
    write_gemma4(path, tokenizer_from, true)
}

fn write_gemma4(path: &std::path::Path, tokenizer_from: &std::path::Path, moe: bool) {
    let (experts, used, expert_ffn) = (4usize, 2usize, 128usize);
    let (hidden, heads, ple, layers) = (256usize, 4usize, 32usize, GEMMA4_WINDOW.len());
    let (hd_global, hd_local, shared) = (64usize, 32usize, 2usize);
    let kv_heads = |i: usize| if GEMMA4_WINDOW[i] { 2usize } else { 1 };
    let hd = |i: usize| {
        if GEMMA4_WINDOW[i] {
            hd_local
        } else {
            hd_global
        }
    };
    let ffn = |i: usize| if i >= layers - shared { 512usize } else { 256 };
    let (src, vocab) = tokenizer_source(tokenizer_from);
    // The vocabulary and its 256 byte tokens (`gemma4_tokenizer`).
    let vocab = vocab + 256;
    let mut rng = Rng(0x0005_eed0_9e44);
    let mut tensor =
        |dims: &[usize], scale: f32, offset: f32, q: GgmlDType| rng.tensor(dims, scale, offset, q);
    let (q8, f32t) = (GgmlDType::Q8_0, GgmlDType::F32);
    let s = |inputs: usize| (3.0 / inputs as f32).sqrt();
    let n_rot = hd_global / 4 / 2;
    let freqs: Vec<f32> = (0..hd_global / 2)
        .map(|i| if i < n_rot { 1.0 } else { 1e30 })
        .collect();
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            tensor(&[vocab, hidden], 0.05, 0.0, q8),
        ),
        (
            "output_norm.weight".into(),
            tensor(&[hidden], 0.2, 1.0, f32t),
        ),
        (
            "rope_freqs.weight".into(),
            QTensor::quantize(&Tensor::new(freqs, &Device::Cpu).unwrap(), f32t).unwrap(),
        ),
        (
            "per_layer_token_embd.weight".into(),
            tensor(&[vocab, layers * ple], 1.0, 0.0, q8),
        ),
        (
            "per_layer_model_proj.weight".into(),
            tensor(&[layers * ple, hidden], s(hidden), 0.0, q8),
        ),
        (
            "per_layer_proj_norm.weight".into(),
            tensor(&[ple], 0.2, 1.0, f32t),
        ),
    ];
    for i in 0..layers {
        let p = format!("blk.{i}");
        let mut push = |name: &str, t: QTensor| tensors.push((format!("{p}.{name}"), t));
        let (nkv, hd, f) = (kv_heads(i), hd(i), ffn(i));
        for norm in [
            "attn_norm",
            "post_attention_norm",
            "ffn_norm",
            "post_ffw_norm",
            "post_norm",
        ] {
            push(&format!("{norm}.weight"), tensor(&[hidden], 0.2, 1.0, f32t));
        }
        push("attn_q_norm.weight", tensor(&[hd], 0.2, 1.0, f32t));
        // q and k wide enough that attention is sharp (positions and windows matter).
        push(
            "attn_q.weight",
            tensor(&[heads * hd, hidden], 2.0 * s(hidden), 0.0, q8),
        );
        if i < layers - shared {
            push("attn_k_norm.weight", tensor(&[hd], 0.2, 1.0, f32t));
            push(
                "attn_k.weight",
                tensor(&[nkv * hd, hidden], 2.0 * s(hidden), 0.0, q8),
            );
            if i != 1 {
                push(
                    "attn_v.weight",
                    tensor(&[nkv * hd, hidden], s(hidden), 0.0, q8),
                );
            }
        }
        push(
            "attn_output.weight",
            tensor(&[hidden, heads * hd], s(heads * hd), 0.0, q8),
        );
        push("ffn_gate.weight", tensor(&[f, hidden], s(hidden), 0.0, q8));
        push("ffn_up.weight", tensor(&[f, hidden], s(hidden), 0.0, q8));
        push("ffn_down.weight", tensor(&[hidden, f], s(f), 0.0, q8));
        push(
            "inp_gate.weight",
            tensor(&[ple, hidden], s(hidden), 0.0, q8),
        );
        push("proj.weight", tensor(&[hidden, ple], s(ple), 0.0, q8));
        push("layer_output_scale.weight", tensor(&[1], 0.3, 0.8, f32t));
        if moe {
            for norm in ["pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"] {
                push(&format!("{norm}.weight"), tensor(&[hidden], 0.2, 1.0, f32t));
            }
            push(
                "ffn_gate_inp.weight",
                tensor(&[experts, hidden], 4.0 * s(hidden), 0.0, f32t),
            );
            push("ffn_gate_inp.scale", tensor(&[hidden], 0.2, 1.0, f32t));
            push(
                "ffn_gate_up_exps.weight",
                tensor(&[experts, 2 * expert_ffn, hidden], s(hidden), 0.0, q8),
            );
            push(
                "ffn_down_exps.weight",
                tensor(&[experts, hidden, expert_ffn], s(expert_ffn), 0.0, q8),
            );
            push("ffn_down_exps.scale", tensor(&[experts], 0.3, 1.0, f32t));
        }
    }
    let a = |xs: Vec<Value>| Value::Array(xs);
    let per_layer =
        |f: &dyn Fn(usize) -> usize| a((0..layers).map(|i| Value::U32(f(i) as u32)).collect());
    let g = |k: &str| format!("gemma4.{k}");
    let mut md: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("gemma4".into()),
        ),
        (
            "general.name".into(),
            Value::String("kvchat random gemma4".into()),
        ),
        (g("block_count"), Value::U32(layers as u32)),
        (g("context_length"), Value::U32(131072)),
        (g("embedding_length"), Value::U32(hidden as u32)),
        (
            g("embedding_length_per_layer_input"),
            Value::U32(ple as u32),
        ),
        (g("feed_forward_length"), per_layer(&ffn)),
        (g("attention.head_count"), Value::U32(heads as u32)),
        (g("attention.head_count_kv"), per_layer(&kv_heads)),
        (g("attention.key_length"), Value::U32(hd_global as u32)),
        (g("attention.value_length"), Value::U32(hd_global as u32)),
        (g("attention.key_length_swa"), Value::U32(hd_local as u32)),
        (g("attention.value_length_swa"), Value::U32(hd_local as u32)),
        (g("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (g("attention.sliding_window"), Value::U32(16)),
        (
            g("attention.sliding_window_pattern"),
            a(GEMMA4_WINDOW.iter().map(|&w| Value::Bool(w)).collect()),
        ),
        (g("attention.shared_kv_layers"), Value::U32(shared as u32)),
        (g("rope.freq_base"), Value::F32(1_000_000.0)),
        (g("rope.freq_base_swa"), Value::F32(10_000.0)),
        (g("rope.dimension_count"), Value::U32(hd_global as u32)),
        (g("rope.dimension_count_swa"), Value::U32(hd_local as u32)),
        (g("final_logit_softcapping"), Value::F32(30.0)),
    ];
    if moe {
        md.extend([
            (g("expert_count"), Value::U32(experts as u32)),
            (g("expert_used_count"), Value::U32(used as u32)),
            (
                g("expert_feed_forward_length"),
                Value::U32(expert_ffn as u32),
            ),
        ]);
    }
    md.extend(gemma4_tokenizer(&src));
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = std::fs::File::create(path).unwrap();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut out, &md_refs, &t_refs).unwrap();
}

/// A `tokenizer.ggml.model = gemma4` tokenizer (SentencePiece-style BPE over raw UTF-8, "▁" for
/// spaces, `<0xXX>` byte tokens) made from the byte-level BPE tokenizer of `src` (SmolLM2's):
/// each token's bytes as UTF-8 text with "▁" for spaces (a token whose bytes are not UTF-8
/// becomes a private-use placeholder no text contains), the merges between such tokens, and the
/// 256 byte tokens after them. Control tokens stay as they are.
pub fn gemma4_tokenizer(src: &gguf_file::Content) -> Vec<(String, Value)> {
    // GPT-2's bytes_to_unicode, inverted: the character byte-level BPE writes for each byte.
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let byte_of: HashMap<char, u8> = chars
        .iter()
        .zip(&printable)
        .map(|(&c, &b)| (char::from_u32(c).unwrap(), b as u8))
        .collect();
    let text = |t: &str| -> Option<String> {
        let bytes: Option<Vec<u8>> = t.chars().map(|c| byte_of.get(&c).copied()).collect();
        String::from_utf8(bytes?)
            .ok()
            .map(|s| s.replace(' ', "\u{2581}"))
    };
    let strings = |key: &str| -> Vec<String> {
        match src.metadata.get(key) {
            Some(Value::Array(a)) => a.iter().map(|v| v.to_string().unwrap().clone()).collect(),
            _ => panic!("no {key}"),
        }
    };
    let src_types: Vec<i32> = match src.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a.iter().map(|v| v.to_i32().unwrap()).collect(),
        _ => panic!("no token types"),
    };
    let mut tokens = Vec::new();
    let mut types = Vec::new();
    for (i, (t, &ty)) in strings("tokenizer.ggml.tokens")
        .iter()
        .zip(&src_types)
        .enumerate()
    {
        let converted = match ty {
            3 => Some(t.clone()),
            _ => text(t),
        };
        tokens.push(converted.unwrap_or_else(|| format!("\u{E000}{i}")));
        types.push(ty);
    }
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    let merges: Vec<String> = strings("tokenizer.ggml.merges")
        .iter()
        .filter_map(|m| {
            let (a, b) = m.split_once(' ')?;
            Some(format!("{} {}", text(a)?, text(b)?))
        })
        .collect();
    let list = |xs: Vec<Value>| Value::Array(xs);
    let mut md = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gemma4".into()),
        ),
        ("tokenizer.ggml.pre".into(), Value::String("gemma4".into())),
        (
            "tokenizer.ggml.tokens".into(),
            list(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            list(types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            list(merges.into_iter().map(Value::String).collect()),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
    ];
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
        if let Some(v) = src.metadata.get(key) {
            md.push((key.to_string(), v.clone()));
        }
    }
    md
}

/// A copy of the GGUF at `src`, changed by `damage`, named `name`.gguf in the tests' scratch
/// directory: a hostile-input test's file.
pub fn damaged(src: &std::path::Path, name: &str, damage: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(src).unwrap();
    damage(&mut bytes);
    let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.gguf"));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Sets the metadata value of `key` whose GGUF value type is `ty` (the key string, then its type,
/// then the value) to `value`'s bytes.
fn set_value(bytes: &mut [u8], key: &str, ty: u32, value: &[u8]) {
    let at = bytes
        .windows(key.len() + 4)
        .position(|w| &w[..key.len()] == key.as_bytes() && w[key.len()..] == ty.to_le_bytes())
        .unwrap_or_else(|| panic!("no key {key} of type {ty}"))
        + key.len()
        + 4;
    bytes[at..at + value.len()].copy_from_slice(value);
}

/// Sets the u32 metadata value of `key` (GGUF value type 4).
pub fn set_u32(bytes: &mut [u8], key: &str, v: u32) {
    set_value(bytes, key, 4, &v.to_le_bytes())
}

/// Sets the f32 metadata value of `key` (GGUF value type 6).
pub fn set_f32(bytes: &mut [u8], key: &str, v: f32) {
    set_value(bytes, key, 6, &v.to_le_bytes())
}

/// `kvchat run -m PATH --raw -n 2 FLAGS… hi`.
pub fn run_two_tokens(path: &std::path::Path, flags: &[&str]) -> std::process::Output {
    let mut args = vec!["run", "-m", path.to_str().unwrap(), "--raw", "-n", "2"];
    args.extend(flags);
    args.push("hi");
    crate::common::kvchat(&args, "")
}

/// The layers of the random Qwen3.5 (`write_random_qwen35`): every third layer attends, the
/// others are Gated DeltaNet layers with a recurrent state.
pub const QWEN35_ATTENDS: [bool; 6] = [false, false, true, false, false, true];

/// Writes a random `qwen35` GGUF in Qwen3.5's pieces, small: 6 layers of hidden 256, every third
/// attending (`full_attention_interval` 3): 4 query heads of 64 over 2 KV heads, each head's
/// queries with an output gate beside them (`attn_q` twice as tall), q/k norms, a quarter of
/// each head rotated (16 of 64 dimensions, sections 3/3/2 at base 10,000,000); the others Gated
/// DeltaNet: a 4-tap convolution over 2 key heads and 4 value heads of 32, decays and β per value
/// head. Q8_0 matrices, f32 vectors and convolution, the tokenizer of `tokenizer_from`, tied
/// embeddings. The same bytes on every machine.
pub fn write_random_qwen35(path: &std::path::Path, tokenizer_from: &std::path::Path) {
    write_qwen35(path, tokenizer_from, false)
}

/// `write_random_qwen35`'s model as Qwen3.5's MoE models (`qwen35moe`): each FFN 8 experts of
/// 128 rows, 2 a token, and a shared expert of 256 rows gated by sigmoid(`ffn_gate_inp_shexp`·x).
pub fn write_random_qwen35_moe(path: &std::path::Path, tokenizer_from: &std::path::Path) {
    write_qwen35(path, tokenizer_from, true)
}

fn write_qwen35(path: &std::path::Path, tokenizer_from: &std::path::Path, moe: bool) {
    let (hidden, heads, kv_heads, hd, ffn) = (256usize, 4usize, 2usize, 64usize, 512usize);
    let (experts, used, expert_ffn, shared_ffn) = (8usize, 2usize, 128usize, 256usize);
    let arch = if moe { "qwen35moe" } else { "qwen35" };
    let (conv, k_heads, v_heads, d) = (4usize, 2usize, 4usize, 32usize);
    let channels = 2 * k_heads * d + v_heads * d;
    let layers = QWEN35_ATTENDS.len();
    let (src, vocab) = tokenizer_source(tokenizer_from);
    let mut rng = Rng(0x0005_eed0_0035);
    let mut tensor =
        |dims: &[usize], scale: f32, offset: f32, q: GgmlDType| rng.tensor(dims, scale, offset, q);
    let (q8, f32t) = (GgmlDType::Q8_0, GgmlDType::F32);
    let s = |inputs: usize| (3.0 / inputs as f32).sqrt();
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            tensor(&[vocab, hidden], 0.27, 0.0, q8),
        ),
        (
            "output_norm.weight".into(),
            tensor(&[hidden], 0.2, 1.0, f32t),
        ),
    ];
    for (i, &attends) in QWEN35_ATTENDS.iter().enumerate() {
        let p = format!("blk.{i}");
        let mut push = |name: &str, t: QTensor| tensors.push((format!("{p}.{name}"), t));
        push("attn_norm.weight", tensor(&[hidden], 0.2, 1.0, f32t));
        push(
            "post_attention_norm.weight",
            tensor(&[hidden], 0.2, 1.0, f32t),
        );
        let mats: Vec<(&str, usize, usize)> = match attends {
            true => vec![
                ("attn_q", 2 * heads * hd, hidden),
                ("attn_k", kv_heads * hd, hidden),
                ("attn_v", kv_heads * hd, hidden),
                ("attn_output", hidden, heads * hd),
            ],
            false => vec![
                ("attn_qkv", channels, hidden),
                ("attn_gate", v_heads * d, hidden),
                ("ssm_beta", v_heads, hidden),
                ("ssm_alpha", v_heads, hidden),
                ("ssm_out", hidden, v_heads * d),
            ],
        };
        for (name, rows, cols) in mats {
            push(
                &format!("{name}.weight"),
                tensor(&[rows, cols], s(cols), 0.0, q8),
            );
        }
        if attends {
            // q/k norm weights of about 2 make attention sharp enough that positions matter.
            push("attn_q_norm.weight", tensor(&[hd], 0.5, 2.0, f32t));
            push("attn_k_norm.weight", tensor(&[hd], 0.5, 2.0, f32t));
        } else {
            push(
                "ssm_conv1d.weight",
                tensor(&[channels, conv], s(conv), 0.0, f32t),
            );
            push("ssm_dt.bias", tensor(&[v_heads], 0.5, 0.0, f32t));
            // −exp(A_log): decays between e^-1.5 and e^-0.5 a unit of softplus.
            push("ssm_a", tensor(&[v_heads], 0.5, -1.0, f32t));
            push("ssm_norm.weight", tensor(&[d], 0.2, 1.0, f32t));
        }
        if moe {
            push(
                "ffn_gate_inp.weight",
                tensor(&[experts, hidden], s(hidden), 0.0, f32t),
            );
            for (name, rows, cols) in [
                ("gate", expert_ffn, hidden),
                ("up", expert_ffn, hidden),
                ("down", hidden, expert_ffn),
            ] {
                push(
                    &format!("ffn_{name}_exps.weight"),
                    tensor(&[experts, rows, cols], s(cols), 0.0, q8),
                );
            }
            push(
                "ffn_gate_inp_shexp.weight",
                tensor(&[hidden], s(hidden), 0.0, f32t),
            );
            for (name, rows, cols) in [
                ("gate", shared_ffn, hidden),
                ("up", shared_ffn, hidden),
                ("down", hidden, shared_ffn),
            ] {
                push(
                    &format!("ffn_{name}_shexp.weight"),
                    tensor(&[rows, cols], s(cols), 0.0, q8),
                );
            }
        } else {
            push(
                "ffn_gate.weight",
                tensor(&[ffn, hidden], s(hidden), 0.0, q8),
            );
            push("ffn_up.weight", tensor(&[ffn, hidden], s(hidden), 0.0, q8));
            push("ffn_down.weight", tensor(&[hidden, ffn], s(ffn), 0.0, q8));
        }
    }
    let u = |v: usize| Value::U32(v as u32);
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(format!("kvchat random {arch}")),
        ),
        (format!("{arch}.block_count"), u(layers)),
        (format!("{arch}.context_length"), u(262144)),
        (format!("{arch}.embedding_length"), u(hidden)),
        (format!("{arch}.feed_forward_length"), u(ffn)),
        (format!("{arch}.attention.head_count"), u(heads)),
        (format!("{arch}.attention.head_count_kv"), u(kv_heads)),
        (format!("{arch}.attention.key_length"), u(hd)),
        (format!("{arch}.attention.value_length"), u(hd)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(10_000_000.0)),
        (format!("{arch}.rope.dimension_count"), u(hd / 4)),
        (
            format!("{arch}.rope.dimension_sections"),
            Value::Array(vec![
                Value::I32(3),
                Value::I32(3),
                Value::I32(2),
                Value::I32(0),
            ]),
        ),
        (format!("{arch}.full_attention_interval"), u(3)),
        (format!("{arch}.ssm.conv_kernel"), u(conv)),
        (format!("{arch}.ssm.inner_size"), u(v_heads * d)),
        (format!("{arch}.ssm.state_size"), u(d)),
        (format!("{arch}.ssm.time_step_rank"), u(v_heads)),
        (format!("{arch}.ssm.group_count"), u(k_heads)),
    ];
    if moe {
        md.extend([
            (format!("{arch}.expert_count"), u(experts)),
            (format!("{arch}.expert_used_count"), u(used)),
            (format!("{arch}.expert_feed_forward_length"), u(expert_ffn)),
            (
                format!("{arch}.expert_shared_feed_forward_length"),
                u(shared_ffn),
            ),
        ]);
    }
    write_with_tokenizer(path, md, &src, &tensors);
}
