//! Retention by score ([`Retention::Budget`]): a layer keeps `budget` positions, chosen by the
//! attention they receive, plus the newer positions that arrive until the next eviction (at most
//! [`SLACK`] in a decode; a prompt's positions until its last step is attended).
//!
//! Layout: slot i of head h holds position `positions[h][i]`, ascending. Heads may hold different
//! positions (SnapKV ranks per KV head) but always as many, so the store keeps its `[nkv, slots,
//! row]` layout. A step's rows go to the slots after the held ones, so the view is the slots in
//! order with the step's own positions last, which is all the causal mask needs: keys are stored
//! rotated at their absolute positions, so nothing is re-rotated after an eviction.
//!
//! Scores come from the attention kernel (`attend_view_observed`): the softmax weights the step's
//! last queries gave each slot, summed over the query heads of a KV head. When a forward's last
//! step has been attended and more than `budget + SLACK` positions are held, the layer keeps the
//! sinks, the `recent` newest positions and the best scored of the rest, `budget` in all, and
//! compacts them into the first slots ([`RowStore::retain`]).

use super::*;
use anyhow::ensure;

/// How many of a prompt's last queries score its positions (SnapKV's observation window).
pub const OBSERVE_WINDOW: usize = 32;
/// Positions a budget layer takes on past its budget before it evicts again: evicting in
/// batches keeps the compaction's copies off every decode step.
pub const SLACK: usize = 32;
/// SnapKV's pooling: a slot's score is the largest of its neighbours' within this many slots
/// (so a kept position keeps the few around it: a number's digits, a word's pieces).
const POOL: usize = 7;

/// The newest positions a budget always keeps: the observation window, and a quantized cache's
/// f16 residual (read by position, so never evicted).
pub fn newest_kept(precision: Precision, residual: usize) -> usize {
    OBSERVE_WINDOW.max(if precision.quantized() { residual } else { 0 })
}

/// Which of a step's queries score positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queries {
    /// The last n queries of a forward's last step (a prompt's end, a decode step).
    Last(usize),
    /// Every query of every step.
    Every,
}

/// How long a position's observed attention counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// The newest observation alone.
    Newest,
    /// What was observed since the last eviction.
    SinceEviction,
    /// Everything since the position arrived.
    Always,
}

/// How a policy scores: the facts the budget layer reads from the table below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scoring {
    pub queries: Queries,
    pub memory: Memory,
    /// Each KV head ranks its own positions (else one choice for the layer, heads summed).
    pub per_head: bool,
    /// A slot's score is raised to its neighbours' best within [`POOL`] slots.
    pub pooled: bool,
}

