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

/// How keys and values are stored, for the float strategies (the precision axis; INT8 is its own
/// strategy for now). f16 is the default, as in llama.cpp: half the bytes of f32, and the values
/// rounded once when stored (attention reads them widened to f32, exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    F32,
    F16,
    Bf16,
}

pub const DEFAULT_PRECISION: Precision = Precision::F16;

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::F16, Precision::Bf16];

    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// A cache strategy as a person names it, before the context size is known. Written as its parts
/// joined by `+`, in any order: a strategy (`none`, `full`, `window:N` with an optional sink count
/// after it, `offload`, `int8` or `int8:R`) and a precision (`f32`, `f16`, `bf16`; default f16):
/// `full`, `full+f32`, `window:256+4+bf16`, `none+f32`, `int8`. This is the one place such a name is
/// parsed; [`CacheMode::spec`] checks it against a context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    None {
        precision: Precision,
    },
    Full {
        precision: Precision,
    },
    Window {
        window: usize,
        sinks: usize,
        precision: Precision,
    },
    Int8 {
        residual: usize,
    },
    Offload {
        precision: Precision,
    },
}

impl std::str::FromStr for CacheMode {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let num = |what: &str, v: &str| -> Result<usize> {
            v.parse()
                .map_err(|_| anyhow::anyhow!("cache mode '{s}': '{v}' is not a {what}"))
        };
        let mut precision: Option<Precision> = None;
        let mut strategy: Option<CacheMode> = None;
        let mut set = |m: CacheMode| -> Result<()> {
            if strategy.replace(m).is_some() {
                anyhow::bail!("cache mode '{s}' names two strategies (choose one of none, full, window, offload, int8)");
            }
            Ok(())
        };
        let parts: Vec<&str> = s.split('+').collect();
        let mut i = 0;
        while i < parts.len() {
            let part = parts[i];
            match part {
                "none" => set(CacheMode::None {
                    precision: DEFAULT_PRECISION,
                })?,
                "full" => set(CacheMode::Full {
                    precision: DEFAULT_PRECISION,
                })?,
                "offload" => set(CacheMode::Offload {
                    precision: DEFAULT_PRECISION,
                })?,
                "int8" => set(CacheMode::Int8 {
                    residual: DEFAULT_RESIDUAL,
                })?,
                p if Precision::parse(p).is_some() => {
                    if precision.replace(Precision::parse(p).expect("checked")).is_some() {
                        anyhow::bail!("cache mode '{s}' names two precisions");
                    }
                }
                r if r.starts_with("int8:") => set(CacheMode::Int8 {
                    residual: num("residual position count", &r["int8:".len()..])?,
                })?,
                w if w.starts_with("window:") => {
                    let window = num("window size", &w["window:".len()..])?;
                    // A number right after the window is its sink count.
                    let sinks = match parts.get(i + 1) {
                        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                            i += 1;
                            num("sink count", n)?
                        }
                        _ => DEFAULT_SINKS,
                    };
                    set(CacheMode::Window {
                        window,
                        sinks,
                        precision: DEFAULT_PRECISION,
                    })?
                }
                other => anyhow::bail!(
                    "cache mode '{s}': unknown part '{other}' (none, full, window:N[+S], offload, int8[:R], f32, f16, bf16)"
                ),
            }
            i += 1;
        }
        let mode = strategy.unwrap_or(CacheMode::Full {
            precision: DEFAULT_PRECISION,
        });
        Ok(match (mode, precision) {
            (m, None) => m,
            (CacheMode::Int8 { .. }, Some(p)) => anyhow::bail!(
                "cache mode '{s}': int8 is its own precision; it does not combine with {} (yet)",
                p.name()
            ),
            (m, Some(p)) => m.with_precision(p),
        })
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CacheMode::None { .. } => write!(f, "none")?,
            CacheMode::Full { .. } => write!(f, "full")?,
            CacheMode::Offload { .. } => write!(f, "offload")?,
            CacheMode::Int8 { residual } if *residual == DEFAULT_RESIDUAL => write!(f, "int8")?,
            CacheMode::Int8 { residual } => write!(f, "int8:{residual}")?,
            CacheMode::Window { window, sinks, .. } => write!(f, "window:{window}+{sinks}")?,
        }
        match self.precision() {
            Some(p) if p != DEFAULT_PRECISION => write!(f, "+{}", p.name()),
            _ => Ok(()),
        }
    }
}

