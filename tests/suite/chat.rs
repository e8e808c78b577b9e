//! Chat that keeps its KV cache across turns, and the prompt cache that survives the process.

use crate::common::{engine, kvchat, rel_diff};
use kvchat::kv::{persist, CacheSpec};
use kvchat::session::conversation::{Conversation, OnFull};
use kvchat::session::{Sampler, SamplingParams};
use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::AtomicBool;

fn conversation() -> Conversation<'static> {
    let e = engine();
    Conversation::new(
        e,
        &CacheSpec::full(kvchat::kv::Precision::F32, 4096),
        e.chat_template(None).unwrap(),
        None,
        OnFull::Stop,
    )
}

fn ask(c: &mut Conversation<'_>, q: &str) -> String {
    let mut sampler = Sampler::new(SamplingParams::greedy());
    c.ask(q, &mut sampler, 40, &AtomicBool::new(false), |_| Ok(()))
        .unwrap();
    c.turns().last().unwrap().1.clone()
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvchat-chat-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn after_three_turns_the_cache_equals_one_prefill_of_the_transcript() {
    let mut c = conversation();
    for q in ["hi", "what did I just say?", "Name a colour."] {
        ask(&mut c, q);
    }
    // The transcript as the template renders it, with a fourth question pending.
    let ids = c.render_ids(Some("And another?"), true).unwrap();
    let held = c.session().tokens().len();
    assert_eq!(
        &ids[..held],
        c.session().tokens(),
        "the cache holds a prefix of the transcript"
    );
    let incremental: Vec<f32> = c
        .session_mut()
        .feed(&ids[held..])
        .unwrap()
        .to_vec1()
        .unwrap();
    let mut fresh = engine().session(&CacheSpec::full(kvchat::kv::Precision::F32, 4096));
    let one_prefill: Vec<f32> = fresh.feed(&ids).unwrap().to_vec1().unwrap();
    let d = rel_diff(&incremental, &one_prefill);
    assert!(d < 1e-4, "logits differ by {d} relative");
}

#[test]
fn each_turn_prefills_only_its_new_tokens() {
    let out = kvchat(
        &["chat", "--temperature", "0", "-n", "24", "--stats"],
        "hi\nwhat did I just say?\nName a colour.\n",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let turns: Vec<(usize, usize, usize)> = err
        .lines()
        .filter(|l| l.starts_with("[stats] turn"))
        .map(|l| {
            let num = |after: &str| -> usize {
                l.split(after)
                    .nth(1)
                    .unwrap()
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            (num("reused "), num("prefilled "), num("cache "))
        })
        .collect();
    assert_eq!(turns.len(), 3, "{err}");
    assert_eq!(turns[0].0, 0);
    for k in 1..3 {
        // Everything the cache held after the previous turn is reused; only the new turn is prefilled.
        assert_eq!(turns[k].0, turns[k - 1].2, "{err}");
        assert!(
            turns[k].1 < 30,
            "turn {k} prefilled {} tokens: {err}",
            turns[k].1
        );
    }
}

#[test]
fn undo_then_a_new_question_answers_as_a_fresh_session_with_the_shorter_history() {
    let mut a = conversation();
    ask(&mut a, "What is the capital of France?");
    ask(&mut a, "Tell me a joke.");
    assert!(a.undo().unwrap());
    let after_undo = ask(&mut a, "What is 2+2?");

    let mut b = conversation();
    ask(&mut b, "What is the capital of France?");
    let fresh = ask(&mut b, "What is 2+2?");
    assert_eq!(after_undo, fresh);
    assert_eq!(a.session().tokens(), b.session().tokens());
}

#[test]
fn save_then_load_in_a_new_process_continues_with_identical_output() {
    let file = temp("conv.kvc");
    let f = file.to_str().unwrap();
    let args = ["chat", "--temperature", "0", "-n", "30"];
    let first = kvchat(
        &args,
        &format!("What is the capital of France?\n/save {f}\n"),
    );
    assert!(first.status.success());
    let resumed = kvchat(&args, &format!("/load {f}\nAnd of Italy?\n"));
    let straight = kvchat(&args, "What is the capital of France?\nAnd of Italy?\n");
    let last_answer = |o: &Output| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .rfind(|l| !l.is_empty())
            .unwrap()
            .to_string()
    };
    assert!(
        String::from_utf8_lossy(&resumed.stdout).contains("(loaded 1 turns"),
        "{}",
        String::from_utf8_lossy(&resumed.stdout)
    );
    assert_eq!(last_answer(&resumed), last_answer(&straight));
}

#[test]
fn loading_a_conversation_into_another_cache_configuration_is_refused() {
    let file = temp("conv-int8.kvc");
    let f = file.to_str().unwrap();
    let saved = kvchat(
        &["chat", "--temperature", "0", "-n", "8"],
        &format!("hi\n/save {f}\n"),
    );
    assert!(saved.status.success());
    let out = kvchat(&["chat", "--kv-quant", "int8"], &format!("/load {f}\n"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("error:") && text.contains("int8"), "{text}");
}

fn run_with_cache(file: &str, question: &str) -> Output {
    run_with_cache_and(file, question, &[])
}

/// [`run_with_cache`] with more flags.
fn run_with_cache_and(file: &str, question: &str, flags: &[&str]) -> Output {
    let system = kvchat::eval::bench::BENCH_TEXT.to_string();
    let system: String = system.chars().take(1500).collect();
    let mut args = vec![
        "run",
        "--temperature",
        "0",
        "-n",
        "16",
        "--stats",
        "--prompt-cache",
        file,
        "--system",
        &system,
    ];
    args.extend_from_slice(flags);
    args.push(question);
    kvchat(&args, "")
}

fn reused(o: &Output) -> usize {
    let err = String::from_utf8_lossy(&o.stderr);
    err.split("reused ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"))
}

#[test]
fn warm_prompt_cache_gives_the_cold_answer_and_prefills_only_the_new_part() {
    let file = temp("sys.kvc");
    let f = file.to_str().unwrap();
    let cold = run_with_cache(f, "question 1: what is this text?");
    assert!(cold.status.success());
    assert_eq!(reused(&cold), 0);
    let warm = run_with_cache(f, "question 1: what is this text?");
    assert_eq!(warm.stdout, cold.stdout);
    assert!(reused(&warm) > 300);
    // Another question sharing the system prompt reuses the shared prefix.
    let other = run_with_cache(f, "question 2: who wrote it?");
    assert!(other.status.success());
    assert!(reused(&other) > 300);
}

#[test]
fn a_budget_saves_its_prompt_whole_and_a_warm_run_compresses_it_to_the_cold_answer() {
    let file = temp("budget.kvc");
    let f = file.to_str().unwrap();
    let budget = ["--kv-budget", "128"];
    let cold = run_with_cache_and(f, "question 1: what is this text?", &budget);
    let err = String::from_utf8_lossy(&cold.stderr);
    assert!(cold.status.success(), "{err}");
    assert!(!err.contains("cannot save"), "{err}");
    assert!(err.contains("positions evicted per layer"), "{err}");
    let warm = run_with_cache_and(f, "question 1: what is this text?", &budget);
    assert_eq!(warm.stdout, cold.stdout);
    // The prompt's last 32 positions (the queries that score it) are prefilled again.
    let n = reused(&warm);
    assert!(n > 250, "{n}");
}

#[test]
fn truncated_wrong_model_and_wrong_configuration_caches_are_reported_and_ignored() {
    let good = temp("good.kvc");
    let cold = run_with_cache(good.to_str().unwrap(), "question 1: what is this text?");
    assert!(cold.status.success());
    let bytes = std::fs::read(&good).unwrap();

    let truncated = temp("truncated.kvc");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    // Same container, another model's digest / another cache configuration.
    let e = engine();
    let mut s = e.session(&CacheSpec::full(kvchat::kv::Precision::F32, 4096));
    s.feed(&e.raw_prompt("some prompt").unwrap()).unwrap();
    let other_model = temp("other-model.kvc");
    persist::save(
        &other_model,
        s.tokens(),
        s.cache(),
        "0000-not-this-model",
        "full f32",
        serde_json::json!({}),
    )
    .unwrap();
    let other_config = temp("other-config.kvc");
    persist::save(
        &other_config,
        s.tokens(),
        s.cache(),
        e.digest(),
        "int8",
        serde_json::json!({}),
    )
    .unwrap();

    for (file, why) in [
        (&truncated, "truncated"),
        (&other_model, "another model"),
        (&other_config, "another cache configuration"),
    ] {
        let out = run_with_cache(file.to_str().unwrap(), "question 1: what is this text?");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains("ignoring prompt cache") && err.contains(why),
            "{why}: {err}"
        );
        assert!(!err.contains("panicked"));
        assert_eq!(out.stdout, cold.stdout, "{why}: a wrong answer");
    }
}

#[test]
fn a_prompt_cache_path_holding_something_else_is_refused_and_left_as_it_was() {
    let corrupt = temp("corrupt.kvc");
    let junk = b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all";
    std::fs::write(&corrupt, junk).unwrap();
    let out = run_with_cache(corrupt.to_str().unwrap(), "question 1: what is this text?");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("not a kvchat KV file") && err.contains("will not overwrite"),
        "{err}"
    );
    assert_eq!(std::fs::read(&corrupt).unwrap(), junk);
}

