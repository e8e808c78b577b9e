//! The autoregressive loop: prefill a prompt in one forward, then decode token by token; sampling,
//! streaming and timing.

use crate::kv::KvCache;
use crate::model::{Llama, Logits};
use anyhow::{bail, Result};
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

/// Sampling settings; the defaults are llama.cpp's.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy argmax.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    /// 1.0 = off.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 42,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }
}

pub struct Sampler {
    p: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(p: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(p.seed);
        Self { p, rng }
    }

    /// Picks the next token from `logits` [vocab]; `recent` are the tokens the repeat penalty looks at.
    pub fn sample(&mut self, logits: &Tensor, recent: &[u32]) -> Result<u32> {
        let mut logits: Vec<f32> = logits.to_vec1()?;
        let p = &self.p;
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = recent.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &recent[start..] {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repeat_penalty
                        } else {
                            *l * p.repeat_penalty
                        };
                    }
                }
            }
        }
        if p.temperature <= 0.0 {
            return Ok(argmax(&logits));
        }
        // Candidates sorted by logit, cut by top-k.
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = if p.top_k == 0 {
            idx.len()
        } else {
            p.top_k.min(idx.len())
        };
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        idx.truncate(k);
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        // Softmax at temperature over the candidates.
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) / p.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        // min-p: drop what is less likely than min_p × the top probability.
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        }
        // top-p: the smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for &x in &probs[..keep] {
                acc += x;
                n += 1;
                if acc >= p.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        for (i, &x) in probs[..keep].iter().enumerate() {
            r -= x;
            if r <= 0.0 {
                return Ok(idx[i]);
            }
        }
        Ok(idx[keep - 1])
    }
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in xs.iter().enumerate() {
        if *x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    EndOfText,
    MaxTokens,
    ContextFull,
    Interrupted,
}

/// Timings and counts of one prefill + decode.
#[derive(Debug, Clone, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub generated: usize,
    /// Time of the decode forwards (the generated tokens after the first).
    pub decode: Duration,
    pub decode_steps: usize,
}

impl GenStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// A sequence and the cache that holds it: feeding tokens runs them through the model.
pub struct Session<'m> {
    pub model: &'m Llama,
    pub cache: KvCache,
    /// Every token of the sequence so far, in order.
    pub tokens: Vec<u32>,
    /// The most positions the sequence may reach (`--ctx`).
    pub max_positions: usize,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Llama, cache: KvCache, max_positions: usize) -> Self {
        Self {
            model,
            cache,
            tokens: Vec::new(),
            max_positions,
        }
    }

    /// Replaces what the session holds by a saved state (tokens and every layer's keys and values).
    pub fn restore(&mut self, snap: &crate::kv::persist::Snapshot) -> Result<()> {
        self.cache.reset()?;
        self.tokens.clear();
        for (i, (k, v)) in snap.kv.iter().enumerate() {
            if let Err(e) = self.cache.layer(i).restore(k, v) {
                // Never leave a half-restored cache behind.
                self.cache.reset()?;
                return Err(e);
            }
        }
        self.tokens = snap.tokens.clone();
        Ok(())
    }

    /// What a saved state must match to be restored into this session.
    pub fn persist_expect<'a>(
        &self,
        model_digest: &'a str,
        cache_key: &'a str,
    ) -> crate::kv::persist::Expect<'a> {
        let cfg = &self.model.cfg;
        crate::kv::persist::Expect {
            model_digest,
            cache_key,
            n_layers: self.cache.n_layers(),
            n_kv_heads: cfg.n_kv_head,
            head_dim: cfg.head_dim,
            max_positions: self.max_positions,
        }
    }

    /// Appends `new` tokens to the sequence and returns the next-token logits [vocab].
    /// With a cache, only `new` goes through the model; with `--no-cache`, the whole sequence does.
    pub fn feed(&mut self, new: &[u32]) -> Result<Tensor> {
        self.feed_with(new, Logits::Last)
    }

    /// As `feed`, returning logits for `new`'s positions ([t, vocab]) when `which` is `All`.
    pub fn feed_with(&mut self, new: &[u32], which: Logits) -> Result<Tensor> {
        if new.is_empty() {
            bail!("nothing to feed");
        }
        let total = self.tokens.len() + new.len();
        if total > self.max_positions {
            bail!(
                "the sequence would be {total} tokens, more than the context of {} (raise --ctx)",
                self.max_positions
            );
        }
        self.tokens.extend_from_slice(new);
        if self.cache.spec().recomputes() {
            let logits = self.model.forward(&self.tokens, &mut self.cache, which)?;
            return Ok(match which {
                Logits::Last => logits,
                Logits::All => logits.narrow(0, total - new.len(), new.len())?,
            });
        }
        match self.model.forward(new, &mut self.cache, which) {
            Ok(l) => Ok(l),
            Err(e) => {
                // Keep the sequence and the cache consistent after a failed step.
                self.tokens.truncate(total - new.len());
                let _ = self.cache.truncate(self.tokens.len());
                Err(e)
            }
        }
    }

    /// Prefills `prompt` then samples up to `max_tokens` tokens, calling `on_token` with each;
    /// `on_token` returns false to stop (Ctrl-C). Stops on any id in `stop_ids` unless `ignore_eos`.
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &mut self,
        prompt: &[u32],
        sampler: &mut Sampler,
        max_tokens: usize,
        stop_ids: &[u32],
        ignore_eos: bool,
        on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<(Vec<u32>, StopReason, GenStats)> {
        let t0 = Instant::now();
        let logits = self.feed(prompt)?;
        let prefill = t0.elapsed();
        let (out, reason, mut stats) =
            self.decode(logits, sampler, max_tokens, stop_ids, ignore_eos, on_token)?;
        stats.prompt_tokens = prompt.len();
        stats.prefill = prefill;
        Ok((out, reason, stats))
    }

    /// Samples from `logits` (the next-token logits after what the session holds), then feeds each
    /// sampled token back, up to `max_tokens` tokens (see `generate`).
    pub fn decode(
        &mut self,
        mut logits: Tensor,
        sampler: &mut Sampler,
        max_tokens: usize,
        stop_ids: &[u32],
        ignore_eos: bool,
        mut on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<(Vec<u32>, StopReason, GenStats)> {
        let mut stats = GenStats::default();
        let mut out = Vec::new();
        let reason = loop {
            let next = sampler.sample(&logits, &self.tokens)?;
            if !ignore_eos && stop_ids.contains(&next) {
                break StopReason::EndOfText;
            }
            out.push(next);
            stats.generated += 1;
            if !on_token(next)? {
                break StopReason::Interrupted;
            }
            if out.len() >= max_tokens {
                break StopReason::MaxTokens;
            }
            if self.tokens.len() + 1 > self.max_positions {
                break StopReason::ContextFull;
            }
            let t = Instant::now();
            logits = self.feed(&[next])?;
            stats.decode += t.elapsed();
            stats.decode_steps += 1;
        };
        Ok((out, reason, stats))
    }

    /// Keeps the longest prefix of what the session holds that `ids` starts with, but at least one token
    /// short of `ids` (there must be something to feed for logits); returns how many positions were
    /// kept. A cache that cannot go back that far (a window that dropped them) starts over.
    pub fn keep_prefix_of(&mut self, ids: &[u32]) -> Result<usize> {
        let common = self
            .tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        let keep = common.min(ids.len().saturating_sub(1));
        if keep < self.tokens.len() {
            if self.cache.truncate(keep).is_err() {
                self.cache.reset()?;
                self.tokens.clear();
                return Ok(0);
            }
            self.tokens.truncate(keep);
        }
        Ok(keep)
    }
}
