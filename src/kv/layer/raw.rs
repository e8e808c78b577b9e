//! A layer's stored bytes, saved and put back: what `--prompt-cache`, the prefix store and a
//! chat's save use (no conversion: the rows in the cache's own format, checked when restored).

use super::*;

impl Layer {
    /// Every held position's stored bytes, oldest first (`[nkv, held, row bytes]` each), and the
    /// residual's rows with the first position it holds.
    pub fn raw_state(&self) -> Result<RawState> {
        if !self.shared.is_empty() {
            bail!("a cache whose first positions are shared with other sequences is not saved");
        }
        if let Some(bg) = self.budget.as_ref().filter(|b| b.evicted_before > 0) {
            bail!(
                "a KV budget that has evicted positions cannot be saved yet (it evicted {} positions before {})",
                bg.dropped,
                bg.evicted_before
            );
        }
        let (sinks, window) = self.held();
        let mut k = Vec::new();
        let mut v = Vec::new();
        // Main rows: every held position from the main store or pending, never the residual.
        for range in [sinks, window] {
            let mut p = range.start;
            while p < range.end {
                let (store, slot, len): (&dyn RowStore, usize, usize) = match &self.pending {
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
        let every = match self.retention {
            Retention::All => true,
            Retention::Budget { .. } => self.by_position(),
            _ => false,
        };
        if !every || self.pending.is_some() {
            bail!("only a cache that keeps every position gives rows by position");
        }
        if a > b || b > self.seen {
            bail!(
                "positions {a}..{b} are not held (the cache has seen {})",
                self.seen
            );
        }
        if self.shared.is_empty() {
            return self.store.raw(a, b - a);
        }
        // Shared blocks, then the main store: each run's rows, joined head by head.
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (src, slot, len) in self.runs(a, b) {
            let (rk, rv) = self.source(src).raw(slot, len)?;
            k.push(rk);
            v.push(rv);
        }
        Ok((
            interleave_heads(&k, self.nkv),
            interleave_heads(&v, self.nkv),
        ))
    }

    /// Puts back a state of `seen` positions from [`Layer::raw_state`] of a layer with these axes.
    pub fn restore_raw(&mut self, seen: usize, st: &RawState) -> Result<()> {
        self.reset();
        let (s, n) = self.shape();
        self.seen = seen;
        if let Some(bg) = self.budget.as_mut() {
            bg.hold_all(seen);
        }
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
        // The capacity writing these positions grows to (a restored store has no shared blocks).
        let cap = main_capacity(self.retention, need, self.max_positions, self.grow_by);
        self.store.grow(cap, 0)?;
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
