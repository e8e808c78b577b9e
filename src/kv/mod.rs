//! The KV cache: one [`layer::Layer`] per decoder layer, composed from three axes that flags choose
//! independently — precision (`rows.rs`: f32, f16, bf16, int8, int4), retention (all positions, a
//! window with sinks, or nothing: `--no-cache`) and placement (on the compute device, or offloaded
//! to host memory). Every combination is one code path per axis (`layer.rs`).
//!
//! Layout, stated once: each layer's keys and values arrive as `[1, n_kv_heads, t, head_dim]`; a
//! store keeps them as rows, `[n_kv_heads, slots, row]`, one row per position and head, keys rotated
//! at their absolute position. Attention reads the rows in place (`model::cache::KvView`).

pub mod layer;
pub mod paged;
pub mod persist;
pub mod prefix;
pub mod qrows;
pub mod rows;
pub mod size;

mod mode;
mod states;
pub use mode::*;
pub use states::*;

use crate::model::cache::LayerCache;
pub use crate::model::cache::{Attend, DecoderCache, KvView, Precision};
use crate::model::config::Config;
use crate::model::deltanet::RecurrentState;
#[cfg(test)]
use crate::model::rope::Rope;
use anyhow::Result;
#[cfg(test)]
use candle_core::DType;
use candle_core::Device;
pub use layer::{
    newest_kept, Evict, Layer, LayerSpec, Queries, Retention, SharedBlock, OBSERVE_WINDOW,
    SHARED_BLOCK, SLACK,
};

/// Attention sinks kept by a window unless told otherwise.
pub const DEFAULT_SINKS: usize = 4;
/// Most recent positions a quantized cache also keeps in f16 unless told otherwise.
pub const DEFAULT_RESIDUAL: usize = 32;
/// The default precision, as in llama.cpp.
pub const DEFAULT_PRECISION: Precision = Precision::F16;

/// A cache configuration with its context: what a session's cache is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSpec {
    pub mode: CacheMode,
    /// The most positions the sequence may reach (a window holds fewer and runs on past it).
    pub max_positions: usize,
    /// How a layer's own store grows (`kv::layer::grown_capacity`): None, by doubling from 256
    /// positions (one sequence: its rows copied O(log n) times); `Some(n)`, n positions at a
    /// time (a server's pool: at most n − 1 positions held beyond those used).
    pub grow_by: Option<usize>,
}

impl serde::Serialize for CacheSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("CacheSpec", 5)?;
        st.serialize_field("name", &self.name())?;
        st.serialize_field("precision", &self.mode.precision)?;
        st.serialize_field("retention", &self.mode.retention)?;
        st.serialize_field("offload", &self.mode.offload)?;
        st.serialize_field("max_positions", &self.max_positions)?;
        st.end()
    }
}

impl CacheSpec {
    /// Every position kept, at `precision`, for a context of `ctx`.
    pub const fn full(precision: Precision, ctx: usize) -> Self {
        Self {
            mode: CacheMode {
                precision,
                retention: Retention::All,
                offload: false,
                residual: DEFAULT_RESIDUAL,
                budget_bytes: None,
            },
            max_positions: ctx,
            grow_by: None,
        }
    }

    /// Nothing kept: the recompute baseline, keys and values rounded to `precision`.
    pub fn none(precision: Precision) -> Self {
        Self {
            mode: CacheMode {
                precision,
                retention: Retention::None,
                ..CacheMode::default()
            },
            max_positions: usize::MAX,
            grow_by: None,
        }
    }

    /// The same cache with another retention / precision / placement.
    pub fn with(mut self, f: impl FnOnce(&mut CacheMode)) -> Self {
        f(&mut self.mode);
        self
    }

    /// Short name, as `kvchat bench --modes` spells it (see [`CacheMode`]).
    pub fn name(&self) -> String {
        self.mode.to_string()
    }

    pub fn precision(&self) -> Precision {
        self.mode.precision
    }

