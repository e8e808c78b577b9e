//! `kvchat serve`: the OpenAI API over HTTP on 127.0.0.1, many clients sharing one model and one
//! KV pool. Each test starts its own server on a free port, bounded in time (`--exit-after`), and
//! kills it when done; the official `openai` Python client (installed by scripts/test.sh into
//! target/pyenv) talks to one of them.

use crate::common::server::{fresh_store, greedy_chat, python, Server};
use crate::common::stderr;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn text_of(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .or_else(|| v["choices"][0]["text"].as_str())
        .unwrap()
        .to_string()
}

const OPENAI_CLIENT: &str = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-test", max_retries=0, timeout=300)
q = [{"role": "user", "content": "What is the capital of France?"}]
out = {"models": [m.id for m in c.models.list().data]}
r = c.chat.completions.create(model="m", messages=q, temperature=0, max_tokens=24)
out["chat"] = r.choices[0].message.content
out["finish"] = r.choices[0].finish_reason
out["usage"] = [r.usage.prompt_tokens, r.usage.completion_tokens]
s = c.chat.completions.create(model="m", messages=q, temperature=0, max_tokens=24, stream=True,
                              stream_options={"include_usage": True})
parts, usage = [], None
for ch in s:
    if ch.choices and ch.choices[0].delta.content:
        parts.append(ch.choices[0].delta.content)
    if ch.usage:
        usage = [ch.usage.prompt_tokens, ch.usage.completion_tokens]
out["streamed"] = "".join(parts)
out["stream_usage"] = usage
p = c.completions.create(model="m", prompt="The capital of France is", temperature=0, max_tokens=6)
out["completion"] = p.choices[0].text
try:
    c.chat.completions.create(model="m", messages=q, n=2)
    out["error"] = None
except openai.BadRequestError as e:
    out["error"] = [e.status_code, e.body["message"] if isinstance(e.body, dict) else str(e.body)]
print(json.dumps(out))
"#;

#[test]
fn the_openai_client_chats_streams_completes_and_gets_errors_and_answers_as_kvchat_run() {
    let py = python();
    assert!(
        std::path::Path::new(&py).exists() || std::env::var("KVCHAT_TEST_PYTHON").is_ok(),
        "no Python with the openai client at {py}: scripts/test.sh makes it (python3 -m venv target/pyenv; target/pyenv/bin/pip install openai)"
    );
    let server = Server::start(&[]);
    let out = Command::new(&py)
        .args(["-c", OPENAI_CLIENT, &server.base])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["models"], json!(["SmolLM2-135M-Instruct.Q4_1"]));
    let run = crate::common::kvchat(
        &[
            "run",
            "--temperature",
            "0",
            "-n",
            "24",
            "--no-kv-store",
            "What is the capital of France?",
        ],
        "",
    );
    assert!(run.status.success(), "{}", stderr(&run));
    let run_text = String::from_utf8(run.stdout).unwrap();
    assert_eq!(v["chat"].as_str().unwrap(), run_text.trim_end_matches('\n'));
    assert_eq!(
        v["streamed"], v["chat"],
        "streamed and whole answers differ"
    );
    assert_eq!(v["finish"], "length");
    assert_eq!(v["usage"], v["stream_usage"]);
    assert_eq!(v["usage"][1], 24);
    assert!(
        v["completion"].as_str().unwrap().contains("Paris"),
        "{}",
        v["completion"]
    );
    assert_eq!(v["error"][0], 400);
    assert!(
        v["error"][1].as_str().unwrap().contains("n = 1"),
        "{}",
        v["error"]
    );
    server.assert_settles();
}

#[test]
fn concurrent_answers_equal_the_answers_each_gets_alone() {
    let server = Arc::new(Server::start(&["--parallel", "4"]));
    let questions = [
        "Name three primary colours.",
        "What is 12 times 12?",
        "Write a haiku about the sea.",
        "Why is the sky blue? Answer briefly.",
    ];
    let handles: Vec<_> = questions
        .iter()
        .map(|q| {
            let (s, q) = (server.clone(), q.to_string());
            std::thread::spawn(move || text_of(&s.chat(greedy_chat(&q, 40))))
        })
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let steps = server.metric("kvchat_decode_steps_total");
    let tokens = server.metric("kvchat_generated_tokens_total");
    assert!(
        steps < 0.8 * tokens,
        "the requests did not decode together: {steps} steps for {tokens} tokens"
    );
    for (q, t) in questions.iter().zip(&together) {
        assert_eq!(&text_of(&server.chat(greedy_chat(q, 40))), t, "{q}");
    }
    server.assert_settles();
}

