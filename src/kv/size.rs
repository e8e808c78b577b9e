//! Memory accounting: how many bytes a KV cache holds, per token and per context, for each
//! precision and retention — the arithmetic that `kvchat kv-size` prints and that the caches' own
//! `bytes_used` must match (a test compares them).

use super::layer::main_capacity;
use super::{CacheMode, CacheSpec, Precision, Retention};
use crate::model::Config;

/// The dimensions that decide KV cache size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvDims {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvDims {
    /// A model's dimensions: its layers that keep keys and values where some keep a recurrent
    /// state instead (Qwen3.5), else all of them.
    pub fn of(cfg: &Config) -> Self {
        Self {
            layers: match cfg.recurrent {
                Some(_) => cfg.kv_layers(),
                None => cfg.n_layer,
            },
            kv_heads: cfg.n_kv_head,
            head_dim: cfg.head_dim,
        }
    }

    /// Bytes one token adds to a model's cache over its layers that keep keys and values (Gemma 4's
    /// layers differ in shape, and its shared layers hold none): `bytes_per_token` for a model
    /// whose layers are alike.
    pub fn model_bytes_per_token(cfg: &Config, p: Precision) -> f64 {
        (0..cfg.kv_layers())
            .map(|i| Self::kv_layer(cfg, i).bytes_per_token(p))
            .sum()
    }

    /// KV layer `c` of a model alone (Gemma 4's layers differ in shape).
    pub fn kv_layer(cfg: &Config, c: usize) -> Self {
        Self::one(cfg.kv_shape(c))
    }

    /// Block `i` of a model alone, as if it kept keys and values (a reference: a cache on every
    /// block).
    pub fn block(cfg: &Config, i: usize) -> Self {
        Self::one(cfg.layer_kv_shape(i))
    }

    fn one((kv_heads, head_dim): (usize, usize)) -> Self {
        Self {
            layers: 1,
            kv_heads,
            head_dim,
        }
    }

    /// Bytes a cache built from `spec` for the model `cfg` holds after `n` positions, layer by
    /// layer: a layer the model declares a sliding window for keeps only that window
    /// (`CacheSpec::layer_spec`). Equals `bytes_for_mode` for a model without declared windows.
    pub fn bytes_for_spec(spec: &CacheSpec, cfg: &Config, n: usize) -> f64 {
        // Layers sharing an earlier layer's keys and values (Gemma 4) hold none.
        (0..cfg.kv_layers())
            .map(|i| {
                let layer = CacheMode {
                    retention: spec.layer_spec(cfg, i).retention,
                    ..spec.mode
                };
                Self::kv_layer(cfg, i).bytes_for_mode(&layer, n)
            })
            .sum()
    }

    /// The most bytes a cache built from `spec` (its `max_positions` the sequence's last
    /// position) can allocate, layer by layer, for a sequence whose first forward is `prompt`
    /// positions fed in steps of at most `chunk`, then one position a step: what a server refuses
    /// a request by when even the whole pool could not hold it. The larger of
    /// [`bytes_up_to`](Self::bytes_up_to) at the prompt's end and at the last position, layer by
    /// layer.
    pub fn bytes_at_most(spec: &CacheSpec, cfg: &Config, prompt: usize, chunk: usize) -> f64 {
        let n = spec.max_positions;
        Self::by_layer(spec, cfg, |r| {
            let at = |upto| held_up_to(r, n, spec.grow_by, prompt, chunk, upto);
            at(prompt).max(at(n))
        })
    }

    /// Bytes a cache built from `spec` holds once its sequence is `upto` positions long, the
    /// first forward `prompt` positions in steps of at most `chunk` and then one position a step:
    /// what a server counts a sequence for before its next step, so that the memory a long
    /// `max_tokens` may never use is not held. Follows the layers' growth rules (`kv::layer`): a
    /// full layer's store grows by `kv::layer::main_capacity` up to `max_positions`; a window's ring the
    /// same up to its sinks and window, plus a step's rows waiting to enter it once the sequence
    /// is longer than that; a budget holds the whole prompt until its first eviction, then its
    /// budget and slack; a quantized layer also its f16 residual.
    pub fn bytes_up_to(
        spec: &CacheSpec,
        cfg: &Config,
        prompt: usize,
        chunk: usize,
        upto: usize,
    ) -> f64 {
        let n = spec.max_positions;
        Self::by_layer(spec, cfg, |r| {
            held_up_to(r, n, spec.grow_by, prompt, chunk, upto)
        })
    }

    /// Bytes of a model's recurrent states with the most snapshots a cache keeps (Qwen3.5's
    /// DeltaNet layers); 0 for a model without them.
    pub fn state_bytes(cfg: &Config) -> f64 {
        cfg.recurrent.as_ref().map_or(0, |r| {
            r.count() * r.layer_bytes() * (1 + super::MAX_SNAPSHOTS)
        }) as f64
    }

    /// A model's keys and values, every layer that keeps them holding `n` positions in `p`
    /// (a quantized precision's newest `residual` positions also in f16): `bytes_for` summed over
    /// layers that may differ in shape (Gemma 4).
    pub fn model_bytes_for(cfg: &Config, p: Precision, n: usize, residual: usize) -> f64 {
        (0..cfg.kv_layers())
            .map(|i| Self::kv_layer(cfg, i).bytes_for(p, n, residual))
            .sum()
    }

    /// Recurrent states (Qwen3.5, with the most snapshots a cache keeps) plus each KV layer's
    /// bytes for the positions `held(retention)` says its stores allocate.
    fn by_layer(spec: &CacheSpec, cfg: &Config, held: impl Fn(Retention) -> usize) -> f64 {
        let n = spec.max_positions;
        Self::state_bytes(cfg)
            + (0..cfg.kv_layers())
                .map(|i| {
                    Self::kv_layer(cfg, i).bytes_for(
                        spec.mode.precision,
                        held(spec.layer_spec(cfg, i).retention),
                        spec.mode.residual.min(n),
                    )
                })
                .sum::<f64>()
    }

    /// Bytes one token adds: 2 (K and V) × layers × kv_heads × the bytes of a row of head_dim
    /// values in this precision (scales included).
    pub fn bytes_per_token(&self, p: Precision) -> f64 {
        (2 * self.layers * self.kv_heads * p.row_bytes(self.head_dim)) as f64
    }

    /// Bytes held for a sequence of `n` positions with every position kept: n × bytes per token,
    /// plus, for a quantized precision, the f16 copies of the newest `residual` positions.
    pub fn bytes_for(&self, p: Precision, n: usize, residual: usize) -> f64 {
        let resid = if p.quantized() { n.min(residual) } else { 0 };
        n as f64 * self.bytes_per_token(p) + resid as f64 * self.bytes_per_token(Precision::F16)
    }

    /// Bytes a cache configured as `mode` holds after `n` positions of a sequence.
    pub fn bytes_for_mode(&self, mode: &CacheMode, n: usize) -> f64 {
        let held = match mode.retention {
            Retention::None => 0,
            Retention::All => n,
            Retention::Window { window, sinks } => n.min(window + sinks),
            // Between evictions up to `SLACK` more: what it holds after each.
            Retention::Budget { budget, .. } => n.min(budget),
        };
        self.bytes_for(mode.precision, held, mode.residual.min(n))
    }
}

