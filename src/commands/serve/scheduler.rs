//! The engine thread: requests wait in a queue, join the running batch when the batch and the KV
//! pool have room, decode together one token a step ([`Batch`]), and leave when they end, when a
//! stop text ends them or when their client goes.
//!
//! **The pool.** Every sequence's cache is built for exactly the positions it may reach (its
//! prompt and its `max_tokens`, within the context), so what its cache can ever allocate is known
//! when it asks to join: it joins only when that much of `--kv-pool` is free. The pool is then a
//! bound no step can cross, and no running sequence is ever preempted for memory.
//!
//! **Prefixes.** A finished sequence stays in memory, idle, while the pool has room (least
//! recently used first out). A new prompt takes the rows of the longest prefix that a running or
//! idle sequence holds of it (`Session::copy_prefix`, exact for float caches) and prefills only
//! the rest; `usage.prompt_tokens_details.cached_tokens` says how many it took.

use super::api::{ApiError, Prompt, Request};
use super::metrics::Metrics;
use crate::engine::Engine;
use crate::kv::size::KvDims;
use crate::kv::CacheSpec;
use crate::session::batch::{Batch, Finished};
use crate::session::{Sampler, Session, StopReason};
use crate::template::ChatTemplate;
use crate::tokenizer::TextStream;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// The fewest positions worth copying from another sequence.
const MIN_SHARED: usize = 16;
/// The most finished sequences kept for their prefixes.
const MAX_IDLE: usize = 16;

/// What the engine tells a request's handler, in order: `Started` (or `Failed`), then `Text`
/// pieces, then `Done`.
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Text(String),
    Done {
        reason: StopReason,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

/// A request handed to the engine thread.
pub struct Job {
    pub request: Request,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// How the engine thread runs.
pub struct Limits {
    /// Most sequences decoding at once.
    pub parallel: usize,
    /// The KV pool's bound in bytes.
    pub pool: u64,
    /// Tokens an answer gets when its request names no max_tokens.
    pub default_max_tokens: usize,
    /// Sampling settings under each request's own (the server's flags).
    pub sampling: crate::model::sampling::SamplingPrefs,
}

/// A request tokenized, waiting for room.
struct Ready {
    job: Job,
    ids: Vec<u32>,
    max_tokens: usize,
    /// Bytes its cache may allocate.
    reserve: u64,
}

/// A request in the batch.
struct Live {
    events: UnboundedSender<Event>,
    arrived: Instant,
    first_token: bool,
    stream: TextStream,
    /// Decoded text not sent yet: it may be the start of a stop text.
    held: String,
    stop: Vec<String>,
    reserve: u64,
}

/// A finished sequence kept for its prefix.
struct Idle<'e> {
    session: Session<'e>,
    bytes: u64,
}

pub struct Scheduler<'e> {
    engine: &'e Engine,
    template: Result<ChatTemplate, String>,
    spec: CacheSpec,
    limits: Limits,
    batch: Batch<'e>,
    live: HashMap<u64, Live>,
    waiting: VecDeque<Ready>,
    /// Least recently used first.
    idle: Vec<Idle<'e>>,
    next_id: u64,
    /// Requests handed over and not yet in the batch or refused (the HTTP side's 429 counts it).
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
}

impl<'e> Scheduler<'e> {
    pub fn new(
        engine: &'e Engine,
        template: Result<ChatTemplate, String>,
        spec: CacheSpec,
        limits: Limits,
        queued: Arc<AtomicUsize>,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics.update(|f| f.pool_bytes = limits.pool);
        Self {
            engine,
            template,
            spec,
            limits,
            batch: Batch::new(),
            live: HashMap::new(),
            waiting: VecDeque::new(),
            idle: Vec::new(),
            next_id: 0,
            queued,
            metrics,
        }
    }

    /// Serves jobs until every sender is gone and nothing runs.
    pub fn run(mut self, jobs: Receiver<Job>) {
        loop {
            if self.batch.is_empty() && self.waiting.is_empty() {
                match jobs.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                self.accept(job);
            }
            self.drop_departed();
            self.admit();
            if !self.batch.is_empty() {
                self.step();
            }
            self.publish();
        }
    }

    /// Tokenizes a job and queues it, or refuses it.
    fn accept(&mut self, job: Job) {
        match self.prepare(&job.request) {
            Ok((ids, max_tokens)) => {
                let reserve = self.reserve(ids.len() + max_tokens);
                if reserve > self.limits.pool {
                    self.refuse(
                        job,
                        ApiError::bad(format!(
                            "this request's KV cache may take {} ({} positions), more than the whole pool of {}; lower max_tokens or shorten the prompt",
                            crate::source::human_bytes(reserve),
                            ids.len() + max_tokens,
                            crate::source::human_bytes(self.limits.pool)
                        )),
                    );
                    return;
                }
                self.metrics.update(|f| f.requests += 1);
                self.waiting.push_back(Ready {
                    job,
                    ids,
                    max_tokens,
                    reserve,
                });
            }
            Err(e) => self.refuse(job, e),
        }
    }

