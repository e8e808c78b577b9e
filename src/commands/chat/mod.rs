//! `kvchat chat`: an interactive conversation that keeps its KV cache across turns.
//!
//! On a terminal: rustyline line editing, a history file shared safely between sessions, multi-line
//! input (a trailing `\` continues the line; a `"""` line opens and closes a block), Ctrl-C during an
//! answer stops it (the partial answer stays; the terminal echoes no ^C into it), Ctrl-C on a line
//! being typed clears it, Ctrl-C at an empty prompt or Ctrl-D exits. `/set` changes sampling and
//! max tokens mid-chat, `/show` prints the model's facts and the settings in force.
//! Not on a terminal: each input line is one turn (slash commands too), so chats can be scripted.

mod input;
mod slash;

use input::*;
use slash::*;

use super::style;
use super::thinking::Shown;
use super::Generate;
use crate::commands::run::{open_store, report_store_problems};
use crate::engine::Engine;
use crate::model::sampling::SamplingPrefs;
use crate::session::conversation::{Conversation, OnFull, TurnStats};
use crate::session::{Resolved, Sampler, StopReason};
use crate::source::{human_bytes, kvchat_home};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The platform's data directory for kvchat's history.
fn default_history() -> PathBuf {
    dirs::data_dir()
        .map_or_else(kvchat_home, |d| d.join("kvchat"))
        .join("history.txt")
}

/// A chat in progress: the conversation and what steers it.
struct Chat<'e> {
    conv: Conversation<'e>,
    sampler: Sampler,
    /// The sampling settings in force and where each came from.
    sampling: Resolved,
    max_tokens: usize,
    /// Where the template came from (for /show).
    template: String,
    /// Colour on stderr.
    colour: bool,
    /// Statistics asked for: the sampling in force is printed at the start and after each `/set`.
    stats: bool,
    /// The front end's words for each fix.
    advice: crate::Advice,
}

