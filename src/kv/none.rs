//! `--no-cache`: nothing is kept between steps. The generation loop feeds the whole sequence every step,
//! so the cost of step n is a full forward over n tokens: the honest O(n²) baseline. Keys and values
//! are rounded to the precision a cache would store them in, so a recompute and a cached run of the
//! same precision give the same bits.

use super::{Attend, KvView, LayerCache};
use crate::model::rope::Rope;
use anyhow::Result;
use candle_core::{DType, Tensor};

pub struct NoCache {
    dtype: DType,
}

impl NoCache {
    pub fn new(dtype: DType) -> Self {
        Self { dtype }
    }
}

impl LayerCache for NoCache {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        // The step is the whole sequence, starting at position 0.
        Ok(Attend {
            view: KvView::Dense {
                k: rope.apply(k, 0)?.to_dtype(self.dtype)?,
                v: v.to_dtype(self.dtype)?,
            },
            q_pos: 0,
        })
    }
    fn len(&self) -> usize {
        0
    }
    fn truncate(&mut self, _len: usize) -> Result<()> {
        Ok(())
    }
    fn bytes(&self) -> usize {
        0
    }
    fn bytes_used(&self) -> usize {
        0
    }
    fn state(&self) -> Result<Option<(Tensor, Tensor)>> {
        Ok(None)
    }
}
