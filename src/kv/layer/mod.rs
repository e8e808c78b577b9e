//! One layer's cache: the three axes composed, each in one place.
//!
//! - **Precision** (`rows.rs`): the format of a row. Quantized rows are stored Hadamard-rotated
//!   (`kvrows::hadamard`), and the newest `residual` positions are also kept in f16 ([`Residual`]),
//!   where attention reads them instead of their quantized copies.
//! - **Retention** ([`Retention`]): which positions are kept and in which slot. `All`: position p in
//!   slot p (the store grows by doubling up to the context). `Window { window: N, sinks: S }`: the
//!   first S positions in slots 0..S, every later position p in ring slot S + (p − S) mod N, so
//!   memory is bounded by S + N. `Budget`: a number of positions chosen by the attention they get
//!   (`budget.rs`). `None`: nothing kept; every step is the whole sequence.
//! - **Placement**: rows on the compute device, or (`offload`) in host memory and brought to a
//!   CUDA/Metal device for each layer's attention, the next layer's copy started first. On the CPU
//!   the two coincide: the same rows are read in place, bit for bit.
//!
//! Keys are stored rotated at their absolute position. A window's queries are rotated at their
//! absolute position too, so the relative distance to every window key is the true one; the sinks
//! keep their place at the start of the cache, and once positions have been dropped they pair with
//! the queries rotated at their place in the cache (`Attend::sink_q_pos`), as StreamingLLM does.
//! While nothing has been dropped, a window is the `All` cache, bit for bit.
//!
//! A step's queries see the sinks, the window as it was before the step, and the step's own
//! positions. When writing the step into the ring would overwrite positions its queries still need,
//! its rows wait in a store of their own ([`Pending`]) and enter the ring at the next call.

use super::paged::Paged;
use super::rows::{new_store, stage, RowStore};
use crate::model::cache::{Attend, KvView, LayerCache, Part, Precision, QueryRotation};
use crate::model::kernels::kvrows;
use crate::model::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

mod budget;
mod raw;
mod shared;
#[cfg(test)]
mod tests;
mod undo;

pub use budget::{newest_kept, Evict, Queries, OBSERVE_WINDOW, SLACK};
pub use raw::RawState;
pub use shared::{SharedBlock, SHARED_BLOCK};

/// The first allocation of a growing store, in positions.
const MIN_CAPACITY: usize = 256;

/// The capacity a growing store takes to hold `need` positions, never more than `limit` (≥
/// `need`): doubling from [`MIN_CAPACITY`], so a sequence's rows are copied O(log n) times, or
/// (`grow_by` Some(n)) the next multiple of n. The one growth rule of every layer's own store
/// (`KvDims::bytes_up_to` predicts by it).
pub(crate) fn grown_capacity(need: usize, limit: usize, grow_by: Option<usize>) -> usize {
    match grow_by {
        Some(n) => need.max(1).next_multiple_of(n.max(1)),
        None => need.max(1).next_power_of_two().max(MIN_CAPACITY),
    }
    .min(limit)
}

/// The capacity a layer's main store of `retention` takes to hold `need` positions, `room`
/// being the most it may ever hold (`max_positions` past any shared blocks): never past the
/// sinks and window of a window. What [`Layer::write_main`] grows to, and what
/// `KvDims::bytes_up_to` predicts.
pub(crate) fn main_capacity(
    retention: Retention,
    need: usize,
    room: usize,
    grow_by: Option<usize>,
) -> usize {
    let limit = match retention {
        Retention::Window { window, sinks } => (sinks + window).min(room.max(need)),
        _ => room.max(need),
    };
    grown_capacity(need, limit, grow_by)
}

/// A layer's own (main) store: in pages of `grow_by` positions where it grows by a step and
/// lives in host memory (the server's paged pool, `paged.rs`: growing never copies a row),
/// else one contiguous store.
fn main_store(
    precision: Precision,
    (nkv, hd): (usize, usize),
    store_on: Option<&Device>,
    grow_by: Option<usize>,
) -> Box<dyn RowStore> {
    match (store_on, grow_by) {
        (None, Some(page)) => Box::new(Paged::new(precision, nkv, hd, page)),
        _ => new_store(precision, nkv, hd, store_on),
    }
}