    pub fn retention(&self) -> Retention {
        self.mode.retention
    }

    pub fn describe(&self) -> String {
        let m = &self.mode;
        let precision = match m.precision {
            p if p.quantized() => format!(
                "{} (groups of {} values, f16 scales, rows Hadamard-rotated; last {} positions also f16)",
                p.name(),
                crate::model::kernels::kvrows::QK,
                m.residual
            ),
            p => p.name().to_string(),
        };
        let retention = match m.retention {
            Retention::None => {
                "none (recompute every step, keys and values rounded as stored)".to_string()
            }
            Retention::All => format!("all positions, up to {}", self.max_positions),
            Retention::Window { window, sinks } => {
                format!("window of {window} positions + {sinks} attention sinks")
            }
            Retention::Budget {
                budget,
                sinks,
                evict,
                pyramid,
            } => format!(
                "budget of {budget} positions{} chosen by {} ({}), {sinks} attention sinks and the newest {} always kept, up to {SLACK} more between evictions",
                if pyramid {
                    " per layer on average (pyramid: lower layers more)"
                } else {
                    " per layer"
                },
                evict.name(),
                evict.what(),
                m.newest_kept(),
            ),
        };
        let placement = if m.offload {
            "host memory (offload)"
        } else {
            "compute device"
        };
        format!("precision {precision}; retention {retention}; placement {placement}")
    }

    /// What this cache does on a model of `cfg` that its settings do not say: on a model with
    /// recurrent layers (Qwen3.5), a window or budget bounds the attention layers' keys and values
    /// only.
    pub fn notes(&self, cfg: &Config) -> Vec<String> {
        let bounded = match self.mode.retention {
            Retention::Window { .. } => "a window",
            Retention::Budget { .. } => "a budget",
            Retention::All | Retention::None => return Vec::new(),
        };
        match &cfg.recurrent {
            Some(r) => vec![format!(
                "{bounded} applies to the {} attention layers only; the {} DeltaNet layers keep a fixed recurrent state",
                cfg.kv_layers(),
                r.count()
            )],
            None => Vec::new(),
        }
    }

    /// Whether the generation loop must feed the whole sequence at every step.
    pub fn recomputes(&self) -> bool {
        self.mode.retention == Retention::None
    }

    /// The longest sequence this cache can hold; None when unbounded (a window, or none).
    pub fn max_positions(&self) -> Option<usize> {
        (self.mode.retention == Retention::All).then_some(self.max_positions)
    }

    /// Whether the sequence may not outgrow the context (a window holds a bounded number of
    /// positions however long the sequence runs).
    pub fn bounded_by_context(&self) -> bool {
        self.mode.bounded_by_context()
    }

    /// Why this cache cannot hold rows of this model, if it cannot.
    pub fn unfit(&self, cfg: &Config) -> Option<String> {
        cfg.kv_shapes()
            .find_map(|(_, hd)| self.mode.precision.unfit(hd))
    }

    /// KV layer `c`'s axes (those of block `cfg.kv_block(c)`): the configured ones, except that
    /// a layer the model declares a sliding window for keeps no more than that window (and no
    /// sinks), and its attention sees, per query, only that window. A `--kv-window` narrower
    /// than the model's is the user's approximation (sinks and a ring) and governs that layer
    /// alone.
    pub fn layer_spec(&self, cfg: &Config, c: usize) -> LayerSpec {
        let m = &self.mode;
        let declared_window = cfg.layer_window(cfg.kv_block(c));
        // The declared window plus a few spare positions, so that a chat going back a few
        // tokens (a re-tokenized answer, /undo of a short turn) still has every key its next
        // query needs; attention still sees only the declared window.
        let declared = Retention::Window {
            window: declared_window.unwrap_or(0) + DECLARED_WINDOW_SPARE,
            sinks: 0,
        };
        let (retention, attend_window) = match (m.retention, declared_window) {
            (Retention::All | Retention::Budget { .. }, Some(w)) => (declared, Some(w)),
            (
                Retention::Budget {
                    budget,
                    sinks,
                    evict,
                    pyramid: true,
                },
                None,
            ) => (
                Retention::Budget {
                    budget: pyramid_budget(budget, budget_least(sinks, m.newest_kept()), c, cfg),
                    sinks,
                    evict,
                    pyramid: true,
                },
                None,
            ),
            (Retention::Window { window, .. }, Some(w)) if w <= window => (declared, Some(w)),
            (Retention::None, Some(w)) => (Retention::None, Some(w)),
            (r, _) => (r, None),
        };
        LayerSpec {
            precision: m.precision,
            retention,
            offload: m.offload,
            residual: m.residual,
            max_positions: self.max_positions,
            attend_window,
            grow_by: self.grow_by,
        }
    }

