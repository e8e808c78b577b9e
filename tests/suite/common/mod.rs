//! Shared by the integration tests: the real model, loaded once per test binary.
#![allow(dead_code)]

pub mod hub;
pub mod raw_gguf;
pub mod server;
pub mod tiny;

use kvchat::engine::Engine;
use kvchat::engine::LoadOptions;
use kvchat::kv::CacheSpec;
use kvchat::session::{Sampler, SamplingParams};
use kvchat::template::Message;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// The real model file: $KVCHAT_MODEL, or where scripts/fetch-models.sh puts it.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("KVCHAT_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(kvchat::source::test_model_path);
    assert!(
        p.exists(),
        "the test model is missing at {}: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

pub fn model_args() -> LoadOptions {
    LoadOptions {
        ctx: Some(4096),
        ..LoadOptions::for_path(model_path())
    }
}

/// The real model (SmolLM2-135M-Instruct Q4_1), loaded once.
pub fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| Engine::load(&model_args()).expect("loading the test model"))
}

/// max |a - b| / max |b|: how far two logit vectors are apart, relative to their scale.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// The full cache at the tests' context size.
pub fn full() -> CacheSpec {
    CacheSpec::full(kvchat::kv::Precision::F32, 4096)
}

/// The chat prompt for one user question, with the model's template.
pub fn chat_ids(question: &str) -> Vec<u32> {
    let e = engine();
    let t = e.chat_template(None).unwrap();
    e.chat_prompt(&t, &[Message::new("user", question)])
        .unwrap()
}

/// Greedy tokens and the logits of the last step, with the given cache strategy.
pub fn greedy(spec: &CacheSpec, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    greedy_with(engine(), spec, prompt, n)
}

/// As `greedy`, on another model.
pub fn greedy_with(e: &Engine, spec: &CacheSpec, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut s = e.session(spec);
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let mut logits = s.feed(prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = sampler.sample(&logits, s.tokens()).unwrap();
        out.push(next);
        logits = s.feed(&[next]).unwrap();
    }
    (out, logits.to_vec1().unwrap())
}

/// The prefix store the tests' runs share (under the target directory, not the user's cache).
pub fn test_store() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kv-store")
}

/// Runs the kvchat binary on the test model with `stdin` as its input.
pub fn kvchat(args: &[&str], stdin: &str) -> Output {
    kvchat_env(args, stdin, &[])
}

/// As [`kvchat`], with more environment variables (`KVCHAT_KV_STORE` among them overrides the
/// tests' store).
pub fn kvchat_env(args: &[&str], stdin: &str, env: &[(&str, &std::ffi::OsStr)]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvchat"))
        .args(args)
        .env("KVCHAT_MODEL", model_path())
        .env("KVCHAT_KV_STORE", test_store())
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// kvchat with every cache under `home` and nothing reachable but `hub_url` (a local fake hub and
/// its PyPI index; with None, a closed port): no proxy, token or model variable of the caller's
/// environment leaks in.
pub fn isolated_kvchat(home: &std::path::Path, hub_url: Option<String>, args: &[&str]) -> Command {
    let hub = hub_url.unwrap_or_else(|| "http://127.0.0.1:9".to_string());
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvchat"));
    c.args(args)
        .env("HF_HOME", home.join("hf"))
        .env("KVCHAT_HOME", home.join("kv"))
        .env("HF_ENDPOINT", &hub)
        .env("KVCHAT_PIP_INDEX", format!("{hub}/simple"))
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env("HOME", home)
        .env("XDG_DATA_HOME", home.join("data"));
    for v in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "KVCHAT_MODEL",
        "KVCHAT_MODELS_FILE",
        "HF_HUB_OFFLINE",
        "HF_TOKEN",
        "PIP_INDEX_URL",
        "RUST_BACKTRACE",
    ] {
        c.env_remove(v);
    }
    c
}

/// Runs `cmd` with `stdin` as its input until it exits; returns what it printed and its peak
/// resident memory in bytes (`wait4`'s `ru_maxrss`). That peak is the child's own only when the
/// test process is small: Linux records, at exec, the high-water mark of the memory the process
/// had before it (with posix_spawn, the test process's own), so a test that asserts a child's peak
/// runs in `tests/memory.rs`, a binary that loads no model. A run past `limit` is killed and the
/// test fails: a hang is a failure, not a wait.
pub fn run_measured(mut cmd: Command, stdin: &[u8], limit: std::time::Duration) -> (Output, u64) {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    // Reaped by wait4 below (std's wait would lose the child's rusage), or killed and waited.
    #[allow(clippy::zombie_processes)]
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let data = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = reader(Box::new(child.stdout.take().unwrap()));
    let err = reader(Box::new(child.stderr.take().unwrap()));
    let pid = child.id() as libc::pid_t;
    let start = std::time::Instant::now();
    let (status, peak) = loop {
        let mut status = 0;
        // SAFETY: rusage is plain data that wait4 fills; all-zero bytes are a valid value of it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: wait4 writes only through the two pointers, to locals that outlive the call.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(r >= 0, "wait4: {}", std::io::Error::last_os_error());
        if r == pid {
            break (status, usage.ru_maxrss as u64 * 1024);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let err = err.join().unwrap();
            panic!("{cmd:?} hung; stderr: {}", String::from_utf8_lossy(&err));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let _ = writer.join();
    let output = Output {
        status: std::process::ExitStatus::from_raw(status),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    (output, peak)
}

/// What a run wrote on stderr, as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Exit 1, one line on stderr, containing `needle`, no panic: how kvchat refuses bad input.
pub fn assert_refused(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
}
