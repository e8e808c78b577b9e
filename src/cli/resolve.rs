//! Each subcommand's flags turned, once, into the options its command runs with (ripgrep's
//! `HiArgs` idea): every value checked here, before anything is read, fetched or loaded, and every
//! error naming its flag. A command parses nothing after this.

use super::options::{CacheArgs, DraftArgs, ModelArgs, SamplingArgs, StoreArgs};
use super::subcommands::*;
use crate::commands::bench::BenchOptions;
use crate::commands::cache::{CacheOptions, CacheTask};
use crate::commands::chat::ChatOptions;
use crate::commands::kv_size::KvSizeOptions;
use crate::commands::models::{ModelsOptions, ModelsTask};
use crate::commands::needle::NeedleOptions;
use crate::commands::ppl::{LogitsFile, PplOptions};
use crate::commands::quiz::QuizOptions;
use crate::commands::run::RunOptions;
use crate::commands::serve::ServeOptions;
use crate::commands::tokenize::TokenizeOptions;
use crate::commands::JsonOut;
use crate::commands::{Generate, StoreChoice, TemplateChoice};
use crate::eval::bench::Runs;
use crate::eval::kv_size::{DimsFrom, KvSizeQuery};
use crate::eval::needle::NeedleGrid;
use crate::eval::quiz::QuizPlan;
use crate::grammar::Grammar;
use crate::kv::size::KvDims;
use crate::kv::{CacheMode, Retention};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The flags `run` and `chat` share.
struct GenerateFlags<'a> {
    model: &'a ModelArgs,
    cache: &'a CacheArgs,
    sampling: &'a SamplingArgs,
    store: &'a StoreArgs,
    system: Option<String>,
    chat_template: Option<String>,
    max_tokens: usize,
    stats: bool,
    prompt_cache: Option<PathBuf>,
    draft: &'a DraftArgs,
    hide_reasoning: bool,
}

/// The shared flags of `run`'s or `chat`'s args (the same fields in both).
macro_rules! generate_flags {
    ($args:expr) => {
        GenerateFlags {
            model: &$args.model,
            cache: &$args.cache,
            sampling: &$args.sampling,
            store: &$args.store,
            system: $args.system.clone(),
            chat_template: $args.chat_template.clone(),
            max_tokens: $args.max_tokens,
            stats: $args.stats,
            prompt_cache: $args.prompt_cache.clone(),
            draft: &$args.draft,
            hide_reasoning: $args.hide_reasoning,
        }
    };
}

impl GenerateFlags<'_> {
    fn resolve(self) -> Result<Generate> {
        if self.max_tokens == 0 {
            bail!("-n/--max-tokens must be at least 1");
        }
        let sampling = self.sampling.prefs()?;
        let mut load = self.model.options()?;
        let mode = self.cache.mode_for(self.model.ctx)?;
        load.kv_precisions = vec![mode.precision];
        if mode.retention == Retention::None && self.prompt_cache.is_some() {
            bail!("--prompt-cache needs a KV cache (drop --no-cache)");
        }
        // What is at --prompt-cache must be a kvchat KV file or nothing.
        if let Some(pc) = &self.prompt_cache {
            crate::kv::persist::check_target(pc)
                .map_err(|e| anyhow::anyhow!("--prompt-cache: {e}"))?;
        }
        let template = template_choice(self.chat_template)?;
        let draft = self.draft.choice(&mode, &load)?;
        Ok(Generate {
            load,
            mode,
            sampling,
            store: self.store.choice(self.prompt_cache.is_some())?,
            system: self.system,
            template,
            max_tokens: self.max_tokens,
            stats: self.stats,
            prompt_cache: self.prompt_cache,
            draft,
            hide_reasoning: self.hide_reasoning,
            advice: super::report::advice,
        })
    }
}

/// `--chat-template`, checked: it reads and compiles.
fn template_choice(spec: Option<String>) -> Result<Option<TemplateChoice>> {
    Ok(match spec {
        Some(spec) => {
            crate::template::ChatTemplate::check_spec(&spec).context("--chat-template")?;
            let label = if spec.len() < 40 && !spec.contains('{') {
                format!("{spec} (--chat-template)")
            } else {
                "Jinja text from --chat-template".into()
            };
            Some(TemplateChoice { spec, label })
        }
        None => None,
    })
}

