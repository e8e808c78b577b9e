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
pub mod run;
pub mod style;
pub mod tokenize;

use crate::engine::LoadOptions;
use crate::kv::CacheMode;
use crate::model::sampling::SamplingPrefs;
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
    /// The front end's words for each fix.
    pub advice: crate::Advice,
}
