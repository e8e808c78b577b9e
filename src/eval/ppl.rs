//! `kvchat ppl FILE`: perplexity of a text through the cache strategy in use — what a strategy costs
//! in answer quality.
//!
//! The method is llama.cpp's `llama-perplexity`: the text is cut into non-overlapping chunks of `--ctx`
//! tokens, each scored from a fresh cache, and only the second half of each chunk is scored (every
//! scored token has at least ctx/2 tokens of context); a BOS starts each chunk only if the model adds
//! one. The first half is prefilled in one forward; the scored half goes through the cache token by
//! token, as generation does, so a quantized or windowed cache really is what is measured.
//! `--long` scores the whole text as one sequence instead (after a warm-up of ctx/2 tokens): for a
//! window, a text much longer than the window in one pass.

use crate::engine::Engine;
use crate::kv::CacheMode;
use crate::session::Session;
use anyhow::{bail, Result};
use candle_core::Tensor;

/// The result of a perplexity run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    pub ppl_stderr: f64,
    pub tokens_scored: usize,
    pub chunks: usize,
    /// −log p of every scored token, in order.
    #[serde(skip)]
    pub nll: Vec<f64>,
}

/// One cache against another on the same tokens: how much its perplexity differs, with the
/// standard error of the paired per-token differences (the two runs score the same tokens, so
/// their common difficulty cancels and a small difference can be told from noise).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Paired {
    pub against: String,
    pub against_ppl: f64,
    /// ppl / against_ppl − 1, in percent.
    pub diff_pct: f64,
    /// Its standard error, in percent.
    pub diff_stderr_pct: f64,
}

/// `a` against `b` (the same tokens scored by two caches).
pub fn paired(a: &Perplexity, b: &Perplexity, against: &str) -> Result<Paired> {
    if a.nll.len() != b.nll.len() || a.nll.is_empty() {
        bail!("the two runs scored different tokens");
    }
    let d: Vec<f64> = a.nll.iter().zip(&b.nll).map(|(x, y)| x - y).collect();
    let n = d.len() as f64;
    let mean = d.iter().sum::<f64>() / n;
    let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    Ok(Paired {
        against: against.to_string(),
        against_ppl: b.ppl,
        diff_pct: 100.0 * mean.exp_m1(),
        // Delta method: d/dm e^m = e^m.
        diff_stderr_pct: 100.0 * mean.exp() * (var / n).sqrt(),
    })
}

/// −log p(target) under `logits` [vocab].
fn nll(logits: &Tensor, target: u32) -> Result<f64> {
    let l: Vec<f32> = logits.to_vec1()?;
    let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    Ok(lse - l[target as usize] as f64)
}

/// Prefills `seq[..warm]`, then feeds the rest token by token, appending to `out` the NLL of every
/// token after the warm-up (each predicted from the logits of the one before); `tick` sees `out`
/// after each.
fn score(
    session: &mut Session<'_>,
    seq: &[u32],
    warm: usize,
    out: &mut Vec<f64>,
    tick: &mut dyn FnMut(&[f64]),
) -> Result<()> {
    let mut logits = session.feed(&seq[..warm])?;
    for &tok in &seq[warm..] {
        out.push(nll(&logits, tok)?);
        tick(out);
        logits = session.feed(&[tok])?;
    }
    Ok(())
}

/// How many tokens a run scores (what a progress bar counts to).
pub fn tokens_to_score(
    n_tokens: usize,
    add_bos: bool,
    chunk: usize,
    max_chunks: usize,
    long: bool,
) -> usize {
    if long {
        (n_tokens + usize::from(add_bos)).saturating_sub(chunk / 2)
    } else {
        let available = n_tokens / chunk.max(1);
        let n = if max_chunks == 0 {
            available
        } else {
            available.min(max_chunks)
        };
        n * (chunk - chunk / 2 - 1)
    }
}

/// Perplexity of `tokens` through the engine with the given cache mode.
pub fn perplexity(
    engine: &Engine,
    cache: CacheMode,
    tokens: &[u32],
    chunk: usize,
    max_chunks: usize,
    long: bool,
) -> Result<Perplexity> {
    perplexity_with(engine, cache, tokens, chunk, max_chunks, long, &mut |_| {})
}

/// As [`perplexity`]; `tick` sees the NLLs scored so far after each token (for a progress bar).
pub fn perplexity_with(
    engine: &Engine,
    cache: CacheMode,
    tokens: &[u32],
    chunk: usize,
    max_chunks: usize,
    long: bool,
    tick: &mut dyn FnMut(&[f64]),
) -> Result<Perplexity> {
    if chunk < 4 {
        bail!("a chunk of {chunk} tokens is too short (at least 4)");
    }
    let spec = cache.spec(engine.ctx().max(chunk))?;
    let bos = engine
        .tokenizer()
        .add_bos
        .then_some(engine.tokenizer().bos_id)
        .flatten();
    let mut nlls = Vec::new();
    let n_chunks;
    if long {
        if tokens.len() <= chunk / 2 + 1 {
            bail!(
                "the text has {} tokens, too few to score after a warm-up of {}",
                tokens.len(),
                chunk / 2
            );
        }
        let mut seq = Vec::with_capacity(tokens.len() + 1);
        seq.extend(bos);
        seq.extend_from_slice(tokens);
        let mut s = engine.session(&spec);
        score(&mut s, &seq, chunk / 2, &mut nlls, tick)?;
        n_chunks = 1;
    } else {
        let available = tokens.len() / chunk;
        if available == 0 {
            bail!(
                "the text has {} tokens, fewer than one chunk of {chunk}",
                tokens.len()
            );
        }
        n_chunks = if max_chunks == 0 {
            available
        } else {
            available.min(max_chunks)
        };
        for c in 0..n_chunks {
            let mut seq = tokens[c * chunk..(c + 1) * chunk].to_vec();
            if let Some(b) = bos {
                seq[0] = b; // as llama-perplexity does
            }
            let mut s = engine.session(&spec);
            // Positions chunk/2 .. chunk-1 predict tokens chunk/2+1 .. chunk-1.
            score(&mut s, &seq, chunk / 2 + 1, &mut nlls, tick)?;
        }
    }
    let n = nlls.len() as f64;
    let mean = nlls.iter().sum::<f64>() / n;
    let var = nlls.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let ppl = mean.exp();
    Ok(Perplexity {
        ppl,
        // Delta method: stderr(exp(mean)) = exp(mean) · stderr(mean).
        ppl_stderr: ppl * (var / n).sqrt(),
        tokens_scored: nlls.len(),
        chunks: n_chunks,
        nll: nlls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_to_score_counts_what_the_chunks_score() {
        // Two chunks of 512 (the rest is dropped): positions 257..511 of each, 255 tokens.
        assert_eq!(tokens_to_score(1030, true, 512, 0, false), 510);
        assert_eq!(tokens_to_score(1030, true, 512, 1, false), 255);
        // One sequence after a warm-up of 256, the BOS included.
        assert_eq!(tokens_to_score(1000, true, 512, 0, true), 745);
    }
}
