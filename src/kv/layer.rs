//! One layer's cache: the three axes composed, each in one place.
//!
//! - **Precision** (`store.rs`): the format of a row. Quantized rows are stored Hadamard-rotated
//!   (`kvrows::hadamard`), and the newest `residual` positions are also kept in f16 ([`Residual`]),
//!   where attention reads them instead of their quantized copies.
//! - **Retention** ([`Retention`]): which positions are kept and in which slot. `All`: position p in
//!   slot p (the store grows by doubling up to the context). `Window { window: N, sinks: S }`: the
//!   first S positions in slots 0..S, every later position p in ring slot S + (p − S) mod N, so
//!   memory is bounded by S + N. `None`: nothing kept; every step is the whole sequence.
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

use super::store::{new_store, stage, Store};
use crate::model::cache::{Attend, KvView, LayerCache, Part, Precision};
use crate::model::kernels::kvrows;
use crate::model::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

/// The first allocation of a growing store, in positions.
const MIN_CAPACITY: usize = 256;

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
}

/// The newest positions of a quantized cache in f16 (rotated as the quantized rows are): slot
/// `p mod r` holds position p, for p in `lo..hi`.
struct Residual {
    store: Box<dyn Store>,
    r: usize,
    lo: usize,
    hi: usize,
}

/// A step's rows waiting to enter a window's ring (they would overwrite positions the step's own
/// queries attend to): slots `0..t` of `store` hold positions `seq..seq + t`.
struct Pending {
    store: Box<dyn Store>,
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
}

pub struct Layer {
    nkv: usize,
    hd: usize,
    precision: Precision,
    retention: Retention,
    max_positions: usize,
    /// See [`LayerSpec::attend_window`].
    attend_window: Option<usize>,
    store: Box<dyn Store>,
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
}

pub struct LayerSpec {
    pub precision: Precision,
    pub retention: Retention,
    pub offload: bool,
    pub residual: usize,
    pub max_positions: usize,
    /// The window the model declares for this layer, which attention enforces per query row.
    pub attend_window: Option<usize>,
}

impl Layer {
    /// A layer whose rows live in host memory, read in place by the CPU's attention kernel
    /// (`tensors_on` None), or as tensors on a device, attended with candle ops (`Some`: a GPU, or
    /// the CPU running the GPU's path); with `offload`, rows on a device live in host memory
    /// instead and are staged to the device for each step.
    pub fn new(spec: &LayerSpec, nkv: usize, hd: usize, tensors_on: Option<&Device>) -> Self {
        let store_on = tensors_on.filter(|_| !spec.offload).cloned();
        let store = new_store(spec.precision, nkv, hd, store_on.as_ref());
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
            nkv,
            hd,
            precision: spec.precision,
            retention: spec.retention,
            max_positions: spec.max_positions,
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
            _ => p,
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
        let mut p = a;
        while p < c {
            let (src, slot, room) = if p >= res_lo {
                let r = self.residual.as_ref().expect("res_lo is set").r;
                (Source::Residual, p % r, r - p % r)
            } else if p >= pend {
                let seq = self.pending.as_ref().expect("pend is set").seq;
                (Source::Pending, p - seq, res_lo - p)
            } else {
                let (slot, room) = self.slot_run(p);
                (Source::Main, slot, room.min(res_lo.min(pend) - p))
            };
            let len = room.min(c - p);
            out.push((src, slot, len));
            p += len;
        }
        out
    }

