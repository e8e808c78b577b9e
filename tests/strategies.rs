//! The cache strategies on the real model: exactness where it is owed, bounded memory, and the price in
//! perplexity of each.

mod common;

use common::{chat_ids, engine, full, greedy, rel_diff};
use kvchat::commands::ppl::perplexity;
use kvchat::kv::CacheSpec;

const F32_PER_TOKEN: usize = 46_080; // 2 × 30 layers × 3 KV heads × 64 × 4 bytes

#[test]
fn offload_on_cpu_gives_bit_identical_output_to_full() {
    let prompt = chat_ids("What is the capital of France?");
    let (a, la) = greedy(&full(), &prompt, 48);
    let (b, lb) = greedy(
        &CacheSpec::Offload {
            max_positions: 4096,
        },
        &prompt,
        48,
    );
    assert_eq!(a, b);
    assert_eq!(la, lb);
}

#[test]
fn window_longer_than_the_sequence_gives_full_cache_output() {
    let prompt = chat_ids("Tell me about caches");
    let (a, la) = greedy(&full(), &prompt, 48);
    for sinks in [0, 4] {
        let (b, lb) = greedy(&CacheSpec::Window { window: 256, sinks }, &prompt, 48);
        assert_eq!(a, b, "sinks {sinks}");
        assert_eq!(la, lb, "sinks {sinks}: logits differ");
    }
}

#[test]
fn window_holds_sinks_plus_window_positions_at_any_length() {
    let e = engine();
    let spec = CacheSpec::Window {
        window: 32,
        sinks: 4,
    };
    let mut s = e.session(&spec);
    let prompt = e
        .raw_prompt(&"the cache keeps a window ".repeat(12))
        .unwrap();
    s.feed(&prompt).unwrap();
    let after_prompt = s.cache().bytes();
    for i in 0..40u32 {
        s.feed(&[100 + i]).unwrap();
    }
    assert_eq!(s.cache().seen(), prompt.len() + 40);
    assert_eq!(s.cache().len(), 36);
    assert_eq!(s.cache().bytes_used(), 36 * F32_PER_TOKEN);
    assert_eq!(s.cache().bytes(), after_prompt, "a window must not grow");
}

#[test]
fn window_refuses_to_truncate_to_a_position_it_no_longer_holds() {
    let e = engine();
    let mut s = e.session(&CacheSpec::Window {
        window: 16,
        sinks: 4,
    });
    s.feed(&e.raw_prompt(&"a b c d ".repeat(20)).unwrap())
        .unwrap();
    let seen = s.cache().seen();
    s.truncate(seen - 5).unwrap();
    assert_eq!(s.cache().seen(), seen - 5);
    let err = s.truncate(10).unwrap_err().to_string();
    assert!(err.contains("no longer holds position 10"), "{err}");
}

#[test]
fn int8_holds_at_most_0_27_of_f32_and_0_53_of_f16_per_token() {
    let e = engine();
    let spec = CacheSpec::Int8 {
        max_positions: 4096,
        residual: 32,
    };
    let mut s = e.session(&spec);
    let text = kvchat::commands::bench::BENCH_TEXT.to_string();
    let ids = e.tokenizer.encode(&text).unwrap();
    // Two lengths 5 key groups apart, with the same f32 tail: the bytes between are all INT8.
    s.feed(&ids[..300]).unwrap();
    s.feed(&ids[300..301]).unwrap();
    let (n1, b1) = (s.cache().len(), s.cache().bytes_used());
    s.feed(&ids[301..941]).unwrap();
    s.feed(&ids[941..942]).unwrap();
    let (n2, b2) = (s.cache().len(), s.cache().bytes_used());
    assert_eq!(n2 - n1, 641);
    let per_token = (b2 - b1) as f64 / 640.0;
    assert!(
        per_token <= 0.27 * F32_PER_TOKEN as f64,
        "{per_token} bytes/token"
    );
    assert!(
        per_token <= 0.53 * (F32_PER_TOKEN / 2) as f64,
        "{per_token} bytes/token"
    );
    // And the f32 tail stays bounded: at most residual + group − 1 + the step.
    let f32_part = b2 as f64 - per_token * n2 as f64;
    assert!(
        f32_part <= ((32 + 128) * F32_PER_TOKEN) as f64,
        "{f32_part}"
    );
}

#[test]
fn int8_next_token_logits_stay_close_to_full() {
    let e = engine();
    let text = kvchat::commands::bench::BENCH_TEXT.to_string();
    let ids = e.tokenizer.encode(&text).unwrap();
    let prompt = &ids[..700];
    let last = |spec: &CacheSpec| -> Vec<f32> {
        let mut s = e.session(spec);
        s.feed(&prompt[..400]).unwrap();
        let mut l = s.feed(&[prompt[400]]).unwrap();
        for &t in &prompt[401..] {
            l = s.feed(&[t]).unwrap();
        }
        l.to_vec1().unwrap()
    };
    let a = last(&full());
    let b = last(&CacheSpec::Int8 {
        max_positions: 4096,
        residual: 32,
    });
    let d = rel_diff(&b, &a);
    assert!(d > 0.0, "int8 must actually quantize something");
    assert!(d < 0.05, "int8 logits differ by {d} relative");
}

#[test]
fn perplexity_of_each_strategy_is_reported_and_int8_costs_little() {
    let e = engine();
    let text = kvchat::commands::bench::BENCH_TEXT.to_string();
    let ids = e.tokenizer.encode(&text).unwrap();
    let ppl = |mode: &str| perplexity(e, mode.parse().unwrap(), &ids, 512, 1, false).unwrap();
    let full = ppl("full");
    let int8 = ppl("int8");
    let window = ppl("window:64");
    assert_eq!(full.tokens_scored, 255);
    assert!(full.ppl > 1.0 && full.ppl < 100.0, "{full:?}");
    assert!(
        (int8.ppl / full.ppl - 1.0).abs() < 0.05,
        "int8 {int8:?} vs full {full:?}"
    );
    // A 64-token window forgets most of the 256-token context it is scored on.
    assert!(window.ppl > full.ppl, "window {window:?} vs full {full:?}");
}

#[test]
fn combining_unsupported_strategies_is_an_error() {
    use clap::Parser;
    let cli = kvchat::cli::Cli::try_parse_from([
        "kvchat",
        "run",
        "--kv-window",
        "64",
        "--kv-quant",
        "int8",
        "hi",
    ])
    .unwrap();
    let kvchat::cli::Command::Run(args) = cli.command else {
        unreachable!()
    };
    let err = args.cache.mode().unwrap_err().to_string();
    assert!(
        err.contains("--kv-window and --kv-quant cannot be combined"),
        "{err}"
    );
}