impl ServeArgs {
    pub fn resolve(self) -> Result<ServeOptions> {
        if self.max_tokens == 0 {
            bail!("-n/--max-tokens must be at least 1");
        }
        if self.queue == 0 {
            bail!("--queue 0 would turn every request away: give at least 1");
        }
        if !(1..=256).contains(&self.parallel) {
            bail!("--parallel {} is not from 1 to 256", self.parallel);
        }
        let host: std::net::IpAddr = self.host.parse().map_err(|_| {
            anyhow::anyhow!(
                "--host {:?} is not an IP address (127.0.0.1, ::1, 0.0.0.0, …)",
                self.host
            )
        })?;
        let api_key = self.api_key.filter(|k| !k.is_empty());
        if !host.is_loopback() && api_key.is_none() {
            bail!(
                "--host {host} is reachable from other machines: serving beyond this one needs --api-key (or KVCHAT_API_KEY)"
            );
        }
        let pool = match &self.kv_pool {
            Some(s) => {
                let b = super::options::parse_size(s).context("--kv-pool")?;
                if b == 0 {
                    bail!(
                        "--kv-pool {s} is empty: give the KV memory requests share (e.g. 512MiB)"
                    );
                }
                Some(b)
            }
            None => None,
        };
        let exit_after = match self.exit_after {
            Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Some(Duration::from_secs_f64(s)),
            Some(s) => bail!("--exit-after {s} is not a positive number of seconds"),
            None => None,
        };
        let sampling = self.sampling.prefs()?;
        let mut load = self.model.options()?;
        let mode = self.cache.mode_for(self.model.ctx)?;
        if mode.retention == Retention::None {
            bail!("serve keeps a KV cache for every request: drop --no-cache");
        }
        load.kv_precisions = vec![mode.precision];
        Ok(ServeOptions {
            load,
            mode,
            sampling,
            template: template_choice(self.chat_template)?,
            addr: std::net::SocketAddr::new(host, self.port),
            parallel: self.parallel,
            pool,
            queue: self.queue,
            api_key,
            max_tokens: self.max_tokens,
            exit_after,
            store: self.store.choice(false)?,
        })
    }
}

impl StoreArgs {
    /// The prefix store as these flags (and `--prompt-cache`, which names the state to use
    /// instead) choose it.
    fn choice(&self, prompt_cache: bool) -> Result<StoreChoice> {
        let budget =
            super::options::parse_size(&self.kv_store_budget).context("--kv-store-budget")?;
        Ok(if prompt_cache {
            StoreChoice::Off("--prompt-cache names the state to use")
        } else if self.no_kv_store {
            StoreChoice::Off("--no-kv-store")
        } else if budget == 0 {
            StoreChoice::Off("--kv-store-budget 0")
        } else {
            StoreChoice::On {
                root: self
                    .kv_store_dir
                    .clone()
                    .unwrap_or_else(crate::source::kv_store_root),
                budget,
            }
        })
    }
}

/// How long a generation into a pipe runs before its bar shows: `KVCHAT_PROGRESS_AFTER_MS`
/// (the tests set 0), else 2 s.
fn bar_after() -> Duration {
    Duration::from_millis(
        std::env::var("KVCHAT_PROGRESS_AFTER_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000),
    )
}

/// `--json-schema FILE|JSON` or `--grammar FILE`, read: the grammar and the flag that gave it.
fn grammar_flags(
    schema: Option<&str>,
    lark: Option<&std::path::Path>,
) -> Result<Option<(&'static str, Grammar)>> {
    use crate::grammar::MAX_GRAMMAR_BYTES;
    let read = |flag: &str, path: &std::path::Path| -> Result<String> {
        let size = std::fs::metadata(path)
            .with_context(|| format!("{flag}: cannot read {}", path.display()))?
            .len();
        if size > MAX_GRAMMAR_BYTES as u64 {
            bail!(
                "{flag}: {} is {size} bytes, more than the {MAX_GRAMMAR_BYTES} a grammar may have",
                path.display()
            );
        }
        std::fs::read_to_string(path)
            .with_context(|| format!("{flag}: cannot read {}", path.display()))
    };
    if let Some(s) = schema {
        // Inline JSON starts with `{` (or is `true`); anything else names a file.
        let text = if s.trim_start().starts_with('{') || s.trim() == "true" {
            s.to_string()
        } else {
            read("--json-schema", std::path::Path::new(s))?
        };
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("--json-schema: not JSON: {e}"))?;
        return Ok(Some(("--json-schema", Grammar::JsonSchema(v))));
    }
    if let Some(p) = lark {
        return Ok(Some(("--grammar", Grammar::Lark(read("--grammar", p)?))));
    }
    Ok(None)
}

