//! `full`: every position kept, in one contiguous buffer per layer, written in place.
//!
//! Keys and values each live in `[1, n_kv_heads, capacity, head_dim]`; positions `0..len` are valid.
//! Capacity starts small and doubles (up to `max_positions`) so a short chat does not reserve the
//! model's whole trained context up front; attention reads a `narrow` view, never a copy.

use super::{Attend, KvView, LayerCache};
use crate::model::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// The first allocation, in positions.
const MIN_CAPACITY: usize = 256;

pub struct FullCache {
    n_kv_heads: usize,
    head_dim: usize,
    max_positions: usize,
    dtype: DType,
    device: Device,
    /// `[1, n_kv_heads, capacity, head_dim]` each, or None before the first append.
    buffers: Option<(Tensor, Tensor)>,
    capacity: usize,
    len: usize,
}

impl FullCache {
    pub fn new(
        n_kv_heads: usize,
        head_dim: usize,
        max_positions: usize,
        dtype: DType,
        device: Device,
    ) -> Self {
        Self {
            n_kv_heads,
            head_dim,
            max_positions,
            dtype,
            device,
            buffers: None,
            capacity: 0,
            len: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Writes already-rotated keys and values `[1, n_kv_heads, t, head_dim]` after what is held.
    pub fn push_rotated(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(2)?;
        let pos = self.len;
        self.reserve(pos + t)?;
        let (kb, vb) = self.buffers.as_ref().expect("reserved above");
        let dev = &self.device;
        kb.slice_set(
            &k.to_device(dev)?.to_dtype(self.dtype)?.contiguous()?,
            2,
            pos,
        )?;
        vb.slice_set(
            &v.to_device(dev)?.to_dtype(self.dtype)?.contiguous()?,
            2,
            pos,
        )?;
        self.len = pos + t;
        Ok(())
    }

    /// Makes room for `needed` positions, copying what is held into a larger buffer if needed.
    fn reserve(&mut self, needed: usize) -> Result<()> {
        if needed > self.max_positions {
            return Err(crate::fixable(
                crate::Fix::RaiseContext,
                format!(
                    "the KV cache is full: {needed} positions needed, {} allowed",
                    self.max_positions
                ),
            ));
        }
        if needed <= self.capacity {
            return Ok(());
        }
        let new_cap = needed
            .next_power_of_two()
            .max(MIN_CAPACITY)
            .min(self.max_positions);
        let shape = (1, self.n_kv_heads, new_cap, self.head_dim);
        let k = Tensor::zeros(shape, self.dtype, &self.device)?;
        let v = Tensor::zeros(shape, self.dtype, &self.device)?;
        if let Some((old_k, old_v)) = &self.buffers {
            if self.len > 0 {
                k.slice_set(&old_k.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                v.slice_set(&old_v.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
            }
        }
        self.buffers = Some((k, v));
        self.capacity = new_cap;
        Ok(())
    }
}

impl LayerCache for FullCache {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        let pos = self.len;
        let k = rope.apply(k, pos)?; // [1, n_kv_heads, t, head_dim]
        self.push_rotated(&k, v)?;
        let (kb, vb) = self.buffers.as_ref().expect("pushed above");
        Ok(Attend {
            view: KvView::Dense {
                k: kb.narrow(2, 0, self.len)?, // [1, n_kv_heads, len, head_dim], a view
                v: vb.narrow(2, 0, self.len)?,
            },
            q_pos: pos,
        })
    }

    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.len = self.len.min(len);
        Ok(())
    }

    fn restore(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(2)?;
        if k.dims() != [1, self.n_kv_heads, n, self.head_dim] || v.dims() != k.dims() {
            bail!(
                "saved KV of shape {:?} does not fit this model's cache",
                k.dims()
            );
        }
        self.len = 0;
        if n == 0 {
            return Ok(());
        }
        self.reserve(n)?;
        let Some((kb, vb)) = self.buffers.as_ref() else {
            bail!("the cache could not make room for {n} saved positions");
        };
        let dev = &self.device;
        kb.slice_set(&k.to_device(dev)?.to_dtype(self.dtype)?.contiguous()?, 2, 0)?;
        vb.slice_set(&v.to_device(dev)?.to_dtype(self.dtype)?.contiguous()?, 2, 0)?;
        self.len = n;
        Ok(())
    }

    fn state(&self) -> Result<Option<(Tensor, Tensor)>> {
        match &self.buffers {
            Some((k, v)) if self.len > 0 => Ok(Some((
                k.narrow(2, 0, self.len)?
                    .to_dtype(DType::F32)?
                    .contiguous()?,
                v.narrow(2, 0, self.len)?
                    .to_dtype(DType::F32)?
                    .contiguous()?,
            ))),
            _ => Ok(None),
        }
    }

    fn bytes(&self) -> usize {
        2 * self.n_kv_heads * self.capacity * self.head_dim * self.dtype.size_in_bytes()
    }

    fn bytes_used(&self) -> usize {
        2 * self.n_kv_heads * self.len * self.head_dim * self.dtype.size_in_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::test_rope;

    fn step(from: usize, t: usize) -> Tensor {
        let xs: Vec<f32> = (from..from + t).flat_map(|p| [p as f32; 2]).collect();
        Tensor::from_vec(xs, (1, 1, t, 2), &Device::Cpu).unwrap()
    }

    #[test]
    fn truncate_drops_the_tail_and_the_next_append_continues_there() {
        let rope = test_rope(64);
        let mut c = FullCache::new(1, 2, 64, DType::F32, Device::Cpu);
        c.append(&step(0, 5), &step(0, 5), &rope).unwrap();
        c.truncate(3).unwrap();
        assert_eq!(c.len(), 3);
        c.truncate(10).unwrap(); // beyond what is held: nothing happens
        assert_eq!(c.len(), 3);
        let a = c.append(&step(3, 1), &step(3, 1), &rope).unwrap();
        assert_eq!(a.q_pos, 3);
        let (_, v) = c.state().unwrap().unwrap();
        let held: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(held, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    }

    #[test]
    fn the_cache_refuses_positions_past_its_context() {
        let rope = test_rope(64);
        let mut c = FullCache::new(1, 2, 4, DType::F32, Device::Cpu);
        c.append(&step(0, 4), &step(0, 4), &rope).unwrap();
        let e = c.append(&step(4, 1), &step(4, 1), &rope).err().unwrap();
        assert!(
            e.to_string().contains("5 positions needed, 4 allowed"),
            "{e}"
        );
    }
}
