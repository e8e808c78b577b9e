//! The llama-family decoder (llama, mistral, qwen2, smollm, qwen3, gemma3), written on candle ops.
//! One block with optional pieces (`Config::block`): q/k norms (qwen3, gemma3), norms after
//! attention and FFN (gemma3), GeGLU (gemma3), embeddings scaled by √hidden (gemma3), and per layer
//! a RoPE base and a sliding window (gemma3's local layers).
//!
//! Reads top to bottom like the math. Shapes: `t` = tokens in this step, `L` = positions attended over,
//! `nh` = query heads, `nkv` = KV heads, `g = nh / nkv` query heads per KV head, `hd` = head size.

use super::cache::{DecoderCache, LayerCache};
use super::config::Config;
use super::kernels::norm::rms_norm;
use super::kernels::quant::QMatrix;
use super::moe::Moe;
use super::rope::Rope;
use anyhow::{bail, Result};
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

/// One decoder block's weights: attention (q, k, v, o and their norms) and the feed-forward network.
pub struct Block {
    /// q, k and v stacked into one matrix (CPU kernels, one format, no biases): one pass instead
    /// of three.
    pub qkv: Option<QMatrix>,
    pub attn_norm: Tensor,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    /// A logit per query head that joins each softmax (gpt-oss's `attn_sinks`), `[nh]`.
    pub sinks: Option<Vec<f32>>,
    pub ffn_norm: Tensor,
    pub ffn: Ffn,
    /// Per-head RMSNorm weights of q and k, `[hd]` (qwen3, gemma3).
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// RMSNorm weights applied to the attention and FFN outputs before the residual adds (gemma3).
    pub post_attn_norm: Option<Tensor>,
    pub post_ffn_norm: Option<Tensor>,
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

/// Longest prefill step by default (`Llama::prefill_chunk`).
pub const PREFILL_CHUNK: usize = 512;

pub struct Llama {
    pub cfg: Config,
    pub embed: Embedding,
    pub layers: Vec<Block>,
    pub norm: Tensor,
    pub output: Linear,
    pub rope: Rope,
    /// The rotation of the sliding-window layers when their base differs (gemma3).
    pub rope_local: Option<Rope>,
    pub device: Device,
    /// Longest step a single forward computes at once; longer prompts are prefilled in chunks of this
    /// many tokens, so the score matrix of a long prompt never has to exist whole.
    pub prefill_chunk: usize,
}

impl Block {
    /// Stacks q/k/v and gate/up into one matrix each where all run on our CPU kernels in one
    /// format, without biases; the separate weights become views of the stacked ones (nothing is
    /// stored twice).
    pub fn stack_projections(&mut self) -> Result<()> {
        let no_bias = self.wq.b.is_none() && self.wk.b.is_none() && self.wv.b.is_none();
        if let (true, Weight::Cpu(q), Weight::Cpu(k), Weight::Cpu(v)) =
            (no_bias, &self.wq.w, &self.wk.w, &self.wv.w)
        {
            if let Some((all, mut parts)) = QMatrix::stack(&[q, k, v])? {
                self.wv.w = Weight::Cpu(parts.pop().expect("v"));
                self.wk.w = Weight::Cpu(parts.pop().expect("k"));
                self.wq.w = Weight::Cpu(parts.pop().expect("q"));
                self.qkv = Some(all);
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

impl Llama {
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
        for c in caches.iter_mut() {
            c.layer(0).prefetch()?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if i + 1 < self.layers.len() {
                for c in caches.iter_mut() {
                    c.layer(i + 1).prefetch()?;
                }
            }
            let per_row = caches.iter_mut().map(|c| c.layer(i)).collect();
            x = self.block(i, layer, &x, StepCache::PerRow(per_row))?;
        }
        for c in caches.iter_mut() {
            c.step_done();
        }
        let x = rms_norm(&x, &self.norm, self.cfg.rms_eps as f32)?;
        Ok(self.output.forward(&x)?.squeeze(0)?) // [n, vocab]
    }

    /// The embeddings of `tokens` (`ids` on the device), scaled where the model says: `[1, t, hidden]`.
    fn embed(&self, ids: &Tensor, tokens: &[u32]) -> Result<Tensor> {
        let mut x = match &self.embed {
            Embedding::Quantized(q) => q.embedding(ids)?,
            Embedding::Cpu(q) => q.rows(tokens)?,
            Embedding::Dense(e) => e.embedding(ids)?.to_dtype(candle_core::DType::F32)?,
        }
        .unsqueeze(0)?; // [1, t, hidden]
        if self.cfg.block.embed_scale {
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
        cache.layer(0).prefetch()?;
        for (i, layer) in self.layers.iter().enumerate() {
            // Offload: the next layer's cache starts its way to the device before this layer computes.
            if i + 1 < self.layers.len() {
                cache.layer(i + 1).prefetch()?;
            }
            let apart = cache.rows_apart();
            x = self.block(i, layer, &x, StepCache::One(cache.layer(i), apart))?;
        }
        cache.step_done();
        let x = match which {
            Logits::Last => x.narrow(1, t - 1, 1)?, // [1, 1, hidden]
            Logits::All => x,
        };
        let x = rms_norm(&x, &self.norm, self.cfg.rms_eps as f32)?;
        let logits = self.output.forward(&x)?.squeeze(0)?; // [t or 1, vocab]
        Ok(match which {
            Logits::Last => logits.squeeze(0)?, // [vocab]
            Logits::All => logits,
        })
    }

    /// One transformer block: x + attn(norm(x)), then + ffn(norm(x)); with post norms (gemma3)
    /// each branch's output is normed again before its add.
    fn block(&self, i: usize, layer: &Block, x: &Tensor, cache: StepCache<'_>) -> Result<Tensor> {
        let eps = self.cfg.rms_eps as f32;
        let h = rms_norm(x, &layer.attn_norm, eps)?;
        let mut att = self.attention(i, layer, &h, cache)?;
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
                        let f = self.cfg.ffn;
                        (gu.narrow(2, 0, f)?, gu.narrow(2, f, f)?)
                    }
                    None => (gate.forward(&h)?, up.forward(&h)?), // [1, t, ffn] each
                };
                // act(gate, up) in one pass.
                let act = super::kernels::glu::gated(self.cfg.block.act, &gate, &up)?; // [1, t, ffn]
                down.forward(&act)? // [1, t, hidden]
            }
            Ffn::Moe(moe) => moe.forward(&h)?, // [1, t, hidden]
        };
        if let Some(n) = &layer.post_ffn_norm {
            ffn = rms_norm(&ffn, n, eps)?;
        }
        Ok((x + ffn)?)
    }