impl RunArgs {
    pub fn resolve(self) -> Result<RunOptions> {
        let grammar = grammar_flags(self.json_schema.as_deref(), self.grammar.as_deref())?;
        let generate = generate_flags!(self).resolve()?;
        Ok(RunOptions {
            generate,
            grammar,
            prompt: self.prompt,
            raw: self.raw,
            ignore_eos: self.ignore_eos,
            trace_picks: self.trace_picks,
            bar_after: bar_after(),
        })
    }
}

impl ChatArgs {
    pub fn resolve(self) -> Result<ChatOptions> {
        let generate = generate_flags!(self).resolve()?;
        Ok(ChatOptions {
            generate,
            on_full: self.on_full.parse().context("--on-full")?,
            history: self.history,
        })
    }
}

impl BenchArgs {
    pub fn resolve(self) -> Result<BenchOptions> {
        refuse_fit(&self.model, "bench")?;
        if self.gen == 0 || self.repeat == 0 {
            bail!("--gen and --repeat must be at least 1");
        }
        if self.contexts.is_empty() || self.contexts.contains(&0) {
            bail!("--contexts must be a list of positive token counts");
        }
        check_svg(&self.plot)?;
        // (Duration::from_secs_f64 panics on a negative or endless one.)
        if !(self.budget_s >= 0.0 && self.budget_s < 1e9) {
            bail!("--budget-s must be a number of seconds from 0 to 1e9");
        }
        let modes: Vec<(String, CacheMode)> = self
            .modes
            .iter()
            .map(|m| Ok((m.clone(), m.parse::<CacheMode>().context("--modes")?)))
            .collect::<Result<_>>()?;
        let mut load = self.model.options()?;
        load.kv_precisions = modes.iter().map(|(_, m)| m.precision).collect();
        // The context holds the longest cell and the chat-turn summary (512 + 256 tokens).
        let longest = self.contexts.iter().max().copied().unwrap_or(0) + self.gen;
        load.ctx = Some(load.ctx.unwrap_or(0).max(longest).max(768 + 256));
        // Each mode must fit that context (a window wider than it is named before anything loads).
        for (name, m) in &modes {
            m.spec(load.ctx.unwrap_or(0))
                .with_context(|| format!("--modes {name}"))?;
        }
        let draft = match self.draft.as_deref() {
            None => None,
            Some("ngram") => {
                if !(1..=32).contains(&self.draft_max) {
                    bail!("--draft-max must be from 1 to 32, not {}", self.draft_max);
                }
                let at = modes
                    .iter()
                    .position(|(_, m)| m.verifies_drafts())
                    .context(
                        "--draft: none of --modes keeps a KV cache to verify drafts on (add full)",
                    )?;
                Some((at, self.draft_max))
            }
            Some(other) => {
                bail!("--draft {other}: bench measures prompt lookup only (--draft ngram)")
            }
        };
        Ok(BenchOptions {
            draft,
            load,
            modes,
            contexts: self.contexts,
            runs: Runs {
                gen: self.gen,
                repeat: self.repeat,
                warmup: self.warmup,
                budget_s: self.budget_s,
            },
            summary: !self.no_summary,
            json: json_out(self.json),
            plot: self.plot,
        })
    }
}

