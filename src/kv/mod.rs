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

pub use crate::model::cache::{Attend, DecoderCache, KvView, LayerCache};
use crate::model::config::Config;
#[cfg(test)]
use crate::model::rope::Rope;
use anyhow::Result;
use candle_core::{DType, Device, Tensor};

/// Attention sinks kept by a window unless told otherwise.
pub const DEFAULT_SINKS: usize = 4;
/// Most recent positions INT8 keeps in f32 unless told otherwise.
pub const DEFAULT_RESIDUAL: usize = 32;

/// A cache strategy as a person names it, before the context size is known: `none`, `full`,
/// `int8`, `int8:R` (R recent positions in f32), `offload`, `window:N` or `window:N+S` (S sinks).
/// This is the one place such a name is parsed; [`CacheMode::spec`] checks it against a context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    None,
    Full,
    Window { window: usize, sinks: usize },
    Int8 { residual: usize },
    Offload,
}

impl std::str::FromStr for CacheMode {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let num = |what: &str, v: &str| -> Result<usize> {
            v.parse()
                .map_err(|_| anyhow::anyhow!("cache mode '{s}': '{v}' is not a {what}"))
        };
        Ok(match s {
            "none" => CacheMode::None,
            "full" => CacheMode::Full,
            "offload" => CacheMode::Offload,
            "int8" => CacheMode::Int8 {
                residual: DEFAULT_RESIDUAL,
            },
            _ => {
                if let Some(r) = s.strip_prefix("int8:") {
                    CacheMode::Int8 {
                        residual: num("residual position count", r)?,
                    }
                } else if let Some(w) = s.strip_prefix("window:") {
                    let (n, k) = w.split_once('+').unwrap_or((w, ""));
                    CacheMode::Window {
                        window: num("window size", n)?,
                        sinks: if k.is_empty() {
                            DEFAULT_SINKS
                        } else {
                            num("sink count", k)?
                        },
                    }
                } else {
                    anyhow::bail!(
                        "unknown cache mode '{s}' (none, full, int8[:R], offload, window:N[+S])"
                    )
                }
            }
        })
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheMode::None => write!(f, "none"),
            CacheMode::Full => write!(f, "full"),
            CacheMode::Offload => write!(f, "offload"),
            CacheMode::Int8 { residual } if *residual == DEFAULT_RESIDUAL => write!(f, "int8"),
            CacheMode::Int8 { residual } => write!(f, "int8:{residual}"),
            CacheMode::Window { window, sinks } => write!(f, "window:{window}+{sinks}"),
        }
    }
}

impl CacheMode {
    /// The strategy for a context of `ctx` positions; impossible settings are refused here, in
    /// words that name the values.
    pub fn spec(&self, ctx: usize) -> Result<CacheSpec> {
        Ok(match *self {
            CacheMode::None => CacheSpec::None,
            CacheMode::Full => CacheSpec::Full { max_positions: ctx },
            CacheMode::Offload => CacheSpec::Offload { max_positions: ctx },
            CacheMode::Int8 { residual } => CacheSpec::Int8 {
                max_positions: ctx,
                residual,
            },
            CacheMode::Window { window, sinks } => {
                if window == 0 {
                    anyhow::bail!("a window must hold at least 1 position");
                }
                if sinks >= window {
                    anyhow::bail!("{sinks} sinks do not fit a window of {window} (fewer sinks than positions)");
                }
                // Positions inside the cache reach sinks + 2 × window during a step (the rotation
                // table has `ctx` positions).
                match window.checked_mul(2).and_then(|w| w.checked_add(sinks)) {
                    Some(n) if n <= ctx => {}
                    Some(n) => anyhow::bail!(
                        "a window of {window} with {sinks} sinks needs a context of at least {n} (it is {ctx})"
                    ),
                    None => anyhow::bail!("a window of {window} positions is too large (the context is {ctx})"),
                }
                CacheSpec::Window { window, sinks }
            }
        })
    }
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

    /// Whether the sequence may not outgrow the context (a window holds a bounded number of
    /// positions however long the sequence runs).
    pub fn bounded_by_context(&self) -> bool {
        !matches!(self, CacheSpec::Window { .. })
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

impl DecoderCache for KvCache {
    fn n_layers(&self) -> usize {
        self.layers.len()
    }
    fn layer(&mut self, i: usize) -> &mut dyn LayerCache {
        self.layers[i].as_mut()
    }
    fn recomputes(&self) -> bool {
        self.spec.recomputes()
    }
    fn max_step(&self) -> Option<usize> {
        self.spec.max_step()
    }
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
            other => Err(crate::fixable(
                crate::Fix::FullCache,
                format!(
                    "saving the KV state is not supported with the {} cache yet",
                    other.name()
                ),
            )),
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

/// A RoPE table for unit tests of the strategies: one KV head of size 2.
#[cfg(test)]
pub(crate) fn test_rope(max_positions: usize) -> Rope {
    let cfg = Config {
        arch: "llama".into(),
        n_layer: 1,
        n_head: 1,
        n_kv_head: 1,
        head_dim: 2,
        hidden: 2,
        ffn: 2,
        vocab: 2,
        ctx_train: max_positions,
        rope_base: 10_000.0,
        rope_dim: 2,
        rope_linear_scale: 1.0,
        rope_style: crate::model::config::RopeStyle::Interleaved,
        rms_eps: 1e-5,
    };
    Rope::new(&cfg, max_positions, None, DType::F32, &Device::Cpu).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_mode_names_round_trip() {
        for name in [
            "none",
            "full",
            "int8",
            "int8:16",
            "offload",
            "window:256+4",
            "window:64+0",
        ] {
            let m: CacheMode = name.parse().unwrap();
            assert_eq!(m.to_string(), name);
        }
        assert_eq!(
            "window:256".parse::<CacheMode>().unwrap(),
            CacheMode::Window {
                window: 256,
                sinks: DEFAULT_SINKS
            }
        );
        for bad in ["window:x", "window:4+y", "int4", "", "full:3"] {
            assert!(bad.parse::<CacheMode>().is_err(), "{bad}");
        }
    }

    #[test]
    fn impossible_windows_are_refused_against_the_context() {
        let w = |window, sinks| CacheMode::Window { window, sinks };
        assert!(w(0, 0).spec(100).is_err());
        assert!(w(4, 4).spec(100).is_err());
        assert!(w(50, 4).spec(100).is_err(), "needs 104 positions");
        assert!(w(usize::MAX / 2 + 1, 0).spec(100).is_err());
        assert_eq!(
            w(48, 4).spec(100).unwrap(),
            CacheSpec::Window {
                window: 48,
                sinks: 4
            }
        );
    }
}