impl Chat<'_> {
    fn print_turn_stats(&self, t: &TurnStats) {
        let c = &self.conv;
        let line = format!(
            "[stats] turn {}: reused {} cached tokens, prefilled {} new ({:.1} tok/s){} | generated {} tok, decode {:.1} tok/s | cache {} positions, {} | stop: {}",
            t.number,
            t.reused,
            t.prefilled,
            t.gen.prefill_tok_s(),
            if t.shifted > 0 { format!(", dropped {} old turn(s)", t.shifted) } else { String::new() },
            t.gen.generated,
            t.gen.decode_tok_s(),
            c.session().cache().len(),
            human_bytes(c.session().cache().bytes_used() as u64),
            t.reason
        );
        eprintln!("{}", style::paint(self.colour, style::DIM, &line));
        if let Some(d) = t.gen.describe_drafts() {
            let line = format!("[stats] {d}");
            eprintln!("{}", style::paint(self.colour, style::DIM, &line));
        }
        let store = match (&t.store, &c.store().off) {
            (Some(l), _) => Some(l.describe()),
            (None, Some(why)) if t.number == 1 => Some(format!("not used: {why}")),
            _ => None,
        };
        if let Some(store) = store {
            let line = format!("[stats] prefix store: {store}");
            eprintln!("{}", style::paint(self.colour, style::DIM, &line));
        }
    }

    fn stats_text(&self) -> String {
        let c = &self.conv;
        let cfg = &c.engine().model().cfg;
        let cache = &c.session().cache();
        let layers = match cfg.layers {
            // Gemma 4: layers of two shapes, some sharing another's keys and values.
            Some(_) => format!(
                "layers: {}; K and V {}",
                crate::eval::kv_size::layer_kinds(cfg),
                cache.spec().precision().name()
            ),
            None => format!(
                "per layer ({} layers): K and V [1, {}, {}, {}] {}",
                cfg.n_layer,
                cfg.n_kv_head,
                cache.len(),
                cfg.head_dim,
                cache.spec().precision().name()
            ),
        };
        let mut s = format!(
            "cache: {} positions held ({} seen), {} used of {} allocated\n{layers}\ndevice {:?}, activations f32, {} threads",
            cache.len(),
            cache.seen(),
            human_bytes(cache.bytes_used() as u64),
            human_bytes(cache.bytes() as u64),
            crate::engine::device_name(c.engine().device()),
            candle_core::utils::get_num_threads()
        );
        if let Some(t) = c.last() {
            s += &format!(
                "\nlast turn: reused {}, prefilled {} at {:.1} tok/s, generated {} at {:.1} tok/s, stop: {}",
                t.reused,
                t.prefilled,
                t.gen.prefill_tok_s(),
                t.gen.generated,
                t.gen.decode_tok_s(),
                t.reason
            );
        }
        s
    }

    /// The context meter: positions the conversation holds of the most it may reach, and what a
    /// turn past it will do ("1,234 of 32,768 tokens (3.8 %); when full: …"). Shown after each
    /// answer on a terminal and in `/cache`.
    fn meter_text(&self) -> String {
        let s = self.conv.session();
        let held = s.tokens().len();
        let most = s.max_positions();
        let next = match self.conv.on_full() {
            OnFull::Stop => "the turn is refused",
            OnFull::Shift => "the oldest turns are dropped",
            OnFull::Compact => "the oldest turns are summarised into a note",
        };
        if most == usize::MAX {
            return format!("{held} tokens; the cache keeps a bounded window, so it never fills");
        }
        format!(
            "{} of {} tokens ({:.1} %); when full: {next}",
            crate::eval::kv_size::grouped(held as f64),
            crate::eval::kv_size::grouped(most as f64),
            100.0 * held as f64 / most.max(1) as f64
        )
    }

    /// `/cache`: the axes, what the cache holds now and what it would hold keeping every
    /// position, what a budget or a model's windows dropped, what the last turn reused, and the
    /// prefix store.
    fn cache_text(&self) -> String {
        let c = &self.conv;
        let engine = c.engine();
        let cache = c.session().cache();
        let spec = cache.spec();
        let per_position = |p: crate::kv::Precision| {
            crate::kv::size::KvDims::model_bytes_per_token(&engine.model().cfg, p)
        };
        let mut s = format!(
            "context: {}
axes: {}
holds {} positions of the {} seen: {} used, {} allocated ({} a position in {} over all layers)",
            self.meter_text(),
            spec.describe(),
            cache.len(),
            cache.seen(),
            human_bytes(cache.bytes_used() as u64),
            human_bytes(cache.bytes() as u64),
            human_bytes(per_position(spec.precision()) as u64),
            spec.precision().name(),
        );
        for line in super::cache_savings(engine, cache) {
            s += &format!("\n{line}");
        }
        if let Some(t) = c.last() {
            s += &format!(
                "\nlast turn (#{}): reused {} positions from the turns before, prefilled {}",
                t.number, t.reused, t.prefilled
            );
            if let Some(l) = t.store.as_ref().filter(|l| l.reused > 0) {
                s += &format!("; {} positions came from the prefix store", l.reused);
            }
            if t.shifted > 0 {
                s += &format!(", dropped {} old turns to fit", t.shifted);
            }
            for k in &t.compacted {
                s += &format!("; {k}");
            }
        }
        if let Some(note) = c.note() {
            s += &format!("\nnote of compacted turns: {note}");
        }
        s + &format!("\nprefix store: {}", c.store().describe())
    }

    fn show_text(&self) -> String {
        let mut lines: Vec<(&str, String)> = self.conv.engine().facts();
        lines.push(("template", self.template.clone()));
        lines.push(("cache", self.conv.session().cache().spec().describe()));
        lines.push(("sampling", self.sampling.describe()));
        lines.push(("max tokens", self.max_tokens.to_string()));
        lines
            .iter()
            .map(|(k, v)| format!("{k:<13}{v}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `/set NAME VALUE`.
    fn set(&mut self, arg: &str) -> std::result::Result<String, String> {
        let (name, value) = arg
            .split_once(char::is_whitespace)
            .map(|(n, v)| (n, v.trim()))
            .ok_or_else(|| "usage: /set NAME VALUE (/set alone lists the settings)".to_string())?;
        let name = name.replace('_', "-");
        if name == "max-tokens" {
            match value.parse::<usize>() {
                Ok(n) if n > 0 => self.max_tokens = n,
                _ => return Err(format!("max-tokens: '{value}' is not a whole number ≥ 1")),
            }
        } else {
            let mut p = SamplingPrefs::default();
            p.set(&name, value).map_err(|e| {
                if e.starts_with("unknown setting") {
                    format!("{e}; max-tokens is also one")
                } else {
                    e
                }
            })?;
            self.sampling.apply(&p, "/set");
            self.sampler.update(self.sampling.params.clone());
            if name == "seed" {
                // `/set seed N` replays from N, even when N is the seed already in force.
                self.sampler.reseed();
            }
            self.print_sampling();
        }
        Ok(format!("({name} = {value})"))
    }

    /// With `--stats`: the sampling in force, one line on stderr.
    fn print_sampling(&self) {
        if self.stats {
            let line = format!("[stats] sampling: {}", self.sampling.describe());
            eprintln!("{}", style::paint(self.colour, style::DIM, &line));
        }
    }
}

/// `kvchat chat`, resolved.
#[derive(Debug, Clone)]
pub struct ChatOptions {
    pub generate: Generate,
    /// What a full context does: refuse the turn, or drop the oldest turns.
    pub on_full: OnFull,
    /// The line editor's history file; None: the platform's data directory.
    pub history: Option<PathBuf>,
}

pub fn run(opts: ChatOptions) -> Result<()> {
    let g = &opts.generate;
    let on_full = opts.on_full;
    let interrupt = crate::interrupt::install()?;
    let engine = Engine::load(&g.load)?;
    let spec = engine.cache_spec(&g.mode, engine.ctx())?;
    let template = engine.chat_template(g.template.as_ref().map(|t| t.spec.as_str()))?;
    // Every turn's prompt ends as a one-message conversation's does: whether it opens the
    // reasoning is the template's.
    let source = template.source().to_string();
    let opens = |m: &crate::reasoning::Markers| {
        template
            .render(&[crate::template::Message::new("user", "x")], true)
            .is_ok_and(|t| t.trim_end().ends_with(m.open))
    };
    let dim = style::enabled(std::io::stdout().is_terminal());
    let opened = crate::reasoning::for_template(&source).is_some_and(opens);
    let sampling = engine.sampling_for(&g.sampling);
    let draft_engine = super::run::load_draft(g.draft.as_ref(), &engine)?;
    let mut chat = Chat {
        conv: Conversation::new(&engine, &spec, template, g.system.clone(), on_full),
        sampler: Sampler::new(sampling.params.clone()),
        sampling,
        max_tokens: g.max_tokens,
        template: g
            .template
            .as_ref()
            .map_or_else(|| "the model's own".to_string(), |t| t.label.clone()),
        advice: g.advice,
        colour: style::stderr(),
        stats: g.stats,
    };
    if g.draft.is_some() && !chat.conv.session().can_verify_drafts() {
        eprintln!("note: {}", super::run::DRAFTS_OFF);
    }
    chat.conv
        .set_drafter(super::run::drafter(g.draft.as_ref(), draft_engine.as_ref()));
    // A system message that alone fills the context is refused before the first turn.
    chat.conv.check_system()?;
    let store = open_store(&g.store, &engine, chat.conv.session());
    chat.conv.set_store(store);
    report_store_problems(chat.conv.store_mut(), g.advice);
    for n in engine
        .sampling_notes()
        .iter()
        .chain(&spec.notes(&engine.model().cfg))
    {
        eprintln!("note: {n}");
    }
    chat.print_sampling();
    if let Some(pc) = &g.prompt_cache {
        // A cache whose state cannot be saved is refused before the first turn.
        chat.conv.session().cache().persist_key()?;
        if pc.exists() {
            match chat.conv.load(pc) {
                Ok(()) => eprintln!(
                    "kvchat: resumed {} turns from {}",
                    chat.conv.turns().len(),
                    pc.display()
                ),
                Err(e) => eprintln!(
                    "kvchat: ignoring prompt cache: {}",
                    crate::describe_with(&e, g.advice)
                ),
            }
        }
    }
    let tty = std::io::stdin().is_terminal();
    // Set by the Ctrl-C key binding when it dropped a line being typed.
    let dropped_line = Arc::new(AtomicBool::new(false));

    let mut editor = if tty {
        let mut ed: rustyline::Editor<EditorHelper, rustyline::history::DefaultHistory> =
            rustyline::Editor::new().context("cannot start the line editor")?;
        ed.set_helper(Some(EditorHelper {
            colour: style::enabled(std::io::stdout().is_terminal()),
        }));
        ed.bind_sequence(
            rustyline::KeyEvent::ctrl('C'),
            rustyline::EventHandler::Conditional(Box::new(CtrlC(dropped_line.clone()))),
        );
        let hist = opts.history.clone().unwrap_or_else(default_history);
        if let Some(dir) = hist.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = ed.load_history(&hist);
        eprintln!(
            "kvchat chat — {} ({}); /help for commands",
            engine.path().display(),
            spec.describe()
        );
        Some((ed, hist))
    } else {
        None
    };
    let stdin = std::io::stdin();
    let mut input_lines = stdin.lock();
    let mut stdout = std::io::stdout();
    // Turns and commands that failed: a chat that is not interactive then exits non-zero.
    let mut errors = 0usize;
    loop {
        let input = match &mut editor {
            Some((ed, hist)) => {
                dropped_line.store(false, Ordering::SeqCst);
                let r = read_turn(|cont| match ed.readline(if cont { "... " } else { "> " }) {
                    Ok(l) => Ok(Some(l)),
                    // Ctrl-C in a block or a continued line drops the whole turn.
                    Err(rustyline::error::ReadlineError::Interrupted) if cont => {
                        dropped_line.store(true, Ordering::SeqCst);
                        Ok(None)
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) => Ok(None),
                    Err(rustyline::error::ReadlineError::Eof) => Ok(None),
                    Err(e) => Err(e.into()),
                })?;
                if dropped_line.load(Ordering::SeqCst) {
                    eprintln!("(line cleared; Ctrl-D or /exit to leave)");
                    continue;
                }
                if let Some(l) = &r {
                    if !l.trim().is_empty() {
                        let _ = ed.add_history_entry(l.as_str());
                        // append, not save: concurrent sessions add to the file under a lock.
                        let _ = ed.append_history(hist);
                    }
                }
                r
            }
            None => read_turn(|_| read_line_bounded(&mut input_lines, MAX_LINE))?,
        };
        let Some(input) = input else { break };
        let input = input.trim();
        if input.is_empty() {
            continue;
        }
        if input.starts_with('/') {
            if !command(&mut chat, input, &mut stdout, &mut errors)? {
                break;
            }
            continue;
        }
        interrupt.generating.store(true, Ordering::SeqCst);
        let quiet = QuietTerminal::new(tty);
        let mut shown = Shown::new(Some(&source), |_| opened, dim, g.hide_reasoning);
        let result = chat.conv.ask(
            input,
            &mut chat.sampler,
            chat.max_tokens,
            &interrupt.stop,
            |t| {
                stdout.write_all(shown.text(t).as_bytes())?;
                stdout.flush()?;
                Ok(())
            },
        );
        stdout.write_all(shown.finish().as_bytes())?;
        drop(quiet);
        interrupt.generating.store(false, Ordering::SeqCst);
        writeln!(stdout)?;
        report_store_problems(chat.conv.store_mut(), g.advice);
        match result {
            Ok(t) => {
                for c in &t.compacted {
                    eprintln!("({c})");
                }
                match t.reason {
                    StopReason::Interrupted => eprintln!("(interrupted)"),
                    StopReason::ContextFull => eprintln!(
                        "(the answer was cut: the context of {} tokens is full; {})",
                        chat.conv.session().max_positions(),
                        match on_full {
                            OnFull::Stop => (g.advice)(crate::Fix::ChatFull),
                            OnFull::Shift => "the next turn drops the oldest turns",
                            OnFull::Compact => "the next turn compacts the oldest turns",
                        }
                    ),
                    _ => {}
                }
                if g.stats {
                    chat.print_turn_stats(&t);
                }
                if tty {
                    let meter = format!("[{}]", chat.meter_text());
                    eprintln!("{}", style::paint(chat.colour, style::DIM, &meter));
                }
                if let Some(pc) = &g.prompt_cache {
                    if let Err(e) = chat.conv.save(pc) {
                        errors += 1;
                        eprintln!(
                            "kvchat: cannot save the prompt cache: {}",
                            crate::describe_with(&e, g.advice)
                        );
                    }
                }
            }
            Err(e) => {
                errors += 1;
                eprintln!("error: {}", crate::describe_with(&e, g.advice))
            }
        }
    }
    chat.conv.store_mut().finish();
    report_store_problems(chat.conv.store_mut(), g.advice);
    if !tty && errors > 0 {
        bail!("{errors} of the chat's turns or commands failed (see above)");
    }
    Ok(())
}
