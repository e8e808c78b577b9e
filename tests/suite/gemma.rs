//! Gemma 3 270M (Q4_K_M, the registry's gemma3-270m: four PyPI wheels joined by the pip-parts
//! source) against llama.cpp on the same file. Reference figures come from the llama.cpp that
//! `scripts/llamacpp.sh` builds (llama-cpp-python 0.3.36's vendored sources); the command that
//! produced each is beside it. `scripts/test.sh` pulls the model (`kvchat models pull gemma3-270m`).

use kvchat::engine::{Engine, LoadOptions};
use kvchat::kv::size::KvDims;
use kvchat::kv::{CacheSpec, Precision};
use std::path::PathBuf;
use std::sync::OnceLock;

fn gemma_path() -> PathBuf {
    let p = kvchat::source::kvchat_home()
        .join("models")
        .join("gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "Gemma 3 270M is missing at {}: run `kvchat models pull gemma3-270m` (scripts/test.sh does)",
        p.display()
    );
    p
}

fn gemma() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        Engine::load(&LoadOptions {
            ctx: Some(8192),
            ..LoadOptions::for_path(gemma_path())
        })
        .expect("loading Gemma 3 270M")
    })
}

#[test]
fn gemma3_token_ids_equal_llama_tokenize_on_varied_text() {
    // llama-tokenize -m gemma-3-270m-q4_k_m.gguf -p "$s" --ids --log-disable --no-escape
    // (its leading BOS, id 2, dropped: kvchat tokenize prints the text's ids).
    let cases: &[(&str, &[u32])] = &[
        ("Hello, world!", &[9259, 236764, 1902, 236888]),
        (
            "  leading spaces and\ta tab",
            &[138, 26016, 9952, 532, 255968, 236746, 6937],
        ),
        (
            "東京は日本の首都です。北京是中国的首都。",
            &[
                31414, 237048, 76444, 120211, 3652, 236924, 32707, 237026, 110323, 120211, 236924,
            ],
        ),
        (
            "emoji 🤖🚀 and flags 🇫🇷 ok",
            &[
                67906, 236743, 246143, 242015, 532, 22680, 236743, 246598, 242644, 7546,
            ],
        ),
        (
            "fn main() {\n    println!(\"{}\", 1 + 2);\n}",
            &[
                15059, 1689, 825, 642, 107, 140, 4629, 183228, 236743, 236770, 900, 236743, 236778,
                626, 107, 236783,
            ],
        ),
        (
            "naïve café – “quotes” — dash",
            &[
                1789, 238527, 560, 33443, 1271, 999, 52231, 236919, 2192, 31498,
            ],
        ),
        (
            "1234567890 3.14159 1e-9",
            &[
                236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771,
                236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 236743, 236770,
                236744, 236772, 236819,
            ],
        ),
        ("<start_of_turn>user not special", &[105, 2364, 711, 2803]),
        ("   ", &[139]),
        (
            "Ünïcödé ß ẞ ﬁ",
            &[
                238194, 236749, 238527, 236755, 55515, 236859, 114881, 65894, 97940,
            ],
        ),
        ("مرحبا بالعالم", &[236873, 150345, 107602, 17193]),
        ("a\\nb\\\\c", &[236746, 236785, 7814, 4084, 236755]),
        // Runs of newlines and tabs are user-defined tokens, cut out before merging.
        (
            "line one\n\nline two\n\n\n\nend",
            &[1257, 886, 108, 1257, 1156, 110, 643],
        ),
        (
            "\t\tindented\n\t\t\tdeeper",
            &[255969, 724, 16764, 107, 255970, 893, 13462],
        ),
        // A control token's text, and HTML tags (normal tokens here).
        (
            "text with <unused5> inside and <b>html</b>",
            &[1005, 607, 236743, 11, 4888, 532, 236743, 200, 3185, 209],
        ),
        // A byte token's spelling typed as text is text.
        (
            "<0x0A> literal byte token",
            &[
                236820, 236771, 236781, 236771, 236776, 236813, 37087, 16812, 8369,
            ],
        ),
    ];
    let tk = &gemma().tokenizer();
    for (text, want) in cases {
        assert_eq!(tk.encode(text).unwrap(), *want, "{text:?}");
    }
    assert!(
        tk.add_bos && tk.bos_id == Some(2),
        "Gemma prompts start with <bos>"
    );
}

#[test]
fn gemma3_answers_keep_their_newlines_and_tabs_when_special_tokens_are_left_out() {
    // "\n", "\n\n" and tab runs are user-defined tokens: text, not control tokens.
    let tk = &gemma().tokenizer();
    let text = "Steps:\n\n1. one\n\t2. two";
    let ids = tk.encode(text).unwrap();
    assert!(ids.contains(&108), "\\n\\n is one token: {ids:?}");
    assert_eq!(tk.decode(&ids, true).unwrap(), text);
    let with_turn = [&[105u32][..], &ids, &[106]].concat(); // <start_of_turn> … <end_of_turn>
    assert_eq!(tk.decode(&with_turn, true).unwrap(), text);
}