    fn source(&self, s: Source) -> &dyn Store {
        match s {
            Source::Main => self.store.as_ref(),
            Source::Pending => self.pending.as_ref().expect("a pending run").store.as_ref(),
            Source::Residual => self
                .residual
                .as_ref()
                .expect("a residual run")
                .store
                .as_ref(),
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
        let need = match self.retention {
            Retention::Window { window, sinks } => e.min(sinks + window),
            _ => e,
        };
        if need > self.store.capacity() {
            let cap = need
                .next_power_of_two()
                .max(MIN_CAPACITY)
                .min(match self.retention {
                    Retention::Window { window, sinks } => sinks + window,
                    _ => self.max_positions.max(need),
                });
            let keep = self.store.capacity().min(b);
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
        let first = b.max(e.saturating_sub(res.r));
        let mut p = first;
        while p < e {
            let len = (res.r - p % res.r).min(e - p);
            res.store.write(
                p % res.r,
                &k.narrow(2, p - b, len)?,
                &v.narrow(2, p - b, len)?,
            )?;
            p += len;
        }
        res.lo = if res.hi == b && res.lo < res.hi {
            res.lo.max(e.saturating_sub(res.r))
        } else {
            first
        };
        res.hi = e;
        Ok(())
    }

    /// The view of a step over positions `b..e`: sinks `0..sink_end` (pairing with query 1 when
    /// `dropped`), then `lo..e`.
    fn view(
        &self,
        sink_end: usize,
        lo: usize,
        b: usize,
        e: usize,
        dropped: bool,
    ) -> Result<KvView<'_>> {
        let ranges = [(0..sink_end, usize::from(dropped)), (lo..b, 0), (b..e, 0)];
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
        })
    }

    /// Why this layer cannot go back to `len` positions, if it cannot: a window that dropped
    /// position `len`, or a declared window whose next query would miss keys already dropped
    /// (it needs the `attend_window` positions before it). Changes nothing.
    pub fn truncate_refusal(&self, len: usize) -> Option<String> {
        if self.retention == Retention::None || len >= self.seen || len == 0 {
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

    /// Every held position's stored bytes, oldest first (`[nkv, held, row bytes]` each), and the
    /// residual's rows with the first position it holds.
    pub fn raw_state(&self) -> Result<RawState> {
        let (sinks, window) = self.held();
        let mut k = Vec::new();
        let mut v = Vec::new();
        // Main rows: every held position from the main store or pending, never the residual.
        for range in [sinks, window] {
            let mut p = range.start;
            while p < range.end {
                let (store, slot, len): (&dyn Store, usize, usize) = match &self.pending {
                    Some(pd) if p >= pd.seq => (pd.store.as_ref(), p - pd.seq, range.end - p),
                    _ => {
                        let (slot, room) = self.slot_run(p);
                        let stop = self.pending.as_ref().map_or(range.end, |pd| pd.seq.max(p));
                        (self.store.as_ref(), slot, room.min(stop.min(range.end) - p))
                    }
                };
                let (rk, rv) = store.raw(slot, len)?;
                k.push(rk);
                v.push(rv);
                p += len;
            }
        }
        let mut rk = Vec::new();
        let mut rv = Vec::new();
        let mut res_from = self.seen;
        if let Some(res) = &self.residual {
            res_from = res.lo;
            let mut p = res.lo;
            while p < res.hi {
                let len = (res.r - p % res.r).min(res.hi - p);
                let (a, b) = res.store.raw(p % res.r, len)?;
                rk.push(a);
                rv.push(b);
                p += len;
            }
        }
        Ok(RawState {
            k: interleave_heads(&k, self.nkv),
            v: interleave_heads(&v, self.nkv),
            residual_k: interleave_heads(&rk, self.nkv),
            residual_v: interleave_heads(&rv, self.nkv),
            residual_from: res_from,
        })
    }

    /// The stored bytes of positions `a..b` of a cache that keeps every position (the prefix
    /// store's blocks), `[nkv, b − a, row bytes]` each; the residual's f16 copies are not part of
    /// them.
    pub fn raw_range(&self, a: usize, b: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        if self.retention != Retention::All || self.pending.is_some() {
            bail!("only a cache that keeps every position gives rows by position");
        }
        if a > b || b > self.seen {
            bail!(
                "positions {a}..{b} are not held (the cache has seen {})",
                self.seen
            );
        }
        self.store.raw(a, b - a)
    }

    /// Puts back a state of `seen` positions from [`Layer::raw_state`] of a layer with these axes.
    pub fn restore_raw(&mut self, seen: usize, st: &RawState) -> Result<()> {
        self.reset();
        let (s, n) = self.shape();
        self.seen = seen;
        self.win_lo = seen.saturating_sub(n).max(s.min(seen));
        if self.retention == Retention::All && seen > self.max_positions {
            bail!(
                "{seen} saved positions do not fit a context of {}",
                self.max_positions
            );
        }
        let (sinks, window) = self.held();
        let held = sinks.len() + window.len();
        let row = self.precision.row_bytes(self.hd);
        if st.k.len() != self.nkv * held * row || st.v.len() != st.k.len() {
            self.reset();
            bail!(
                "the saved rows ({} bytes) are not the {held} positions of {} bytes this cache holds",
                st.k.len(),
                row
            );
        }
        let need = match self.retention {
            Retention::Window { window, sinks } => seen.min(sinks + window),
            _ => seen,
        };
        self.store.grow(
            need.max(1)
                .next_power_of_two()
                .max(MIN_CAPACITY)
                .min(match self.retention {
                    Retention::Window { window, sinks } => sinks + window,
                    _ => self.max_positions.max(need),
                }),
            0,
        )?;
        let nkv = self.nkv;
        // Rows i.. of each head, `per` bytes each: the saved bytes themselves when they are all.
        fn per_head(
            bytes: &[u8],
            (nkv, held, row): (usize, usize, usize),
            i: usize,
            per: usize,
        ) -> std::borrow::Cow<'_, [u8]> {
            if i == 0 && per == held * row {
                return std::borrow::Cow::Borrowed(&bytes[..nkv * per]);
            }
            let mut out = Vec::with_capacity(nkv * per);
            for h in 0..nkv {
                out.extend_from_slice(&bytes[h * held * row + i..][..per]);
            }
            std::borrow::Cow::Owned(out)
        }
        let dims = (nkv, held, row);
        let mut i = 0;
        for range in [sinks, window] {
            let mut p = range.start;
            while p < range.end {
                let (slot, room) = self.slot_run(p);
                let len = room.min(range.end - p);
                // Rows i..i + len of each head.
                let (k, v) = (
                    per_head(&st.k, dims, i * row, len * row),
                    per_head(&st.v, dims, i * row, len * row),
                );
                if let Err(e) = self.store.write_raw(slot, len, &k, &v) {
                    self.reset();
                    return Err(e);
                }
                i += len;
                p += len;
            }
        }
        // Float rows are checked on their bytes (decoding them all would cost more than the
        // restore); quantized ones decoded.
        let finite = raw_finite(self.precision, &st.k);
        let finite = finite.map(|k| k.and(raw_finite(self.precision, &st.v).unwrap_or(Ok(()))));
        match finite {
            Some(Ok(())) => {}
            Some(Err(what)) => {
                self.reset();
                bail!("the saved keys or values hold {what}");
            }
            None => self.check_finite(0, seen)?,
        }
        if let Some(res) = self.residual.as_mut() {
            let from = st.residual_from;
            let count = seen.saturating_sub(from);
            let rrow = 2 * self.hd;
            if from > seen || count > res.r || st.residual_k.len() != self.nkv * count * rrow {
                let r = res.r;
                self.reset();
                bail!("the saved residual does not fit this cache's {r} recent positions");
            }
            res.store.grow(res.r, 0)?;
            let mut j = 0;
            let mut p = from;
            while p < seen {
                let len = (res.r - p % res.r).min(seen - p);
                let take = |bytes: &[u8]| -> Vec<u8> {
                    (0..nkv)
                        .flat_map(|h| bytes[(h * count + j) * rrow..][..len * rrow].to_vec())
                        .collect()
                };
                let (k, v) = (take(&st.residual_k), take(&st.residual_v));
                res.store.write_raw(p % res.r, len, &k, &v)?;
                j += len;
                p += len;
            }
            (res.lo, res.hi) = (from, seen);
            self.check_finite(from, seen)?;
        }
        Ok(())
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
            self.store = new_store(self.precision, self.nkv, self.hd, self.store_on.as_ref());
        }
    }

    fn reset(&mut self) {
        self.seen = 0;
        self.win_lo = 0;
        self.pending = None;
        self.staged = None;
        if let Some(r) = self.residual.as_mut() {
            (r.lo, r.hi) = (0, 0);
        }
    }
}