/// `--json FILE`, or `-` for stdout.
fn json_out(p: Option<PathBuf>) -> Option<JsonOut> {
    p.map(|p| {
        if p.as_os_str() == "-" {
            JsonOut::Stdout
        } else {
            JsonOut::File(p)
        }
    })
}

/// `--plot FILE`: an .svg file.
fn check_svg(plot: &Option<PathBuf>) -> Result<()> {
    if let Some(p) = plot {
        if p.extension().and_then(|e| e.to_str()) != Some("svg") {
            bail!("--plot {}: only .svg is supported", p.display());
        }
    }
    Ok(())
}

/// `--fit` is for the commands whose cache the engine builds at its context (run, chat, serve,
/// quiz); a command whose workload sizes its context and caches (bench, needle, ppl) is refused.
fn refuse_fit(model: &ModelArgs, command: &str) -> Result<()> {
    if model.fit {
        bail!("--fit applies to run, chat, serve and quiz; {command} sizes its context and caches from what it measures (set --ctx or --mem to check it)");
    }
    Ok(())
}

impl NeedleArgs {
    pub fn resolve(self) -> Result<NeedleOptions> {
        refuse_fit(&self.model, "needle")?;
        if self.contexts.is_empty() || self.contexts.contains(&0) {
            bail!("--contexts must be a list of positive token counts");
        }
        if self.depths.is_empty() {
            bail!("--depths must list at least one depth");
        }
        if let Some(d) = self.depths.iter().find(|&&d| d > 100) {
            bail!("--depths {d}: a depth is a percentage, 0 to 100");
        }
        if self.keys == 0 {
            bail!("--keys must be at least 1");
        }
        check_svg(&self.plot)?;
        let mut load = self.model.options()?;
        let longest = self.contexts.iter().max().copied().unwrap_or(0);
        // Room for the longest prompt (rendered within a few tokens of it) and its answer.
        let needed = longest + 64;
        let mode = self.cache.mode_for(Some(load.ctx.unwrap_or(needed)))?;
        let ctx_from_grid = load.ctx.is_none();
        match load.ctx {
            Some(c) if c < needed && mode.bounded_by_context() => bail!(
                "--ctx {c} cannot hold --contexts {longest} and the answer (at least {needed})"
            ),
            Some(_) => {}
            None => load.ctx = Some(needed),
        }
        load.kv_precisions = vec![mode.precision];
        if let Some(t) = &self.chat_template {
            crate::template::ChatTemplate::check_spec(t).context("--chat-template")?;
        }
        Ok(NeedleOptions {
            load,
            mode,
            chat_template: self.chat_template,
            grid: NeedleGrid {
                contexts: self.contexts,
                depths: self.depths,
                keys: self.keys,
                seed: self.seed,
                ask_later: self.ask_later,
            },
            ctx_from_grid,
            json: json_out(self.json),
            plot: self.plot,
        })
    }
}

/// The most seeds a quiz answers each question with.
const MAX_QUIZ_SEEDS: u64 = 1000;

impl QuizArgs {
    pub fn resolve(self) -> Result<QuizOptions> {
        if !(1..=MAX_QUIZ_SEEDS).contains(&self.seeds) {
            bail!(
                "--seeds must be from 1 to {MAX_QUIZ_SEEDS}, not {}",
                self.seeds
            );
        }
        if self.max_tokens == 0 {
            bail!("--max-tokens must be at least 1");
        }
        let sampling = self.sampling.prefs()?;
        if sampling.seed.is_some() {
            bail!("--seed conflicts with --seeds: a quiz answers with seeds 1 to --seeds");
        }
        let mut load = self.model.options()?;
        let mode = self.cache.mode_for(self.model.ctx)?;
        load.kv_precisions = vec![mode.precision];
        if let Some(t) = &self.chat_template {
            crate::template::ChatTemplate::check_spec(t).context("--chat-template")?;
        }
        Ok(QuizOptions {
            load,
            mode,
            chat_template: self.chat_template,
            questions: self.questions,
            plan: QuizPlan {
                seeds: (1..=self.seeds).collect(),
                sampling,
                max_tokens: self.max_tokens,
            },
            json: json_out(self.json),
        })
    }
}

