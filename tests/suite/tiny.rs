//! Tiny random models made in the test: loader paths the real model does not exercise (qwen2's q/k/v
//! biases, GQA, tied embeddings, quantized matrices) and the SentencePiece tokenizer.

use crate::common::tiny::*;
use candle_core::Device;
use kvchat::kv::CacheSpec;
use kvchat::model::gguf::GgufFile;
use kvchat::model::{Decoder, Logits};
use kvchat::session::Session;
use kvchat::tokenizer::Tokenizer;

fn load(name: &str) -> Decoder {
    let path = write_tiny_qwen2(name);
    GgufFile::open(&path)
        .unwrap()
        .load_decoder(&Device::Cpu, 128)
        .unwrap()
}

fn session<'a>(m: &'a Decoder, spec: &CacheSpec) -> Session<'a> {
    Session::new(m, spec.build(&m.cfg, None), 128)
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
    assert!(
        m.layers[0].attention().unwrap().wq.b.is_some(),
        "qwen2 q bias not loaded"
    );
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
    let mut s = Session::new(&m, FULL.build(&m.cfg, None), 4);
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

fn load_arch(name: &str, arch: &str) -> Decoder {
    let path = write_tiny_arch(name, arch, Vec::new());
    GgufFile::open(&path)
        .unwrap()
        .load_decoder(&Device::Cpu, 128)
        .unwrap()
}

#[test]
fn qwen3_and_gemma3_read_their_block_pieces_from_the_table() {
    let q = load_arch("cfg-qwen3", "qwen3");
    assert!(q.cfg.pieces.qk_norm && !q.cfg.pieces.post_norms && !q.cfg.pieces.embed_scale);
    assert!(
        q.layers[0].attention().unwrap().q_norm.is_some()
            && q.layers[0].attention().unwrap().wq.b.is_none()
    );
    assert_eq!(q.cfg.sliding_window, None);
    let g = load_arch("cfg-gemma3", "gemma3");
    let b = g.cfg.pieces;
    assert!(b.qk_norm && b.post_norms && b.embed_scale);
    assert_eq!(b.act, kvchat::model::config::Activation::GeluTanh);
    assert!(g.layers[1].post_ffn_norm.is_some());
    // Pattern 2: layer 0 is a sliding-window layer, layer 1 global; local layers rotate at 10,000.
    assert_eq!(g.cfg.sliding_window, Some((TINY_WINDOW, vec![true, false])));
    assert_eq!(g.cfg.layer_window(0), Some(TINY_WINDOW));
    assert_eq!(g.cfg.layer_window(1), None);
    assert_eq!(g.cfg.rope_base_local, Some(10_000.0));
    assert!(g.rope_local.is_some());
}

#[test]
fn qwen3_prefill_decode_and_recompute_give_the_same_logits() {
    let m = load_arch("eq-qwen3", "qwen3");
    let tokens: Vec<u32> = (0..20).map(|i| (i * 7 % VOCAB) as u32).collect();
    let (prefill, decode) = prefill_and_decode(&m, &FULL, &tokens, 128);
    let none = CacheSpec::none(kvchat::kv::Precision::F32);
    let (_, recompute) = prefill_and_decode(&m, &none, &tokens, 128);
    for i in 0..tokens.len() {
        assert_eq!(prefill[i], decode[i], "position {i}");
        assert_eq!(decode[i], recompute[i], "position {i}");
    }
}

#[test]
fn gemma3_past_its_window_prefill_decode_and_recompute_agree() {
    // 100 positions, far past layer 0's window of 8 and its 64 spare: the cache keeps 72 on that layer, the
    // recompute keeps none and masks the same window per query row, a prefill does it in one step.
    let m = load_arch("eq-gemma3", "gemma3");
    let tokens: Vec<u32> = (0..100).map(|i| (i * 11 % VOCAB) as u32).collect();
    let (prefill, decode) = prefill_and_decode(&m, &FULL, &tokens, 128);
    let none = CacheSpec::none(kvchat::kv::Precision::F32);
    let (_, recompute) = prefill_and_decode(&m, &none, &tokens, 128);
    for i in 0..tokens.len() {
        let d = crate::common::rel_diff(&decode[i], &recompute[i]);
        assert!(d < 1e-5, "position {i}: decode vs recompute differ by {d}");
        let p = crate::common::rel_diff(&prefill[i], &decode[i]);
        assert!(p < 1e-5, "position {i}: prefill vs decode differ by {p}");
    }
}

