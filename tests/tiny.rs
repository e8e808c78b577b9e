//! Tiny random models made in the test: loader paths the real model does not exercise (qwen2's q/k/v
//! biases, GQA, tied embeddings, quantized matrices) and the SentencePiece tokenizer.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use kvchat::generate::Session;
use kvchat::kv::CacheSpec;
use kvchat::model::gguf::GgufFile;
use kvchat::model::{Llama, Logits};
use kvchat::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::path::PathBuf;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 128;
const VOCAB: usize = 40;
const LAYERS: usize = 2;

/// Writes a random qwen2-architecture GGUF (biases on q/k/v, 4 heads sharing 2 KV heads, no
/// output.weight) with Q8_0 matrices, and returns its path.
fn write_tiny_qwen2(name: &str) -> PathBuf {
    let dev = Device::Cpu;
    let rand = |shape: &[usize], q: GgmlDType| {
        let t = Tensor::randn(0f32, 0.2, shape, &dev).unwrap();
        QTensor::quantize(&t, q).unwrap()
    };
    let ones = |n: usize| {
        QTensor::quantize(&Tensor::ones(n, DType::F32, &dev).unwrap(), GgmlDType::F32).unwrap()
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
                format!("{p}.attn_q.bias"),
                rand(&[HEADS * HEAD_DIM], GgmlDType::F32),
            ),
            (
                format!("{p}.attn_k.weight"),
                rand(&[KV_HEADS * HEAD_DIM, HIDDEN], q8),
            ),
            (
                format!("{p}.attn_k.bias"),
                rand(&[KV_HEADS * HEAD_DIM], GgmlDType::F32),
            ),
            (
                format!("{p}.attn_v.weight"),
                rand(&[KV_HEADS * HEAD_DIM, HIDDEN], q8),
            ),
            (
                format!("{p}.attn_v.bias"),
                rand(&[KV_HEADS * HEAD_DIM], GgmlDType::F32),
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
    }
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("qwen2".into())),
        ("qwen2.block_count", Value::U32(LAYERS as u32)),
        ("qwen2.context_length", Value::U32(128)),
        ("qwen2.embedding_length", Value::U32(HIDDEN as u32)),
        ("qwen2.feed_forward_length", Value::U32(FFN as u32)),
        ("qwen2.attention.head_count", Value::U32(HEADS as u32)),
        ("qwen2.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("qwen2.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("qwen2.rope.freq_base", Value::F32(10000.0)),
    ];
    let path = std::env::temp_dir().join(format!("kvchat-tiny-{name}-{}.gguf", std::process::id()));
    let mut f = std::fs::File::create(&path).unwrap();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    path
}

fn load(name: &str) -> Llama {
    let path = write_tiny_qwen2(name);
    GgufFile::open(&path)
        .unwrap()
        .load_llama(&Device::Cpu, 128)
        .unwrap()
}

fn session<'a>(m: &'a Llama, spec: &CacheSpec) -> Session<'a> {
    Session::new(m, spec.build(&m.cfg, DType::F32, &Device::Cpu), 128)
}

const FULL: CacheSpec = CacheSpec::Full { max_positions: 128 };

#[test]
fn qwen2_config_is_read_from_metadata() {
    let m = load("cfg");
    let c = &m.cfg;
    assert_eq!(
        (
            c.arch.as_str(),
            c.n_layer,
            c.n_head,
            c.n_kv_head,
            c.head_dim
        ),
        ("qwen2", 2, 4, 2, 16)
    );
    assert_eq!(c.rope_style, kvchat::model::config::RopeStyle::HalfSplit);
    assert!(m.layers[0].wq.b.is_some(), "qwen2 q bias not loaded");
}

#[test]
fn tiny_model_logits_are_identical_with_full_cache_and_recompute() {
    let m = load("eq");
    let tokens = [3u32, 17, 5, 9, 22, 1, 30, 8];
    let mut full = session(&m, &FULL);
    let mut none = session(&m, &CacheSpec::None);
    let mut a = full.feed(&tokens[..3]).unwrap();
    let mut b = none.feed(&tokens[..3]).unwrap();
    for &t in &tokens[3..] {
        a = full.feed(&[t]).unwrap();
        b = none.feed(&[t]).unwrap();
    }
    let (a, b): (Vec<f32>, Vec<f32>) = (a.to_vec1().unwrap(), b.to_vec1().unwrap());
    assert_eq!(a, b);
    assert_eq!(a.len(), VOCAB);
}

