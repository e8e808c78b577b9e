//! The flag groups shared by subcommands (model, cache, sampling) and their conversion, once, into
//! the library's options. Every check here runs before any download or load, and every error names
//! the flag.

use crate::engine::{max_threads, DeviceChoice, LoadOptions};
use crate::kv::{
    CacheMode, Evict, Precision, Retention, DEFAULT_PRECISION, DEFAULT_RESIDUAL, DEFAULT_SINKS,
};
use crate::model::sampling::SamplingPrefs;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

/// Which model, where it runs.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a models.toml name (`kvchat models list`), hf:owner/repo[@rev][:file.gguf], a GGUF
    /// file, or a directory in the HF layout [default: the registry's default, qwen2.5-coder-0.5b]
    #[arg(short = 'm', long, env = "KVCHAT_MODEL")]
    pub model: Option<String>,
    /// Model registry to read instead of the built-in models.toml
    #[arg(long, env = "KVCHAT_MODELS_FILE", value_name = "FILE")]
    pub models_file: Option<PathBuf>,
    /// tokenizer.json to use instead of the model's own tokenizer
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Device: cpu, cuda[:N], metal or auto (a GPU when this build has CUDA or Metal and one is
    /// present, else the CPU)
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Weight storage: f32, f16 or bf16 for safetensors [default: f32]; for GGUF, dequantize every
    /// matrix to this dtype at load [default: keep them quantized]. Activations stay f32; the KV
    /// cache's precision is chosen apart from it.
    #[arg(long, value_parser = ["f32", "f16", "bf16"])]
    pub dtype: Option<String>,
    /// CPU threads [default: all cores; at most 4 per core]
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context size in tokens: the most positions a sequence may reach [default: the model's trained context]
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Memory the run may take in all (e.g. 768MiB, 4GiB): weights, KV cache at the full context,
    /// state. Checked before loading; a run over it is refused, naming what would fit
    /// [default: the KV cache must fit in half the memory available]
    #[arg(long, value_name = "SIZE", env = "KVCHAT_MEM")]
    pub mem: Option<String>,
    /// When the run would not fit in memory (--mem, or what is available): narrow the KV cache
    /// from the default f16 to int8 or int4, else shorten the context, and say what was chosen
    #[arg(long)]
    pub fit: bool,
    /// CPU matmul for quantized GGUF matrices: preferred (the faster per type), ours or candle —
    /// for side-by-side measurements; gpu: the GPU's path on the CPU (candle's matmuls, KV
    /// rows as tensors, attention by candle ops), to check it where there is no GPU
    #[arg(long, hide = true, env = "KVCHAT_KERNELS", default_value = "preferred")]
    pub kernels: String,
}

impl ModelArgs {
    /// The CPU threads asked for, capped at [`max_threads`] (None: all cores). The process's
    /// thread pool is sized from it before anything runs (main.rs).
    pub fn threads(&self) -> Option<usize> {
        self.threads
            .filter(|&n| n > 0)
            .map(|n| n.min(max_threads()))
    }

    /// The load options these flags select; a thread count over the cap is noted (see
    /// [`ModelArgs::threads`]).
    pub fn options(&self) -> Result<LoadOptions> {
        let device: DeviceChoice = self.device.parse().context("--device")?;
        let dtype = self
            .dtype
            .as_deref()
            .map(crate::model::safetensors::parse_dtype)
            .transpose()
            .context("--dtype")?;
        match self.threads {
            Some(0) => bail!("--threads must be at least 1"),
            Some(n) if n > max_threads() => eprintln!(
                "note: --threads {n} capped at {} (4 × the {} cores)",
                max_threads(),
                max_threads() / 4
            ),
            _ => {}
        }
        if self.ctx == Some(0) {
            bail!("--ctx must be at least 1");
        }
        Ok(LoadOptions {
            model: self.model.clone(),
            models_file: self.models_file.clone(),
            tokenizer: self.tokenizer.clone(),
            device,
            dtype,
            ctx: self.ctx,
            mem: self
                .mem
                .as_deref()
                .map(parse_size)
                .transpose()
                .context("--mem")?,
            fit: self.fit,
            kv_precisions: Vec::new(),
            kernels: {
                crate::model::kernels::quant::simd_cap()?;
                self.kernels.parse().context("--kernels")?
            },
        })
    }
}

/// The KV cache's three axes: retention (--no-cache, --kv-window), precision (--kv-type) and
/// placement (--kv-offload), combined freely.
#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// Keep no KV cache: recompute the whole sequence at every step (the O(n²) baseline)
    #[arg(long)]
    pub no_cache: bool,
    /// Keep only the last N positions (plus --kv-sinks): bounded memory, unbounded length
    #[arg(long, value_name = "N")]
    pub kv_window: Option<usize>,
    /// With --kv-window or --kv-budget: how many first positions to keep as attention sinks
    /// (0 = none)
    #[arg(long, value_name = "S", default_value_t = DEFAULT_SINKS)]
    pub kv_sinks: usize,
    /// Keep N positions per layer, chosen by the attention they receive (--kv-evict); the sinks
    /// and the newest 32 always among them. Bounded memory like a window, but old positions
    /// that matter stay. A size (64MiB) is the positions whose rows take that many bytes
    #[arg(long, value_name = "N|SIZE", conflicts_with = "kv_window")]
    pub kv_budget: Option<String>,
    /// With --kv-budget: how positions are ranked. snapkv: the attention of a prompt's last 32
    /// queries (in a decode, those since the last eviction), per KV head, pooled; tova: the newest
    /// query's, all heads together; h2o: every query's, accumulated [default: snapkv]
    #[arg(long, value_name = "POLICY", requires = "kv_budget")]
    pub kv_evict: Option<String>,
    /// With --kv-budget: flat (every layer N) or pyramid (lower layers more, upper fewer; N on
    /// average, as PyramidKV)
    #[arg(long, value_name = "SHAPE", value_parser = ["flat", "pyramid"], requires = "kv_budget")]
    pub kv_budget_shape: Option<String>,
    /// How the cache stores keys and values: f32, f16, bf16, int8 or int4 (8/4 bits, a f16 scale
    /// per 32 values), all read in place by attention [default: f16]
    #[arg(long, value_name = "TYPE", value_parser = precision_parser(false))]
    pub kv_type: Option<Precision>,
    /// Quantize the cache (the same as --kv-type)
    #[arg(long, value_name = "TYPE", value_parser = precision_parser(true), conflicts_with = "kv_type")]
    pub kv_quant: Option<Precision>,
    /// With int8/int4: how many most recent positions are also kept in f16
    #[arg(long, value_name = "R", default_value_t = DEFAULT_RESIDUAL, alias = "kv-quant-residual")]
    pub kv_residual: usize,
    /// Keep the cache in host memory; each layer is copied to the compute device for its attention
    #[arg(long)]
    pub kv_offload: bool,
}