/// Which positions a layer keeps (the retention axis).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Retention {
    /// Nothing between steps: the decoder recomputes the whole sequence every step.
    None,
    /// Every position, up to the context.
    All,
    /// The first `sinks` positions and the last `window`.
    Window { window: usize, sinks: usize },
    /// `budget` positions per layer, chosen by attention score (`evict`), the first `sinks` and
    /// the newest always among them; with `pyramid`, lower layers keep more and upper layers
    /// fewer, the same in all (PyramidKV).
    Budget {
        budget: usize,
        sinks: usize,
        evict: Evict,
        pyramid: bool,
    },
}

/// The newest positions of a quantized cache in f16 (rotated as the quantized rows are): slot
/// `p mod r` holds position p, for p in `lo..hi`.
struct Residual {
    store: Box<dyn RowStore>,
    r: usize,
    lo: usize,
    hi: usize,
}

/// A step's rows waiting to enter a window's ring (they would overwrite positions the step's own
/// queries attend to): slots `0..t` of `store` hold positions `seq..seq + t`.
struct Pending {
    store: Box<dyn RowStore>,
    k: Tensor,
    v: Tensor,
    seq: usize,
}

/// A run of positions: where it is read from, its first slot there, its length.
type Run = (Source, usize, usize);

/// Where a run of positions is read from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    Main,
    Pending,
    Residual,
    /// The i-th block of rows shared with other sequences (`shared.rs`).
    Shared(usize),
}

/// What the last append's queries attended over: sinks `0..sink_end`, then `lo..e`, the step
/// being `b..e` (`Layer::view`); layers sharing this one's keys and values see the same.
#[derive(Clone, Copy)]
struct LastStep {
    sink_end: usize,
    lo: usize,
    b: usize,
    e: usize,
    dropped: bool,
}

pub struct Layer {
    /// See [`LastStep`].
    last_step: Option<LastStep>,
    nkv: usize,
    hd: usize,
    precision: Precision,
    retention: Retention,
    max_positions: usize,
    /// See [`LayerSpec::grow_by`].
    grow_by: Option<usize>,
    /// See [`LayerSpec::attend_window`].
    attend_window: Option<usize>,
    store: Box<dyn RowStore>,
    residual: Option<Residual>,
    pending: Option<Pending>,
    /// Block size of the Hadamard rotation of quantized rows.
    hadamard: Option<usize>,
    /// The compute device, when rows live in host memory and are staged to it (offload).
    offload_to: Option<Device>,
    /// Where the main store lives: a device, or None for host memory.
    store_on: Option<Device>,
    /// Offload: the runs of positions (`Layer::runs`) copied to the compute device ahead of the
    /// layer's attention, and the copies.
    staged: Option<(Vec<Run>, Tensor, Tensor)>,
    /// Positions of the sequence seen.
    seen: usize,
    /// The oldest window position still held (positions before it, sinks aside, were dropped).
    win_lo: usize,
    /// A budget's bookkeeping (`Retention::Budget`).
    budget: Option<budget::Budgeted>,
    /// A verification forward's record of what its guesses changed (`undo.rs`).
    undo: Option<undo::Undo>,
    /// Blocks of [`shared::SHARED_BLOCK`] positions from position 0 that this layer attends to
    /// but does not own (a full float cache only, `shared.rs`); the main store then holds
    /// positions from the end of the last one, in slots from 0.
    shared: Vec<std::sync::Arc<dyn RowStore>>,
}

pub struct LayerSpec {
    pub precision: Precision,
    pub retention: Retention,
    pub offload: bool,
    pub residual: usize,
    pub max_positions: usize,
    /// The window the model declares for this layer, which attention enforces per query row.
    pub attend_window: Option<usize>,
    /// How the layer's own store grows ([`grown_capacity`]).
    pub grow_by: Option<usize>,
}

