//! A thinking model's reasoning as `run` and `chat` show it: dimmed on a terminal (without its
//! markers), left out with `--hide-reasoning`, and as the model wrote it — between its markers —
//! into a pipe. The split is `crate::reasoning`'s, the same the server's is. A Harmony model's
//! (gpt-oss) answer is read by its channels (`toolcall::harmony`), whose markers are control
//! tokens: its text must keep them ([`Shown::keeps_special`]), and its reasoning is shown before
//! its answer, dimmed on a terminal.

use super::style;
use crate::reasoning::{self, Markers, Part, Splitter};
use crate::toolcall::harmony::{self, is_harmony, Channels};
use crate::toolcall::Piece;

/// What of an answer's text is shown, piece by piece.
pub struct Shown {
    /// None: the text is shown as it comes (no reasoning markers, or a pipe without hiding).
    splitter: Option<Splitter>,
    /// A Harmony model's channels (then `splitter` is None).
    channels: Option<Channels>,
    hide: bool,
    dim: bool,
    /// Reasoning was shown and the answer has not begun.
    in_reasoning: bool,
}

impl Shown {
    /// For an answer under the chat template `source` (None: raw text), whose prompt `opens`
    /// the reasoning or not (`reasoning::prompt_opens`): `dim`: on a terminal in colour;
    /// `hide`: `--hide-reasoning`.
    pub fn new(
        source: Option<&str>,
        opens: impl Fn(&Markers) -> bool,
        dim: bool,
        hide: bool,
    ) -> Self {
        let markers = source.and_then(reasoning::for_template);
        let splitter = markers
            .filter(|_| dim || hide)
            .map(|m| Splitter::new(m, opens(m)));
        let channels = source.filter(|s| is_harmony(s)).map(|_| Channels::new());
        Self {
            splitter,
            channels,
            hide,
            dim,
            in_reasoning: false,
        }
    }

    /// Whether the answer's text must keep control tokens' text (a Harmony model's).
    pub fn keeps_special(&self) -> bool {
        self.channels.is_some()
    }

    /// The text to show for `text`, the answer's next piece.
    pub fn text(&mut self, text: &str) -> String {
        if let Some(c) = &mut self.channels {
            let parts = c.push(text);
            return self.show_channels(parts);
        }
        match &mut self.splitter {
            None => text.to_string(),
            Some(s) => {
                let parts = s.push(text);
                self.show(parts)
            }
        }
    }

    /// What is still held when the answer ends.
    pub fn finish(&mut self) -> String {
        if let Some(c) = &mut self.channels {
            let parts = c.finish();
            return self.show_channels(parts);
        }
        match &mut self.splitter {
            None => String::new(),
            Some(s) => {
                let parts = s.finish();
                self.show(parts)
            }
        }
    }

    /// Harmony's parts as the others: reasoning, and text (a call, which `run` never asks for,
    /// as its JSON).
    fn show_channels(&mut self, parts: Vec<harmony::Part>) -> String {
        let parts = parts
            .into_iter()
            .map(|p| match p {
                harmony::Part::Reasoning(r) => Part::Reasoning(r),
                harmony::Part::Piece(Piece::Text(t)) => Part::Answer(t),
                harmony::Part::Piece(Piece::Call(c)) => {
                    Part::Answer(format!("{}({})", c.name, c.arguments))
                }
            })
            .collect();
        self.show(parts)
    }

    fn show(&mut self, parts: Vec<Part>) -> String {
        let mut out = String::new();
        for p in parts {
            match p {
                Part::Reasoning(t) if !self.hide => {
                    self.in_reasoning = true;
                    out.push_str(&style::paint(self.dim, style::DIM, &t));
                }
                Part::Reasoning(_) => {}
                Part::Answer(t) => {
                    if std::mem::take(&mut self.in_reasoning) {
                        out.push_str("\n\n");
                    }
                    out.push_str(&t);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THINKING: &str = "{{ '<think>' }} … {{ '</think>' }}";

    fn shown(dim: bool, hide: bool) -> String {
        let mut s = Shown::new(Some(THINKING), |_| false, dim, hide);
        let mut out = String::new();
        for piece in ["<thi", "nk>Two and two", " make four.</think>", "\n\n4"] {
            out.push_str(&s.text(piece));
        }
        out + &s.finish()
    }

    #[test]
    fn on_a_terminal_reasoning_is_dimmed_without_its_markers_and_the_answer_follows() {
        assert_eq!(
            shown(true, false),
            "\x1b[2mTwo and two\x1b[0m\x1b[2m make four.\x1b[0m\n\n4"
        );
    }

    #[test]
    fn hidden_reasoning_leaves_only_the_answer() {
        assert_eq!(shown(true, true), "4");
        assert_eq!(shown(false, true), "4");
    }

    #[test]
    fn into_a_pipe_the_text_is_as_the_model_wrote_it() {
        assert_eq!(
            shown(false, false),
            "<think>Two and two make four.</think>\n\n4"
        );
    }

    #[test]
    fn a_harmony_answer_shows_its_reasoning_then_its_answer_and_keeps_control_tokens() {
        let harmony = "<|start|>assistant<|channel|>final<|message|>";
        let text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4";
        let mut s = Shown::new(Some(harmony), |_| false, false, false);
        assert!(s.keeps_special());
        assert_eq!(s.text(text) + &s.finish(), "Easy.\n\n4");
        let mut hidden = Shown::new(Some(harmony), |_| false, false, true);
        assert_eq!(hidden.text(text) + &hidden.finish(), "4");
    }

    #[test]
    fn a_template_without_markers_shows_everything() {
        let mut s = Shown::new(Some("{{ messages }}"), |_| false, true, true);
        assert_eq!(s.text("<think>x</think>y"), "<think>x</think>y");
    }
}