/// Speculative decoding: how the next tokens are guessed, and how many a forward verifies.
#[derive(Args, Debug, Clone)]
pub struct DraftArgs {
    /// Guess the next tokens and verify them in one forward (the same tokens as without):
    /// `ngram` = prompt lookup, the continuation of the latest earlier match of the last tokens
    /// in the prompt and answer (pays where the answer copies); or a draft model with the same
    /// tokenizer, named as for -m. Needs a KV cache (not --no-cache): docs/draft.md
    #[arg(long, value_name = "ngram|MODEL")]
    pub draft: Option<String>,
    /// The most tokens one draft guesses (1 to 32)
    #[arg(long, value_name = "K", default_value_t = 16, requires = "draft")]
    pub draft_max: usize,
}

impl DraftArgs {
    /// How drafts are guessed, when they are; checked against the cache mode. A draft model
    /// loads as the model does (`model`: the target's load options) but for its name.
    pub fn choice(
        &self,
        mode: &CacheMode,
        model: &crate::engine::LoadOptions,
    ) -> Result<Option<crate::commands::DraftChoice>> {
        let Some(how) = &self.draft else {
            return Ok(None);
        };
        if how.is_empty() {
            bail!("--draft needs ngram or a model");
        }
        let most = crate::session::draft::MAX_DRAFT;
        if !(1..=most).contains(&self.draft_max) {
            bail!(
                "--draft-max must be from 1 to {most}, not {}",
                self.draft_max
            );
        }
        // Why not, in the flags' words, where the mode cannot verify drafts.
        if !mode.verifies_drafts() {
            bail!("--draft needs a KV cache to verify drafts on (drop --no-cache)");
        }
        let max = self.draft_max;
        Ok(Some(if how == "ngram" {
            crate::commands::DraftChoice::Ngram { max }
        } else {
            let load = crate::engine::LoadOptions {
                model: Some(how.clone()),
                tokenizer: None,
                kv_precisions: vec![crate::kv::DEFAULT_PRECISION],
                // The draft is planned against the memory left, not --mem whole: not fitted.
                mem: None,
                fit: false,
                ..model.clone()
            };
            crate::commands::DraftChoice::Model { load, max }
        }))
    }
}

