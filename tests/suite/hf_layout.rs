//! The safetensors (HF layout) path against the GGUF path on the real model: the fixture is the
//! SmolLM2 GGUF dequantized to f32 with Q/K rows put back in HF's rotary order
//! (`kvchat::model::export`, also `scripts/make-hf-fixture.sh`).

use crate::common::{engine, model_path, rel_diff};
use kvchat::engine::Engine;
use kvchat::engine::LoadOptions;
use kvchat::kv::CacheSpec;
use kvchat::session::{Sampler, SamplingParams};
use kvchat::template::Message;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The HF-layout fixture, written once per test run into the target directory.
fn fixture_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("smollm2-135m-hf");
        let _ = std::fs::remove_dir_all(&dir);
        kvchat::model::export::gguf_to_hf(&model_path(), &dir).expect("exporting the fixture");
        dir
    })
    .clone()
}

fn hf_engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        Engine::load(&LoadOptions {
            ctx: Some(4096),
            ..LoadOptions::for_path(fixture_dir())
        })
        .expect("loading the safetensors fixture")
    })
}

/// The same GGUF with every matrix dequantized to f32 at load (`--dtype f32`): the GGUF path with
/// the HF path's arithmetic, so the two differ only in layout handling.
fn gguf_f32_engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        Engine::load(&LoadOptions {
            ctx: Some(4096),
            dtype: Some(candle_core::DType::F32),
            ..LoadOptions::for_path(model_path())
        })
        .expect("loading the GGUF dequantized")
    })
}

#[test]
fn a_dequantized_gguf_says_so_and_has_its_own_digest() {
    assert_eq!(gguf_f32_engine().weights(), "f32 (dequantized at load)");
    assert_eq!(engine().weights(), "quantized");
    assert_ne!(gguf_f32_engine().digest(), engine().digest());
}

fn full() -> CacheSpec {
    crate::common::full()
}

/// Greedy tokens of `e` after `prompt`, and the logits of the prompt's last position.
fn greedy(e: &Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut s = e.session(&full());
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let mut logits = s.feed(prompt).unwrap();
    let first = logits.to_vec1().unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = sampler.sample(&logits, s.tokens()).unwrap();
        out.push(next);
        logits = s.feed(&[next]).unwrap();
    }
    (out, first)
}

fn prompts() -> Vec<Vec<u32>> {
    let e = engine();
    let t = e.chat_template(None).unwrap();
    vec![
        e.raw_prompt("The capital of France is").unwrap(),
        e.chat_prompt(
            &t,
            &[Message::new("user", "Name three colours of the rainbow.")],
        )
        .unwrap(),
    ]
}

#[test]
fn safetensors_next_token_logits_are_within_2e_2_of_gguf_dequantized() {
    for p in prompts() {
        let (_, gguf) = greedy(gguf_f32_engine(), &p, 0);
        let (_, hf) = greedy(hf_engine(), &p, 0);
        let d = rel_diff(&hf, &gguf);
        eprintln!("safetensors vs GGUF (--dtype f32): relative logit difference {d:e}");
        assert!(d < 2e-2, "relative logit difference {d}");
    }
}

#[test]
fn safetensors_and_gguf_dequantized_give_the_same_16_greedy_tokens_on_two_prompts() {
    for p in prompts() {
        let (gguf, _) = greedy(gguf_f32_engine(), &p, 16);
        let (hf, _) = greedy(hf_engine(), &p, 16);
        assert_eq!(
            engine().tokenizer().decode(&hf, false).unwrap(),
            engine().tokenizer().decode(&gguf, false).unwrap()
        );
    }
}

/// The default GGUF path quantizes activations to Q8_1 for its Q4_1 matrices (as llama.cpp does);
/// against f32 arithmetic that costs a few percent of the logit scale, no more.
#[test]
fn safetensors_logits_stay_within_5e_2_of_the_quantized_gguf_path() {
    for p in prompts() {
        let (_, gguf) = greedy(engine(), &p, 0);
        let (_, hf) = greedy(hf_engine(), &p, 0);
        let d = rel_diff(&hf, &gguf);
        eprintln!("safetensors vs GGUF (quantized): relative logit difference {d:e}");
        assert!(d < 5e-2, "relative logit difference {d}");
    }
}

#[test]
fn tokenizer_json_gives_the_same_ids_as_the_gguf_tokenizer() {
    for text in [
        "Hello, world!",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
        "Ünïcödé, emoji 🦀 and numbers 12345 and   spaces\tand\ttabs",
    ] {
        assert_eq!(
            hf_engine().tokenizer().encode(text).unwrap(),
            engine().tokenizer().encode(text).unwrap(),
            "{text}"
        );
    }
    assert_eq!(hf_engine().stop_ids(), engine().stop_ids());
}

#[test]
fn safetensors_chat_template_is_read_from_tokenizer_config() {
    let m = [Message::new("user", "hi")];
    let hf = hf_engine().chat_template(None).unwrap();
    let gguf = engine().chat_template(None).unwrap();
    assert_eq!(hf.render(&m, true).unwrap(), gguf.render(&m, true).unwrap());
}

#[test]
fn bf16_weights_keep_the_logits_close() {
    let e = Engine::load(&LoadOptions {
        ctx: Some(256),
        dtype: Some(candle_core::DType::BF16),
        ..LoadOptions::for_path(fixture_dir())
    })
    .unwrap();
    assert_eq!(e.weights(), "bf16");
    let p = &prompts()[0];
    let (_, bf16) = greedy(&e, p, 0);
    let (_, f32) = greedy(hf_engine(), p, 0);
    let d = rel_diff(&bf16, &f32);
    assert!(d < 5e-2, "bf16 vs f32 relative logit difference {d}");
}
