//! The binary as a user meets it: bad input gets one clear line on stderr and a non-zero exit.

use crate::common::kvchat;

use std::path::{Path, PathBuf};
use std::process::Output;

/// Asserts a failed run: exit code 1, exactly one line on stderr, starting "error:" and containing `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvchat-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn tokenize_prints_ids_as_json() {
    let out = kvchat(&["tokenize", "Hello, world!"], "");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[19556,28,905,17]"
    );
}

#[test]
fn raw_completion_from_stdin_says_paris() {
    let out = kvchat(
        &["run", "--raw", "--temperature", "0", "-n", "4"],
        "The capital of France is\n",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(" Paris."));
}

#[test]
fn trace_picks_prints_each_token_beside_its_runner_up() {
    let out = kvchat(
        &[
            "run",
            "--raw",
            "--temperature",
            "0",
            "-n",
            "4",
            "--trace-picks",
        ],
        "The capital of France is\n",
    );
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let picks: Vec<&str> = err.lines().filter(|l| l.starts_with("[pick] ")).collect();
    assert_eq!(picks.len(), 4, "{err}");
    // " Paris" (the answer's first token), its logit, then the runner-up and the margin.
    assert!(
        picks[0].starts_with("[pick] 0: ") && picks[0].contains("\"ĠParis\""),
        "{err}"
    );
    let margin: f32 = picks[0]
        .rsplit("(margin ")
        .next()
        .unwrap()
        .trim_end_matches(')')
        .parse()
        .unwrap();
    assert!(margin > 0.0, "{err}");
}

#[test]
fn stats_report_prefill_decode_and_kv_bytes() {
    let out = kvchat(
        &[
            "run",
            "--temperature",
            "0",
            "-n",
            "8",
            "--ignore-eos",
            "--stats",
            "Hi",
        ],
        "",
    );
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("generated 8 tok"), "{err}");
    assert!(err.contains("tok/s"), "{err}");
    // The cache holds the prompt and every generated token but the last (never fed back).
    let prompt: usize = err
        .split("prompt ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let held = prompt + 7;
    assert!(err.contains(&format!("{held} positions held")), "{err}");
    // The default cache stores f16: 2 × 30 layers × 3 KV heads × 64 × 2 bytes = 23,040 per token.
    assert!(
        err.contains(&format!(
            "{} used",
            kvchat::source::human_bytes((held * 23_040) as u64)
        )),
        "{err}"
    );
    assert!(err.contains("kv cache full (precision f16"), "{err}");
}

#[test]
fn missing_model_file_is_an_error() {
    let out = kvchat(&["run", "-m", "/nonexistent/model.gguf", "hi"], "");
    assert_one_line_error(&out, "model path /nonexistent/model.gguf does not exist");
}

#[test]
fn directory_without_config_json_is_an_error() {
    let d = temp_dir("dir");
    let out = kvchat(&["run", "-m", p(&d), "hi"], "");
    assert_one_line_error(&out, "has no config.json");
}

#[test]
fn file_that_is_not_gguf_is_an_error() {
    let d = temp_dir("notgguf");
    let f = d.join("model.gguf");
    std::fs::write(&f, b"this is not a model, just text\n").unwrap();
    let out = kvchat(&["run", "-m", p(&f), "hi"], "");
    assert_one_line_error(&out, "is not a readable GGUF file");
}

#[test]
fn truncated_gguf_is_an_error() {
    let d = temp_dir("trunc");
    let f = d.join("truncated.gguf");
    let bytes = std::fs::read(crate::common::model_path()).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let out = kvchat(&["run", "-m", p(&f), "hi"], "");
    assert_one_line_error(&out, "truncated or corrupt");
}

