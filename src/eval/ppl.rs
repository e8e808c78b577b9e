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
use crate::model::Logits;
use crate::session::Session;

pub use super::logits_file::{scored_per_chunk, Reader, Writer};
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

impl Perplexity {
    /// The perplexity of these NLLs, with its standard error (delta method: stderr(exp(mean)) =
    /// exp(mean) · stderr(mean)).
    fn of(nll: Vec<f64>, chunks: usize) -> Self {
        let (mean, se) = mean_stderr(&nll);
        let ppl = mean.exp();
        Self {
            ppl,
            ppl_stderr: ppl * se,
            tokens_scored: nll.len(),
            chunks,
            nll,
        }
    }
}

/// The text's tokens as llama-perplexity cuts its chunks from them: the model's BOS (when it adds
/// one) and then the text's.
pub fn stream(engine: &Engine, tokens: &[u32]) -> Vec<u32> {
    bos(engine)
        .into_iter()
        .chain(tokens.iter().copied())
        .collect()
}

/// How many chunks of `chunk` a stream of `len` tokens gives, at most `max_chunks` (0 = all).
pub fn n_chunks(len: usize, chunk: usize, max_chunks: usize) -> usize {
    let available = len / chunk.max(1);
    if max_chunks == 0 {
        available
    } else {
        available.min(max_chunks)
    }
}

/// llama-perplexity's chunks of `stream` ([`stream`]): at most `max_chunks` (0 = all) of `chunk`
/// tokens, chunk c holding the stream's tokens from c·chunk on, its first made BOS when the model
/// adds one.
fn chunks(
    engine: &Engine,
    stream: &[u32],
    chunk: usize,
    max_chunks: usize,
) -> Result<Vec<Vec<u32>>> {
    if chunk < 4 {
        bail!("a chunk of {chunk} tokens is too short (at least 4)");
    }
    let n = n_chunks(stream.len(), chunk, max_chunks);
    if n == 0 {
        bail!(
            "the text has {} tokens, fewer than one chunk of {chunk}",
            stream.len()
        );
    }
    Ok(stream
        .chunks_exact(chunk)
        .take(n)
        .map(|c| {
            let mut seq = c.to_vec();
            if let Some(b) = bos(engine) {
                seq[0] = b; // as llama-perplexity does
            }
            seq
        })
        .collect())
}

/// The BOS token the model adds, if it adds one.
fn bos(engine: &Engine) -> Option<u32> {
    let tk = engine.tokenizer();
    tk.add_bos.then_some(tk.bos_id).flatten()
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
    /// Its standard error, in percent, with every token an independent sample.
    pub diff_stderr_pct: f64,
    /// Its standard error with every chunk's mean difference the sample (two chunks or more):
    /// a rounding that flips early in a chunk moves every later token of it, so its tokens are
    /// not independent, and this error bar is the one that counts that.
    pub diff_stderr_chunks_pct: Option<f64>,
}

/// `a` against `b` (the same tokens scored by two caches).
pub fn paired(a: &Perplexity, b: &Perplexity, against: &str) -> Result<Paired> {
    if a.nll.len() != b.nll.len() || a.nll.is_empty() {
        bail!("the two runs scored different tokens");
    }
    let d: Vec<f64> = a.nll.iter().zip(&b.nll).map(|(x, y)| x - y).collect();
    let (mean, se) = mean_stderr(&d);
    // Chunks score equally many tokens each.
    let per_chunk: Vec<f64> = if a.chunks >= 2 && d.len().is_multiple_of(a.chunks) {
        d.chunks_exact(d.len() / a.chunks)
            .map(|c| c.iter().sum::<f64>() / c.len() as f64)
            .collect()
    } else {
        Vec::new()
    };
    Ok(Paired {
        against: against.to_string(),
        against_ppl: b.ppl,
        diff_pct: 100.0 * mean.exp_m1(),
        // Delta method: d/dm e^m = e^m.
        diff_stderr_pct: 100.0 * mean.exp() * se,
        diff_stderr_chunks_pct: (!per_chunk.is_empty())
            .then(|| 100.0 * mean.exp() * mean_stderr(&per_chunk).1),
    })
}

