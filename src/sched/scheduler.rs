//! The scheduler's loop, on its own thread: jobs wait in a queue, join the running batch when the
//! batch and the KV pool have room, decode together one token a step ([`Batch`]), and leave when
//! they end, when a stop text ends them or when their sender goes.
//!
//! **The pool** holds two kinds of KV rows: each sequence's own, and blocks of
//! [`SHARED_BLOCK`] positions that sequences share. A sequence counts in it for what its own
//! stores hold once its next step is fed (`KvDims::bytes_up_to`: the stores grow a page of
//! [`GROW_BY`](super::pool::GROW_BY) positions at a time, up to its prompt and `max_tokens` within the context), not for all it may ever hold: a long
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

use super::pool::{Pool, ADMIT_AHEAD};
use super::shared::SharedIndex;
use super::stop::Text;
use super::{counters, Event, Failure, Inbox, Job};
use crate::engine::Engine;
use crate::kv::{CacheSpec, SharedBlock, SHARED_BLOCK};
use crate::session::batch::{Batch, Finished, Paused};
use crate::session::prefix::PrefixReuse;
use crate::session::{Sampler, Session, StopReason};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// How the scheduler runs.
pub struct Limits {
    /// Most sequences decoding at once.
    pub parallel: usize,
    /// The KV pool's bound in bytes.
    pub pool: u64,
    /// Sampling settings under each job's own (the server's flags).
    pub sampling: crate::model::sampling::SamplingPrefs,
}

/// A job, waiting for room.
struct Ready {
    job: Job,
    /// Whether its sender was told it started (it was preempted since, or while prefilling).
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

/// A job in the batch.
struct Live {
    job: Job,
    text: Text,
    /// Positions of its prompt read from shared blocks.
    shared: usize,
}

/// A job whose prompt is being prefilled, a chunk between two decode steps of the others.
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
    pool: Pool<'e>,
    parallel: usize,
    sampling: crate::model::sampling::SamplingPrefs,
    batch: Batch<'e>,
    live: HashMap<u64, Live>,
    waiting: VecDeque<Ready>,
    /// The job being prefilled, if one is.
    prefilling: Option<Prefilling<'e>>,
    blocks: SharedIndex,
    /// Whether this cache shares rows (None), or why not.
    share_refusal: Option<&'static str>,
    /// The on-disk prefix store behind the shared blocks: a prompt no shared block starts is
    /// looked up in it, and one prefilled whole is written to it.
    store: PrefixReuse,
    next_id: u64,
    /// Sequences that have left the batch (answered, failed or cancelled).
    left: u64,
    counts: Arc<counters::Shared>,
    /// A step's last events (`Done`, `Failed`), sent once the counts say what they end.
    last_events: Vec<(UnboundedSender<Event>, Event)>,
}

impl<'e> Scheduler<'e> {
    pub fn new(
        engine: &'e Engine,
        spec: CacheSpec,
        Prefixes {
            share_refusal,
            store,
        }: Prefixes,
        limits: Limits,
        counts: Arc<counters::Shared>,
    ) -> Self {
        counts.update(|c| c.pool_bytes = limits.pool);
        Self {
            engine,
            pool: Pool::new(engine.model(), spec, limits.pool),
            parallel: limits.parallel,
            sampling: limits.sampling,
            batch: Batch::new(),
            live: HashMap::new(),
            waiting: VecDeque::new(),
            prefilling: None,
            blocks: SharedIndex::default(),
            share_refusal,
            store,
            next_id: 0,
            left: 0,
            counts,
            last_events: Vec::new(),
        }
    }

    /// Serves jobs until every sender is gone and nothing runs.
    pub fn run(mut self, inbox: Inbox) {
        loop {
            if self.is_idle() {
                match inbox.0.recv() {
                    Ok(job) => self.submit(job),
                    Err(_) => {
                        self.store.finish();
                        self.report_store_problems();
                        return;
                    }
                }
            }
            while let Ok(job) = inbox.0.try_recv() {
                self.submit(job);
            }
            self.tick();
        }
    }

