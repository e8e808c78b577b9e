//! What the decoder needs of a KV cache, and what a layer's cache hands to attention. The model
//! owns this interface; `kv` implements it, so the dependency points one way: kv → model.
//!
//! Layout, stated once: a layer's keys and values arrive as `[1, n_kv_heads, t, head_dim]` for the
//! step's t positions (keys not yet rotated). The cache stores them, each position of each head as
//! one row in its precision's format (`kernels::kvrows`), keys rotated at their absolute position,
//! and returns what to attend over: a [`KvView`], the rows of every position the step's queries see,
//! in sequence order, the step's own last.

use super::rope::Rope;
use anyhow::Result;
use candle_core::Tensor;
use half::{bf16, f16};

/// How keys and values are stored (the precision axis). f16 is the default, as in llama.cpp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    F32,
    F16,
    Bf16,
    /// 8-bit symmetric, one f16 scale per 32 values, rows Hadamard-rotated.
    Int8,
    /// 4-bit symmetric (ggml's q4_0 layout), one f16 scale per 32 values, rows Hadamard-rotated.
    Int4,
}

impl Precision {
    pub const ALL: [Precision; 5] = [
        Precision::F32,
        Precision::F16,
        Precision::Bf16,
        Precision::Int8,
        Precision::Int4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
            Precision::Int4 => "int4",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether rows are quantized (and so stored Hadamard-rotated, with a recent residual).
    pub fn quantized(self) -> bool {
        matches!(self, Precision::Int8 | Precision::Int4)
    }

    /// Bytes of one row of `hd` values.
    pub fn row_bytes(self, hd: usize) -> usize {
        use super::kernels::kvrows::{Codec, Q4, Q8};
        match self {
            Precision::F32 => 4 * hd,
            Precision::F16 | Precision::Bf16 => 2 * hd,
            Precision::Int8 => Q8::row_len(hd),
            Precision::Int4 => Q4::row_len(hd),
        }
    }

    /// Why rows of `hd` values cannot be stored in this precision, if they cannot (the float
    /// precisions store any).
    pub fn unfit(self, hd: usize) -> Option<String> {
        use super::kernels::kvrows::QK;
        match self {
            p if p.quantized() && !hd.is_multiple_of(QK) => Some(format!(
                "an {} KV cache cannot hold this model: its head_dim of {hd} cannot be split into groups of {QK}",
                p.name()
            )),
            _ => None,
        }
    }
}

/// Stored rows of `len` positions in host memory: head h's rows start at `h * head_stride`
/// elements, `row_len` elements each, positions in order.
#[derive(Clone, Copy)]
pub struct HostRows<'a, E> {
    pub k: &'a [E],
    pub v: &'a [E],
    pub head_stride: usize,
    pub row_len: usize,
    pub len: usize,
}

/// A run of positions of the view, in one format.
pub enum Rows<'a> {
    F32(HostRows<'a, f32>),
    F16(HostRows<'a, f16>),
    Bf16(HostRows<'a, bf16>),
    Q8(HostRows<'a, u8>),
    Q4(HostRows<'a, u8>),
    /// On a compute device: `[1, n_kv_heads, len, head_dim]` keys and values (views are fine).
    Dense {
        k: Tensor,
        v: Tensor,
    },
}

impl Rows<'_> {
    pub fn len(&self) -> usize {
        match self {
            Rows::F32(r) => r.len,
            Rows::F16(r) => r.len,
            Rows::Bf16(r) => r.len,
            Rows::Q8(r) | Rows::Q4(r) => r.len,
            Rows::Dense { k, .. } => k.dim(2).unwrap_or(0),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A run of positions and the rotation of the queries its keys pair with.
pub struct Part<'a> {
    pub rows: Rows<'a>,
    /// 0: queries rotated at `Attend::q_pos`; 1: at `Attend::sink_q_pos` (a window's sinks).
    pub query: usize,
}

/// What a layer's attention attends over for one step, in sequence order; the step's own `t`
/// positions come last, so query i sees the first `L - t + i + 1` positions.
pub struct KvView<'a> {
    pub parts: Vec<Part<'a>>,
    /// Rows are stored multiplied by the orthonormal Hadamard matrix of this block size (the
    /// quantized precisions): attention rotates its queries the same way and its output back.
    pub hadamard: Option<usize>,
    /// A sliding window the model declares for this layer: each query sees only the `w` most recent
    /// positions up to its own (itself included). Set only where the view's positions are
    /// consecutive (no sinks), so view index and position differ by a constant.
    pub window: Option<usize>,
}

impl KvView<'_> {
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.rows.len()).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub struct Attend<'a> {
    pub view: KvView<'a>,
    /// Position at which the step's first query is rotated (its absolute position).
    pub q_pos: usize,
    /// Where parts with `query: 1` need the first query rotated instead (a window's sinks sit at
    /// their place in the cache, not at their distance in the sequence); None when no part does.
    pub sink_q_pos: Option<usize>,
}

/// One layer's cache.
pub trait LayerCache: Send {
    /// Stores this step's keys `k` (not yet rotated) and values `v`, both `[1, n_kv_heads, t, head_dim]`,
    /// and returns what the step's queries attend over.
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>>;
    /// Positions held.
    fn len(&self) -> usize;
    /// Positions of the sequence seen so far (more than `len` once a window has dropped some).
    fn seen(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Drops every position of the sequence from `len` on, so the next append continues at `len`.
    /// Truncating to `len >= seen()` does nothing.
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Starts moving this layer's storage to the compute device ahead of its `append` (offload).
    fn prefetch(&mut self) -> Result<()> {
        Ok(())
    }
    /// Bytes of cache storage resident now (allocated, not just used).
    fn bytes(&self) -> usize;
    /// Bytes that the positions held occupy (no spare capacity).
    fn bytes_used(&self) -> usize;
}

/// Every layer's cache, as the decoder sees it.
pub trait DecoderCache {
    fn n_layers(&self) -> usize;
    fn layer(&mut self, i: usize) -> &mut dyn LayerCache;
    /// The decoder runs the whole sequence at every step (nothing is kept).
    fn recomputes(&self) -> bool;
    /// The most positions one forward may append (a window cannot take more than its spare slots).
    fn max_step(&self) -> Option<usize>;
    /// The forward is over: what only it needed (a recompute's rows) may go.
    fn step_done(&mut self) {}
}
