//! kvchat: run a local LLM over an explicit, swappable KV cache.
//!
//! The binary (`main.rs`) is a thin clap front over these modules.

pub mod cli;
pub mod commands;
pub mod engine;
pub mod generate;
pub mod kv;
pub mod model;
pub mod template;
pub mod tokenizer;
