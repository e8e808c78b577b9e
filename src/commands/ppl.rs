//! `kvchat ppl FILE`: perplexity of a text through a cache strategy (`eval::ppl`), with a progress
//! bar and the comparison `--against` another mode.

use crate::engine::{Engine, LoadOptions};
use crate::eval::ppl::*;
use crate::kv::CacheMode;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::PathBuf;

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

/// Memory the tokenizer takes per byte of text, with room: SmolLM2's took 110 on English (a
/// 5 MB text, 684 MB peak against 132 MB for a 35 KB one: `/usr/bin/time -f %M kvchat ppl
/// --chunks 1`), and a chat line of one repeated letter took ~180.
const TOKENIZE_BYTES_PER_BYTE: u64 = 200;

/// What `kvchat ppl` does with a logits file (llama-perplexity's `--kl-divergence-base`).
#[derive(Debug, Clone, PartialEq)]
pub enum LogitsFile {
    /// Write this run's distributions to it.
    Save(PathBuf),
    /// Score its tokens and compare with its distributions (`--kl-divergence`).
    Compare(PathBuf),
}

/// `kvchat ppl`, resolved.
#[derive(Debug, Clone)]
pub struct PplOptions {
    /// The text file to score (none when the tokens come from a base file).
    pub file: Option<PathBuf>,
    /// The model, with every mode's precision.
    pub load: LoadOptions,
    pub mode: CacheMode,
    /// Another mode to score the same tokens through, with its name.
    pub against: Option<(String, CacheMode)>,
    pub logits: Option<LogitsFile>,
    /// Chunk size in tokens (at least 4).
    pub chunk: usize,
    /// At most this many chunks (0 = all).
    pub chunks: usize,
    /// The whole text as one sequence.
    pub long: bool,
    pub json: bool,
}

/// The text's tokens, read and tokenized whole (as llama-perplexity does: a cut could move the
/// tokens at it).
fn text_tokens(engine: &Engine, file: &std::path::Path) -> Result<Vec<u32>> {
    let text = crate::fsx::read_text(file, crate::fsx::MAX_TEXT, "text file")?;
    if text.trim().is_empty() {
        bail!("text file {} is empty", file.display());
    }
    // Tokenizing takes memory for each byte: refused before it is tried when memory cannot hold it.
    let needs = (text.len() as u64).saturating_mul(TOKENIZE_BYTES_PER_BYTE);
    let avail = crate::engine::available_memory();
    if needs > avail {
        bail!(
            "text file {} is {}; tokenizing it takes about {}, more than the {} of memory available (use a shorter text)",
            file.display(),
            crate::source::human_bytes(text.len() as u64),
            crate::source::human_bytes(needs),
            crate::source::human_bytes(avail)
        );
    }
    engine.tokenizer().encode(&text)
}

pub fn run(opts: PplOptions) -> Result<()> {
    // A file to write must not exist, and one to read must be one, before the model loads.
    let mut base = match &opts.logits {
        Some(LogitsFile::Save(path)) => {
            Writer::check_target(path)?;
            None
        }
        Some(LogitsFile::Compare(path)) => Some(Reader::open(path)?),
        None => None,
    };
    if let Some(f) = &opts.file {
        crate::fsx::check_regular(f, crate::fsx::MAX_TEXT, "text file")?;
    }
    let engine = Engine::load(&opts.load)?;
    let vocab = engine.model().cfg.vocab;
    let chunk = base.as_ref().map_or(opts.chunk, |b| b.n_ctx);
    // The modes must fit the context the chunks need.
    let mode = opts.mode.for_model(&engine.model().cfg)?;
    let spec = mode.spec(engine.ctx().max(chunk))?;
    if let Some((name, m)) = &opts.against {
        m.spec(engine.ctx().max(chunk))
            .with_context(|| format!("the cache mode {name} to compare against"))?;
    }
    let stream = match (&mut base, &opts.file) {
        (Some(b), _) => {
            if b.n_vocab != vocab {
                bail!(
                    "--kl-divergence-base {} holds distributions over {} tokens; this model's vocabulary has {vocab} (the base was made with another model family)",
                    b.path().display(),
                    b.n_vocab
                );
            }
            std::mem::take(&mut b.tokens)
        }
        (None, Some(file)) => stream(&engine, &text_tokens(&engine, file)?),
        (None, None) => bail!("internal: no text and no base file"),
    };
    let run = Run {
        chunk,
        max_chunks: opts.chunks,
        long: opts.long,
    };
    let mut save = match &opts.logits {
        Some(LogitsFile::Save(path)) => {
            let n = n_chunks(stream.len(), chunk, opts.chunks);
            Some(Writer::create(path, chunk, vocab, &stream[..n * chunk])?)
        }
        _ => None,
    };
    // A bar on stderr (drawn only on a terminal) with the ETA and the running perplexity, as
    // llama-perplexity prints each chunk's.
    let per_pass = tokens_to_score(stream.len(), chunk, opts.chunks, opts.long);
    let bar = indicatif::ProgressBar::new(per_pass as u64)
        .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} tokens scored, {elapsed} (ETA {eta}) {msg}",
        )
        .expect("valid template"),
    );
    // Compared with another cache, both score in lockstep (one pass over the text), so that each
    // token's two distributions can be compared; with a base file, its distributions are read
    // as the tokens are scored.
    let (against, against_name) = match (&opts.against, base.as_mut()) {
        (Some((name, m)), _) => (Against::Mode(*m), name.clone()),
        (None, Some(b)) => {
            let name = b.path().display().to_string();
            (Against::Base(b), name)
        }
        (None, None) => (Against::Nothing, String::new()),
    };
    let scored = evaluate(
        &engine,
        mode,
        against,
        &stream,
        &run,
        save.as_mut(),
        &mut tick(&bar, String::new()),
    )?;
    if let Some(w) = save {
        w.finish()?;
    }
    let p = scored.this;
    let vs = match scored.against {
        Some((b, d)) => Some((paired(&p, &b, &against_name)?, d)),
        None => None,
    };
    bar.finish_and_clear();
    let mut out = std::io::stdout().lock();
    if opts.json {
        let mut j = serde_json::to_value(&p)?;
        if let Some((v, d)) = &vs {
            j["against"] = serde_json::to_value(v)?;
            j["divergence"] = serde_json::to_value(d)?;
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
            chunk,
            spec.describe()
        )?;
        if let Some((v, d)) = &vs {
            let chunks = v
                .diff_stderr_chunks_pct
                .map_or(String::new(), |c| format!(", ± {c:.3}% over chunks"));
            writeln!(
                out,
                "against {}: ppl {:.4}; this cache {:+.3}% ± {:.3}% (paired over the same tokens{chunks})",
                v.against, v.against_ppl, v.diff_pct, v.diff_stderr_pct
            )?;
            writeln!(
                out,
                "KL divergence from {}: mean {:.6} ± {:.6}, 99% {:.6}, max {:.6} nats; same top token {:.2}%",
                v.against, d.kl_mean, d.kl_stderr, d.kl_p99, d.kl_max, d.same_top_pct
            )?;
        }
        if let Some(LogitsFile::Save(path)) = &opts.logits {
            writeln!(
                out,
                "saved every scored token's distribution to {} (compare another run with it: --kl-divergence-base {} --kl-divergence)",
                path.display(),
                path.display()
            )?;
        }
    }
    Ok(())
}