/// kvchat's perplexity of the bundled bench text in `max_chunks` chunks of `chunk`, each chunk in
/// one prefill as llama-perplexity batches it. The tokens scored are those `kvchat ppl` scores one
/// decode step at a time; the values differ from its by rounding only. A prefill of 1024 runs in
/// the forward's 512-position steps, so its sliding-window layers drop their oldest rows between
/// steps; the cache's own decode past the window is checked by the windowed-cache test below.
fn ppl(chunk: usize, max_chunks: usize) -> f64 {
    let e = gemma();
    let ids = e
        .tokenizer()
        .encode(kvchat::eval::bench::BENCH_TEXT)
        .unwrap();
    kvchat::eval::ppl::perplexity_prefilled(e, &ids, chunk, max_chunks)
        .unwrap()
        .ppl
}

#[test]
fn gemma3_perplexity_is_within_1_percent_of_llama_perplexity_at_512() {
    // llama-perplexity -m gemma-3-270m-q4_k_m.gguf -f assets/bench-text.txt -c 512 --chunks 2 -t 2
    //   → Final estimate: PPL = 10.2420 +/- 1.25986 (all 4 chunks: 10.1775; two keep the suite short)
    let reference = 10.2420;
    let p = ppl(512, 2);
    assert!(
        (p / reference - 1.0).abs() < 0.01,
        "kvchat {p:.4} vs llama.cpp {reference}"
    );
}

#[test]
fn gemma3_perplexity_is_within_1_percent_of_llama_perplexity_past_the_window() {
    // Chunks of 1024: positions past 512, where the sliding-window layers drop their oldest keys.
    // llama-perplexity -m gemma-3-270m-q4_k_m.gguf -f assets/bench-text.txt -c 1024 --chunks 1 -t 2
    //   → Final estimate: PPL = 8.2780 +/- 0.92229 (both chunks: 8.1155)
    let reference = 8.2780;
    let p = ppl(1024, 1);
    assert!(
        (p / reference - 1.0).abs() < 0.01,
        "kvchat {p:.4} vs llama.cpp {reference}"
    );
}

#[test]
fn gemma3_windowed_cache_answers_as_the_full_recompute_past_the_window_in_under_a_quarter_of_the_bytes(
) {
    let e = gemma();
    let prompt = kvchat::eval::bench::bench_tokens(e, 700).unwrap();
    let cached = CacheSpec::full(Precision::F16, e.ctx());
    let (tokens, _) = crate::common::greedy_with(e, &cached, &prompt, 4);
    // --no-cache keeps no rows: every step recomputes all positions, each sliding-window layer
    // masking per query row what the cache drops.
    let (recomputed, _) =
        crate::common::greedy_with(e, &CacheSpec::none(Precision::F16), &prompt, 4);
    assert_eq!(tokens, recomputed);
    // Bytes: 15 of 18 layers hold 512 + 64 spare positions; at 8192 that is 0.23 of a uniform cache.
    let mut s = e.session(&cached);
    s.feed(&prompt).unwrap();
    let held = s.cache().bytes_used() as f64;
    assert_eq!(
        held,
        KvDims::bytes_for_spec(&cached, &e.model().cfg, prompt.len())
    );
    assert!(held < s.cache().bytes_uniform(&e.model().cfg));
    let at_8192 = KvDims::bytes_for_spec(&cached, &e.model().cfg, 8192)
        / KvDims::of(&e.model().cfg).bytes_for_mode(&cached.mode, 8192);
    assert!(at_8192 <= 0.25, "{at_8192}");
}

#[test]
fn gemma3_drafted_decoding_gives_the_tokens_of_plain_decoding_past_the_window() {
    // Drafted decoding once parted from plain decoding here (600-token prompt, 29th token,
    // guesses of 2+) while the kernel's key chunks started at a view's first position. A prompt
    // past the 512-position window, so that the sliding-window layers have dropped positions
    // and a draft's rows are verified in one wide step over them.
    let e = gemma();
    let text = kvchat::eval::bench::bench_tokens(e, 600).unwrap();
    let spec = CacheSpec::full(Precision::F16, e.ctx());
    let run = |draft: bool| {
        let mut s = e.session(&spec);
        assert!(s.can_verify_drafts());
        let logits = s.feed(&text).unwrap();
        let mut sampler = kvchat::session::Sampler::new(kvchat::session::SamplingParams::greedy());
        let mut d = kvchat::session::draft::Ngram::new(16);
        let drafter = draft.then_some(&mut d as &mut dyn kvchat::session::draft::Drafter);
        let (out, _, stats) = s
            .decode_drafted(logits, &mut sampler, 120, &[], true, drafter, |_| Ok(true))
            .unwrap();
        (out, stats)
    };
    let (plain, _) = run(false);
    let (drafted, stats) = run(true);
    assert_eq!(plain, drafted);
    assert!(stats.drafted > 0 && stats.forwards < 119, "{stats:?}");
}
