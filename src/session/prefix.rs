//! The prefix store (`kv::prefix`) seen from a session: which caches can use it, restoring the
//! stored prefix of a prompt, and the rows of the blocks to store after a prefill.
//!
//! Exactness: a restored prefix followed by a prefill of the rest must give the state that one
//! prefill of the whole prompt gives, bit for bit, so that the answer is the one a run without the
//! store gives. This rests on the CPU kernels computing each row in a fixed order whatever the
//! step's length (DEVELOPERS.md, "Exactness"), so the store is used on the CPU only (no such promise
//! is made for cuBLAS). Float caches are then exact: each row is stored and read back in one format
//! whatever the steps. A quantized cache reads a step's last `residual` positions from their f16
//! copies and earlier ones quantized, so its values depend on where steps end. Prefill steps end at
//! multiples of the prefill chunk counted from position 0 (`Decoder::forward`), so a resumed prompt
//! steps as a whole one does; then what differs is where the prompt ends, and a quantized cache
//! (1) stores only blocks ending `residual` positions before its prompt's end, (2) resumes at most
//! `residual` before the reader's end and not inside the last `residual` positions of a chunk (there
//! one prefill reads f16 copies a resumed one would not have), with an empty residual, and (3) stores
//! only from a state that one prefill made.
//!
//! A model with recurrent states (Qwen3.5) needs them where it resumes, and a state cannot be
//! taken back to an earlier position: a prefill with the store on stops at the positions where
//! the store is to keep them (`Session::state_marks`) and snapshots them there (`kv::States`;
//! a saved prompt cache keeps the same snapshots). Stopping is exact
//! where a float cache keeps every position (each row and each scan step is computed alike
//! whatever the steps); a quantized cache stops only where a prefill step ends anyway.

use super::Session;
use crate::kv::persist::Snapshot;
use crate::kv::prefix::{Found, Piece, PieceRows, PrefixStore, Problem, Shape, STORE_BLOCK};
use crate::kv::{Retention, SharedBlock, States, SHARED_BLOCK};
use anyhow::Result;
use candle_core::Tensor;

