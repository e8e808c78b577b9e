//! The slash commands, in one table that /help, completion and dispatch all read.

use super::*;

/// What a slash command asks of the chat loop.
pub(super) enum Flow {
    Continue,
    Leave,
}

/// What a slash command does, given the chat, its argument (trimmed) and where to write.
pub(super) type Action = fn(&mut Chat<'_>, &str, &mut dyn Write) -> Result<Flow>;

/// A slash command: its names (the first is the one /help shows), its argument, its help line and
/// what it does. The one list of them: /help, completion and dispatch all read [`SLASH`].
pub(super) struct Slash {
    names: &'static [&'static str],
    args: &'static str,
    help: &'static str,
    run: Action,
}

pub(super) const SLASH: &[Slash] = &[
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
        names: &["/compact"],
        args: "",
        help: "have the model summarise the oldest half of the turns into a note kept with\n\
               the system message (frees context; --on-full compact does it when full)",
        run: |chat, _, out| {
            let c = chat.conv.compact()?;
            writeln!(out, "({c})")?;
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
        help: "the cache: its axes, what it holds now, what a budget dropped, what the last\n\
               turn reused, the prefix store",
        run: |chat, _, out| {
            writeln!(out, "{}", chat.cache_text())?;
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
pub(super) fn file_arg<'a>(cmd: &str, arg: &'a str) -> Result<&'a str> {
    if arg.is_empty() {
        bail!("usage: {cmd} FILE");
    }
    Ok(arg)
}

/// Every slash command's name, aliases included (completion, "did you mean").
pub(super) fn slash_names() -> impl Iterator<Item = &'static str> {
    SLASH.iter().flat_map(|c| c.names.iter().copied())
}

/// /help: one line per command (a help text's own line breaks continue it), then the input keys.
pub(super) fn help_text() -> String {
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

/// Handles a slash command; returns false to leave. A command that fails is reported and
/// counted.
pub(super) fn command(
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
            writeln!(out, "error: {}", crate::describe_with(&e, chat.advice))?;
            false
        }
    };
    out.flush()?;
    Ok(!leave)
}
