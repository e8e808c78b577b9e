//! `kvchat run`: one prompt in (argument or stdin), one streamed answer out.

use super::thinking::Shown;
use super::{DraftChoice, Generate, StoreChoice};
use crate::engine::Engine;
use crate::kv::KvCache;
use crate::session::draft::{Drafter, ModelDraft, Ngram};
use crate::session::prefix::PrefixReuse;
use crate::session::{GenStats, Sampler, StopReason};
use crate::source::human_bytes;
use crate::template::Message;
use crate::tokenizer::TextStream;
use anyhow::{bail, Context, Result};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// The longest prompt read (from stdin or the argument), before any model is loaded.
const MAX_PROMPT_BYTES: u64 = 64 << 20;

/// `kvchat run`, resolved.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub generate: Generate,
    /// The grammar the answer keeps to, with the flag that gave it (for its errors).
    pub grammar: Option<(&'static str, crate::grammar::Grammar)>,
    /// The prompt; None: read from stdin (which must not be a terminal).
    pub prompt: Option<String>,
    /// Complete the text as-is, without the chat template.
    pub raw: bool,
    /// Keep generating past end-of-text tokens.
    pub ignore_eos: bool,
    /// Print each pick beside the runner-up (stderr, after the answer).
    pub trace_picks: bool,
    /// A generation whose answer goes to a file or pipe shows a bar on a terminal's stderr once
    /// it has run this long.
    pub bar_after: Duration,
}

