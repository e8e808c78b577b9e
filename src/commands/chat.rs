//! `kvchat chat`: an interactive conversation that keeps its KV cache across turns.
//!
//! On a terminal: rustyline line editing, a history file shared safely between sessions, multi-line
//! input (a trailing `\` continues the line; a `"""` line opens and closes a block), Ctrl-C during an
//! answer stops it (the partial answer stays), Ctrl-C at an empty prompt or Ctrl-D exits.
//! Not on a terminal: each input line is one turn (slash commands too), so chats can be scripted.

use crate::cli::report::describe;
use crate::cli::ChatArgs;
use crate::engine::Engine;
use crate::kv::persist;
use crate::session::conversation::{Conversation, TurnStats};
use crate::session::Sampler;
use crate::source::kvchat_home;
use anyhow::{bail, Context, Result};
use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

const HELP: &str = "commands:
  /help            this text
  /reset           forget the conversation (keeps the system message)
  /system TEXT     set the system message
  /stats           tokens and bytes in the cache, per-layer shape, last turn's speed
  /cache           the cache's precision, retention and placement
  /save FILE       save the conversation and its KV state
  /load FILE       load a saved conversation (same model and cache configuration)
  /undo            drop the last exchange
  /exit            leave (also Ctrl-D, or Ctrl-C at an empty prompt)
input: end a line with \\ to continue it; a line \"\"\" opens and closes a multi-line block";

/// The platform's data directory for kvchat's history.
fn default_history() -> PathBuf {
    dirs::data_dir()
        .map_or_else(kvchat_home, |d| d.join("kvchat"))
        .join("history.txt")
}

pub fn print_turn_stats(c: &Conversation<'_>, t: &TurnStats) {
    eprintln!(
        "[stats] turn {}: reused {} cached tokens, prefilled {} new ({:.1} tok/s){} | generated {} tok, decode {:.1} tok/s | cache {} positions, {} bytes | stop: {:?}",
        c.turns.len(),
        t.reused,
        t.prefilled,
        t.gen.prefill_tok_s(),
        if t.shifted > 0 { format!(", dropped {} old turn(s)", t.shifted) } else { String::new() },
        t.gen.generated,
        t.gen.decode_tok_s(),
        c.session.cache().len(),
        c.session.cache().bytes_used(),
        t.reason
    );
}

fn stats_text(c: &Conversation<'_>) -> String {
    let cfg = &c.engine.model.cfg;
    let cache = &c.session.cache();
    let mut s = format!(
        "cache: {} positions held ({} seen), {} bytes used, {} allocated\nper layer ({} layers): K and V [1, {}, {}, {}] {}\ndevice {:?}, activations f32, {} threads",
        cache.len(),
        cache.seen(),
        cache.bytes_used(),
        cache.bytes(),
        cfg.n_layer,
        cfg.n_kv_head,
        cache.len(),
        cfg.head_dim,
        cache.spec().precision().name(),
        c.engine.device.location(),
        candle_core::utils::get_num_threads()
    );
    if let Some(t) = &c.last {
        s += &format!(
            "\nlast turn: reused {}, prefilled {} at {:.1} tok/s, generated {} at {:.1} tok/s",
            t.reused,
            t.prefilled,
            t.gen.prefill_tok_s(),
            t.gen.generated,
            t.gen.decode_tok_s()
        );
    }
    s
}

/// Handles a slash command; returns false to leave.
fn command(c: &mut Conversation<'_>, line: &str, out: &mut impl Write) -> Result<bool> {
    let (cmd, arg) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let arg = arg.trim();
    match cmd {
        "/help" => writeln!(out, "{HELP}")?,
        "/exit" | "/quit" => return Ok(false),
        "/reset" => {
            c.reset()?;
            writeln!(out, "(conversation cleared)")?;
        }
        "/system" => {
            if arg.is_empty() {
                writeln!(
                    out,
                    "system: {}",
                    c.system.as_deref().unwrap_or("(the template's default)")
                )?;
            } else {
                c.system = Some(arg.to_string());
                writeln!(out, "(system message set)")?;
            }
        }
        "/stats" => writeln!(out, "{}", stats_text(c))?,
        "/cache" => writeln!(out, "{}", c.session.cache().spec().describe())?,
        "/undo" => {
            if c.undo()? {
                writeln!(
                    out,
                    "(last exchange dropped; cache holds {} positions)",
                    c.session.cache().len()
                )?;
            } else {
                writeln!(out, "(nothing to undo)")?;
            }
        }
        "/save" | "/load" if arg.is_empty() => writeln!(out, "usage: {cmd} FILE")?,
        "/save" => match c.save(Path::new(arg)) {
            Ok(()) => writeln!(
                out,
                "(saved {} turns, {} positions to {arg})",
                c.turns.len(),
                c.session.tokens().len()
            )?,
            Err(e) => writeln!(out, "error: {}", describe(&e))?,
        },
        "/load" => match c.load(Path::new(arg)) {
            Ok(()) => writeln!(
                out,
                "(loaded {} turns, {} positions from {arg})",
                c.turns.len(),
                c.session.tokens().len()
            )?,
            Err(e) => writeln!(out, "error: {}", describe(&e))?,
        },
        other => writeln!(out, "unknown command {other}: /help lists them")?,
    }
    out.flush()?;
    Ok(true)
}

