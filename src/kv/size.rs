//! Memory accounting: how many bytes a KV cache holds, per token and per context, for each storage
//! mode — the arithmetic that `kvchat kv-size` prints and that the caches' own `bytes_used` must match.

use super::int8::GROUP;

/// The dimensions that decide KV cache size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvDims {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// How the cache stores each element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    F32,
    F16,
    Bf16,
    /// INT8 as `kv::int8` stores it: K per (channel, head) over GROUP tokens, V per (token, head), f32 scales.
    Int8,
    /// Two values a byte with the same scales as INT8 (a projection: no INT4 cache exists yet).
    Int4,
}

impl Storage {
    pub const ALL: [Storage; 5] = [
        Storage::F32,
        Storage::F16,
        Storage::Bf16,
        Storage::Int8,
        Storage::Int4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::F16 => "f16",
            Storage::Bf16 => "bf16",
            Storage::Int8 => "int8",
            Storage::Int4 => "int4",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }
}

impl KvDims {
    /// Bytes one token adds in steady state: 2 × layers × kv_heads × head_dim × bytes per element,
    /// plus the scales of the quantized modes (per KV head and layer: K `4·hd/GROUP`, V 4).
    pub fn bytes_per_token(&self, m: Storage) -> f64 {
        let elems = (self.layers * self.kv_heads * self.head_dim) as f64;
        let scales = (self.layers * self.kv_heads) as f64
            * (4.0 * self.head_dim as f64 / GROUP as f64 + 4.0);
        match m {
            Storage::F32 => 2.0 * elems * 4.0,
            Storage::F16 | Storage::Bf16 => 2.0 * elems * 2.0,
            Storage::Int8 => 2.0 * elems + scales,
            Storage::Int4 => elems + scales,
        }
    }

    /// Bytes held for a sequence of `n` positions. For the dense modes, n × bytes per token; for INT8,
    /// exactly what `kv::int8` holds after a decode step: `residual`..`residual + GROUP` newest
    /// positions in f32, the rest INT8.
    pub fn bytes_for(&self, m: Storage, n: usize, residual: usize) -> f64 {
        match m {
            Storage::Int8 => {
                let tail = if n <= residual {
                    n
                } else {
                    residual + 1 + (n - residual - 1) % GROUP
                };
                let quant = n - tail;
                quant as f64 * self.bytes_per_token(Storage::Int8)
                    + tail as f64 * self.bytes_per_token(Storage::F32)
            }
            _ => n as f64 * self.bytes_per_token(m),
        }
    }
}
