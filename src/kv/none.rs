//! `--no-cache`: nothing is kept between steps. The generation loop feeds the whole sequence every step,
//! so the cost of step n is a full forward over n tokens: the honest O(n²) baseline.

use super::{Attend, KvView, LayerCache};
use crate::model::rope::Rope;
use anyhow::Result;
use candle_core::Tensor;

pub struct NoCache;

impl LayerCache for NoCache {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        // The step is the whole sequence, starting at position 0.
        Ok(Attend {
            view: KvView::Dense {
                k: rope.apply(k, 0)?,
                v: v.clone(),
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
