//! Taking back a verified draft exactly. A verification forward attends each of its rows as a
//! step of its own (`DecoderCache::rows_apart`), so every row sees what a single step would; its
//! first row (the token already sampled) always stays, and the rows after it (the guesses) may be
//! taken back. While one may, the layer records what each of those rows changed: the oldest
//! window and residual positions held before it, and the rows its writes overwrote (a window's
//! ring slots, the residual's). Truncating back to one of them puts those back, so the layer is
//! what single steps up to there left, bit for bit; a budget's scores from the guesses wait in
//! `Budgeted::deferred` and are added once the guesses that stay are known.

use super::*;

/// A verification forward's record ([`Layer::verify_begins`]); it lasts until the next forward
/// begins.
#[derive(Default)]
pub(super) struct Undo {
    /// The first position that may be taken back: the verification's first row (only a failed
    /// forward takes it back; a verification's guesses start one later).
    pub(super) from: usize,
    /// Per row from `from` on, oldest first: (its position, the oldest window position held
    /// before it was appended, the oldest residual position held then).
    rows: Vec<(usize, usize, Option<usize>)>,
    /// What the rows' writes overwrote, oldest first.
    overwritten: Vec<Overwritten>,
}

/// Rows of a store that a write of position `pos` overwrote: their slots and stored bytes.
struct Overwritten {
    pos: usize,
    source: Source,
    slot: usize,
    len: usize,
    k: Vec<u8>,
    v: Vec<u8>,
}

impl Layer {
    /// A verification forward begins: each of its rows is a step of its own, and the rows after
    /// the first may be taken back ([`LayerCache::truncate`]) until the next forward begins.
    pub fn verify_begins(&mut self) -> Result<()> {
        let from = self.seen + 1;
        self.settle()?;
        // Recorded from the first row on, so that a forward that fails part-way goes back whole
        // (a budget's eviction on the first row is not undone: `truncate_refusal` says so).
        self.undo = Some(Undo {
            from: self.seen,
            ..Undo::default()
        });
        if let Some(bg) = self.budget.as_mut() {
            // Every row ends a step of its own (an eviction falls due only on the first: the
            // session keeps guesses within `Layer::draft_room`); the guesses' scores wait.
            bg.forward_end = Some(from);
            bg.defer_from = Some(from);
        }
        Ok(())
    }

    /// Before the row at position `b` is appended: what taking it back restores.
    pub(super) fn note_row(&mut self, b: usize) {
        let res_lo = self.residual.as_ref().map(|r| r.lo);
        let win_lo = self.win_lo;
        if let Some(u) = self.undo.as_mut().filter(|u| b >= u.from) {
            u.rows.push((b, win_lo, res_lo));
        }
    }

    /// Before a write of position `pos` over slots `slot..slot + len` of `source`: the rows there.
    pub(super) fn note_overwrite(
        &mut self,
        pos: usize,
        source: Source,
        slot: usize,
        len: usize,
    ) -> Result<()> {
        // A full cache's slots past the sequence hold nothing a truncation needs back.
        let nothing_there = source == Source::Main && self.retention == Retention::All;
        if nothing_there || self.undo.as_ref().is_none_or(|u| pos < u.from) {
            return Ok(());
        }
        let (k, v) = self.source(source).raw(slot, len)?;
        let u = self.undo.as_mut().expect("checked");
        u.overwritten.push(Overwritten {
            pos,
            source,
            slot,
            len,
            k,
            v,
        });
        Ok(())
    }

    /// Whether a truncation back to `len` is one the record undoes.
    pub(super) fn can_take_back(&self, len: usize) -> bool {
        self.undo.as_ref().is_some_and(|u| len >= u.from)
    }

    /// Puts back what the rows from `len` on changed (when the record covers `len`): the rows they
    /// overwrote, newest first, and the oldest positions held before them.
    pub(super) fn take_back(&mut self, len: usize) -> Result<()> {
        let Some(mut u) = self.undo.take() else {
            return Ok(());
        };
        if len >= u.from {
            while u.overwritten.last().is_some_and(|o| o.pos >= len) {
                let o = u.overwritten.pop().expect("checked");
                let store = match o.source {
                    Source::Main => self.store.as_mut(),
                    Source::Residual => self.residual.as_mut().expect("a residual").store.as_mut(),
                    Source::Pending => unreachable!("pending rows are never overwritten"),
                    Source::Shared(_) => unreachable!("shared rows are never written"),
                };
                store.write_raw(o.slot, o.len, &o.k, &o.v)?;
            }
            if let Some(&(_, win_lo, res_lo)) = u.rows.iter().find(|r| r.0 == len) {
                self.win_lo = win_lo;
                if let (Some(r), Some(lo)) = (self.residual.as_mut(), res_lo) {
                    r.lo = lo;
                }
            }
            u.rows.retain(|r| r.0 < len);
        }
        self.undo = Some(u);
        Ok(())
    }

    /// The most guesses a verification may take after its first row: a budget must not fall due
    /// for an eviction on a guess (it could not be taken back). Unbounded without a budget.
    pub fn draft_room(&self) -> usize {
        let Some(bg) = &self.budget else {
            return usize::MAX;
        };
        let cap = bg.budget + SLACK;
        let mut after_first = bg.held() + 1;
        if after_first > cap {
            // The first row's eviction: at most the budget stays (or what is always kept).
            after_first = bg.budget.max(bg.sinks + bg.recent + 1);
        }
        cap.saturating_sub(after_first)
    }
}
