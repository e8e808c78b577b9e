//! `kvchat run`: one prompt in (argument or stdin), one streamed answer out.

use crate::cli::{CacheArgs, ModelArgs, SamplingArgs};
use crate::engine::Engine;
use crate::generate::{GenStats, Sampler, StopReason};
use crate::kv::{CacheSpec, KvCache};
use crate::template::Message;
use crate::tokenizer::TextStream;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{IsTerminal, Read, Write};

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
    /// Complete the text as-is, without the chat template
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
}

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
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            // A trailing newline from `echo` is not part of the prompt.
            s.trim_end_matches(['\n', '\r']).to_string()
        }
    };
    if prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let engine = Engine::load(&args.model)?;
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
    let mut session = engine.session(&spec);
    let mut sampler = Sampler::new(sampling);
    let mut stream = TextStream::new();
    let mut stdout = std::io::stdout().lock();
    let (_, reason, stats) = session.generate(
        &ids,
        &mut sampler,
        args.max_tokens,
        &engine.stop_ids,
        args.ignore_eos,
        |id| {
            if let Some(text) = stream.push(&engine.tokenizer, id)? {
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            Ok(true)
        },
    )?;
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
        "[stats] kv cache {}: {} positions held of {} seen, {} bytes used, {} bytes allocated | device {:?}, dtype f32, {threads} threads",
        cache.spec().describe(),
        cache.len(),
        cache.seen(),
        cache.bytes_used(),
        cache.bytes(),
        engine.device.location(),
    );
}
