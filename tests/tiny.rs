//! Tiny random models made in the test: loader paths the real model does not exercise (qwen2's q/k/v
//! biases, GQA, tied embeddings, quantized matrices) and the SentencePiece tokenizer.

mod common;

use candle_core::Device;
use common::tiny::*;
use kvchat::kv::CacheSpec;
use kvchat::model::gguf::GgufFile;
use kvchat::model::{Llama, Logits};
use kvchat::session::Session;
use kvchat::tokenizer::Tokenizer;

fn load(name: &str) -> Llama {
    let path = write_tiny_qwen2(name);
    GgufFile::open(&path)
        .unwrap()
        .load_llama(&Device::Cpu, 128)
        .unwrap()
}

fn session<'a>(m: &'a Llama, spec: &CacheSpec) -> Session<'a> {
    Session::new(m, spec.build(&m.cfg, &Device::Cpu), 128)
}

const FULL: CacheSpec = CacheSpec::full(kvchat::kv::Precision::F32, 128);

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
    let mut none = session(&m, &CacheSpec::none(kvchat::kv::Precision::F32));
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
    assert_eq!(s.cache().bytes_used(), 3 * per_token);
    // Capacity is min(256, max_positions) = 128 positions, allocated once.
    assert_eq!(s.cache().bytes(), 128 * per_token);
    s.truncate(1).unwrap();
    assert_eq!(s.cache().len(), 1);
    // Truncating to more than is held changes nothing.
    s.truncate(5).unwrap();
    assert_eq!(s.cache().len(), 1);
}

#[test]
fn sequence_past_max_positions_is_refused() {
    let m = load("full");
    let mut s = Session::new(&m, FULL.build(&m.cfg, &Device::Cpu), 4);
    s.feed(&[1, 2, 3]).unwrap();
    let err = s.feed(&[4, 5]).unwrap_err().to_string();
    assert!(err.contains("more than the context of 4"), "{err}");
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