/// clap's parser of a KV precision: the precision table's names (`model::cache`), the quantized
/// ones alone when `quantized_only`.
pub(crate) fn precision_parser(
    quantized_only: bool,
) -> impl clap::builder::TypedValueParser<Value = Precision> {
    use clap::builder::TypedValueParser;
    let names = Precision::ALL
        .into_iter()
        .filter(move |p| !quantized_only || p.quantized())
        .map(Precision::name);
    clap::builder::PossibleValuesParser::new(names)
        .map(|name| Precision::parse(&name).expect("a name from the table"))
}

impl CacheArgs {
    /// The cache mode these flags select. Conflicts and impossible values are refused here, before
    /// anything loads, each naming its flag.
    pub fn mode(&self) -> Result<CacheMode> {
        let precision = self.kv_quant.or(self.kv_type).unwrap_or(DEFAULT_PRECISION);
        if self.kv_residual != DEFAULT_RESIDUAL && !precision.quantized() {
            bail!("--kv-residual applies to a quantized cache only (add --kv-type int8 or int4)");
        }
        if self.no_cache && self.kv_window.is_some() {
            bail!("--no-cache and --kv-window cannot be combined: with no cache nothing is kept to window");
        }
        if self.no_cache && self.kv_budget.is_some() {
            bail!("--no-cache and --kv-budget cannot be combined: with no cache nothing is kept to choose from");
        }
        if self.kv_sinks != DEFAULT_SINKS && self.kv_window.is_none() && self.kv_budget.is_none() {
            bail!("--kv-sinks applies to --kv-window or --kv-budget (add one of them)");
        }
        if self.no_cache && self.kv_offload {
            bail!("--no-cache and --kv-offload cannot be combined: with no cache nothing is kept to offload");
        }
        let mut budget_bytes = None;
        let retention = if self.no_cache {
            Retention::None
        } else if let Some(window) = self.kv_window {
            if window == 0 {
                bail!("--kv-window must be at least 1");
            }
            if self.kv_sinks >= window {
                bail!(
                    "--kv-sinks {} must be smaller than --kv-window {window}",
                    self.kv_sinks
                );
            }
            Retention::Window {
                window,
                sinks: self.kv_sinks,
            }
        } else if let Some(given) = &self.kv_budget {
            // Positions, or a size turned into positions once the model is known.
            let (budget, bytes) = if given.bytes().all(|b| b.is_ascii_digit()) && !given.is_empty()
            {
                let n = given.parse::<usize>().map_err(|_| {
                    anyhow::anyhow!("--kv-budget {given} is more positions than can be counted")
                })?;
                (n, None)
            } else {
                let b = parse_size(given).map_err(|_| {
                    anyhow::anyhow!(
                        "--kv-budget '{given}' is neither a number of positions nor a size (e.g. 512, 64MiB)"
                    )
                })?;
                if b == 0 {
                    bail!("--kv-budget {given} holds nothing: give at least one position's bytes");
                }
                (usize::MAX, Some(b))
            };
            budget_bytes = bytes;
            let evict = match self.kv_evict.as_deref() {
                None => Evict::DEFAULT,
                Some(name) => Evict::parse(name).ok_or_else(|| {
                    let names = Evict::ALL.map(Evict::name);
                    anyhow::anyhow!(
                        "--kv-evict '{name}' is not a policy (choose {}){}",
                        names.join(", "),
                        crate::did_you_mean(name, names)
                    )
                })?,
            };
            if budget == 0 {
                bail!("--kv-budget must be at least 1 position");
            }
            let newest = crate::kv::newest_kept(precision, self.kv_residual);
            if let Some(why) = crate::kv::budget_unfit(budget, self.kv_sinks, newest) {
                bail!(
                    "--kv-budget {budget} with --kv-sinks {}: {why}",
                    self.kv_sinks
                );
            }
            Retention::Budget {
                budget,
                sinks: self.kv_sinks,
                evict,
                pyramid: self.kv_budget_shape.as_deref() == Some("pyramid"),
            }
        } else {
            Retention::All
        };
        Ok(CacheMode {
            precision,
            retention,
            offload: self.kv_offload,
            residual: self.kv_residual,
            budget_bytes,
        })
    }

