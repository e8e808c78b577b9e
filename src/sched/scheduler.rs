//! The engine thread: requests wait in a queue, join the running batch when the batch and the KV
//! pool have room, decode together one token a step ([`Batch`]), and leave when they end, when a
//! stop text ends them or when their client goes.
//!
//! **The pool** holds two kinds of KV rows: each sequence's own, and blocks of
//! [`SHARED_BLOCK`] positions that sequences share. A sequence counts in it for what its own
//! stores hold once its next step is fed (`KvDims::bytes_up_to`: the stores grow a page of
//! [`GROW_BY`] positions at a time, up to its prompt and `max_tokens` within the context), not for all it may ever hold: a long
//! `max_tokens` takes no memory it does not use. A request joins when its prompt (and first
//! step) fits beside the others' next steps and the shared blocks. Before each step, when the
//! running sequences' next rows would pass `--kv-pool`, shared blocks nobody attends to go first,
//! then the newest sequence is **preempted**: its rows are freed and it waits at the head of the
//! queue; when it resumes, its prompt is prefilled again and the tokens it had generated are fed
//! again one a step, as they were the first time ([`Batch::resume`]), so it finishes with the
//! answer it would have given had it never left. The pool is a bound no step crosses.
//!
//! **Shared prefixes.** Once a sequence has prefilled its prompt, every full block of the prompt
//! becomes a shared block (copied once from its rows), indexed by the tokens from position 0 to
//! the block's end, and the sequence attends to the shared copy from then on, giving its own up
//! (`Session::adopt_blocks`). A new prompt starts from the longest run of indexed blocks its
//! tokens begin with — counted references, never copied — and prefills only the rest, into its
//! own store: a prompt that parts from another inside a block has that block's positions of its
//! own (copy on write at the first block that differs). Blocks no sequence attends to stay as an
//! in-memory prefix cache, least recently used out first when a request needs the room;
//! `usage.prompt_tokens_details.cached_tokens` says how many positions a request took from it.
//! Sharing is exact (`kv/layer/shared.rs`) and applies to float caches that keep every position;
//! the start line says when the cache flags turn it off.

use super::api::{ApiError, Prompt, Request};
use super::metrics::Metrics;
use crate::engine::Engine;
use crate::kv::size::KvDims;
use crate::kv::{CacheSpec, SharedBlock, SHARED_BLOCK};
use crate::session::batch::{Batch, Finished, Paused};
use crate::session::prefix::PrefixReuse;
use crate::session::{Sampler, Session, StopReason};
use crate::template::ChatTemplate;
use crate::tokenizer::TextStream;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Positions a sequence's own stores grow by (`CacheSpec::grow_by`), the size of a page of its
/// block table (`kv/paged.rs`: growing appends a page and copies no row): a sequence holds at
/// most 63 positions it has not used, where doubling from 256 held up to half its store unused.
const GROW_BY: usize = 64;

/// Positions past its next step that each sequence is counted for when a request asks to join:
/// it joins only when every running sequence (and itself) could go on that far beside it. An
/// answer shorter than this is never preempted by the ones that joined after it; a longer one
/// may be, when the pool is tight.
const ADMIT_AHEAD: usize = 2 * GROW_BY;

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
    /// Whether its client was told it started (it was preempted since, or while prefilling).
    started: bool,
    /// Set when it was preempted after it joined the batch: it goes on where it was.
    resumed: Option<Resumed>,
}

/// What a sequence preempted in the batch keeps for its resumption.
struct Resumed {
    id: u64,
    paused: Paused,
    text: Text,
    /// How many sequences had left the batch when it was preempted ([`Scheduler::left`]).
    after: u64,
}

/// A request in the batch.
struct Live {
    job: Job,
    text: Text,
    /// Its prompt, and the positions of it read from shared blocks.
    prompt: Vec<u32>,
    shared: usize,
    max_tokens: usize,
}