#[test]
fn ctrl_c_in_a_terminal_clears_a_typed_line_stops_an_answer_and_the_chat_goes_on() {
    use std::io::Read;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    // `script` gives kvchat a pseudo-terminal; \x03 there is the user's Ctrl-C. `exec`: no shell
    // stays between script and kvchat to be killed by that SIGINT (dash would die of it).
    let cmd = format!(
        "exec {} chat --temperature 0 -n 2000 --history {}",
        env!("CARGO_BIN_EXE_kvchat"),
        temp("history.txt").display()
    );
    let mut child = Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("KVCHAT_MODEL", crate::common::model_path())
        .env("SHELL", "/bin/sh")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs kvchat in a pseudo-terminal");
    let mut stdin = child.stdin.take().unwrap();
    // The terminal's output, as it arrives.
    let seen = Arc::new(Mutex::new(String::new()));
    let mut stdout = child.stdout.take().unwrap();
    let sink = seen.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    // Waits (up to a minute: the machine may be busy) until `cond` holds of the output so far.
    let wait_for = |what: &str, cond: &dyn Fn(&str) -> bool| {
        let start = Instant::now();
        while !cond(&seen.lock().unwrap()) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}: {}",
                seen.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // What the terminal showed after the last `marker`.
    let after = |text: &str, marker: &str| {
        text.rsplit_once(marker)
            .map_or(String::new(), |(_, a)| a.to_string())
    };

    wait_for("the banner", &|t| t.contains("/help for commands"));
    // Ctrl-C on a line being typed clears that line; the chat goes on.
    stdin.write_all(b"half a thought").unwrap();
    wait_for("the typed text", &|t| t.contains("half a thought"));
    stdin.write_all(b"\x03").unwrap();
    wait_for("the line to be cleared", &|t| {
        t.contains("(line cleared; Ctrl-D or /exit to leave)")
    });
    stdin
        .write_all(b"Tell me a very long story about dragons.\r")
        .unwrap();
    // Ctrl-C once the answer is streaming, long before it could end.
    wait_for("the answer to stream", &|t| {
        after(t, "dragons.").len() > 120
    });
    stdin.write_all(b"\x03").unwrap();
    wait_for("the interruption", &|t| t.contains("(interrupted)"));
    stdin.write_all(b"What is 2+2?\r").unwrap();
    wait_for("the next answer and prompt", &|t| {
        let a = after(t, "What is 2+2?");
        a.contains('4') && a.contains("> ")
    });
    stdin.write_all(b"/exit\r").unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "kvchat did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(stdin);
    reader.join().unwrap();
    let text = seen.lock().unwrap().clone();
    // The story was cut short: the answer before "(interrupted)" is a few lines, not 2000 tokens.
    let story = after(
        text.split("(interrupted)").next().unwrap_or_default(),
        "dragons.",
    );
    assert!(story.len() < 2000, "not interrupted early: {story}");
    assert!(
        !story.contains("^C"),
        "the terminal echoed ^C into the answer: {story}"
    );
    // The cleared line never became a turn (turns go into the history file).
    let history = std::fs::read_to_string(temp("history.txt")).unwrap_or_default();
    assert!(history.contains("dragons"), "{history}");
    assert!(!history.contains("half a thought"), "{history}");
    assert!(status.success(), "{status}: {text}");
}

