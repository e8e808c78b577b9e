//! The KV cache: one object per layer behind the [`LayerCache`] trait, chosen by flags.
//!
//! Layout, stated once: each layer's keys and values are `[1, n_kv_heads, positions, head_dim]`.
//! Attention hands a layer's new keys (not yet rotated) and values for this step to that layer's cache,
//! and gets back the keys (rotated) and values to attend over, and the position at which to rotate the
//! step's queries. The decoder never knows which strategy it runs with; a strategy is one file here.

pub mod full;
pub mod none;

use crate::model::{config::Config, rope::Rope};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

/// What a layer's attention attends over for one step.
pub struct Attend {
    /// Rotated keys, `[1, n_kv_heads, kv_len, head_dim]`; the step's own keys are the last `t`.
    pub k: Tensor,
    /// Values, `[1, n_kv_heads, kv_len, head_dim]`.
    pub v: Tensor,
    /// Position at which the step's first query is rotated.
    pub q_pos: usize,
}

/// One layer's cache.
pub trait LayerCache: Send {
    /// Stores this step's keys `k` (not yet rotated) and values `v`, both `[1, n_kv_heads, t, head_dim]`,
    /// and returns what the step's queries attend over.
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend>;
    /// Positions held.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Drops every position from `len` on, so the next append continues at `len`.
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Bytes of cache storage resident now (allocated, not just used).
    fn bytes(&self) -> usize;
    /// The keys (rotated) and values held, `[1, n_kv_heads, len, head_dim]` each, as f32; None when empty.
    fn state(&self) -> Result<Option<(Tensor, Tensor)>>;
}

/// Which strategy, with its parameters: what `--no-cache` and the other cache flags select.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheSpec {
    /// No state: every step recomputes the whole sequence (the O(n²) baseline).
    None,
    /// A contiguous per-layer buffer written in place, grown by doubling up to `max_positions`.
    Full { max_positions: usize },
}

impl CacheSpec {
    pub fn describe(&self) -> String {
        match self {
            CacheSpec::None => "none (recompute every step)".to_string(),
            CacheSpec::Full { max_positions } => {
                format!("full f32, up to {max_positions} positions")
            }
        }
    }

    /// Whether the generation loop must feed the whole sequence at every step.
    pub fn recomputes(&self) -> bool {
        matches!(self, CacheSpec::None)
    }

    pub fn build(&self, cfg: &Config, dtype: DType, device: &Device) -> KvCache {
        let layers = (0..cfg.n_layer)
            .map(|_| -> Box<dyn LayerCache> {
                match self {
                    CacheSpec::None => Box::new(none::NoCache),
                    CacheSpec::Full { max_positions } => Box::new(full::FullCache::new(
                        cfg.n_kv_head,
                        cfg.head_dim,
                        *max_positions,
                        dtype,
                        device.clone(),
                    )),
                }
            })
            .collect();
        KvCache {
            spec: self.clone(),
            layers,
            bytes_per_token: 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * dtype.size_in_bytes(),
        }
    }
}

/// All layers' caches for one sequence.
pub struct KvCache {
    spec: CacheSpec,
    layers: Vec<Box<dyn LayerCache>>,
    bytes_per_token: usize,
}

impl KvCache {
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }
    pub fn layer(&mut self, i: usize) -> &mut dyn LayerCache {
        self.layers[i].as_mut()
    }
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    /// Positions held (the same in every layer).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        for l in &mut self.layers {
            l.truncate(len)?;
        }
        Ok(())
    }
    pub fn reset(&mut self) -> Result<()> {
        self.truncate(0)
    }
    /// Bytes resident in all layers now.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }
    /// Bytes the positions held occupy: len × bytes per token (what kv-size predicts).
    pub fn bytes_used(&self) -> usize {
        self.len() * self.bytes_per_token
    }
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }
}
