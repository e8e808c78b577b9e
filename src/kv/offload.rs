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
        // Store on the host; attend on the device over what was staged plus this step.
        let t = k.dim(2)?;
        let staged = match self.staged.take() {
            Some(s) => Some(s),
            None => self.host.state()?,
        };
        let q_pos = self.host.len();
        let host_attend = self.host.append(
            &k.to_device(&Device::Cpu)?,
            &v.to_device(&Device::Cpu)?,
            rope,
        )?;
        let (hk, hv) = match host_attend.view {
            KvView::Dense { k, v } => (k, v),
            KvView::Int8(_) => unreachable!("the host cache is dense"),
        };
        let new_k = hk.narrow(2, q_pos, t)?.to_device(&self.compute)?;
        let new_v = hv.narrow(2, q_pos, t)?.to_device(&self.compute)?;
        let (k_all, v_all) = match staged {
            Some((sk, sv)) => (
                Tensor::cat(&[&sk.to_device(&self.compute)?, &new_k], 2)?,
                Tensor::cat(&[&sv.to_device(&self.compute)?, &new_v], 2)?,
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