#[test]
fn a_block_and_a_continued_line_are_one_turn_each() {
    let out = kvchat(
        &["chat", "--temperature", "0", "-n", "8", "--stats"],
        "\"\"\"\nfirst line\nsecond line\n\"\"\"\nabc \\\ndef\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.lines()
            .filter(|l| l.starts_with("[stats] turn"))
            .count(),
        2,
        "{err}"
    );
}

#[test]
fn a_full_context_stops_with_a_message_or_shifts_out_old_turns() {
    let questions = "Tell me about the sea.\nTell me about the sky.\nTell me about the moon.\nTell me about the sun.\n";
    let stop = kvchat(
        &["chat", "--temperature", "0", "-n", "40", "--ctx", "160"],
        questions,
    );
    let err = String::from_utf8_lossy(&stop.stderr);
    assert!(err.contains("no longer fits the context of 160"), "{err}");
    // Piped input is a script: a turn that failed makes the whole run fail.
    assert_eq!(stop.status.code(), Some(1), "{err}");
    assert!(
        err.contains("of the chat's turns or commands failed"),
        "{err}"
    );

    let shift = kvchat(
        &[
            "chat",
            "--temperature",
            "0",
            "-n",
            "40",
            "--ctx",
            "160",
            "--on-full",
            "shift",
            "--stats",
        ],
        questions,
    );
    let err = String::from_utf8_lossy(&shift.stderr);
    assert!(shift.status.success());
    assert!(err.contains("dropped 1 old turn"), "{err}");
    assert!(!err.contains("error:"), "{err}");
    assert_eq!(
        err.lines()
            .filter(|l| l.starts_with("[stats] turn"))
            .count(),
        4,
        "{err}"
    );
    // Turns dropped to make room still count: the fourth turn is turn 4.
    assert!(err.contains("[stats] turn 4:"), "{err}");
}

