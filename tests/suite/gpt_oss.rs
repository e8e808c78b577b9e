//! gpt-oss (issue 34) against llama.cpp and against itself, on a random-weight `gpt-oss` model the
//! test writes (`crate::common::tiny::write_random_gpt_oss`: the same bytes on every machine,
//! checked by sha256): MXFP4 experts routed 4 of 8, learned sinks, a window on every other layer,
//! biases, YaRN.

use crate::common::tiny::prefill_and_decode;
use candle_core::Device;
use kvchat::kv::CacheSpec;
use kvchat::model::gguf::GgufFile;
use kvchat::model::Decoder;

/// sha256 of the file `write_random_gpt_oss` writes: if it changes, the reference below must be
/// measured again on the new file.
const FILE_SHA256: &str = "4d0faa81dd3a231ce2a55508882625bd290d7ad117e7620e036cc96a3741caff";

/// The random model, written once per test run (the tests of this file share it).
fn random_gpt_oss() -> std::path::PathBuf {
    static PATH: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    crate::common::tiny::written_once(
        &PATH,
        "random-gpt-oss.gguf",
        crate::common::tiny::write_random_gpt_oss,
    )
}

#[test]
fn gpt_oss_perplexity_is_within_half_a_percent_of_llama_perplexity_on_the_same_file() {
    let p = crate::common::tiny::pinned_perplexity(&random_gpt_oss(), FILE_SHA256);
    // llama-perplexity -m target/tmp/random-gpt-oss.gguf -f assets/bench-text.txt -c 256 -t 2 --no-repack
    //   → Final estimate: PPL = 1051637.1563 +/- 82289.48022 (8 chunks; kvchat measured 1051754.61)
    // (Its repacked default crashes on this VM's AMX now and then.) The figure depends on each
    // piece: llama.cpp itself gives 1,178,455 (+12 %) with --rope-scaling none (no YaRN),
    // 1,126,515 (+7.1 %) with the window widened past the text, 1,053,444 (+0.17 %) with 3
    // experts a token instead of 4.
    let reference = 1051637.1563;
    assert!(
        (p / reference - 1.0).abs() < 0.005,
        "kvchat {p:.4} vs llama.cpp {reference}"
    );
}

fn load() -> Decoder {
    GgufFile::open(&random_gpt_oss())
        .unwrap()
        .load_decoder(&Device::Cpu, 256)
        .unwrap()
}

#[test]
fn gpt_oss_reads_its_pieces_from_the_table_and_the_file() {
    let m = load();
    let c = &m.cfg;
    assert!(c.pieces.moe && c.pieces.attn_sinks);
    assert_eq!(c.pieces.ffn_norm, "post_attention_norm");
    let e = c.experts.unwrap();
    assert_eq!((e.count, e.used, e.ffn), (8, 4, 256));
    assert_eq!(c.sliding_window, Some((64, vec![true, false])));
    let y = c.yarn.unwrap();
    assert_eq!(
        (y.factor, y.orig_ctx, y.beta_fast, y.beta_slow),
        (32.0, 4096, 32.0, 1.0)
    );
    let l = &m.layers[0];
    let a = l.attention().unwrap();
    assert_eq!(a.sinks.as_ref().map(Vec::len), Some(4));
    assert!(a.wq.b.is_some() && a.wo.b.is_some());
    match &l.ffn {
        kvchat::model::decoder::Ffn::Moe(moe) => {
            assert_eq!(moe.experts.len(), 8);
            let x = &moe.experts[3];
            assert_eq!(
                x.down.dtype(),
                kvchat::model::kernels::quant::WeightType::MXFP4
            );
            assert_eq!(x.down.dims(), (256, 256));
            assert_eq!((x.gate_up_b.len(), x.down_b.len()), (512, 256));
        }
        _ => panic!("layer 0's FFN is not a mixture of experts"),
    }
}

