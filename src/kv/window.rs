//! `--kv-window N --kv-sinks S`: the first S positions ("attention sinks", StreamingLLM, arXiv
//! 2309.17453) and the most recent N, so memory is bounded by S + N however long the sequence runs.
//!
//! Keys are stored *before* RoPE and rotated at attention time by their place inside the cache
//! (sinks at 0..S, the window after them), so the positions the model sees never exceed S + 2N even
//! past its trained context. Storage: sinks `[1, nkv, S, hd]` and a ring `[1, nkv, N, hd]` for keys
//! and values each. A step appends at most N positions; its queries see the sinks, the window as it
//! was before the step, and the step's own earlier positions.

use super::{Attend, KvView, LayerCache};
use crate::model::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

pub struct WindowCache {
    n_kv_heads: usize,
    head_dim: usize,
    window: usize,
    sinks: usize,
    dtype: DType,
    device: Device,
    /// (keys, values) of the sinks, `[1, nkv, S, hd]`, keys not rotated; allocated on first use.
    sink_buf: Option<(Tensor, Tensor)>,
    /// (keys, values) ring, `[1, nkv, N, hd]`, keys not rotated.
    ring: Option<(Tensor, Tensor)>,
    sink_len: usize,
    /// Ring slot of the oldest window position.
    head: usize,
    win_len: usize,
    /// Positions of the sequence appended so far.
    seen: usize,
}

impl WindowCache {
    pub fn new(
        n_kv_heads: usize,
        head_dim: usize,
        window: usize,
        sinks: usize,
        dtype: DType,
        device: Device,
    ) -> Self {
        Self {
            n_kv_heads,
            head_dim,
            window,
            sinks,
            dtype,
            device,
            sink_buf: None,
            ring: None,
            sink_len: 0,
            head: 0,
            win_len: 0,
            seen: 0,
        }
    }

    fn alloc(&mut self) -> Result<()> {
        if self.ring.is_none() {
            let z = |n: usize| {
                Tensor::zeros(
                    (1, self.n_kv_heads, n, self.head_dim),
                    self.dtype,
                    &self.device,
                )
            };
            if self.sinks > 0 {
                self.sink_buf = Some((z(self.sinks)?, z(self.sinks)?));
            }
            self.ring = Some((z(self.window)?, z(self.window)?));
        }
        Ok(())
    }

    /// The window's positions oldest first, as up to two ring segments (start slot, length).
    fn segments(&self) -> Vec<(usize, usize)> {
        let first = self.win_len.min(self.window - self.head);
        let mut segs = vec![(self.head, first)];
        if self.win_len > first {
            segs.push((0, self.win_len - first));
        }
        segs.retain(|s| s.1 > 0);
        segs
    }

    /// Keys (unrotated) and values held, oldest first, plus `extra` appended: `[1, nkv, n, hd]`.
    fn ordered(&self, extra: Option<(&Tensor, &Tensor)>) -> Result<Option<(Tensor, Tensor)>> {
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        if let Some((sk, sv)) = &self.sink_buf {
            if self.sink_len > 0 {
                ks.push(sk.narrow(2, 0, self.sink_len)?);
                vs.push(sv.narrow(2, 0, self.sink_len)?);
            }
        }
        if let Some((rk, rv)) = &self.ring {
            for (start, len) in self.segments() {
                ks.push(rk.narrow(2, start, len)?);
                vs.push(rv.narrow(2, start, len)?);
            }
        }
        if let Some((k, v)) = extra {
            if k.dim(2)? > 0 {
                ks.push(k.clone());
                vs.push(v.clone());
            }
        }
        if ks.is_empty() {
            return Ok(None);
        }
        Ok(Some((Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?)))
    }

    /// Writes `k`, `v` ([1, nkv, n, hd], n ≤ N) at the window's end, dropping the oldest as needed.
    fn push_window(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(2)?;
        let (rk, rv) = self.ring.as_ref().expect("allocated");
        let mut written = 0;
        while written < n {
            let slot = (self.head + self.win_len) % self.window;
            let len = (n - written).min(self.window - slot);
            rk.slice_set(&k.narrow(2, written, len)?.contiguous()?, 2, slot)?;
            rv.slice_set(&v.narrow(2, written, len)?.contiguous()?, 2, slot)?;
            written += len;
            if self.win_len + len <= self.window {
                self.win_len += len;
            } else {
                // The oldest positions were overwritten.
                let dropped = self.win_len + len - self.window;
                self.head = (self.head + dropped) % self.window;
                self.win_len = self.window;
            }
        }
        Ok(())
    }
}

