//! kvchat: run a local LLM over an explicit, swappable KV cache.
//!
//! The binary (`main.rs`) is a thin clap front over these modules.

pub mod cli;
pub mod commands;
pub mod engine;
pub mod fsx;
pub mod guard;
pub mod interrupt;
pub mod kv;
pub mod model;
pub mod plot;
pub mod session;
pub mod source;
pub mod template;
pub mod tokenizer;

/// A JSON file, with errors that name it (config.json, tokenizer_config.json, safetensors indexes).
pub fn read_json(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let text = fsx::read_text(path, fsx::MAX_JSON, "JSON file")?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// What a person can change to avoid an error. Core code names values, never flags; a front end
/// (the CLI's `report`) words the fix in its own terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fix {
    /// A longer context would hold the sequence.
    RaiseContext,
    /// A shorter context would fit in memory.
    LowerContext,
    /// The CPU device runs this.
    CpuDevice,
    /// A tokenizer.json must be given.
    Tokenizer,
    /// A chat template must be given (or the raw prompt used).
    ChatTemplate,
    /// Only the full cache can do this yet.
    FullCache,
    /// Another KV precision would fit this model.
    KvType,
    /// A chat that no longer fits: drop turns or grow the context.
    ChatFull,
    /// A build with the cuda / metal feature.
    BuildWithCuda,
    BuildWithMetal,
}

/// An error that a [`Fix`] would avoid; its text names the values involved.
#[derive(Debug)]
pub struct Fixable {
    pub fix: Fix,
    pub message: String,
}

impl std::fmt::Display for Fixable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Fixable {}

pub fn fixable(fix: Fix, message: String) -> anyhow::Error {
    anyhow::Error::new(Fixable { fix, message })
}

/// An error as one line: its context chain joined by ": ", each part cut to its first line (candle
/// appends a captured backtrace to its messages). The one way kvchat words an error for a person.
pub fn error_line(e: &anyhow::Error) -> String {
    e.chain().map(first_line).collect::<Vec<_>>().join(": ")
}

/// The first line of an error's text: candle appends a captured backtrace to its messages.
pub fn first_line(e: impl std::fmt::Display) -> String {
    e.to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end()
        .to_string()
}