impl CacheMode {
    /// The float precision, for the strategies that have one.
    pub fn precision(&self) -> Option<Precision> {
        match *self {
            CacheMode::None { precision }
            | CacheMode::Full { precision }
            | CacheMode::Window { precision, .. }
            | CacheMode::Offload { precision } => Some(precision),
            CacheMode::Int8 { .. } => None,
        }
    }

    /// The same strategy at another float precision (INT8 stays INT8).
    pub fn with_precision(self, p: Precision) -> Self {
        match self {
            CacheMode::None { .. } => CacheMode::None { precision: p },
            CacheMode::Full { .. } => CacheMode::Full { precision: p },
            CacheMode::Offload { .. } => CacheMode::Offload { precision: p },
            CacheMode::Window { window, sinks, .. } => CacheMode::Window {
                window,
                sinks,
                precision: p,
            },
            m @ CacheMode::Int8 { .. } => m,
        }
    }

    /// The strategy for a context of `ctx` positions; impossible settings are refused here, in
    /// words that name the values.
    pub fn spec(&self, ctx: usize) -> Result<CacheSpec> {
        Ok(match *self {
            CacheMode::None { precision } => CacheSpec::None { precision },
            CacheMode::Full { precision } => CacheSpec::Full {
                max_positions: ctx,
                precision,
            },
            CacheMode::Offload { precision } => CacheSpec::Offload {
                max_positions: ctx,
                precision,
            },
            CacheMode::Int8 { residual } => CacheSpec::Int8 {
                max_positions: ctx,
                residual,
            },
            CacheMode::Window {
                window,
                sinks,
                precision,
            } => {
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
                CacheSpec::Window {
                    window,
                    sinks,
                    precision,
                }
            }
        })
    }
}

/// Which strategy, with its parameters: what `--no-cache` and the other cache flags select.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CacheSpec {
    /// No state: every step recomputes the whole sequence (the O(n²) baseline). Keys and values are
    /// rounded to `precision` as a cache would store them, so the recompute gives the cached
    /// strategy's exact numbers.
    None { precision: Precision },
    /// A contiguous per-layer buffer written in place, grown by doubling up to `max_positions`.
    Full {
        max_positions: usize,
        precision: Precision,
    },
    /// The first `sinks` positions and the last `window`, keys stored before RoPE and rotated by
    /// their place in the cache: memory bounded by `sinks + window`, length unbounded.
    Window {
        window: usize,
        sinks: usize,
        precision: Precision,
    },
    /// INT8 keys (per-channel scales over groups of tokens) and values (per-token scales), the most
    /// recent `residual` positions (and an incomplete key group) in f32.
    Int8 {
        max_positions: usize,
        residual: usize,
    },
    /// Like `Full`, but the cache lives in host memory and each layer is brought to the compute device
    /// for its attention, the next layer's copy started first.
    Offload {
        max_positions: usize,
        precision: Precision,
    },
}

impl CacheSpec {
    /// Short name, as `kvchat bench --modes` spells it (see [`CacheMode`]).
    pub fn name(&self) -> String {
        let p = |p: &Precision| {
            if *p == DEFAULT_PRECISION {
                String::new()
            } else {
                format!("+{}", p.name())
            }
        };
        match self {
            CacheSpec::None { precision } => format!("none{}", p(precision)),
            CacheSpec::Full { precision, .. } => format!("full{}", p(precision)),
            CacheSpec::Window {
                window,
                sinks,
                precision,
            } => format!("window:{window}+{sinks}{}", p(precision)),
            CacheSpec::Int8 { .. } => "int8".into(),
            CacheSpec::Offload { precision, .. } => format!("offload{}", p(precision)),
        }
    }

    /// The float precision of the storage (None for INT8).
    pub fn precision(&self) -> Option<Precision> {
        match self {
            CacheSpec::None { precision }
            | CacheSpec::Full { precision, .. }
            | CacheSpec::Window { precision, .. }
            | CacheSpec::Offload { precision, .. } => Some(*precision),
            CacheSpec::Int8 { .. } => None,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            CacheSpec::None { precision } => format!(
                "none (recompute every step, keys and values rounded to {})",
                precision.name()
            ),
            CacheSpec::Full {
                max_positions,
                precision,
            } => format!("full {}, up to {max_positions} positions", precision.name()),
            CacheSpec::Window {
                window,
                sinks,
                precision,
            } => format!(
                "window of {window} positions + {sinks} attention sinks, {}, keys rotated in-cache",
                precision.name()
            ),
            CacheSpec::Int8 {
                max_positions,
                residual,
            } => format!(
                "int8 (K per-channel over {}-token groups, V per-token), last {residual} positions f32, up to {max_positions} positions",
                int8::GROUP
            ),
            CacheSpec::Offload {
                max_positions,
                precision,
            } => format!(
                "full {} in host memory (offload), up to {max_positions} positions",
                precision.name()
            ),
        }
    }