impl Layer {
    /// A layer whose rows live in host memory, read in place by the CPU's attention kernel
    /// (`tensors_on` None), or as tensors on a device, attended with candle ops (`Some`: a GPU, or
    /// the CPU running the GPU's path); with `offload`, rows on a device live in host memory
    /// instead and are staged to the device for each step.
    pub fn new(spec: &LayerSpec, nkv: usize, hd: usize, tensors_on: Option<&Device>) -> Self {
        let store_on = tensors_on.filter(|_| !spec.offload).cloned();
        let store = main_store(spec.precision, (nkv, hd), store_on.as_ref(), spec.grow_by);
        let residual =
            (spec.precision.quantized() && spec.residual > 0 && spec.retention != Retention::None)
                .then(|| Residual {
                    store: new_store(Precision::F16, nkv, hd, store_on.as_ref()),
                    // More recent positions than the context (or the window) holds could never
                    // be used.
                    r: spec
                        .residual
                        .min(spec.max_positions)
                        .min(match spec.retention {
                            Retention::Window { window, sinks } => window + sinks,
                            _ => usize::MAX,
                        }),
                    lo: 0,
                    hi: 0,
                });
        Self {
            last_step: None,
            nkv,
            hd,
            precision: spec.precision,
            retention: spec.retention,
            max_positions: spec.max_positions,
            grow_by: spec.grow_by,
            attend_window: spec.attend_window,
            store,
            residual,
            pending: None,
            hadamard: spec
                .precision
                .quantized()
                .then(|| kvrows::hadamard_block(hd)),
            offload_to: tensors_on.filter(|_| spec.offload).cloned(),
            store_on,
            staged: None,
            seen: 0,
            win_lo: 0,
            budget: match spec.retention {
                Retention::Budget {
                    budget,
                    sinks,
                    evict,
                    ..
                } => Some(budget::Budgeted::new(
                    nkv,
                    budget,
                    sinks,
                    newest_kept(spec.precision, spec.residual),
                    evict,
                )),
                _ => None,
            },
            undo: None,
            shared: Vec::new(),
        }
    }

    pub fn n_kv_heads(&self) -> usize {
        self.nkv
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// The window the model declares for this layer, which attention enforces per query row.
    pub fn attend_window(&self) -> Option<usize> {
        self.attend_window
    }

    /// (sinks, window) of the retention; a full cache is a window that never drops.
    fn shape(&self) -> (usize, usize) {
        match self.retention {
            Retention::Window { window, sinks } => (sinks, window),
            _ => (0, usize::MAX),
        }
    }

    /// The slot of position p in the main store.
    fn slot(&self, p: usize) -> usize {
        match self.retention {
            Retention::Window { window, sinks } if p >= sinks => sinks + (p - sinks) % window,
            _ => p - self.shared_len(),
        }
    }

    /// The slot of position p and how many positions from p on sit in consecutive slots (until
    /// the sinks or the ring end; unbounded for `All`).
    fn slot_run(&self, p: usize) -> (usize, usize) {
        let slot = self.slot(p);
        let room = match self.retention {
            Retention::Window { window, sinks } if p >= sinks => sinks + window - slot,
            Retention::Window { sinks, .. } => sinks - p,
            _ => usize::MAX,
        };
        (slot, room)
    }

    /// The positions held, oldest first, as (sinks, window) ranges.
    fn held(&self) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (s, _) = self.shape();
        let sink_end = s.min(self.seen);
        (0..sink_end, self.win_lo.max(sink_end)..self.seen)
    }

    /// Runs of positions `a..c` by where they are read and in which slots: (source, slot, len).
    fn runs(&self, a: usize, c: usize) -> Vec<Run> {
        let mut out = Vec::new();
        let res_lo = match &self.residual {
            Some(r) if r.lo < r.hi => r.lo,
            _ => usize::MAX,
        };
        let pend = self.pending.as_ref().map_or(usize::MAX, |p| p.seq);
        let shared_end = self.shared_len();
        let mut p = a;
        while p < c {
            let (src, slot, room) = if p < shared_end {
                let b = shared::SHARED_BLOCK;
                (Source::Shared(p / b), p % b, b - p % b)
            } else if p >= res_lo {
                let r = self.residual.as_ref().expect("res_lo is set").r;
                (Source::Residual, p % r, r - p % r)
            } else if p >= pend {
                let seq = self.pending.as_ref().expect("pend is set").seq;
                (Source::Pending, p - seq, res_lo - p)
            } else {
                let (slot, room) = self.slot_run(p);
                let room = room.min(self.store.contiguous(slot));
                (Source::Main, slot, room.min(res_lo.min(pend) - p))
            };
            let len = room.min(c - p);
            out.push((src, slot, len));
            p += len;
        }
        out
    }