    /// Whether nothing waits, prefills or decodes.
    pub fn is_idle(&self) -> bool {
        self.batch.is_empty() && self.waiting.is_empty() && self.prefilling.is_none()
    }

    /// One turn of the loop: departed jobs dropped, waiting ones admitted (a prefill chunk), one
    /// decode step, the next step fitted into the pool, the counts published, then the step's
    /// last events sent.
    pub fn tick(&mut self) {
        self.drop_departed();
        self.admit();
        if !self.batch.is_empty() {
            self.step();
        }
        // (A job joins only when its next step fits: the steps after it may not.)
        self.fit_step();
        self.publish();
        for (to, event) in self.last_events.drain(..) {
            let _ = to.send(event);
        }
    }

    /// Queues a job, or refuses one that is empty, passes the context or could need more than
    /// the whole pool.
    pub fn submit(&mut self, job: Job) {
        let n = job.prompt.len();
        let ctx = self.engine.ctx();
        let refusal = if n == 0 {
            Some("the prompt is empty: there is nothing to continue".to_string())
        } else if n + job.max_tokens > ctx {
            Some(format!(
                "the prompt's {n} tokens and max_tokens {} pass the context of {ctx} tokens",
                job.max_tokens
            ))
        } else {
            let reserve = self.pool.most_bytes(n, n + job.max_tokens);
            (reserve > self.pool.bound).then(|| format!(
                "this request's KV cache may take {} ({} positions), more than the whole pool of {}; lower max_tokens or shorten the prompt",
                crate::human_bytes(reserve),
                n + job.max_tokens,
                crate::human_bytes(self.pool.bound)
            ))
        };
        if let Some(why) = refusal {
            // Its place in the queue is given back before its sender hears.
            let Job { events, ticket, .. } = job;
            drop(ticket);
            let _ = events.send(Event::Failed(Failure::Refused(why)));
            return;
        }
        self.counts.update(|c| c.requests += 1);
        self.waiting.push_back(Ready {
            job,
            started: false,
            resumed: None,
        });
    }

    /// Bytes of the pool the sequences' own rows take by their next step and `ahead` positions
    /// more (what they hold now, if more): the running ones', and the one being prefilled's
    /// from where it will sample.
    fn committed(&self, ahead: usize) -> u64 {
        let running = self.batch.sessions().filter_map(|(id, s)| {
            let l = self.live.get(&id)?;
            let upto = s.tokens().len() + 1 + ahead;
            let counted = self
                .pool
                .seq_bytes(l.job.prompt.len(), l.shared, l.job.max_tokens, upto);
            Some(counted.max(s.cache().bytes() as u64))
        });
        let prefilling = self.prefilling.as_ref().map(|p| {
            let job = &p.ready.job;
            let n = job.prompt.len();
            let at = n + p.paused.tokens().len();
            let counted = self
                .pool
                .seq_bytes(n, p.cached, job.max_tokens, at + 1 + ahead);
            counted.max(p.session.cache().bytes() as u64)
        });
        running.chain(prefilling).sum()
    }

    /// The longest run of shared blocks that `ids` starts with, at most `limit` blocks (none
    /// where this cache does not share).
    fn lookup(&mut self, ids: &[u32], limit: usize) -> Vec<Arc<SharedBlock>> {
        if self.share_refusal.is_some() {
            return Vec::new();
        }
        self.blocks.lookup(ids, limit)
    }