    fn attention(
        &self,
        i: usize,
        layer: &Block,
        h: &Tensor,
        cache: StepCache<'_>,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (_, t, _) = h.dims3()?;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);

        let (q, k, v) = match &layer.qkv {
            Some(w) => {
                let qkv = w.forward(h)?; // [1, t, (nh + 2 nkv) * hd]
                (
                    qkv.narrow(2, 0, nh * hd)?,
                    qkv.narrow(2, nh * hd, nkv * hd)?,
                    qkv.narrow(2, (nh + nkv) * hd, nkv * hd)?,
                )
            }
            None => (
                layer.wq.forward(h)?,
                layer.wk.forward(h)?,
                layer.wv.forward(h)?,
            ),
        };
        // [1, t, n*hd] -> [1, t, n, hd]
        let q = q.reshape((1, t, nh, hd))?;
        let k = k.reshape((1, t, nkv, hd))?;
        // Per-head RMSNorm over hd (qwen3, gemma3), before the rotation.
        let eps = cfg.rms_eps as f32;
        let q = match &layer.q_norm {
            Some(n) => rms_norm(&q, n, eps)?,
            None => q,
        };
        let k = match &layer.k_norm {
            Some(n) => rms_norm(&k, n, eps)?,
            None => k,
        };
        // [1, t, n, hd] -> [1, n, t, hd]
        let q = q.transpose(1, 2)?;
        let k = k.transpose(1, 2)?;
        let v = v.reshape((1, t, nkv, hd))?.transpose(1, 2)?;
        let v = v.contiguous()?;

        let rope = self.layer_rope(i);
        let row = |x: &Tensor, r: usize| -> Result<Tensor> { Ok(x.narrow(2, r, 1)?.contiguous()?) };
        let out = match cache {
            StepCache::One(cache, apart) if !apart || t == 1 => {
                self.attend(&q, &k, &v, cache, rope, layer)? // [1, nh, t, hd]
            }
            // Each row attended as a step of its own (a verified draft: `DecoderCache::rows_apart`).
            StepCache::One(cache, _) => {
                let rows = (0..t)
                    .map(|r| {
                        self.attend(&row(&q, r)?, &row(&k, r)?, &row(&v, r)?, cache, rope, layer)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 2)? // [1, nh, t, hd]
            }
            // Row r is the next position of sequence r.
            StepCache::PerRow(caches) => {
                let rows = caches
                    .into_iter()
                    .enumerate()
                    .map(|(r, c)| {
                        self.attend(&row(&q, r)?, &row(&k, r)?, &row(&v, r)?, c, rope, layer)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 2)? // [1, nh, t, hd]
            }
        };
        let out = out
            .transpose(1, 2)? // [1, t, nh, hd]
            .reshape((1, t, nh * hd))?;
        layer.wo.forward(&out)
    }

    /// One step's attention: the cache stores the step's keys and values (`[1, nkv, t, hd]`, keys
    /// not yet rotated) and returns everything to attend over (on a layer with a declared window,
    /// each query row sees only its last `window` positions); the queries `[1, nh, t, hd]`, not
    /// yet rotated, attend over it. Returns `[1, nh, t, hd]`.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut dyn LayerCache,
        rope: &Rope,
        layer: &Block,
    ) -> Result<Tensor> {
        let (_, nh, t, hd) = q.dims4()?;
        let nkv = self.cfg.n_kv_head;
        let g = nh / nkv;
        let att = cache.append(k, v, rope)?;
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
        if att.observe > 0 {
            drop(att);
            cache.observed(&weights)?;
        }
        Ok(out.reshape((1, nh, t, hd))?)
    }
}

/// Dims check used by loaders: `[rows, cols]` of a matrix named `name`.
pub fn expect_dims(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        bail!("tensor {name} has shape {got:?}, expected {want:?} from the model's config");
    }
    Ok(())
}
