//! The prefix store (issue 15) through the binary, on the real model: a run reuses what an
//! earlier one stored and answers exactly as without the store; damage, foreign blocks and an
//! unusable store are reported once and change nothing in the answer; concurrent runs sharing a
//! prefix leave a sound store.

use crate::common::kvchat_env;
use kvchat::kv::{CacheSpec, Precision};
use kvchat::session::prefix::PrefixReuse;
use kvchat::template::Message;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Output;

/// A system prompt of ~330 tokens of plain prose (5 full blocks and a tail).
fn system_prompt() -> String {
    let s = "The lighthouse keeper wrote down the weather every morning, the ships that passed, \
             and the colour of the sea. ";
    let t = "In winter the storms came from the north and the lamp burned through the night. ";
    let mut out = String::from("You answer questions about this logbook. ");
    for i in 0..10 {
        out.push_str(s);
        out.push_str(t);
        out.push_str(&format!("Entry {i} ends here. "));
    }
    out
}

/// A fresh store directory for one test.
fn fresh_store(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("store-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_file(&d);
    d
}

fn ask(store: &Path, question: &str, extra: &[&str]) -> Output {
    let sys = system_prompt();
    let mut args = vec![
        "run",
        "--temperature",
        "0",
        "-n",
        "12",
        "--stats",
        "--system",
        &sys,
    ];
    args.extend_from_slice(extra);
    args.push(question);
    kvchat_env(&args, "", &[("KVCHAT_KV_STORE", store.as_os_str())])
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The "[stats] prefix store: …" line's reused-token count.
fn reused(o: &Output) -> usize {
    let err = text(&o.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("[stats] prefix store:"))
        .unwrap_or_else(|| panic!("no prefix store line in:\n{err}"));
    line.split_whitespace()
        .nth(3)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn store_problems(o: &Output) -> Vec<String> {
    text(&o.stderr)
        .lines()
        .filter(|l| l.starts_with("kvchat: prefix store:"))
        .map(str::to_string)
        .collect()
}

/// The block that holds positions 0..64 (its header says so).
fn chain_start(dir: &Path) -> PathBuf {
    blocks(dir)
        .into_iter()
        .find(|b| {
            let bytes = std::fs::read(b).unwrap();
            let n = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
            let h: serde_json::Value = serde_json::from_slice(&bytes[12..12 + n]).unwrap();
            h["start"] == 0 && h["len"] == 64
        })
        .expect("a first block")
}

fn blocks(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for d in std::fs::read_dir(dir).unwrap().flatten() {
        if d.path().is_dir() {
            for f in std::fs::read_dir(d.path()).unwrap().flatten() {
                if f.path().extension().is_some_and(|x| x == "kvb") {
                    out.push(f.path());
                }
            }
        }
    }
    out
}

/// The answer a run gives without any store.
fn reference(question: &str, extra: &[&str]) -> String {
    let mut flags = extra.to_vec();
    flags.push("--no-kv-store");
    let o = ask(Path::new("/nonexistent-unused"), question, &flags);
    assert!(o.status.success(), "{}", text(&o.stderr));
    text(&o.stdout)
}

#[test]
fn a_second_run_reuses_the_stored_system_prompt_and_answers_as_without_the_store() {
    let store = fresh_store("reuse");
    let first = ask(&store, "Where is the lighthouse?", &[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(reused(&first), 0);
    let second = ask(&store, "What did the keeper write down?", &[]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    // The whole system message (its tail block ends where it ends) came from the store.
    let sys_tokens = reused(&second);
    assert!(sys_tokens > 5 * 64, "reused {sys_tokens}");
    assert_eq!(
        text(&second.stdout),
        reference("What did the keeper write down?", &[])
    );
    assert!(store_problems(&second).is_empty());
}

#[test]
fn a_quantized_cache_reuses_blocks_and_answers_as_without_the_store() {
    let store = fresh_store("int8");
    let flags = ["--kv-type", "int8"];
    assert!(ask(&store, "Where is the lighthouse?", &flags)
        .status
        .success());
    let second = ask(&store, "When did the storms come?", &flags);
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert!(reused(&second) >= 4 * 64, "reused {}", reused(&second));
    assert_eq!(
        text(&second.stdout),
        reference("When did the storms come?", &flags)
    );
}

#[test]
fn a_quantized_cache_resumed_past_a_prefill_chunk_answers_as_without_the_store() {
    // ~1,000 tokens: the prompt spans two 512-position prefill steps, and the stored prefix ends
    // inside the second (where a resumed prefill must step as a whole one does).
    let store = fresh_store("int8-long");
    let long = format!("{0} {0} {0}", system_prompt());
    let flags = ["--kv-type", "int8", "--kv-residual", "48"];
    let run = |q: &str, extra: &[&str]| {
        let mut args = vec!["run", "--temperature", "0", "-n", "12", "--stats"];
        args.extend_from_slice(&["--system", &long]);
        args.extend_from_slice(&flags);
        args.extend_from_slice(extra);
        args.push(q);
        kvchat_env(&args, "", &[("KVCHAT_KV_STORE", store.as_os_str())])
    };
    assert!(run("Where is the lighthouse?", &[]).status.success());
    let q = "What did the keeper write down?";
    let second = run(q, &[]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    let n = reused(&second);
    assert!(n > 512 && !n.is_multiple_of(512), "reused {n}");
    assert_eq!(
        text(&second.stdout),
        text(&run(q, &["--no-kv-store"]).stdout)
    );
}

#[test]
fn damaged_blocks_are_each_reported_once_removed_and_the_answer_is_unchanged() {
    let store = fresh_store("damaged");
    assert!(ask(&store, "Where is the lighthouse?", &[])
        .status
        .success());
    let all = blocks(&store);
    assert!(all.len() >= 6, "{} blocks", all.len());
    // Flip one bit in every block: the chain's first block is found damaged and the run goes on.
    for b in &all {
        let mut bytes = std::fs::read(b).unwrap();
        let i = bytes.len() / 3;
        bytes[i] ^= 4;
        std::fs::write(b, bytes).unwrap();
    }
    let q = "What did the keeper write down?";
    let o = ask(&store, q, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let problems = store_problems(&o);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("checksum mismatch"), "{problems:?}");
    assert_eq!(reused(&o), 0);
    assert_eq!(text(&o.stdout), reference(q, &[]));
}

#[test]
fn a_truncated_or_empty_block_is_reported_and_the_answer_is_unchanged() {
    let store = fresh_store("truncated");
    assert!(ask(&store, "Where is the lighthouse?", &[])
        .status
        .success());
    // The chain's first block emptied, every other one cut in half.
    let first = chain_start(&store);
    for b in blocks(&store) {
        let bytes = std::fs::read(&b).unwrap();
        let keep = if b == first { 0 } else { bytes.len() / 2 };
        std::fs::write(&b, &bytes[..keep]).unwrap();
    }
    let q = "What did the keeper write down?";
    let o = ask(&store, q, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let problems = store_problems(&o);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("not a kvchat KV block"),
        "{problems:?}"
    );
    assert_eq!(text(&o.stdout), reference(q, &[]));
    // Every block was replaced by a sound one: the next run reuses the prompt again.
    assert!(reused(&ask(&store, q, &[])) > 5 * 64);
}

#[test]
fn a_store_directory_that_is_a_file_is_reported_once_and_left_alone() {
    let store = fresh_store("is-a-file");
    std::fs::write(&store, b"my notes").unwrap();
    let q = "Where is the lighthouse?";
    let o = ask(&store, q, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let problems = store_problems(&o);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("not a directory"), "{problems:?}");
    assert_eq!(std::fs::read(&store).unwrap(), b"my notes");
    assert_eq!(text(&o.stdout), reference(q, &[]));
}

#[test]
fn a_store_that_cannot_be_written_is_reported_once_and_the_answer_is_unchanged() {
    let store = fresh_store("unwritable");
    // The lock file's place is taken by a directory: nothing can be written (as with a
    // read-only or full disk, the writer gives up with one line).
    std::fs::create_dir_all(store.join("lock")).unwrap();
    let q = "Where is the lighthouse?";
    let o = ask(&store, q, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let problems = store_problems(&o);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(blocks(&store).is_empty());
    assert_eq!(text(&o.stdout), reference(q, &[]));
}

#[test]
fn concurrent_runs_sharing_a_prefix_leave_a_sound_store() {
    let store = fresh_store("concurrent");
    let questions = [
        "Where is the lighthouse?",
        "What did the keeper write down?",
        "When did the storms come?",
    ];
    let runs: Vec<_> = questions
        .iter()
        .map(|q| {
            let store = store.clone();
            let q = q.to_string();
            std::thread::spawn(move || ask(&store, &q, &[]))
        })
        .collect();
    for (r, q) in runs.into_iter().zip(questions) {
        let o = r.join().unwrap();
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert!(store_problems(&o).is_empty(), "{:?}", store_problems(&o));
        assert_eq!(text(&o.stdout), reference(q, &[]), "{q}");
    }
    let again = ask(&store, questions[1], &[]);
    assert!(store_problems(&again).is_empty());
    assert!(reused(&again) > 5 * 64);
}

#[test]
fn no_kv_store_neither_reads_nor_writes_the_store() {
    let store = fresh_store("off");
    let o = ask(&store, "Where is the lighthouse?", &["--no-kv-store"]);
    assert!(o.status.success());
    assert!(text(&o.stderr).contains("prefix store: not used: --no-kv-store"));
    assert!(!store.exists());
}

#[test]
fn a_window_cache_says_once_that_it_stores_nothing() {
    let store = fresh_store("window");
    let o = ask(&store, "Where is the lighthouse?", &["--kv-window", "128"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert_eq!(
        err.matches("prefix store: not used: a window").count(),
        1,
        "{err}"
    );
    assert!(!store.exists() || blocks(&store).is_empty());
}

#[test]
fn a_bad_budget_is_a_one_line_error_naming_the_flag() {
    let o = kvchat_env(
        &["run", "--kv-store-budget", "2XB", "hi"],
        "",
        &[("KVCHAT_KV_STORE", OsStr::new("/nonexistent"))],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--kv-store-budget") && err.contains("2XB"),
        "{err}"
    );
}

#[test]
fn cache_stats_ls_and_clear_show_and_remove_what_runs_stored() {
    let store = fresh_store("cli");
    assert!(ask(&store, "Where is the lighthouse?", &[])
        .status
        .success());
    assert!(ask(&store, "What did the keeper write down?", &[])
        .status
        .success());
    let env = [("KVCHAT_KV_STORE", store.as_os_str())];
    let stats = text(&kvchat_env(&["cache", "stats"], "", &env).stdout);
    assert!(stats.contains("lookups 2, hits 1:"), "{stats}");
    assert!(stats.contains("hit rate"), "{stats}");
    let ls = text(&kvchat_env(&["cache", "ls"], "", &env).stdout);
    assert!(ls.contains("SmolLM2") && ls.contains("all, f16"), "{ls}");
    let cleared = text(&kvchat_env(&["cache", "clear", "--model", "SmolLM2"], "", &env).stdout);
    assert!(cleared.starts_with("removed "), "{cleared}");
    assert!(blocks(&store).is_empty());
}

#[test]
fn a_chat_reuses_the_stored_system_prompt_on_its_first_turn() {
    let store = fresh_store("chat");
    assert!(ask(&store, "Where is the lighthouse?", &[])
        .status
        .success());
    let sys = system_prompt();
    let o = kvchat_env(
        &[
            "chat",
            "--temperature",
            "0",
            "-n",
            "8",
            "--stats",
            "--system",
            &sys,
        ],
        "What did the keeper write down?\n/cache\n",
        &[("KVCHAT_KV_STORE", store.as_os_str())],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("[stats] prefix store:"))
        .unwrap_or_else(|| panic!("{err}"));
    let n: usize = line
        .split_whitespace()
        .nth(3)
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(n > 5 * 64, "{line}");
    assert!(text(&o.stdout).contains("prefix store:"));
    // /cache says how many of the turn's positions came from the store.
    let from_store = format!("; {n} positions came from the prefix store");
    assert!(text(&o.stdout).contains(&from_store), "{}", text(&o.stdout));
}

/// Logits after a whole prompt prefilled at once, and after the same prompt resumed from the
/// blocks an earlier, 480-token prompt stored (so the resumed prefill crosses a 512-position
/// prefill step), with `spec`; returns both and the positions restored.
fn whole_and_resumed(spec: &CacheSpec, name: &str, ids: &[u32]) -> (Vec<f32>, Vec<f32>, usize) {
    resumed_after(spec, name, ids, 480)
}

/// As `whole_and_resumed`, the earlier prompt being `ids[..earlier]`.
fn resumed_after(
    spec: &CacheSpec,
    name: &str,
    ids: &[u32],
    earlier: usize,
) -> (Vec<f32>, Vec<f32>, usize) {
    let e = crate::common::engine();
    let root = fresh_store(name);
    let ids_earlier = &ids[..earlier];
    let mut earlier = e.session(spec);
    earlier.feed(ids_earlier).unwrap();
    let mut store = PrefixReuse::open(e, &earlier, &root, 1 << 30);
    store.store(&earlier, true, &[], ids_earlier.len());
    store.finish();
    assert!(store.take_problems().is_empty());
    let mut whole = e.session(spec);
    let a: Vec<f32> = whole.feed(ids).unwrap().to_vec1().unwrap();
    let mut resumed = e.session(spec);
    let mut store = PrefixReuse::open(e, &resumed, &root, 1 << 30);
    let n = store.restore(&mut resumed, ids, &[]).unwrap();
    let b: Vec<f32> = resumed.feed(&ids[n..]).unwrap().to_vec1().unwrap();
    (a, b, n)
}

fn long_prompt() -> Vec<u32> {
    let e = crate::common::engine();
    let t = e.chat_template(None).unwrap();
    let sys = format!("{0} {0} {0}", system_prompt());
    let messages = [
        Message::new("system", &sys),
        Message::new("user", "Who kept the log?"),
    ];
    e.chat_prompt(&t, &messages).unwrap()
}

#[test]
fn a_resumed_f16_prompt_has_the_logits_of_a_whole_one_bit_for_bit() {
    let ids = long_prompt();
    let (a, b, n) = whole_and_resumed(&CacheSpec::full(Precision::F16, 4096), "logits-f16", &ids);
    assert_eq!(n, 448, "restored {n} of {}", ids.len());
    assert!(ids.len() > 600);
    assert!(a == b, "the logits differ");
}

#[test]
fn a_resumed_int8_prompt_has_the_logits_of_a_whole_one_bit_for_bit() {
    // Past a 512-position prefill step: the resumed prefill must step as the whole one does.
    let ids = long_prompt();
    let spec = CacheSpec::full(Precision::Int8, 4096);
    let (a, b, n) = whole_and_resumed(&spec, "logits-int8", &ids);
    // (448 = the last block end at least 32 residual positions before the earlier prompt's end.)
    assert_eq!(n, 448, "restored {n} of {}", ids.len());
    assert!(ids.len() > 600);
    assert!(a == b, "the logits differ");
}

#[test]
fn a_quantized_cache_never_resumes_among_the_positions_a_step_reads_in_f16() {
    // With 100 residual positions, one prefill reads positions 412..512 of its first step from
    // their f16 copies: a resume at 448 (a stored block's end) would read 412..448 quantized, so
    // the store resumes at 384.
    let ids = long_prompt();
    let spec = CacheSpec::full(Precision::Int8, 4096).with(|m| m.residual = 100);
    let (a, b, n) = resumed_after(&spec, "logits-int8-r100", &ids, 600);
    assert_eq!(n, 384, "restored {n} of {}", ids.len());
    assert!(a == b, "the logits differ");
}

#[test]
fn a_budget_resumed_from_the_store_compresses_and_answers_as_one_prefill() {
    use kvchat::session::{Sampler, SamplingParams};
    let e = crate::common::engine();
    let ids = long_prompt();
    for evict in [kvchat::kv::Evict::SnapKv, kvchat::kv::Evict::Tova] {
        let spec = CacheSpec::full(Precision::F16, 4096).with(|m| {
            m.retention = kvchat::kv::Retention::Budget {
                budget: 128,
                sinks: 4,
                evict,
                pyramid: false,
            }
        });
        // An earlier prompt's whole rows go to the store before its budget compresses them.
        let root = fresh_store(&format!("budget-{}", evict.name()));
        let mut earlier = e.session(&spec);
        earlier.hold_evictions(true);
        earlier.feed(&ids[..480]).unwrap();
        let mut store = PrefixReuse::open(e, &earlier, &root, 1 << 30);
        store.store(&earlier, true, &[], 480);
        earlier.evict_held().unwrap();
        assert!(earlier.cache().len() <= 128 + kvchat::kv::SLACK);
        store.finish();
        assert!(store.take_problems().is_empty());
        let answer = |s: &mut kvchat::session::Session<'_>, logits| {
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let (out, _, _) = s
                .decode(logits, &mut sampler, 24, &[], true, |_| Ok(true))
                .unwrap();
            out
        };
        let mut whole = e.session(&spec);
        let logits = whole.feed(&ids).unwrap();
        let a = answer(&mut whole, logits);
        let mut resumed = e.session(&spec);
        let mut store = PrefixReuse::open(e, &resumed, &root, 1 << 30);
        let n = store.restore(&mut resumed, &ids, &[]).unwrap();
        assert_eq!(n, 448, "{evict:?}");
        let logits = resumed.feed(&ids[n..]).unwrap();
        assert!(
            resumed.cache().len() <= 128 + kvchat::kv::SLACK,
            "compressed after the restore"
        );
        let b = answer(&mut resumed, logits);
        assert_eq!(a, b, "{evict:?}");
        assert_eq!(whole.cache().len(), resumed.cache().len());
    }
}