pub fn run(opts: RunOptions) -> Result<()> {
    let g = &opts.generate;
    let prompt = match &opts.prompt {
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
    // Ctrl-C or SIGTERM while the state is being saved removes the temporary file.
    crate::interrupt::install()?;
    let engine = Engine::load(&g.load)?;
    let spec = engine.cache_spec(&g.mode, engine.ctx())?;
    // Every text is checked by its bytes before it is tokenized.
    let fits = |what: &str, text: &str| -> Result<()> {
        if spec.bounded_by_context() {
            engine.refuse_by_bytes(what, text, engine.ctx())?;
        }
        // A window takes a sequence of any length; no tokenizer packs more than ~64 bytes into a
        // token of real text, so a text past that is refused as not meant for this context.
        if !spec.bounded_by_context() && text.len() > engine.ctx().saturating_mul(64) {
            return Err(crate::fixable(
                crate::Fix::RaiseContext,
                format!(
                    "{what} is {} bytes, which cannot fit the context of {} tokens",
                    text.len(),
                    engine.ctx()
                ),
            ));
        }
        Ok(())
    };
    fits("the prompt", &prompt)?;
    if let Some(s) = g.system.as_deref().filter(|_| !opts.raw) {
        fits("the system message", s)?;
    }
    // Where the system message ends: the prefix store may end a block there.
    let mut boundaries = Vec::new();
    let mut template_source = None;
    let ids = if opts.raw {
        engine.raw_prompt(&prompt)?
    } else {
        let template = engine.chat_template(g.template.as_ref().map(|t| t.spec.as_str()))?;
        let mut messages = Vec::new();
        if let Some(s) = &g.system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", &prompt));
        let text = template.render(&messages, true)?;
        fits("the prompt in the chat template", &text)?;
        let ids = engine.encode_rendered(&text, &messages)?;
        boundaries = engine.message_boundaries(&template, &messages, &ids);
        template_source = Some(template.source().to_string());
        ids
    };
    if ids.len() >= engine.ctx() && spec.bounded_by_context() {
        // Name the part that does not fit: the system message alone, else the prompt.
        let system = match g.system.as_deref().filter(|_| !opts.raw) {
            Some(s) => engine.tokenizer().encode_literal(s)?.len(),
            None => 0,
        };
        let what = if system >= engine.ctx() {
            format!("the system message is {system} tokens")
        } else if system > 0 {
            format!(
                "the prompt with its system message of {system} tokens is {} tokens",
                ids.len()
            )
        } else {
            format!("the prompt is {} tokens", ids.len())
        };
        return Err(crate::fixable(
            crate::Fix::RaiseContext,
            format!("{what}, which does not fit the context of {}", engine.ctx()),
        ));
    }
    let mut session = engine.session(&spec);
    let sampling = engine.sampling_for(&g.sampling);
    for n in engine
        .sampling_notes()
        .iter()
        .chain(&spec.notes(&engine.model().cfg))
    {
        eprintln!("note: {n}");
    }
    let mut sampler = Sampler::new(sampling.params.clone());
    if opts.trace_picks {
        sampler.trace();
    }
    // How long the grammar took: the vocabulary's trie (once per model), then this grammar
    // compiled with its first mask.
    let mut grammar_times = None;
    if let Some((flag, grammar)) = &opts.grammar {
        let failed = |e: anyhow::Error| anyhow::anyhow!("{flag}: {}", crate::error_line(&e));
        let t = Instant::now();
        let grammars = engine.grammars().map_err(failed)?;
        let vocabulary = t.elapsed();
        let constraint = grammars.compile(grammar).map_err(failed)?;
        grammar_times = Some((vocabulary, t.elapsed() - vocabulary));
        sampler.constrain(constraint);
    }
    let dim = super::style::enabled(std::io::stdout().is_terminal());
    let opens = |m: &_| crate::reasoning::prompt_opens(engine.tokenizer(), &ids, m);
    let mut shown = Shown::new(template_source.as_deref(), opens, dim, g.hide_reasoning);
    let mut stream = match shown.keeps_special() {
        true => TextStream::keeping_special(),
        false => TextStream::new(),
    };
    let mut stdout = std::io::stdout().lock();
    let mut store = open_store(&g.store, &engine, &session);
    let t0 = Instant::now();
    if g.prompt_cache.is_some() {
        // A cache whose state cannot be saved is refused before any work.
        session.cache().persist_key()?;
    }
    let reused = match &g.prompt_cache {
        Some(p) if p.exists() => match session.reuse_saved_prefix(p, engine.digest(), &ids) {
            Ok(n) => n,
            Err(e) => {
                eprintln!(
                    "kvchat: ignoring prompt cache: {}",
                    crate::describe_with(&e, g.advice)
                );
                0
            }
        },
        Some(_) => 0,
        None => store.restore(&mut session, &ids, &boundaries)?,
    };
    // A budget compresses the prompt once it is prefilled: its whole rows are saved and stored
    // first, and a resumed prompt is compressed the same way after its prefill.
    let hold = session.evicts_by_score() && (store.is_on() || g.prompt_cache.is_some());
    session.hold_evictions(hold);
    // A model with recurrent states snapshots them where the store or a later prompt may resume.
    let snapshots = store.is_on() || g.prompt_cache.is_some();
    let logits = session.prefill(&ids, reused, &boundaries, snapshots)?;
    let prefill = t0.elapsed();
    report_store_problems(&mut store, g.advice);
    if let Some(p) = &g.prompt_cache {
        if let Err(e) = session.save_state(p, engine.digest(), serde_json::json!({})) {
            eprintln!(
                "kvchat: cannot save the prompt cache: {}",
                crate::describe_with(&e, g.advice)
            );
        }
    }
    if hold {
        store.store(&session, true, &boundaries, ids.len());
        session.evict_held()?;
    }
    let mut first_token: Option<Duration> = None;
    // A generation whose answer goes to a file or a pipe shows a bar on stderr (a terminal only)
    // once it has run a few seconds; on a terminal the streaming answer is the progress.
    let show_bar = !std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    let bar_after = opts.bar_after;
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut generated = 0u64;
    let recomputes = spec.recomputes();
    let draft_engine = load_draft(g.draft.as_ref(), &engine)?;
    if g.draft.is_some() && !session.can_verify_drafts() {
        eprintln!("note: {DRAFTS_OFF}");
    }
    let mut drafter = drafter(g.draft.as_ref(), draft_engine.as_ref());
    let (_, reason, mut stats) = session.decode_drafted(
        logits,
        &mut sampler,
        g.max_tokens,
        engine.stop_ids(),
        opts.ignore_eos,
        drafter.as_deref_mut(),
        |id| {
            first_token.get_or_insert_with(|| t0.elapsed());
            generated += 1;
            if show_bar && bar.is_none() && t0.elapsed() >= bar_after {
                bar = Some(generation_bar(g.max_tokens as u64, recomputes));
            }
            if let Some(b) = &bar {
                b.set_position(generated);
            }
            if let Some(text) = stream.push(engine.tokenizer(), id)? {
                stdout.write_all(shown.text(&text).as_bytes())?;
                stdout.flush()?;
            }
            Ok(true)
        },
    )?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // The prompt's new blocks are written once the answer is out: a writer beside the decode
    // would take a core from its threads (measured: +5 % on a 2-core machine).
    if !hold {
        store.store(&session, true, &boundaries, ids.len());
    }
    store.finish();
    report_store_problems(&mut store, g.advice);
    stats.prompt_tokens = ids.len() - reused;
    stats.prefill = prefill;
    if let Some(text) = stream.finish(engine.tokenizer())? {
        stdout.write_all(shown.text(&text).as_bytes())?;
    }
    stdout.write_all(shown.finish().as_bytes())?;
    writeln!(stdout)?;
    stdout.flush()?;
    if opts.trace_picks {
        let text = |id: u32| {
            format!(
                "{:?}",
                engine.tokenizer().token_text(id).unwrap_or_default()
            )
        };
        for (i, p) in sampler.picks().iter().enumerate() {
            eprintln!(
                "[pick] {i}: {} {} {:.4} over {} {} {:.4} (margin {:.4})",
                p.token,
                text(p.token),
                p.logit,
                p.runner_up,
                text(p.runner_up),
                p.runner_up_logit,
                p.logit - p.runner_up_logit
            );
        }
    }
    if reason == StopReason::ContextFull {
        eprintln!(
            "kvchat: stopped: the context of {} tokens is full ({})",
            engine.ctx(),
            (g.advice)(crate::Fix::RaiseContext)
        );
    }
    if g.stats {
        if g.prompt_cache.is_some() {
            eprintln!(
                "[stats] prompt cache: reused {reused} of {} prompt tokens; time to first token {:.1} ms",
                ids.len(),
                first_token.unwrap_or(prefill).as_secs_f64() * 1e3
            );
        }
        print_stats(&engine, &stats, session.cache(), reason);
        eprintln!(
            "[stats] prefix store: {}; time to first token {:.1} ms",
            store.describe(),
            first_token.unwrap_or(prefill).as_secs_f64() * 1e3
        );
        eprintln!("[stats] sampling: {}", sampling.describe());
        if let Some((vocabulary, compile)) = grammar_times {
            eprintln!(
                "[stats] grammar: vocabulary read in {:.1} ms (once per model), grammar compiled with its first mask in {:.1} ms",
                vocabulary.as_secs_f64() * 1e3,
                compile.as_secs_f64() * 1e3
            );
        }
        if g.draft.is_some() {
            let line = stats
                .describe_drafts()
                .unwrap_or_else(|| "draft: nothing drafted".into());
            eprintln!("[stats] {line}");
        }
    }
    Ok(())
}

/// Why a run or chat asked to draft decodes without drafts.
pub const DRAFTS_OFF: &str =
    "drafting is off: with no KV cache there is nothing to verify guesses on";

/// Refuses a draft model whose vocabulary is not the target's: the same size, and the same ids for
/// a probe text (its guesses are token ids of the target's vocabulary).
/// The draft model, when one drafts: loaded beside the target, checked to share its vocabulary.
pub(super) fn load_draft(choice: Option<&DraftChoice>, engine: &Engine) -> Result<Option<Engine>> {
    match choice {
        Some(DraftChoice::Model { load, .. }) => {
            let d = Engine::load(load).context("the draft model")?;
            same_vocabulary(engine, &d)?;
            Ok(Some(d))
        }
        _ => Ok(None),
    }
}

/// What guesses the drafts `choice` names: prompt lookup, or the draft model (`draft`, from
/// [`load_draft`]) in a session of its own.
pub(super) fn drafter<'d>(
    choice: Option<&DraftChoice>,
    draft: Option<&'d Engine>,
) -> Option<Box<dyn Drafter + 'd>> {
    match (choice, draft) {
        (Some(DraftChoice::Ngram { max }), _) => Some(Box::new(Ngram::new(*max))),
        (Some(DraftChoice::Model { max, .. }), Some(d)) => {
            let spec = crate::kv::CacheSpec::full(crate::kv::DEFAULT_PRECISION, d.ctx());
            Some(Box::new(ModelDraft::new(d.session(&spec), *max)))
        }
        _ => None,
    }
}

