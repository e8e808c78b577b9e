//! One file per subcommand. A command receives its options resolved (`cli/` turned the flags into
//! these types once, checking every value before anything loads); it parses no flag and names
//! none: the errors it reports and goes on from are worded by the front end's [`crate::Advice`].

pub mod bench;
pub mod cache;
pub mod chat;
pub mod kv_size;
pub mod models;
pub mod needle;
pub mod ppl;
pub mod quiz;
pub mod run;
pub mod serve;
pub mod style;
pub mod thinking;
pub mod tokenize;

use crate::engine::{Engine, LoadOptions};
use crate::kv::{CacheMode, KvCache};
use crate::model::sampling::SamplingPrefs;
use crate::source::human_bytes;
use std::path::PathBuf;

/// Where the JSON report goes.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonOut {
    /// To stdout (the table then goes to stderr).
    Stdout,
    File(PathBuf),
}

/// A report as its table on stdout, and as JSON where `json` says (on stdout, the table then going
/// to stderr; or to a file).
pub fn write_report(
    json: &Option<JsonOut>,
    table: &str,
    report: &impl serde::Serialize,
) -> anyhow::Result<()> {
    use anyhow::Context;
    match json {
        Some(JsonOut::Stdout) => {
            eprint!("{table}");
            println!("{}", serde_json::to_string_pretty(report)?);
        }
        other => {
            print!("{table}");
            if let Some(JsonOut::File(p)) = other {
                std::fs::write(p, serde_json::to_string_pretty(report)?)
                    .with_context(|| format!("cannot write {}", p.display()))?;
            }
        }
    }
    Ok(())
}

/// The prefix store as a run or chat uses it.
#[derive(Debug, Clone)]
pub enum StoreChoice {
    /// Off, and why (for `--stats`: the front end's words).
    Off(&'static str),
    /// Under `root`, holding at most `budget` bytes.
    On { root: PathBuf, budget: u64 },
}

/// The chat template to use instead of the model's own.
#[derive(Debug, Clone)]
pub struct TemplateChoice {
    /// A name (chatml, llama3, …), Jinja text or a file (checked: it reads and compiles).
    pub spec: String,
    /// Where it came from, for a person (`/show`).
    pub label: String,
}

/// How drafts are guessed.
#[derive(Debug, Clone)]
pub enum DraftChoice {
    /// Prompt lookup, at most `max` tokens a draft.
    Ngram { max: usize },
    /// A small model with the same vocabulary, `max` tokens a draft (run only).
    Model { load: LoadOptions, max: usize },
}

/// What `run` and `chat` share.
#[derive(Debug, Clone)]
pub struct Generate {
    pub load: LoadOptions,
    pub mode: CacheMode,
    pub sampling: SamplingPrefs,
    pub store: StoreChoice,
    pub system: Option<String>,
    pub template: Option<TemplateChoice>,
    /// Most tokens per answer (at least 1).
    pub max_tokens: usize,
    /// Print speed, cache and sampling figures to stderr.
    pub stats: bool,
    /// The file the KV state is reused from and saved to (checked: a kvchat KV file or nothing).
    pub prompt_cache: Option<PathBuf>,
    /// Speculative decoding (the cache checked able to verify drafts:
    /// `Session::can_verify_drafts`).
    pub draft: Option<DraftChoice>,
    /// Leave a thinking model's reasoning out of what is shown.
    pub hide_reasoning: bool,
    /// The front end's words for each fix.
    pub advice: crate::Advice,
}

/// What a cache holds against a uniform one that keeps every position: a line for a model's
/// declared windows and one for a budget, where they apply (`--stats`, chat's `/cache`).
pub(crate) fn cache_savings(engine: &Engine, cache: &KvCache) -> Vec<String> {
    [
        window_saving(engine, cache),
        budget_saving(engine, cache),
        recurrent_memory(engine, cache),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// For a budget cache: what it evicted, and what it holds against keeping every position seen.
fn budget_saving(engine: &Engine, cache: &KvCache) -> Option<String> {
    let evicted: Vec<usize> = cache.layers().iter().filter_map(|l| l.evicted()).collect();
    if evicted.is_empty() {
        return None;
    }
    let cfg = &engine.model().cfg;
    let seen = cache.seen();
    let full = crate::kv::CacheSpec {
        mode: crate::kv::CacheMode {
            retention: crate::kv::Retention::All,
            ..cache.spec().mode
        },
        max_positions: seen.max(1),
        grow_by: None,
    };
    let every = crate::kv::size::KvDims::bytes_for_spec(&full, cfg, seen);
    let used = cache.bytes_used() as f64;
    Some(format!(
        "kv budget: {} positions evicted per layer on average ({} of {} KV layers under the budget); {} held against {} with every position kept ({:.2}×)",
        evicted.iter().sum::<usize>() / evicted.len(),
        evicted.len(),
        cfg.kv_layers(),
        human_bytes(used as u64),
        human_bytes(every as u64),
        if every > 0.0 { used / every } else { 1.0 }
    ))
}

/// For a model with recurrent layers (Qwen3.5): its memory by kind, against a cache of keys and
/// values on every layer.
fn recurrent_memory(engine: &Engine, cache: &KvCache) -> Option<String> {
    let m = cache.memory_by_kind(&engine.model().cfg)?;
    Some(format!("memory by kind: {m}"))
}

/// For a model whose layers declare sliding windows: what the cache holds against a uniform one.
fn window_saving(engine: &Engine, cache: &KvCache) -> Option<String> {
    let cfg = &engine.model().cfg;
    let (w, local) = cfg.window_layers()?;
    let uniform = cache.bytes_uniform(cfg);
    let used = cache.bytes_used() as f64;
    Some(format!(
        "sliding-window layers: {local} of {} attend within {w} positions (and keep {}): {} held against {} for a uniform cache ({:.2}×)",
        cfg.n_layer,
        w + crate::kv::DECLARED_WINDOW_SPARE,
        human_bytes(used as u64),
        human_bytes(uniform as u64),
        if uniform > 0.0 { used / uniform } else { 1.0 }
    ))
}
