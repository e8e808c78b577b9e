//! The command line: the only place that knows a flag. clap parses the flags (`subcommands.rs`,
//! `options.rs`); `resolve.rs` turns each subcommand's flags, once, into the options its command
//! runs with (`options.rs` converts the shared groups: `LoadOptions`, `CacheMode`,
//! `SamplingPrefs`), checking every value before anything is downloaded or loaded; `report.rs`
//! words errors for a person, adding which flag would fix them.

pub mod options;
pub mod report;
pub mod resolve;
pub mod subcommands;

#[cfg(test)]
mod doc_commands;

pub use options::{CacheArgs, ModelArgs, SamplingArgs, StoreArgs};
pub use subcommands::*;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "kvchat",
    version,
    about = "Run a local LLM and see what its KV cache buys and costs",
    long_about = "Run a local LLM (GGUF or safetensors; the architectures are listed in docs/models.md) for chat, one-shot completion or an OpenAI-compatible server, over an explicit KV cache \
whose precision, retention and placement are chosen by flags. With no --model, the registry's default model (models.toml; `kvchat models list`), \
fetched on first use.",
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
    /// Serve the OpenAI API (chat completions, completions, models) to many clients at once, sharing one KV pool.
    Serve(ServeArgs),
    /// Measure prefill and decode speed and KV memory for each cache mode and context length.
    Bench(BenchArgs),
    /// KV cache memory arithmetic: bytes per token, per context, per user, for each storage mode.
    KvSize(KvSizeArgs),
    /// Perplexity of a text file through the chosen cache strategy (llama-perplexity's method).
    Ppl(PplArgs),
    /// Pass-key retrieval through the chosen cache: a key hidden at depths in filler text, found or not.
    Needle(NeedleArgs),
    /// A question set (facts, arithmetic, instructions, code) answered at the model's own sampling
    /// over several seeds: how often its first answer is right.
    Quiz(QuizArgs),
    /// Print the token ids of TEXT as a JSON array.
    Tokenize(TokenizeArgs),
    /// The model registry (models.toml): list entries and what is on disk, pull a model.
    Models(ModelsArgs),
    /// The prefix store on disk (KV blocks of earlier prompts, reused by run and chat): stats, ls, clear.
    Cache(CacheCmdArgs),
    /// Print a completion script for a shell (e.g. `kvchat completions bash > ~/.local/share/bash-completion/completions/kvchat`).
    Completions {
        /// bash, zsh, fish, elvish or powershell
        shell: clap_complete::Shell,
    },
}

impl Command {
    /// The CPU threads the command's flags ask for (None: all cores, or a command that runs no
    /// model).
    pub fn threads(&self) -> Option<usize> {
        match self {
            Command::Run(a) => a.model.threads(),
            Command::Chat(a) => a.model.threads(),
            Command::Serve(a) => a.model.threads(),
            Command::Bench(a) => a.model.threads(),
            Command::Ppl(a) => a.model.threads(),
            Command::Needle(a) => a.model.threads(),
            Command::Quiz(a) => a.model.threads(),
            _ => None,
        }
    }

    /// How many times an idle worker of the thread pool polls for work before it parks
    /// (main.rs): a server's batched steps leave it longer gaps than one sequence's step.
    pub fn pool_spin_polls(&self) -> u32 {
        match self {
            Command::Serve(_) => 2_000,
            _ => 500,
        }
    }
}

/// `kvchat --version`: the version, the compute features built in, and the CPU paths this machine
/// runs (chosen at run time).
pub fn long_version() -> String {
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("metal", cfg!(feature = "metal")),
    ]
    .into_iter()
    .filter_map(|(n, on)| on.then_some(n))
    .collect();
    let features = if features.is_empty() {
        "none (CPU only)".to_string()
    } else {
        features.join(", ")
    };
    #[cfg(target_arch = "x86_64")]
    let cpu: Vec<&str> = [
        ("avx2", std::arch::is_x86_feature_detected!("avx2")),
        ("fma", std::arch::is_x86_feature_detected!("fma")),
        ("f16c", std::arch::is_x86_feature_detected!("f16c")),
        ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
    ]
    .into_iter()
    .filter_map(|(n, on)| on.then_some(n))
    .collect();
    #[cfg(not(target_arch = "x86_64"))]
    let cpu: Vec<&str> = vec!["portable"];
    format!(
        "{}\nfeatures: {features}\nCPU paths: {}",
        env!("CARGO_PKG_VERSION"),
        if cpu.is_empty() {
            "scalar".to_string()
        } else {
            cpu.join(", ")
        }
    )
}