impl Session<'_> {
    /// Why this session's cache cannot use the prefix store, if it cannot.
    pub fn store_refusal(&self) -> Option<&'static str> {
        let recurrent = self.model.cfg.recurrent.is_some();
        match self.cache.spec().retention() {
            Retention::None => Some("with no KV cache there is no state to store"),
            Retention::Window { .. } => Some("a window cannot restore a stored prefix exactly"),
            Retention::Budget { .. } if recurrent => Some(
                "a budget beside recurrent states (DeltaNet layers) cannot stop its prefill where the states are to be stored",
            ),
            Retention::Budget { evict, .. }
                if evict.scoring().queries == crate::kv::Queries::Every =>
            {
                Some(
                    "h2o scores every query of a prompt, and a restored prefix's are not run again",
                )
            }
            Retention::All | Retention::Budget { .. }
                if self.model.cfg.window_layers().is_some() =>
            {
                Some("this model's sliding-window layers keep only their window")
            }
            Retention::Budget { .. } => None,
            Retention::All => None,
        }
    }

    /// The shape of one block of this session's cache.
    pub fn store_shape(&self) -> Shape {
        // (The store serves models whose layers are alike: one with sliding-window layers,
        // Gemma 4's among them, is refused by `store_refusal`.)
        let cfg = &self.model.cfg;
        Shape {
            layers: self.cache.layers().len(),
            n_kv_heads: cfg.n_kv_head,
            row_bytes: self.cache.spec().precision().row_bytes(cfg.head_dim),
            state_bytes: self.cache.states().bytes(),
        }
    }

    /// Where a prefill of a prompt of `len` positions stops to snapshot the recurrent states for
    /// the store or a saved prompt cache: the end of the last full block the store may keep, the end of the block before it
    /// (a rerun of the same prompt resumes at least one position short of its end), and the
    /// `boundaries` (where prompts part: the end of the system message). A quantized cache stops
    /// only where its prefill steps end anyway (multiples of the prefill chunk). None for a model
    /// without states, or a cache the store refuses.
    pub fn state_marks(&self, len: usize, boundaries: &[usize]) -> Vec<usize> {
        if self.model.cfg.recurrent.is_none() || self.store_refusal().is_some() {
            return Vec::new();
        }
        let upto = len.saturating_sub(self.residual());
        let quantized = self.cache.spec().precision().quantized();
        let step = if quantized {
            self.model.prefill_chunk.max(STORE_BLOCK)
        } else {
            STORE_BLOCK
        };
        let ends = [upto / step * step, upto.saturating_sub(1) / step * step];
        let splits = |m: &usize| !quantized || m.is_multiple_of(step);
        let b = boundaries.iter().copied().filter(|&b| b <= upto);
        let mut marks: Vec<usize> = ends.into_iter().chain(b.filter(splits)).collect();
        marks.retain(|&m| m > 0);
        marks.sort_unstable();
        marks.dedup();
        marks
    }

    /// Prefills `ids` after the `reused` positions the session holds and returns the next-token
    /// logits. With `snapshots` on, a model with recurrent states stops at its `state_marks` to
    /// snapshot them (for the store, a saved prompt cache, going back): bit for bit the state
    /// one feed gives.
    pub fn prefill(
        &mut self,
        ids: &[u32],
        reused: usize,
        boundaries: &[usize],
        snapshots: bool,
    ) -> Result<Tensor> {
        let marks = match snapshots {
            true => self.state_marks(ids.len(), boundaries),
            false => Vec::new(),
        };
        let end = ids.len();
        let mut at = reused;
        for &m in marks.iter().filter(|&&m| m > reused && m < end) {
            self.feed(&ids[at..m])?;
            self.cache.snapshot_states();
            at = m;
        }
        let logits = self.feed(&ids[at..])?;
        if marks.contains(&end) {
            self.cache.snapshot_states();
        }
        Ok(logits)
    }

    /// The recent positions a quantized cache reads from f16 copies (0 for a float cache).
    fn residual(&self) -> usize {
        let spec = self.cache.spec();
        if spec.precision().quantized() {
            spec.mode.residual.min(spec.max_positions)
        } else {
            0
        }
    }

    /// Restores the longest stored prefix of `ids` into this (empty) session, leaving at least
    /// one position of `ids` to prefill (and a quantized cache's residual); `found.tokens` is what
    /// it holds now. A stored prefix that cannot be restored is a problem in `found`, and the
    /// session stays empty.
    /// `boundaries`: positions where prompts tend to part (the end of the system message), where
    /// a block may end early.
    pub fn restore_from_store(
        &mut self,
        store: &PrefixStore,
        ids: &[u32],
        boundaries: &[usize],
    ) -> Result<Found> {
        if !self.tokens.is_empty() {
            self.reset()?;
        }
        let r = self.residual();
        let limit = ids.len().saturating_sub(r.max(self.resume_margin()));
        let chunk = self.model.prefill_chunk;
        // Where a quantized cache may resume: not inside the last r positions of a chunk.
        let ok = |t: usize| r == 0 || t.is_multiple_of(chunk) || t % chunk + r <= chunk;
        let mut found = store.lookup(ids, limit, boundaries, &ok);
        if found.tokens > 0 {
            let states = match found.states.take() {
                Some(b) => self.cache.states().decode(&b),
                None => Ok(Vec::new()),
            };
            let mut snap = |states| Snapshot {
                tokens: ids[..found.tokens].to_vec(),
                layers: std::mem::take(&mut found.layers),
                states,
                snapshots: Vec::new(),
                extra: serde_json::Value::Null,
            };
            if let Err(e) = states.and_then(|s| self.restore(&snap(s))) {
                self.reset()?;
                let line = store.discard(&found.paths, &crate::first_line(e));
                found.problems.push(line.into());
                found.damaged_at = Some(0);
                found.tokens = 0;
            } else {
                // Recurrent states restored here are where a chat's /undo may come back to.
                self.cache.snapshot_states();
            }
        }
        Ok(found)
    }

    /// Why this session cannot share rows with other sessions in memory (a server's prefix
    /// sharing), if it cannot: only a float cache that keeps every position is exact whatever
    /// steps made the rows (see the module's note on exactness), on a model without
    /// sliding-window layers.
    pub fn share_refusal(&self) -> Option<&'static str> {
        if let Some(why) = self.store_refusal() {
            return Some(why);
        }
        if self.model.cfg.recurrent.is_some() {
            return Some("shared blocks do not carry recurrent states (DeltaNet layers) yet");
        }
        if let Some(why) = self.cache.layers().iter().find_map(|l| l.share_refusal()) {
            return Some(why);
        }
        None
    }

    /// Blocks `from..to` of what this session holds (`SHARED_BLOCK` positions each, from
    /// position 0) as blocks other sessions can attend to: those it already shares, and copies of
    /// its own rows for the others.
    pub fn share_blocks(&self, from: usize, to: usize) -> Result<Vec<SharedBlock>> {
        if let Some(why) = self.share_refusal() {
            anyhow::bail!(why);
        }
        let per_layer = self
            .cache
            .layers()
            .iter()
            .map(|l| l.share(from, to))
            .collect::<Result<Vec<_>>>()?;
        Ok((from..to)
            .map(|i| SharedBlock {
                tokens: self.tokens[..(i + 1) * SHARED_BLOCK].to_vec(),
                layers: per_layer.iter().map(|l| l[i - from].clone()).collect(),
            })
            .collect())
    }

    /// Attends from now on to `blocks` (consecutive, from position 0) for the first positions
    /// of `ids`: an empty session takes them as its first positions; one that holds them itself
    /// gives up its own copy. Returns how many positions they hold. Then prefilling the rest of
    /// `ids` gives the state one prefill gives, bit for bit. Refused (and nothing changed) when
    /// the blocks' tokens are not `ids`' first ones or not what the session holds.
    pub fn adopt_blocks(
        &mut self,
        ids: &[u32],
        blocks: &[std::sync::Arc<SharedBlock>],
    ) -> Result<usize> {
        let n = blocks.len() * SHARED_BLOCK;
        let Some(last) = blocks.last() else {
            return Ok(0);
        };
        if let Some(why) = self.share_refusal() {
            anyhow::bail!(why);
        }
        let same = ids.len() >= n
            && last.tokens[..] == ids[..n]
            && (self.tokens.is_empty() || self.tokens.starts_with(&ids[..n]));
        if !same
            || blocks
                .iter()
                .enumerate()
                .any(|(i, b)| b.tokens.len() != (i + 1) * SHARED_BLOCK)
        {
            anyhow::bail!("the shared blocks do not hold this sequence's first {n} tokens");
        }
        if blocks
            .iter()
            .any(|b| b.layers.len() != self.cache.layers().len())
        {
            anyhow::bail!("the shared blocks are of a model with another number of layers");
        }
        let was_empty = self.tokens.is_empty();
        for (i, layer) in self.cache.layers_mut().iter_mut().enumerate() {
            if let Err(e) = layer.adopt_shared(blocks.iter().map(|b| b.layers[i].clone()).collect())
            {
                // Never leave some layers sharing and others not.
                self.cache.reset()?;
                self.tokens.clear();
                return Err(e.context(format!("layer {i}")));
            }
        }
        if was_empty {
            self.tokens = ids[..n].to_vec();
        }
        Ok(n)
    }

    /// The blocks of the session's first `prompt` positions (a prompt it prefilled; what it
    /// generated after may follow) not stored yet, and their rows, with the recurrent states at
    /// their ends where the cache keeps a snapshot (`prefill`). `one_prefill` says whether the
    /// prompt's state was made by one prefill (after at most a restore from the store); a
    /// quantized cache stores nothing otherwise.
    pub fn rows_for_store(
        &self,
        store: &PrefixStore,
        one_prefill: bool,
        boundaries: &[usize],
        rewrite_from: usize,
        prompt: usize,
    ) -> Result<(Vec<Piece>, Vec<PieceRows>)> {
        let quantized = self.cache.spec().precision().quantized();
        // (A budget that has evicted no longer holds positions in order: nothing to store.)
        if self.store_refusal().is_some()
            || (quantized && !one_prefill)
            || !self.cache.by_position()
        {
            return Ok((Vec::new(), Vec::new()));
        }
        let tokens = &self.tokens[..prompt.min(self.tokens.len())];
        let upto = tokens.len().saturating_sub(self.residual());
        let states = self.cache.states();
        let states_at: Vec<usize> = states.snapshots().iter().map(|(at, _)| *at).collect();
        let which = store.missing(tokens, upto, boundaries, rewrite_from, &states_at);
        let mut rows = Vec::with_capacity(which.len());
        for p in &which {
            let block: Result<_> = self
                .cache
                .layers()
                .iter()
                .map(|l| l.raw_range(p.start, p.end()))
                .collect();
            rows.push(PieceRows {
                rows: block?,
                states: states.snapshot_at(p.end()).map(States::encode),
            });
        }
        Ok((which, rows))
    }
}

