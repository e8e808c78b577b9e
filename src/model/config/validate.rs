//! A config's checks: counts and sizes in range (before a layer map is built of them), then the
//! shapes and the layer map's sense.

use super::*;
use anyhow::bail;

impl Config {
    /// Gemma 4's per-layer shapes: sizes in range, and each shared layer's source of its own
    /// kind and shape.
    fn validate_recurrent(&self, r: &Recurrent) -> Result<()> {
        if r.layers.len() != self.n_layer {
            bail!(
                "recurrent layer flags for {} layers in a model of {}",
                r.layers.len(),
                self.n_layer
            );
        }
        if self.kv_layers() == 0 {
            bail!(
                "model has no attention layer: every layer is recurrent, which kvchat does not run"
            );
        }
        if !(2..=64).contains(&r.conv) {
            bail!(
                "model ssm.conv_kernel = {} is not usable (2 to 64 taps)",
                r.conv
            );
        }
        if r.head_dim == 0 || r.head_dim > 1024 || r.k_heads == 0 || r.v_heads > 4096 {
            bail!(
                "model ssm.state_size = {}, ssm.group_count = {} is not usable (heads of 1 to 1024 values, at least one key head)",
                r.head_dim,
                r.k_heads
            );
        }
        if r.v_heads == 0 || !r.v_heads.is_multiple_of(r.k_heads) {
            bail!(
                "model ssm.time_step_rank = {} value heads are not a multiple of ssm.group_count = {} key heads",
                r.v_heads,
                r.k_heads
            );
        }
        Ok(())
    }

    fn validate_layers(&self, l: &LayerShapes) -> Result<()> {
        let (hl, rl) = (l.head_dim_local, l.rope_dim_local);
        if hl == 0 || hl > 4096 || rl == 0 || rl > hl || !rl.is_multiple_of(2) {
            bail!(
                "sliding-window layers' head size {hl} with {rl} rotated dimensions is not usable"
            );
        }
        for (i, (&k, &f)) in l.kv_heads.iter().zip(&l.ffn).enumerate() {
            if k == 0 || k > 4096 || !self.n_head.is_multiple_of(k) {
                bail!(
                    "layer {i}'s head_count_kv = {k} does not divide its {} attention heads",
                    self.n_head
                );
            }
            if f == 0 || f > 1 << 20 {
                bail!("layer {i}'s feed_forward_length = {f} is out of range");
            }
        }
        if l.shared_kv == 0 {
            return Ok(());
        }
        let own = self
            .n_layer
            .checked_sub(l.shared_kv)
            .filter(|&own| own >= 2);
        let Some(own) = own else {
            bail!(
                "GGUF {}.attention.shared_kv_layers = {} leaves fewer than 2 of {} layers with KV of their own",
                self.arch,
                l.shared_kv,
                self.n_layer
            );
        };
        let map = self.layer_map();
        for i in own..self.n_layer {
            let source = map
                .kv_source(i)
                .and_then(|c| map.kv_blocks().get(c).copied());
            let Some(s) = source else {
                bail!("layer {i} shares keys and values, but no earlier layer keeps any");
            };
            let kind = |l: usize| self.layer_window(l).is_some();
            if kind(s) != kind(i) || self.layer_kv_shape(s) != self.layer_kv_shape(i) {
                bail!(
                    "layer {i} shares the keys and values of layer {s} (GGUF {}.attention.shared_kv_layers = {}), which is not of its kind and shape",
                    self.arch,
                    l.shared_kv
                );
            }
        }
        Ok(())
    }