#[test]
fn gguf_of_unsupported_architecture_is_an_error() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let d = temp_dir("arch");
    let f = d.join("gpt2.gguf");
    let t = QTensor::quantize(
        &candle_core::Tensor::zeros((4, 32), candle_core::DType::F32, &candle_core::Device::Cpu)
            .unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let arch = gguf_file::Value::String("gpt2".into());
    let mut w = std::fs::File::create(&f).unwrap();
    gguf_file::write(
        &mut w,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    drop(w);
    let out = kvchat(&["run", "-m", p(&f), "hi"], "");
    assert_one_line_error(&out, "unsupported model architecture 'gpt2'");
}

#[test]
fn a_pool_spin_limit_candle_cannot_read_is_an_error_naming_the_variable() {
    for bad in ["abc", "-1", "4294967296", ""] {
        let out = crate::common::kvchat_env(
            &["run", "hi"],
            "",
            &[("CANDLE_BARRIER_POOL_SPIN_LIMIT", std::ffi::OsStr::new(bad))],
        );
        assert_one_line_error(
            &out,
            &format!("CANDLE_BARRIER_POOL_SPIN_LIMIT={bad:?} is not a whole number of polls"),
        );
    }
}

#[test]
fn empty_prompt_is_an_error() {
    assert_one_line_error(&kvchat(&["run", ""], ""), "the prompt is empty");
    assert_one_line_error(&kvchat(&["run", "--raw"], "\n"), "the prompt is empty");
}

#[test]
fn zero_max_tokens_is_an_error() {
    assert_one_line_error(
        &kvchat(&["run", "-n", "0", "hi"], ""),
        "--max-tokens must be at least 1",
    );
}

#[test]
fn prompt_longer_than_ctx_is_an_error() {
    let prompt = "word ".repeat(100);
    let out = kvchat(&["run", "--raw", "--ctx", "32", &prompt], "");
    assert_one_line_error(&out, "does not fit the context of 32");
}

#[test]
fn the_default_device_is_auto() {
    let out = kvchat(&["run", "--help"], "");
    let help = String::from_utf8_lossy(&out.stdout);
    let device = help.split("--device").nth(1).expect("a --device flag");
    assert!(
        device
            .split("--")
            .next()
            .unwrap()
            .contains("[default: auto]"),
        "{help}"
    );
}

#[test]
fn stats_name_the_device_used() {
    let out = kvchat(&["run", "-n", "1", "--device", "cpu", "--stats", "Hi"], "");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("| device cpu,"), "{err}");
}

#[test]
fn cuda_without_the_feature_is_an_error() {
    if cfg!(feature = "cuda") {
        return;
    }
    let out = kvchat(&["run", "--device", "cuda", "hi"], "");
    assert_one_line_error(&out, "built without CUDA");
}

#[test]
fn bad_sampling_value_is_an_error() {
    let out = kvchat(&["run", "--top-p", "1.5", "hi"], "");
    assert_one_line_error(&out, "--top-p must be between 0 and 1");
}

#[test]
fn chat_template_that_fails_to_render_is_an_error() {
    let out = kvchat(
        &[
            "run",
            "--chat-template",
            "{{ raise_exception('no system role') }}",
            "hi",
        ],
        "",
    );
    assert_one_line_error(&out, "chat template failed to render");
}

#[test]
fn chat_template_that_does_not_parse_is_an_error() {
    let out = kvchat(&["run", "--chat-template", "{% for m in %}", "hi"], "");
    assert_one_line_error(&out, "chat template does not parse");
}

#[test]
fn no_cache_run_prints_the_same_answer_as_the_cached_run() {
    let args = [
        "run",
        "--temperature",
        "0",
        "-n",
        "24",
        "--ignore-eos",
        "Tell me about caches",
    ];
    let cached = kvchat(&args, "");
    let mut with_flag = args.to_vec();
    with_flag.push("--no-cache");
    let recomputed = kvchat(&with_flag, "");
    assert!(cached.status.success() && recomputed.status.success());
    assert_eq!(cached.stdout, recomputed.stdout);
    assert!(!cached.stdout.is_empty());
}