    /// The cache for a model of `cfg`: rows in host memory, read in place by the CPU's attention
    /// kernel (`tensors_on` None), or as tensors on a device (a GPU, or the CPU running the GPU's
    /// path: `Engine::kv_device`).
    pub fn build(&self, cfg: &Config, tensors_on: Option<&Device>) -> KvCache {
        // Layers that share an earlier layer's keys and values (Gemma 4) keep none; DeltaNet
        // layers (Qwen3.5) keep a recurrent state instead.
        let layers = (0..cfg.kv_layers())
            .map(|c| {
                let (nkv, hd) = cfg.kv_shape(c);
                Layer::new(&self.layer_spec(cfg, c), nkv, hd, tensors_on)
            })
            .collect();
        let states = match &cfg.recurrent {
            Some(r) => States::new(r),
            None => States::default(),
        };
        KvCache {
            spec: self.clone(),
            layers,
            states,
            verifying: false,
        }
    }
}

/// KV layer `c`'s share of a pyramid budget (PyramidKV): from 1.5 × `budget` at the first KV
/// layer that takes a budget down to 0.5 × at the last, in a straight line, so the layers hold
/// `budget` on average; never below `least` ([`budget_least`]). Layers with a declared window
/// keep their window and take no share.
pub fn pyramid_budget(budget: usize, least: usize, c: usize, cfg: &Config) -> usize {
    let budgeted = |k: &usize| cfg.layer_window(cfg.kv_block(*k)).is_none();
    let n = (0..cfg.kv_layers()).filter(budgeted).count();
    let rank = (0..c).filter(budgeted).count();
    let share = if n > 1 {
        1.5 - rank as f64 / (n - 1) as f64
    } else {
        1.0
    };
    ((budget as f64 * share).round() as usize).max(least)
}

/// All layers' caches for one sequence.
pub struct KvCache {
    spec: CacheSpec,
    layers: Vec<Layer>,
    /// The recurrent states of a model's DeltaNet layers (none for other models).
    states: States,
    /// The forwards under way verify drafts ([`KvCache::verify_drafts`]).
    verifying: bool,
}

impl DecoderCache for KvCache {
    fn n_layers(&self) -> usize {
        self.layers.len()
    }
    fn layer(&mut self, i: usize) -> &mut dyn LayerCache {
        &mut self.layers[i]
    }
    fn recomputes(&self) -> bool {
        self.spec.recomputes()
    }
    fn max_step(&self) -> Option<usize> {
        None
    }
    fn step_done(&mut self) {
        for l in &mut self.layers {
            l.step_done();
        }
        self.states.at = self.seen();
        self.states.changed = false;
    }
    fn state(&mut self, r: usize) -> Result<&mut RecurrentState> {
        self.states.changed = true;
        let n = self.states.now.len();
        self.states
            .now
            .get_mut(r)
            .ok_or_else(|| anyhow::anyhow!("recurrent layer {r} of {n} asked for"))
    }
    fn forward_begins(&mut self, positions: usize) -> Result<()> {
        if self.spec.recomputes() {
            // The whole sequence runs again: the states start from nothing.
            self.states.clear();
        } else if positions > 1 {
            let seen = self.seen();
            self.states.snapshot(seen);
        }
        let apart = self.rows_apart();
        for l in &mut self.layers {
            if apart {
                l.verify_begins()?;
            } else {
                l.forward_begins(positions)?;
            }
        }
        Ok(())
    }
    fn rows_apart(&self) -> bool {
        self.verifying && !self.spec.mode.verifies_batched()
    }
}