impl PplArgs {
    pub fn resolve(self) -> Result<PplOptions> {
        refuse_fit(&self.model, "ppl")?;
        if self.chunk < 4 {
            bail!("--chunk must be at least 4 tokens");
        }
        let mut load = self.model.options()?;
        let mode = self
            .cache
            .mode_for(self.model.ctx.map(|c| c.max(self.chunk)))?;
        let against = match &self.against {
            Some(a) => Some((
                a.clone(),
                a.parse::<CacheMode>()
                    .map_err(|e| anyhow::anyhow!("--against: {e}"))?,
            )),
            None => None,
        };
        // With --ctx given, the --against mode is checked against it too before anything loads.
        if let (Some((name, m)), Some(ctx)) = (&against, self.model.ctx) {
            m.spec(ctx.max(self.chunk))
                .map_err(|e| anyhow::anyhow!("--against {name}: {e}"))?;
        }
        load.kv_precisions = std::iter::once(mode.precision)
            .chain(against.as_ref().map(|(_, m)| m.precision))
            .collect();
        let logits = self.kl_divergence_base.map(|f| {
            if self.kl_divergence {
                LogitsFile::Compare(f)
            } else {
                LogitsFile::Save(f)
            }
        });
        Ok(PplOptions {
            file: self.file,
            load,
            mode,
            against,
            logits,
            chunk: self.chunk,
            chunks: self.chunks,
            long: self.long,
            json: self.json,
        })
    }
}

impl KvSizeArgs {
    pub fn resolve(self) -> Result<KvSizeOptions> {
        let dims = match (self.layers, self.kv_heads, self.head_dim) {
            (Some(layers), Some(kv_heads), Some(head_dim)) => {
                if layers == 0 || kv_heads == 0 || head_dim == 0 {
                    bail!("--layers, --kv-heads and --head-dim must be at least 1");
                }
                DimsFrom::Given(KvDims {
                    layers,
                    kv_heads,
                    head_dim,
                })
            }
            _ => DimsFrom::Model {
                model: self.model,
                models_file: self.models_file,
            },
        };
        if self.ctx == 0 || self.users == 0 {
            bail!("--ctx and --users must be at least 1");
        }
        if let Some(w) = self.window {
            if w == 0 {
                bail!("--window must be at least 1");
            }
        }
        if let Some(b) = self.budget {
            let newest = crate::kv::newest_kept(self.kv_type, self.residual);
            if let Some(why) = crate::kv::budget_unfit(b, self.sinks, newest) {
                bail!("--budget {b} with --sinks {}: {why}", self.sinks);
            }
        }
        Ok(KvSizeOptions {
            query: KvSizeQuery {
                dims,
                heads: self.heads,
                precision: self.kv_type,
                ctx: self.ctx,
                users: self.users,
                window: self.window.map(|w| (w, self.sinks)),
                budget: self.budget,
                residual: self.residual,
            },
            json: self.json,
        })
    }
}

impl TokenizeArgs {
    pub fn resolve(self) -> Result<TokenizeOptions> {
        Ok(TokenizeOptions {
            text: self.text,
            model: self.model,
            models_file: self.models_file,
            tokenizer: self.tokenizer,
        })
    }
}

impl ModelsArgs {
    pub fn resolve(self) -> Result<ModelsOptions> {
        Ok(ModelsOptions {
            task: match self.action {
                ModelsAction::List => ModelsTask::List,
                ModelsAction::Pull { model } => ModelsTask::Pull(model),
            },
            models_file: self.models_file,
        })
    }
}

impl CacheCmdArgs {
    pub fn resolve(self) -> Result<CacheOptions> {
        Ok(CacheOptions {
            task: match self.action {
                CacheAction::Stats => CacheTask::Stats,
                CacheAction::Ls => CacheTask::Ls,
                CacheAction::Clear { model } => CacheTask::Clear(model),
            },
            root: self
                .kv_store_dir
                .unwrap_or_else(crate::source::kv_store_root),
        })
    }
}