/// Positions a layer of `retention` allocates once its sequence is `upto` positions long (at
/// most `n`), the prompt's `prompt` positions fed in steps of at most `chunk` (`KvDims::bytes_up_to`).
fn held_up_to(
    retention: Retention,
    n: usize,
    grow_by: Option<usize>,
    prompt: usize,
    chunk: usize,
    upto: usize,
) -> usize {
    let upto = upto.min(n);
    // Rows of the last step waiting to enter a window's ring: a prompt's step, then a position.
    let step = if upto > prompt {
        1
    } else {
        chunk.min(prompt).max(1)
    };
    match retention {
        Retention::None => 0,
        Retention::All => main_capacity(retention, upto, n, grow_by),
        Retention::Window { window, sinks } => {
            let ring = window + sinks;
            main_capacity(retention, upto.min(ring), n, grow_by)
                + if upto > ring { step } else { 0 }
        }
        Retention::Budget { budget, .. } => prompt.max(budget + crate::kv::SLACK + 1).min(n),
    }
}

/// A cache's memory by kind, for a model whose DeltaNet layers keep a recurrent state beside
/// its attention layers' keys and values (Qwen3.5): the keys and values, one copy of the states
/// and the snapshots of them the cache keeps (`kv::States`), against keys and values on every
/// layer for the same positions. The one definition `kvchat kv-size`, `--stats` and `kvchat
/// bench` render, with its one `Display`; the server's pool counts the same (`state_bytes`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryByKind {
    pub kv_bytes: f64,
    pub kv_layers: usize,
    pub layers: usize,
    /// One copy of every recurrent layer's state (f32, whatever the context).
    pub state_bytes: f64,
    pub state_layers: usize,
    /// Snapshots of the states kept, and their bytes; `snapshots_at_most`: a prediction's
    /// bound ([`super::MAX_SNAPSHOTS`]), not a count.
    pub snapshots: usize,
    pub snapshot_bytes: f64,
    pub snapshots_at_most: bool,
    /// Keys and values on every layer (what a model of attention layers alone would hold).
    pub uniform_bytes: f64,
}

