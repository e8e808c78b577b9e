//! What the decoder needs of a KV cache, and what a layer's cache hands to attention. The model
//! owns this interface; `kv` implements it (one strategy per file), so the dependency points one
//! way: kv → model.
//!
//! Layout, stated once: each layer's keys and values are `[1, n_kv_heads, positions, head_dim]`.
//! Attention hands a layer's new keys (not yet rotated) and values for this step to that layer's
//! cache, and gets back what to attend over ([`KvView`]: dense rotated keys and values, or INT8
//! blocks plus a full-precision tail) and the position at which to rotate the step's queries.

use super::rope::Rope;
use anyhow::Result;
use candle_core::Tensor;

/// What a layer's attention attends over for one step. In every view the step's own `t` positions
/// come last, so the causal mask is the same: query i sees the first `L - t + i + 1` positions.
pub enum KvView<'a> {
    /// Rotated keys and values, `[1, n_kv_heads, L, head_dim]` each (views into a cache are fine).
    Dense { k: Tensor, v: Tensor },
    /// INT8 blocks of old positions, then a full-precision tail that ends with the step's own.
    Int8(Int8View<'a>),
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
        Err(crate::fixable(
            crate::Fix::FullCache,
            "this cache strategy cannot be saved or restored yet".into(),
        ))
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

/// Every layer's cache, as the decoder sees it.
pub trait DecoderCache {
    fn n_layers(&self) -> usize;
    fn layer(&mut self, i: usize) -> &mut dyn LayerCache;
    /// The decoder runs the whole sequence at every step (nothing is kept).
    fn recomputes(&self) -> bool;
    /// The most positions one forward may append (a window cannot take more than its width).
    fn max_step(&self) -> Option<usize>;
}

/// Tokens per key-scale group. 128 keeps the scale overhead at 4·hd/128 bytes per token and head, so
/// INT8 holds ≤ 0.27× the bytes of f32 (and ≤ 0.53× of f16) at head_dim 64.
pub const GROUP: usize = 128;

#[derive(Debug, Clone, Default)]
pub struct Int8Head {
    pub kq: Vec<i8>,
    pub k_scale: Vec<f32>,
    pub vq: Vec<i8>,
    pub v_scale: Vec<f32>,
    pub tail_k: Vec<f32>,
    pub tail_v: Vec<f32>,
}

/// What attention reads: every head's INT8 blocks and f32 tail (the step's positions last).
pub struct Int8View<'a> {
    pub heads: &'a [Int8Head],
    pub head_dim: usize,
    /// Quantized positions (a multiple of GROUP).
    pub n_quant: usize,
    /// Positions in the f32 tail, the step's included.
    pub n_tail: usize,
}