#[test]
fn gpt_oss_past_its_window_prefill_decode_and_recompute_give_the_same_logits() {
    // 150 positions: past layer 0's window of 64 and the 64 spare positions its cache keeps.
    let m = load();
    let tokens: Vec<u32> = (0..150).map(|i| (i * 7919 % 49152) as u32).collect();
    let full = CacheSpec::full(kvchat::kv::Precision::F32, 256);
    let (prefill, decode) = prefill_and_decode(&m, &full, &tokens, 256);
    let none = CacheSpec::none(kvchat::kv::Precision::F32);
    let (_, recompute) = prefill_and_decode(&m, &none, &tokens, 256);
    for i in 0..tokens.len() {
        assert_eq!(prefill[i], decode[i], "position {i}: prefill vs decode");
        assert_eq!(decode[i], recompute[i], "position {i}: decode vs recompute");
    }
}

/// A copy of the random model, changed by `damage`, for a hostile-input test.
fn damaged(name: &str, damage: impl FnOnce(&mut Vec<u8>)) -> std::path::PathBuf {
    crate::common::tiny::damaged(&random_gpt_oss(), name, damage)
}

use crate::common::tiny::{set_f32, set_u32};

fn run(path: &std::path::Path) -> std::process::Output {
    crate::common::tiny::run_two_tokens(path, &[])
}

#[test]
fn an_expert_count_of_zero_or_fewer_experts_than_routed_is_refused_in_one_line() {
    let zero = damaged("goss-zero-experts", |b| {
        set_u32(b, "gpt-oss.expert_count", 0)
    });
    crate::common::assert_refused(&run(&zero), "expert_count = 0 with expert_used_count = 4");
    let over = damaged("goss-topk-over", |b| {
        set_u32(b, "gpt-oss.expert_used_count", 9)
    });
    crate::common::assert_refused(&run(&over), "expert_count = 8 with expert_used_count = 9");
}

#[test]
fn mxfp4_experts_cut_short_are_named_with_their_tensor_and_type() {
    // The file ends with blk.1's down experts (8 × 256 × 256 in MXFP4: 278,528 bytes) and their
    // bias (8 KiB).
    let short = damaged("goss-short", |b| b.truncate(b.len() - 20_000));
    let o = run(&short);
    crate::common::assert_refused(&o, "cannot read tensor blk.1.ffn_down_exps.weight");
    crate::common::assert_refused(&o, "its MXFP4 blocks need 278528 bytes at offset");
}

/// kv-size by kind, against the file's metadata by hand: 2 layers × 2 KV heads × 64 × (K and V)
/// × 2 bytes = 1,024 bytes a token; at 4,096 tokens the full layer holds 4096 × 512 B = 2 MiB and
/// the windowed one its 64 positions plus the 64 spare the cache keeps, 128 × 512 B = 64 KiB:
/// 2.0625 MiB against 4 MiB uniform.
#[test]
fn kv_size_counts_the_windowed_layers_by_what_they_keep() {
    let path = random_gpt_oss();
    let o = crate::common::kvchat(
        &["kv-size", "-m", path.to_str().unwrap(), "--ctx", "4096"],
        "",
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("f16: 1,024 bytes (1.00 KiB) per token, 4.00 MiB per user"),
        "{out}"
    );
    assert!(
        out.contains(
            "sliding-window layers: 1 of 2 attend within 64 positions (and keep 128): 2.06 MiB per user at 4096 tokens against 4.00 MiB"
        ),
        "{out}"
    );
    assert_eq!(kvchat::kv::DECLARED_WINDOW_SPARE, 64);
}

