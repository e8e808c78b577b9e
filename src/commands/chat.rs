//! `kvchat chat`: an interactive conversation that keeps its KV cache across turns.
//!
//! On a terminal: rustyline line editing, a history file shared safely between sessions, multi-line
//! input (a trailing `\` continues the line; a `"""` line opens and closes a block), Ctrl-C during an
//! answer stops it (the partial answer stays; the terminal echoes no ^C into it), Ctrl-C on a line
//! being typed clears it, Ctrl-C at an empty prompt or Ctrl-D exits. `/set` changes sampling and
//! max tokens mid-chat, `/show` prints the model's facts and the settings in force.
//! Not on a terminal: each input line is one turn (slash commands too), so chats can be scripted.

use crate::cli::report::describe;
use crate::cli::style;
use crate::cli::ChatArgs;
use crate::commands::run::{open_store, report_store_problems};
use crate::engine::Engine;
use crate::kv::persist;
use crate::model::sampling::SamplingPrefs;
use crate::session::conversation::{Conversation, TurnStats};
use crate::session::{Resolved, Sampler, StopReason};
use crate::source::{human_bytes, kvchat_home};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What a slash command asks of the chat loop.
enum Flow {
    Continue,
    Leave,
}

/// What a slash command does, given the chat, its argument (trimmed) and where to write.
type Action = fn(&mut Chat<'_>, &str, &mut dyn Write) -> Result<Flow>;

/// A slash command: its names (the first is the one /help shows), its argument, its help line and
/// what it does. The one list of them: /help, completion and dispatch all read [`SLASH`].
struct Slash {
    names: &'static [&'static str],
    args: &'static str,
    help: &'static str,
    run: Action,
}