    /// The counts and sizes in range (what a layer map may be built from).
    pub(super) fn validate_sizes(&self) -> Result<()> {
        if self.n_layer == 0 || self.n_head == 0 || self.n_kv_head == 0 || self.head_dim == 0 {
            bail!(
                "model has zero layers, heads or head size ({} layers, {} heads, {} KV heads, head size {})",
                self.n_layer,
                self.n_head,
                self.n_kv_head,
                self.head_dim
            );
        }
        // Limits far above any real model: a file beyond them is damaged, and taking it on trust
        // would mean allocations that abort.
        for (name, v, max) in [
            ("block_count", self.n_layer, 4096),
            ("head_count", self.n_head, 4096),
            ("head_count_kv", self.n_kv_head, 4096),
            ("head size", self.head_dim, 4096),
            ("embedding_length", self.hidden, 1 << 17),
            ("feed_forward_length", self.ffn, 1 << 20),
            ("vocabulary", self.vocab, 1 << 23),
            ("context_length", self.ctx_train, 1 << 26),
        ] {
            if v > max {
                bail!("model {name} = {v} is beyond any real model's (at most {max}); the file is damaged");
            }
        }
        Ok(())
    }

    /// Checks a config as a whole: sizes, shapes and the layer map's sense. Each constructor
    /// calls it (through `finish`); call it again after changing a config by hand.
    pub fn validate(&self) -> Result<()> {
        self.validate_sizes()?;
        // The map every check below reads: the one built of these fields.
        if *self.layer_map() != LayerMap::of(self) {
            bail!("the layer map does not match the layers (a config changed by hand needs Config::remap)");
        }
        // A mixture of experts has no dense FFN: its width may be 0 (`Experts` has the sizes).
        if self.hidden == 0 || (self.ffn == 0 && !self.pieces.moe) || self.vocab == 0 {
            bail!(
                "model has a zero embedding, feed-forward or vocabulary size ({}, {}, {})",
                self.hidden,
                self.ffn,
                self.vocab
            );
        }
        if self.rope_dim == 0 {
            bail!("RoPE dimension is 0");
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            bail!("RoPE base {} is not a positive number", self.rope_base);
        }
        if let Some((w, layers)) = &self.sliding_window {
            if *w == 0 || layers.len() != self.n_layer {
                bail!(
                    "sliding window of {w} over {} of {} layers is not a usable pattern",
                    layers.len(),
                    self.n_layer
                );
            }
        }
        if let Some(y) = &self.yarn {
            if !(y.factor.is_finite() && y.factor >= 1.0) || y.orig_ctx == 0 {
                bail!(
                    "YaRN scaling factor {} over an original context of {} is not usable (factor ≥ 1, context > 0)",
                    y.factor,
                    y.orig_ctx
                );
            }
        }
        if let Some(e) = &self.experts {
            if e.count == 0 || e.used == 0 || e.used > e.count || e.count > 4096 {
                bail!(
                    "model expert_count = {} with expert_used_count = {} is not usable (1 ≤ used ≤ count ≤ 4096)",
                    e.count,
                    e.used
                );
            }
            if e.ffn == 0 || e.ffn > 1 << 20 {
                bail!(
                    "model expert_feed_forward_length = {} is out of range",
                    e.ffn
                );
            }
        }
        if let Some(l) = &self.layers {
            self.validate_layers(l)?;
        }
        if let Some(r) = &self.recurrent {
            self.validate_recurrent(r)?;
        }
        if let Some(c) = self.final_softcap {
            if !(c.is_finite() && c > 0.0) {
                bail!("model final_logit_softcapping = {c} is not a positive number");
            }
        }
        if self.per_layer_embd > 1 << 16 {
            bail!(
                "model embedding_length_per_layer_input = {} is out of range",
                self.per_layer_embd
            );
        }
        if !(self.rope_linear_scale.is_finite() && self.rope_linear_scale > 0.0) {
            bail!(
                "RoPE scaling factor {} is not a positive number",
                self.rope_linear_scale
            );
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            bail!("RMSNorm epsilon {} is not in (0, 1)", self.rms_eps);
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            bail!(
                "{} attention heads are not a multiple of {} KV heads",
                self.n_head,
                self.n_kv_head
            );
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            bail!(
                "RoPE dimension {} does not fit head size {}",
                self.rope_dim,
                self.head_dim
            );
        }
        Ok(())
    }
}
