//! The scheduler on its own (`kvchat::sched`), on a tiny random model: token ids in, events out,
//! no HTTP and no Python. Admission into the pool, waiting for the batch, preemption and prefix
//! sharing each leave every answer equal to the one served alone.

use crate::common::tiny::write_tiny_with_tokenizer;
use kvchat::engine::{Engine, LoadOptions};
use kvchat::kv::{CacheSpec, Precision};
use kvchat::model::sampling::SamplingPrefs;
use kvchat::sched::counters::{Counters, Shared};
use kvchat::sched::pool::{Pool, ADMIT_AHEAD};
use kvchat::sched::{self, Event, Failure, Job, Limits, Prefixes, Queue, Scheduler};
use kvchat::session::prefix::PrefixReuse;
use std::sync::{Arc, OnceLock};
use tokio::sync::mpsc::UnboundedReceiver;

const CTX: usize = 512;

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let path = write_tiny_with_tokenizer("sched");
        let opts = LoadOptions {
            ctx: Some(CTX),
            ..LoadOptions::for_path(path)
        };
        Engine::load(&opts).expect("loading the tiny model")
    })
}

fn spec() -> CacheSpec {
    CacheSpec::full(Precision::F32, CTX)
}

fn greedy() -> SamplingPrefs {
    SamplingPrefs {
        temperature: Some(0.0),
        ..Default::default()
    }
}

/// A scheduler of `parallel` sequences over a pool of `pool` bytes, its counts, and a queue to
/// take tickets from.
fn scheduler(parallel: usize, pool: u64) -> (Scheduler<'static>, Arc<Shared>, Queue) {
    let counts = Arc::new(Shared::default());
    let (queue, _inbox) = sched::queue(64, counts.clone());
    let prefixes = Prefixes {
        share_refusal: None,
        store: PrefixReuse::off("the tests' scheduler has no store"),
    };
    let limits = Limits {
        parallel,
        pool,
        sampling: greedy(),
    };
    let s = Scheduler::new(engine(), spec(), prefixes, limits, counts.clone());
    (s, counts, queue)
}

/// A prompt of `n` tokens of the tiny vocabulary, different for each `seed`.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 7 + seed * 13) % 30)
        .collect()
}

fn job(queue: &Queue, prompt: Vec<u32>, max_tokens: usize) -> (Job, UnboundedReceiver<Event>) {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        constraint: None,
        keep_special: false,
        prompt,
        max_tokens,
        sampling: greedy(),
        stop: Vec::new(),
        // (The tiny model's weights are random: answers run to max_tokens, never to a chance
        // end-of-text, so each test's lengths are what it says.)
        ignore_eos: true,
        events,
        arrived: std::time::Instant::now(),
        ticket: queue.reserve().unwrap(),
    };
    (job, rx)
}

/// What a job's sender received: (prompt tokens, cached tokens), the text, and the completion
/// tokens — or the failure.
#[derive(Debug, PartialEq)]
enum Answer {
    Done {
        prompt: usize,
        cached: usize,
        text: String,
        tokens: usize,
    },
    Failed(Failure),
}

fn answer(rx: &mut UnboundedReceiver<Event>) -> Answer {
    let (mut prompt, mut cached, mut text) = (0, 0, String::new());
    loop {
        match rx.try_recv().expect("the scheduler ended the job") {
            Event::Started {
                prompt_tokens,
                cached_tokens,
            } => (prompt, cached) = (prompt_tokens, cached_tokens),
            Event::Text(t) => text.push_str(&t),
            Event::Done(done) => {
                return Answer::Done {
                    prompt,
                    cached,
                    text,
                    tokens: done.completion_tokens,
                }
            }
            Event::Failed(f) => return Answer::Failed(f),
        }
    }
}

fn run_until_idle(s: &mut Scheduler) {
    for _ in 0..10_000 {
        if s.is_idle() {
            return;
        }
        s.tick();
    }
    panic!("the scheduler did not finish its jobs");
}

/// The answer to `prompt` served alone, in a pool that holds it whole.
fn alone(prompt: Vec<u32>, max_tokens: usize) -> Answer {
    let (mut s, _, q) = scheduler(1, 1 << 30);
    let (j, mut rx) = job(&q, prompt, max_tokens);
    s.submit(j);
    run_until_idle(&mut s);
    answer(&mut rx)
}

fn text(a: &Answer) -> &str {
    match a {
        Answer::Done { text, .. } => text,
        Answer::Failed(f) => panic!("failed: {f:?}"),
    }
}

#[test]
fn a_job_alone_gets_started_then_its_text_then_done() {
    let a = alone(prompt(1, 20), 24);
    let Answer::Done { prompt, tokens, .. } = &a else {
        panic!("{a:?}")
    };
    assert_eq!((*prompt, *tokens), (20, 24));
    assert!(!text(&a).is_empty());
}