fn same_vocabulary(target: &Engine, draft: &Engine) -> Result<()> {
    let (a, b) = (target.tokenizer(), draft.tokenizer());
    if a.vocab_size() != b.vocab_size() {
        bail!(
            "the draft model {} has a vocabulary of {} tokens, the model {} of {}: a draft model needs the same tokenizer",
            draft.path().display(),
            b.vocab_size(),
            target.path().display(),
            a.vocab_size()
        );
    }
    let probe = &crate::eval::bench::BENCH_TEXT[..2000];
    if a.encode(probe)? != b.encode(probe)? {
        bail!(
            "the draft model {} tokenizes text differently from {}: a draft model needs the same tokenizer",
            draft.path().display(),
            target.path().display()
        );
    }
    Ok(())
}

/// The prefix store of a run or chat, as chosen.
pub fn open_store(
    choice: &StoreChoice,
    engine: &Engine,
    session: &crate::session::Session<'_>,
) -> PrefixReuse {
    match choice {
        StoreChoice::Off(why) => PrefixReuse::off(*why),
        StoreChoice::On { root, budget } => PrefixReuse::open(engine, session, root, *budget),
    }
}

/// Prints what went wrong with the prefix store since the last call, one line each (the run goes on
/// without what failed).
pub fn report_store_problems(store: &mut PrefixReuse, advice: crate::Advice) {
    for p in store.take_problems() {
        match p.fix {
            Some(fix) => eprintln!("kvchat: prefix store: {} ({})", p.text, advice(fix)),
            None => eprintln!("kvchat: prefix store: {}", p.text),
        }
    }
}

