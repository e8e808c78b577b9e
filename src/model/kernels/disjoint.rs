//! The one place kernels write into shared output from several threads.
//!
//! A kernel splits its output into regions that no two work items share (rows of a matrix, a
//! tile's rows, one partial per (row, chunk)), runs the items on candle's thread pool, and each
//! item writes its own regions through a [`DisjointOut`]. Rust cannot see that the regions are
//! disjoint, so the writes are `unsafe`; this module holds the raw pointer and states the contract
//! once:
//!
//! SAFETY CONTRACT: while a `DisjointOut` is shared between threads, every index is written by at
//! most one work item, and nothing reads an index that another item may still write. The output
//! buffer is borrowed mutably for the `DisjointOut`'s lifetime, so no other access exists; bounds
//! are checked on every call.

use std::marker::PhantomData;

pub struct DisjointOut<'a, T> {
    ptr: *mut T,
    len: usize,
    _out: PhantomData<&'a mut [T]>,
}

// SAFETY: see the module's contract; `T: Send` because values cross threads.
unsafe impl<T: Send> Sync for DisjointOut<'_, T> {}
unsafe impl<T: Send> Send for DisjointOut<'_, T> {}

impl<'a, T> DisjointOut<'a, T> {
    pub fn new(out: &'a mut [T]) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _out: PhantomData,
        }
    }

    /// The `len` elements from `start`.
    ///
    /// # Safety
    /// The module's contract: no other work item touches `start..start + len` while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(
            start <= self.len && len <= self.len - start,
            "disjoint output: {start}+{len} out of {}",
            self.len
        );
        // SAFETY: in bounds (checked above); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// Fills `out`, rows of `width`, by `row(r, out_row)`: on candle's pool, `rows_per_item` rows to
/// a work item, once `out` holds `parallel_from` elements or more; below that on this thread
/// (a decode step's row). Each row is written by one item alone, so this states the contract
/// for every row-wise kernel (RMSNorm, the gated FFN activation, activation quantizing).
pub fn for_each_row<T: Send>(
    out: &mut [T],
    width: usize,
    rows_per_item: usize,
    parallel_from: usize,
    row: impl Fn(usize, &mut [T]) + Sync,
) {
    if width == 0 {
        return;
    }
    let rows = out.len() / width;
    if out.len() < parallel_from {
        for (r, o) in out.chunks_exact_mut(width).enumerate() {
            row(r, o);
        }
        return;
    }
    let dst = DisjointOut::new(out);
    candle_core::utils::barrier_pool().execute_chunked(rows.div_ceil(rows_per_item), |items| {
        for item in items {
            for r in item * rows_per_item..rows.min((item + 1) * rows_per_item) {
                // SAFETY (the module's contract): row r belongs to this item alone.
                row(r, unsafe { dst.slice(r * width, width) });
            }
        }
    });
}

/// As [`for_each_row`] over two outputs at once: row r of `a` (rows of `wa`) and row r of `b`
/// (rows of `wb`) go to the same work item, one row a item, on candle's pool once there are
/// `parallel_from` rows or more (a recurrent layer's heads: each item updates its head's state
/// and writes its head's output).
pub fn for_each_row_pair<A: Send, B: Send>(
    a: &mut [A],
    wa: usize,
    b: &mut [B],
    wb: usize,
    parallel_from: usize,
    row: impl Fn(usize, &mut [A], &mut [B]) + Sync,
) {
    if wa == 0 || wb == 0 {
        return;
    }
    let rows = (a.len() / wa).min(b.len() / wb);
    if rows < parallel_from {
        for (r, (x, y)) in a
            .chunks_exact_mut(wa)
            .zip(b.chunks_exact_mut(wb))
            .enumerate()
        {
            row(r, x, y);
        }
        return;
    }
    let (da, db) = (DisjointOut::new(a), DisjointOut::new(b));
    candle_core::utils::barrier_pool().execute_chunked(rows, |items| {
        for r in items {
            // SAFETY (the module's contract): row r of each output belongs to this item alone.
            let (x, y) = unsafe { (da.slice(r * wa, wa), db.slice(r * wb, wb)) };
            row(r, x, y);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_writing_their_own_rows_fill_the_whole_output() {
        let mut out = vec![0u32; 64 * 8];
        let d = DisjointOut::new(&mut out);
        candle_core::utils::barrier_pool().execute_chunked(64, |range| {
            for row in range {
                // SAFETY: row `row` belongs to this item alone.
                let r = unsafe { d.slice(row * 8, 8) };
                r.iter_mut()
                    .enumerate()
                    .for_each(|(j, x)| *x = (row * 8 + j) as u32);
            }
        });
        assert!(out.iter().enumerate().all(|(i, &x)| x == i as u32));
    }

    #[test]
    fn row_pairs_are_filled_alike_on_the_pool_and_on_one_thread() {
        let fill = |parallel_from: usize| {
            let (mut a, mut b) = (vec![0u32; 16 * 3], vec![0u64; 16 * 5]);
            for_each_row_pair(&mut a, 3, &mut b, 5, parallel_from, |r, x, y| {
                x.iter_mut().for_each(|v| *v = r as u32);
                y.iter_mut().for_each(|v| *v = 2 * r as u64);
            });
            (a, b)
        };
        let (a, b) = fill(1);
        assert_eq!((a.clone(), b.clone()), fill(usize::MAX));
        assert_eq!((a[47], b[79]), (15, 30));
    }

    #[test]
    #[should_panic(expected = "out of")]
    fn a_region_past_the_end_is_refused() {
        let mut out = vec![0u8; 4];
        let d = DisjointOut::new(&mut out);
        // SAFETY: single-threaded here.
        let _ = unsafe { d.slice(2, 3) };
    }
}