/// A system prompt of ~700 tokens that every request shares.
fn long_system() -> String {
    let mut s = String::from("You are a careful assistant for a library. Rules:\n");
    for i in 1..=40 {
        s.push_str(&format!(
            "{i}. Books in section {i} are lent for {} days and renewed at most {} times.\n",
            7 + i % 5,
            i % 3 + 1
        ));
    }
    s
}

#[test]
fn a_shared_system_prompt_is_copied_from_memory_and_answers_as_prefilled() {
    let system = long_system();
    let ask = |q: &str| {
        json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
               "temperature": 0, "max_tokens": 16})
    };
    let server = Server::start(&[]);
    let first = server.chat(ask("How long is a book of section 3 lent?"));
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = server.chat(ask("How often can a book of section 8 be renewed?"));
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(prompt > 600, "the system prompt is {prompt} tokens");
    // Whole shared blocks of 16 positions, up to where the two prompts part.
    assert!(
        cached.is_multiple_of(16) && cached + 100 > prompt && cached < prompt,
        "{cached} of {prompt} prompt tokens came from shared blocks"
    );
    assert_eq!(server.metric("kvchat_prefix_hits_total"), 1.0);
    // The system prompt is held once: the shared blocks are the first prompt's full blocks and
    // the second's past where they part (SmolLM2's f16 rows: 23,040 bytes a position).
    let block = 64.0 * 23_040.0;
    let shared = server.metric("kvchat_kv_shared_bytes");
    assert!(
        shared <= (prompt / 64 + 2) as f64 * block,
        "{shared} bytes of shared blocks for a {prompt}-token prompt"
    );
    // The same request on a server that never saw the first: the same answer, prefilled whole.
    let fresh = Server::start(&[]);
    let alone = fresh.chat(ask("How often can a book of section 8 be renewed?"));
    assert_eq!(alone["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(text_of(&alone), text_of(&second));
    server.assert_settles();
}

#[test]
fn a_prompt_one_server_stored_on_disk_starts_the_next_servers_answer() {
    let system = long_system();
    let ask = json!({"messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": "How long is a book of section 3 lent?"}],
                     "temperature": 0, "max_tokens": 16});
    let dir = fresh_store();
    let first = Server::start_env(&[], &dir);
    let answer = first.chat(ask.clone());
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Another prompt looks the store up, which waits for the first one's blocks to be written.
    first.chat(json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}));
    drop(first);
    let next = Server::start_env(&[], &dir);
    let again = next.chat(ask);
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The store's blocks of 64 positions, the prompt's last position left to prefill.
    assert!(
        prompt > 600 && cached.is_multiple_of(64) && cached + 64 >= prompt && cached < prompt,
        "{cached} of {prompt} prompt tokens came from the disk"
    );
    assert_eq!(next.metric("kvchat_prefix_hits_total"), 1.0);
    assert_eq!(text_of(&again), text_of(&answer));
    next.assert_settles();
    drop(next);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_prefix_store_that_cannot_be_made_is_said_once_and_the_server_answers_without_it() {
    // A directory under a regular file: it cannot be created, and nothing else is written.
    let dir = fresh_store();
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    std::fs::write(&dir, "a file, not a directory").unwrap();
    let server = Server::start_env(&[], &dir.join("store"));
    let answer = server.chat(json!({"messages": [{"role": "user", "content": "Hi"}],
                                    "temperature": 0, "max_tokens": 4}));
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let log = server.log.lock().unwrap().clone();
    let says = format!("prefix store: cannot read {}", dir.join("store").display());
    assert_eq!(log.matches(&says).count(), 1, "said once: {log}");
    assert_eq!(log.lines().count(), 1, "one line: {log}");
    assert_eq!(std::fs::read(&dir).unwrap(), b"a file, not a directory");
    server.assert_settles();
    drop(server);
    std::fs::remove_file(&dir).unwrap();
}