/// An answer's text on its way to the client.
struct Text {
    first_token: bool,
    stream: TextStream,
    /// Decoded text not sent yet: it may be the start of a stop text.
    held: String,
}

/// A request whose prompt is being prefilled, a chunk between two decode steps of the others.
struct Prefilling<'e> {
    ready: Ready,
    id: u64,
    session: Session<'e>,
    /// How it samples and what it generated before (resumed), and, resumed, its text's state.
    paused: Paused,
    text: Option<Text>,
    /// Prompt positions taken from shared blocks.
    cached: usize,
    /// Prompt positions restored from the on-disk prefix store (into its own store).
    restored: usize,
    /// Seconds spent prefilling it so far.
    seconds: f64,
}

/// A shared block in the index, and when it was last used (a tick: larger is later).
struct Indexed {
    block: Arc<SharedBlock>,
    bytes: u64,
    last_use: u64,
}

/// Where prompts' prefixes come from besides a prefill.
pub struct Prefixes {
    /// Why this cache cannot share rows between sequences, if it cannot
    /// (`Session::share_refusal`).
    pub share_refusal: Option<&'static str>,
    /// The on-disk prefix store (or why it is off).
    pub store: PrefixReuse,
}

pub struct Scheduler<'e> {
    engine: &'e Engine,
    template: Result<ChatTemplate, String>,
    spec: CacheSpec,
    limits: Limits,
    batch: Batch<'e>,
    live: HashMap<u64, Live>,
    waiting: VecDeque<Ready>,
    /// The request being prefilled, if one is.
    prefilling: Option<Prefilling<'e>>,
    /// The shared blocks, by the chained hash of their tokens ([`block_keys`]).
    blocks: HashMap<u64, Indexed>,
    tick: u64,
    /// Whether this cache shares rows (None), or why not.
    share_refusal: Option<&'static str>,
    /// The on-disk prefix store behind the shared blocks: a prompt no shared block starts is
    /// looked up in it, and one prefilled whole is written to it.
    store: PrefixReuse,
    next_id: u64,
    /// Sequences that have left the batch (answered, failed or cancelled).
    left: u64,
    /// Requests handed over and not yet in the batch or refused (the HTTP side's 429 counts it).
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
}