/// The bar of a long generation: tokens out of `max`, speed and ETA.
fn generation_bar(max: u64, recomputes: bool) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(max).with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} tokens, {elapsed} (ETA {eta}) {msg}",
        )
        .expect("valid template"),
    );
    if recomputes {
        bar.set_message("no KV cache: every step recomputes the whole sequence");
    }
    bar
}

pub fn print_stats(engine: &Engine, s: &GenStats, cache: &KvCache, reason: StopReason) {
    let threads = candle_core::utils::get_num_threads();
    eprintln!(
        "[stats] prompt {} tok, prefill {:.1} tok/s ({:.0} ms) | generated {} tok, decode {:.1} tok/s | stop: {}",
        s.prompt_tokens,
        s.prefill_tok_s(),
        s.prefill.as_secs_f64() * 1e3,
        s.generated,
        s.decode_tok_s(),
        reason
    );
    eprintln!(
        "[stats] kv cache {} ({}): {} positions held of {} seen, {} used of {} allocated | device {}, weights {}, activations f32, {threads} threads",
        cache.spec().name(),
        cache.spec().describe(),
        cache.len(),
        cache.seen(),
        human_bytes(cache.bytes_used() as u64),
        human_bytes(cache.bytes() as u64),
        crate::engine::device_name(engine.device()),
        engine.weights(),
    );
    for line in super::cache_savings(engine, cache) {
        eprintln!("[stats] {line}");
    }
    eprintln!(
        "[stats] model loaded in {:.0} ms ({} parameters; {})",
        engine.load_time().as_secs_f64() * 1e3,
        engine.params(),
        engine.tensor_types()
    );
}