impl KvCache {
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }
    pub fn layers_mut(&mut self) -> &mut [Layer] {
        &mut self.layers
    }
    /// While `on`, forwards verify drafts: their first row stays, the rows after it may be taken
    /// back by a truncation; a cache that cannot attend them together attends them apart
    /// ([`CacheMode::verifies_batched`]).
    pub fn verify_drafts(&mut self, on: bool) {
        self.verifying = on;
    }
    /// The most guesses a verification may take after its first row ([`Layer::draft_room`]).
    pub fn draft_room(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.draft_room())
            .min()
            .unwrap_or(usize::MAX)
    }
    /// While `on`, a budget's evictions wait (see [`Layer::hold_evictions`]).
    pub fn hold_evictions(&mut self, on: bool) {
        for l in &mut self.layers {
            l.hold_evictions(on);
        }
    }
    /// Makes the evictions that waited and stops holding them.
    pub fn evict_held(&mut self) -> Result<()> {
        for l in &mut self.layers {
            l.evict_held()?;
        }
        Ok(())
    }
    /// Whether every layer holds every position it has seen in slot order (no budget evicted).
    pub fn by_position(&self) -> bool {
        self.layers.iter().all(|l| l.by_position())
    }
    /// Positions held (the most any layer holds).
    pub fn len(&self) -> usize {
        self.layers.iter().map(|l| l.len()).max().unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Positions of the sequence seen so far.
    pub fn seen(&self) -> usize {
        self.layers.first().map_or(0, |l| l.seen())
    }
    /// Drops every position from `len` on, in every layer — or, when some layer cannot go back
    /// that far, in none (an error names why). A model with recurrent states goes back to the
    /// newest snapshot at or before `len` ([`States`]): `seen()` then tells where, and the
    /// positions from there to `len` are to be computed again (`Session::truncate` does).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let states = self.goes_back_to_snapshots();
        let to = match states {
            true => self.states.back_to(len.min(self.seen())),
            false => len,
        };
        if let Some(why) = self.layers.iter().find_map(|l| l.truncate_refusal(to)) {
            anyhow::bail!(why);
        }
        for l in &mut self.layers {
            l.truncate(to)?;
        }
        if states {
            self.states.restore(to);
        }
        Ok(())
    }

    /// Whether `truncate` goes back to a snapshot of recurrent states (which may be before its
    /// target) rather than to the target itself.
    pub fn goes_back_to_snapshots(&self) -> bool {
        !self.states.now.is_empty() && !self.spec.recomputes()
    }

    /// The recurrent states (Qwen3.5's DeltaNet layers; empty for other models).
    pub fn states(&self) -> &States {
        &self.states
    }

    /// Keeps a snapshot of the recurrent states where the sequence stands (none for a model
    /// without them), so that going back there restores it instead of computing from further back.
    pub fn snapshot_states(&mut self) {
        let seen = self.seen();
        self.states.snapshot(seen);
    }

    /// Puts saved states in, as they stood after the first `at` positions (which the attention
    /// layers hold), with snapshots at earlier positions (oldest first) in place of those kept.
    pub fn restore_states(
        &mut self,
        states: Vec<RecurrentState>,
        at: usize,
        snapshots: Vec<(usize, Vec<RecurrentState>)>,
    ) -> Result<()> {
        let like = |s: &[RecurrentState]| {
            s.len() == self.states.now.len()
                && s.iter()
                    .zip(&self.states.now)
                    .all(|(a, b)| a.conv.len() == b.conv.len() && a.matrix.len() == b.matrix.len())
        };
        if !like(&states) || !snapshots.iter().all(|(_, s)| like(s)) {
            anyhow::bail!(
                "{} recurrent states given for a model of {} of another shape",
                states.len(),
                self.states.now.len()
            );
        }
        let ordered = snapshots.windows(2).all(|w| w[0].0 < w[1].0);
        if snapshots.len() > MAX_SNAPSHOTS || !ordered || snapshots.iter().any(|(p, _)| *p > at) {
            anyhow::bail!("snapshots of recurrent states out of order or past position {at}");
        }
        self.states.now = states;
        self.states.at = at;
        self.states.changed = false;
        self.states.snapshots = snapshots;
        Ok(())
    }
    pub fn reset(&mut self) -> Result<()> {
        self.truncate(0)?;
        self.states.clear();
        Ok(())
    }
    /// What must match for a saved state to be loaded into this cache: the axes, not the capacity.
    pub fn persist_key(&self) -> Result<String> {
        if self.spec.recomputes() {
            return Err(crate::fixable(
                crate::Fix::FullCache,
                "with no cache there is no KV state to save".into(),
            ));
        }
        let m = &self.spec.mode;
        let retention = match m.retention {
            Retention::Window { window, sinks } => format!("window {window} sinks {sinks}"),
            _ => "all".into(),
        };
        let residual = if m.precision.quantized() {
            format!(" residual {}", m.residual)
        } else {
            String::new()
        };
        // Placement is not part of it: offloaded or not, the rows are the same.
        Ok(format!("{retention}, {}{residual}", m.precision.name()))
    }
    /// Bytes resident in all layers now (allocated storage), recurrent states and their
    /// snapshots included.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum::<usize>()
            + self.states.bytes()
            + self.states.snapshot_bytes()
    }
    /// Bytes the positions held occupy (what `kv-size` predicts for this many positions).
    pub fn bytes_used(&self) -> usize {
        self.layers.iter().map(|l| l.bytes_used()).sum()
    }

    /// Its memory by kind (a model with recurrent layers), as it stands; None for other models.
    pub fn memory_by_kind(&self, cfg: &crate::model::Config) -> Option<size::MemoryByKind> {
        let r = cfg.recurrent.as_ref()?;
        let states = self.states();
        Some(size::MemoryByKind {
            kv_bytes: self.bytes_used() as f64,
            kv_layers: cfg.kv_layers(),
            layers: cfg.n_layer,
            state_bytes: states.bytes() as f64,
            state_layers: r.count(),
            snapshots: states.counts().1,
            snapshot_bytes: states.snapshot_bytes() as f64,
            snapshots_at_most: false,
            uniform_bytes: self.bytes_uniform(cfg),
        })
    }

    /// What a cache of the same axes would hold for the positions seen if no layer kept less than
    /// the others (the model's declared windows ignored, and every layer keeping its own keys
    /// and values, shared or not): the saving's reference.
    pub fn bytes_uniform(&self, cfg: &crate::model::Config) -> f64 {
        (0..cfg.n_layer)
            .map(|i| size::KvDims::block(cfg, i).bytes_for_mode(&self.spec.mode, self.seen()))
            .sum()
    }
}

