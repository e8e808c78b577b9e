//! `kvchat run`: one prompt in (argument or stdin), one streamed answer out.

use crate::cli::{CacheArgs, ModelArgs, SamplingArgs};
use crate::engine::Engine;
use crate::generate::{GenStats, Sampler, StopReason};
use crate::kv::{persist, CacheSpec, KvCache};
use crate::template::Message;
use crate::tokenizer::TextStream;
use anyhow::{bail, Result};
use clap::Args;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The prompt; read from stdin when absent
    pub prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Complete the text as-is, without the chat template; special-token text in it (<|im_start|>)
    /// is parsed as control tokens, whereas a chat message's text never is
    #[arg(long)]
    pub raw: bool,
    /// System message for the chat template
    #[arg(long, conflicts_with = "raw")]
    pub system: Option<String>,
    /// Chat template: a name (chatml, llama3, llama2) or Jinja text, instead of the model's own
    #[arg(long, conflicts_with = "raw")]
    pub chat_template: Option<String>,
    /// Most tokens to generate
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// Keep generating past end-of-text tokens (for benchmarks)
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print prompt/decode speed and KV cache size to stderr
    #[arg(long)]
    pub stats: bool,
    /// Reuse the KV state of an earlier prompt that shares a prefix with this one, from FILE, and save
    /// this prompt's state there
    #[arg(long, value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,
}

/// The longest prompt read (from stdin or the argument), before any model is loaded.
const MAX_PROMPT_BYTES: u64 = 64 << 20;

pub fn run(args: RunArgs) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("-n/--max-tokens must be at least 1");
    }
    let sampling = args.sampling.params()?;
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None => {
            if std::io::stdin().is_terminal() {
                bail!("no prompt: pass it as an argument or pipe it on stdin");
            }
            let s = crate::fsx::read_stream_bounded(
                &mut std::io::stdin().lock(),
                MAX_PROMPT_BYTES,
                "the prompt on stdin",
            )?;
            // A trailing newline from `echo` is not part of the prompt.
            s.trim_end_matches(['\n', '\r']).to_string()
        }
    };
    if prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    if prompt.len() as u64 > MAX_PROMPT_BYTES {
        bail!(
            "the prompt is {} bytes, more than the {MAX_PROMPT_BYTES} kvchat takes",
            prompt.len()
        );
    }
    // What is at --prompt-cache must be a kvchat KV file or nothing: checked before anything loads.
    if let Some(pc) = &args.prompt_cache {
        persist::check_target(pc).map_err(|e| anyhow::anyhow!("--prompt-cache: {e}"))?;
    }
    // Ctrl-C or SIGTERM while the state is being saved removes the temporary file.
    crate::interrupt::install()?;
    let engine = Engine::load(&args.model)?;
    // No tokenizer packs more than ~64 bytes into a token on real text: a longer prompt cannot
    // fit the context, and tokenizing it first would take memory for nothing.
    if prompt.len() > engine.ctx.saturating_mul(64) {
        bail!(
            "the prompt is {} bytes, which cannot fit the context of {} tokens (raise --ctx)",
            prompt.len(),
            engine.ctx
        );
    }
    let ids = if args.raw {
        engine.raw_prompt(&prompt)?
    } else {
        let template = engine.chat_template(args.chat_template.as_deref())?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", &prompt));
        engine.chat_prompt(&template, &messages)?
    };
    let spec = args.cache.spec(engine.ctx)?;
    if ids.len() >= engine.ctx && !matches!(spec, CacheSpec::Window { .. }) {
        bail!(
            "the prompt is {} tokens, which does not fit the context of {} (raise --ctx)",
            ids.len(),
            engine.ctx
        );
    }
    if spec.recomputes() && args.prompt_cache.is_some() {
        bail!("--prompt-cache needs a KV cache (drop --no-cache)");
    }
    let mut session = engine.session(&spec);
    let mut sampler = Sampler::new(sampling);
    let mut stream = TextStream::new();
    let mut stdout = std::io::stdout().lock();
    let t0 = Instant::now();
    let reused = match &args.prompt_cache {
        Some(p) => crate::commands::chat::load_prompt_cache(&engine, &mut session, p, &ids)?,
        None => 0,
    };
    let logits = session.feed(&ids[reused..])?;
    let prefill = t0.elapsed();
    if let Some(p) = &args.prompt_cache {
        let saved = session.cache.persist_key().and_then(|key| {
            persist::save(
                p,
                &session.tokens,
                &session.cache,
                &engine.digest,
                &key,
                serde_json::json!({}),
            )
        });
        if let Err(e) = saved {
            eprintln!(
                "kvchat: cannot save the prompt cache: {}",
                crate::first_line(format!("{e:#}"))
            );
        }
    }
    let mut first_token: Option<Duration> = None;
    let (_, reason, mut stats) = session.decode(
        logits,
        &mut sampler,
        args.max_tokens,
        &engine.stop_ids,
        args.ignore_eos,
        |id| {
            first_token.get_or_insert_with(|| t0.elapsed());
            if let Some(text) = stream.push(&engine.tokenizer, id)? {
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            Ok(true)
        },
    )?;
    stats.prompt_tokens = ids.len() - reused;
    stats.prefill = prefill;
    if let Some(text) = stream.finish(&engine.tokenizer)? {
        stdout.write_all(text.as_bytes())?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    if reason == StopReason::ContextFull {
        eprintln!(
            "kvchat: stopped: the context of {} tokens is full (raise --ctx)",
            engine.ctx
        );
    }
    if args.stats {
        if args.prompt_cache.is_some() {
            eprintln!(
                "[stats] prompt cache: reused {reused} of {} prompt tokens; time to first token {:.1} ms",
                ids.len(),
                first_token.unwrap_or(prefill).as_secs_f64() * 1e3
            );
        }
        print_stats(&engine, &stats, &session.cache, reason);
    }
    Ok(())
}

pub fn print_stats(engine: &Engine, s: &GenStats, cache: &KvCache, reason: StopReason) {
    let threads = candle_core::utils::get_num_threads();
    eprintln!(
        "[stats] prompt {} tok, prefill {:.1} tok/s ({:.0} ms) | generated {} tok, decode {:.1} tok/s | stop: {:?}",
        s.prompt_tokens,
        s.prefill_tok_s(),
        s.prefill.as_secs_f64() * 1e3,
        s.generated,
        s.decode_tok_s(),
        reason
    );
    eprintln!(
        "[stats] kv cache {}: {} positions held of {} seen, {} bytes used, {} bytes allocated | device {:?}, weights {}, activations and KV f32, {threads} threads",
        cache.spec().describe(),
        cache.len(),
        cache.seen(),
        cache.bytes_used(),
        cache.bytes(),
        engine.device.location(),
        engine.weights,
    );
}