#[test]
fn bad_requests_get_openai_errors_naming_the_problem() {
    let server = Server::start(&["--ctx", "256"]);
    let user = r#"[{"role":"user","content":"hi"}]"#;
    let long = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "word ".repeat(400)
    );
    for (path, body, code, says) in [
        (
            "/v1/chat/completions",
            "{\"messages\": [".to_string(),
            400,
            "not valid JSON",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[]}"#.to_string(),
            400,
            "'messages' is empty",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"wizard","content":"x"}]}"#.to_string(),
            400,
            "unknown role 'wizard'",
        ),
        (
            "/v1/chat/completions",
            format!(r#"{{"messages":{user},"max_tokens":"many"}}"#),
            400,
            "'max_tokens' must be",
        ),
        (
            "/v1/chat/completions",
            long,
            400,
            "does not fit the context of 256",
        ),
        (
            "/v1/completions",
            r#"{"prompt":42}"#.to_string(),
            400,
            "'prompt' must be a string",
        ),
        ("/v1/embeddings", "{}".to_string(), 404, "no such endpoint"),
    ] {
        let (got, v, _) = server.post(path, &body, None);
        assert_eq!(got, code, "{path} {}: {v}", &body[..body.len().min(60)]);
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{path}: {msg}");
    }
    // A body announced larger than 8 MiB: refused before it is sent.
    let addr = server.base.trim_start_matches("http://").to_string();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{{\"messages\":",
        9 << 20
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("larger than 8 MiB"), "{answer}");
    // A chunked body whose chunk size is not hex: a 400 that says the body is malformed, not 413.
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("malformed or was cut short"), "{answer}");
    server.assert_settles();
}

#[test]
fn anthropics_key_header_is_read_as_the_api_key_and_a_wrong_one_is_refused() {
    let server = Server::start(&["--api-key", "sk-right"]);
    let body =
        json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let send = |key: &str| match ureq::post(&server.url("/v1/messages"))
        .set("x-api-key", key)
        .send_string(&body)
    {
        Ok(r) => (r.status(), String::new()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    };
    assert_eq!(send("sk-right").0, 200);
    let (code, text) = send("sk-wrong");
    assert_eq!(code, 401, "{text}");
    assert!(text.contains("authentication_error"), "{text}");
}

#[test]
fn an_api_key_is_required_when_set() {
    let server = Server::start(&["--api-key", "sk-right"]);
    let body = greedy_chat("hi", 2).to_string();
    let (code, v, _) = server.post("/v1/chat/completions", &body, None);
    assert_eq!(
        (code, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let (code, _, _) = server.post("/v1/chat/completions", &body, Some("sk-wrong"));
    assert_eq!(code, 401);
    let (code, _, _) = server.post("/v1/chat/completions", &body, Some("sk-right"));
    assert_eq!(code, 200);
    // /health stays open: a load balancer's probe carries no key.
    assert_eq!(
        ureq::get(&server.url("/health")).call().unwrap().status(),
        200
    );
}

#[test]
fn a_client_that_leaves_mid_stream_frees_its_sequence() {
    let server = Server::start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                      "max_tokens": 400, "stream": true})
    .to_string();
    let conn = server.open_stream("/v1/chat/completions", &body);
    drop(conn);
    server.wait_until(
        "kvchat_requests_cancelled_total",
        1.0,
        30,
        "the client going",
    );
    server.assert_settles();
    assert_eq!(server.metric("kvchat_requests_finished_total"), 0.0);
    assert!(server.metric("kvchat_generated_tokens_total") < 400.0);
}

#[test]
fn a_full_queue_answers_429_with_retry_after_and_the_rest_complete() {
    let server = Arc::new(Server::start(&["--parallel", "1", "--queue", "1"]));
    let ask = |i: usize| {
        let s = server.clone();
        std::thread::spawn(move || {
            let body = greedy_chat(&format!("Count from {i} to {}.", i + 30), 48).to_string();
            let (code, _, retry) = s.post("/v1/chat/completions", &body, None);
            (code, retry)
        })
    };
    // One runs; then three arrive together: one waits, two are turned away.
    let mut handles = vec![ask(0)];
    let t0 = Instant::now();
    while server.metric("kvchat_running_sequences") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(5));
    }
    handles.extend((1..4).map(ask));
    let results: Vec<(u16, Option<String>)> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();
    let busy = results.iter().filter(|(c, _)| *c == 429).count();
    let done = results.iter().filter(|(c, _)| *c == 200).count();
    assert_eq!(busy + done, 4, "{results:?}");
    assert_eq!((busy, done), (2, 2), "{results:?}");
    assert!(results
        .iter()
        .filter(|(c, _)| *c == 429)
        .all(|(_, r)| r.as_deref() == Some("1")));
    server.assert_settles();
}