/// One lookup's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lookup {
    pub reused: usize,
    pub prompt: usize,
    pub bytes: u64,
    pub elapsed: std::time::Duration,
}

impl Lookup {
    /// "N of M prompt tokens reused (P %), X MiB read in T ms".
    pub fn describe(&self) -> String {
        format!(
            "{} of {} prompt tokens reused ({:.1} %), {:.1} MiB read in {:.1} ms",
            self.reused,
            self.prompt,
            100.0 * self.reused as f64 / self.prompt.max(1) as f64,
            self.bytes as f64 / (1 << 20) as f64,
            self.elapsed.as_secs_f64() * 1e3
        )
    }
}

/// What a process wrote to the prefix store.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Writes {
    pub blocks: usize,
    pub bytes: u64,
    /// Time copying the rows out of the cache (on the answer's path).
    pub copying: std::time::Duration,
    /// Time writing them (on the writer's thread).
    pub writing: std::time::Duration,
}

/// A run's or a chat's use of the prefix store: the store (or why there is none), the last lookup,
/// the thread writing new blocks once an answer is out, and this process's figures, added
/// to the store's totals by [`PrefixReuse::finish`].
pub struct PrefixReuse {
    store: Option<PrefixStore>,
    /// Why the store is not used, when it is not.
    pub off: Option<String>,
    pub last: Option<Lookup>,
    writer: Option<std::thread::JoinHandle<crate::kv::prefix::Written>>,
    run: crate::kv::prefix::Totals,
    problems: Vec<Problem>,
    /// Where the last lookup found a damaged block: the blocks from there on are rewritten.
    rewrite_from: usize,
    /// This process's writes.
    pub wrote: Writes,
    /// A write failed: this process writes no more (lookups go on).
    write_failed: bool,
}

