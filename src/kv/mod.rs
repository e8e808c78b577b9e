//! The KV cache: one object per layer behind the [`LayerCache`] trait, chosen by flags.
//!
//! Layout, stated once: each layer's keys and values are `[1, n_kv_heads, positions, head_dim]`.
//! Attention hands a layer's new keys (not yet rotated) and values for this step to that layer's cache,
//! and gets back what to attend over ([`KvView`]: dense rotated keys and values, or INT8 blocks plus a
//! full-precision tail) and the position at which to rotate the step's queries. The decoder never
//! knows which strategy it runs with; a strategy is one file here.

pub mod full;
pub mod int8;
pub mod none;
pub mod offload;
pub mod persist;
pub mod size;
pub mod window;

use crate::model::{config::Config, rope::Rope};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

/// What a layer's attention attends over for one step. In every view the step's own `t` positions
/// come last, so the causal mask is the same: query i sees the first `L - t + i + 1` positions.
pub enum KvView<'a> {
    /// Rotated keys and values, `[1, n_kv_heads, L, head_dim]` each (views into a cache are fine).
    Dense { k: Tensor, v: Tensor },
    /// INT8 blocks of old positions, then a full-precision tail that ends with the step's own.
    Int8(int8::Int8View<'a>),
}

pub struct Attend<'a> {
    pub view: KvView<'a>,
    /// Position at which the step's first query is rotated.
    pub q_pos: usize,
}

/// One layer's cache.
pub trait LayerCache: Send {
    /// Stores this step's keys `k` (not yet rotated) and values `v`, both `[1, n_kv_heads, t, head_dim]`,
    /// and returns what the step's queries attend over.
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>>;
    /// Positions held.
    fn len(&self) -> usize;
    /// Positions of the sequence seen so far (more than `len` once a window has dropped some).
    fn seen(&self) -> usize {
        self.len()
    }
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Drops every position of the sequence from `len` on, so the next append continues at `len`.
    /// Truncating to `len >= seen()` does nothing.
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Replaces what this layer holds by `k` (rotated) and `v`, `[1, n_kv_heads, n, head_dim]` (from
    /// `state` of the same strategy): how a saved prompt cache comes back.
    fn restore(&mut self, _k: &Tensor, _v: &Tensor) -> Result<()> {
        anyhow::bail!("this cache strategy cannot be saved or restored yet (use the full cache)")
    }
    /// Starts moving this layer's storage to the compute device ahead of its `append` (offload).
    fn prefetch(&mut self) -> Result<()> {
        Ok(())
    }
    /// Bytes of cache storage resident now (allocated, not just used).
    fn bytes(&self) -> usize;
    /// Bytes that the positions held occupy (no spare capacity).
    fn bytes_used(&self) -> usize;
    /// The keys and values held, `[1, n_kv_heads, len, head_dim]` each, oldest first, keys as the
    /// strategy stores them (rotated, except in the window); None when empty.
    fn state(&self) -> Result<Option<(Tensor, Tensor)>>;
}

/// Which strategy, with its parameters: what `--no-cache` and the other cache flags select.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CacheSpec {
    /// No state: every step recomputes the whole sequence (the O(n²) baseline).
    None,
    /// A contiguous per-layer buffer written in place, grown by doubling up to `max_positions`.
    Full { max_positions: usize },
    /// The first `sinks` positions and the last `window`, keys stored before RoPE and rotated by
    /// their place in the cache: memory bounded by `sinks + window`, length unbounded.
    Window { window: usize, sinks: usize },
    /// INT8 keys (per-channel scales over groups of tokens) and values (per-token scales), the most
    /// recent `residual` positions (and an incomplete key group) in f32.
    Int8 {
        max_positions: usize,
        residual: usize,
    },
    /// Like `Full`, but the cache lives in host memory and each layer is brought to the compute device
    /// for its attention, the next layer's copy started first.
    Offload { max_positions: usize },
}