/// How a budget cache ranks the positions it may evict: the table of policies. A row: the
/// variant, its name (flags, mode names), what it scores by in words, and its [`Scoring`]; no
/// code matches on a policy elsewhere.
macro_rules! policies {
    ($( $(#[$doc:meta])* $v:ident = $name:literal, $what:literal, $scoring:expr; )*) => {
        /// The eviction policy of a budget cache.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Evict {
            $( $(#[$doc])* $v, )*
        }

        impl Evict {
            pub const ALL: [Evict; [$($name),*].len()] = [$(Evict::$v),*];
            pub fn name(self) -> &'static str {
                match self { $( Evict::$v => $name, )* }
            }
            /// What the policy scores by, in a few words.
            pub fn what(self) -> &'static str {
                match self { $( Evict::$v => $what, )* }
            }
            pub fn parse(s: &str) -> Option<Self> {
                Self::ALL.into_iter().find(|e| e.name() == s)
            }
            /// How it scores.
            pub fn scoring(self) -> Scoring {
                match self { $( Evict::$v => $scoring, )* }
            }
        }
    };
}

policies! {
    /// SnapKV: the attention of the last [`OBSERVE_WINDOW`] queries of a prompt (in a decode,
    /// of the queries since the last eviction), per KV head, pooled over neighbouring slots.
    SnapKv = "snapkv", "attention of the last 32 queries, per KV head, pooled over 7 slots",
        Scoring { queries: Queries::Last(OBSERVE_WINDOW), memory: Memory::SinceEviction, per_head: true, pooled: true };
    /// TOVA: the attention of the newest query alone, summed over every head (one choice for
    /// the layer).
    Tova = "tova", "attention of the newest query, all heads together",
        Scoring { queries: Queries::Last(1), memory: Memory::Newest, per_head: false, pooled: false };
    /// H2O: the attention every query has paid a position since it arrived, per KV head.
    H2o = "h2o", "attention accumulated over every query, per KV head",
        Scoring { queries: Queries::Every, memory: Memory::Always, per_head: true, pooled: false };
}

impl Evict {
    /// The policy when none is named.
    pub const DEFAULT: Evict = Evict::SnapKv;
}

/// A budget layer's bookkeeping.
pub(super) struct Budgeted {
    pub(super) budget: usize,
    pub(super) sinks: usize,
    /// The newest positions that always stay (the observation window, and a quantized cache's
    /// f16 residual, which attention reads by position).
    pub(super) recent: usize,
    pub(super) evict: Evict,
    /// `positions[h][slot]`, ascending.
    pub(super) positions: Vec<Vec<u32>>,
    /// `scores[h][slot]`: the attention observed since the policy last reset it.
    pub(super) scores: Vec<Vec<f32>>,
    /// Every position from here on is held by every head; some before it were evicted (0: none).
    pub(super) evicted_before: usize,
    /// Where the forward under way ends (`DecoderCache::forward_begins`); None: every step is
    /// a forward of its own.
    pub(super) forward_end: Option<usize>,
    /// Positions evicted so far (per head).
    pub(super) dropped: usize,
    /// Whether the step under way may evict once attended.
    pub(super) last_step: bool,
    /// Evictions wait ([`Layer::hold_evictions`]): one that falls due is left `pending`.
    pub(super) hold: bool,
    pub(super) pending: bool,
    /// A verification forward's guesses (positions from here on) have their observed weights
    /// wait in `deferred` until the guesses that stay are known (`undo.rs`).
    pub(super) defer_from: Option<usize>,
    /// (position of the row, the weights it observed over the slots held then), oldest first.
    pub(super) deferred: Vec<(usize, Vec<f32>)>,
}

impl Budgeted {
    pub(super) fn new(
        nkv: usize,
        budget: usize,
        sinks: usize,
        recent: usize,
        evict: Evict,
    ) -> Self {
        Self {
            budget,
            sinks,
            recent,
            evict,
            positions: vec![Vec::new(); nkv],
            scores: vec![Vec::new(); nkv],
            evicted_before: 0,
            forward_end: None,
            dropped: 0,
            last_step: false,
            hold: false,
            pending: false,
            defer_from: None,
            deferred: Vec::new(),
        }
    }

    pub(super) fn held(&self) -> usize {
        self.positions[0].len()
    }

    /// How many of a step's last `t` queries score positions; `last`: the step ends its forward.
    pub(super) fn observe(&self, t: usize, last: bool) -> usize {
        match self.evict.scoring().queries {
            Queries::Every => t,
            Queries::Last(n) if last => t.min(n),
            Queries::Last(_) => 0,
        }
    }

    /// Adds a step's observed weights `[nkv, n]` (slot order) to the scores of the first n slots:
    /// n is every slot held (`deferred` false), or the slots held when a deferred step was
    /// attended (later ones arrived after it).
    pub(super) fn add(&mut self, weights: &[f32], deferred: bool) -> Result<()> {
        let held = self.held();
        let n = weights.len() / self.positions.len().max(1);
        ensure!(
            weights.len() == self.positions.len() * n && (n == held || deferred && n <= held),
            "observed attention over {} keys, the layer holds {held} positions per head",
            weights.len() / self.positions.len().max(1)
        );
        for (s, w) in self.scores.iter_mut().zip(weights.chunks_exact(n.max(1))) {
            if self.evict.scoring().memory == Memory::Newest {
                s.fill(0.0);
            }
            for (a, b) in s.iter_mut().zip(w) {
                *a += b;
            }
        }
        Ok(())
    }

    /// Whether the step just attended ends a forward (or a prompt's piece, see `append_budgeted`)
    /// after which too much is held.
    pub(super) fn due(&self) -> bool {
        self.last_step && self.held() > self.budget + SLACK
    }

    /// The slots each head keeps (ascending): the sinks, the `recent` newest positions, and the
    /// best scored of the others, `budget` in all.
    pub(super) fn choose(&self, seen: usize) -> Vec<Vec<usize>> {
        let protected = |p: u32| (p as usize) < self.sinks || p as usize + self.recent >= seen;
        let scoring = self.evict.scoring();
        let rank = |scores: &[f32], positions: &[u32]| -> Vec<usize> {
            let scored: Vec<f32> = if scoring.pooled {
                pooled(scores)
            } else {
                scores.to_vec()
            };
            let (mut keep, mut rest): (Vec<usize>, Vec<usize>) =
                (0..positions.len()).partition(|&i| protected(positions[i]));
            let room = self.budget.saturating_sub(keep.len());
            // Highest score first; among equals, the newer position.
            rest.sort_by(|&a, &b| scored[b].total_cmp(&scored[a]).then(b.cmp(&a)));
            keep.extend(rest.into_iter().take(room));
            keep.sort_unstable();
            keep
        };
        if scoring.per_head {
            return self
                .scores
                .iter()
                .zip(&self.positions)
                .map(|(s, p)| rank(s, p))
                .collect();
        }
        // One choice for the layer, by the attention of all heads (their positions agree: every
        // eviction so far chose the same slots for each).
        let total: Vec<f32> = (0..self.held())
            .map(|i| self.scores.iter().map(|s| s[i]).sum())
            .collect();
        let keep = rank(&total, &self.positions[0]);
        vec![keep; self.positions.len()]
    }

    /// Keeps `keep[h]` of each head's bookkeeping, in order, after an eviction at `seen`.
    pub(super) fn evicted(&mut self, keep: &[Vec<usize>], seen: usize) {
        let before = self.held();
        for ((ps, ss), k) in self.positions.iter_mut().zip(&mut self.scores).zip(keep) {
            *ps = k.iter().map(|&i| ps[i]).collect();
            *ss = k.iter().map(|&i| ss[i]).collect();
            if self.evict.scoring().memory != Memory::Always {
                ss.fill(0.0);
            }
        }
        self.dropped += before - self.held();
        self.evicted_before = seen;
    }

    /// Adds the deferred weights of the guesses that stayed, in the order single steps would
    /// have added them, and stops deferring.
    pub(super) fn settle(&mut self) -> Result<()> {
        self.defer_from = None;
        for (_, w) in std::mem::take(&mut self.deferred) {
            self.add(&w, true)?;
        }
        Ok(())
    }

    /// The last `n` positions go (a truncation that the evictions allow).
    pub(super) fn drop_last(&mut self, n: usize) {
        for (ps, ss) in self.positions.iter_mut().zip(&mut self.scores) {
            let keep = ps.len().saturating_sub(n);
            ps.truncate(keep);
            ss.truncate(keep);
        }
    }

    /// Positions `0..seen`, every one held (a reset, or a restored state that evicted nothing).
    pub(super) fn hold_all(&mut self, seen: usize) {
        for (ps, ss) in self.positions.iter_mut().zip(&mut self.scores) {
            *ps = (0..seen as u32).collect();
            *ss = vec![0.0; seen];
        }
        self.evicted_before = 0;
    }
}

/// Each slot's score raised to the largest within [`POOL`] / 2 slots either side.
fn pooled(scores: &[f32]) -> Vec<f32> {
    let r = POOL / 2;
    (0..scores.len())
        .map(|i| {
            let lo = i.saturating_sub(r);
            let hi = (i + r + 1).min(scores.len());
            scores[lo..hi].iter().copied().fold(f32::MIN, f32::max)
        })
        .collect()
}

impl Layer {
    /// [`LayerCache::append`] for a budget layer: the step's rows after the held ones, the view of
    /// them all in slot order.
    pub(super) fn append_budgeted(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        rope: &Rope,
    ) -> Result<Attend<'_>> {
        let t = k.dim(2)?;
        let (b, e) = (self.seen, self.seen + t);
        self.note_row(b);
        let k = rope.apply(k, b)?; // [1, nkv, t, hd], rotated at absolute positions
        let (k, v) = match self.hadamard {
            Some(blk) => (self.rotate(&k, blk)?, self.rotate(v, blk)?),
            None => (k, v.clone()),
        };
        let (n, room) = {
            let bg = self.budget.as_ref().expect("a budget layer");
            (bg.held(), bg.budget + SLACK + 1)
        };
        if n + t > self.store.capacity() {
            // Exactly what is needed: a decode stays within the room an eviction leaves, and a
            // prompt's positions go at its end.
            // (Never past the context: a sequence that cannot outgrow its budget never evicts.)
            self.store
                .grow((n + t).max(room.min(self.max_positions)), n)?;
        }
        self.store.write(n, &k, &v)?;
        self.write_residual(b, &k, &v)?;
        self.seen = e;
        let bg = self.budget.as_mut().expect("a budget layer");
        for (ps, ss) in bg.positions.iter_mut().zip(&mut bg.scores) {
            ps.extend(b as u32..e as u32);
            ss.resize(n + t, 0.0);
        }
        // A step ends its forward, or leaves so much held that a step as long again would pass
        // the context: either way the held positions are scored and cut back now.
        let last = bg.forward_end.is_none_or(|end| e >= end) || n + 2 * t > self.max_positions;
        bg.last_step = last;
        let observe = bg.observe(t, last);
        // The residual's positions are the newest (always held: `recent` covers them), so they
        // are the last slots; attention reads them from their f16 copies.
        let (res_lo, res_hi) = match &self.residual {
            Some(r) if r.lo < r.hi => (r.lo, r.hi),
            _ => (e, e),
        };
        let main = n + t - (res_hi - res_lo);
        let mut runs = self.main_runs(0, main);
        runs.extend(self.runs(res_lo, res_hi));
        let mut parts = Vec::new();
        for (src, slot, len) in runs.into_iter().filter(|r| r.2 > 0) {
            parts.push(match &self.offload_to {
                // Rows in host memory, attended on a device: their stored bytes go there.
                Some(dev) => {
                    let (k, v) = stage(self.source(src), (self.nkv, self.hd), slot, len, dev)?;
                    Part {
                        rows: crate::model::cache::Rows::Dense { k, v },
                        query: QueryRotation::AtPosition,
                    }
                }
                None => self
                    .source(src)
                    .part(slot, len, QueryRotation::AtPosition)?,
            });
        }
        Ok(Attend {
            view: KvView {
                parts,
                hadamard: self.hadamard,
                window: None,
                first: 0,
            },
            q_pos: b,
            sink_q_pos: None,
            observe,
        })
    }

    /// [`LayerCache::observed`] for a budget layer: the scores, then an eviction when one is due.
    pub(super) fn observed_budgeted(&mut self, weights: &[f32]) -> Result<()> {
        let seen = self.seen;
        let bg = self.budget.as_mut().expect("a budget layer");
        // A guess of a verification forward (a row apart: one position): its weights wait.
        if bg.defer_from.is_some_and(|f| seen > f) {
            bg.deferred.push((seen - 1, weights.to_vec()));
            ensure!(
                !bg.due(),
                "a verified guess at position {} would make the KV budget evict (guesses must stay within Layer::draft_room)",
                seen - 1
            );
            return Ok(());
        }
        bg.add(weights, false)?;
        if !bg.due() {
            return Ok(());
        }
        if bg.hold {
            bg.pending = true;
            return Ok(());
        }
        self.evict(seen)
    }

    /// Evicts down to the budget by the scores observed.
    fn evict(&mut self, seen: usize) -> Result<()> {
        let bg = self.budget.as_mut().expect("a budget layer");
        bg.pending = false;
        let keep = bg.choose(seen);
        let room = bg.budget + SLACK + 1;
        self.store.retain(&keep, room)?;
        self.budget
            .as_mut()
            .expect("a budget layer")
            .evicted(&keep, seen);
        Ok(())
    }

    /// While `on`, an eviction that falls due waits (its scores kept) until
    /// [`Layer::evict_held`]: what lets a prompt's whole rows be saved or stored first.
    pub fn hold_evictions(&mut self, on: bool) {
        if let Some(bg) = self.budget.as_mut() {
            bg.hold = on;
        }
    }

    /// Makes the eviction that waited, if one did, and stops holding them.
    pub fn evict_held(&mut self) -> Result<()> {
        self.settle()?;
        let seen = self.seen;
        match self.budget.as_mut() {
            Some(bg) => {
                bg.hold = false;
                if bg.pending {
                    self.evict(seen)?;
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Whether slot p holds position p in every head (nothing evicted yet): what reading rows by
    /// position (saving, the prefix store) needs.
    pub fn by_position(&self) -> bool {
        self.budget.as_ref().is_none_or(|b| b.evicted_before == 0)
    }

    /// A forward of `positions` begins: a budget evicts when its last step has been attended.
    pub fn forward_begins(&mut self, positions: usize) -> Result<()> {
        let end = self.seen + positions;
        self.settle()?;
        self.undo = None;
        if let Some(bg) = self.budget.as_mut() {
            bg.forward_end = Some(end);
        }
        Ok(())
    }

    /// What a verification forward deferred, now that its guesses that stay are known.
    pub(super) fn settle(&mut self) -> Result<()> {
        match self.budget.as_mut() {
            Some(bg) => bg.settle(),
            None => Ok(()),
        }
    }

    /// Positions evicted by this layer's budget so far (per head), if it has one.
    pub fn evicted(&self) -> Option<usize> {
        self.budget.as_ref().map(|b| b.dropped)
    }
}