impl<'e> Scheduler<'e> {
    pub fn new(
        engine: &'e Engine,
        template: Result<ChatTemplate, String>,
        spec: CacheSpec,
        Prefixes {
            share_refusal,
            store,
        }: Prefixes,
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
            prefilling: None,
            blocks: HashMap::new(),
            tick: 0,
            share_refusal,
            store,
            next_id: 0,
            left: 0,
            queued,
            metrics,
        }
    }

    /// Serves jobs until every sender is gone and nothing runs.
    pub fn run(mut self, jobs: Receiver<Job>) {
        loop {
            if self.batch.is_empty() && self.waiting.is_empty() && self.prefilling.is_none() {
                match jobs.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => {
                        self.store.finish();
                        self.report_store_problems();
                        return;
                    }
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
            // (A request joins only when its next step fits: the steps after it may not.)
            self.fit_step();
            self.publish();
        }
    }

    /// Tokenizes a job and queues it, or refuses it.
    fn accept(&mut self, job: Job) {
        match self.prepare(&job.request) {
            Ok((ids, max_tokens)) => {
                let reserve = self.most_bytes(ids.len(), ids.len() + max_tokens);
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
                    started: false,
                    resumed: None,
                });
            }
            Err(e) => self.refuse(job, e),
        }
    }

    /// Refuses a job (the HTTP side counts it among the invalid requests when it answers).
    fn refuse(&mut self, job: Job, e: ApiError) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
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
        // Refused by its bytes before it is tokenized (all messages together).
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
                self.engine.chat_prompt(template, messages).map_err(|e| {
                    ApiError::bad(format!(
                        "the chat template cannot render these messages: {}",
                        crate::first_line(e)
                    ))
                })?
            }
        };
        if ids.is_empty() {
            return Err(ApiError::bad(
                "the prompt is empty once rendered and tokenized: there is nothing to continue",
            ));
        }
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

    /// The cache a sequence's own stores make: built for `positions` positions, of which the
    /// first `prompt` are its first forward.
    fn own_spec(&self, positions: usize) -> CacheSpec {
        CacheSpec {
            max_positions: positions,
            grow_by: Some(GROW_BY),
            ..self.spec.clone()
        }
    }

    /// Bytes a sequence's own stores may ever allocate (`KvDims::bytes_at_most`): a request
    /// needing more than the pool is refused.
    fn most_bytes(&self, prompt: usize, positions: usize) -> u64 {
        let m = self.engine.model();
        KvDims::bytes_at_most(&self.own_spec(positions), &m.cfg, prompt, m.prefill_chunk).ceil()
            as u64
    }

    /// Bytes a sequence's own stores hold once it is `upto` positions long
    /// (`KvDims::bytes_up_to`): its prompt `prompt` positions, the first `off` of them read from
    /// shared blocks (its own stores start after them), and `max_tokens` to generate.
    fn seq_bytes(&self, prompt: usize, off: usize, max_tokens: usize, upto: usize) -> u64 {
        let m = self.engine.model();
        let spec = self.own_spec(prompt + max_tokens - off);
        KvDims::bytes_up_to(&spec, &m.cfg, prompt - off, m.prefill_chunk, upto - off).ceil() as u64
    }

    /// Bytes of the pool the sequences' own rows take by their next step and `ahead` positions
    /// more (what they hold now, if more): the running ones', and the one being prefilled's
    /// from where it will sample.
    fn committed(&self, ahead: usize) -> u64 {
        let running = self.batch.sessions().filter_map(|(id, s)| {
            let l = self.live.get(&id)?;
            let upto = s.tokens().len() + 1 + ahead;
            let counted = self.seq_bytes(l.prompt.len(), l.shared, l.max_tokens, upto);
            Some(counted.max(s.cache().bytes() as u64))
        });
        let prefilling = self.prefilling.as_ref().map(|p| {
            let n = p.ready.ids.len();
            let at = n + p.paused.tokens().len();
            let counted = self.seq_bytes(n, p.cached, p.ready.max_tokens, at + 1 + ahead);
            counted.max(p.session.cache().bytes() as u64)
        });
        running.chain(prefilling).sum()
    }

    fn shared_bytes(&self) -> u64 {
        self.blocks.values().map(|b| b.bytes).sum()
    }

    /// The longest run of indexed blocks that `ids` starts with, at most `limit` blocks; marked
    /// used now.
    fn lookup(&mut self, ids: &[u32], limit: usize) -> Vec<Arc<SharedBlock>> {
        let mut found = Vec::new();
        if self.share_refusal.is_some() {
            return found;
        }
        let keys = block_keys(ids);
        for (i, key) in keys.iter().take(limit).enumerate() {
            let span = i * SHARED_BLOCK..(i + 1) * SHARED_BLOCK;
            match self.blocks.get(key) {
                Some(b) if b.block.tokens[span.clone()] == ids[span] => found.push(b.block.clone()),
                _ => break,
            }
        }
        // A run's first blocks are the most recently used: the least recently used one is then
        // always the end of a run, and a run is never left with a missing block inside it.
        let m = found.len() as u64;
        for (j, key) in keys.iter().take(found.len()).enumerate() {
            if let Some(b) = self.blocks.get_mut(key) {
                b.last_use = self.tick + m - j as u64;
            }
        }
        self.tick += m + 1;
        found
    }

    /// Makes room for `need` more bytes beside the sequences' rows `ahead` positions past their
    /// next step (`committed`), by dropping shared blocks no sequence attends to, least recently
    /// used first; whether the room is there.
    fn make_room(&mut self, need: u64, ahead: usize) -> bool {
        let used = self.committed(ahead) + self.shared_bytes();
        if used + need <= self.limits.pool {
            return true;
        }
        let mut free: Vec<(u64, u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| Arc::strong_count(&b.block) == 1 && !b.block.in_use())
            .map(|(k, b)| (b.last_use, *k, b.bytes))
            .collect();
        // Nothing is dropped unless dropping is enough.
        if used + need > self.limits.pool + free.iter().map(|f| f.2).sum::<u64>() {
            return false;
        }
        free.sort_unstable();
        let mut over = used + need - self.limits.pool;
        for (_, key, bytes) in free {
            if over == 0 {
                break;
            }
            self.blocks.remove(&key);
            over = over.saturating_sub(bytes);
        }
        true
    }

    /// Before a step: while the running sequences' next rows and the shared blocks would pass
    /// the pool, shared blocks nobody attends to go first (`make_room`), then the newest sequence
    /// (the one prefilling, or the last to have started) is preempted. A sequence alone that
    /// could not take its next step in the whole pool would end with an error (the pool refuses
    /// any request that could need more than all of it, so it does not happen).
    fn fit_step(&mut self) {
        while !self.make_room(0, 0) {
            let newest = self.live.keys().copied().max();
            let prefilling = self.prefilling.as_ref().map(|p| p.id);
            let others = self.live.len() + usize::from(prefilling.is_some()) > 1;
            match (prefilling, newest) {
                (Some(p), l) if others && l.is_none_or(|l| p > l) => {
                    let p = self.prefilling.take().expect("checked");
                    self.requeue(p);
                }
                (_, Some(id)) if others => self.preempt(id),
                (Some(_), _) => {
                    let p = self.prefilling.take().expect("checked");
                    self.prefill_failed(&p.ready.job.events, self.too_big());
                }
                (None, Some(id)) => {
                    let why = self.too_big().to_string();
                    self.fail(id, &why);
                }
                (None, None) => return,
            }
        }
    }

    fn too_big(&self) -> anyhow::Error {
        anyhow::anyhow!(
            "the KV pool of {} cannot hold this answer's next position beside the shared prefix blocks; start the server with a larger --kv-pool",
            crate::source::human_bytes(self.limits.pool)
        )
    }

    /// Running sequence `id` is preempted: its rows are freed and it waits at the head of the
    /// queue, keeping how it samples, what it generated and its text's state.
    fn preempt(&mut self, id: u64) {
        let Some(paused) = self.batch.preempt(id) else {
            return;
        };
        let Some(l) = self.live.remove(&id) else {
            return;
        };
        self.metrics.update(|f| f.preempted += 1);
        self.waiting.push_front(Ready {
            job: l.job,
            ids: l.prompt,
            max_tokens: l.max_tokens,
            started: true,
            resumed: Some(Resumed {
                id,
                paused,
                text: l.text,
                after: self.left,
            }),
        });
    }

    /// The sequence being prefilled is preempted: its rows are freed and it waits at the head of
    /// the queue (a new one starts again as new: it has sampled nothing yet).
    fn requeue(&mut self, p: Prefilling<'e>) {
        let Prefilling {
            mut ready,
            id,
            paused,
            text,
            ..
        } = p;
        let after = self.left;
        ready.resumed = text.map(|text| Resumed {
            id,
            paused,
            text,
            after,
        });
        self.metrics.update(|f| f.preempted += 1);
        self.waiting.push_front(ready);
    }

    /// Requests whose client left: waiting ones are dropped, running ones leave the batch.
    fn drop_departed(&mut self) {
        let (mut gone, mut new) = (0, 0);
        self.waiting.retain(|r| {
            let closed = r.job.events.is_closed();
            gone += usize::from(closed);
            new += usize::from(closed && !r.started);
            !closed
        });
        // (The queue's count is of requests never started: a preempted one is not in it.)
        self.queued.fetch_sub(new, Ordering::SeqCst);
        if gone > 0 {
            self.metrics.update(|f| f.cancelled += gone as u64);
        }
        if self
            .prefilling
            .as_ref()
            .is_some_and(|p| p.ready.job.events.is_closed())
        {
            self.prefilling = None;
            self.metrics.update(|m| m.cancelled += 1);
        }
        let departed: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.job.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in departed {
            if self.batch.leave(id, StopReason::Interrupted).is_some() {
                self.live.remove(&id);
                self.left += 1;
                self.metrics.update(|m| m.cancelled += 1);
            }
        }
    }

    /// Moves waiting requests into the batch, oldest first, while the batch and the pool have
    /// room (shared blocks no sequence attends to give theirs back, least recently used first).
    /// One prompt is prefilled at a time, a chunk between two decode steps while others decode.
    fn admit(&mut self) {
        loop {
            if self.prefilling.is_some() {
                if !self.advance() {
                    return;
                }
                continue;
            }
            if self.batch.len() >= self.limits.parallel {
                return;
            }
            let Some(next) = self.waiting.front() else {
                return;
            };
            // A preempted sequence resumes once another has left the batch since (or nothing
            // runs): resumed into the room its own preemption made, the growth that preempted it
            // would soon preempt it again, its work refed for nothing.
            if next.resumed.as_ref().is_some_and(|r| r.after == self.left) && !self.batch.is_empty()
            {
                return;
            }
            let ids = next.ids.clone();
            let max_tokens = next.max_tokens;
            // Where it samples next: after its prompt, or (resumed) after what it generated.
            let at = ids.len() + next.resumed.as_ref().map_or(0, |r| r.paused.tokens().len());
            // The blocks it starts from are held (so not dropped for room) while it asks; at
            // least one position of the prompt is left to prefill.
            let blocks = self.lookup(&ids, (ids.len() - 1) / SHARED_BLOCK);
            let cached = blocks.len() * SHARED_BLOCK;
            let need = self.seq_bytes(ids.len(), cached, max_tokens, at + 1 + ADMIT_AHEAD);
            if !self.make_room(need, ADMIT_AHEAD) {
                return;
            }
            let Some(ready) = self.waiting.pop_front() else {
                return;
            };
            if !ready.started {
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
            self.start(ready, blocks);
        }
    }

    /// A request starts, or a preempted one resumes: its cache starts from the shared blocks its
    /// prompt begins with, and the rest of its prompt is to be prefilled into its own store.
    fn start(&mut self, mut r: Ready, blocks: Vec<Arc<SharedBlock>>) {
        let positions = r.ids.len() + r.max_tokens;
        let mut session = Session::new(
            self.engine.model(),
            self.own_spec(positions)
                .build(&self.engine.model().cfg, self.engine.kv_device()),
            positions,
        );
        // (Refused only for blocks this index never holds: then the prompt is prefilled whole.)
        let cached = session.adopt_blocks(&r.ids, &blocks).unwrap_or(0);
        // No shared block starts it: the longest prefix the disk holds, into its own store (a
        // resumed sequence's rows were stored when it was prefilled the first time).
        let restored = if cached == 0 && r.resumed.is_none() {
            let found = self.store.restore(&mut session, &r.ids, &[]);
            self.report_store_problems();
            found.unwrap_or_else(|e| {
                say_store_problem(&crate::first_line(e));
                0
            })
        } else {
            0
        };
        let (id, paused, text) = match r.resumed.take() {
            Some(resumed) => (resumed.id, resumed.paused, Some(resumed.text)),
            None => {
                let sampling = self.engine.sampling_over(&[
                    ("request", &r.job.request.sampling),
                    ("flag", &self.limits.sampling),
                ]);
                let sampler = Sampler::new(sampling.params);
                self.next_id += 1;
                let paused = Paused::new(sampler, r.max_tokens, self.engine.stop_ids());
                (self.next_id - 1, paused, None)
            }
        };
        if !r.started {
            r.started = true;
            let _ = r.job.events.send(Event::Started {
                prompt_tokens: r.ids.len(),
                cached_tokens: cached + restored,
            });
        }
        self.prefilling = Some(Prefilling {
            ready: r,
            id,
            session,
            paused,
            text,
            cached,
            restored,
            seconds: 0.0,
        });
    }

    /// Prefills the next chunk of the prompt being prefilled — all of it when nothing else
    /// decodes — and joins it to the batch once only its last chunk is left (that one is fed as
    /// it joins). Chunks end at multiples of the model's prefill step counted from position 0, as
    /// one prefill's steps do, so the state is the one a whole prefill gives, bit for bit.
    /// (A KV budget evicts when a forward ends: its prompt is prefilled in one forward.)
    /// Whether it joined (or failed), so that another may start.
    fn advance(&mut self) -> bool {
        use crate::model::cache::DecoderCache;
        loop {
            let Some(p) = self.prefilling.as_mut() else {
                return true;
            };
            let step = self.engine.model().prefill_chunk;
            let chunk = p
                .session
                .cache()
                .max_step()
                .map_or(step, |m| m.min(step))
                .max(1);
            let at = p.session.tokens().len();
            let end = (at / chunk + 1) * chunk;
            if end >= p.ready.ids.len() || p.session.evicts_by_score() {
                let p = self.prefilling.take().expect("checked");
                self.join(p);
                return true;
            }
            let t0 = Instant::now();
            let fed = p.session.feed(&p.ready.ids[at..end]);
            p.seconds += t0.elapsed().as_secs_f64();
            if let Err(e) = fed {
                let p = self.prefilling.take().expect("checked");
                self.prefill_failed(&p.ready.job.events, e);
                return true;
            }
            if !self.batch.is_empty() {
                return false;
            }
        }
    }

    /// The request being prefilled joins the batch with its prompt's last chunk (resumed, to
    /// feed again what it generated before), and its prompt's full blocks are shared.
    fn join(&mut self, p: Prefilling<'e>) {
        let Prefilling {
            ready: r,
            id,
            session,
            paused,
            text,
            cached,
            restored,
            seconds,
        } = p;
        let t0 = Instant::now();
        let at = session.tokens().len();
        let refed = paused.tokens().len();
        let joined = self.batch.resume(id, session, &r.ids[at..], paused);
        let prefill = seconds + t0.elapsed().as_secs_f64();
        let resumed = text.is_some();
        self.metrics.update(|f| {
            if resumed {
                f.recomputed_tokens += (r.ids.len() - cached + refed) as u64;
            } else {
                f.prompt_tokens += r.ids.len() as u64;
                f.cached_tokens += (cached + restored) as u64;
                f.prefix_hits += u64::from(cached + restored > 0);
            }
            f.prefill_seconds += prefill;
        });
        if let Err(e) = joined {
            self.prefill_failed(&r.job.events, e);
            return;
        }
        let ids = r.ids.clone();
        // A prompt prefilled in its own store (no shared block under it) goes to the disk, its
        // blocks copied now and written on the store's thread.
        if cached == 0 && !resumed && self.store.is_on() {
            if let Some((_, session)) = self.batch.sessions().find(|(i, _)| *i == id) {
                self.store.store(session, true, &[], ids.len());
            }
            self.report_store_problems();
        }
        self.live.insert(
            id,
            Live {
                job: r.job,
                text: text.unwrap_or_else(Text::new),
                prompt: r.ids,
                shared: cached,
                max_tokens: r.max_tokens,
            },
        );
        let shared = self.share_prompt(id, &ids, cached / SHARED_BLOCK);
        // Its own store gave up the positions now shared.
        if let Some(l) = self.live.get_mut(&id) {
            l.shared = shared * SHARED_BLOCK;
        }
    }

    /// Shares the full blocks of sequence `id`'s prompt `ids` (it attends to the first `from`
    /// already) and has the sequence attend to them; returns how many blocks it attends to.
    fn share_prompt(&mut self, id: u64, ids: &[u32], from: usize) -> usize {
        let to = ids.len() / SHARED_BLOCK;
        if self.share_refusal.is_some() || to <= from {
            return from;
        }
        // Blocks another sequence shared meanwhile are taken as they are; the others are made.
        let mut run = self.lookup(ids, to);
        if run.len() < from {
            return from;
        }
        let have = run.len();
        if have < to {
            let one = self.most_bytes(SHARED_BLOCK, SHARED_BLOCK);
            if !self.make_room(one * (to - have) as u64, 0) {
                return from;
            }
            let made = match self.batch.session_mut(id) {
                Some(session) => session.share_blocks(have, to),
                None => return from,
            };
            let Ok(made) = made else {
                return from;
            };
            let keys = block_keys(ids);
            for (i, block) in (have..to).zip(made) {
                let block = Arc::new(block);
                let bytes = block.bytes() as u64;
                self.blocks.insert(
                    keys[i],
                    Indexed {
                        block: block.clone(),
                        bytes,
                        last_use: 0,
                    },
                );
                run.push(block);
            }
            self.lookup(ids, to);
        }
        let adopted = self
            .batch
            .session_mut(id)
            .map(|session| session.adopt_blocks(ids, &run).is_ok());
        match adopted {
            Some(true) => to,
            Some(false) => {
                // Its cache was emptied rather than left half shared (a failed allocation): end it.
                self.fail(id, "its prompt's rows could not be shared");
                0
            }
            None => from,
        }
    }

    /// The prefix store's problems, one line each on stderr (the server goes on without what
    /// failed).
    fn report_store_problems(&mut self) {
        for p in self.store.take_problems() {
            say_store_problem(&p.text);
        }
    }

    /// One batched step: every running sequence's next token, its text sent, stop texts watched.
    fn step(&mut self) {
        let t0 = Instant::now();
        let tokenizer = self.engine.tokenizer();
        let live = &mut self.live;
        let metrics = &self.metrics;
        let mut stopped = Vec::new();
        let mut kept = 0u64;
        let result = self.batch.step(|id, token| {
            kept += 1;
            let Some(l) = live.get_mut(&id) else { return };
            if !l.text.first_token {
                l.text.first_token = true;
                let ttft = l.job.arrived.elapsed().as_secs_f64();
                metrics.update(|f| f.observe_ttft(ttft));
            }
            if let Ok(Some(text)) = l.text.stream.push(tokenizer, token) {
                if l.push_text(&text) {
                    stopped.push(id);
                }
            }
        });
        let elapsed = t0.elapsed().as_secs_f64();
        match result {
            Ok(done) => {
                self.metrics.update(|f| {
                    f.decode_steps += 1;
                    f.generated_tokens += kept;
                    f.decode_seconds += elapsed;
                });
                for mut f in done {
                    // A stop text completed by the token that also ended it otherwise: a stop.
                    let by_stop = stopped.contains(&f.id);
                    if by_stop {
                        f.reason = StopReason::EndOfText;
                    }
                    self.finish(f, by_stop);
                }
                for id in stopped {
                    if let Some(f) = self.batch.leave(id, StopReason::EndOfText) {
                        self.finish(f, true);
                    }
                }
            }
            Err(e) => {
                // The sequences' answers hold a token their sessions were not fed: end them all.
                let line = format!("a decode step failed: {}", crate::first_line(e));
                let ids: Vec<u64> = self.live.keys().copied().collect();
                for id in ids {
                    self.fail(id, &line);
                }
            }
        }
    }

    /// A prompt's prefill failed: its client gets a server error saying why.
    fn prefill_failed(&self, events: &UnboundedSender<Event>, e: anyhow::Error) {
        self.metrics.update(|f| f.failed += 1);
        let _ = events.send(Event::Failed(ApiError::new(
            500,
            "server_error",
            format!("the prompt's prefill failed: {}", crate::first_line(e)),
        )));
    }

    /// Ends sequence `id` with a server error saying `why`.
    fn fail(&mut self, id: u64, why: &str) {
        self.batch.leave(id, StopReason::Interrupted);
        self.left += 1;
        if let Some(l) = self.live.remove(&id) {
            let _ = l
                .job
                .events
                .send(Event::Failed(ApiError::new(500, "server_error", why)));
        }
        self.metrics.update(|f| f.failed += 1);
    }

    /// A sequence ended: the rest of its text and why it ended go to its client; its own rows go
    /// (the shared blocks it attended to stay in the index).
    fn finish(&mut self, f: Finished<'e>, by_stop_text: bool) {
        self.left += 1;
        if let Some(mut l) = self.live.remove(&f.id) {
            if !by_stop_text {
                if let Ok(Some(rest)) = l.text.stream.finish(self.engine.tokenizer()) {
                    l.text.held.push_str(&rest);
                }
                if !l.text.held.is_empty() {
                    let _ = l
                        .job
                        .events
                        .send(Event::Text(std::mem::take(&mut l.text.held)));
                }
            }
            let _ = l.job.events.send(Event::Done {
                reason: f.reason,
                completion_tokens: f.tokens.len(),
            });
            self.metrics.update(|m| m.finished += 1);
        }
    }

    fn publish(&self) {
        let allocated: u64 = self
            .batch
            .sessions()
            .map(|(_, s)| s.cache().bytes() as u64)
            .sum::<u64>()
            + self.shared_bytes();
        let (committed, shared_bytes) = (self.committed(0), self.shared_bytes());
        let in_use = self.blocks.values().filter(|b| b.block.in_use()).count();
        self.metrics.update(|f| {
            f.committed_bytes = committed;
            f.shared_bytes = shared_bytes;
            f.allocated_bytes = allocated;
            f.running = self.batch.len();
            f.waiting = self.waiting.len();
            f.shared_blocks = self.blocks.len();
            f.shared_blocks_in_use = in_use;
        });
    }
}

