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
            precision: kvchat::kv::Precision::F32,
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
        let (b, lb) = greedy(
            &CacheSpec::Window {
                precision: kvchat::kv::Precision::F32,
                window: 256,
                sinks,
            },
            &prompt,
            48,
        );
        assert_eq!(a, b, "sinks {sinks}");
        assert_eq!(la, lb, "sinks {sinks}: logits differ");
    }
}

#[test]
fn window_holds_sinks_plus_window_positions_at_any_length() {
    let e = engine();
    let spec = CacheSpec::Window {
        precision: kvchat::kv::Precision::F32,
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
        precision: kvchat::kv::Precision::F32,
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
    let full = ppl("full+f32");
    let int8 = ppl("int8");
    let window = ppl("window:64+4+f32");
    for half in ["full+f16", "full+bf16"] {
        let p = ppl(half);
        let rel = p.ppl / full.ppl - 1.0;
        // One chunk of 255 tokens: a regression guard. The precision targets are measured on a
        // >= 30 KB text by scripts/kv-precision-check.sh.
        let limit = if half == "full+f16" { 1e-2 } else { 2e-2 };
        assert!(rel.abs() < limit, "{half}: {p:?} vs f32 {full:?}");
    }
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
        err.contains("--kv-window and --kv-quant int8 cannot be combined"),
        "{err}"
    );
}

fn spec(mode: &str) -> CacheSpec {
    mode.parse::<kvchat::kv::CacheMode>()
        .unwrap()
        .spec(4096)
        .unwrap()
}

#[test]
fn f16_is_the_default_and_holds_half_the_bytes_of_f32() {
    let d = "full".parse::<kvchat::kv::CacheMode>().unwrap();
    assert_eq!(d.precision(), Some(kvchat::kv::Precision::F16));
    let e = engine();
    let prompt = chat_ids("What is the capital of France?");
    for (mode, per_token) in [
        ("full", 23_040),
        ("full+bf16", 23_040),
        ("full+f32", 46_080),
    ] {
        let mut s = e.session(&spec(mode));
        s.feed(&prompt).unwrap();
        assert_eq!(s.cache().bytes_used(), prompt.len() * per_token, "{mode}");
    }
}

#[test]
fn a_recompute_at_a_precision_gives_the_bits_of_the_cache_at_that_precision() {
    let prompt = chat_ids("Tell me a story about a cat.");
    for p in ["f16", "bf16"] {
        let (a, la) = greedy(&spec(&format!("full+{p}")), &prompt, 24);
        let (b, lb) = greedy(&spec(&format!("none+{p}")), &prompt, 24);
        assert_eq!(a, b, "{p}");
        assert_eq!(la, lb, "{p}: logits differ");
    }
}

#[test]
fn every_float_precision_combines_with_offload_exactly_and_with_a_window() {
    let prompt = chat_ids("What is a KV cache?");
    for p in ["f32", "f16", "bf16"] {
        let (a, la) = greedy(&spec(&format!("full+{p}")), &prompt, 32);
        let (b, lb) = greedy(&spec(&format!("offload+{p}")), &prompt, 32);
        assert!(a == b && la == lb, "offload+{p} differs from full+{p}");
        // A window wider than the whole sequence holds every position. It stores keys before
        // RoPE, so at f16/bf16 they are rounded before rotation rather than after: exact at f32,
        // within rounding otherwise.
        let (c, lc) = greedy(&spec(&format!("window:512+4+{p}")), &prompt, 32);
        if p == "f32" {
            assert!(a == c && la == lc, "window+f32 differs from full+f32");
        } else {
            // Compared after one step, before sampled tokens can part ways.
            let (_, l1) = greedy(&spec(&format!("full+{p}")), &prompt, 1);
            let (_, w1) = greedy(&spec(&format!("window:512+4+{p}")), &prompt, 1);
            let d = rel_diff(&w1, &l1);
            // (f16 against f32 itself moves them ~4%: Q8_1 activation rounding amplifies any
            // change. A wrong rotation would move them by far more.)
            assert!(
                d < 5e-2,
                "window+{p}: logits {d} of their scale from full+{p}"
            );
            let _ = (c, lc);
        }
    }
}

#[test]
fn the_kv_type_flag_combines_with_window_and_offload_but_int8_does_not_yet() {
    use clap::Parser;
    let mode = |flags: &[&str]| {
        let mut args = vec!["kvchat", "run"];
        args.extend_from_slice(flags);
        args.push("hi");
        let kvchat::cli::Command::Run(r) = kvchat::cli::Cli::try_parse_from(args).unwrap().command
        else {
            unreachable!()
        };
        r.cache.mode().map(|m| m.to_string())
    };
    assert_eq!(mode(&[]).unwrap(), "full");
    assert_eq!(mode(&["--kv-type", "f32"]).unwrap(), "full+f32");
    assert_eq!(
        mode(&["--kv-type", "bf16", "--kv-window", "64"]).unwrap(),
        "window:64+4+bf16"
    );
    assert_eq!(
        mode(&["--kv-type", "f32", "--kv-offload"]).unwrap(),
        "offload+f32"
    );
    assert_eq!(mode(&["--kv-quant", "int8"]).unwrap(), "int8");
    assert_eq!(mode(&["--kv-type", "int8"]).unwrap(), "int8");
    let err = mode(&["--kv-type", "int8", "--kv-window", "64"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot be combined (yet)"), "{err}");
    let err = mode(&["--kv-quant-residual", "8"]).unwrap_err().to_string();
    assert!(err.contains("int8 cache only"), "{err}");
}
