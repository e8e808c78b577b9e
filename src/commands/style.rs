//! Colour for a person at a terminal: on when the stream is a terminal and `NO_COLOR` is unset or
//! empty (no-color.org), off when piped.

use std::io::IsTerminal;

/// Bold green: the chat prompt.
pub const PROMPT: &str = "1;32";
/// Dim: statistics and notes beside the answer.
pub const DIM: &str = "2";

/// Whether to colour what goes to a stream that `is_terminal` or not.
pub fn enabled(is_terminal: bool) -> bool {
    is_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Whether to colour stderr.
pub fn stderr() -> bool {
    enabled(std::io::stderr().is_terminal())
}

/// `text` in the ANSI style `code` when `on`, else as it is.
pub fn paint(on: bool, code: &str, text: &str) -> String {
    if on {
        format!("\x1b[{code}m{text}\x1b[0m")
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paint_wraps_only_when_on() {
        assert_eq!(paint(true, DIM, "x"), "\x1b[2mx\x1b[0m");
        assert_eq!(paint(false, DIM, "x"), "x");
    }

    #[test]
    fn a_pipe_gets_no_colour() {
        assert!(!enabled(false));
    }
}