/// Sets the first f32 of tensor `name` in a copy of the random model to NaN.
fn with_nan(name: &str) -> std::path::PathBuf {
    let types = kvchat::model::gguf_types::tensor_types(&random_gpt_oss()).unwrap();
    // Each tensor's type field is followed by its data offset (u64); the data starts at the
    // first multiple of the alignment (32) after the last tensor's entry.
    let start = (types.iter().map(|t| t.at).max().unwrap() + 12).next_multiple_of(32);
    let field = types.iter().find(|t| t.name == name).unwrap().at as usize;
    damaged(&format!("goss-nan-{name}"), |b| {
        let off = u64::from_le_bytes(b[field + 4..][..8].try_into().unwrap());
        let at = (start + off) as usize;
        b[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    })
}

#[test]
fn a_nan_sink_logit_is_named_at_load() {
    let o = run(&with_nan("blk.0.attn_sinks.weight"));
    crate::common::assert_refused(&o, "tensor blk.0.attn_sinks.weight in ");
    crate::common::assert_refused(&o, "holds NaN, not a number a model can use");
}

#[test]
fn a_nan_in_the_weights_is_refused_at_the_first_token_not_answered() {
    // A NaN weight of the final norm makes one dimension NaN, and so every logit.
    let o = run(&with_nan("output_norm.weight"));
    crate::common::assert_refused(&o, "non-finite logit (NaN for token 0)");
}

/// gpt-oss's chat template (OpenAI's Harmony format, from the vendored llama.cpp's
/// models/templates/openai-gpt-oss-120b.jinja; Apache-2.0 as the model's repository).
const GPT_OSS_TEMPLATE: &str = include_str!("../data/gpt-oss-chat-template.jinja");

#[test]
fn gpt_oss_chat_template_renders_through_minijinja_as_jinja2_does() {
    use kvchat::template::{ChatTemplate, Message};
    let t = ChatTemplate::new(GPT_OSS_TEMPLATE, "", "").unwrap();
    let messages = [
        Message::new("system", "S"),
        Message::new("user", "hi"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "again"),
    ];
    // Python's jinja2 (transformers' settings: ImmutableSandboxedEnvironment, trim_blocks,
    // lstrip_blocks, loopcontrols; strftime_now giving kvchat's fixed date) renders exactly this.
    let want = "<|start|>system<|message|>You are ChatGPT, a large language model trained by \
                OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2024-07-26\n\nReasoning: medium\
                \n\n# Valid channels: analysis, commentary, final. Channel must be included for \
                every message.<|end|><|start|>developer<|message|># Instructions\n\nS\n\n<|end|>\
                <|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>\
                Hello!<|end|><|start|>user<|message|>again<|end|><|start|>assistant";
    assert_eq!(t.render(&messages, true).unwrap(), want);
}

#[test]
fn experts_asked_to_run_dequantized_are_refused_in_one_line() {
    let path = random_gpt_oss();
    let o = crate::common::kvchat(
        &[
            "run",
            "-m",
            path.to_str().unwrap(),
            "--dtype",
            "f32",
            "--raw",
            "hi",
        ],
        "",
    );
    crate::common::assert_refused(&o, "a mixture-of-experts model cannot be dequantized");
}

#[test]
fn unusable_yarn_or_window_metadata_is_refused_in_one_line() {
    let shrink = damaged("goss-yarn-half", |b| {
        set_f32(b, "gpt-oss.rope.scaling.factor", 0.5)
    });
    crate::common::assert_refused(
        &run(&shrink),
        "YaRN scaling factor 0.5 over an original context of 4096 is not usable",
    );
    let no_ctx = damaged("goss-yarn-ctx0", |b| {
        set_u32(b, "gpt-oss.rope.scaling.original_context_length", 0)
    });
    crate::common::assert_refused(&run(&no_ctx), "over an original context of 0 is not usable");
    let no_window = damaged("goss-window0", |b| {
        set_u32(b, "gpt-oss.attention.sliding_window", 0)
    });
    crate::common::assert_refused(
        &run(&no_window),
        "sliding window of 0 over 2 of 2 layers is not a usable pattern",
    );
}

#[test]
fn experts_of_another_shape_than_the_metadata_says_are_named() {
    let wide = damaged("goss-expert-ffn", |b| {
        set_u32(b, "gpt-oss.expert_feed_forward_length", 128)
    });
    crate::common::assert_refused(
        &run(&wide),
        "tensor blk.0.ffn_gate_exps.weight has shape [8, 256, 256], expected [8, 128, 256]",
    );
}