    /// Whether the generation loop must feed the whole sequence at every step.
    pub fn recomputes(&self) -> bool {
        matches!(self, CacheSpec::None { .. })
    }

    /// The longest sequence this cache can hold; None when unbounded (a window).
    pub fn max_positions(&self) -> Option<usize> {
        match self {
            CacheSpec::None { .. } => None,
            CacheSpec::Full { max_positions, .. }
            | CacheSpec::Int8 { max_positions, .. }
            | CacheSpec::Offload { max_positions, .. } => Some(*max_positions),
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

    pub fn build(&self, cfg: &Config, device: &Device) -> KvCache {
        let (nkv, hd) = (cfg.n_kv_head, cfg.head_dim);
        let layers = (0..cfg.n_layer)
            .map(|_| -> Box<dyn LayerCache> {
                match self {
                    CacheSpec::None { precision } => {
                        Box::new(none::NoCache::new(precision.dtype()))
                    }
                    CacheSpec::Full {
                        max_positions,
                        precision,
                    } => Box::new(full::FullCache::new(
                        nkv,
                        hd,
                        *max_positions,
                        precision.dtype(),
                        device.clone(),
                    )),
                    CacheSpec::Window {
                        window,
                        sinks,
                        precision,
                    } => Box::new(window::WindowCache::new(
                        nkv,
                        hd,
                        *window,
                        *sinks,
                        precision.dtype(),
                        device.clone(),
                    )),
                    CacheSpec::Int8 {
                        max_positions,
                        residual,
                    } => Box::new(int8::Int8Cache::new(nkv, hd, *max_positions, *residual)),
                    CacheSpec::Offload {
                        max_positions,
                        precision,
                    } => Box::new(offload::OffloadCache::new(
                        nkv,
                        hd,
                        *max_positions,
                        precision.dtype(),
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
            // Offload holds the same state as the full cache: one file serves both.
            CacheSpec::Full { precision, .. } | CacheSpec::Offload { precision, .. } => {
                Ok(format!("full {}", precision.name()))
            }
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
            "none+f32",
            "full",
            "full+f32",
            "full+bf16",
            "int8",
            "int8:16",
            "offload",
            "offload+f32",
            "window:256+4",
            "window:64+0+bf16",
        ] {
            let m: CacheMode = name.parse().unwrap();
            assert_eq!(m.to_string(), name);
        }
        assert_eq!(
            "window:256".parse::<CacheMode>().unwrap(),
            CacheMode::Window {
                window: 256,
                sinks: DEFAULT_SINKS,
                precision: Precision::F16
            }
        );
        // Parts in any order; a precision alone means the full cache.
        assert_eq!(
            "f32+window:8+2".parse::<CacheMode>().unwrap().to_string(),
            "window:8+2+f32"
        );
        assert_eq!(
            "bf16".parse::<CacheMode>().unwrap().to_string(),
            "full+bf16"
        );
        for bad in [
            "window:x",
            "window:4+y",
            "int4",
            "",
            "full:3",
            "full+none",
            "f16+f32",
            "int8+f32",
        ] {
            assert!(bad.parse::<CacheMode>().is_err(), "{bad}");
        }
    }

    #[test]
    fn impossible_windows_are_refused_against_the_context() {
        let w = |window, sinks| CacheMode::Window {
            window,
            sinks,
            precision: Precision::F32,
        };
        assert!(w(0, 0).spec(100).is_err());
        assert!(w(4, 4).spec(100).is_err());
        assert!(w(50, 4).spec(100).is_err(), "needs 104 positions");
        assert!(w(usize::MAX / 2 + 1, 0).spec(100).is_err());
        assert_eq!(
            w(48, 4).spec(100).unwrap(),
            CacheSpec::Window {
                window: 48,
                sinks: 4,
                precision: Precision::F32
            }
        );
    }
}