    /// An empty main store of this layer's kind ([`main_store`]).
    fn new_main_store(&self) -> Box<dyn RowStore> {
        let dims = (self.nkv, self.hd);
        main_store(self.precision, dims, self.store_on.as_ref(), self.grow_by)
    }

    /// Slots `slot..slot + len` of the main store as runs, cut where its pages end.
    fn main_runs(&self, slot: usize, len: usize) -> Vec<Run> {
        let mut out = Vec::new();
        let mut s = slot;
        while s < slot + len {
            let n = self.store.contiguous(s).min(slot + len - s);
            out.push((Source::Main, s, n));
            s += n;
        }
        out
    }

    fn source(&self, s: Source) -> &dyn RowStore {
        match s {
            Source::Main => self.store.as_ref(),
            Source::Pending => self.pending.as_ref().expect("a pending run").store.as_ref(),
            Source::Residual => self
                .residual
                .as_ref()
                .expect("a residual run")
                .store
                .as_ref(),
            Source::Shared(i) => self.shared[i].as_ref(),
        }
    }

    /// Positions `a..c` decoded to f32, `[1, nkv, c − a, hd]` each, Hadamard rotation undone.
    fn read_range(&self, a: usize, c: usize) -> Result<(Tensor, Tensor)> {
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (src, slot, len) in self.runs(a, c) {
            let (k, v) = self.source(src).read(slot, len)?;
            ks.push(k);
            vs.push(v);
        }
        let (k, v) = (Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?);
        match self.hadamard {
            Some(b) => Ok((self.rotate(&k, b)?, self.rotate(&v, b)?)),
            None => Ok((k, v)),
        }
    }

    /// Positions `a..c` as tensors on `dev`, as stored (quantized rows decoded there, still
    /// rotated): what an offloaded layer's attention reads.
    fn stage_range(&self, a: usize, c: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (src, slot, len) in self.runs(a, c) {
            let (k, v) = stage(self.source(src), (self.nkv, self.hd), slot, len, dev)?;
            ks.push(k);
            vs.push(v);
        }
        // Quantized runs arrive as f32, the residual's as f16: joined as f32 (exact).
        if ks.iter().any(|k| k.dtype() != ks[0].dtype()) {
            let f32 = |xs: Vec<Tensor>| -> Result<Vec<Tensor>> {
                Ok(xs
                    .into_iter()
                    .map(|x| x.to_dtype(candle_core::DType::F32))
                    .collect::<candle_core::Result<_>>()?)
            };
            (ks, vs) = (f32(ks)?, f32(vs)?);
        }
        Ok((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?))
    }

    /// `x` `[1, nkv, t, hd]` with each row multiplied by the Hadamard matrix of block `b` (its
    /// own inverse), where `x` is.
    fn rotate(&self, x: &Tensor, b: usize) -> Result<Tensor> {
        crate::model::kernels::attention::hadamard_rows(x, b)
    }

    /// Moves rows of a finished step from `pending` into the ring.
    fn commit(&mut self) -> Result<()> {
        if let Some(p) = self.pending.take() {
            self.write_main(p.seq, &p.k, &p.v)?;
        }
        Ok(())
    }

