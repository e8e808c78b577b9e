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

/// `kvchat ppl`, resolved.
#[derive(Debug, Clone)]
pub struct PplOptions {
    /// The text file to score.
    pub file: PathBuf,
    /// The model, with every mode's precision.
    pub load: LoadOptions,
    pub mode: CacheMode,
    /// Another mode to score the same tokens through, with its name.
    pub against: Option<(String, CacheMode)>,
    /// Chunk size in tokens (at least 4).
    pub chunk: usize,
    /// At most this many chunks (0 = all).
    pub chunks: usize,
    /// The whole text as one sequence.
    pub long: bool,
    pub json: bool,
}

pub fn run(opts: PplOptions) -> Result<()> {
    let text = crate::fsx::read_text(&opts.file, crate::fsx::MAX_TEXT, "text file")?;
    if text.trim().is_empty() {
        bail!("text file {} is empty", opts.file.display());
    }
    // The text is tokenized whole (as llama-perplexity does: a cut could move the tokens at
    // it), which takes memory for each byte: refused before it is tried when memory cannot hold it.
    let needs = (text.len() as u64).saturating_mul(TOKENIZE_BYTES_PER_BYTE);
    let avail = crate::engine::available_memory();
    if needs > avail {
        bail!(
            "text file {} is {}; tokenizing it takes about {}, more than the {} of memory available (use a shorter text)",
            opts.file.display(),
            crate::source::human_bytes(text.len() as u64),
            crate::source::human_bytes(needs),
            crate::source::human_bytes(avail)
        );
    }
    let engine = Engine::load(&opts.load)?;
    // The modes must fit the context the chunks need.
    let mode = opts.mode.for_model(&engine.model().cfg)?;
    let spec = mode.spec(engine.ctx().max(opts.chunk))?;
    if let Some((name, m)) = &opts.against {
        m.spec(engine.ctx().max(opts.chunk))
            .with_context(|| format!("the cache mode {name} to compare against"))?;
    }
    let tokens = engine.tokenizer().encode(&text)?;
    // A bar on stderr (drawn only on a terminal) with the ETA and the running perplexity, as
    // llama-perplexity prints each chunk's (with --against, of this cache).
    let per_pass = tokens_to_score(
        tokens.len(),
        engine.tokenizer().add_bos && engine.tokenizer().bos_id.is_some(),
        opts.chunk,
        opts.chunks,
        opts.long,
    );
    let bar = indicatif::ProgressBar::new(per_pass as u64)
        .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} tokens scored, {elapsed} (ETA {eta}) {msg}",
        )
        .expect("valid template"),
    );
    // With --against, both caches score in lockstep (one pass over the text), so that each
    // token's two distributions can be compared.
    let (p, vs) = match opts.against.clone() {
        None => {
            let p = perplexity_with(
                &engine,
                mode,
                &tokens,
                opts.chunk,
                opts.chunks,
                opts.long,
                &mut tick(&bar, String::new()),
            )?;
            (p, None)
        }
        Some((name, m)) => {
            let (a, b, d) = compare(
                &engine,
                mode,
                m,
                &tokens,
                opts.chunk,
                opts.chunks,
                opts.long,
                &mut tick(&bar, String::new()),
            )?;
            let v = paired(&a, &b, &name)?;
            (a, Some((v, d)))
        }
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
            opts.chunk,
            spec.describe()
        )?;
        if let Some((v, d)) = &vs {
            writeln!(
                out,
                "against {}: ppl {:.4}; this cache {:+.3}% ± {:.3}% (paired over the same tokens)",
                v.against, v.against_ppl, v.diff_pct, v.diff_stderr_pct
            )?;
            writeln!(
                out,
                "KL divergence from {}: mean {:.6} ± {:.6}, 99% {:.6}, max {:.6} nats; same top token {:.2}%",
                v.against, d.kl_mean, d.kl_stderr, d.kl_p99, d.kl_max, d.same_top_pct
            )?;
        }
    }
    Ok(())
}