#[test]
fn a_job_that_could_need_more_than_the_whole_pool_is_refused_before_it_waits() {
    let (mut s, counts, q) = scheduler(4, 4096);
    let (j, mut rx) = job(&q, prompt(1, 20), 200);
    s.submit(j);
    assert!(s.is_idle());
    match answer(&mut rx) {
        Answer::Failed(Failure::Refused(why)) => {
            assert!(why.contains("more than the whole pool"), "{why}")
        }
        a => panic!("{a:?}"),
    }
    assert_eq!(q.waiting(), 0, "its place in the queue was given back");
    assert_eq!(counts.snapshot().requests, 0);
}

#[test]
fn jobs_past_the_batch_wait_and_are_answered_as_alone() {
    let prompts: Vec<Vec<u32>> = (1..=3).map(|i| prompt(i, 18 + i as usize)).collect();
    let (mut s, counts, q) = scheduler(2, 1 << 30);
    let mut rxs = Vec::new();
    for p in &prompts {
        let (j, rx) = job(&q, p.clone(), 20);
        s.submit(j);
        rxs.push(rx);
    }
    s.tick();
    let c = counts.snapshot();
    assert_eq!((c.running, c.waiting), (2, 1));
    assert_eq!(q.waiting(), 1, "the started jobs gave their places back");
    run_until_idle(&mut s);
    for (p, rx) in prompts.iter().zip(&mut rxs) {
        assert_eq!(text(&answer(rx)), text(&alone(p.clone(), 20)));
    }
    let c = counts.snapshot();
    assert_eq!((c.requests, c.finished, c.running, c.waiting), (3, 3, 0, 0));
    assert_eq!(q.waiting(), 0);
}

/// Prompt and answer lengths for the preemption test: admitted by what they hold
/// `ADMIT_AHEAD` positions on, they outgrow that.
const LONG: usize = 2 * ADMIT_AHEAD;

#[test]
fn a_pool_outgrown_preempts_the_newest_and_its_answer_is_unchanged() {
    let (a, b) = (prompt(4, 20), prompt(5, 20));
    let sizes = Pool::new(engine().model(), spec(), 0);
    // Room for both as admitted (their next step and ADMIT_AHEAD more), not for both whole.
    let admitted = sizes.seq_bytes(20, 0, LONG, 20 + 1 + ADMIT_AHEAD);
    let whole = sizes.seq_bytes(20, 0, LONG, 20 + LONG);
    assert!(
        whole > admitted,
        "the test needs answers that outgrow admission"
    );
    let pool = 2 * admitted + (whole - admitted) / 2;
    assert!(2 * whole > pool && whole <= pool);
    let (mut s, counts, q) = scheduler(2, pool);
    let (ja, mut ra) = job(&q, a.clone(), LONG);
    let (jb, mut rb) = job(&q, b.clone(), LONG);
    s.submit(ja);
    s.submit(jb);
    let mut most = 0;
    while !s.is_idle() {
        s.tick();
        let c = counts.snapshot();
        assert!(c.committed_bytes + c.shared_bytes <= pool, "{c:?}");
        most = most.max(c.allocated_bytes);
    }
    assert!(most <= pool);
    let c: Counters = counts.snapshot();
    assert!(c.preempted >= 1, "nothing was preempted: {c:?}");
    assert!(c.recomputed_tokens > 0);
    assert_eq!(text(&answer(&mut ra)), text(&alone(a, LONG)));
    assert_eq!(text(&answer(&mut rb)), text(&alone(b, LONG)));
}

#[test]
fn a_prompt_that_starts_like_an_answered_one_reads_its_blocks_and_answers_as_alone() {
    let shared = prompt(6, 48);
    let mut second = shared.clone();
    second.extend(prompt(7, 5));
    let (mut s, counts, q) = scheduler(2, 1 << 30);
    let (j, mut first) = job(&q, shared.clone(), 8);
    s.submit(j);
    run_until_idle(&mut s);
    answer(&mut first);
    assert_eq!(
        counts.snapshot().shared_blocks,
        3,
        "48 positions: 3 blocks of 16"
    );
    let (j, mut rx) = job(&q, second.clone(), 8);
    s.submit(j);
    run_until_idle(&mut s);
    let got = answer(&mut rx);
    let Answer::Done { cached, .. } = &got else {
        panic!("{got:?}")
    };
    assert_eq!(*cached, 48);
    assert_eq!(text(&got), text(&alone(second, 8)));
    assert_eq!(counts.snapshot().prefix_hits, 1);
}