/// A RoPE table for unit tests of the caches, heads of `hd` values.
#[cfg(test)]
pub(crate) fn test_rope(max_positions: usize, hd: usize) -> Rope {
    let cfg = test_config(1, hd);
    Rope::new(&cfg, max_positions, None, DType::F32, &Device::Cpu).unwrap()
}

/// Positions a layer with a model-declared window keeps beyond it (see `CacheSpec::layer_spec`):
/// more than a verified draft takes back (at most 32 guesses and the token before them).
pub const DECLARED_WINDOW_SPARE: usize = 64;

/// A config with `nkv` KV heads of `hd` values, for unit tests.
#[cfg(test)]
pub(crate) use crate::model::config::test_config;

/// A Qwen3.5-like config for unit tests: `n_layer` blocks, every `every`-th attending (`nkv` KV
/// heads of `hd` values), the others Gated DeltaNet layers.
#[cfg(test)]
pub(crate) fn test_hybrid_config(n_layer: usize, every: usize, nkv: usize, hd: usize) -> Config {
    let mut cfg = test_config(nkv, hd);
    cfg.arch = "qwen35".into();
    cfg.pieces = crate::model::arch::find("qwen35").unwrap().pieces;
    cfg.n_layer = n_layer;
    cfg.recurrent = Some(crate::model::config::Recurrent {
        layers: (0..n_layer).map(|i| (i + 1) % every != 0).collect(),
        conv: 4,
        k_heads: 1,
        v_heads: 1,
        head_dim: 8,
    });
    cfg.remap();
    cfg.validate().unwrap();
    cfg
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
            "full+int8",
            "full+int8:16",
            "full+int4",
            "full+offload",
            "full+f32+offload",
            "window:256+4",
            "window:64+0+bf16",
            "window:512+4+int8+offload",
            "window:512+4+int4:0",
            "budget:512:snapkv+4",
            "budget:300:h2o:pyramid+0+int4+offload",
        ] {
            let m: CacheMode = name.parse().unwrap();
            assert_eq!(m.to_string(), name);
        }
        let w = "window:256".parse::<CacheMode>().unwrap();
        assert_eq!(
            w.retention,
            Retention::Window {
                window: 256,
                sinks: DEFAULT_SINKS
            }
        );
        assert_eq!(w.precision, Precision::F16);
    }

    #[test]
    fn cache_mode_parts_come_in_any_order_and_default_to_a_full_f16_cache() {
        let m = |s: &str| s.parse::<CacheMode>().unwrap().to_string();
        assert_eq!(m("f32+window:8+2"), "window:8+2+f32");
        assert_eq!(m("bf16"), "full+bf16");
        assert_eq!(m("int8"), "full+int8");
        assert_eq!(m("offload+int4"), "full+int4+offload");
    }

    #[test]
    fn malformed_cache_modes_are_refused() {
        for bad in [
            "window:x",
            "window:64+y",
            "int3",
            "",
            "full:3",
            "full+none",
            "f16+f32",
            "int8+int4",
            "f16:4",
            "offload+offload",
            "none+offload",
        ] {
            assert!(bad.parse::<CacheMode>().is_err(), "{bad}");
        }
    }

    #[test]
    fn impossible_windows_are_refused() {
        let w = |window, sinks| CacheMode {
            retention: Retention::Window { window, sinks },
            ..CacheMode::default()
        };
        assert!(w(0, 0).spec(100).is_err());
        assert!(w(4, 4).spec(100).is_err());
        assert!(w(97, 4).spec(100).is_err(), "101 positions held");
        assert!(w(96, 4).spec(100).is_ok());
    }

    #[test]
    fn int4_refuses_a_head_dim_its_groups_cannot_split() {
        let spec = CacheSpec::full(Precision::Int4, 64);
        let why = spec.unfit(&test_config(1, 48)).unwrap();
        assert!(
            why.contains("int4") && why.contains("head_dim of 48"),
            "{why}"
        );
        assert!(spec.unfit(&test_config(1, 64)).is_none());
    }

    #[test]
    fn a_layer_the_model_declares_a_window_for_keeps_only_that_window_and_attends_within_it() {
        let mut cfg = test_config(1, 8);
        cfg.sliding_window = Some((16, vec![true]));
        let spec = CacheSpec::full(Precision::F16, 1024).layer_spec(&cfg, 0);
        assert_eq!(
            spec.retention,
            Retention::Window {
                window: 16 + DECLARED_WINDOW_SPARE,
                sinks: 0
            }
        );
        assert_eq!(spec.attend_window, Some(16));
        // Recomputing keeps nothing, and still attends within the window.
        let none = CacheSpec::none(Precision::F16).layer_spec(&cfg, 0);
        assert_eq!(
            (none.retention, none.attend_window),
            (Retention::None, Some(16))
        );
    }

    #[test]
    fn memory_by_kind_counts_what_the_server_reserves_for_a_sequence() {
        let cfg = test_hybrid_config(8, 4, 2, 64);
        let m = size::MemoryByKind::predicted(&cfg, Precision::F16, 1000, 0).unwrap();
        let spec = CacheSpec::full(Precision::F16, 1000);
        assert_eq!(
            m.held(),
            size::KvDims::bytes_at_most(&spec, &cfg, 1000, 100)
        );
        assert_eq!(
            (m.kv_layers, m.state_layers, m.snapshots),
            (2, 6, MAX_SNAPSHOTS)
        );
        // Keys and values on all 8 layers, 4× the 2 attention layers'.
        assert_eq!(m.uniform_bytes, 4.0 * m.kv_bytes);
    }

    #[test]
    fn a_pyramid_budget_on_a_hybrid_model_ranks_its_kv_layers_as_the_arithmetic_does() {
        // Qwen3.5's shape: 24 blocks, every 4th attends (3, 7, …, 23): 6 KV layers. Ranked by
        // block number, block 3 took rank 3 and the rest rank 0 (8.4 N where 6 N was counted).
        let cfg = test_hybrid_config(24, 4, 2, 64);
        assert_eq!(cfg.layer_map().kv_blocks(), [3, 7, 11, 15, 19, 23]);
        let spec = CacheSpec::full(Precision::F16, 4096).with(|m| {
            m.retention = Retention::Budget {
                budget: 200,
                sinks: 4,
                evict: Evict::SnapKv,
                pyramid: true,
            }
        });
        let budget = |r: Retention| match r {
            Retention::Budget { budget, .. } => budget,
            r => panic!("{r:?}"),
        };
        let built: Vec<usize> = spec
            .build(&cfg, None)
            .layers()
            .iter()
            .map(|l| budget(l.retention()))
            .collect();
        let counted: Vec<usize> = (0..cfg.kv_layers())
            .map(|c| budget(spec.layer_spec(&cfg, c).retention))
            .collect();
        assert_eq!(built, [300, 260, 220, 180, 140, 100]);
        assert_eq!(built, counted);
    }

    #[test]
    fn a_pyramid_budget_gives_lower_layers_more_and_keeps_the_total() {
        let mut cfg = test_config(1, 8);
        cfg.n_layer = 30;
        cfg.remap();
        let spec = CacheSpec::full(Precision::F16, 4096).with(|m| {
            m.retention = Retention::Budget {
                budget: 512,
                sinks: 4,
                evict: Evict::SnapKv,
                pyramid: true,
            }
        });
        let budgets: Vec<usize> = (0..30)
            .map(|i| match spec.layer_spec(&cfg, i).retention {
                Retention::Budget { budget, .. } => budget,
                r => panic!("{r:?}"),
            })
            .collect();
        assert_eq!((budgets[0], budgets[29]), (768, 256));
        assert!(budgets.windows(2).all(|w| w[0] >= w[1]));
        let total: usize = budgets.iter().sum();
        assert!(total.abs_diff(30 * 512) <= 15, "{total}");
        // A model's declared-window layers keep their window; the budget is the others'.
        cfg.sliding_window = Some((64, (0..30).map(|i| i % 6 != 5).collect()));
        cfg.remap();
        let global: Vec<usize> = (0..30)
            .filter_map(|i| match spec.layer_spec(&cfg, i).retention {
                Retention::Budget { budget, .. } => Some(budget),
                _ => None,
            })
            .collect();
        assert_eq!(global, [768, 640, 512, 384, 256]);
    }
}