#[test]
fn a_chat_that_compacts_when_full_never_errors_and_keeps_its_system_message() {
    let e = kvchat::engine::Engine::load(&kvchat::engine::LoadOptions {
        ctx: Some(384),
        ..crate::common::model_args()
    })
    .unwrap();
    let system = "You are a pirate named Jack.";
    let mut c = Conversation::new(
        &e,
        &CacheSpec::full(kvchat::kv::Precision::F16, 384),
        e.chat_template(None).unwrap(),
        Some(system.to_string()),
        OnFull::Compact,
    );
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let mut compactions = Vec::new();
    for i in 0..16 {
        let q = format!(
            "Question {i}: tell me one thing about the number {}.",
            100 + i
        );
        let t = c
            .ask(&q, &mut sampler, 24, &AtomicBool::new(false), |_| Ok(()))
            .unwrap_or_else(|err| panic!("turn {i}: {err}"));
        assert_eq!(t.number, i + 1, "turns keep counting the compacted ones");
        compactions.extend(t.compacted);
    }
    assert!(compactions.len() >= 2, "{compactions:?}");
    for k in &compactions {
        assert!(k.tokens_after < k.tokens_before, "{k}");
        assert!(k.turns >= 1);
    }
    // The system message stays first, the note with it, the recent turns after.
    let m = c.messages(None);
    assert_eq!(m[0].role, "system");
    assert!(m[0].content.starts_with(system), "{}", m[0].content);
    assert!(m[0]
        .content
        .contains("Summary of the earlier conversation: "));
    assert!(c.note().is_some_and(|n| !n.is_empty()));
    assert!(c.render_ids(None, false).unwrap().len() < 384);
}