#[test]
fn bench_json_dash_writes_the_json_to_stdout_and_the_table_to_stderr() {
    let out = kvchat(
        &[
            "bench",
            "--modes",
            "full+int4",
            "--contexts",
            "16",
            "--gen",
            "2",
            "--repeat",
            "1",
            "--warmup",
            "0",
            "--no-summary",
            "--json",
            "-",
        ],
        "",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cells"][0]["mode"], "full+int4");
    assert!(err.contains("decode ms/tok"), "{err}");
    assert!(!Path::new("-").exists(), "a file named - was written");
}

#[test]
fn completions_for_bash_know_the_subcommands_and_cache_flags() {
    let out = kvchat(&["completions", "bash"], "");
    assert!(out.status.success());
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(script.contains("_kvchat()"), "{script}");
    for word in ["chat", "bench", "--kv-type", "--kv-window", "--kv-offload"] {
        assert!(script.contains(word), "{word} missing");
    }
}

#[test]
fn version_names_the_compute_features_and_cpu_paths() {
    let out = kvchat(&["--version"], "");
    assert!(out.status.success());
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(v.starts_with("kvchat 0.1.0"), "{v}");
    assert!(v.contains("features: ") && v.contains("CPU paths: "), "{v}");
}

/// Runs `shell_cmd` (kvchat's arguments after the binary, shell-quoted, redirections allowed) in a
/// pseudo-terminal (util-linux `script`), and returns what the terminal showed.
fn on_a_terminal(shell_cmd: &str) -> String {
    let cmd = format!("exec {} {shell_cmd}", env!("CARGO_BIN_EXE_kvchat"));
    let out = std::process::Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("KVCHAT_MODEL", crate::common::model_path())
        .env("SHELL", "/bin/sh")
        .env("KVCHAT_PROGRESS_AFTER_MS", "0")
        .env_remove("NO_COLOR")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("script (util-linux) gives kvchat a pseudo-terminal");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn ppl_on_a_terminal_shows_a_bar_with_an_eta_and_the_running_perplexity() {
    let d = temp_dir("ppl-bar");
    let text = d.join("text.txt");
    std::fs::write(&text, kvchat::eval::bench::BENCH_TEXT).unwrap();
    let shown = on_a_terminal(&format!("ppl --chunk 64 --chunks 4 {}", p(&text)));
    assert!(shown.contains("/124 tokens scored"), "{shown}");
    assert!(shown.contains("(ETA "), "{shown}");
    assert!(shown.contains(") ppl "), "no running perplexity: {shown}");
    assert!(
        shown.contains("ppl ") && shown.contains("over 124 tokens"),
        "{shown}"
    );
}

#[test]
fn a_long_generation_into_a_file_shows_progress_on_the_terminal() {
    let d = temp_dir("gen-bar");
    let answer = d.join("answer.txt");
    // (The bar shows after 2 s; the test sets that delay to 0.)
    let prompt: String = kvchat::eval::bench::BENCH_TEXT.chars().take(200).collect();
    let prompt_file = d.join("prompt.txt");
    std::fs::write(&prompt_file, prompt).unwrap();
    let shown = on_a_terminal(&format!(
        "run --raw --no-cache --temperature 0 --ignore-eos -n 4 < {} > {}",
        p(&prompt_file),
        p(&answer)
    ));
    assert!(shown.contains("/4 tokens"), "{shown}");
    assert!(
        shown.contains("no KV cache: every step recomputes"),
        "{shown}"
    );
    assert!(!std::fs::read_to_string(&answer).unwrap().trim().is_empty());
}

#[test]
fn scripts_kvchat_says_it_is_building_on_the_first_run_only() {
    // The script in a scratch root, with a stand-in `cargo` whose "build" writes a kvchat that
    // prints "ran": what the script says around the build is what is tested, not the build.
    let root = temp_dir("script-first-run");
    std::fs::create_dir_all(root.join("scripts")).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kvchat"),
        root.join("scripts/kvchat"),
    )
    .unwrap();
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let fake_cargo = bin.join("cargo");
    std::fs::write(
        &fake_cargo,
        format!(
            "#!/bin/sh\nmkdir -p {r}/target/release\nprintf '#!/bin/sh\\necho ran\\n' > {r}/target/release/kvchat\nchmod +x {r}/target/release/kvchat\n",
            r = root.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake_cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _ = std::fs::remove_dir_all(root.join("target"));
    let run = || {
        std::process::Command::new("bash")
            .arg(root.join("scripts/kvchat"))
            .env(
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            )
            .output()
            .unwrap()
    };
    let first = run();
    assert_eq!(String::from_utf8_lossy(&first.stdout).trim(), "ran");
    assert!(
        String::from_utf8_lossy(&first.stderr).contains("building it first"),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = run();
    assert_eq!(String::from_utf8_lossy(&second.stdout).trim(), "ran");
    assert!(
        second.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
}

#[test]
fn an_unknown_kv_precision_is_refused_naming_the_flag_and_the_tables_choices() {
    for (args, flag, choices) in [
        (
            &["run", "--kv-type", "int9", "hi"][..],
            "--kv-type",
            "f32, f16, bf16, int8, int4",
        ),
        (
            &["run", "--kv-quant", "f16", "hi"][..],
            "--kv-quant",
            "int8, int4",
        ),
        (
            &[
                "kv-size",
                "--layers",
                "2",
                "--kv-heads",
                "2",
                "--head-dim",
                "64",
                "--kv-type",
                "q8",
            ][..],
            "--kv-type",
            "f32, f16, bf16, int8, int4",
        ),
    ] {
        let out = kvchat(args, "");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        let bad = args[args.iter().position(|a| *a == flag).unwrap() + 1];
        assert!(
            err.contains(&format!("invalid value '{bad}' for '{flag}")),
            "{err}"
        );
        assert!(
            err.contains(&format!("[possible values: {choices}]")),
            "{err}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed a result");
    }
}

#[test]
fn a_needle_grid_too_long_for_memory_says_to_lower_its_longest_context() {
    // No --ctx: the grid's longest context sizes it, so that is what the advice names.
    let out = kvchat(&["needle", "--contexts", "1024,9000000"], "");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("more than the") && err.contains("(lower the longest of --contexts)"),
        "{err}"
    );
    assert!(!err.contains("--ctx"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `kvchat ppl … --json` on the bench text, parsed.
fn ppl_json(args: &[&str]) -> serde_json::Value {
    let out = kvchat(&[&["ppl", "--json", "--threads", "2"], args].concat(), "");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_run_compared_with_its_own_saved_distributions_differs_only_by_their_storage() {
    let d = temp_dir("kld-self");
    let text = d.join("text.txt");
    std::fs::write(&text, kvchat::eval::bench::BENCH_TEXT).unwrap();
    let base = d.join("self.kld");
    let _ = std::fs::remove_file(&base);
    let saved = ppl_json(&[
        "--chunk",
        "64",
        "--chunks",
        "2",
        "--kl-divergence-base",
        p(&base),
        p(&text),
    ]);
    // 20-byte header, 2·64 tokens, 2·31 scored tokens of 49,152 + 4 u16 each.
    assert_eq!(
        std::fs::metadata(&base).unwrap().len(),
        20 + 2 * 64 * 4 + 2 * 31 * (49_152 + 4) * 2
    );
    let again = ppl_json(&["--kl-divergence-base", p(&base), "--kl-divergence"]);
    // The same tokens, the same chunks, the same figure (the run is deterministic).
    assert_eq!(again["tokens_scored"], 62);
    assert_eq!(again["ppl"], saved["ppl"]);
    let div = &again["divergence"];
    assert_eq!(div["same_top_pct"], 100.0);
    // Stored in 65,536 steps over 16 nats: each log-probability within 8/65,535 = 1.22e-4, and
    // so is each token's divergence (to first order it is the mean error under P).
    assert!(div["kl_max"].as_f64().unwrap().abs() < 1.3e-4, "{div}");
    assert!(div["kl_mean"].as_f64().unwrap().abs() < 2e-5, "{div}");
    let vs = again["against"]["diff_pct"].as_f64().unwrap();
    assert!(vs.abs() < 0.02, "{vs}");
}

#[test]
fn a_saved_base_compares_as_the_cache_it_was_saved_from() {
    let d = temp_dir("kld-mode");
    let text = d.join("text.txt");
    std::fs::write(&text, kvchat::eval::bench::BENCH_TEXT).unwrap();
    let base = d.join("f32.kld");
    let _ = std::fs::remove_file(&base);
    let args = ["--chunk", "64", "--chunks", "2"];
    ppl_json(
        &[
            &args[..],
            &[
                "--kv-type",
                "f32",
                "--kl-divergence-base",
                p(&base),
                p(&text),
            ],
        ]
        .concat(),
    );
    // int4 against the saved f32 run, and against an f32 cache run beside it: one divergence.
    let from_file = ppl_json(&[
        "--kv-type",
        "int4",
        "--kl-divergence-base",
        p(&base),
        "--kl-divergence",
    ]);
    let side_by_side = ppl_json(
        &[
            &args[..],
            &["--kv-type", "int4", "--against", "full+f32", p(&text)],
        ]
        .concat(),
    );
    assert_eq!(from_file["ppl"], side_by_side["ppl"]);
    let (a, b) = (&from_file["divergence"], &side_by_side["divergence"]);
    assert_eq!(a["same_top_pct"], b["same_top_pct"]);
    let (ka, kb) = (
        a["kl_mean"].as_f64().unwrap(),
        b["kl_mean"].as_f64().unwrap(),
    );
    assert!(kb > 1e-4, "int4 against f32 diverges measurably: {kb}");
    assert!((ka - kb).abs() < 0.01 * kb, "{ka} vs {kb}");
}

/// tests/data/smollm2-q4_1-c8.kld was written by llama.cpp (llama-cpp-python 0.3.36's sources,
/// scripts/llamacpp.sh): `llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -f
/// assets/bench-text.txt -c 8 -b 8 --chunks 1 -t 2 --no-repack --kl-divergence-base
/// smollm2-q4_1-c8.kld`, which printed `Final estimate: PPL = 8.9103 +/- 14.65427`.
const LLAMA_CPP_C8_PPL: f64 = 8.9103;

#[test]
fn a_logits_file_llama_perplexity_wrote_reads_back_as_its_perplexity_and_tokens() {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2-q4_1-c8.kld");
    let vs = ppl_json(&["--kl-divergence-base", p(&base), "--kl-divergence"]);
    // The file's stored distributions give llama.cpp's own figure (to its 4 decimals).
    let theirs = vs["against"]["against_ppl"].as_f64().unwrap();
    assert!((theirs - LLAMA_CPP_C8_PPL).abs() < 5e-4, "{theirs}");
    assert_eq!(vs["tokens_scored"], 3);
    assert_eq!(vs["divergence"]["same_top_pct"], 100.0);
    assert!(vs["divergence"]["kl_mean"].as_f64().unwrap() < 0.01, "{vs}");
    // Its tokens are the ones kvchat cuts from the same text: the same run, the same figure.
    let d = temp_dir("kld-llama");
    let text = d.join("text.txt");
    std::fs::write(&text, kvchat::eval::bench::BENCH_TEXT).unwrap();
    let ours = ppl_json(&["--chunk", "8", "--chunks", "1", p(&text)]);
    assert_eq!(ours["ppl"], vs["ppl"]);
}
