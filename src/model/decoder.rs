//! The llama-family decoder (llama, mistral, qwen2, smollm, qwen3, gemma3, gemma4, gpt-oss),
//! written on candle ops. One block with optional pieces (`Config::block`): q/k norms (qwen3,
//! gemma3/4), norms after attention and FFN (gemma3/4), GeGLU (gemma3/4), embeddings scaled by
//! √hidden (gemma3/4), per layer a RoPE base, a sliding window and a head size (gemma3/4's local
//! layers), value norms, keys and values shared with an earlier layer, per-layer token embeddings
//! and a scaled output (gemma4), sinks and experts (gpt-oss).
//!
//! Reads top to bottom like the math. Shapes: `t` = tokens in this step, `L` = positions attended over,
//! `nh` = query heads, `nkv` = KV heads, `g = nh / nkv` query heads per KV head, `hd` = head size.

use super::cache::{DecoderCache, LayerCache};
use super::config::Config;
use super::deltanet::{DeltaNet, RecurrentState};
use super::kernels::attention::SeqQuery;
use super::kernels::norm::rms_norm;
use super::kernels::quant::QMatrix;
use super::layers::BlockMemory;
use super::moe::Moe;
use super::rope::Rope;
use anyhow::{bail, ensure, Result};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::sync::Arc;

/// A weight matrix `[out, in]`: quantized (GGUF) or dense in its storage dtype (safetensors f32,
/// f16 or bf16). Activations stay f32; a dense matrix of another dtype gets its input cast to it.
pub enum Weight {
    Quantized(QMatMul),
    /// Quantized on the CPU, in a format our kernels run (`kernels::quant`).
    Cpu(QMatrix),
    Dense(Tensor),
}