/// The longest input line taken from a pipe (a turn cannot be longer than the context anyway).
const MAX_LINE: u64 = 16 << 20;

/// One line of piped input without its newline, at most `limit` bytes; None at end of input.
fn read_line_bounded(r: &mut impl BufRead, limit: u64) -> Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r.by_ref().take(limit + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
    } else if n as u64 > limit {
        bail!("an input line is longer than {limit} bytes");
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| anyhow::anyhow!("an input line is not UTF-8 text"))
}

/// Reads one turn's input: handles `\\` continuations and `"""` blocks. None at end of input.
fn read_turn(mut next_line: impl FnMut(bool) -> Result<Option<String>>) -> Result<Option<String>> {
    let Some(first) = next_line(false)? else {
        return Ok(None);
    };
    if first.trim() == "\"\"\"" {
        let mut lines = Vec::new();
        while let Some(l) = next_line(true)? {
            if l.trim() == "\"\"\"" {
                break;
            }
            lines.push(l);
        }
        return Ok(Some(lines.join("\n")));
    }
    let mut text = first;
    while text.ends_with('\\') {
        text.pop();
        match next_line(true)? {
            Some(l) => {
                text.push('\n');
                text.push_str(&l);
            }
            None => break,
        }
    }
    Ok(Some(text))
}

pub fn run(args: ChatArgs) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("-n/--max-tokens must be at least 1");
    }
    // Every flag is checked before anything is fetched or loaded.
    let sampling = args.sampling.params()?;
    let mut load = args.model.options()?;
    let mode = args.cache.mode()?;
    load.kv_precisions = vec![mode.precision];
    let on_full: crate::session::conversation::OnFull =
        args.on_full.parse().context("--on-full")?;
    if mode.retention == crate::kv::Retention::None && args.prompt_cache.is_some() {
        bail!("--prompt-cache needs a KV cache (drop --no-cache)");
    }
    // What is at --prompt-cache must be a kvchat KV file or nothing.
    if let Some(pc) = &args.prompt_cache {
        persist::check_target(pc).map_err(|e| anyhow::anyhow!("--prompt-cache: {e}"))?;
    }
    let interrupt = crate::interrupt::install()?;
    let engine = Engine::load(&load)?;
    let spec = args.cache.spec(engine.ctx)?;
    let template = engine.chat_template(args.chat_template.as_deref())?;
    let mut conv = Conversation::new(&engine, &spec, template, args.system.clone(), on_full);
    if let Some(pc) = &args.prompt_cache {
        if pc.exists() {
            match conv.load(pc) {
                Ok(()) => eprintln!(
                    "kvchat: resumed {} turns from {}",
                    conv.turns.len(),
                    pc.display()
                ),
                Err(e) => eprintln!("kvchat: ignoring prompt cache: {}", describe(&e)),
            }
        }
    }
    let mut sampler = Sampler::new(sampling);
    let tty = std::io::stdin().is_terminal();

    let mut editor = if tty {
        let mut ed = rustyline::DefaultEditor::new().context("cannot start the line editor")?;
        let hist = args.history.clone().unwrap_or_else(default_history);
        if let Some(dir) = hist.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = ed.load_history(&hist);
        eprintln!(
            "kvchat chat — {} ({}); /help for commands",
            engine.path.display(),
            spec.describe()
        );
        Some((ed, hist))
    } else {
        None
    };
    let stdin = std::io::stdin();
    let mut input_lines = stdin.lock();
    let mut stdout = std::io::stdout();
    loop {
        let input = match &mut editor {
            Some((ed, hist)) => {
                let r = read_turn(|cont| match ed.readline(if cont { "... " } else { "> " }) {
                    Ok(l) => Ok(Some(l)),
                    Err(rustyline::error::ReadlineError::Interrupted) if !cont => Ok(None),
                    Err(rustyline::error::ReadlineError::Interrupted) => Ok(Some(String::new())),
                    Err(rustyline::error::ReadlineError::Eof) => Ok(None),
                    Err(e) => Err(e.into()),
                })?;
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
            if !command(&mut conv, input, &mut stdout)? {
                break;
            }
            continue;
        }
        interrupt.generating.store(true, Ordering::SeqCst);
        let result = conv.ask(input, &mut sampler, args.max_tokens, &interrupt.stop, |t| {
            stdout.write_all(t.as_bytes())?;
            stdout.flush()?;
            Ok(())
        });
        interrupt.generating.store(false, Ordering::SeqCst);
        writeln!(stdout)?;
        match result {
            Ok(t) => {
                if t.reason == crate::session::StopReason::Interrupted {
                    eprintln!("(interrupted)");
                }
                if args.stats {
                    print_turn_stats(&conv, &t);
                }
                if let Some(pc) = &args.prompt_cache {
                    if let Err(e) = conv.save(pc) {
                        eprintln!("kvchat: cannot save the prompt cache: {}", describe(&e));
                    }
                }
            }
            Err(e) => eprintln!("error: {}", describe(&e)),
        }
    }
    Ok(())
}
