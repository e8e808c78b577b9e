//! Bad input bounded in memory (issue 32), measured as each kvchat child's peak resident memory.
//! A binary of its own, apart from `tests/suite`: Linux records at exec the memory high-water mark
//! of the process before it — with posix_spawn, the test process itself — in the child's
//! `ru_maxrss`, so these figures are the child's own only in a test process that loads no model.

#[path = "suite/common/mod.rs"]
mod common;

use common::{assert_refused, stderr};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// The memory a small hostile input may take in all: the model, the tokenizer and a render's
/// budget, far from the gigabytes these inputs took before they were bounded.
const SMALL_INPUT_PEAK: u64 = 512 << 20;

fn temp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("memory-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_model(name: &str) -> PathBuf {
    common::tiny::write_tiny_with_tokenizer(&format!("memory-{name}"))
}

/// kvchat run in `home`, what it printed and its peak resident memory in bytes.
fn kvchat_measured(home: &Path, args: &[&str], stdin: &[u8]) -> (Output, u64) {
    let c = common::isolated_kvchat(home, None, args);
    common::run_measured(c, stdin, Duration::from_secs(120))
}

fn kvchat(home: &Path, args: &[&str], stdin: &[u8]) -> Output {
    kvchat_measured(home, args, stdin).0
}

#[test]
fn a_runaway_template_on_the_command_line_or_in_the_model_is_one_line_in_little_memory() {
    let home = temp("template");
    let grow = "{{ ([1] * 10**12) | list | length }}";
    let model = tiny_model("template");
    let m = model.to_str().unwrap();
    let (o, peak) = kvchat_measured(&home, &["run", "-m", m, "--chat-template", grow, "hi"], b"");
    assert_refused(
        &o,
        "--chat-template: chat template needs more than its memory limit",
    );
    assert!(peak < SMALL_INPUT_PEAK, "peak {peak} bytes");
    // The same template as the model's own: every run of that model was an abort.
    let mut meta = common::tiny::spm_metadata(common::tiny::VOCAB);
    meta.push((
        "tokenizer.chat_template".into(),
        candle_core::quantized::gguf_file::Value::String(grow.into()),
    ));
    let model = common::tiny::write_tiny("memory-template-gguf", meta);
    let (o, peak) = kvchat_measured(&home, &["run", "-m", model.to_str().unwrap(), "hi"], b"");
    assert_refused(&o, "chat template needs more than its memory limit");
    assert!(
        stderr(&o).contains("the chat template of"),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("--chat-template"), "{}", stderr(&o));
    assert!(peak < SMALL_INPUT_PEAK, "peak {peak} bytes");
    // The model still runs with another template, or a raw prompt.
    for extra in [&["--chat-template", "chatml"][..], &["--raw"][..]] {
        let args = [
            &["run", "-m", model.to_str().unwrap(), "-n", "2"][..],
            extra,
            &["hi"],
        ]
        .concat();
        let o = kvchat(&home, &args, b"");
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
    }
}

#[test]
fn a_huge_chat_line_is_refused_by_its_bytes_before_it_is_tokenized() {
    let home = temp("chat-line");
    let model = tiny_model("chat-line");
    let m = model.to_str().unwrap();
    // 10 MB (1.9 GB and 8.7 s before), and just under the 16 MiB line cap (3.2 GB before).
    for len in [10_000_000usize, (16 << 20) - 1] {
        let mut input = vec![b'a'; len];
        input.push(b'\n');
        let t0 = Instant::now();
        let (o, peak) = kvchat_measured(
            &home,
            &["chat", "-m", m, "--chat-template", "chatml"],
            &input,
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("the question is {len} bytes, at least")),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(peak < SMALL_INPUT_PEAK, "{len}: peak {peak} bytes");
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    }
}