impl CacheSpec {
    /// Short name, as `kvchat bench --modes` spells it.
    pub fn name(&self) -> String {
        match self {
            CacheSpec::None => "none".into(),
            CacheSpec::Full { .. } => "full".into(),
            CacheSpec::Window { window, sinks } => format!("window:{window}+{sinks}"),
            CacheSpec::Int8 { .. } => "int8".into(),
            CacheSpec::Offload { .. } => "offload".into(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            CacheSpec::None => "none (recompute every step)".to_string(),
            CacheSpec::Full { max_positions } => format!("full f32, up to {max_positions} positions"),
            CacheSpec::Window { window, sinks } => {
                format!("window of {window} positions + {sinks} attention sinks, keys rotated in-cache")
            }
            CacheSpec::Int8 {
                max_positions,
                residual,
            } => format!(
                "int8 (K per-channel over {}-token groups, V per-token), last {residual} positions f32, up to {max_positions} positions",
                int8::GROUP
            ),
            CacheSpec::Offload { max_positions } => {
                format!("full f32 in host memory (offload), up to {max_positions} positions")
            }
        }
    }

    /// Whether the generation loop must feed the whole sequence at every step.
    pub fn recomputes(&self) -> bool {
        matches!(self, CacheSpec::None)
    }

    /// The longest sequence this cache can hold; None when unbounded (a window).
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            CacheSpec::None => None,
            CacheSpec::Full { max_positions }
            | CacheSpec::Int8 { max_positions, .. }
            | CacheSpec::Offload { max_positions } => Some(*max_positions),
            CacheSpec::Window { .. } => None,
        }
    }

    /// The most positions one forward may append (a window cannot take more than its width at once).
    pub fn max_step(&self) -> Option<usize> {
        match self {
            CacheSpec::Window { window, .. } => Some(*window),
            _ => None,
        }
    }

    pub fn build(&self, cfg: &Config, dtype: DType, device: &Device) -> KvCache {
        let (nkv, hd) = (cfg.n_kv_head, cfg.head_dim);
        let layers = (0..cfg.n_layer)
            .map(|_| -> Box<dyn LayerCache> {
                match self {
                    CacheSpec::None => Box::new(none::NoCache),
                    CacheSpec::Full { max_positions } => Box::new(full::FullCache::new(
                        nkv,
                        hd,
                        *max_positions,
                        dtype,
                        device.clone(),
                    )),
                    CacheSpec::Window { window, sinks } => Box::new(window::WindowCache::new(
                        nkv,
                        hd,
                        *window,
                        *sinks,
                        dtype,
                        device.clone(),
                    )),
                    CacheSpec::Int8 {
                        max_positions,
                        residual,
                    } => Box::new(int8::Int8Cache::new(nkv, hd, *max_positions, *residual)),
                    CacheSpec::Offload { max_positions } => Box::new(offload::OffloadCache::new(
                        nkv,
                        hd,
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
        }
    }
}

/// All layers' caches for one sequence.
pub struct KvCache {
    spec: CacheSpec,
    layers: Vec<Box<dyn LayerCache>>,
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
    /// Positions of the sequence seen so far.
    pub fn seen(&self) -> usize {
        self.layers.first().map_or(0, |l| l.seen())
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
    /// Every layer's `state()`.
    pub fn layers_state(&self) -> Result<Vec<Option<(Tensor, Tensor)>>> {
        self.layers.iter().map(|l| l.state()).collect()
    }
    /// What must match for a saved state to be loaded into this cache: the storage, not the capacity.
    pub fn persist_key(&self) -> Result<String> {
        match &self.spec {
            CacheSpec::Full { .. } | CacheSpec::Offload { .. } => Ok("full f32".into()),
            other => anyhow::bail!(
                "saving the KV state is not supported with the {} cache yet (use the full cache)",
                other.name()
            ),
        }
    }
    /// Bytes resident in all layers now (allocated storage).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }
    /// Bytes the positions held occupy (what `kv-size` predicts for this many positions).
    pub fn bytes_used(&self) -> usize {
        self.layers.iter().map(|l| l.bytes_used()).sum()
    }
}
