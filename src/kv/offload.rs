//! `--kv-offload`: every position kept, in host memory; each layer's keys and values are brought to the
//! compute device for its attention. The decoder asks for layer i+1's copy (`prefetch`) before it
//! computes layer i, so on CUDA/Metal the device holds at most two layers of cache at a time.
//! On a CPU device storage and compute coincide: no copy is made and the output is bit-identical to
//! `full`.

use super::full::FullCache;
use super::{Attend, KvView, LayerCache};
use crate::model::rope::Rope;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

pub struct OffloadCache {
    /// The cache itself, on the host.
    host: FullCache,
    compute: Device,
    /// This layer's positions already copied to the compute device (by `prefetch`).
    staged: Option<(Tensor, Tensor)>,
}

impl OffloadCache {
    pub fn new(
        n_kv_heads: usize,
        head_dim: usize,
        max_positions: usize,
        dtype: DType,
        compute: Device,
    ) -> Self {
        Self {
            host: FullCache::new(n_kv_heads, head_dim, max_positions, dtype, Device::Cpu),
            compute,
            staged: None,
        }
    }
}

impl LayerCache for OffloadCache {
    fn prefetch(&mut self) -> Result<()> {
        if self.compute.is_cpu() || self.staged.is_some() {
            return Ok(());
        }
        self.staged = match self.host.state()? {
            Some((k, v)) => Some((k.to_device(&self.compute)?, v.to_device(&self.compute)?)),
            None => None,
        };
        Ok(())
    }

    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        if self.compute.is_cpu() {
            return self.host.append(k, v, rope);
        }
        // Rotate on the device, store on the host; attend on the device over what was staged (the
        // positions held before this step, copied by `prefetch`) plus this step's own.
        let q_pos = self.host.len();
        let staged = match self.staged.take() {
            Some(s) => Some(s),
            None => match self.host.state()? {
                Some((hk, hv)) => {
                    Some((hk.to_device(&self.compute)?, hv.to_device(&self.compute)?))
                }
                None => None,
            },
        };
        let new_k = rope.apply(k, q_pos)?;
        let new_v = v.contiguous()?;
        self.host.push_rotated(&new_k, &new_v)?;
        let (k_all, v_all) = match staged {
            Some((sk, sv)) => (
                Tensor::cat(&[&sk, &new_k], 2)?,
                Tensor::cat(&[&sv, &new_v], 2)?,
            ),
            None => (new_k, new_v),
        };
        Ok(Attend {
            view: KvView::Dense { k: k_all, v: v_all },
            q_pos,
        })
    }

    fn len(&self) -> usize {
        self.host.len()
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.staged = None;
        self.host.truncate(len)
    }

    fn bytes(&self) -> usize {
        self.host.bytes()
    }

    fn bytes_used(&self) -> usize {
        self.host.bytes_used()
    }

    fn restore(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        self.staged = None;
        self.host.restore(k, v)
    }

    fn state(&self) -> Result<Option<(Tensor, Tensor)>> {
        self.host.state()
    }
}