#[test]
fn cache_shows_what_a_budget_holds_and_dropped_and_what_the_turn_reused() {
    let long = "Remember this list of fruits: apple, pear, plum, fig, kiwi, lime. ".repeat(20);
    let out = kvchat(
        // No prefix store: what the first turn reuses must not depend on the runs before.
        &[
            "chat",
            "--temperature",
            "0",
            "-n",
            "8",
            "--kv-budget",
            "96",
            "--no-kv-store",
        ],
        &format!("{long}\n/cache\nAnd one more?\n/cache\n"),
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    let holds: Vec<usize> = said
        .lines()
        .filter_map(|l| l.strip_prefix("holds "))
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(holds.len(), 2, "{said}");
    assert!(holds.iter().all(|&n| n <= 96 + kvchat::kv::SLACK), "{said}");
    assert!(said.contains("retention budget of 96 positions"), "{said}");
    let evicted = said
        .lines()
        .find_map(|l| l.strip_prefix("kv budget: "))
        .and_then(|l| l.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(evicted > 200, "{said}");
    assert!(
        said.contains("last turn (#1): reused 0 positions"),
        "{said}"
    );
    // The second turn reuses what the budget kept of the first (its rendered prefix).
    assert!(said.contains("last turn (#2): reused "), "{said}");
    assert!(!said.contains("last turn (#2): reused 0 "), "{said}");
}

#[test]
fn cache_shows_the_context_meter_and_what_a_full_context_will_do() {
    let out = kvchat(
        &[
            "chat",
            "--temperature",
            "0",
            "-n",
            "4",
            "--ctx",
            "2048",
            "--on-full",
            "shift",
        ],
        "Hello there.\n/cache\n",
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    let held = said
        .lines()
        .find_map(|l| l.strip_prefix("holds "))
        .and_then(|l| l.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("{said}"));
    let meter = format!(
        "context: {held} of 2,048 tokens ({:.1} %); when full: the oldest turns are dropped",
        100.0 * held as f64 / 2048.0
    );
    assert!(said.contains(&meter), "{meter} not in {said}");
}

#[test]
fn compact_on_demand_says_what_it_did_and_the_chat_goes_on() {
    let out = kvchat(
        &["chat", "--temperature", "0", "-n", "16"],
        "My name is Ada.\nWhat is a cache?\n/compact\nWhat is my name?\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{err}");
    assert!(said.contains("(compacted 1 turn into a note of"), "{said}");
    let empty = kvchat(&["chat", "-n", "8"], "/compact\n");
    let said = String::from_utf8_lossy(&empty.stdout);
    assert!(said.contains("nothing to compact yet"), "{said}");
    assert_eq!(empty.status.code(), Some(1));
}

#[test]
fn set_changes_sampling_mid_chat_and_show_says_where_each_setting_came_from() {
    let out = kvchat(
        &["chat", "-n", "4", "--top-k", "5"],
        "/set temperature 0\n/set max-tokens 3\n/show\n",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("(temperature = 0)"), "{text}");
    let sampling = text
        .lines()
        .find(|l| l.starts_with("sampling"))
        .unwrap_or_else(|| panic!("no sampling line in /show: {text}"));
    assert!(sampling.contains("temperature 0 (/set)"), "{sampling}");
    assert!(sampling.contains("top-k 5 (flag)"), "{sampling}");
    assert!(sampling.contains("(random)"), "{sampling}");
    assert!(text.contains("max tokens   3"), "{text}");
    for fact in [
        "architecture llama",
        "parameters   134.5M",
        "context      ",
        "cache        ",
    ] {
        assert!(text.contains(fact), "{fact:?} not in /show: {text}");
    }
}

#[test]
fn a_refused_set_changes_nothing_and_a_mistyped_command_gets_a_suggestion() {
    let out = kvchat(
        &["chat", "--temperature", "0.5"],
        "/set top-p 2\n/sett\n/set\n",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("error: /set top-p must be between 0 and 1, got 2"),
        "{text}"
    );
    assert!(text.contains("did you mean '/set'?"), "{text}");
    assert!(text.contains("temperature 0.5 (flag)"), "{text}");
    assert!(text.contains("top-p 0.95,"), "unchanged: {text}");
    assert_eq!(out.status.code(), Some(1), "errors in a piped chat fail it");
}

#[test]
fn set_seed_replays_the_same_sampled_answer_even_when_the_seed_is_unchanged() {
    let out = kvchat(
        &["chat", "--temperature", "1.5", "--seed", "5", "-n", "12"],
        "/set seed 5\nSay a random word.\n/undo\n/set seed 5\nSay a random word.\n",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('(') && !l.trim().is_empty())
        .collect();
    assert_eq!(answers.len(), 2, "{text}");
    assert_eq!(answers[0], answers[1], "{text}");
}

#[test]
fn undo_of_the_only_exchange_keeps_the_system_prompt_cached() {
    let mut c = conversation();
    c.set_system(Some("You are terse.".into()));
    ask(&mut c, "hi");
    assert!(c.undo().unwrap());
    let system_ids = engine()
        .encode_conversation(
            c.template(),
            &[kvchat::template::Message::new("system", "You are terse.")],
            false,
        )
        .unwrap();
    assert!(
        c.session().tokens().len() >= system_ids.len(),
        "holds {} positions, the system prompt is {}",
        c.session().tokens().len(),
        system_ids.len()
    );
    assert_eq!(&c.session().tokens()[..system_ids.len()], &system_ids[..]);
}

#[test]
fn an_answer_cut_by_the_full_context_says_so_not_max_tokens() {
    let out = kvchat(
        &[
            "chat",
            "--temperature",
            "0",
            "-n",
            "500",
            "--ctx",
            "48",
            "--stats",
        ],
        "Tell me a long story.\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("stop: context full"), "{err}");
    assert!(err.contains("the context of 48 tokens is full"), "{err}");
    assert!(!err.contains("max tokens"), "{err}");
}

#[test]
fn no_color_turns_the_prompt_colour_off_on_a_terminal() {
    let cmd = format!("exec {} chat", env!("CARGO_BIN_EXE_kvchat"));
    let mut child = Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("KVCHAT_MODEL", crate::common::model_path())
        .env("SHELL", "/bin/sh")
        .env("NO_COLOR", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs kvchat in a pseudo-terminal");
    // The pseudo-terminal buffers what is typed until kvchat reads it at its prompt.
    child.stdin.take().unwrap().write_all(b"/exit\r").unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("/help for commands"), "{text}");
    assert!(text.contains("> "), "{text}");
    assert!(
        !text.contains("\x1b[1;32m"),
        "coloured despite NO_COLOR: {text}"
    );
}

#[test]
fn piped_chat_stats_carry_no_colour_codes() {
    let out = kvchat(
        &["chat", "--temperature", "0", "-n", "2", "--stats"],
        "hi\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[stats] turn 1:"), "{err}");
    assert!(!err.contains('\x1b'), "{err}");
}

#[test]
fn help_lists_every_slash_command_and_each_one_is_understood() {
    let out = kvchat(&["chat"], "/help\n");
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{help}");
    let names: Vec<&str> = help
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.starts_with('/'))
        .collect();
    assert_eq!(
        names,
        [
            "/help", "/reset", "/compact", "/system", "/set", "/show", "/stats", "/cache", "/save",
            "/load", "/undo", "/exit"
        ]
    );
    // Each listed command (and /exit's aliases) is dispatched: none is "unknown".
    let script: String = names
        .iter()
        // (/save and /load need a file, /compact a turn: their errors are tested on their own.)
        .filter(|n| !["/exit", "/save", "/load", "/compact"].contains(n))
        .chain(["/quit"].iter())
        .map(|n| format!("{n}\n"))
        .collect();
    let out = kvchat(&["chat"], &script);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("unknown command"), "{text}");
    assert!(out.status.success(), "{text}");
}

#[test]
fn a_file_command_without_its_file_is_an_error_that_says_how_to_use_it() {
    let out = kvchat(&["chat"], "/save\n/load\n");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("error: usage: /save FILE"), "{text}");
    assert!(text.contains("error: usage: /load FILE"), "{text}");
    assert_eq!(out.status.code(), Some(1), "errors in a piped chat fail it");
}