    /// Encodes positions `b..b + t` (rows `[1, nkv, t, hd]`) into their slots of the main store,
    /// skipping those a later one of the same write overwrites.
    fn write_main(&mut self, b: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(2)?;
        let e = b + t;
        let (s, n) = self.shape();
        // Slots of the main store: positions from the end of the shared blocks (none but in a
        // full cache, where no write goes before it).
        let off = self.shared_len();
        let need = match self.retention {
            Retention::Window { window, sinks } => e.min(sinks + window),
            _ => e - off,
        };
        if need > self.store.capacity() {
            // (Only a full cache has shared blocks: a window's `off` is 0.)
            let room = self.max_positions.saturating_sub(off);
            let cap = main_capacity(self.retention, need, room, self.grow_by);
            let keep = self.store.capacity().min(b - off);
            self.store.grow(cap, keep)?;
        }
        // Positions that survive this write: the sinks, and the last n.
        let first_kept = e.saturating_sub(n).max(b);
        let mut p = b;
        while p < e {
            if p >= s && p < first_kept {
                p = first_kept;
                continue;
            }
            let (slot, room) = self.slot_run(p);
            let len = room.min(e - p);
            self.note_overwrite(p, Source::Main, slot, len)?;
            self.store
                .write(slot, &k.narrow(2, p - b, len)?, &v.narrow(2, p - b, len)?)?;
            p += len;
        }
        Ok(())
    }

    /// Writes positions `b..b + t` of the residual.
    fn write_residual(&mut self, b: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let Some(res) = self.residual.as_mut() else {
            return Ok(());
        };
        let t = k.dim(2)?;
        let e = b + t;
        if res.store.capacity() < res.r {
            res.store.grow(res.r, 0)?;
        }
        let r = res.r;
        let first = b.max(e.saturating_sub(r));
        let mut p = first;
        while p < e {
            let len = (r - p % r).min(e - p);
            self.note_overwrite(p, Source::Residual, p % r, len)?;
            let res = self.residual.as_mut().expect("checked");
            res.store
                .write(p % r, &k.narrow(2, p - b, len)?, &v.narrow(2, p - b, len)?)?;
            p += len;
        }
        let res = self.residual.as_mut().expect("checked");
        res.lo = if res.hi == b && res.lo < res.hi {
            res.lo.max(e.saturating_sub(res.r))
        } else {
            first
        };
        res.hi = e;
        Ok(())
    }

