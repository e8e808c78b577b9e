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

use crate::cli::PplArgs;
use crate::engine::Engine;
use crate::kv::CacheMode;
use crate::session::Session;
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::io::Write;

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

/// Advances `bar` by one scored token; every 32 tokens shows the running perplexity.
fn tick(bar: &indicatif::ProgressBar, label: String) -> impl FnMut(&[f64]) + '_ {
    move |nlls| {
        bar.inc(1);
        if nlls.len() % 32 == 0 {
            let mean = nlls.iter().sum::<f64>() / nlls.len() as f64;
            bar.set_message(format!("{label}ppl {:.4}", mean.exp()));
        }
    }
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
    let spec = cache.spec(engine.ctx.max(chunk))?;
    let bos = engine
        .tokenizer
        .add_bos
        .then_some(engine.tokenizer.bos_id)
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

/// Memory the tokenizer takes per byte of text, with room: SmolLM2's took 110 on English (a
/// 5 MB text, 684 MB peak against 132 MB for a 35 KB one: `/usr/bin/time -f %M kvchat ppl
/// --chunks 1`), and a chat line of one repeated letter took ~180.
const TOKENIZE_BYTES_PER_BYTE: u64 = 200;

pub fn run(args: PplArgs) -> Result<()> {
    let mut load = args.model.options()?;
    let mode = args
        .cache
        .mode_for(args.model.ctx.map(|c| c.max(args.chunk)))?;
    let against = match &args.against {
        Some(a) => Some((
            a.clone(),
            a.parse::<CacheMode>()
                .map_err(|e| anyhow::anyhow!("--against: {e}"))?,
        )),
        None => None,
    };
    // With --ctx given, the --against mode is checked against it too before anything loads.
    if let (Some((name, m)), Some(ctx)) = (&against, args.model.ctx) {
        m.spec(ctx.max(args.chunk))
            .map_err(|e| anyhow::anyhow!("--against {name}: {e}"))?;
    }
    load.kv_precisions = std::iter::once(mode.precision)
        .chain(against.as_ref().map(|(_, m)| m.precision))
        .collect();
    if args.chunk < 4 {
        bail!("--chunk must be at least 4 tokens");
    }
    let text = crate::fsx::read_text(&args.file, crate::fsx::MAX_TEXT, "text file")?;
    if text.trim().is_empty() {
        bail!("text file {} is empty", args.file.display());
    }
    // The text is tokenized whole (as llama-perplexity does: a cut could move the tokens at
    // it), which takes memory for each byte: refused before it is tried when memory cannot hold it.
    let needs = (text.len() as u64).saturating_mul(TOKENIZE_BYTES_PER_BYTE);
    let avail = crate::engine::available_memory();
    if needs > avail {
        bail!(
            "text file {} is {}; tokenizing it takes about {}, more than the {} of memory available (use a shorter text)",
            args.file.display(),
            crate::source::human_bytes(text.len() as u64),
            crate::source::human_bytes(needs),
            crate::source::human_bytes(avail)
        );
    }
    let engine = Engine::load(&load)?;
    // The mode must fit the context the chunks need (a window check names the flags).
    let spec = args.cache.spec(engine.ctx.max(args.chunk))?;
    if let Some((name, m)) = &against {
        m.spec(engine.ctx.max(args.chunk))
            .map_err(|e| anyhow::anyhow!("--against {name}: {e}"))?;
    }
    let tokens = engine.tokenizer.encode(&text)?;
    // A bar on stderr (drawn only on a terminal) with the ETA and the running perplexity, as
    // llama-perplexity prints each chunk's; with --against it covers both passes.
    let per_pass = tokens_to_score(
        tokens.len(),
        engine.tokenizer.add_bos && engine.tokenizer.bos_id.is_some(),
        args.chunk,
        args.chunks,
        args.long,
    );
    let passes = 1 + usize::from(against.is_some());
    let bar = indicatif::ProgressBar::new((per_pass * passes) as u64)
        .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} tokens scored, {elapsed} (ETA {eta}) {msg}",
        )
        .expect("valid template"),
    );
    let p = perplexity_with(
        &engine,
        mode,
        &tokens,
        args.chunk,
        args.chunks,
        args.long,
        &mut tick(&bar, String::new()),
    )?;
    let vs = match against {
        Some((name, m)) => {
            let b = perplexity_with(
                &engine,
                m,
                &tokens,
                args.chunk,
                args.chunks,
                args.long,
                &mut tick(&bar, format!("against {name}: ")),
            )?;
            Some(paired(&p, &b, &name)?)
        }
        None => None,
    };
    bar.finish_and_clear();
    let mut out = std::io::stdout().lock();
    if args.json {
        let mut j = serde_json::to_value(&p)?;
        if let Some(v) = &vs {
            j["against"] = serde_json::to_value(v)?;
        }
        writeln!(out, "{j}")?;
    } else {
        writeln!(
            out,
            "ppl {:.4} ± {:.4} over {} tokens in {} chunk(s) of {} | cache: {}",
            p.ppl,
            p.ppl_stderr,
            p.tokens_scored,
            p.chunks,
            args.chunk,
            spec.describe()
        )?;
        if let Some(v) = &vs {
            writeln!(
                out,
                "against {}: ppl {:.4}; this cache {:+.3}% ± {:.3}% (paired over the same tokens)",
                v.against, v.against_ppl, v.diff_pct, v.diff_stderr_pct
            )?;
        }
    }
    Ok(())
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