const SLASH: &[Slash] = &[
    Slash {
        names: &["/help"],
        args: "",
        help: "this text",
        run: |_, _, out| {
            writeln!(out, "{}", help_text())?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/reset"],
        args: "",
        help: "forget the conversation (keeps the system message)",
        run: |chat, _, out| {
            chat.conv.reset()?;
            writeln!(out, "(conversation cleared)")?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/system"],
        args: "TEXT",
        help: "set the system message (/system alone shows it)",
        run: |chat, arg, out| {
            let c = &mut chat.conv;
            if arg.is_empty() {
                let system = c.system().unwrap_or("(the template's default)");
                writeln!(out, "system: {system}")?;
            } else {
                c.set_system(Some(arg.to_string()));
                writeln!(out, "(system message set)")?;
            }
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/set"],
        args: "NAME VALUE",
        help: "change a setting: temperature, top-k, top-p, min-p, repeat-penalty,\n\
               repeat-last-n, seed, max-tokens (/set alone lists them)",
        run: |chat, arg, out| {
            if arg.is_empty() {
                writeln!(
                    out,
                    "sampling: {}\nmax-tokens {}",
                    chat.sampling.describe(),
                    chat.max_tokens
                )?;
            } else {
                let done = chat.set(arg).map_err(|e| anyhow::anyhow!("/set {e}"))?;
                writeln!(out, "{done}")?;
            }
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/show"],
        args: "",
        help: "the model, its context, template, cache and the sampling in force",
        run: |chat, _, out| {
            writeln!(out, "{}", chat.show_text())?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/stats"],
        args: "",
        help: "tokens and bytes in the cache, per-layer shape, last turn's speed",
        run: |chat, _, out| {
            writeln!(out, "{}", chat.stats_text())?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/cache"],
        args: "",
        help: "the cache's precision, retention and placement",
        run: |chat, _, out| {
            let c = &chat.conv;
            writeln!(
                out,
                "{}\nprefix store: {}",
                c.session().cache().spec().describe(),
                c.store().describe()
            )?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/save"],
        args: "FILE",
        help: "save the conversation and its KV state",
        run: |chat, arg, out| {
            let c = &chat.conv;
            c.save(Path::new(file_arg("/save", arg)?))?;
            let (turns, positions) = (c.turns().len(), c.session().tokens().len());
            writeln!(out, "(saved {turns} turns, {positions} positions to {arg})")?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/load"],
        args: "FILE",
        help: "load a saved conversation (same model and cache configuration)",
        run: |chat, arg, out| {
            let c = &mut chat.conv;
            c.load(Path::new(file_arg("/load", arg)?))?;
            let (turns, positions) = (c.turns().len(), c.session().tokens().len());
            writeln!(
                out,
                "(loaded {turns} turns, {positions} positions from {arg})"
            )?;
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/undo"],
        args: "",
        help: "drop the last exchange",
        run: |chat, _, out| {
            let c = &mut chat.conv;
            if c.undo()? {
                let held = c.session().cache().len();
                writeln!(out, "(last exchange dropped; cache holds {held} positions)")?;
            } else {
                writeln!(out, "(nothing to undo)")?;
            }
            Ok(Flow::Continue)
        },
    },
    Slash {
        names: &["/exit", "/quit", "/bye"],
        args: "",
        help: "leave (also Ctrl-D, or Ctrl-C at an empty prompt)",
        run: |_, _, _| Ok(Flow::Leave),
    },
];

/// The FILE argument of /save and /load, which they cannot do without.
fn file_arg<'a>(cmd: &str, arg: &'a str) -> Result<&'a str> {
    if arg.is_empty() {
        bail!("usage: {cmd} FILE");
    }
    Ok(arg)
}

/// Every slash command's name, aliases included (completion, "did you mean").
fn slash_names() -> impl Iterator<Item = &'static str> {
    SLASH.iter().flat_map(|c| c.names.iter().copied())
}

/// /help: one line per command (a help text's own line breaks continue it), then the input keys.
fn help_text() -> String {
    let mut s = String::from("commands:");
    for c in SLASH {
        let head = format!("{} {}", c.names[0], c.args);
        let mut lines = c.help.lines();
        s += &format!("\n  {head:<19}{}", lines.next().unwrap_or(""));
        for more in lines {
            s += &format!("\n  {:<19}{}", "", more.trim_start());
        }
    }
    s + "\ninput: end a line with \\ to continue it; a line \"\"\" opens and closes a multi-line block;\n\
         Ctrl-C clears a line being typed, or stops an answer"
}

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
    /// `--stats`: the sampling in force is printed at the start and after each `/set`.
    stats: bool,
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
        let cfg = &c.engine().model.cfg;
        let cache = &c.session().cache();
        let mut s = format!(
            "cache: {} positions held ({} seen), {} used of {} allocated\nper layer ({} layers): K and V [1, {}, {}, {}] {}\ndevice {:?}, activations f32, {} threads",
            cache.len(),
            cache.seen(),
            human_bytes(cache.bytes_used() as u64),
            human_bytes(cache.bytes() as u64),
            cfg.n_layer,
            cfg.n_kv_head,
            cache.len(),
            cfg.head_dim,
            cache.spec().precision().name(),
            crate::engine::device_name(&c.engine().device),
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

/// Handles a slash command; returns false to leave. A command that fails is reported and
/// counted.
fn command(
    chat: &mut Chat<'_>,
    line: &str,
    out: &mut impl Write,
    errors: &mut usize,
) -> Result<bool> {
    let (cmd, arg) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let flow = match SLASH.iter().find(|c| c.names.contains(&cmd)) {
        Some(c) => (c.run)(chat, arg.trim(), out),
        None => Err(anyhow::anyhow!(
            "unknown command {cmd}: /help lists them{}",
            crate::did_you_mean(cmd, slash_names())
        )),
    };
    let leave = match flow {
        Ok(Flow::Leave) => true,
        Ok(Flow::Continue) => false,
        Err(e) => {
            *errors += 1;
            writeln!(out, "error: {}", describe(&e))?;
            false
        }
    };
    out.flush()?;
    Ok(!leave)
}

/// The line editor's helper: a coloured prompt and completion of slash commands and /set names.
struct EditorHelper {
    colour: bool,
}

impl rustyline::completion::Completer for EditorHelper {
    type Candidate = String;
    fn complete(
        &self,
        line: &str,
        pos: usize,
        _: &rustyline::Context<'_>,
    ) -> rustyline::Result<(usize, Vec<String>)> {
        let head = &line[..pos];
        if !head.starts_with('/') {
            return Ok((0, Vec::new()));
        }
        let (candidates, start, word): (Vec<&str>, usize, &str) = match head.strip_prefix("/set ") {
            Some(rest) if !rest.contains(' ') => {
                let mut names = crate::model::sampling::SETTINGS.to_vec();
                names.push("max-tokens");
                (names, 5, rest)
            }
            Some(_) => return Ok((0, Vec::new())),
            None if !head.contains(' ') => (slash_names().collect(), 0, head),
            None => return Ok((0, Vec::new())),
        };
        let found = candidates
            .into_iter()
            .filter(|c| c.starts_with(word))
            .map(|c| format!("{c} "))
            .collect();
        Ok((start, found))
    }
}

impl rustyline::hint::Hinter for EditorHelper {
    type Hint = String;
}

impl rustyline::validate::Validator for EditorHelper {}

impl rustyline::highlight::Highlighter for EditorHelper {
    fn highlight_prompt<'b, 's: 'b, 'p: 'b>(
        &'s self,
        prompt: &'p str,
        _default: bool,
    ) -> std::borrow::Cow<'b, str> {
        std::borrow::Cow::Owned(style::paint(self.colour, style::PROMPT, prompt))
    }
}

impl rustyline::Helper for EditorHelper {}

/// Ctrl-C at the prompt: notes whether a line was being typed (that line is then dropped, and the
/// chat goes on), then interrupts the read as usual.
struct CtrlC(Arc<AtomicBool>);

impl rustyline::ConditionalEventHandler for CtrlC {
    fn handle(
        &self,
        _: &rustyline::Event,
        _: rustyline::RepeatCount,
        _: bool,
        ctx: &rustyline::EventContext<'_>,
    ) -> Option<rustyline::Cmd> {
        self.0.store(!ctx.line().is_empty(), Ordering::SeqCst);
        None
    }
}

/// While an answer streams on a terminal, the terminal does not echo what is typed — neither a
/// ^C into the answer nor keys typed ahead (they wait for the next prompt). Restored when dropped.
struct QuietTerminal {
    #[cfg(unix)]
    saved: Option<nix::sys::termios::Termios>,
}

impl QuietTerminal {
    fn new(tty: bool) -> Self {
        #[cfg(unix)]
        {
            use nix::sys::termios::{tcgetattr, tcsetattr, LocalFlags, SetArg};
            let stdin = std::io::stdin();
            let saved = if tty { tcgetattr(&stdin).ok() } else { None };
            if let Some(t) = &saved {
                let mut quiet = t.clone();
                quiet
                    .local_flags
                    .remove(LocalFlags::ECHO | LocalFlags::ECHOCTL);
                let _ = tcsetattr(&stdin, SetArg::TCSANOW, &quiet);
            }
            Self { saved }
        }
        #[cfg(not(unix))]
        {
            let _ = tty;
            Self {}
        }
    }
}

impl Drop for QuietTerminal {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(t) = &self.saved {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin(),
                nix::sys::termios::SetArg::TCSANOW,
                t,
            );
        }
    }
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
        // (The chat ends here: a piped script with a line this long is not one to go on with.)
        bail!("an input line is longer than {limit} bytes");
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| anyhow::anyhow!("an input line is not UTF-8 text"))
}

/// Reads one turn's input: handles `\\` continuations and `"""` blocks, at most [`MAX_LINE`]
/// bytes in all. None at end of input.
fn read_turn(mut next_line: impl FnMut(bool) -> Result<Option<String>>) -> Result<Option<String>> {
    let Some(first) = next_line(false)? else {
        return Ok(None);
    };
    let too_long = |text: &str| -> Result<()> {
        if text.len() as u64 > MAX_LINE {
            bail!("an input turn is longer than {MAX_LINE} bytes");
        }
        Ok(())
    };
    if first.trim() == "\"\"\"" {
        let mut text = String::new();
        let mut first_line = true;
        while let Some(l) = next_line(true)? {
            if l.trim() == "\"\"\"" {
                break;
            }
            if !first_line {
                text.push('\n');
            }
            first_line = false;
            text.push_str(&l);
            too_long(&text)?;
        }
        return Ok(Some(text));
    }
    let mut text = first;
    while text.ends_with('\\') {
        text.pop();
        match next_line(true)? {
            Some(l) => {
                text.push('\n');
                text.push_str(&l);
                too_long(&text)?;
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
    let flags = args.sampling.prefs()?;
    let store_budget = args.store.budget()?;
    let mut load = args.model.options()?;
    let mode = args.cache.mode_for(args.model.ctx)?;
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
    if let Some(t) = &args.chat_template {
        crate::template::ChatTemplate::check_spec(t).context("--chat-template")?;
    }
    let interrupt = crate::interrupt::install()?;
    let engine = Engine::load(&load)?;
    let spec = args.cache.spec(engine.ctx)?;
    let template = engine.chat_template(args.chat_template.as_deref())?;
    let sampling = engine.sampling_for(&flags);
    let mut chat = Chat {
        conv: Conversation::new(&engine, &spec, template, args.system.clone(), on_full),
        sampler: Sampler::new(sampling.params.clone()),
        sampling,
        max_tokens: args.max_tokens,
        template: match &args.chat_template {
            Some(t) if t.len() < 40 && !t.contains('{') => format!("{t} (--chat-template)"),
            Some(_) => "Jinja text from --chat-template".into(),
            None => "the model's own".into(),
        },
        colour: style::stderr(),
        stats: args.stats,
    };
    // A system message that alone fills the context is refused before the first turn.
    chat.conv.check_system()?;
    let prompt_cache = args.prompt_cache.is_some();
    let store = open_store(
        &args.store,
        store_budget,
        prompt_cache,
        &engine,
        chat.conv.session(),
    );
    chat.conv.set_store(store);
    report_store_problems(chat.conv.store_mut());
    for n in &engine.sampling_notes {
        eprintln!("note: {n}");
    }
    chat.print_sampling();
    if let Some(pc) = &args.prompt_cache {
        if pc.exists() {
            match chat.conv.load(pc) {
                Ok(()) => eprintln!(
                    "kvchat: resumed {} turns from {}",
                    chat.conv.turns().len(),
                    pc.display()
                ),
                Err(e) => eprintln!("kvchat: ignoring prompt cache: {}", describe(&e)),
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
        let result = chat.conv.ask(
            input,
            &mut chat.sampler,
            chat.max_tokens,
            &interrupt.stop,
            |t| {
                stdout.write_all(t.as_bytes())?;
                stdout.flush()?;
                Ok(())
            },
        );
        drop(quiet);
        interrupt.generating.store(false, Ordering::SeqCst);
        writeln!(stdout)?;
        report_store_problems(chat.conv.store_mut());
        match result {
            Ok(t) => {
                match t.reason {
                    StopReason::Interrupted => eprintln!("(interrupted)"),
                    StopReason::ContextFull => eprintln!(
                        "(the answer was cut: the context of {} tokens is full; {})",
                        chat.conv.session().max_positions(),
                        if on_full == crate::session::conversation::OnFull::Stop {
                            "/undo, /reset, or --on-full shift"
                        } else {
                            "the next turn drops the oldest turns"
                        }
                    ),
                    _ => {}
                }
                if args.stats {
                    chat.print_turn_stats(&t);
                }
                if let Some(pc) = &args.prompt_cache {
                    if let Err(e) = chat.conv.save(pc) {
                        errors += 1;
                        eprintln!("kvchat: cannot save the prompt cache: {}", describe(&e));
                    }
                }
            }
            Err(e) => {
                errors += 1;
                eprintln!("error: {}", describe(&e))
            }
        }
    }
    chat.conv.store_mut().finish();
    report_store_problems(chat.conv.store_mut());
    if !tty && errors > 0 {
        bail!("{errors} of the chat's turns or commands failed (see above)");
    }
    Ok(())
}
