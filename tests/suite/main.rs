//! The integration tests, one binary: each file is a module named for what it tests. They were 14
//! binaries, each compiling the shared helpers (`common`) and linking the whole crate again; one
//! binary compiles and links once, and the real model (`common::engine`) loads once for all.
//! Run one part with `cargo test --release --test suite -- MODULE::` (e.g. `weights::`).

mod common;

mod bench;
mod chat;
mod cli;
mod engine;
mod flood;
mod gemma;
mod gemma4;
mod gpt_oss;
mod hf_layout;
mod hostile;
mod messages;
mod props;
mod quiz;
mod qwen3;
mod qwen35;
mod qwen_coder;
mod reasoning;
mod responses;
mod sched;
mod serve;
mod sources;
mod store;
mod strategies;
mod structured;
mod tiny;
mod tools;
mod weights;