#[test]
fn a_chat_with_drafts_answers_as_one_without_and_holds_the_same_cache() {
    let questions = [
        "Repeat word for word: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
        "Now say it once more, exactly.",
    ];
    let mut plain = conversation();
    let mut fast = conversation();
    fast.set_draft(Some(8));
    for q in questions {
        assert_eq!(ask(&mut plain, q), ask(&mut fast, q), "{q}");
        assert_eq!(plain.session().tokens(), fast.session().tokens());
    }
    let drafted = fast.last().unwrap().gen.drafted;
    assert!(
        drafted > 0,
        "the second answer repeats the first: something to draft from"
    );
}

#[test]
fn a_chat_drafting_on_a_quantized_window_answers_as_one_without_through_undo() {
    // int8 rows with their f16 residual, a window of 96 with 4 sinks that drops positions during
    // the answers: guesses taken back, a turn undone after a drafted answer, and asked again.
    let fox = "Repeat word for word: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.";
    let questions = format!("{fox}\n/undo\n{fox}\nNow say it once more, exactly.\n");
    let flags = [
        "chat",
        "--temperature",
        "0",
        "-n",
        "48",
        "--kv-type",
        "int8",
        "--kv-window",
        "96",
        "--kv-sinks",
        "4",
        "--stats",
    ];
    let plain = kvchat(&flags, &questions);
    let mut with: Vec<&str> = flags.to_vec();
    with.extend(["--draft", "ngram"]);
    let drafted = kvchat(&with, &questions);
    let err = String::from_utf8_lossy(&drafted.stderr);
    assert!(drafted.status.success(), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&plain.stdout),
        String::from_utf8_lossy(&drafted.stdout)
    );
    assert!(err.contains("accepted"), "{err}");
}

