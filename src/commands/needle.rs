//! `kvchat needle`: pass-key retrieval through a cache (`eval::needle`), as a table, JSON and an
//! SVG heat map.

use super::{write_report, JsonOut};
use crate::engine::{Engine, LoadOptions};
use crate::eval::needle::{heat_map_svg, render_table, run_grid, NeedleGrid};
use crate::kv::CacheMode;
use anyhow::{Context, Result};
use std::path::PathBuf;

/// `kvchat needle`, resolved.
#[derive(Debug, Clone)]
pub struct NeedleOptions {
    /// The model, its context large enough for the longest prompt and its answer.
    pub load: LoadOptions,
    pub mode: CacheMode,
    /// A chat template instead of the model's own (checked).
    pub chat_template: Option<String>,
    pub grid: NeedleGrid,
    /// The context was sized from the grid's longest context (none was given): what to lower
    /// when it does not fit in memory.
    pub ctx_from_grid: bool,
    pub json: Option<JsonOut>,
    /// An .svg file for the heat map.
    pub plot: Option<PathBuf>,
}

pub fn run(opts: NeedleOptions) -> Result<()> {
    let engine = Engine::load(&opts.load).map_err(|e| {
        // A context too large for memory is the grid's longest one when the grid sized it.
        let too_long = e
            .chain()
            .find_map(|c| c.downcast_ref::<crate::Fixable>())
            .is_some_and(|f| f.fix == crate::Fix::LowerContext);
        match opts.ctx_from_grid && too_long {
            true => crate::fixable(crate::Fix::LowerLongestContext, crate::error_line(&e)),
            false => e,
        }
    })?;
    let spec = engine.cache_spec(&opts.mode, engine.ctx())?;
    let template = engine.chat_template(opts.chat_template.as_deref())?;
    let cells = opts.grid.contexts.len() * opts.grid.depths.len();
    let bar =
        indicatif::ProgressBar::new(cells as u64).with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} cells, {elapsed} (ETA {eta}) {msg}",
        )
        .expect("valid template"),
    );
    let report = run_grid(&engine, &template, &spec, &opts.grid, &mut |c| {
        bar.inc(1);
        bar.set_message(format!(
            "{} tok at {}%: {}/{}",
            c.context, c.depth, c.found, c.keys
        ));
    })?;
    bar.finish_and_clear();
    write_report(&opts.json, &render_table(&report), &report)?;
    if let Some(p) = &opts.plot {
        std::fs::write(p, heat_map_svg(&report))
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}
