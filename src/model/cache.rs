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

/// How a precision's rows live on a compute device (CUDA, Metal, or the CPU running the GPU's path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDevice {
    /// As a tensor of this dtype, the stored value widened by candle (float formats).
    Float(candle_core::DType),
    /// As quants and one f16 scale per [`QK`](super::kernels::kvrows::QK) values (`kv::qrows`).
    Quantized(Quants),
}

/// How a quantized precision's quants are kept in a device tensor (`kv::qrows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quants {
    /// One byte a value, q ∈ [−127, 127] kept as q + 128.
    Byte,
    /// Two values a byte, q ∈ [−8, 7] kept as q + 8, in ggml's q4_0 nibble order.
    Nibble,
}

/// The precision axis, declared once. A row: the variant (its doc comment), its name (in flags,
/// KV files and tables), its row codec (`kernels::kvrows`: encode, decoders, finite check) and how
/// its rows live on a compute device. From these rows come the [`Precision`] enum, [`Precision::ALL`]
/// and every per-precision fact below, the view's [`Rows`] variants, [`RowFormat`] (how a codec's
/// rows enter a view) and the two dispatch macros, [`with_codec!`] and [`with_host_rows!`], through
/// which the cache's stores and the attention kernel pick a codec. No code matches on a precision
/// elsewhere: a new precision is its codec plus one row here (docs/architecture.md).
macro_rules! precisions {
    ($d:tt $( $(#[$doc:meta])* $v:ident = $name:literal, $codec:ty, $dev:expr; )*) => {
        /// `$body` with the type `$C` bound to precision `$p`'s codec (a [`RowFormat`]).
        macro_rules! with_codec {
            ($d p:expr, |$d C:ident| $d body:expr) => {
                match $d p {
                    $( $crate::model::cache::Precision::$v => {
                        #[allow(dead_code)]
                        type $d C = $codec;
                        $d body
                    } )*
                }
            };
        }

        /// `$body` with `$x` the host rows of a view's part and the type `$C` bound to their
        /// codec; `$dense` for rows on a compute device.
        macro_rules! with_host_rows {
            ($d rows:expr, |$d x:ident, $d C:ident| $d body:expr, dense => $d dense:expr) => {
                match $d rows {
                    $( $crate::model::cache::Rows::$v($d x) => {
                        #[allow(dead_code)]
                        type $d C = $codec;
                        $d body
                    } )*
                    $crate::model::cache::Rows::Dense { .. } => $d dense,
                }
            };
        }

        /// How keys and values are stored (the precision axis). f16 is the default, as in llama.cpp.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Precision {
            $( $(#[$doc])* $v, )*
        }

        impl Precision {
            pub const ALL: [Precision; [$($name),*].len()] = [$(Precision::$v),*];
            /// Every precision's name, in [`Precision::ALL`]'s order (flags' value lists).
            pub const NAMES: [&'static str; [$($name),*].len()] = [$($name),*];

            pub fn name(self) -> &'static str {
                match self {
                    $( Precision::$v => $name, )*
                }
            }

            /// How its rows live on a compute device.
            pub fn on_device(self) -> OnDevice {
                match self {
                    $( Precision::$v => $dev, )*
                }
            }

            /// Bytes of one row of `hd` values.
            pub fn row_bytes(self, hd: usize) -> usize {
                with_codec!(self, |C| C::row_len(hd) * std::mem::size_of::<<C as Codec>::E>())
            }

            /// Whether stored rows (`raw`, their bytes) hold only finite values, where the bytes
            /// tell without decoding; None for quantized rows.
            pub fn all_finite(self, raw: &[u8]) -> Option<bool> {
                with_codec!(self, |C| C::all_finite(raw))
            }
        }

        /// A run of positions of the view, in one format.
        pub enum Rows<'a> {
            $( $v(HostRows<'a, <$codec as Codec>::E>), )*
            /// On a compute device: `[1, n_kv_heads, len, head_dim]` keys and values (views are fine).
            Dense {
                k: Tensor,
                v: Tensor,
            },
        }

        impl Rows<'_> {
            pub fn len(&self) -> usize {
                match self {
                    $( Rows::$v(r) => r.len, )*
                    Rows::Dense { k, .. } => k.dim(2).unwrap_or(0),
                }
            }
        }

        $(
            impl RowFormat for $codec {
                const PRECISION: Precision = Precision::$v;
                fn rows(x: HostRows<'_, Self::E>) -> Rows<'_> {
                    Rows::$v(x)
                }
            }
        )*

    };
}

use super::kernels::kvrows::Codec;
use candle_core::DType;

precisions! {$
    F32 = "f32", crate::model::kernels::kvrows::F32, OnDevice::Float(DType::F32);
    F16 = "f16", crate::model::kernels::kvrows::F16, OnDevice::Float(DType::F16);
    Bf16 = "bf16", crate::model::kernels::kvrows::Bf16, OnDevice::Float(DType::BF16);
    /// 8-bit symmetric, one f16 scale per 32 values, rows Hadamard-rotated.
    Int8 = "int8", crate::model::kernels::kvrows::Q8, OnDevice::Quantized(Quants::Byte);
    /// 4-bit symmetric (ggml's q4_0 layout), one f16 scale per 32 values, rows Hadamard-rotated.
    Int4 = "int4", crate::model::kernels::kvrows::Q4, OnDevice::Quantized(Quants::Nibble);
}

pub(crate) use {with_codec, with_host_rows};

/// A row codec as the cache knows it: its precision and how its rows enter a view (one impl per
/// row of the table above).
pub trait RowFormat: Codec {
    const PRECISION: Precision;
    fn rows(x: HostRows<'_, Self::E>) -> Rows<'_>;
}

impl Precision {
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether rows are quantized (and so stored Hadamard-rotated, with a recent residual).
    pub fn quantized(self) -> bool {
        matches!(self.on_device(), OnDevice::Quantized(_))
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

impl Rows<'_> {
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which rotation of the step's queries a run of keys pairs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryRotation {
    /// Rotated at the step's positions (`Attend::q_pos`): every key but a window's dropped-past sinks.
    AtPosition,
    /// Rotated where a window's sinks need it (`Attend::sink_q_pos`), once positions were dropped.
    ForSinks,
}

impl QueryRotation {
    /// Its place among the rotated queries attention is given (`qs[0]`, `qs[1]`).
    pub fn index(self) -> usize {
        match self {
            QueryRotation::AtPosition => 0,
            QueryRotation::ForSinks => 1,
        }
    }
}

/// A run of positions and the rotation of the queries its keys pair with.
pub struct Part<'a> {
    pub rows: Rows<'a>,
    pub query: QueryRotation,
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
    /// The absolute position of the view's first key where its positions are consecutive (0
    /// otherwise): the CPU kernel's key chunks then sit at fixed absolute positions, so a row
    /// sums its keys in the same order whichever step it is in and wherever the view starts.
    pub first: usize,
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
    /// Where parts with `QueryRotation::ForSinks` need the first query rotated instead (a window's sinks sit at
    /// their place in the cache, not at their distance in the sequence); None when no part does.
    pub sink_q_pos: Option<usize>,
    /// How many of the step's last queries' attention weights the cache wants back
    /// ([`LayerCache::observed`]): a cache that evicts by score ranks positions by them. 0: none.
    pub observe: usize,
}

/// One layer's cache.
pub trait LayerCache: Send {
    /// Stores this step's keys `k` (not yet rotated) and values `v`, both `[1, n_kv_heads, t, head_dim]`,
    /// and returns what the step's queries attend over.
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>>;
    /// What the last [`LayerCache::append`] (of `t` positions) returned, again, storing nothing:
    /// a layer that shares this one's keys and values (Gemma 4) attends over it.
    fn attend_again(&mut self, t: usize) -> Result<Attend<'_>>;
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
    /// The attention the step's last [`Attend::observe`] queries paid each position of the view
    /// (`kernels::attention::attend_view_observed`: `[n_kv_heads, L]`), once the step's attention
    /// is done; called only when the cache asked.
    fn observed(&mut self, _weights: &[f32]) -> Result<()> {
        Ok(())
    }
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
    /// A forward of `positions` positions begins (in one step or several): a cache that evicts
    /// by score does so when the forward's last step is attended.
    fn forward_begins(&mut self, _positions: usize) -> Result<()> {
        Ok(())
    }
    /// The recurrent state of the model's `r`-th DeltaNet layer (Qwen3.5; `Config::state_index`),
    /// which the forward reads and leaves after its step.
    fn state(&mut self, r: usize) -> Result<&mut super::deltanet::RecurrentState> {
        anyhow::bail!("this cache keeps no recurrent state (asked for layer {r}'s)")
    }
    /// Whether each row of this forward is to be attended as a step of its own (one
    /// [`LayerCache::append`] a row), while the matmuls still take every row at once: a verified
    /// draft on a cache whose batched step would not give each row the bits of single steps (a
    /// quantized cache's residual, a window, a budget), and whose rows must be taken back exactly.
    fn rows_apart(&self) -> bool {
        false
    }
}