impl PrefixReuse {
    /// No store, for `reason`.
    pub fn off(reason: impl Into<String>) -> Self {
        Self {
            store: None,
            off: Some(reason.into()),
            last: None,
            writer: None,
            run: Default::default(),
            problems: Vec::new(),
            rewrite_from: usize::MAX,
            wrote: Default::default(),
            write_failed: false,
        }
    }

    /// The store under `root` for this engine and session's cache, with a byte budget. Where it
    /// cannot be used, a problem (reported once) or the reason (said in --stats).
    pub fn open(
        engine: &crate::engine::Engine,
        session: &Session<'_>,
        root: &std::path::Path,
        budget: u64,
    ) -> Self {
        if let Some(why) = session.store_refusal() {
            return Self::off(why);
        }
        if engine.gpu_path() {
            return Self::off(
                "on a GPU's path a resumed prefill is not promised the bits of a whole one (CPU only)",
            );
        }
        let ident = crate::kv::prefix::Identity {
            model: format!(
                "{} weights {} {}",
                engine.digest(),
                crate::source::local::weights_sample(engine.path()),
                engine.numerics()
            ),
            file: engine.path().display().to_string(),
            axes: match session.cache().persist_key() {
                Ok(k) => k,
                Err(e) => return Self::off(crate::first_line(e)),
            },
        };
        match PrefixStore::open(root, ident, session.store_shape(), budget) {
            Ok(store) => {
                let mut s = Self::off("");
                s.store = Some(store);
                s.off = None;
                s
            }
            Err(e) => {
                let mut s = Self::off(format!("unusable ({})", crate::first_line(&e)));
                s.problems
                    .push(format!("{}; going on without it", crate::first_line(e)).into());
                s
            }
        }
    }

    pub fn is_on(&self) -> bool {
        self.store.is_some()
    }

    /// Restores the stored prefix of `ids` into the (empty) session; returns the positions it
    /// holds now.
    pub fn restore(
        &mut self,
        session: &mut Session<'_>,
        ids: &[u32],
        boundaries: &[usize],
    ) -> Result<usize> {
        self.join_writer();
        let Some(store) = &self.store else {
            return Ok(0);
        };
        let found = session.restore_from_store(store, ids, boundaries)?;
        self.run.lookups += 1;
        self.run.hits += u64::from(found.tokens > 0);
        self.run.prompt_tokens += ids.len() as u64;
        self.run.reused_tokens += found.tokens as u64;
        self.run.bytes_read += found.bytes_read;
        self.run.removed_damaged += found.removed as u64;
        self.problems.extend(found.problems);
        self.rewrite_from = found.damaged_at.unwrap_or(usize::MAX);
        self.last = Some(Lookup {
            reused: found.tokens,
            prompt: ids.len(),
            bytes: found.bytes_read,
            elapsed: found.elapsed,
        });
        Ok(found.tokens)
    }

