//! A sequence being generated: the [`Session`] (tokens and the KV cache that holds them, changed only
//! together), the generation loop, the [`sampler`], a chat [`conversation`] over one session, and
//! saving and restoring a session's state ([`persist`]).

pub mod batch;
pub mod conversation;
pub mod draft;
pub mod persist;
pub mod prefix;
pub mod sampler;

pub use sampler::{argmax, Resolved, Sampler, SamplingParams};

use crate::kv::KvCache;
use crate::model::sampling::SamplingPrefs;
use crate::model::{Decoder, Logits};
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::time::{Duration, Instant};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    EndOfText,
    MaxTokens,
    ContextFull,
    Interrupted,
}

impl StopReason {
    /// Why a generation ends once a token is kept: `generated` tokens of at most `max_tokens`,
    /// and a sequence of `len` positions before the kept token that the context of
    /// `max_positions` must still hold it in. None: it goes on. (A stop token, checked before, is
    /// not kept.)
    pub fn after_kept(
        generated: usize,
        max_tokens: usize,
        len: usize,
        max_positions: usize,
    ) -> Option<StopReason> {
        if generated >= max_tokens {
            Some(StopReason::MaxTokens)
        } else if len + 1 > max_positions {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StopReason::EndOfText => "end of text",
            StopReason::MaxTokens => "max tokens",
            StopReason::ContextFull => "context full",
            StopReason::Interrupted => "interrupted",
        })
    }
}

/// Timings and counts of one prefill + decode.
#[derive(Debug, Clone, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub generated: usize,
    /// Time of the decode forwards (the generated tokens after the first).
    pub decode: Duration,
    /// Tokens the decode forwards gave logits for (a verified draft counts each accepted token).
    pub decode_steps: usize,
    /// Decode forwards run (fewer than `decode_steps` when drafts were accepted).
    pub forwards: usize,
    /// Tokens drafted and, of those, accepted (speculative decoding).
    pub drafted: usize,
    pub accepted: usize,
}

impl GenStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode.as_secs_f64().max(1e-9)
    }
    /// What drafting did, in words; None when nothing was drafted.
    pub fn describe_drafts(&self) -> Option<String> {
        (self.drafted > 0).then(|| {
            format!(
                "draft: {} tokens drafted, {} accepted ({:.0} %); {:.2} tokens per decode forward",
                self.drafted,
                self.accepted,
                100.0 * self.accepted as f64 / self.drafted as f64,
                self.decode_steps as f64 / self.forwards.max(1) as f64
            )
        })
    }
}

impl crate::engine::Engine {
    /// A fresh sequence over this model with a cache of the given strategy. (Defined here, not in
    /// engine.rs, so that the session depends on the engine and never the reverse.)
    pub fn session(&self, spec: &crate::kv::CacheSpec) -> Session<'_> {
        let cache = spec.build(&self.model().cfg, self.kv_device());
        // A window holds a bounded number of positions whatever the length of the sequence.
        let max = if spec.bounded_by_context() {
            self.ctx()
        } else {
            usize::MAX
        };
        Session::new(self.model(), cache, max)
    }

    /// The sampling settings in force: `flags` over the model's recommendations (`sampling`)
    /// over the built-in defaults; a random seed unless one is given.
    pub fn sampling_for(&self, flags: &SamplingPrefs) -> Resolved {
        self.sampling_over(&[("flag", flags)])
    }

    /// The sampling settings in force: `layers` (most important first, each named for where it
    /// came from: a server's request, then its flags) over the model's recommendations over the
    /// built-in defaults.
    pub fn sampling_over(&self, layers: &[(&str, &SamplingPrefs)]) -> Resolved {
        let mut all = layers.to_vec();
        all.extend(self.sampling().iter().map(|(o, p)| (o.as_str(), p)));
        Resolved::from_layers(&all)
    }
}