/// The mean of `x` and its standard error.
fn mean_stderr(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

/// log p of every token under `logits` [vocab] (a log-softmax, in f64).
fn log_probs(logits: &Tensor) -> Result<Vec<f64>> {
    let l: Vec<f32> = logits.to_vec1()?;
    let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    Ok(l.iter().map(|&x| x as f64 - lse).collect())
}

/// KL(P ‖ Q) = Σ p (log p − log q), from log-probabilities, over the tokens where log p > −16:
/// llama-perplexity's sum, term for term (a logits file stores everything below its range as one
/// floor, and the tokens left out hold less than e⁻¹⁶ each). A P read from a file is rounded to
/// 16/65,535 nats and no longer sums to exactly 1, so the sum can come out a little below 0, as
/// llama.cpp's does; it is not clamped.
pub fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .filter(|(&lp, _)| lp > -16.0)
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum::<f64>()
}

fn argmax(x: &[f64]) -> usize {
    x.iter()
        .enumerate()
        .fold(
            (0, f64::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0
}

/// What a run's distributions are compared with, token by token.
pub enum Against<'a> {
    Nothing,
    /// Another cache of the same engine, scored in lockstep.
    Mode(CacheMode),
    /// The distributions a logits file holds (llama-perplexity's `--kl-divergence-base`, or
    /// `kvchat ppl`'s); the run then scores the file's tokens, in its chunks.
    Base(&'a mut Reader),
}

/// A run's perplexity and, when it was compared with something, that one's perplexity over the
/// same tokens and the divergence between the two.
pub struct Scored {
    pub this: Perplexity,
    pub against: Option<(Perplexity, Divergence)>,
}

/// What one scored token gave each side: its NLL under each, and — with something to compare
/// with — the KL divergence of this run's distribution from that one's and whether their top
/// tokens agree.
#[derive(Default)]
struct Scores {
    nll: Vec<Vec<f64>>,
    kl: Vec<f64>,
    same_top: usize,
}

/// Prefills `seq[..warm]` into every session, then feeds the rest token by token to all of them,
/// recording for every token after the warm-up (each predicted from the logits of the one before)
/// what [`Scores`] holds: the first session is this run, the second (or the base file's next
/// distribution) what it is compared with. `save` gets this run's distribution of each scored
/// token; `tick` sees this run's NLLs after each.
fn score(
    sessions: &mut [Session<'_>],
    seq: &[u32],
    warm: usize,
    mut base: Option<&mut Reader>,
    mut save: Option<&mut Writer>,
    out: &mut Scores,
    tick: &mut dyn FnMut(&[f64]),
) -> Result<()> {
    let mut logits: Vec<Tensor> = sessions
        .iter_mut()
        .map(|s| s.feed(&seq[..warm]))
        .collect::<Result<_>>()?;
    for (i, &tok) in seq.iter().enumerate().skip(warm) {
        let mut lp: Vec<Vec<f64>> = logits.iter().map(log_probs).collect::<Result<_>>()?;
        if let Some(w) = save.as_deref_mut() {
            w.token(&lp[0])?;
        }
        if let Some(r) = base.as_deref_mut() {
            let mut from_file = Vec::new();
            r.next_into(&mut from_file)?;
            lp.push(from_file);
        }
        out.nll.resize(lp.len(), Vec::new());
        for (side, l) in lp.iter().enumerate() {
            out.nll[side].push(-l[tok as usize]);
        }
        if let [this, against, ..] = &lp[..] {
            out.kl.push(kl_divergence(against, this));
            out.same_top += usize::from(argmax(this) == argmax(against));
        }
        tick(&out.nll[0]);
        // The last token predicts nothing: it is not fed.
        if i + 1 < seq.len() {
            logits = sessions
                .iter_mut()
                .map(|s| s.feed(&[tok]))
                .collect::<Result<_>>()?;
        }
    }
    Ok(())
}

/// How many tokens a run over a stream of `len` ([`stream`]) scores (what a progress bar counts to).
pub fn tokens_to_score(len: usize, chunk: usize, max_chunks: usize, long: bool) -> usize {
    if long {
        len.saturating_sub(chunk / 2)
    } else {
        n_chunks(len, chunk, max_chunks) * scored_per_chunk(chunk)
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
    let stream = stream(engine, tokens);
    let run = Run {
        chunk,
        max_chunks,
        long,
    };
    Ok(evaluate(engine, cache, Against::Nothing, &stream, &run, None, tick)?.this)
}

/// As [`perplexity`] in chunks (not `long`) with a full cache, each chunk in one forward that
/// returns every position's logits — llama-perplexity's own batching, and the fast way to a
/// reference figure (the scored tokens are the same; the values are those of a prefill, which on
/// the CPU kernels equal token-by-token decoding's, and with candle's dense matmuls differ by
/// rounding).
pub fn perplexity_prefilled(
    engine: &Engine,
    tokens: &[u32],
    chunk: usize,
    max_chunks: usize,
) -> Result<Perplexity> {
    let spec = CacheMode::default().spec(engine.ctx().max(chunk))?;
    let seqs = chunks(engine, &stream(engine, tokens), chunk, max_chunks)?;
    let mut nlls = Vec::new();
    for seq in &seqs {
        let rows = engine.session(&spec).feed_with(seq, Logits::All)?; // [chunk, vocab]
                                                                       // Rows chunk/2 .. chunk-2 predict tokens chunk/2+1 .. chunk-1, as `score` does.
        for j in chunk / 2..chunk - 1 {
            nlls.push(-log_probs(&rows.get(j)?)?[seq[j + 1] as usize]);
        }
    }
    Ok(Perplexity::of(nlls, seqs.len()))
}

/// How far one run's next-token distributions are from another's over the same tokens
/// (llama-perplexity's `--kl-divergence` figures).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Divergence {
    /// Mean KL(P_against ‖ P_this) per token, in nats, with its standard error.
    pub kl_mean: f64,
    pub kl_stderr: f64,
    /// Its 99th percentile and maximum over the tokens.
    pub kl_p99: f64,
    pub kl_max: f64,
    /// Tokens whose most likely next token is the same under both, in percent.
    pub same_top_pct: f64,
}

impl Divergence {
    fn of(s: &Scores) -> Self {
        let n = s.kl.len() as f64;
        let (mean, se) = mean_stderr(&s.kl);
        let mut sorted = s.kl.clone();
        sorted.sort_by(f64::total_cmp);
        // The nearest-rank percentile.
        let p99 = sorted[((0.99 * n).ceil() as usize).clamp(1, sorted.len()) - 1];
        Self {
            kl_mean: mean,
            kl_stderr: se,
            kl_p99: p99,
            kl_max: *sorted.last().expect("tokens were scored"),
            same_top_pct: 100.0 * s.same_top as f64 / n,
        }
    }
}

/// `this` and `against` scored in lockstep over the same tokens: each one's perplexity, and the
/// divergence of `this` from `against` (two caches of one engine, side by side).
#[allow(clippy::too_many_arguments)]
pub fn compare(
    engine: &Engine,
    this: CacheMode,
    against: CacheMode,
    tokens: &[u32],
    chunk: usize,
    max_chunks: usize,
    long: bool,
    tick: &mut dyn FnMut(&[f64]),
) -> Result<(Perplexity, Perplexity, Divergence)> {
    let stream = stream(engine, tokens);
    let run = Run {
        chunk,
        max_chunks,
        long,
    };
    let s = evaluate(
        engine,
        this,
        Against::Mode(against),
        &stream,
        &run,
        None,
        tick,
    )?;
    let (b, d) = s.against.expect("compared");
    Ok((s.this, b, d))
}

/// How a run cuts its tokens: llama-perplexity's chunks of `chunk` (at most `max_chunks`, 0 =
/// all), or with `long` one sequence after a warm-up of chunk/2.
pub struct Run {
    pub chunk: usize,
    pub max_chunks: usize,
    pub long: bool,
}

/// Scores `stream` (the text's tokens after BOS, [`stream`]; with a base file, the file's) through
/// `this` cache, compared with `against`, writing each scored token's distribution to `save`.
pub fn evaluate(
    engine: &Engine,
    this: CacheMode,
    against: Against<'_>,
    stream: &[u32],
    run: &Run,
    mut save: Option<&mut Writer>,
    tick: &mut dyn FnMut(&[f64]),
) -> Result<Scored> {
    let &Run {
        chunk,
        max_chunks,
        long,
    } = run;
    let (caches, mut base) = match against {
        Against::Nothing => (vec![this], None),
        Against::Mode(m) => (vec![this, m], None),
        Against::Base(r) => {
            if long || chunk != r.n_ctx {
                bail!(
                    "internal: a base file of chunks of {} scored in chunks of {chunk}",
                    r.n_ctx
                );
            }
            (vec![this], Some(r))
        }
    };
    if long && save.is_some() {
        bail!("internal: a logits file is written in chunks, not as one sequence");
    }
    let specs: Vec<_> = caches
        .iter()
        .map(|c| c.spec(engine.ctx().max(chunk)))
        .collect::<Result<_>>()?;
    let sessions = || specs.iter().map(|s| engine.session(s)).collect::<Vec<_>>();
    let mut scores = Scores::default();
    let n_chunks = if long {
        if chunk < 4 {
            bail!("a chunk of {chunk} tokens is too short (at least 4)");
        }
        if stream.len() <= chunk / 2 + 1 {
            bail!(
                "the text has {} tokens, too few to score after a warm-up of {}",
                stream.len(),
                chunk / 2
            );
        }
        score(
            &mut sessions(),
            stream,
            chunk / 2,
            None,
            None,
            &mut scores,
            tick,
        )?;
        1
    } else {
        let seqs = chunks(engine, stream, chunk, max_chunks)?;
        for seq in &seqs {
            // Positions chunk/2 .. chunk-2 predict tokens chunk/2+1 .. chunk-1.
            score(
                &mut sessions(),
                seq,
                chunk / 2 + 1,
                base.as_deref_mut(),
                save.as_deref_mut(),
                &mut scores,
                tick,
            )?;
        }
        seqs.len()
    };
    let divergence = (scores.nll.len() > 1).then(|| Divergence::of(&scores));
    let mut ppl = std::mem::take(&mut scores.nll)
        .into_iter()
        .map(|nlls| Perplexity::of(nlls, n_chunks));
    let this = ppl.next().expect("this run scored");
    Ok(Scored {
        this,
        against: ppl.next().zip(divergence),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_to_score_counts_what_the_chunks_score() {
        // Two chunks of 512 (the rest is dropped): positions 257..511 of each, 255 tokens.
        assert_eq!(tokens_to_score(1031, 512, 0, false), 510);
        assert_eq!(tokens_to_score(1031, 512, 1, false), 255);
        // One sequence after a warm-up of 256, the BOS included.
        assert_eq!(tokens_to_score(1001, 512, 0, true), 745);
    }

    #[test]
    fn a_paired_difference_has_an_error_bar_per_token_and_one_per_chunk() {
        let a = Perplexity::of(vec![1.0, 1.0, 2.0, 2.0], 2);
        let b = Perplexity::of(vec![0.0; 4], 2);
        let v = paired(&a, &b, "b").unwrap();
        let e = 1.5f64.exp();
        assert!((v.diff_pct - 100.0 * (e - 1.0)).abs() < 1e-9);
        // Tokens: sd √(1/3) over √4. Chunks: their means 1 and 2, sd √½ over √2 = ½.
        assert!((v.diff_stderr_pct - 100.0 * e * (1.0f64 / 12.0).sqrt()).abs() < 1e-9);
        assert!((v.diff_stderr_chunks_pct.unwrap() - 100.0 * e * 0.5).abs() < 1e-9);
        // One chunk (or one long sequence): no chunk error bar.
        let one = paired(&Perplexity::of(vec![1.0; 4], 1), &b, "b").unwrap();
        assert_eq!(one.diff_stderr_chunks_pct, None);
    }

    #[test]
    fn kl_divergence_is_zero_for_equal_distributions_and_known_for_two_coins() {
        let p = [0.5f64.ln(), 0.5f64.ln()];
        assert_eq!(kl_divergence(&p, &p), 0.0);
        // KL((½, ½) ‖ (¾, ¼)) = ½ ln(2/3) + ½ ln 2 = ½ ln(4/3).
        let q = [0.75f64.ln(), 0.25f64.ln()];
        assert!((kl_divergence(&p, &q) - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-15);
    }
}