#[test]
fn tiny_model_prefill_logits_match_decode_at_every_position() {
    let m = load("pos");
    let tokens = [4u32, 11, 19, 2, 33, 7];
    let all = session(&m, &FULL).feed_with(&tokens, Logits::All).unwrap(); // [t, vocab]
    assert_eq!(all.dims(), &[tokens.len(), VOCAB]);
    let mut s = session(&m, &FULL);
    for (i, &t) in tokens.iter().enumerate() {
        let step: Vec<f32> = s.feed(&[t]).unwrap().to_vec1().unwrap();
        assert_eq!(
            all.get(i).unwrap().to_vec1::<f32>().unwrap(),
            step,
            "position {i}"
        );
    }
}

#[test]
fn full_cache_grows_in_place_and_truncates() {
    let m = load("grow");
    let mut s = session(&m, &FULL);
    s.feed(&[1, 2, 3]).unwrap();
    let per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4;
    assert_eq!(s.cache.bytes_used(), 3 * per_token);
    // Capacity is min(256, max_positions) = 128 positions, allocated once.
    assert_eq!(s.cache.bytes(), 128 * per_token);
    s.cache.truncate(1).unwrap();
    assert_eq!(s.cache.len(), 1);
    assert!(s.cache.truncate(5).is_err());
}

#[test]
fn sequence_past_max_positions_is_refused() {
    let m = load("full");
    let mut s = Session::new(&m, FULL.build(&m.cfg, DType::F32, &Device::Cpu), 4);
    s.feed(&[1, 2, 3]).unwrap();
    let err = s.feed(&[4, 5]).unwrap_err().to_string();
    assert!(err.contains("more than the context of 4"), "{err}");
}

/// A SentencePiece-style (tokenizer.ggml.model = llama) vocabulary, as GGUF metadata.
fn spm_content() -> gguf_file::Content {
    // (piece, score, type): 1 normal, 2 unknown, 3 control, 6 byte
    let vocab: &[(&str, f32, i32)] = &[
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
    let strings =
        |f: &dyn Fn(&(&str, f32, i32)) -> Value| Value::Array(vocab.iter().map(f).collect());
    let mut metadata = HashMap::new();
    metadata.insert(
        "tokenizer.ggml.model".to_string(),
        Value::String("llama".into()),
    );
    metadata.insert(
        "tokenizer.ggml.tokens".to_string(),
        strings(&|v| Value::String(v.0.into())),
    );
    metadata.insert(
        "tokenizer.ggml.scores".to_string(),
        strings(&|v| Value::F32(v.1)),
    );
    metadata.insert(
        "tokenizer.ggml.token_type".to_string(),
        strings(&|v| Value::I32(v.2)),
    );
    metadata.insert("tokenizer.ggml.bos_token_id".to_string(), Value::U32(1));
    metadata.insert("tokenizer.ggml.eos_token_id".to_string(), Value::U32(2));
    metadata.insert("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(0));
    gguf_file::Content {
        magic: gguf_file::VersionedMagic::GgufV3,
        metadata,
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    }
}

#[test]
fn sentencepiece_tokenizer_merges_by_score_and_prefixes_a_space() {
    let tk = Tokenizer::from_gguf(&spm_content()).unwrap();
    assert_eq!(tk.encode("hello").unwrap(), vec![14]); // "▁hello"
    assert_eq!(tk.decode(&[14], false).unwrap(), "hello");
    assert!(tk.add_bos, "llama tokenizers add BOS unless told otherwise");
    assert_eq!((tk.bos_id, tk.eos_id), (Some(1), Some(2)));
}

#[test]
fn sentencepiece_tokenizer_falls_back_to_bytes() {
    let tk = Tokenizer::from_gguf(&spm_content()).unwrap();
    let ids = tk.encode("hé").unwrap();
    assert_eq!(ids, vec![10, 3, 4]); // "▁h" <0xC3> <0xA9>
    assert_eq!(tk.decode(&ids, false).unwrap(), "hé");
}