/// A sequence and the cache that holds it: feeding tokens runs them through the model.
///
/// Invariant: `tokens` is the sequence the cache has seen (`cache.seen() == tokens.len()`). The
/// fields are private so that only the methods here change either, always both together.
pub struct Session<'m> {
    model: &'m Decoder,
    cache: KvCache,
    /// Every token of the sequence so far, in order.
    tokens: Vec<u32>,
    /// The most positions the sequence may reach (the context size).
    max_positions: usize,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Decoder, cache: KvCache, max_positions: usize) -> Self {
        Self {
            model,
            cache,
            tokens: Vec::new(),
            max_positions,
        }
    }

    /// The sequence so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The cache that holds it (read only: change it through the session).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The most positions the sequence may reach.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Forgets the whole sequence.
    pub fn reset(&mut self) -> Result<()> {
        self.cache.reset()?;
        self.tokens.clear();
        Ok(())
    }

    /// Drops every position from `len` on. A cache that can no longer reach `len` (a window that
    /// dropped it) is an error, and nothing changes. A model with recurrent states goes back to
    /// their newest snapshot at or before `len` and computes the tokens from there to `len` again.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.cache.truncate(len)?;
        let back = self.cache.seen();
        let keep = len.min(self.tokens.len());
        if back < keep {
            let again = self.tokens[back..keep].to_vec();
            self.tokens.truncate(back);
            self.feed(&again)?;
        } else {
            self.tokens.truncate(back);
        }
        Ok(())
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
        self.check_room(new.len())?;
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
            Err(e) => Err(self.undo_failed_step(total - new.len(), e)?),
        }
    }

    /// Refuses a step of `n` more tokens that the context cannot hold.
    fn check_room(&self, n: usize) -> Result<()> {
        let total = self.tokens.len() + n;
        if total > self.max_positions {
            return Err(crate::fixable(
                crate::Fix::RaiseContext,
                format!(
                    "the sequence would be {total} tokens, more than the context of {}",
                    self.max_positions
                ),
            ));
        }
        Ok(())
    }

    /// After a step that failed: the sequence and the cache back to its first `len` tokens, or
    /// (a window that dropped those positions) both cleared rather than disagree; the step's error,
    /// with that said.
    fn undo_failed_step(&mut self, len: usize, e: anyhow::Error) -> Result<anyhow::Error> {
        self.tokens.truncate(len);
        if let Err(back) = self.cache.truncate(self.tokens.len()) {
            self.tokens.clear();
            self.cache.reset()?;
            return Ok(e.context(format!(
                "the cache could not return to the sequence before this step ({}), so it was cleared",
                crate::first_line(back)
            )));
        }
        // Recurrent states go back to a snapshot, which may be before `len`.
        self.tokens.truncate(self.cache.seen());
        Ok(e)
    }

    /// One decode step of several sessions of the same model at once (continuous batching's
    /// step): `tokens[i]` continues `sessions[i]`. The weights are read once for all of them
    /// (`Decoder::forward_rows`), each row attends its own session's cache — whatever its axes —
    /// and each session gets the logits `[vocab]` it would get decoding alone, bit for bit.
    pub fn feed_each(sessions: &mut [&mut Session<'m>], tokens: &[u32]) -> Result<Vec<Tensor>> {
        if sessions.len() != tokens.len() || sessions.is_empty() {
            bail!(
                "a batched step needs one token for each session ({} tokens, {} sessions)",
                tokens.len(),
                sessions.len()
            );
        }
        let model = sessions[0].model;
        for s in sessions.iter() {
            if !std::ptr::eq(s.model, model) {
                bail!("a batched step needs every session to run the same model");
            }
            s.check_room(1)?;
        }
        for (s, &t) in sessions.iter_mut().zip(tokens) {
            s.tokens.push(t);
        }
        let mut caches: Vec<&mut dyn crate::model::cache::DecoderCache> = sessions
            .iter_mut()
            .map(|s| &mut s.cache as &mut dyn crate::model::cache::DecoderCache)
            .collect();
        let result = model.forward_rows(tokens, &mut caches);
        drop(caches);
        match result {
            Ok(logits) => (0..tokens.len())
                .map(|i| Ok(logits.get(i)?))
                .collect::<Result<Vec<_>>>(),
            Err(e) => {
                let mut e = e;
                for s in sessions.iter_mut() {
                    let len = s.tokens.len() - 1;
                    e = s.undo_failed_step(len, e)?;
                }
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
        logits: Tensor,
        sampler: &mut Sampler,
        max_tokens: usize,
        stop_ids: &[u32],
        ignore_eos: bool,
        on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<(Vec<u32>, StopReason, GenStats)> {
        self.decode_drafted(
            logits, sampler, max_tokens, stop_ids, ignore_eos, None, on_token,
        )
    }

    /// Whether a draft can be verified exactly on this cache ([`crate::kv::CacheMode::verifies_drafts`]):
    /// any cache that keeps positions. A float cache of every position attends a verification's
    /// rows together — a model's declared sliding-window layers (Gemma 3) included: each row sees
    /// its own window (a per-row bound), the kernel's key chunks sit at absolute positions (so the
    /// older keys a wide step's view also holds change no bit), and the layers keep
    /// [`crate::kv::DECLARED_WINDOW_SPARE`] positions more than the window, more than a draft
    /// takes back. Other caches attend the rows apart and take the guesses back through a record
    /// of what each changed ([`crate::kv::CacheMode::verifies_batched`]).
    pub fn can_verify_drafts(&self) -> bool {
        self.cache.spec().mode.verifies_drafts()
    }

    /// As [`Session::decode`], with speculative decoding when `drafter` is given and the cache
    /// allows it ([`Session::can_verify_drafts`]): the drafter's guesses after each sampled token
    /// are fed with it in one forward, and each row's logits are sampled in turn — a guess is
    /// accepted when it is the token sampled there. The sampler sees the same logits and history,
    /// in the same order, as without drafts, so the tokens are the same ones (greedy or sampled,
    /// with the same seed); the rejected positions are truncated away.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_drafted(
        &mut self,
        mut logits: Tensor,
        sampler: &mut Sampler,
        max_tokens: usize,
        stop_ids: &[u32],
        ignore_eos: bool,
        mut drafter: Option<&mut (dyn draft::Drafter + '_)>,
        mut on_token: impl FnMut(u32) -> Result<bool>,
    ) -> Result<(Vec<u32>, StopReason, GenStats)> {
        if !self.can_verify_drafts() {
            drafter = None;
        }
        let mut stats = GenStats::default();
        let mut out = Vec::new();
        // A token already sampled from the row of a rejected guess (sampling it again would draw
        // the random generator twice).
        let mut pending: Option<u32> = None;
        let max_positions = self.max_positions;
        // What each sampled token does: Some(reason) ends the generation.
        let mut take = |next: u32, out: &mut Vec<u32>, stats: &mut GenStats, len: usize| {
            if !ignore_eos && stop_ids.contains(&next) {
                return Ok(Some(StopReason::EndOfText));
            }
            out.push(next);
            stats.generated += 1;
            if !on_token(next)? {
                return Ok(Some(StopReason::Interrupted));
            }
            anyhow::Ok(StopReason::after_kept(
                out.len(),
                max_tokens,
                len,
                max_positions,
            ))
        };
        let reason = 'gen: loop {
            let next = match pending.take() {
                Some(t) => t,
                None => sampler.sample(&logits, &self.tokens)?,
            };
            if let Some(r) = take(next, &mut out, &mut stats, self.tokens.len())? {
                break r;
            }
            // The guesses (their time is the decode's): within the answer's and the context's
            // room left after `next`.
            let t = Instant::now();
            let room = (max_tokens - out.len())
                .min(self.max_positions - self.tokens.len() - 1)
                .min(draft::MAX_DRAFT)
                .min(self.cache.draft_room());
            let guess = match drafter.as_deref_mut() {
                Some(d) if room > 0 => {
                    // The sequence with `next` for a moment (no copy of it per step).
                    self.tokens.push(next);
                    let guess = d.propose(&self.tokens, room);
                    self.tokens.pop();
                    guess?
                }
                _ => Vec::new(),
            };
            if guess.is_empty() {
                logits = self.feed(&[next])?;
                stats.decode += t.elapsed();
                stats.decode_steps += 1;
                stats.forwards += 1;
                continue;
            }
            // Rows [k + 1, vocab]: row j follows `next` and the first j guesses.
            let base = self.tokens.len();
            let mut step = vec![next];
            step.extend_from_slice(&guess);
            self.cache.verify_drafts(true);
            let rows = self.feed_with(&step, Logits::All);
            self.cache.verify_drafts(false);
            let rows = rows?;
            stats.decode += t.elapsed();
            stats.forwards += 1;
            stats.drafted += guess.len();
            let mut accepted = 0;
            for (j, &g) in guess.iter().enumerate() {
                stats.decode_steps += 1;
                let row = rows.get(j)?;
                let s = sampler.sample(&row, &self.tokens[..base + 1 + j])?;
                if s != g {
                    // The positions of the rejected guesses go; `s` is the next token.
                    self.truncate(base + 1 + j)?;
                    pending = Some(s);
                    break;
                }
                accepted += 1;
                if let Some(r) = take(s, &mut out, &mut stats, base + 1 + j)? {
                    // As without drafts: a token that ends the generation is not kept.
                    self.truncate(base + 1 + j)?;
                    if let Some(d) = drafter.as_deref_mut() {
                        d.accepted(accepted, guess.len());
                    }
                    stats.accepted += accepted;
                    break 'gen r;
                }
            }
            stats.accepted += accepted;
            if let Some(d) = drafter.as_deref_mut() {
                d.accepted(accepted, guess.len());
            }
            if accepted == guess.len() {
                stats.decode_steps += 1;
                logits = rows.get(guess.len())?;
            }
        };
        Ok((out, reason, stats))
    }

    /// Keeps the longest prefix of what the session holds that `ids` starts with, but at least one token
    /// short of `ids` (there must be something to feed for logits); returns how many positions were
    /// kept. A cache that cannot go back that far (a window that dropped them) starts over.
    pub fn keep_prefix_of(&mut self, ids: &[u32]) -> Result<usize> {
        let keep = self.common_prefix(ids).min(ids.len().saturating_sub(1));
        self.keep(keep)
    }

    /// Keeps the longest prefix of what the session holds that is also a prefix of `ids` (all of
    /// `ids` may be kept); returns how many positions remain.
    pub fn keep_common_prefix(&mut self, ids: &[u32]) -> Result<usize> {
        let keep = self.common_prefix(ids);
        self.keep(keep)
    }

    /// While `on`, a KV budget's evictions wait (`KvCache::hold_evictions`): a prompt's whole
    /// rows can then be saved or stored before the budget compresses them.
    pub fn hold_evictions(&mut self, on: bool) {
        self.cache.hold_evictions(on);
    }

    /// Makes the evictions that waited and stops holding them.
    pub fn evict_held(&mut self) -> Result<()> {
        self.cache.evict_held()
    }

    /// Whether the cache evicts by score (a KV budget).
    pub fn evicts_by_score(&self) -> bool {
        matches!(
            self.cache.spec().retention(),
            crate::kv::Retention::Budget { .. }
        )
    }

    /// The fewest positions of a prompt a resumed state must leave to prefill, so that the
    /// prompt's last step is the one a whole prefill ends with: 1, or for a budget its
    /// observation window (the queries that score what it keeps).
    pub fn resume_margin(&self) -> usize {
        if self.evicts_by_score() {
            crate::kv::OBSERVE_WINDOW
        } else {
            1
        }
    }

    fn common_prefix(&self, ids: &[u32]) -> usize {
        self.tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Truncates to `keep` positions, or starts over where the cache cannot go back that far;
    /// returns the positions held. A model with recurrent states holds fewer when it goes back
    /// to a snapshot before `keep`: the positions after it are the caller's to feed again (with
    /// the rest of its sequence), and are not counted as kept.
    fn keep(&mut self, keep: usize) -> Result<usize> {
        if keep >= self.tokens.len() {
            return Ok(self.tokens.len());
        }
        if self.cache.truncate(keep).is_err() {
            self.reset()?;
            return Ok(0);
        }
        let back = match self.cache.goes_back_to_snapshots() {
            true => self.cache.seen().min(keep),
            false => keep,
        };
        self.tokens.truncate(back);
        Ok(back)
    }
}