    fn refuse(&mut self, job: Job, e: ApiError) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
        self.metrics.update(|f| f.rejected_bad += 1);
        let _ = job.events.send(Event::Failed(e));
    }

    /// The prompt's token ids and how many tokens the answer may take.
    fn prepare(&self, r: &Request) -> Result<(Vec<u32>, usize), ApiError> {
        let ctx = self.engine.ctx();
        let text_len = match &r.prompt {
            Prompt::Text(t) => t.len(),
            Prompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
        };
        let too_long = |n: &str| {
            ApiError::bad(format!(
                "the prompt is {n}, which does not fit the context of {ctx} tokens"
            ))
            .with_code("context_length_exceeded")
        };
        // Refused by its bytes before it is tokenized.
        if self.engine.tokenizer().min_tokens(text_len) >= ctx {
            return Err(too_long(&format!("{text_len} bytes")));
        }
        let ids = match &r.prompt {
            Prompt::Text(t) => self
                .engine
                .raw_prompt(t)
                .map_err(|e| ApiError::bad(crate::first_line(e)))?,
            Prompt::Chat(messages) => {
                let template = self
                    .template
                    .as_ref()
                    .map_err(|why| ApiError::bad(why.clone()))?;
                template
                    .render(messages, true)
                    .and_then(|text| self.engine.encode_rendered(&text, messages))
                    .map_err(|e| {
                        ApiError::bad(format!(
                            "the chat template cannot render these messages: {}",
                            crate::first_line(e)
                        ))
                    })?
            }
        };
        if ids.len() >= ctx {
            return Err(too_long(&format!("{} tokens", ids.len())));
        }
        let room = ctx - ids.len();
        let max_tokens = r
            .max_tokens
            .unwrap_or(self.limits.default_max_tokens)
            .min(room);
        Ok((ids, max_tokens))
    }

    /// Bytes a cache for `positions` positions may allocate.
    fn reserve(&self, positions: usize) -> u64 {
        let spec = CacheSpec {
            max_positions: positions,
            ..self.spec.clone()
        };
        KvDims::bytes_for_spec(&spec, &self.engine.model().cfg, positions).ceil() as u64
    }

    fn reserved(&self) -> u64 {
        self.live.values().map(|l| l.reserve).sum()
    }

    fn idle_bytes(&self) -> u64 {
        self.idle.iter().map(|i| i.bytes).sum()
    }

    /// Requests whose client left: waiting ones are dropped, running ones leave the batch.
    fn drop_departed(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|r| !r.job.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.queued.fetch_sub(gone, Ordering::SeqCst);
            self.metrics.update(|f| f.cancelled += gone as u64);
        }
        let departed: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in departed {
            if let Some(f) = self.batch.leave(id, StopReason::Interrupted) {
                self.live.remove(&id);
                self.metrics.update(|m| m.cancelled += 1);
                self.keep_idle(f.session);
            }
        }
    }

    /// Moves waiting requests into the batch, oldest first, while the batch and the pool have
    /// room (idle sequences give theirs back, least recently used first).
    fn admit(&mut self) {
        while self.batch.len() < self.limits.parallel {
            let Some(next) = self.waiting.front() else {
                return;
            };
            let need = next.reserve;
            while self.reserved() + self.idle_bytes() + need > self.limits.pool
                && !self.idle.is_empty()
            {
                // The least recently used goes, unless it holds the longest prefix of this prompt
                // and another can go instead.
                let best = self.best_idle(&next.ids);
                let victim = if best == Some(0) && self.idle.len() > 1 {
                    1
                } else {
                    0
                };
                self.idle.remove(victim);
            }
            if self.reserved() + self.idle_bytes() + need > self.limits.pool {
                return;
            }
            let Some(ready) = self.waiting.pop_front() else {
                return;
            };
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.join(ready);
        }
    }

    /// The idle sequence holding the longest prefix of `ids`, if any holds one.
    fn best_idle(&self, ids: &[u32]) -> Option<usize> {
        self.idle
            .iter()
            .enumerate()
            .map(|(i, s)| (i, common(s.session.tokens(), ids)))
            .filter(|(_, n)| *n >= MIN_SHARED)
            .max_by_key(|(_, n)| *n)
            .map(|(i, _)| i)
    }

    /// A request joins: its cache is built for its positions, takes the longest prefix held in
    /// memory, and prefills the rest.
    fn join(&mut self, r: Ready) {
        let positions = r.ids.len() + r.max_tokens;
        let spec = CacheSpec {
            max_positions: positions,
            ..self.spec.clone()
        };
        let mut session = Session::new(
            self.engine.model(),
            spec.build(&self.engine.model().cfg, self.engine.kv_device()),
            positions,
        );
        let t0 = Instant::now();
        let cached = self.copy_longest_prefix(&mut session, &r.ids);
        let sampling = self
            .engine
            .sampling_for(&over(&r.job.request.sampling, &self.limits.sampling));
        let id = self.next_id;
        self.next_id += 1;
        let _ = r.job.events.send(Event::Started {
            prompt_tokens: r.ids.len(),
            cached_tokens: cached,
        });
        let joined = self.batch.join(
            id,
            session,
            &r.ids[cached..],
            Sampler::new(sampling.params),
            r.max_tokens,
            self.engine.stop_ids(),
        );
        let prefill = t0.elapsed().as_secs_f64();
        self.metrics.update(|f| {
            f.prompt_tokens += r.ids.len() as u64;
            f.cached_tokens += cached as u64;
            f.prefix_hits += u64::from(cached > 0);
            f.prefill_seconds += prefill;
        });
        if let Err(e) = joined {
            self.metrics.update(|f| f.failed += 1);
            let _ = r.job.events.send(Event::Failed(ApiError::new(
                500,
                "server_error",
                format!("the prompt's prefill failed: {}", crate::first_line(e)),
            )));
            return;
        }
        self.live.insert(
            id,
            Live {
                events: r.job.events,
                arrived: r.job.arrived,
                first_token: false,
                stream: TextStream::new(),
                held: String::new(),
                stop: r.job.request.stop,
                reserve: r.reserve,
            },
        );
    }

    /// Copies into `session` the longest prefix of `ids` a running or idle sequence holds;
    /// returns its length (0: none worth copying, or the cache cannot share rows exactly).
    fn copy_longest_prefix(&mut self, session: &mut Session<'e>, ids: &[u32]) -> usize {
        if session.copy_refusal().is_some() {
            return 0;
        }
        let running = self
            .batch
            .sessions()
            .map(|(_, s)| (common(s.tokens(), ids), s))
            .max_by_key(|(n, _)| *n);
        let idle = self.best_idle(ids);
        let idle_len = idle.map_or(0, |i| common(self.idle[i].session.tokens(), ids));
        let donor = match running {
            Some((n, s)) if n >= idle_len => Some((n, s)),
            _ => idle.map(|i| (idle_len, &self.idle[i].session)),
        };
        let got = match donor {
            Some((n, from)) if n >= MIN_SHARED => session.copy_prefix(from, ids).unwrap_or(0),
            _ => 0,
        };
        // The idle sequence used is now the most recently used.
        if let Some(i) = idle.filter(|_| got > 0 && idle_len >= got) {
            let s = self.idle.remove(i);
            self.idle.push(s);
        }
        got
    }

    /// One batched step: every running sequence's next token, its text sent, stop texts watched.
    fn step(&mut self) {
        let t0 = Instant::now();
        let tokenizer = self.engine.tokenizer();
        let live = &mut self.live;
        let metrics = &self.metrics;
        let mut stopped = Vec::new();
        let result = self.batch.step(|id, token| {
            let Some(l) = live.get_mut(&id) else { return };
            if !l.first_token {
                l.first_token = true;
                let ttft = l.arrived.elapsed().as_secs_f64();
                metrics.update(|f| f.observe_ttft(ttft));
            }
            if let Ok(Some(text)) = l.stream.push(tokenizer, token) {
                if l.push_text(&text) {
                    stopped.push(id);
                }
            }
        });
        let elapsed = t0.elapsed().as_secs_f64();
        match result {
            Ok(done) => {
                let n = (done.len() + self.batch.len()) as u64;
                self.metrics.update(|f| {
                    f.decode_steps += 1;
                    f.generated_tokens += n;
                    f.decode_seconds += elapsed;
                });
                for f in done {
                    self.finish(f, false);
                }
                for id in stopped {
                    if let Some(f) = self.batch.leave(id, StopReason::EndOfText) {
                        self.finish(f, true);
                    }
                }
            }
            Err(e) => {
                // The sequences' answers hold a token their sessions were not fed: end them all.
                let line = crate::first_line(e);
                let ids: Vec<u64> = self.live.keys().copied().collect();
                for id in ids {
                    self.batch.leave(id, StopReason::Interrupted);
                    if let Some(l) = self.live.remove(&id) {
                        let _ = l.events.send(Event::Failed(ApiError::new(
                            500,
                            "server_error",
                            format!("a decode step failed: {line}"),
                        )));
                    }
                }
                self.metrics.update(|f| f.failed += 1);
            }
        }
    }

    /// A sequence ended: the rest of its text and why it ended go to its client; its session is
    /// kept for its prefix.
    fn finish(&mut self, f: Finished<'e>, by_stop_text: bool) {
        if let Some(mut l) = self.live.remove(&f.id) {
            if !by_stop_text {
                if let Ok(Some(rest)) = l.stream.finish(self.engine.tokenizer()) {
                    l.held.push_str(&rest);
                }
                if !l.held.is_empty() {
                    let _ = l.events.send(Event::Text(std::mem::take(&mut l.held)));
                }
            }
            let _ = l.events.send(Event::Done {
                reason: f.reason,
                completion_tokens: f.tokens.len(),
            });
            self.metrics.update(|m| m.finished += 1);
        }
        self.keep_idle(f.session);
    }

    /// Keeps a finished session for its prefix, while there is room.
    fn keep_idle(&mut self, session: Session<'e>) {
        if session.copy_refusal().is_some() || session.tokens().len() < MIN_SHARED {
            return;
        }
        let bytes = session.cache().bytes() as u64;
        if self.reserved() + self.idle_bytes() + bytes > self.limits.pool {
            return;
        }
        if self.idle.len() >= MAX_IDLE {
            self.idle.remove(0);
        }
        self.idle.push(Idle { session, bytes });
    }

    fn publish(&self) {
        let allocated: u64 = self
            .batch
            .sessions()
            .map(|(_, s)| s.cache().bytes() as u64)
            .sum::<u64>()
            + self.idle_bytes();
        let (reserved, idle_bytes) = (self.reserved(), self.idle_bytes());
        self.metrics.update(|f| {
            f.reserved_bytes = reserved;
            f.idle_bytes = idle_bytes;
            f.allocated_bytes = allocated;
            f.running = self.batch.len();
            f.waiting = self.waiting.len();
            f.idle_sequences = self.idle.len();
        });
    }
}