#[test]
fn a_small_pool_makes_requests_wait_never_exceeding_it() {
    // SmolLM2's f16 KV is 30 KiB a position: 8 MiB holds ~270 positions, one request at a time.
    let server = Arc::new(Server::start(&["--kv-pool", "8MiB"]));
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let s = server.clone();
            std::thread::spawn(move || s.chat(greedy_chat(&format!("Say hello number {i}."), 100)))
        })
        .collect();
    let watcher = {
        let s = server.clone();
        std::thread::spawn(move || {
            let mut most: f64 = 0.0;
            for _ in 0..40 {
                most = most.max(s.metric("kvchat_kv_pool_used_bytes"));
                std::thread::sleep(Duration::from_millis(50));
            }
            most
        })
    };
    for h in handles {
        h.join().unwrap();
    }
    let most = watcher.join().unwrap();
    assert!(
        most > 0.0 && most <= (8 << 20) as f64,
        "pool use peaked at {most}"
    );
    let (code, v, _) = server.post(
        "/v1/chat/completions",
        &greedy_chat("hi", 4000).to_string(),
        None,
    );
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("more than the whole pool"));
    server.assert_settles();
}

#[test]
fn sequences_preempted_for_memory_finish_with_the_answers_they_get_alone() {
    // SmolLM2's f16 KV is 23,040 bytes a position, and 13 MiB holds 591. Each request has a
    // prompt of 11 or 15 tokens (no block to share) and 400 tokens to generate, 411 or 415
    // positions; its store grows 64 positions at a time. The pool admits both, but cannot hold
    // both past ~290 positions: the newer is preempted there, and resumes when the older is
    // done, its prompt prefilled and its tokens fed again.
    let server = Arc::new(Server::start(&["--kv-pool", "13MiB", "--kv-type", "f16"]));
    let count_from = |a: usize| {
        let list: Vec<String> = (a..a + 4).map(|i| i.to_string()).collect();
        list.join(", ") + ","
    };
    let prompts = [count_from(1), count_from(20)];
    fn complete(s: &Server, p: &str) -> Value {
        let body = json!({"model": "m", "prompt": p, "temperature": 0, "max_tokens": 400});
        let (code, v, _) = s.post("/v1/completions", &body.to_string(), None);
        assert_eq!(code, 200, "{v}");
        v
    }
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (s, p) = (server.clone(), p.clone());
            std::thread::spawn(move || complete(&s, &p))
        })
        .collect();
    let watcher = {
        let s = server.clone();
        std::thread::spawn(move || {
            let mut most: f64 = 0.0;
            while s.metric("kvchat_requests_finished_total") < 2.0 {
                most = most
                    .max(s.metric("kvchat_kv_pool_used_bytes"))
                    .max(s.metric("kvchat_kv_allocated_bytes"));
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };
    let together: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let most = watcher.join().unwrap();
    assert!(
        most > 0.0 && most <= (13 << 20) as f64,
        "pool use peaked at {most}"
    );
    assert!(server.metric("kvchat_preemptions_total") >= 1.0);
    assert!(server.metric("kvchat_recomputed_tokens_total") > 200.0);
    for (p, t) in prompts.iter().zip(&together) {
        assert_eq!(t["usage"]["completion_tokens"], 400, "{t}");
        let alone = complete(&server, p);
        assert_eq!(text_of(t), text_of(&alone), "{p}");
    }
    server.assert_settles();
}

#[test]
fn a_client_that_leaves_while_its_sequence_is_preempted_frees_everything() {
    // As above, 13 MiB and two 400-token answers: the second to start is preempted; its client
    // then leaves. The first answer ends in full, the second is counted cancelled, and the pool
    // holds nothing for either.
    let server = Arc::new(Server::start(&["--kv-pool", "13MiB", "--kv-type", "f16"]));
    let first = {
        let s = server.clone();
        std::thread::spawn(move || {
            let body = json!({"model": "m", "prompt": "1, 2, 3, 4,", "temperature": 0,
                              "max_tokens": 400});
            let (code, v, _) = s.post("/v1/completions", &body.to_string(), None);
            assert_eq!(code, 200, "{v}");
            v
        })
    };
    server.wait_until(
        "kvchat_generated_tokens_total",
        5.0,
        30,
        "the first answer start",
    );
    let body = json!({"prompt": "20, 21, 22, 23,", "temperature": 0, "max_tokens": 400,
                      "stream": true})
    .to_string();
    let conn = server.open_stream("/v1/completions", &body);
    server.wait_until("kvchat_preemptions_total", 1.0, 60, "a preemption");
    drop(conn);
    let answer = first.join().unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 400, "{answer}");
    server.wait_until(
        "kvchat_requests_cancelled_total",
        1.0,
        90,
        "the client going",
    );
    server.assert_settles();
    assert_eq!(server.metric("kvchat_requests_finished_total"), 1.0);
}

#[test]
fn serve_refuses_unsafe_or_empty_settings_in_one_line() {
    for (args, says) in [
        (vec!["--host", "0.0.0.0"], "needs --api-key"),
        (vec!["--host", "localhost:80"], "is not an IP address"),
        (vec!["--parallel", "0"], "--parallel 0"),
        (vec!["--kv-pool", "0"], "--kv-pool 0 is empty"),
        (vec!["--no-cache"], "drop --no-cache"),
        (vec!["--exit-after", "0"], "--exit-after 0 is not"),
        (
            vec!["--queue", "0"],
            "--queue 0 would turn every request away",
        ),
        (vec!["--kv-pool", "lots"], "--kv-pool"),
        (
            vec!["--kv-store-budget", "lots"],
            "--kv-store-budget: 'lots' is not a size",
        ),
    ] {
        let mut a = vec!["serve"];
        a.extend(args);
        let o = crate::common::kvchat(&a, "");
        crate::common::assert_refused(&o, says);
    }
}

#[test]
fn concurrent_requests_sharing_a_system_prompt_answer_as_kvchat_run_does() {
    let server = Arc::new(Server::start(&["--parallel", "3"]));
    let system = long_system();
    let questions = [
        "How long is a book of section 4 lent?",
        "How often can a book of section 9 be renewed?",
        "Which section lends books for the longest time?",
    ];
    let handles: Vec<_> = questions
        .iter()
        .map(|q| {
            let (s, q, system) = (server.clone(), q.to_string(), system.clone());
            std::thread::spawn(move || {
                s.chat(json!({"messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": q}],
                              "temperature": 0, "max_tokens": 20}))
            })
        })
        .collect();
    let answers: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        answers
            .iter()
            .any(|a| a["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(500)),
        "no request started from the others' shared blocks"
    );
    for (q, a) in questions.iter().zip(&answers) {
        let run = crate::common::kvchat(
            &[
                "run",
                "--temperature",
                "0",
                "-n",
                "20",
                "--no-kv-store",
                "--system",
                &system,
                q,
            ],
            "",
        );
        assert!(run.status.success(), "{}", stderr(&run));
        let run_text = String::from_utf8(run.stdout).unwrap();
        assert_eq!(text_of(a), run_text.trim_end_matches('\n'), "{q}");
    }
    server.assert_settles();
}