/// A weight matrix with an optional bias (qwen2's q/k/v).
pub struct Linear {
    pub w: Weight,
    pub b: Option<Tensor>,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.w {
            Weight::Quantized(w) => w.forward(x)?,
            Weight::Cpu(w) => w.forward(x)?,
            Weight::Dense(w) => {
                let dtype = x.dtype();
                // [.., in] x [in, out] -> [.., out]
                x.to_dtype(w.dtype())?
                    .broadcast_matmul(&w.t()?)?
                    .to_dtype(dtype)?
            }
        };
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// A block's feed-forward network.
pub enum Ffn {
    /// down · act(gate·x) ⊙ (up·x).
    Dense {
        /// gate and up stacked into one matrix (CPU kernels, one format): one pass instead of two.
        gate_up: Option<QMatrix>,
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// A mixture of experts (gpt-oss).
    Moe(Moe),
}

/// A block's token mixer: attention over the cache's keys and values, or a Gated DeltaNet over
/// a recurrent state the cache keeps (Qwen3.5's linear-attention layers).
pub enum Mixer {
    Attention(Attention),
    DeltaNet(DeltaNet),
}

/// An attention mixer's weights: q, k, v, o and their norms, sinks.
pub struct Attention {
    /// q, k and v stacked into one matrix (CPU kernels, one format, no biases): one pass instead
    /// of three.
    pub qkv: Option<QMatrix>,
    /// `[nh·hd, hidden]`, or `[2·nh·hd, hidden]` where each head's queries come with an output
    /// gate (`Block::q_gate`: per head, hd queries then hd gates).
    pub wq: Linear,
    /// None: the layer keeps no keys and values of its own and attends over those of
    /// `Config::kv_source` (Gemma 4's shared-KV layers).
    pub wk: Option<Linear>,
    /// None beside a `wk`: the values are the keys' projection (Gemma 4 without `attn_v`).
    pub wv: Option<Linear>,
    pub wo: Linear,
    /// The values' RMSNorm, which has no weight: ones `[hd]` (gemma4).
    pub v_norm: Option<Tensor>,
    /// A logit per query head that joins each softmax (gpt-oss's `attn_sinks`), `[nh]`.
    pub sinks: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of q and k, `[hd]` (qwen3, gemma3).
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
}

/// One decoder block's weights: the mixer (attention or DeltaNet) and the feed-forward network.
pub struct Block {
    pub attn_norm: Tensor,
    pub mixer: Mixer,
    /// The block's output is multiplied by this (gemma4's `layer_output_scale`).
    pub out_scale: Option<f32>,
    /// This layer's part of the per-layer token embeddings (gemma4 E2B/E4B).
    pub per_layer: Option<PerLayerBlock>,
    /// Experts beside the dense FFN (gemma4 26B-A4B).
    pub moe_beside: Option<MoeBeside>,
    pub ffn_norm: Tensor,
    pub ffn: Ffn,
    /// RMSNorm weights applied to the attention and FFN outputs before the residual adds (gemma3).
    pub post_attn_norm: Option<Tensor>,
    pub post_ffn_norm: Option<Tensor>,
}

/// A mixture of experts beside a block's dense FFN (Gemma 4 26B-A4B): the dense FFN's output is
/// normed (`post_ffw_norm_1`), the experts run on `pre_ffw_norm_2(x)`, routed by
/// `router_scale ⊙ rms(x) / √hidden`, their sum normed (`post_ffw_norm_2`); the two are added.
pub struct MoeBeside {
    pub moe: Moe,
    pub post_norm_dense: Tensor,
    pub pre_norm: Tensor,
    pub post_norm: Tensor,
    /// `[hidden]`, × 1/√hidden folded in.
    pub router_scale: Tensor,
}

/// A block's use of its per-layer input (Gemma 4): x + norm(proj(gelu(gate·x) ⊙ input_i)).
pub struct PerLayerBlock {
    /// `[ple, hidden]`.
    pub gate: Linear,
    /// `[hidden, ple]`.
    pub proj: Linear,
    pub post_norm: Tensor,
}

/// The per-layer token embeddings (Gemma 4 E2B/E4B): each token's row of `table`
/// `[vocab, n_layer·ple]`, plus a projection of its embedding, give each layer an input of `ple`.
pub struct PerLayerEmbeddings {
    pub table: Embedding,
    /// `[n_layer·ple, hidden]`.
    pub model_proj: Linear,
    /// `[ple]`.
    pub proj_norm: Tensor,
}

/// Token embeddings: kept quantized when the file has them quantized, rows dequantized on lookup.
pub enum Embedding {
    Quantized(Arc<QTensor>),
    /// The table in our CPU kernels' block store, shared with a tied output matrix.
    Cpu(QMatrix),
    Dense(Tensor),
}

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

/// Longest prefill step by default (`Decoder::prefill_chunk`).
pub const PREFILL_CHUNK: usize = 512;

pub struct Decoder {
    pub cfg: Config,
    pub embed: Embedding,
    pub layers: Vec<Block>,
    pub norm: Tensor,
    pub output: Linear,
    pub per_layer: Option<PerLayerEmbeddings>,
    pub rope: Rope,
    /// The rotation of the sliding-window layers when their base differs (gemma3).
    pub rope_local: Option<Rope>,
    pub device: Device,
    /// Longest step a single forward computes at once; longer prompts are prefilled in chunks of this
    /// many tokens, so the score matrix of a long prompt never has to exist whole.
    pub prefill_chunk: usize,
}

impl Embedding {
    /// The rows of `tokens` (`ids` on the device), f32: `[t, width]`.
    pub fn rows(&self, ids: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        Ok(match self {
            Embedding::Quantized(q) => q.embedding(ids)?,
            Embedding::Cpu(q) => q.rows(tokens)?,
            Embedding::Dense(e) => e.embedding(ids)?.to_dtype(candle_core::DType::F32)?,
        })
    }
}

impl Block {
    /// The block's attention, if its mixer attends.
    pub fn attention(&self) -> Option<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }

