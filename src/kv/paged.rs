//! A layer's own rows in fixed-size pages: the server's paged pool (`kvchat serve`, issue 39).
//!
//! Slot s lives in page `s / page` at slot `s % page` of it; the list of pages is the layer's
//! page table. Growing appends pages and leaves every stored row where it is (a contiguous store
//! grows by allocating the larger buffer and copying every row into it). Every page is `page`
//! slots but the last, which is shorter only where the capacity asked for is not a multiple of
//! `page`: a context or a window's ring that ends inside a page (never grown past), or a budget's
//! exact sizes, where growing past it later completes that one page first, copying its fewer
//! than `page` rows.
//!
//! Attention reads a page as one part of its view ([`RowStore::contiguous`] tells the layer
//! where a page ends, so no run crosses one); the kernel's sums do not depend on how a view is
//! cut into parts, so paged rows give the bits contiguous rows give.
//!
//! Pages are host stores of the layer's precision: every precision applies to the pool.

use super::rows::{new_store, retain_by_copy, RowStore};
use crate::model::cache::{Part, Precision, QueryRotation};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub struct Paged {
    precision: Precision,
    nkv: usize,
    hd: usize,
    /// Slots per page.
    page: usize,
    /// The page table: page i holds slots `i·page..`.
    pages: Vec<Box<dyn RowStore>>,
    cap: usize,
}

impl Paged {
    pub fn new(precision: Precision, nkv: usize, hd: usize, page: usize) -> Self {
        Self {
            precision,
            nkv,
            hd,
            page: page.max(1),
            pages: Vec::new(),
            cap: 0,
        }
    }

    /// Pages in the page table.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Slots `slot..slot + len` are allocated.
    fn check_range(&self, slot: usize, len: usize) -> Result<()> {
        if slot.checked_add(len).is_none_or(|e| e > self.cap) {
            bail!(
                "KV slots {slot}..{} are outside the {} allocated",
                slot.saturating_add(len),
                self.cap
            );
        }
        Ok(())
    }

    /// Slots `slot..slot + len` as (page, slot in it, length) pieces, in order.
    fn pieces(&self, slot: usize, len: usize) -> Result<Vec<(usize, usize, usize)>> {
        self.check_range(slot, len)?;
        let mut out = Vec::new();
        let mut s = slot;
        while s < slot + len {
            let n = (self.page - s % self.page).min(slot + len - s);
            out.push((s / self.page, s % self.page, n));
            s += n;
        }
        Ok(out)
    }

    /// Bytes per head of `len` stored rows of this precision.
    fn head_bytes(&self, len: usize) -> usize {
        len * self.precision.row_bytes(self.hd)
    }
}

impl RowStore for Paged {
    fn precision(&self) -> Precision {
        self.precision
    }

    fn capacity(&self) -> usize {
        self.cap
    }

    fn contiguous(&self, slot: usize) -> usize {
        self.page - slot % self.page
    }

    /// Completes a short last page (copying its rows, fewer than a page), then appends pages:
    /// the rows of full pages stay where they are (`keep` is always all of them).
    fn grow(&mut self, cap: usize, _keep: usize) -> Result<()> {
        while self.cap < cap {
            let in_last = self.cap % self.page;
            if in_last > 0 {
                // The short last page, completed (a copy of its fewer than `page` rows).
                let to = (in_last + cap - self.cap).min(self.page);
                self.pages
                    .last_mut()
                    .expect("a short page")
                    .grow(to, in_last)?;
                self.cap += to - in_last;
            } else {
                let len = (cap - self.cap).min(self.page);
                let mut page = new_store(self.precision, self.nkv, self.hd, None);
                page.grow(len, 0)?;
                self.pages.push(page);
                self.cap += len;
            }
        }
        Ok(())
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let mut at = 0;
        for (i, s, n) in self.pieces(slot, k.dim(2)?)? {
            self.pages[i].write(s, &k.narrow(2, at, n)?, &v.narrow(2, at, n)?)?;
            at += n;
        }
        Ok(())
    }