impl MemoryByKind {
    /// Everything held: keys and values, the states and their snapshots.
    pub fn held(&self) -> f64 {
        self.kv_bytes + self.state_bytes + self.snapshot_bytes
    }

    /// What a sequence of `n` positions may hold at most in precision `p` (the newest `residual`
    /// positions also in f16), every snapshot kept; None for a model without recurrent layers.
    pub fn predicted(cfg: &Config, p: Precision, n: usize, residual: usize) -> Option<Self> {
        let r = cfg.recurrent.as_ref()?;
        let state = (r.count() * r.layer_bytes()) as f64;
        Some(Self {
            kv_bytes: KvDims::model_bytes_for(cfg, p, n, residual),
            kv_layers: cfg.kv_layers(),
            layers: cfg.n_layer,
            state_bytes: state,
            state_layers: r.count(),
            snapshots: super::MAX_SNAPSHOTS,
            snapshot_bytes: state * super::MAX_SNAPSHOTS as f64,
            snapshots_at_most: true,
            uniform_bytes: (0..cfg.n_layer)
                .map(|i| KvDims::block(cfg, i).bytes_for(p, n, residual.min(n)))
                .sum(),
        })
    }
}

impl std::fmt::Display for MemoryByKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = |b: f64| crate::human_bytes(b as u64);
        let at_most = if self.snapshots_at_most {
            "at most "
        } else {
            ""
        };
        write!(
            f,
            "attention KV {} on {} of {} layers + recurrent state {} (fixed, f32) on the other {} + {at_most}{} snapshots of it ({}): {} held against {} for a uniform cache ({:.2}×)",
            h(self.kv_bytes),
            self.kv_layers,
            self.layers,
            h(self.state_bytes),
            self.state_layers,
            self.snapshots,
            h(self.snapshot_bytes),
            h(self.held()),
            h(self.uniform_bytes),
            if self.uniform_bytes > 0.0 {
                self.held() / self.uniform_bytes
            } else {
                1.0
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_holds_23040_bytes_a_token_at_f16_and_under_0_15_of_f32_at_int4() {
        let d = KvDims {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(d.bytes_per_token(Precision::F32), 46_080.0);
        assert_eq!(d.bytes_per_token(Precision::F16), 23_040.0);
        let f32 = d.bytes_per_token(Precision::F32);
        assert!(d.bytes_per_token(Precision::Int8) / f32 <= 0.27);
        assert!(d.bytes_per_token(Precision::Int4) / f32 <= 0.15);
    }
}