    /// Stacks q/k/v and gate/up into one matrix each where all run on our CPU kernels in one
    /// format, without biases; the separate weights become views of the stacked ones (nothing is
    /// stored twice).
    pub fn stack_projections(&mut self) -> Result<()> {
        if let Mixer::Attention(a) = &mut self.mixer {
            // q, k and v, or q and k (values from the keys' projection), each ours and unbiased.
            let mut projections = vec![&mut a.wq];
            projections.extend(a.wk.as_mut());
            projections.extend(a.wv.as_mut());
            let mats: Option<Vec<&QMatrix>> = projections
                .iter()
                .map(|l| match (&l.w, &l.b) {
                    (Weight::Cpu(m), None) => Some(m),
                    _ => None,
                })
                .collect();
            if let Some(mats) = mats.filter(|m| m.len() > 1) {
                if let Some((all, parts)) = QMatrix::stack(&mats)? {
                    for (l, part) in projections.into_iter().zip(parts) {
                        l.w = Weight::Cpu(part);
                    }
                    a.qkv = Some(all);
                }
            }
        }
        let Ffn::Dense {
            gate_up, gate, up, ..
        } = &mut self.ffn
        else {
            return Ok(());
        };
        if let (Weight::Cpu(g), Weight::Cpu(u)) = (&gate.w, &up.w) {
            if let Some((all, mut parts)) = QMatrix::stack(&[g, u])? {
                up.w = Weight::Cpu(parts.pop().expect("up"));
                gate.w = Weight::Cpu(parts.pop().expect("gate"));
                *gate_up = Some(all);
            }
        }
        Ok(())
    }
}

/// Whose cache a forward's rows go to: one sequence's (its rows attended together, or apart —
/// `DecoderCache::rows_apart`), or each row a sequence of its own (a batched decode step).
enum StepCache<'c> {
    One(&'c mut dyn LayerCache, bool),
    PerRow(Vec<&'c mut dyn LayerCache>),
}

/// What a block's mixer reads and leaves: a layer's KV cache (attention), or a DeltaNet layer's
/// recurrent state, one sequence's or one per row (a batched decode step).
enum StepMemory<'c> {
    Kv(StepCache<'c>),
    State(&'c mut RecurrentState),
    StatePerRow(Vec<&'c mut RecurrentState>),
}

impl Decoder {
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The rotation layer `i` uses: the local one on a sliding-window layer that has its own.
    pub fn layer_rope(&self, i: usize) -> &Rope {
        match (&self.rope_local, self.cfg.layer_window(i)) {
            (Some(local), Some(_)) => local,
            _ => &self.rope,
        }
    }

    /// Runs `tokens` through the decoder, continuing after what `cache` holds, and returns logits
    /// `[vocab]` (Logits::Last) or `[t, vocab]` (Logits::All).
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut dyn DecoderCache,
        which: Logits,
    ) -> Result<Tensor> {
        if tokens.is_empty() {
            bail!("forward over zero tokens");
        }
        let chunk = cache
            .max_step()
            .map_or(self.prefill_chunk, |m| m.min(self.prefill_chunk));
        // Steps end at multiples of `chunk` counted from position 0, wherever the sequence
        // resumes: a quantized cache reads a step's last positions from their f16 copies, so
        // where steps end decides the values, and a prompt resumed from a stored prefix must
        // step as one prefill of the whole prompt does (session::prefix).
        let seen = if cache.n_layers() > 0 {
            cache.layer(0).seen()
        } else {
            0
        };
        let first = chunk - seen % chunk;
        cache.forward_begins(tokens.len())?;
        if cache.recomputes() || tokens.len() <= first {
            return self.forward_chunk(tokens, cache, which);
        }
        let mut all = Vec::new();
        let mut last = None;
        let (head, rest) = tokens.split_at(first);
        for chunk in std::iter::once(head).chain(rest.chunks(chunk)) {
            let logits = self.forward_chunk(chunk, cache, which)?;
            match which {
                Logits::All => all.push(logits),
                Logits::Last => last = Some(logits),
            }
        }
        match which {
            Logits::All => Ok(Tensor::cat(&all, 0)?),
            Logits::Last => Ok(last.expect("at least one chunk")),
        }
    }

    /// One decode step of several sequences at once: `tokens[r]` continues the sequence that
    /// `caches[r]` holds. The matmuls take every row together (one pass over the weights for all
    /// sequences); each row's attention reads and appends its own sequence's cache, as that
    /// sequence's own single step would — so each row's logits are the bits of its sequence
    /// decoded alone (the CPU kernels compute every row in a fixed order). Returns `[n, vocab]`.
    pub fn forward_rows(
        &self,
        tokens: &[u32],
        caches: &mut [&mut dyn DecoderCache],
    ) -> Result<Tensor> {
        if tokens.is_empty() || tokens.len() != caches.len() {
            bail!(
                "a batched step needs one token for each of its sequences ({} tokens, {} caches)",
                tokens.len(),
                caches.len()
            );
        }
        if caches.iter().any(|c| c.recomputes()) {
            bail!("a batched step needs every sequence to keep a KV cache");
        }
        for c in caches.iter_mut() {
            c.forward_begins(1)?;
        }
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed(&ids, tokens)?; // [1, n, hidden]
        let per_layer = self.per_layer_inputs(&x, tokens)?;
        for c in caches.iter_mut() {
            c.layer(0).prefetch()?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if let Some(next) = self.next_prefetch(i) {
                for c in caches.iter_mut() {
                    c.layer(next).prefetch()?;
                }
            }
            let memory = match self.cfg.layer_map().block(i) {
                BlockMemory::Kv { kv, .. } => StepMemory::Kv(StepCache::PerRow(
                    caches.iter_mut().map(|c| c.layer(kv)).collect(),
                )),
                BlockMemory::State { state } => StepMemory::StatePerRow(
                    caches
                        .iter_mut()
                        .map(|c| c.state(state))
                        .collect::<Result<_>>()?,
                ),
            };
            x = self.block(i, layer, &x, memory, per_layer.as_ref())?;
        }
        for c in caches.iter_mut() {
            c.step_done();
        }
        let x = rms_norm(&x, &self.norm, self.cfg.rms_eps as f32)?;
        self.softcap(self.output.forward(&x)?.squeeze(0)?) // [n, vocab]
    }

    /// The KV cache layer to start moving to the device while block `i` computes (offload): the
    /// next block's, where it keeps its own and is not the first (moved before the loop).
    fn next_prefetch(&self, i: usize) -> Option<usize> {
        match self.cfg.layer_map().get(i + 1)? {
            BlockMemory::Kv { kv, own: true } if kv > 0 => Some(kv),
            _ => None,
        }
    }

    /// Logits through c·tanh(x / c) where the model caps them (gemma4).
    fn softcap(&self, logits: Tensor) -> Result<Tensor> {
        Ok(match self.cfg.final_softcap {
            Some(c) => ((logits / c as f64)?.tanh()? * c as f64)?,
            None => logits,
        })
    }

    /// Each layer's per-layer input (Gemma 4), `[1, t, n_layer, ple]`, from the tokens' rows of
    /// the per-layer table (× √ple) and a projection of their scaled embeddings `x`
    /// `[1, t, hidden]` (× 1/√hidden, RMS-normed per layer), added and × 1/√2; None for models
    /// without them.
    fn per_layer_inputs(&self, x: &Tensor, tokens: &[u32]) -> Result<Option<Tensor>> {
        let Some(pl) = &self.per_layer else {
            return Ok(None);
        };
        let (n, ple, t) = (self.cfg.n_layer, self.cfg.per_layer_embd, tokens.len());
        let ids = Tensor::new(tokens, &self.device)?;
        let table = (pl.table.rows(&ids, tokens)? * (ple as f64).sqrt())?; // [t, n·ple]
        let table = table.reshape((1, t, n, ple))?;
        let proj = (pl.model_proj.forward(x)? / (self.cfg.hidden as f64).sqrt())?; // [1, t, n·ple]
        let proj = rms_norm(
            &proj.reshape((1, t, n, ple))?,
            &pl.proj_norm,
            self.cfg.rms_eps as f32,
        )?;
        Ok(Some(((proj + table)? * std::f64::consts::FRAC_1_SQRT_2)?))
    }

    /// The embeddings of `tokens` (`ids` on the device), scaled where the model says: `[1, t, hidden]`.
    fn embed(&self, ids: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        let mut x = self.embed.rows(ids, tokens)?.unsqueeze(0)?; // [1, t, hidden]
        if self.cfg.pieces.embed_scale {
            x = (x * (self.cfg.hidden as f64).sqrt())?;
        }
        Ok(x)
    }

    fn forward_chunk(
        &self,
        tokens: &[u32],
        cache: &mut dyn DecoderCache,
        which: Logits,
    ) -> Result<Tensor> {
        let t = tokens.len();
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed(&ids, tokens)?; // [1, t, hidden]
        let per_layer = self.per_layer_inputs(&x, tokens)?; // [1, t, n_layer, ple]
        cache.layer(0).prefetch()?;
        for (i, layer) in self.layers.iter().enumerate() {
            // Offload: the next layer's cache starts its way to the device before this layer computes.
            if let Some(next) = self.next_prefetch(i) {
                cache.layer(next).prefetch()?;
            }
            let memory = match self.cfg.layer_map().block(i) {
                BlockMemory::Kv { kv, .. } => {
                    let apart = cache.rows_apart();
                    StepMemory::Kv(StepCache::One(cache.layer(kv), apart))
                }
                BlockMemory::State { state } => StepMemory::State(cache.state(state)?),
            };
            x = self.block(i, layer, &x, memory, per_layer.as_ref())?;
        }
        cache.step_done();
        let x = match which {
            Logits::Last => x.narrow(1, t - 1, 1)?, // [1, 1, hidden]
            Logits::All => x,
        };
        let x = rms_norm(&x, &self.norm, self.cfg.rms_eps as f32)?;
        let logits = self.softcap(self.output.forward(&x)?.squeeze(0)?)?; // [t or 1, vocab]
        Ok(match which {
            Logits::Last => logits.squeeze(0)?, // [vocab]
            Logits::All => logits,
        })
    }

    /// One transformer block: x + attn(norm(x)), then + ffn(norm(x)); with post norms (gemma3/4)
    /// each branch's output is normed again before its add; then (gemma4) + the layer's part of
    /// the per-layer inputs `[1, t, n_layer, ple]`, and × the layer's output scale.
    fn block(
        &self,
        i: usize,
        layer: &Block,
        x: &Tensor,
        memory: StepMemory<'_>,
        per_layer: Option<&Tensor>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_eps as f32;
        let h = rms_norm(x, &layer.attn_norm, eps)?;
        let mut att = match (&layer.mixer, memory) {
            (Mixer::Attention(a), StepMemory::Kv(cache)) => self.attention(i, a, &h, cache)?,
            (Mixer::DeltaNet(d), StepMemory::State(state)) => self.delta_net(d, &h, state)?,
            // Row r is the next position of sequence r.
            (Mixer::DeltaNet(d), StepMemory::StatePerRow(states)) => {
                let rows = states
                    .into_iter()
                    .enumerate()
                    .map(|(r, state)| self.delta_net(d, &h.narrow(1, r, 1)?, state))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 1)? // [1, n, hidden]
            }
            _ => bail!("layer {i}'s mixer was given the other kind of memory"),
        };
        if let Some(n) = &layer.post_attn_norm {
            att = rms_norm(&att, n, eps)?;
        }
        let x = (x + att)?;
        let h = rms_norm(&x, &layer.ffn_norm, eps)?;
        let mut ffn = match &layer.ffn {
            Ffn::Dense {
                gate_up,
                gate,
                up,
                down,
            } => {
                let (gate, up) = match gate_up {
                    Some(w) => {
                        let gu = w.forward(&h)?; // [1, t, 2 * ffn]
                        let f = self.cfg.layer_ffn(i);
                        (gu.narrow(2, 0, f)?, gu.narrow(2, f, f)?)
                    }
                    None => (gate.forward(&h)?, up.forward(&h)?), // [1, t, ffn] each
                };
                // act(gate, up) in one pass.
                let act = super::kernels::glu::gated(self.cfg.pieces.act, &gate, &up)?; // [1, t, ffn]
                down.forward(&act)? // [1, t, hidden]
            }
            Ffn::Moe(moe) => moe.forward(&h)?, // [1, t, hidden]
        };
        if let Some(mb) = &layer.moe_beside {
            let dense = rms_norm(&ffn, &mb.post_norm_dense, eps)?;
            // rms(x) ⊙ router_scale is an RMSNorm whose weight is router_scale.
            let router_x = rms_norm(&x, &mb.router_scale, eps)?;
            let experts = mb
                .moe
                .forward_routed_by(&rms_norm(&x, &mb.pre_norm, eps)?, &router_x)?;
            ffn = (dense + rms_norm(&experts, &mb.post_norm, eps)?)?; // [1, t, hidden]
        }
        if let Some(n) = &layer.post_ffn_norm {
            ffn = rms_norm(&ffn, n, eps)?;
        }
        let mut x = (x + ffn)?;
        if let (Some(pl), Some(inputs)) = (&layer.per_layer, per_layer) {
            let (_, t, _, ple) = inputs.dims4()?;
            let input = inputs.narrow(2, i, 1)?.reshape((1, t, ple))?; // [1, t, ple]
            let gated = (pl.gate.forward(&x)?.gelu()? * input)?; // [1, t, ple]
            let y = rms_norm(&pl.proj.forward(&gated)?, &pl.post_norm, eps)?; // [1, t, hidden]
            x = (x + y)?;
        }
        if let Some(s) = layer.out_scale {
            x = (x * s as f64)?;
        }
        Ok(x)
    }

    /// A DeltaNet layer's mixer over `h [1, t, hidden]` from `state` (left after the step).
    fn delta_net(&self, d: &DeltaNet, h: &Tensor, state: &mut RecurrentState) -> Result<Tensor> {
        let r = self
            .cfg
            .recurrent
            .as_ref()
            .expect("a DeltaNet layer's sizes");
        d.forward(r, self.cfg.rms_eps as f32, h, state)
    }

    fn attention(
        &self,
        i: usize,
        layer: &Attention,
        h: &Tensor,
        cache: StepCache<'_>,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (_, t, _) = h.dims3()?;
        let (nh, (nkv, hd)) = (cfg.n_head, cfg.layer_kv_shape(i));
        // Queries, and beside each head's an output gate where the model has them (qwen35).
        let qw = if cfg.pieces.q_gate {
            2 * nh * hd
        } else {
            nh * hd
        };

        // q, and the step's keys and values unless the layer shares an earlier layer's.
        let (q, kv) = match &layer.qkv {
            Some(w) => {
                let qkv = w.forward(h)?; // [1, t, qw + (nkv (+ nkv)) * hd]
                let k = qkv.narrow(2, qw, nkv * hd)?;
                let v = match layer.wv {
                    Some(_) => qkv.narrow(2, qw + nkv * hd, nkv * hd)?,
                    None => k.clone(),
                };
                (qkv.narrow(2, 0, qw)?, Some((k, v)))
            }
            None => {
                let kv = match &layer.wk {
                    Some(wk) => {
                        let k = wk.forward(h)?;
                        let v = match &layer.wv {
                            Some(wv) => wv.forward(h)?,
                            None => k.clone(),
                        };
                        Some((k, v))
                    }
                    None => None,
                };
                (layer.wq.forward(h)?, kv)
            }
        };
        // Per-head RMSNorm over hd (qwen3, gemma3/4), before the rotation; values' (gemma4).
        let eps = cfg.rms_eps as f32;
        let norm = |x: Tensor, w: &Option<Tensor>| -> Result<Tensor> {
            Ok(match w {
                Some(w) => rms_norm(&x, w, eps)?,
                None => x,
            })
        };
        // [1, t, nh, 2·hd] -> queries and gates, [1, t, nh, hd] each.
        let (q, gate) = match cfg.pieces.q_gate {
            true => {
                let qg = q.reshape((1, t, nh, 2 * hd))?;
                let gate = qg.narrow(3, hd, hd)?.reshape((1, t, nh * hd))?;
                (qg.narrow(3, 0, hd)?.contiguous()?, Some(gate))
            }
            false => (q, None),
        };
        // [1, t, n*hd] -> [1, t, n, hd] -> [1, n, t, hd]
        let q = norm(q.reshape((1, t, nh, hd))?, &layer.q_norm)?.transpose(1, 2)?;
        let kv = match kv {
            Some((k, v)) => {
                let k = norm(k.reshape((1, t, nkv, hd))?, &layer.k_norm)?.transpose(1, 2)?;
                let v = norm(v.reshape((1, t, nkv, hd))?, &layer.v_norm)?;
                Some((k, v.transpose(1, 2)?.contiguous()?))
            }
            None => None,
        };

        let rope = self.layer_rope(i);
        let kv_row = |r: usize| -> Result<Option<(Tensor, Tensor)>> {
            kv.as_ref()
                .map(|(k, v)| Ok((step_row(k, r)?, step_row(v, r)?)))
                .transpose()
        };
        let out = match cache {
            StepCache::One(cache, apart) if !apart || t == 1 => {
                self.attend(&q, kv.as_ref(), nkv, cache, rope, layer)? // [1, nh, t, hd]
            }
            // Each row attended as a step of its own (a verified draft: `DecoderCache::rows_apart`).
            StepCache::One(cache, _) => {
                if kv.is_none() {
                    bail!("a draft verified row by row cannot run on layers that share keys and values (gemma4) yet: use a cache whose rows need not be apart (f16 or wider, no window or budget)");
                }
                let rows = (0..t)
                    .map(|r| {
                        let kv = kv_row(r)?;
                        self.attend(&step_row(&q, r)?, kv.as_ref(), nkv, cache, rope, layer)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 2)? // [1, nh, t, hd]
            }
            // Row r is the next position of sequence r.
            StepCache::PerRow(caches) => {
                self.attend_rows(&q, kv.as_ref(), nkv, caches, rope, layer)? // [1, nh, t, hd]
            }
        };
        let mut out = out
            .transpose(1, 2)? // [1, t, nh, hd]
            .reshape((1, t, nh * hd))?;
        if let Some(gate) = gate {
            out = (out * candle_nn::ops::sigmoid(&gate)?)?;
        }
        layer.wo.forward(&out)
    }

    /// One step's attention: the cache stores the step's keys and values (`[1, nkv, t, hd]`, keys
    /// not yet rotated) and returns everything to attend over (on a layer with a declared window,
    /// each query row sees only its last `window` positions); the queries `[1, nh, t, hd]`, not
    /// yet rotated, attend over it. Without keys and values (a layer sharing an earlier one's),
    /// the cache returns what that layer's queries attended over this step. Returns `[1, nh, t, hd]`.
    fn attend(
        &self,
        q: &Tensor,
        kv: Option<&(Tensor, Tensor)>,
        nkv: usize,
        cache: &mut dyn LayerCache,
        rope: &Rope,
        layer: &Attention,
    ) -> Result<Tensor> {
        let (_, nh, t, hd) = q.dims4()?;
        let g = nh / nkv;
        let att = match kv {
            Some((k, v)) => cache.append(k, v, rope)?,
            None => cache.attend_again(t)?,
        };
        // Grouped-query attention without copying K/V per query head: the g query heads that share a
        // KV head are stacked as rows. [1, nh, t, hd] = [nkv, g*t, hd]
        let rotated =
            |pos: usize| -> Result<Tensor> { Ok(rope.apply(q, pos)?.reshape((nkv, g * t, hd))?) };
        let q_main = rotated(att.q_pos)?;
        let q_sink = att.sink_q_pos.map(rotated).transpose()?;
        let qs: Vec<&Tensor> = std::iter::once(&q_main).chain(q_sink.as_ref()).collect();
        let (out, weights) = super::kernels::attention::attend_view_observed(
            &qs,
            &att.view,
            t,
            self.cfg.attn_scale,
            layer.sinks.as_deref(),
            att.observe,
        )?; // [nkv, g*t, hd]; weights [nkv, L] when the cache asked
        if att.observe > 0 && kv.is_some() {
            drop(att);
            cache.observed(&weights)?;
        }
        Ok(out.reshape((1, nh, t, hd))?)
    }

    /// [`Decoder::attend`] for a step whose row r is the next position of sequence r: each row
    /// appends to its own sequence's cache, and then all rows attend in one call of the kernel
    /// (one dispatch of the pool for the whole batch on the CPU), each over its own view, with
    /// the bits it gets alone. Returns `[1, nh, t, hd]`.
    fn attend_rows(
        &self,
        q: &Tensor,
        kv: Option<&(Tensor, Tensor)>,
        nkv: usize,
        mut caches: Vec<&mut dyn LayerCache>,
        rope: &Rope,
        layer: &Attention,
    ) -> Result<Tensor> {
        let (_, nh, t, hd) = q.dims4()?;
        ensure!(
            caches.len() == t,
            "a batched step of {t} rows for {} sequences",
            caches.len()
        );
        let g = nh / nkv;
        // Each sequence stores its row's keys and values and gives its view.
        let mut atts = Vec::with_capacity(t);
        for (r, cache) in caches.iter_mut().enumerate() {
            atts.push(match kv {
                Some((k, v)) => cache.append(&step_row(k, r)?, &step_row(v, r)?, rope)?,
                None => cache.attend_again(1)?,
            });
        }
        // Row r's query rotated at its sequence's position (and its sinks'): [1, nh, 1, hd] =
        // [nkv, g, hd]
        let rotated = |r: usize, pos: usize| -> Result<Tensor> {
            Ok(rope.apply(&step_row(q, r)?, pos)?.reshape((nkv, g, hd))?)
        };
        let qs = atts
            .iter()
            .enumerate()
            .map(|(r, att)| {
                let sink = att.sink_q_pos.map(|pos| rotated(r, pos)).transpose()?;
                Ok(std::iter::once(rotated(r, att.q_pos)?)
                    .chain(sink)
                    .collect::<Vec<_>>())
            })
            .collect::<Result<Vec<_>>>()?;
        let q_refs: Vec<Vec<&Tensor>> = qs.iter().map(|r| r.iter().collect()).collect();
        let seqs: Vec<SeqQuery> = atts
            .iter()
            .zip(&q_refs)
            .map(|(att, qs)| SeqQuery {
                qs,
                view: &att.view,
                observe: att.observe,
            })
            .collect();
        let outs = super::kernels::attention::attend_views_observed(
            &seqs,
            1,
            self.cfg.attn_scale,
            layer.sinks.as_deref(),
        )?; // each [nkv, g, hd]; weights [nkv, L] where its cache asked
        let observe: Vec<usize> = atts.iter().map(|a| a.observe).collect();
        drop(seqs);
        drop(atts);
        let mut rows = Vec::with_capacity(t);
        for ((cache, (out, weights)), observe) in caches.iter_mut().zip(outs).zip(observe) {
            if observe > 0 && kv.is_some() {
                cache.observed(&weights)?;
            }
            rows.push(out.reshape((1, nh, 1, hd))?);
        }
        Ok(Tensor::cat(&rows, 2)?) // [1, nh, t, hd]
    }
}

/// Row `r` of a step's `[1, n, t, d]` tensor as its own `[1, n, 1, d]`.
fn step_row(x: &Tensor, r: usize) -> Result<Tensor> {
    Ok(x.narrow(2, r, 1)?.contiguous()?)
}

/// Dims check used by loaders: `[rows, cols]` of a matrix named `name`.
pub fn expect_dims(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        bail!("tensor {name} has shape {got:?}, expected {want:?} from the model's config");
    }
    Ok(())
}