    /// One page's slots (attention reads a part a page, every step: no list of pieces made).
    fn part(&self, slot: usize, len: usize, query: QueryRotation) -> Result<Part<'_>> {
        self.check_range(slot, len)?;
        if len > self.contiguous(slot) {
            bail!(
                "KV slots {slot}..{} cross a page of {} (one part is one page at most)",
                slot + len,
                self.page
            );
        }
        // An empty part is any page's (as before b8548c3: at the end of the last full page no
        // page holds its slot).
        let (page, at) = if len == 0 {
            (0, 0)
        } else {
            (slot / self.page, slot % self.page)
        };
        match self.pages.get(page) {
            Some(p) => p.part(at, len, query),
            None => bail!("KV slots {slot}..{slot} of an empty paged store"),
        }
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (i, s, n) in self.pieces(slot, len)? {
            let (k, v) = self.pages[i].read(s, n)?;
            ks.push(k);
            vs.push(v);
        }
        if ks.is_empty() {
            let none = Tensor::zeros((1, self.nkv, 0, self.hd), DType::F32, &Device::Cpu)?;
            return Ok((none.clone(), none));
        }
        Ok((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?))
    }

    /// `[n_kv_heads, len, row bytes]` each, as a contiguous store lays them out: each head's rows
    /// gathered from the pages in order.
    fn raw(&self, slot: usize, len: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let pieces = self.pieces(slot, len)?;
        let (ks, vs): (Vec<Vec<u8>>, Vec<Vec<u8>>) = pieces
            .iter()
            .map(|&(i, s, n)| self.pages[i].raw(s, n))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let gather = |raws: &[Vec<u8>]| {
            let mut out = Vec::with_capacity(self.nkv * self.head_bytes(len));
            for h in 0..self.nkv {
                for (raw, &(_, _, n)) in raws.iter().zip(&pieces) {
                    let b = self.head_bytes(n);
                    out.extend_from_slice(&raw[h * b..(h + 1) * b]);
                }
            }
            out
        };
        Ok((gather(&ks), gather(&vs)))
    }

    fn write_raw(&mut self, slot: usize, len: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let per_head = self.head_bytes(len);
        if k.len() != self.nkv * per_head || v.len() != k.len() {
            bail!(
                "saved rows of {} bytes do not fit {len} positions of this cache",
                k.len()
            );
        }
        let mut before = 0;
        for (i, s, n) in self.pieces(slot, len)? {
            let b = self.head_bytes(n);
            let scatter = |src: &[u8]| -> Vec<u8> {
                (0..self.nkv)
                    .flat_map(|h| &src[h * per_head + before..][..b])
                    .copied()
                    .collect()
            };
            let (pk, pv) = (scatter(k), scatter(v));
            self.pages[i].write_raw(s, n, &pk, &pv)?;
            before += b;
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.pages.iter().map(|p| p.bytes()).sum()
    }

    /// Compacts what is kept into the first slots, then gives back the pages past `cap` (at
    /// least what is kept).
    fn retain(&mut self, keep: &[Vec<usize>], cap: usize) -> Result<()> {
        retain_by_copy(self, keep)?;
        let kept = keep.first().map_or(0, Vec::len);
        let pages = cap.max(kept).div_ceil(self.page);
        if pages < self.pages.len() {
            self.pages.truncate(pages);
            self.cap = self.pages.iter().map(|p| p.capacity()).sum();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cache::Rows;

    const NKV: usize = 2;
    const HD: usize = 64;

    /// Rows `[1, NKV, t, HD]` whose values name their position, head and element.
    fn rows(from: usize, t: usize, salt: f32) -> Tensor {
        let xs: Vec<f32> = (0..NKV * t * HD)
            .map(|i| {
                let (h, r, d) = (i / (t * HD), i / HD % t, i % HD);
                ((from + r) as f32 * 0.37 + h as f32 * 1.3 + d as f32 * 0.011 + salt).sin()
            })
            .collect();
        Tensor::from_vec(xs, (1, NKV, t, HD), &Device::Cpu).unwrap()
    }

    /// The first key element's address in host memory of slots `slot..slot + len`.
    fn address(store: &dyn RowStore, slot: usize, len: usize) -> usize {
        match store
            .part(slot, len, QueryRotation::AtPosition)
            .unwrap()
            .rows
        {
            Rows::F32(r) => r.k.as_ptr() as usize,
            _ => panic!("an f32 store"),
        }
    }

    /// A contiguous store and a paged one with `t` positions written in steps of `step`.
    fn both(p: Precision, t: usize, step: usize) -> (Box<dyn RowStore>, Paged) {
        let mut flat = new_store(p, NKV, HD, None);
        let mut paged = Paged::new(p, NKV, HD, 64);
        for b in (0..t).step_by(step) {
            let n = step.min(t - b);
            for s in [flat.as_mut(), &mut paged as &mut dyn RowStore] {
                s.grow((b + n).next_multiple_of(64), b).unwrap();
                s.write(b, &rows(b, n, 0.0), &rows(b, n, 0.5)).unwrap();
            }
        }
        (flat, paged)
    }

    #[test]
    fn growing_appends_pages_and_leaves_stored_rows_where_they_are() {
        let mut s = Paged::new(Precision::F32, NKV, HD, 64);
        s.grow(64, 0).unwrap();
        s.write(0, &rows(0, 40, 0.0), &rows(0, 40, 0.5)).unwrap();
        let first = address(&s, 0, 40);
        s.grow(1000, 40).unwrap();
        assert_eq!((s.pages(), s.capacity()), (16, 1000));
        assert_eq!(address(&s, 0, 40), first);
        let (k, _) = s.read(0, 40).unwrap();
        assert_eq!(
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            rows(0, 40, 0.0)
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        );
    }

    #[test]
    fn a_short_last_page_is_completed_before_another_is_added() {
        let mut s = Paged::new(Precision::F16, NKV, HD, 64);
        s.grow(100, 0).unwrap();
        assert_eq!((s.pages(), s.capacity()), (2, 100));
        s.write(64, &rows(64, 36, 0.0), &rows(64, 36, 0.5)).unwrap();
        s.grow(150, 100).unwrap();
        assert_eq!((s.pages(), s.capacity()), (3, 150));
        let (flat, _) = both(Precision::F16, 100, 100);
        assert_eq!(s.raw(64, 36).unwrap(), flat.raw(64, 36).unwrap());
    }

    #[test]
    fn paged_rows_read_and_save_as_contiguous_ones_in_every_precision() {
        for p in [
            Precision::F32,
            Precision::F16,
            Precision::Int8,
            Precision::Int4,
        ] {
            let (flat, paged) = both(p, 300, 37);
            assert_eq!(paged.bytes(), flat.bytes(), "{p:?}");
            for (a, n) in [(0, 300), (60, 10), (64, 64), (100, 150)] {
                assert_eq!(
                    paged.raw(a, n).unwrap(),
                    flat.raw(a, n).unwrap(),
                    "{p:?} {a}+{n}"
                );
                let (fk, fv) = flat.read(a, n).unwrap();
                let (pk, pv) = paged.read(a, n).unwrap();
                for (x, y) in [(fk, pk), (fv, pv)] {
                    let d = (x - y).unwrap().abs().unwrap().max_all().unwrap();
                    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{p:?} {a}+{n}");
                }
            }
        }
    }

    #[test]
    fn saved_rows_put_back_across_pages_read_as_saved() {
        let (flat, _) = both(Precision::Int8, 200, 200);
        let mut s = Paged::new(Precision::Int8, NKV, HD, 64);
        s.grow(200, 0).unwrap();
        let (k, v) = flat.raw(10, 150).unwrap();
        s.write_raw(10, 150, &k, &v).unwrap();
        assert_eq!(s.raw(10, 150).unwrap(), (k, v));
    }

    #[test]
    fn a_part_is_one_page_and_a_run_across_pages_is_refused() {
        let (_, s) = both(Precision::F32, 200, 200);
        assert_eq!(s.contiguous(70), 58);
        assert_eq!(
            s.part(64, 64, QueryRotation::AtPosition)
                .unwrap()
                .rows
                .len(),
            64
        );
        let err = s.part(60, 10, QueryRotation::AtPosition).err().unwrap();
        assert!(err.to_string().contains("cross a page of 64"), "{err}");
        let err = s.read(250, 20).err().unwrap();
        assert!(
            err.to_string().contains("outside the 256 allocated"),
            "{err}"
        );
    }

    #[test]
    fn an_empty_part_at_the_end_of_the_last_full_page_is_empty_not_an_error() {
        let (_, s) = both(Precision::F32, 200, 200);
        let part = s.part(256, 0, QueryRotation::AtPosition).unwrap();
        assert_eq!(part.rows.len(), 0);
    }

    #[test]
    fn retaining_compacts_the_kept_rows_and_gives_back_pages_past_the_cap() {
        let (flat, mut s) = both(Precision::F16, 256, 256);
        let keep: Vec<Vec<usize>> = (0..NKV).map(|h| (h..200).step_by(3).collect()).collect();
        s.retain(&keep, 80).unwrap();
        assert_eq!((s.pages(), s.capacity()), (2, 128));
        let row = Precision::F16.row_bytes(HD);
        let (k, _) = s.raw(0, keep[0].len()).unwrap();
        let (fk, _) = flat.raw(0, 256).unwrap();
        for (h, slots) in keep.iter().enumerate() {
            for (i, &slot) in slots.iter().enumerate() {
                let at = (h * keep[0].len() + i) * row;
                assert_eq!(k[at..at + row], fk[(h * 256 + slot) * row..][..row]);
            }
        }
    }
}