    /// The cache mode, checked against `--ctx` when that is given (so that a window wider than the
    /// context is refused before anything loads).
    pub fn mode_for(&self, ctx: Option<usize>) -> Result<CacheMode> {
        let mode = self.mode()?;
        // (A budget in bytes is checked once the model's bytes per position are known.)
        if let (Some(c), None) = (ctx, mode.budget_bytes) {
            self.spec(c)?;
        }
        Ok(mode)
    }

    /// The cache for a context of `ctx` positions (`--ctx`).
    pub fn spec(&self, ctx: usize) -> Result<crate::kv::CacheSpec> {
        let mode = self.mode()?;
        mode.spec(ctx).with_context(|| match mode.retention {
            Retention::Window { window, sinks } => {
                format!("--kv-window {window} with --kv-sinks {sinks} and --ctx {ctx}")
            }
            Retention::Budget { .. } => format!(
                "--kv-budget {} and --ctx {ctx}",
                self.kv_budget.as_deref().unwrap_or("")
            ),
            _ => format!("--ctx {ctx}"),
        })
    }
}

/// How the next token is picked. A setting not given here comes from the model's recommendation
/// (models.toml, then the model file), else the built-in default shown.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy (always the most likely token) [default: the model's, else 0.8]
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = off) [default: the model's, else 40]
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches P (1 = off) [default: the model's, else 0.95]
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P × the most likely one (0 = off) [default: the model's, else 0.05]
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalty for repeating recent tokens (1 = off) [default: the model's, else 1]
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens the repeat penalty looks at [default: the model's, else 64]
    #[arg(long)]
    pub repeat_last_n: Option<usize>,
    /// Random seed for sampling [default: a random one, shown by --stats]
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The settings the flags state, each checked (the error names the flag).
    pub fn prefs(&self) -> Result<SamplingPrefs> {
        let p = SamplingPrefs {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        };
        if let Some((name, why)) = p.problems().into_iter().next() {
            bail!("--{name} {why}");
        }
        Ok(p)
    }
}

/// The prefix store (`kv::prefix`): reuse of earlier prompts' KV blocks across processes.
#[derive(Args, Debug, Clone)]
pub struct StoreArgs {
    /// Neither reuse nor store prompt prefixes in the prefix store ($KVCHAT_HOME/kv-store)
    #[arg(long)]
    pub no_kv_store: bool,
    /// Bytes the prefix store may hold on disk, e.g. 2GiB, 500MiB, 1G (least recently used blocks
    /// go first; 0 turns the store off)
    #[arg(long, value_name = "SIZE", default_value = "2GiB")]
    pub kv_store_budget: String,
    /// Where the prefix store keeps its blocks [default: $KVCHAT_HOME/kv-store]
    #[arg(long, value_name = "DIR", env = "KVCHAT_KV_STORE")]
    pub kv_store_dir: Option<PathBuf>,
}

/// A byte size: a number with an optional unit (B; K, M, G, T and KiB… binary; KB, MB, GB, TB
/// decimal), e.g. `2GiB`, `500MB`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let bad = || anyhow::anyhow!("'{s}' is not a size (e.g. 2GiB, 500MB, 1048576)");
    let n: f64 = num.parse().map_err(|_| bad())?;
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = n * mult;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod size_tests {
    use super::parse_size;

    #[test]
    fn sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_size("1.5 MiB").unwrap(), 1_572_864);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("0").unwrap(), 0);
    }

    #[test]
    fn a_size_with_an_unknown_unit_is_refused() {
        for s in ["2XB", "", "GiB", "-1G", "1e999G"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
    }
}
