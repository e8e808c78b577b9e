//! A thinking model's reasoning apart from its answer: the text between its markers (`<think>` …
//! `</think>`: Qwen3, QwQ, DeepSeek-R1 and their kin) goes to the client as reasoning, never as
//! content. Read as the answer streams: text that may be a marker is held until it is known.

/// A family's reasoning markers.
#[derive(Debug)]
pub struct Markers {
    pub open: &'static str,
    pub close: &'static str,
}

/// `<think>` … `</think>`.
pub const THINK: Markers = Markers {
    open: "<think>",
    close: "</think>",
};

/// The markers a chat template's model reasons between, if it is a thinking model's.
pub fn for_template(source: &str) -> Option<&'static Markers> {
    source.contains(THINK.close).then_some(&THINK)
}

/// Whether `prompt` ends by opening the reasoning (templates that open it for the model: the
/// answer then begins inside it).
pub fn prompt_opens(tokenizer: &crate::tokenizer::Tokenizer, prompt: &[u32], m: &Markers) -> bool {
    let tail = &prompt[prompt.len().saturating_sub(4)..];
    let text = tokenizer.decode(tail, false).unwrap_or_default();
    text.trim_end().ends_with(m.open)
}

/// A piece of an answer: reasoning, or the answer itself.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Reasoning(String),
    Answer(String),
}

/// Splits an answer as its text arrives.
#[derive(Debug)]
pub struct Splitter {
    markers: &'static Markers,
    /// Text not given out yet: a possible marker.
    held: String,
    inside: bool,
    /// Anything was given out, or the opening passed: reasoning can only open the answer.
    begun: bool,
    /// Reasoning just closed: whitespace before the answer is not its.
    after_close: bool,
}

impl Splitter {
    /// `inside`: the prompt itself ended with the opening marker (templates that open the
    /// reasoning for the model), so the answer begins as reasoning.
    pub fn new(markers: &'static Markers, inside: bool) -> Self {
        Self {
            markers,
            held: String::new(),
            inside,
            begun: inside,
            after_close: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            let m = self.markers;
            if self.inside {
                if let Some(at) = self.held.find(m.close) {
                    let reasoning: String = self.held.drain(..at + m.close.len()).collect();
                    emit(&mut out, Part::Reasoning(reasoning[..at].to_string()));
                    self.inside = false;
                    self.after_close = true;
                    continue;
                }
                let keep = crate::partial_suffix(&self.held, m.close);
                let give: String = self.held.drain(..self.held.len() - keep).collect();
                emit(&mut out, Part::Reasoning(give));
                break;
            }
            if !self.begun {
                let start = self.held.trim_start();
                if start.starts_with(m.open) {
                    let at = self.held.find(m.open).unwrap_or(0);
                    self.held.drain(..at + m.open.len());
                    self.inside = true;
                    self.begun = true;
                    continue;
                }
                if m.open.starts_with(start) {
                    break;
                }
                self.begun = true;
            }
            if self.after_close {
                let start = self.held.trim_start();
                if start.is_empty() {
                    break;
                }
                let at = self.held.len() - start.len();
                self.held.drain(..at);
                self.after_close = false;
            }
            let all = std::mem::take(&mut self.held);
            emit(&mut out, Part::Answer(all));
            break;
        }
        out
    }

    /// What is left once the answer ended (reasoning never closed stays reasoning).
    pub fn finish(&mut self) -> Vec<Part> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        if self.inside {
            emit(&mut out, Part::Reasoning(held));
        } else if !self.after_close {
            emit(&mut out, Part::Answer(held));
        }
        out
    }
}

fn emit(out: &mut Vec<Part>, part: Part) {
    match &part {
        Part::Reasoning(t) | Part::Answer(t) if t.is_empty() => {}
        _ => out.push(part),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fed in two pieces cut at `cut`: the reasoning and the answer, each whole.
    fn split(inside: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Splitter::new(&THINK, inside);
        let mut parts = Vec::new();
        for p in pieces {
            parts.extend(s.push(p));
        }
        parts.extend(s.finish());
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => reasoning.push_str(&t),
                Part::Answer(t) => answer.push_str(&t),
            }
        }
        (reasoning, answer)
    }

    #[test]
    fn reasoning_between_the_markers_never_reaches_the_answer_wherever_the_pieces_are_cut() {
        let text = "<think>\nplan: add\n</think>\n\n2 + 2 = 4";
        for cut in 0..=text.len() {
            let got = split(false, &[&text[..cut], &text[cut..]]);
            assert_eq!(
                got,
                ("\nplan: add\n".into(), "2 + 2 = 4".into()),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn an_answer_without_markers_is_all_answer_and_a_later_marker_is_text() {
        assert_eq!(split(false, &["Hello"]), (String::new(), "Hello".into()));
        assert_eq!(
            split(false, &["Hi <think>x</think>"]),
            (String::new(), "Hi <think>x</think>".into())
        );
        assert_eq!(split(false, &["<thi"]), (String::new(), "<thi".into()));
    }

    #[test]
    fn a_prompt_that_opened_the_reasoning_starts_the_answer_inside_it() {
        assert_eq!(
            split(true, &["why\n</think>\n\nbecause"]),
            ("why\n".into(), "because".into())
        );
    }

    #[test]
    fn reasoning_cut_short_stays_reasoning() {
        assert_eq!(
            split(false, &["<think>still thinking"]),
            ("still thinking".into(), String::new())
        );
    }

    #[test]
    fn a_thinking_template_is_known_by_its_closing_marker() {
        assert!(for_template("{{ '<think>\\n\\n</think>\\n\\n' }}").is_some());
        assert!(for_template("{{ messages }}").is_none());
    }
}