impl Live {
    /// Adds decoded text; sends what cannot be part of a stop text. True when a stop text
    /// appeared: what precedes it is sent and the answer ends there.
    fn push_text(&mut self, text: &str) -> bool {
        self.held.push_str(text);
        if let Some(at) = self
            .stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.held.truncate(at);
            if !self.held.is_empty() {
                let _ = self
                    .events
                    .send(Event::Text(std::mem::take(&mut self.held)));
            }
            return true;
        }
        let keep = self
            .stop
            .iter()
            .map(|s| partial_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let send = self.held.len() - keep;
        if send > 0 {
            let rest = self.held.split_off(send);
            let _ = self
                .events
                .send(Event::Text(std::mem::replace(&mut self.held, rest)));
        }
        false
    }
}

/// The longest suffix of `text` that `stop` starts with (a stop text that may be completing).
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

/// `top`'s settings, and `under`'s where `top` has none.
fn over(
    top: &crate::model::sampling::SamplingPrefs,
    under: &crate::model::sampling::SamplingPrefs,
) -> crate::model::sampling::SamplingPrefs {
    crate::model::sampling::SamplingPrefs {
        temperature: top.temperature.or(under.temperature),
        top_k: top.top_k.or(under.top_k),
        top_p: top.top_p.or(under.top_p),
        min_p: top.min_p.or(under.min_p),
        repeat_penalty: top.repeat_penalty.or(under.repeat_penalty),
        repeat_last_n: top.repeat_last_n.or(under.repeat_last_n),
        seed: top.seed.or(under.seed),
    }
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(stop: &[&str]) -> (Live, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (
            Live {
                events: tx,
                arrived: Instant::now(),
                first_token: false,
                stream: TextStream::new(),
                held: String::new(),
                stop: stop.iter().map(|s| s.to_string()).collect(),
                reserve: 0,
            },
            rx,
        )
    }

    fn sent(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> String {
        let mut s = String::new();
        while let Ok(Event::Text(t)) = rx.try_recv() {
            s.push_str(&t);
        }
        s
    }

    #[test]
    fn text_that_may_start_a_stop_text_is_held_until_it_cannot() {
        let (mut l, mut rx) = live(&["END"]);
        assert!(!l.push_text("one E"));
        assert_eq!(sent(&mut rx), "one ");
        assert!(!l.push_text("Nx"));
        assert_eq!(sent(&mut rx), "ENx");
    }

    #[test]
    fn a_stop_text_split_across_tokens_ends_the_answer_before_it() {
        let (mut l, mut rx) = live(&["\n\n", "END"]);
        assert!(!l.push_text("two E"));
        assert!(l.push_text("ND three"));
        assert_eq!(sent(&mut rx), "two ");
    }

    #[test]
    fn the_partial_suffix_never_splits_a_character() {
        assert_eq!(partial_suffix("caf\u{e9}", "\u{e9}t\u{e9}"), 2);
        assert_eq!(partial_suffix("abc", "xyz"), 0);
    }
}