#[test]
fn a_chat_drafted_by_a_model_answers_as_one_without() {
    // The model drafting for itself: every guess is the token it then samples.
    let model = crate::common::model_path();
    let questions = "Name three colours.\nAnd three animals?\n";
    let flags = ["chat", "--temperature", "0", "-n", "24", "--stats"];
    let plain = kvchat(&flags, questions);
    let mut with: Vec<&str> = flags.to_vec();
    with.extend(["--draft", model.to_str().unwrap(), "--draft-max", "4"]);
    let drafted = kvchat(&with, questions);
    let err = String::from_utf8_lossy(&drafted.stderr);
    assert!(drafted.status.success(), "{err}");
    assert_eq!(plain.stdout, drafted.stdout);
    assert!(err.contains("drafted"), "{err}");
}

#[test]
fn a_saved_conversation_whose_note_is_not_text_is_refused_and_left_as_it_was() {
    let mut c = conversation();
    ask(&mut c, "Hello!");
    let file = temp("bad-note.kvc");
    let s = c.session();
    let key = s.cache().persist_key().unwrap();
    let extra = serde_json::json!({ "system": null, "turns": c.turns(), "note": 42 });
    persist::save(
        &file,
        s.tokens(),
        s.cache(),
        crate::common::engine().digest(),
        &key,
        extra,
    )
    .unwrap();
    let before = std::fs::read(&file).unwrap();
    let mut other = conversation();
    let err = other.load(&file).unwrap_err().to_string();
    assert!(
        err.contains("holds a note of compacted turns that is not text"),
        "{err}"
    );
    assert!(other.turns().is_empty() && other.note().is_none());
    assert_eq!(std::fs::read(&file).unwrap(), before);
}