#[test]
fn a_long_prompt_prefilled_in_chunks_between_others_steps_answers_as_kvchat_run_does() {
    // Two prompts of ~700 tokens (over one prefill chunk of 512) that differ from their first
    // words: the second is prefilled a chunk at a time while the first decodes.
    let texts: Vec<String> = ["Apples", "Rivers"]
        .iter()
        .map(|w| {
            let mut t = format!("{w} are the subject of these notes.\n");
            for i in 0..56 {
                t.push_str(&format!(
                    "Note {i}: {w} number {} was seen on day {}.\n",
                    i * 7,
                    i % 30
                ));
            }
            t
        })
        .collect();
    let server = Arc::new(Server::start(&["--parallel", "2"]));
    let handles: Vec<_> = texts
        .iter()
        .map(|t| {
            let (s, t) = (server.clone(), t.clone());
            std::thread::spawn(move || {
                let body = json!({"prompt": t, "temperature": 0, "max_tokens": 48}).to_string();
                let (code, v, _) = s.post("/v1/completions", &body, None);
                assert_eq!(code, 200, "{v}");
                v
            })
        })
        .collect();
    let answers: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (t, a) in texts.iter().zip(&answers) {
        assert!(a["usage"]["prompt_tokens"].as_u64().unwrap() > 600);
        let run = crate::common::kvchat(
            &[
                "run",
                "--raw",
                "--temperature",
                "0",
                "-n",
                "48",
                "--no-kv-store",
                t,
            ],
            "",
        );
        assert!(run.status.success(), "{}", stderr(&run));
        let run_text = String::from_utf8(run.stdout).unwrap();
        assert_eq!(text_of(a), run_text.trim_end_matches('\n'));
    }
    server.assert_settles();
}

#[test]
fn a_port_already_taken_is_refused_in_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let o = crate::common::kvchat(&["serve", "--port", &port, "--exit-after", "5"], "");
    crate::common::assert_refused(&o, &format!("cannot listen on 127.0.0.1:{port}"));
}