    /// What the last step's queries attend over ([`LastStep`]).
    fn last_attend(&self) -> Result<Attend<'_>> {
        let s = self.last_step.expect("a step was appended");
        Ok(Attend {
            view: self.view(s.sink_end, s.lo, s.b, s.e, s.dropped)?,
            q_pos: s.b,
            sink_q_pos: s.dropped.then_some(s.sink_end + (s.b - s.lo)),
            observe: 0,
        })
    }

    /// The view of a step over positions `b..e`: sinks `0..sink_end` (pairing with the queries
    /// rotated for sinks when `dropped`), then `lo..e`.
    fn view(
        &self,
        sink_end: usize,
        lo: usize,
        b: usize,
        e: usize,
        dropped: bool,
    ) -> Result<KvView<'_>> {
        use QueryRotation::{AtPosition, ForSinks};
        let sinks = if dropped { ForSinks } else { AtPosition };
        let ranges = [
            (0..sink_end, sinks),
            (lo..b, AtPosition),
            (b..e, AtPosition),
        ];
        let mut parts = Vec::new();
        for (range, query) in ranges.into_iter().filter(|(r, _)| !r.is_empty()) {
            if let Some(dev) = &self.offload_to {
                // Rows in host memory, attended on the device: copy them there (the window's rows
                // were started by `prefetch`).
                let (k, v) = match &self.staged {
                    // Reused only if the positions are read from where they were copied from
                    // (a step moves the oldest ones out of a quantized cache's f16 residual).
                    Some((runs, k, v)) if *runs == self.runs(range.start, range.end) => {
                        (k.clone(), v.clone())
                    }
                    _ => self.stage_range(range.start, range.end, dev)?,
                };
                parts.push(Part {
                    rows: crate::model::cache::Rows::Dense { k, v },
                    query,
                });
                continue;
            }
            for (src, slot, len) in self.runs(range.start, range.end) {
                parts.push(self.source(src).part(slot, len, query)?);
            }
        }
        Ok(KvView {
            parts,
            hadamard: self.hadamard,
            window: self.attend_window.filter(|_| sink_end == 0),
            // Consecutive positions from `lo`, or from 0 while nothing was dropped.
            first: if sink_end == 0 { lo } else { 0 },
        })
    }

    /// Why this layer cannot go back to `len` positions, if it cannot: a window that dropped
    /// position `len`, or a declared window whose next query would miss keys already dropped
    /// (it needs the `attend_window` positions before it). Changes nothing.
    pub fn truncate_refusal(&self, len: usize) -> Option<String> {
        if self.retention == Retention::None || len >= self.seen || len == 0 {
            return None;
        }
        if let Some(bg) = &self.budget {
            // (A verification's record cannot take an eviction back.)
            return (len < bg.evicted_before).then(|| {
                format!(
                    "the KV budget evicted positions before {}: going back to position {len} needs them",
                    bg.evicted_before
                )
            });
        }
        if self.can_take_back(len) {
            return None;
        }
        let (sinks, window) = self.held();
        let dropped = window.start > sinks.end;
        if dropped && len < window.start {
            return Some(format!(
                "the window no longer holds position {len}: it holds {} sinks and positions {}..{}",
                sinks.len(),
                window.start,
                self.seen
            ));
        }
        match self.attend_window {
            Some(w) if dropped && len + 1 < window.start + w => Some(format!(
                "going back to position {len} needs the {w} positions before it, and this layer dropped those before {}",
                window.start
            )),
            _ => None,
        }
    }

    /// Refuses (and empties the layer) if a held position in `a..c` decodes to NaN or infinity.
    fn check_finite(&mut self, a: usize, c: usize) -> Result<()> {
        let (sinks, window) = self.held();
        for r in [sinks, window] {
            let (lo, hi) = (r.start.max(a), r.end.min(c));
            if lo >= hi {
                continue;
            }
            let (k, v) = self.read_range(lo, hi)?;
            for (name, x) in [("keys", k), ("values", v)] {
                let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
                if !xs.iter().all(|x| x.is_finite()) {
                    self.reset();
                    bail!("the saved {name} hold NaN or infinite values");
                }
            }
        }
        Ok(())
    }

    /// After a forward: a recompute keeps nothing, not even the step's rows.
    pub fn step_done(&mut self) {
        if self.retention == Retention::None {
            self.store = self.new_main_store();
        }
        // Offload: what `prefetch` staged served this forward; a ring's slots come round again
        // with other positions in them, so a later step must not take those copies for its own.
        self.staged = None;
    }

    fn reset(&mut self) {
        self.undo = None;
        self.shared.clear();
        self.seen = 0;
        self.win_lo = 0;
        if let Some(bg) = self.budget.as_mut() {
            bg.hold_all(0);
            bg.deferred.clear();
            bg.defer_from = None;
        }
        self.pending = None;
        self.staged = None;
        if let Some(r) = self.residual.as_mut() {
            (r.lo, r.hi) = (0, 0);
        }
    }
}