#[test]
fn shared_blocks_nobody_reads_give_their_room_to_a_new_job_least_recently_used_first() {
    // The first job's prompt leaves 3 shared blocks; in a pool with room for the second job or
    // for the first's rows and blocks, but not for the second beside all three blocks, the
    // second joins once the blocks at the end of the run are dropped.
    let first = prompt(8, 60);
    let (mut s, counts, q) = scheduler(1, 1 << 30);
    let (j, mut rx) = job(&q, first.clone(), 4);
    s.submit(j);
    run_until_idle(&mut s);
    answer(&mut rx);
    let blocks = counts.snapshot().shared_bytes;
    assert_eq!(counts.snapshot().shared_blocks, 3);
    let sizes = Pool::new(engine().model(), spec(), 0);
    let second_needs = sizes.seq_bytes(40, 0, 80, 40 + 1 + ADMIT_AHEAD);
    let pool = second_needs + blocks / 2;
    assert!(sizes.seq_bytes(60, 0, 4, 61) + blocks <= pool);
    let (mut s, counts, q) = scheduler(1, pool);
    let (j, mut rx) = job(&q, first, 4);
    s.submit(j);
    run_until_idle(&mut s);
    answer(&mut rx);
    assert_eq!(counts.snapshot().shared_blocks, 3);
    let second = prompt(9, 40);
    let (j, mut rx) = job(&q, second.clone(), 80);
    s.submit(j);
    run_until_idle(&mut s);
    assert_eq!(text(&answer(&mut rx)), text(&alone(second, 80)));
    let c = counts.snapshot();
    assert!(c.committed_bytes + c.shared_bytes <= pool);
    assert_eq!(c.preempted, 0);
    // The first prompt again: of its run, the last two blocks went and the first stayed
    // (beside the second prompt's own two, shared once it was prefilled).
    assert_eq!(c.shared_blocks, 1 + 2);
    let (j, mut rx) = job(&q, prompt(8, 60), 4);
    s.submit(j);
    run_until_idle(&mut s);
    let Answer::Done { cached, .. } = answer(&mut rx) else {
        panic!("the first prompt again failed")
    };
    assert_eq!(cached, 16);
}

#[test]
fn a_job_whose_sender_left_is_dropped_with_its_place() {
    let (mut s, counts, q) = scheduler(1, 1 << 30);
    let (ja, mut ra) = job(&q, prompt(1, 20), 16);
    let (jb, rb) = job(&q, prompt(2, 20), 16);
    s.submit(ja);
    s.submit(jb);
    drop(rb);
    run_until_idle(&mut s);
    answer(&mut ra);
    let c = counts.snapshot();
    assert_eq!((c.finished, c.cancelled), (1, 1));
    assert_eq!(q.waiting(), 0);
}

#[test]
fn an_empty_prompt_or_one_past_the_context_is_refused_not_run() {
    let (mut s, _, q) = scheduler(2, 1 << 30);
    let (empty, mut re) = job(&q, Vec::new(), 8);
    let (long, mut rl) = job(&q, prompt(1, 20), CTX);
    s.submit(empty);
    s.submit(long);
    assert!(s.is_idle());
    for (rx, want) in [(&mut re, "empty"), (&mut rl, "pass the context")] {
        match answer(rx) {
            Answer::Failed(Failure::Refused(why)) => assert!(why.contains(want), "{why}"),
            a => panic!("{a:?}"),
        }
    }
    assert_eq!(q.waiting(), 0);
}

#[test]
fn a_grammar_that_fails_mid_answer_ends_its_own_job_as_refused_and_the_others_go_on() {
    use kvchat::grammar::{Grammar, Grammars};
    // A vocabulary one word longer than the model's logits: the grammar asks for that word
    // after one token, which no logit can give, so its job fails on its second step.
    let vocab = engine().model().cfg.vocab;
    let mut words: Vec<Vec<u8>> = (0..vocab).map(|i| format!("w{i}|").into_bytes()).collect();
    words.push(b"unreachable".to_vec());
    let grammars = Grammars::from_words(&words, 0).unwrap();
    let grammar = Grammar::Lark("start: /w[0-9]+\\|/ \"unreachable\"\n".into());
    let (mut s, _, q) = scheduler(2, 1 << 30);
    let (mut doomed, mut doomed_rx) = job(&q, prompt(1, 20), 8);
    doomed.constraint = Some(grammars.compile(&grammar).unwrap());
    let (fine, mut fine_rx) = job(&q, prompt(2, 20), 8);
    s.submit(doomed);
    s.submit(fine);
    run_until_idle(&mut s);
    match answer(&mut doomed_rx) {
        Answer::Failed(Failure::Refused(why)) => assert!(why.contains("grammar"), "{why}"),
        a => panic!("{a:?}"),
    }
    assert_eq!(answer(&mut fine_rx), alone(prompt(2, 20), 8));
}