    /// Makes room for `need` more bytes beside the sequences' rows `ahead` positions past their
    /// next step (`committed`), by dropping shared blocks no sequence attends to, least recently
    /// used first; whether the room is there.
    fn make_room(&mut self, need: u64, ahead: usize) -> bool {
        let used = self.committed(ahead) + self.blocks.bytes();
        if used + need <= self.pool.bound {
            return true;
        }
        self.blocks.drop_lru(used + need - self.pool.bound)
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
            crate::human_bytes(self.pool.bound)
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
        self.counts.update(|f| f.preempted += 1);
        self.waiting.push_front(Ready {
            job: l.job,
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
        self.counts.update(|f| f.preempted += 1);
        self.waiting.push_front(ready);
    }

    /// Requests whose client left: waiting ones are dropped, running ones leave the batch.
    fn drop_departed(&mut self) {
        let mut gone = 0;
        // (Their tickets go with them.)
        self.waiting.retain(|r| {
            let closed = r.job.events.is_closed();
            gone += usize::from(closed);
            !closed
        });
        if gone > 0 {
            self.counts.update(|f| f.cancelled += gone as u64);
        }
        if self
            .prefilling
            .as_ref()
            .is_some_and(|p| p.ready.job.events.is_closed())
        {
            self.prefilling = None;
            self.counts.update(|m| m.cancelled += 1);
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
                self.counts.update(|m| m.cancelled += 1);
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
            if self.batch.len() >= self.parallel {
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
            let ids = next.job.prompt.clone();
            let max_tokens = next.job.max_tokens;
            // Where it samples next: after its prompt, or (resumed) after what it generated.
            let at = ids.len() + next.resumed.as_ref().map_or(0, |r| r.paused.tokens().len());
            // The blocks it starts from are held (so not dropped for room) while it asks; at
            // least one position of the prompt is left to prefill.
            let blocks = self.lookup(&ids, (ids.len() - 1) / SHARED_BLOCK);
            let cached = blocks.len() * SHARED_BLOCK;
            let need = self
                .pool
                .seq_bytes(ids.len(), cached, max_tokens, at + 1 + ADMIT_AHEAD);
            if !self.make_room(need, ADMIT_AHEAD) {
                return;
            }
            let Some(mut ready) = self.waiting.pop_front() else {
                return;
            };
            ready.job.ticket.release();
            self.start(ready, blocks);
        }
    }

    /// A request starts, or a preempted one resumes: its cache starts from the shared blocks its
    /// prompt begins with, and the rest of its prompt is to be prefilled into its own store.
    fn start(&mut self, mut r: Ready, blocks: Vec<Arc<SharedBlock>>) {
        let positions = r.job.prompt.len() + r.job.max_tokens;
        let mut session = Session::new(
            self.engine.model(),
            self.pool
                .own_spec(positions)
                .build(&self.engine.model().cfg, self.engine.kv_device()),
            positions,
        );
        // (Refused only for blocks this index never holds: then the prompt is prefilled whole.)
        let cached = session.adopt_blocks(&r.job.prompt, &blocks).unwrap_or(0);
        // No shared block starts it: the longest prefix the disk holds, into its own store (a
        // resumed sequence's rows were stored when it was prefilled the first time).
        let restored = if cached == 0 && r.resumed.is_none() {
            let found = self.store.restore(&mut session, &r.job.prompt, &[]);
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
                let sampling = self
                    .engine
                    .sampling_over(&[("request", &r.job.sampling), ("flag", &self.sampling)]);
                let mut sampler = Sampler::new(sampling.params);
                if let Some(c) = r.job.constraint.take() {
                    sampler.constrain(c);
                }
                self.next_id += 1;
                let stop_ids = match r.job.ignore_eos {
                    true => &[][..],
                    false => self.engine.stop_ids(),
                };
                let paused = Paused::new(sampler, r.job.max_tokens, stop_ids);
                (self.next_id - 1, paused, None)
            }
        };
        if !r.started {
            r.started = true;
            let _ = r.job.events.send(Event::Started {
                prompt_tokens: r.job.prompt.len(),
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
            if end >= p.ready.job.prompt.len() || p.session.evicts_by_score() {
                let p = self.prefilling.take().expect("checked");
                self.join(p);
                return true;
            }
            let t0 = Instant::now();
            let fed = p.session.feed(&p.ready.job.prompt[at..end]);
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
        let n = r.job.prompt.len();
        let joined = self.batch.resume(id, session, &r.job.prompt[at..], paused);
        let prefill = seconds + t0.elapsed().as_secs_f64();
        let resumed = text.is_some();
        self.counts.update(|f| {
            if resumed {
                f.recomputed_tokens += (n - cached + refed) as u64;
            } else {
                f.prompt_tokens += n as u64;
                f.cached_tokens += (cached + restored) as u64;
                f.prefix_hits += u64::from(cached + restored > 0);
            }
            f.prefill_seconds += prefill;
        });
        if let Err(e) = joined {
            self.prefill_failed(&r.job.events, e);
            return;
        }
        let ids = r.job.prompt.clone();
        // A prompt prefilled in its own store (no shared block under it) goes to the disk, its
        // blocks copied now and written on the store's thread.
        if cached == 0 && !resumed && self.store.is_on() {
            if let Some((_, session)) = self.batch.sessions().find(|(i, _)| *i == id) {
                self.store.store(session, true, &[], ids.len());
            }
            self.report_store_problems();
        }
        let keep_special = r.job.keep_special;
        self.live.insert(
            id,
            Live {
                job: r.job,
                text: text.unwrap_or_else(|| Text::new(keep_special)),
                shared: cached,
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
            let one = self.pool.most_bytes(SHARED_BLOCK, SHARED_BLOCK);
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
            run.extend(self.blocks.insert(ids, have, made));
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
        let counts = &self.counts;
        let mut stopped = Vec::new();
        let mut kept = 0u64;
        let result = self.batch.step(|id, token| {
            kept += 1;
            let Some(l) = live.get_mut(&id) else { return };
            if !l.text.first_token {
                l.text.first_token = true;
                let ttft = l.job.arrived.elapsed().as_secs_f64();
                counts.update(|f| f.observe_ttft(ttft));
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
                self.counts.update(|f| {
                    f.decode_steps += 1;
                    f.generated_tokens += kept;
                    f.decode_seconds += elapsed;
                });
                for mut f in done {
                    if let Some((why, grammar)) = f.error.take() {
                        // Its sampler failed: it alone ends, with why (a request's grammar is
                        // refused as the request's fault).
                        self.fail_as(f.id, &why, grammar);
                        continue;
                    }
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

    /// A prompt's prefill failed: its sender is told why.
    fn prefill_failed(&mut self, events: &UnboundedSender<Event>, e: anyhow::Error) {
        self.counts.update(|f| f.failed += 1);
        let why = format!("the prompt's prefill failed: {}", crate::first_line(e));
        self.last_events
            .push((events.clone(), Event::Failed(Failure::Engine(why))));
    }

    /// Ends sequence `id` with an engine failure saying `why`.
    fn fail(&mut self, id: u64, why: &str) {
        self.fail_as(id, why, false);
    }

    /// Ends sequence `id` saying `why`: refused (the request's fault) or an engine failure.
    fn fail_as(&mut self, id: u64, why: &str, refused: bool) {
        self.batch.leave(id, StopReason::Interrupted);
        self.left += 1;
        if let Some(l) = self.live.remove(&id) {
            let failed = Event::Failed(match refused {
                true => Failure::Refused(why.to_string()),
                false => Failure::Engine(why.to_string()),
            });
            self.last_events.push((l.job.events, failed));
        }
        self.counts.update(|f| f.failed += 1);
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
            let done = Event::Done(super::Done {
                reason: f.reason,
                completion_tokens: f.tokens.len(),
                stop_text: if by_stop_text {
                    l.text.stopped_by.take()
                } else {
                    None
                },
            });
            self.last_events.push((l.job.events, done));
            self.counts.update(|m| m.finished += 1);
        }
    }

    fn publish(&self) {
        let allocated: u64 = self
            .batch
            .sessions()
            .map(|(_, s)| s.cache().bytes() as u64)
            .sum::<u64>()
            + self.blocks.bytes();
        let (committed, shared_bytes) = (self.committed(0), self.blocks.bytes());
        let in_use = self.blocks.in_use();
        self.counts.update(|f| {
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
        self.text.push(text, &self.job.stop, &self.job.events)
    }
}

/// One line on stderr about the prefix store (the server goes on without what failed).
fn say_store_problem(text: &str) {
    eprintln!("kvchat serve: prefix store: {text}");
}
