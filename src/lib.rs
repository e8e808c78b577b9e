//! kvchat: run a local LLM over an explicit, swappable KV cache.
//!
//! The binary (`main.rs`) is a thin clap front over these modules.

pub mod cli;
pub mod commands;
pub mod conversation;
pub mod engine;
pub mod fsx;
pub mod generate;
pub mod guard;
pub mod interrupt;
pub mod kv;
pub mod model;
pub mod plot;
pub mod source;
pub mod template;
pub mod tokenizer;

/// A JSON file, with errors that name it (config.json, tokenizer_config.json, safetensors indexes).
pub fn read_json(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let text = fsx::read_text(path, fsx::MAX_JSON, "JSON file")?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
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