impl LayerCache for Layer {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        if self.budget.is_some() {
            return self.append_budgeted(k, v, rope);
        }
        self.commit()?;
        self.staged = self.staged.take().filter(|_| self.offload_to.is_some());
        let t = k.dim(2)?;
        if self.retention == Retention::None {
            // The step is the whole sequence, from position 0; nothing is kept after it.
            self.reset();
        }
        let b = self.seen;
        let e = b + t;
        self.note_row(b);
        if self.retention == Retention::All && e > self.max_positions {
            return Err(crate::fixable(
                crate::Fix::RaiseContext,
                format!(
                    "the KV cache is full: {e} positions needed, {} allowed",
                    self.max_positions
                ),
            ));
        }
        let (s, n) = self.shape();
        let k = rope.apply(k, b)?; // [1, nkv, t, hd], rotated at absolute positions
        let (k, v) = match self.hadamard {
            Some(blk) => (self.rotate(&k, blk)?, self.rotate(v, blk)?),
            None => (k, v.clone()),
        };
        // What the step's queries see: the sinks, the window before the step, the step.
        let sink_end = s.min(b);
        let lo = self.win_lo.max(sink_end).max(b.saturating_sub(n));
        // Sinks pair with queries rotated at their place in the cache once positions between
        // them and the window have been dropped (no sinks: nothing to pair).
        let dropped = sink_end > 0 && lo > sink_end;
        if e > s.saturating_add(n) {
            // Writing into the ring would overwrite positions lo..b that this step attends to.
            let mut store = new_store(self.precision, self.nkv, self.hd, self.store_on.as_ref());
            store.grow(t, 0)?;
            store.write(0, &k, &v)?;
            self.pending = Some(Pending {
                store,
                k: k.clone(),
                v: v.clone(),
                seq: b,
            });
        } else {
            self.write_main(b, &k, &v)?;
        }
        self.write_residual(b, &k, &v)?;
        self.seen = e;
        self.win_lo = self.win_lo.max(e.saturating_sub(n)).max(s.min(e));
        self.last_step = Some(LastStep {
            sink_end,
            lo,
            b,
            e,
            dropped,
        });
        self.last_attend()
    }

    fn attend_again(&mut self, t: usize) -> Result<Attend<'_>> {
        if self.budget.is_some() {
            bail!("a KV budget cannot serve a model whose layers share keys and values (gemma4) yet: use --kv-window or no retention flag");
        }
        match self.last_step {
            Some(s) if s.e - s.b == t && s.e == self.seen => self.last_attend(),
            _ => bail!("a layer shares keys and values that were not stored this step"),
        }
    }

    fn observed(&mut self, weights: &[f32]) -> Result<()> {
        match self.budget {
            Some(_) => self.observed_budgeted(weights),
            None => Ok(()),
        }
    }

    fn len(&self) -> usize {
        if self.retention == Retention::None {
            return 0;
        }
        if let Some(bg) = &self.budget {
            return bg.held();
        }
        let (a, b) = self.held();
        a.len() + b.len()
    }

    fn seen(&self) -> usize {
        if self.retention == Retention::None {
            return 0;
        }
        self.seen
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if self.retention == Retention::None || len >= self.seen {
            return Ok(());
        }
        if let Some(why) = self.truncate_refusal(len) {
            bail!(why);
        }
        self.commit()?;
        self.staged = None;
        if len == 0 {
            self.reset();
            return Ok(());
        }
        self.take_back(len)?;
        if len < self.shared_len() {
            self.unshare_to(len)?;
        }
        if let Some(bg) = self.budget.as_mut() {
            // The guesses from `len` on go; single steps would have added the scores of those
            // kept before it.
            bg.deferred.retain(|(p, _)| *p < len);
            bg.settle()?;
            bg.drop_last(self.seen - len);
        }
        self.seen = len;
        self.win_lo = self.win_lo.min(len);
        if let Some(r) = self.residual.as_mut() {
            r.hi = r.hi.min(len);
            r.lo = r.lo.min(r.hi);
        }
        Ok(())
    }

    fn prefetch(&mut self) -> Result<()> {
        // (A recompute keeps nothing between steps: nothing to stage.)
        // (A budget's rows are staged by its append: its slots are not positions.)
        if self.offload_to.is_none()
            || self.staged.is_some()
            || self.retention == Retention::None
            || self.budget.is_some()
        {
            return Ok(());
        }
        // What the next step's view reads from before its own positions: the window's rows.
        let (_, window) = self.held();
        if !window.is_empty() {
            let dev = self.offload_to.as_ref().expect("checked");
            let (k, v) = self.stage_range(window.start, window.end, dev)?;
            self.staged = Some((self.runs(window.start, window.end), k, v));
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.store.bytes()
            + self.residual.as_ref().map_or(0, |r| r.store.bytes())
            + self.pending.as_ref().map_or(0, |p| p.store.bytes())
    }

    fn bytes_used(&self) -> usize {
        let row = self.precision.row_bytes(self.hd);
        let res = self.residual.as_ref().map_or(0, |r| r.hi - r.lo) * 2 * self.hd;
        2 * self.nkv * (self.len() * row + res)
    }
}