    /// After a prompt of `prompt` positions was prefilled (and maybe answered): copies the rows of
    /// its blocks not stored yet and writes them on a thread of their own (joined by the next call
    /// or [`PrefixReuse::finish`]).
    pub fn store(
        &mut self,
        session: &Session<'_>,
        one_prefill: bool,
        boundaries: &[usize],
        prompt: usize,
    ) {
        self.join_writer();
        let Some(store) = self.store.as_ref().filter(|_| !self.write_failed) else {
            return;
        };
        let rewrite_from = std::mem::replace(&mut self.rewrite_from, usize::MAX);
        let t0 = std::time::Instant::now();
        let rows = session.rows_for_store(store, one_prefill, boundaries, rewrite_from, prompt);
        self.wrote.copying += t0.elapsed();
        match rows {
            Ok((which, rows)) if !which.is_empty() => {
                let (store, tokens) = (store.clone(), session.tokens().to_vec());
                self.writer = Some(std::thread::spawn(move || {
                    store.write(&tokens, &which, rows)
                }));
            }
            Ok(_) => {}
            Err(e) => self
                .problems
                .push(format!("cannot copy the blocks to store: {}", crate::first_line(e)).into()),
        }
    }

    fn join_writer(&mut self) {
        if let Some(w) = self.writer.take() {
            match w.join() {
                Ok(done) => {
                    self.wrote.blocks += done.blocks;
                    self.wrote.bytes += done.bytes;
                    self.wrote.writing += done.elapsed;
                    self.run.blocks_written += done.blocks as u64;
                    self.run.bytes_written += done.bytes;
                    self.run.evictions += done.evicted as u64;
                    // A store that cannot be written is not tried again by this process.
                    self.write_failed |= !done.problems.is_empty();
                    self.problems.extend(done.problems);
                }
                Err(_) => {
                    self.write_failed = true;
                    self.problems.push("the block writer failed".into());
                }
            }
        }
    }

    /// Waits for the writer and adds this process's figures to the store's totals.
    pub fn finish(&mut self) {
        self.join_writer();
        if let Some(store) = &self.store {
            // Evictions were counted in the totals as they happened.
            let add = crate::kv::prefix::Totals {
                evictions: 0,
                ..std::mem::take(&mut self.run)
            };
            // (When blocks could not be written, the totals cannot either: said once.)
            if let Err(e) = store.record(&add) {
                if !self.write_failed {
                    let line = format!("cannot update the totals: {}", crate::first_line(e));
                    self.problems.push(line.into());
                }
            }
        }
    }

    /// Problems met since the last call, one line each.
    pub fn take_problems(&mut self) -> Vec<Problem> {
        std::mem::take(&mut self.problems)
    }

    /// The line for --stats and /cache.
    pub fn describe(&self) -> String {
        match (&self.off, &self.last) {
            (Some(why), _) if self.store.is_none() && self.last.is_none() => {
                format!("not used: {why}")
            }
            (_, Some(l)) => l.describe() + &self.describe_writes(),
            (_, None) => "nothing looked up yet".to_string() + &self.describe_writes(),
        }
    }

    /// "; stored N blocks (X MiB) in T ms, C ms copying", when it stored any.
    fn describe_writes(&self) -> String {
        let Writes {
            blocks: n,
            bytes,
            copying: copy,
            writing: write,
        } = self.wrote;
        if n == 0 {
            return String::new();
        }
        format!(
            "; stored {n} block{} ({:.1} MiB) in {:.1} ms on its own thread, after {:.1} ms copying",
            if n == 1 { "" } else { "s" },
            bytes as f64 / (1 << 20) as f64,
            write.as_secs_f64() * 1e3,
            copy.as_secs_f64() * 1e3
        )
    }
}

impl Drop for PrefixReuse {
    /// A run that ends early (an error while decoding) still lets its writer finish, so that no
    /// temporary file is left behind.
    fn drop(&mut self) {
        self.join_writer();
    }
}