impl Live {
    /// Adds decoded text (`Text::push`); true when a stop text ended the answer.
    fn push_text(&mut self, text: &str) -> bool {
        self.text
            .push(text, &self.job.request.stop, &self.job.events)
    }
}

impl Text {
    fn new() -> Self {
        Self {
            first_token: false,
            stream: TextStream::new(),
            held: String::new(),
        }
    }

    /// Adds decoded text; sends to `events` what cannot be part of one of the `stop` texts. True
    /// when a stop text appeared: what precedes it is sent and the answer ends there.
    fn push(&mut self, text: &str, stop: &[String], events: &UnboundedSender<Event>) -> bool {
        self.held.push_str(text);
        if let Some(at) = stop.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.held.truncate(at);
            if !self.held.is_empty() {
                let _ = events.send(Event::Text(std::mem::take(&mut self.held)));
            }
            return true;
        }
        let keep = stop
            .iter()
            .map(|s| partial_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let send = self.held.len() - keep;
        if send > 0 {
            let rest = self.held.split_off(send);
            let _ = events.send(Event::Text(std::mem::replace(&mut self.held, rest)));
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

/// The key of each full block of `ids`: a hash chained over every token from position 0 to the
/// block's end (a block names its whole prefix; the index checks the tokens too).
fn block_keys(ids: &[u32]) -> Vec<u64> {
    let mut key = 0u64;
    ids.chunks_exact(SHARED_BLOCK)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (key, block).hash(&mut h);
            key = h.finish();
            key
        })
        .collect()
}

/// One line on stderr about the prefix store (the server goes on without what failed).
fn say_store_problem(text: &str) {
    eprintln!("kvchat serve: prefix store: {text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text on its way, with `stop` texts, and what its client receives.
    struct Client {
        text: Text,
        stop: Vec<String>,
        events: UnboundedSender<Event>,
    }

    impl Client {
        fn push_text(&mut self, text: &str) -> bool {
            self.text.push(text, &self.stop, &self.events)
        }
    }

    fn live(stop: &[&str]) -> (Client, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (
            Client {
                text: Text::new(),
                stop: stop.iter().map(|s| s.to_string()).collect(),
                events: tx,
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