#[test]
fn gemma3_window_changes_the_answer_once_the_sequence_outgrows_it() {
    // The window is real: the same weights with layer 0's window made wider than the sequence agree
    // while the sequence fits in 8 positions, then differ.
    let path = write_tiny_arch("win-gemma3", "gemma3", Vec::new());
    let open = || {
        GgufFile::open(&path)
            .unwrap()
            .load_decoder(&Device::Cpu, 128)
            .unwrap()
    };
    let windowed = open();
    let mut wide = open();
    wide.cfg.sliding_window = Some((1000, vec![true, false]));
    let tokens: Vec<u32> = (0..16).map(|i| (i * 5 % VOCAB) as u32).collect();
    let (a, _) = prefill_and_decode(&windowed, &FULL, &tokens, 128);
    let (b, _) = prefill_and_decode(&wide, &FULL, &tokens, 128);
    for i in 0..tokens.len() {
        let d = crate::common::rel_diff(&a[i], &b[i]);
        if i < TINY_WINDOW {
            assert!(d < 1e-6, "position {i} fits the window, yet differs by {d}");
        } else {
            assert!(
                d > 1e-4,
                "position {i} is past the window, yet differs by only {d}"
            );
        }
    }
}

#[test]
fn gemma3_cache_keeps_only_the_window_on_its_local_layer() {
    let m = load_arch("bytes-gemma3", "gemma3");
    let mut s = session(&m, &FULL);
    let tokens: Vec<u32> = (0..100).map(|i| (i % VOCAB) as u32).collect();
    s.feed(&tokens).unwrap();
    // K and V, f32.
    let per_layer_position = 2 * KV_HEADS * HEAD_DIM * 4;
    // Layer 0 holds its window of 8 and the spare positions, layer 1 all 100.
    let local = TINY_WINDOW + kvchat::kv::DECLARED_WINDOW_SPARE;
    assert_eq!(
        s.cache().bytes_used(),
        (local + tokens.len()) * per_layer_position
    );
    assert_eq!(
        s.cache().bytes_used() as f64,
        kvchat::kv::size::KvDims::bytes_for_spec(&FULL, &m.cfg, tokens.len())
    );
    assert_eq!(
        s.cache().bytes_uniform(&m.cfg),
        (2 * tokens.len() * per_layer_position) as f64
    );
}

#[test]
fn gemma3_going_back_within_the_spare_positions_gives_the_same_logits_as_a_fresh_feed() {
    let m = load_arch("back-gemma3", "gemma3");
    let tokens: Vec<u32> = (0..100).map(|i| (i * 13 % VOCAB) as u32).collect();
    let fresh: Vec<f32> = session(&m, &FULL).feed(&tokens).unwrap().to_vec1().unwrap();
    let mut s = session(&m, &FULL);
    s.feed(&tokens).unwrap();
    // Back 20 positions (the layer keeps 8 + 64), then forward again over the same tokens.
    s.truncate(80).unwrap();
    let again: Vec<f32> = s.feed(&tokens[80..]).unwrap().to_vec1().unwrap();
    let d = crate::common::rel_diff(&again, &fresh);
    assert!(d < 1e-5, "differs by {d}");
    // Back to a position still held (the layer holds 28..100) but whose next query needs keys
    // 23..30, already dropped: refused, and nothing changes.
    let err = s.truncate(30).unwrap_err().to_string();
    assert!(err.contains("needs the 8 positions before it"), "{err}");
    assert_eq!(s.tokens().len(), 100);
    assert_eq!(s.cache().seen(), 100);
}

/// An IQ4_NL file (a type candle's reader refuses) loads: its matrices run on kvchat's kernels,
/// and its logits are those of the same weights dequantized to f32 (`--dtype f32`: read through
/// the same file, dequantized by the format) to the activations' 8-bit rounding. The same bytes
/// read as Q4_0 give other logits: the type really is read as IQ4_NL.
#[test]
fn an_iq4_nl_model_answers_as_its_weights_dequantized_to_f32() {
    let path = write_tiny_typed(
        "iq4nl",
        "llama",
        candle_core::quantized::GgmlDType::Q4_0,
        vec![],
    );
    let logits = |path: &std::path::Path, dense: Option<candle_core::DType>| -> Vec<f32> {
        let mut f = GgufFile::open(path).unwrap();
        f.dense = dense;
        let m = f.load_decoder(&Device::Cpu, 128).unwrap();
        let out = session(&m, &FULL).feed(&[3, 17, 5, 9, 22]).unwrap();
        out.to_vec1().unwrap()
    };
    let as_q4_0 = logits(&path, None);
    retype(&path, 2, 20);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(
        f.tensor_type("blk.0.attn_q.weight").map(|t| t.name()),
        Some("IQ4_NL".to_string())
    );
    let ours = logits(&path, None);
    let f32s = logits(&path, Some(candle_core::DType::F32));
    let scale = f32s.iter().fold(0f32, |a, v| a.max(v.abs()));
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |d, (x, y)| d.max((x - y).abs()));
    // Measured over 12 random models: 1.4-3.1 % of the largest logit (two layers of 8-bit
    // activations); the Q4_0 reading is off by 80-100 %.
    assert!(
        diff(&ours, &f32s) <= 0.06 * scale,
        "{} of {scale}",
        diff(&ours, &f32s)
    );
    assert!(
        diff(&as_q4_0, &f32s) > 0.5 * scale,
        "Q4_0's reading is another model"
    );
}
