//! Reading a turn: the line editor on a terminal (completion, Ctrl-C, a quiet terminal during
//! an answer), bounded lines and multi-line blocks when piped.

use super::*;

/// The line editor's helper: a coloured prompt and completion of slash commands and /set names.
pub(super) struct EditorHelper {
    pub(super) colour: bool,
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
pub(super) struct CtrlC(pub(super) Arc<AtomicBool>);

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
pub(super) struct QuietTerminal {
    #[cfg(unix)]
    saved: Option<nix::sys::termios::Termios>,
}

impl QuietTerminal {
    pub(super) fn new(tty: bool) -> Self {
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
pub(super) const MAX_LINE: u64 = 16 << 20;

/// One line of piped input without its newline, at most `limit` bytes; None at end of input.
pub(super) fn read_line_bounded(r: &mut impl BufRead, limit: u64) -> Result<Option<String>> {
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
pub(super) fn read_turn(
    mut next_line: impl FnMut(bool) -> Result<Option<String>>,
) -> Result<Option<String>> {
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
