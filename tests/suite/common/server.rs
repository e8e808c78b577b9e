//! A `kvchat serve` of the tests' model on a free port of 127.0.0.1, bounded in time
//! (`--exit-after`) and killed when dropped, with what the tests ask of it: requests, metrics, and
//! whether it settles.

use super::model_path;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A server on a free port of 127.0.0.1, killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
    /// What it printed on stderr after its first line.
    pub log: Arc<Mutex<String>>,
    /// Its own prefix store (removed when it is dropped), unless the test gave one.
    pub store: Option<std::path::PathBuf>,
}

/// A directory of its own for a test's prefix store, under the target directory.
pub fn fresh_store() -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("serve-store-{}-{n}", std::process::id()))
}

impl Server {
    /// A server with a prefix store of its own, empty (a test's `--kv-store-dir` overrides it).
    pub fn start(args: &[&str]) -> Server {
        let store = fresh_store();
        let mut server = Self::start_env(args, &store);
        server.store = Some(store);
        server
    }

    /// A server of `model` (not the tests' model), with a prefix store of its own.
    pub fn start_model(model: &std::path::Path, args: &[&str]) -> Server {
        let store = fresh_store();
        let mut server = Self::start_with(model, args, &store);
        server.store = Some(store);
        server
    }

    pub fn start_env(args: &[&str], store: &std::path::Path) -> Server {
        Self::start_with(&model_path(), args, store)
    }

    fn start_with(model: &std::path::Path, args: &[&str], store: &std::path::Path) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvchat"))
            .args([
                "serve",
                "--port",
                "0",
                "--threads",
                "2",
                "--exit-after",
                "600",
            ])
            .args(args)
            .env("KVCHAT_MODEL", model)
            .env("KVCHAT_KV_STORE", store)
            .env_remove("KVCHAT_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
        let Some(at) = first.find(" at http://") else {
            let _ = child.kill();
            panic!("the server did not start: {first}");
        };
        let base = first[at + 4..].split("/v1").next().unwrap().to_string();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(l + "\n"));
            }
        });
        Server {
            child,
            base,
            log,
            store: None,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body`; the status and the JSON answer (or error).
    pub fn post(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value, Option<String>) {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(300))
            .build();
        let mut req = agent
            .post(&self.url(path))
            .set("Content-Type", "application/json");
        if let Some(k) = key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        let (code, resp) = match req.send_string(body) {
            Ok(r) => (r.status(), r),
            Err(ureq::Error::Status(c, r)) => (c, r),
            Err(e) => panic!("{path}: {e}"),
        };
        let retry = resp.header("Retry-After").map(str::to_string);
        let text = resp.into_string().unwrap();
        (
            code,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
            retry,
        )
    }

    pub fn chat(&self, body: Value) -> Value {
        let (code, v, _) = self.post("/v1/chat/completions", &body.to_string(), None);
        assert_eq!(code, 200, "{v}");
        v
    }

    /// POSTs `body` on a connection of its own and reads until the answer's status (200),
    /// leaving the stream open for the caller to read or drop.
    pub fn open_stream(&self, path: &str, body: &str) -> std::net::TcpStream {
        let addr = self.base.trim_start_matches("http://").to_string();
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            conn,
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut got = [0u8; 2048];
        let n = conn.read(&mut got).unwrap();
        assert!(String::from_utf8_lossy(&got[..n]).contains("200 OK"));
        conn
    }

    /// Waits until /metrics' `name` is at least `value`, for at most `secs` seconds.
    pub fn wait_until(&self, name: &str, value: f64, secs: u64, what: &str) {
        let t0 = Instant::now();
        while self.metric(name) < value {
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "the server never saw {what} ({name} < {value})"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The value of a Prometheus line of /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let text = ureq::get(&self.url("/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
            .parse()
            .unwrap()
    }

    /// Waits until nothing runs or waits, and checks the pool holds no reservation.
    pub fn assert_settles(&self) {
        let t0 = Instant::now();
        while self.metric("kvchat_running_sequences") + self.metric("kvchat_queue_depth") > 0.0 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the batch never emptied"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let used = self.metric("kvchat_kv_pool_used_bytes");
        let idle = self.metric("kvchat_kv_allocated_bytes");
        assert!(
            used <= idle + 0.5,
            "a reservation outlived its request: {used} > {idle}"
        );
        assert!(
            !self.log.lock().unwrap().contains("panicked"),
            "{}",
            self.log.lock().unwrap()
        );
    }
}

impl Server {
    /// A line of /proc/PID/status in KiB (VmRSS: resident now; VmHWM: the most it ever was).
    pub fn memory_kib(&self, line: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(line)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
            .unwrap_or_else(|| panic!("no {line} in /proc status"))
    }

    /// The host:port it listens on.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.store {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A greedy chat request for `question`, its answer at most `max_tokens` long.
pub fn greedy_chat(question: &str, max_tokens: usize) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": question}],
           "temperature": 0, "max_tokens": max_tokens})
}

/// The Python of the virtual environment scripts/test.sh makes (with the `openai` package).
pub fn python() -> String {
    std::env::var("KVCHAT_TEST_PYTHON")
        .unwrap_or_else(|_| format!("{}/target/pyenv/bin/python", env!("CARGO_MANIFEST_DIR")))
}

/// Runs the tests' Python (`python()`) with `args` (a script path, or `-c` and code, then its
/// arguments) and reads the one JSON report it prints; its stderr is the failure's message.
pub fn python_json(args: &[&str]) -> Value {
    let out = Command::new(python()).args(args).output().expect(
        "target/pyenv/bin/python with the openai and anthropic packages (scripts/test.sh makes it)",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
