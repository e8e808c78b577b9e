//! `kvchat bench`: what the KV cache buys and costs, measured (`eval::bench`). For each cache mode
//! and context length: prefill a real text of that length, then decode greedy tokens; report
//! prefill tok/s, decode ms/token (median and min–max over the measured runs after the warm-up
//! ones), KV bytes held and RSS. A no-cache cell gets slow with the context: a per-cell time budget
//! caps it, and the table says so. A summary states the cache's end-to-end speed-up for a typical
//! chat turn (512-token prompt + 256 generated tokens).

use super::{write_report, JsonOut};
use crate::engine::{Engine, LoadOptions};
use crate::eval::bench::*;
use crate::kv::{CacheMode, CacheSpec};
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Duration;

/// `kvchat bench`, resolved.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The model, its context large enough for the longest cell and the chat-turn summary, and
    /// every mode's precision.
    pub load: LoadOptions,
    /// Each cache mode with the name it was given.
    pub modes: Vec<(String, CacheMode)>,
    /// Prompt lengths, each at least 1.
    pub contexts: Vec<usize>,
    pub runs: Runs,
    /// Measure the chat-turn summary.
    pub summary: bool,
    /// Measure drafting by prompt lookup (at most this many tokens a guess) on the mode of
    /// `modes` at this index (one that can verify drafts).
    pub draft: Option<(usize, usize)>,
    pub json: Option<JsonOut>,
    /// An .svg file to draw decode ms/token against context into.
    pub plot: Option<PathBuf>,
}

pub fn run(opts: BenchOptions) -> Result<()> {
    let engine = Engine::load(&opts.load)?;
    let specs: Vec<(String, CacheSpec)> = opts
        .modes
        .iter()
        .map(|(name, m)| {
            Ok((
                name.clone(),
                m.spec(engine.ctx())
                    .with_context(|| format!("cache mode {name}"))?,
            ))
        })
        .collect::<Result<_>>()?;

    let n_cells = specs.len() * opts.contexts.len();
    // One step per cell, and one for the chat-turn summary (two forwards and a full turn).
    let bar = ProgressBar::new(
        (n_cells + usize::from(opts.summary) + usize::from(opts.draft.is_some())) as u64,
    )
    .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps, {elapsed} (ETA {eta}) {msg}")
            .expect("valid template"),
    );
    bar.enable_steady_tick(Duration::from_secs(1));
    let mut cells = Vec::new();
    for (name, spec) in &specs {
        for &ctx in &opts.contexts {
            bar.set_message(format!("{name} @ {ctx}"));
            cells.push(measure_cell(&engine, name, spec, ctx, &opts.runs)?);
            bar.inc(1);
        }
    }
    let chat_turn = if !opts.summary {
        None
    } else {
        let (name, spec) = specs
            .iter()
            .find(|(_, s)| !s.recomputes())
            .cloned()
            .unwrap_or((
                "full".into(),
                CacheSpec::full(crate::kv::DEFAULT_PRECISION, engine.ctx()),
            ));
        bar.set_message(format!("chat-turn summary ({name} vs no-cache)"));
        let t = chat_turn(&engine, &name, &spec)?;
        bar.inc(1);
        Some(t)
    };
    let draft = match opts.draft {
        Some((i, max)) => {
            let (name, spec) = &specs[i];
            bar.set_message(format!("draft summary ({name})"));
            let d = draft_summary(&engine, name, spec, max)?;
            bar.inc(1);
            Some(d)
        }
        None => None,
    };
    bar.finish_and_clear();
    let report = BenchReport {
        model: engine
            .path()
            .file_name()
            .map_or("model".into(), |f| f.to_string_lossy().into_owned()),
        threads: candle_core::utils::get_num_threads(),
        gen: opts.runs.gen,
        repeat: opts.runs.repeat,
        cells,
        chat_turn,
        draft,
        peak_rss_bytes: rss().1,
    };
    write_report(&opts.json, &render_table(&report), &report)?;
    if let Some(p) = &opts.plot {
        std::fs::write(p, plot_svg(&report))
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}