impl LayerCache for WindowCache {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        let t = k.dim(2)?;
        if t > self.window {
            bail!(
                "a step of {t} positions is wider than the window of {}",
                self.window
            );
        }
        self.alloc()?;
        let k = k.to_dtype(self.dtype)?;
        let v = v.to_dtype(self.dtype)?.contiguous()?;
        // The first S positions of the sequence become the sinks.
        let to_sinks = if self.seen == self.sink_len {
            (self.sinks - self.sink_len).min(t)
        } else {
            0
        };
        if to_sinks > 0 {
            let (sk, sv) = self.sink_buf.as_ref().expect("allocated");
            sk.slice_set(&k.narrow(2, 0, to_sinks)?.contiguous()?, 2, self.sink_len)?;
            sv.slice_set(&v.narrow(2, 0, to_sinks)?.contiguous()?, 2, self.sink_len)?;
            self.sink_len += to_sinks;
        }
        let new_k = k.narrow(2, to_sinks, t - to_sinks)?;
        let new_v = v.narrow(2, to_sinks, t - to_sinks)?;
        // Attend over sinks + window before this step + this step's window positions, in order.
        let (all_k, all_v) = self
            .ordered(Some((&new_k, &new_v)))?
            .expect("at least this step's positions");
        let held = all_k.dim(2)?;
        let all_k = rope.apply(&all_k.to_dtype(DType::F32)?, 0)?; // rotated by place in the cache
        let all_v = all_v.to_dtype(DType::F32)?;
        if t > to_sinks {
            self.push_window(&new_k, &new_v)?;
        }
        self.seen += t;
        Ok(Attend {
            view: KvView::Dense { k: all_k, v: all_v },
            q_pos: held - t,
        })
    }

    fn len(&self) -> usize {
        self.sink_len + self.win_len
    }

    fn seen(&self) -> usize {
        self.seen
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.seen {
            return Ok(());
        }
        if len == 0 {
            (self.sink_len, self.win_len, self.head, self.seen) = (0, 0, 0, 0);
            return Ok(());
        }
        if len <= self.sink_len && self.seen == self.sink_len + self.win_len {
            self.sink_len = len;
            self.win_len = 0;
            self.head = 0;
        } else {
            let oldest = self.seen - self.win_len; // sequence position of the window's oldest
            if len < oldest || len < self.sink_len {
                bail!(
                    "the window no longer holds position {len}: it holds {} sinks and positions {oldest}..{}",
                    self.sink_len,
                    self.seen
                );
            }
            self.win_len -= self.seen - len;
        }
        self.seen = len;
        Ok(())
    }

    fn bytes(&self) -> usize {
        let alloc = if self.ring.is_some() {
            self.window
                + if self.sink_buf.is_some() {
                    self.sinks
                } else {
                    0
                }
        } else {
            0
        };
        2 * self.n_kv_heads * self.head_dim * alloc * self.dtype.size_in_bytes()
    }

    fn bytes_used(&self) -> usize {
        2 * self.n_kv_heads * self.head_dim * self.len() * self.dtype.size_in_bytes()
    }

    fn state(&self) -> Result<Option<(Tensor, Tensor)>> {
        // Keys as stored: not rotated (their rotation depends on their place at attention time).
        self.ordered(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::test_rope;

    /// Keys and values `[1, 1, t, 2]` whose every element is the sequence position.
    fn step(from: usize, t: usize) -> (Tensor, Tensor) {
        let xs: Vec<f32> = (from..from + t).flat_map(|p| [p as f32; 2]).collect();
        let k = Tensor::from_vec(xs, (1, 1, t, 2), &Device::Cpu).unwrap();
        (k.clone(), k)
    }

    fn held_positions(c: &WindowCache) -> Vec<f32> {
        let (_, v) = c.state().unwrap().unwrap();
        v.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .step_by(2)
            .collect()
    }

    #[test]
    fn the_window_keeps_the_sinks_and_the_latest_positions_in_order() {
        let rope = test_rope(64);
        let mut c = WindowCache::new(1, 2, 4, 2, DType::F32, Device::Cpu);
        let mut pos = 0;
        for t in [3, 1, 4, 2, 1] {
            let (k, v) = step(pos, t);
            c.append(&k, &v, &rope).unwrap();
            pos += t;
        }
        assert_eq!(c.seen(), 11);
        assert_eq!(c.len(), 6);
        assert_eq!(held_positions(&c), [0.0, 1.0, 7.0, 8.0, 9.0, 10.0]);
    }

    #[test]
    fn truncating_inside_the_window_works_and_before_it_is_refused() {
        let rope = test_rope(64);
        let mut c = WindowCache::new(1, 2, 4, 2, DType::F32, Device::Cpu);
        let (k, v) = step(0, 4);
        c.append(&k, &v, &rope).unwrap();
        let (k, v) = step(4, 4);
        c.append(&k, &v, &rope).unwrap(); // holds sinks 0,1 and 4..8
        c.truncate(6).unwrap();
        assert_eq!(held_positions(&c), [0.0, 1.0, 4.0, 5.0]);
        assert!(c.truncate(3).is_err(), "positions 2 and 3 were dropped");
        c.truncate(0).unwrap();
        assert_eq!((c.len(), c.seen()), (0, 0));
    }

    #[test]
    fn a_step_wider_than_the_window_is_refused() {
        let rope = test_rope(64);
        let mut c = WindowCache::new(1, 2, 4, 0, DType::F32, Device::Cpu);
        let (k, v) = step(0, 5);
        assert!(c.append(&k, &v, &rope).is_err());
    }
}