/// Whether stored float rows are all finite, read from their bytes: `None` for a quantized
/// precision (whose rows must be decoded to tell).
fn raw_finite(p: Precision, bytes: &[u8]) -> Option<std::result::Result<(), &'static str>> {
    p.all_finite(bytes).map(|ok| {
        if ok {
            Ok(())
        } else {
            Err("NaN or infinite values")
        }
    })
}

/// Rows from several runs, each `[nkv, len_i, row]`, joined into `[nkv, Σ len_i, row]`.
fn interleave_heads(runs: &[Vec<u8>], nkv: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(runs.iter().map(Vec::len).sum());
    for h in 0..nkv {
        for r in runs {
            let per = r.len() / nkv;
            out.extend_from_slice(&r[h * per..(h + 1) * per]);
        }
    }
    out
}

/// A layer's stored bytes, as saved: every held position's rows, oldest first, and the residual's
/// (positions `residual_from..seen`), each `[nkv, positions, row bytes]`.
pub struct RawState {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    pub residual_k: Vec<u8>,
    pub residual_v: Vec<u8>,
    pub residual_from: usize,
}

impl LayerCache for Layer {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        self.commit()?;
        self.staged = self.staged.take().filter(|_| self.offload_to.is_some());
        let t = k.dim(2)?;
        if self.retention == Retention::None {
            // The step is the whole sequence, from position 0; nothing is kept after it.
            self.reset();
        }
        let b = self.seen;
        let e = b + t;
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
        let q_pos = b;
        let sink_q_pos = dropped.then_some(sink_end + (b - lo));
        Ok(Attend {
            view: self.view(sink_end, lo, b, e, dropped)?,
            q_pos,
            sink_q_pos,
        })
    }

    fn len(&self) -> usize {
        if self.retention == Retention::None {
            return 0;
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
        if self.offload_to.is_none() || self.staged.is_some() || self.retention == Retention::None {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::test_rope;
    use crate::model::kernels::attention::attend_view;

    const NKV: usize = 2;
    const HD: usize = 64;

    fn spec(precision: Precision, retention: Retention) -> LayerSpec {
        LayerSpec {
            precision,
            retention,
            offload: false,
            residual: 8,
            max_positions: 4096,
            attend_window: None,
        }
    }

    fn layer(precision: Precision, retention: Retention) -> Layer {
        Layer::new(&spec(precision, retention), NKV, HD, None)
    }

    /// Keys and values for positions `from..from + t`, the same for a position whatever the step.
    fn kv(from: usize, t: usize) -> (Tensor, Tensor) {
        let make = |salt: f32| {
            let xs: Vec<f32> = (0..NKV)
                .flat_map(|h| {
                    (from..from + t).flat_map(move |p| {
                        (0..HD).map(move |c| {
                            ((p * 131 + c * 17 + h * 7) as f32 * 0.618 + salt).sin()
                                * if c % 13 == 5 { 6.0 } else { 1.0 }
                        })
                    })
                })
                .collect();
            Tensor::from_vec(xs, (1, NKV, t, HD), &Device::Cpu).unwrap()
        };
        (make(0.0), make(1.7))
    }

    /// Attention of a fixed query for the step at positions `from..from + t`: the output's bits.
    fn step(c: &mut Layer, rope: &Rope, from: usize, t: usize) -> Vec<u32> {
        let (k, v) = kv(from, t);
        let att = c.append(&k, &v, rope).unwrap();
        let q = Tensor::ones((NKV, 2 * t, HD), candle_core::DType::F32, &Device::Cpu).unwrap();
        let rot = |pos: usize| {
            rope.apply(&q.reshape((1, NKV * 2, t, HD)).unwrap(), pos)
                .unwrap()
                .reshape((NKV, 2 * t, HD))
                .unwrap()
        };
        let q0 = rot(att.q_pos);
        let q1 = att.sink_q_pos.map(rot);
        let qs: Vec<&Tensor> = std::iter::once(&q0).chain(q1.as_ref()).collect();
        let out = attend_view(&qs, &att.view, t, 0.125).unwrap();
        let xs: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
        // As the decoder does before the layer's next step (a no-op but with offload).
        c.prefetch().unwrap();
        xs.iter().map(|x| x.to_bits()).collect()
    }

    /// The outputs of a run of steps of these sizes.
    fn run(c: &mut Layer, steps: &[usize]) -> Vec<Vec<u32>> {
        let rope = test_rope(4096, HD);
        let mut pos = c.seen;
        steps
            .iter()
            .map(|&t| {
                let o = step(c, &rope, pos, t);
                pos += t;
                o
            })
            .collect()
    }

    const STEPS: [usize; 6] = [5, 1, 17, 1, 1, 40];

    #[test]
    fn a_window_is_the_full_cache_bit_for_bit_until_it_drops_a_position() {
        for p in Precision::ALL {
            let mut full = layer(p, Retention::All);
            let mut win = layer(
                p,
                Retention::Window {
                    window: 61,
                    sinks: 4,
                },
            );
            assert!(run(&mut full, &STEPS) == run(&mut win, &STEPS), "{p:?}");
            assert_eq!((win.len(), win.seen()), (65, 65));
        }
    }

    /// The largest difference between two runs' outputs (bits as `step` gives them).
    fn max_diff(a: &[Vec<u32>], b: &[Vec<u32>]) -> f32 {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (f32::from_bits(*x) - f32::from_bits(*y)).abs())
            .fold(
                0.0,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            )
    }

    #[test]
    fn rows_kept_as_tensors_attend_as_the_cpu_kernel_reads_them_in_place() {
        // The GPU's path (rows as tensors, quantized with candle ops, attention by candle ops,
        // offloaded rows staged from host bytes) run on the CPU, against the CPU's path, for
        // every precision, retention and placement. (On the CPU both rotate quantized rows by
        // the fast transform; another device's matrix product is checked in `attention`.)
        let window = Retention::Window {
            window: 29,
            sinks: 3,
        };
        for p in Precision::ALL {
            for retention in [Retention::All, window, Retention::None] {
                for offload in [false, true] {
                    let s = LayerSpec {
                        offload,
                        ..spec(p, retention)
                    };
                    let mut host = Layer::new(&s, NKV, HD, None);
                    let mut tensors = Layer::new(&s, NKV, HD, Some(&Device::Cpu));
                    let (a, b) = (run(&mut host, &STEPS), run(&mut tensors, &STEPS));
                    // candle's matmuls against the kernel's sums: rounding apart.
                    let d = max_diff(&a, &b);
                    assert!(d < 1e-5, "{p:?} {retention:?} offload {offload}: {d}");
                    assert_eq!((host.len(), host.seen()), (tensors.len(), tensors.seen()));
                }
            }
        }
    }

    #[test]
    fn rows_kept_as_tensors_save_the_host_stores_bytes() {
        for p in Precision::ALL {
            let mut host = layer(p, Retention::All);
            let mut tensors = Layer::new(&spec(p, Retention::All), NKV, HD, Some(&Device::Cpu));
            run(&mut host, &STEPS);
            run(&mut tensors, &STEPS);
            let (a, b) = (host.raw_state().unwrap(), tensors.raw_state().unwrap());
            // The same rows encoded by the CPU codec and by candle ops: the same bytes, so a
            // state saved on a GPU restores on the CPU and back.
            assert!(a.k == b.k && a.v == b.v, "{p:?}: stored rows differ");
            assert!(a.residual_k == b.residual_k && a.residual_v == b.residual_v);
            assert_eq!(a.residual_from, b.residual_from);
        }
    }

    #[test]
    fn the_window_keeps_the_sinks_and_the_latest_positions() {
        let mut c = layer(
            Precision::F32,
            Retention::Window {
                window: 6,
                sinks: 2,
            },
        );
        run(&mut c, &[3, 1, 4, 2, 9, 1]);
        assert_eq!((c.seen(), c.len()), (20, 8));
        let held = |c: &Layer| {
            let (s, w) = c.held();
            s.chain(w).collect::<Vec<_>>()
        };
        assert_eq!(held(&c), [0, 1, 14, 15, 16, 17, 18, 19]);
        // What the slots hold is what those positions were given (keys rotated at their place).
        let rope = test_rope(4096, HD);
        let (k, v) = c.read_range(14, 20).unwrap();
        let (k_want, v_want) = kv(14, 6);
        let d = (v - v_want.squeeze(0).unwrap().unsqueeze(0).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(d, 0.0);
        let k_rot = rope.apply(&k_want, 14).unwrap();
        let d = (k - k_rot).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn once_positions_are_dropped_the_window_attends_as_streaming_llm_places_them() {
        // Sinks 0, 1 and the window 13..19, then position 19: in the cache's frame the sinks sit
        // at 0, 1, the window at 2..8 and the query at 8.
        let mut c = layer(
            Precision::F32,
            Retention::Window {
                window: 6,
                sinks: 2,
            },
        );
        run(&mut c, &[3, 1, 4, 2, 9]);
        let got = run(&mut c, &[1]).pop().unwrap();
        let rope = test_rope(4096, HD);
        let (ks, vs) = kv(0, 2);
        let (kw, vw) = kv(13, 7);
        let k = Tensor::cat(
            &[rope.apply(&ks, 0).unwrap(), rope.apply(&kw, 2).unwrap()],
            2,
        )
        .unwrap()
        .squeeze(0)
        .unwrap();
        let v = Tensor::cat(&[vs, vw], 2).unwrap().squeeze(0).unwrap();
        let q = Tensor::ones((1, NKV * 2, 1, HD), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = rope.apply(&q, 8).unwrap().reshape((NKV, 2, HD)).unwrap();
        let want = crate::model::kernels::attention::attend_candle_ops(&q, &k, &v, 1, 0.125)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (f32::from_bits(*g) - w).abs() < 1e-4,
                "{} vs {w}",
                f32::from_bits(*g)
            );
        }
    }

    #[test]
    fn truncating_inside_the_window_works_and_before_it_is_refused() {
        let mut c = layer(
            Precision::F16,
            Retention::Window {
                window: 6,
                sinks: 2,
            },
        );
        run(&mut c, &[4, 8]); // holds sinks 0,1 and 6..12
        c.truncate(9).unwrap();
        assert_eq!((c.seen(), c.len()), (9, 5));
        assert!(c.truncate(4).is_err(), "positions 2..6 were dropped");
        c.truncate(0).unwrap();
        assert_eq!((c.len(), c.seen()), (0, 0));
    }

    /// (A quantized cache cannot promise this: positions that had left its f16 residual before
    /// the truncation are read from their quantized rows afterwards.)
    #[test]
    fn a_truncated_cache_continues_as_if_the_dropped_positions_never_came() {
        for p in [Precision::F16, Precision::Bf16, Precision::F32] {
            let mut a = layer(p, Retention::All);
            run(&mut a, &[30, 1, 1]);
            a.truncate(30).unwrap();
            let mut b = layer(p, Retention::All);
            run(&mut b, &[30]);
            assert!(run(&mut a, &[1, 3]) == run(&mut b, &[1, 3]), "{p:?}");
        }
    }

    #[test]
    fn a_saved_and_restored_layer_continues_bit_for_bit_in_every_combination() {
        for p in Precision::ALL {
            for r in [
                Retention::All,
                Retention::Window {
                    window: 20,
                    sinks: 3,
                },
                Retention::Window {
                    window: 9,
                    sinks: 0,
                },
            ] {
                let mut a = layer(p, r);
                run(&mut a, &[25, 1, 1]);
                let st = a.raw_state().unwrap();
                let mut b = layer(p, r);
                b.restore_raw(a.seen(), &st).unwrap();
                assert_eq!(b.len(), a.len());
                assert_eq!(b.bytes_used(), a.bytes_used());
                assert!(
                    run(&mut a, &[1, 4, 1]) == run(&mut b, &[1, 4, 1]),
                    "{p:?} {r:?}"
                );
            }
        }
    }

    #[test]
    fn a_damaged_state_is_refused_and_leaves_the_layer_empty() {
        let mut a = layer(Precision::F16, Retention::All);
        run(&mut a, &[10]);
        let mut st = a.raw_state().unwrap();
        st.k.iter_mut().for_each(|b| *b = 0xff); // f16 NaN
        let mut b = layer(Precision::F16, Retention::All);
        let e = b.restore_raw(10, &st).unwrap_err();
        assert!(e.to_string().contains("NaN"), "{e}");
        assert_eq!(b.seen(), 0);
        let st = a.raw_state().unwrap();
        assert!(b.restore_raw(11, &st).is_err(), "one position short");
    }

    #[test]
    fn bytes_used_is_what_the_size_arithmetic_predicts() {
        use crate::kv::size::KvDims;
        let d = KvDims {
            layers: 1,
            kv_heads: NKV,
            head_dim: HD,
        };
        for p in Precision::ALL {
            for (r, steps) in [
                (Retention::All, &[40usize, 1][..]),
                (
                    Retention::Window {
                        window: 16,
                        sinks: 4,
                    },
                    &[40, 1][..],
                ),
            ] {
                let mut c = layer(p, r);
                run(&mut c, steps);
                let mode = crate::kv::CacheMode {
                    precision: p,
                    retention: r,
                    offload: false,
                    residual: 8,
                };
                assert_eq!(
                    c.bytes_used() as f64,
                    d.bytes_for_mode(&mode, c.seen()),
                    "{p:?} {r:?}"
                );
            }
        }
    }

    #[test]
    fn a_residual_larger_than_the_context_allocates_no_more_than_the_context() {
        let mut s = spec(Precision::Int8, Retention::All);
        (s.residual, s.max_positions) = (usize::MAX / 2, 64);
        let mut c = Layer::new(&s, NKV, HD, None);
        run(&mut c, &[10, 1]);
        // 256 main slots (the first allocation) and at most 64 f16 residual rows.
        assert!(
            c.bytes() <= 2 * NKV * (256 * 68 + 64 * 128),
            "{}",
            c.bytes()
        );
    }

    #[test]
    fn quantized_attention_stays_close_to_f32() {
        let mut exact = layer(Precision::F32, Retention::All);
        let a = run(&mut exact, &[200, 1]);
        for (p, tol) in [(Precision::Int8, 0.02), (Precision::Int4, 0.2)] {
            let mut q = layer(p, Retention::All);
            let b = run(&mut q, &[200, 1]);
            let (x, y) = (&a[1], &b[1]);
            let worst = x
                .iter()
                .zip(y)
                .map(|(x, y)| (f32::from_bits(*x) - f32::from_bits(*y)).abs())
                .fold(0f32, f32::max);
            assert!(worst < tol, "{p:?}: {worst}");
        }
    }
}
