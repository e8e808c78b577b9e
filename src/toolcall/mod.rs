//! Tool calls in a model's own words: the functions a request offers, which format the model
//! writes its calls in (`formats`, one row per family), and reading the calls out of its answer as
//! it streams, so that a call reaches the client as a call and never as text.

pub mod formats;
pub mod gemma;
pub mod grammar;
pub mod harmony;

pub use formats::{for_template, Format, FORMATS};
use serde_json::Value;

/// A call the model made: a function's name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: Value,
}

/// A function a request offers the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// Its parameters' JSON schema (an object schema).
    pub parameters: Value,
}

impl Tool {
    /// The tool as chat templates read it (OpenAI's shape, which Hugging Face templates expect).
    pub fn for_template(&self) -> Value {
        let mut function = serde_json::Map::new();
        function.insert("name".into(), Value::String(self.name.clone()));
        if let Some(d) = &self.description {
            function.insert("description".into(), Value::String(d.clone()));
        }
        function.insert("parameters".into(), self.parameters.clone());
        serde_json::json!({"type": "function", "function": function})
    }
}

/// Whether, and which, a request lets the model call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The tools are shown, calls are not read: the answer is text.
    None,
    /// The model decides; its calls are read out of its answer.
    Auto,
    /// It must call one of them.
    Required,
    /// It must call this one.
    Named(String),
}

/// A piece of an answer: text for the client, or a whole call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(Call),
}

/// Reads calls out of an answer as its text arrives. Text that may be the start of a call is held
/// back until it is known not to be; whitespace next to a call is not content.
#[derive(Debug)]
pub struct Scanner {
    format: &'static Format,
    /// Text not yet given out: a possible opening, or a call's body so far.
    held: String,
    inside: bool,
    /// Inside bare JSON calls (`Format::bare_json`): read when the answer ends.
    bare: bool,
    /// Text (not whitespace) was given out: an `at_start` format's calls can no longer open.
    spoke: bool,
    calls: usize,
    /// Whitespace given out only if text follows it.
    blank: String,
}

impl Scanner {
    pub fn new(format: &'static Format) -> Self {
        Self {
            format,
            held: String::new(),
            inside: false,
            bare: false,
            spoke: false,
            calls: 0,
            blank: String::new(),
        }
    }

    /// Calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The pieces that `text`, the answer's next piece, completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let f = self.format;
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.inside {
                if f.close.is_empty() || self.bare {
                    break;
                }
                let Some(end) = self.held.find(f.close) else {
                    break;
                };
                let body: String = self.held.drain(..end + f.close.len()).collect();
                self.read(&body[..end], Some(f.close), &mut out);
                self.inside = false;
                continue;
            }
            if f.bare_json && !self.spoke && self.calls == 0 {
                // An answer that opens with `{"name"` is its calls, bare (or in a ```json fence).
                const BARE: &str = "{\"name\"";
                let held = self.held.trim_start();
                if held.len() < FENCE.len() && FENCE.starts_with(held) {
                    break;
                }
                let unfenced = held.strip_prefix(FENCE).unwrap_or(held);
                let start: String = unfenced
                    .chars()
                    .filter(|c| !c.is_whitespace())
                    .take(BARE.len())
                    .collect();
                if start.len() < BARE.len() && BARE.starts_with(&start) {
                    break;
                }
                if start == BARE {
                    self.bare = true;
                    self.inside = true;
                    break;
                }
            }
            if f.at_start && self.spoke {
                let text = std::mem::take(&mut self.held);
                self.text(&text, &mut out);
                break;
            }
            if let Some(at) = self.held.find(f.open) {
                let before: String = self.held.drain(..at + f.open.len()).collect();
                let before = &before[..at];
                if f.at_start && !before.trim().is_empty() {
                    // Text came first: no call can open this answer.
                    let rest = std::mem::take(&mut self.held);
                    self.text(&format!("{before}{}{rest}", f.open), &mut out);
                    break;
                }
                self.text(before, &mut out);
                self.inside = true;
                continue;
            }
            // Hold back what could still become the opening.
            let keep = if f.at_start && f.open.starts_with(self.held.trim_start()) {
                self.held.len()
            } else {
                crate::partial_suffix(&self.held, f.open)
            };
            let give: String = self.held.drain(..self.held.len() - keep).collect();
            self.text(&give, &mut out);
            break;
        }
        out
    }

    /// The last pieces, once the answer ended; and whether a call was opened and never closed
    /// (its text is given out as text).
    pub fn finish(&mut self) -> (Vec<Piece>, bool) {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        let mut unclosed = false;
        if self.bare {
            let calls = held.trim();
            let calls = calls
                .strip_prefix(FENCE)
                .map_or(calls, |c| c.trim_end().strip_suffix("```").unwrap_or(c));
            match formats::read_bare_json_calls(calls) {
                Ok(calls) => {
                    self.calls += calls.len();
                    out.extend(calls.into_iter().map(Piece::Call));
                }
                Err(_) => self.text(&held, &mut out),
            }
            self.bare = false;
            self.inside = false;
        } else if self.inside {
            if self.format.close.is_empty() {
                self.read(&held, None, &mut out);
            } else {
                unclosed = true;
                self.text(&format!("{}{held}", self.format.open), &mut out);
            }
            self.inside = false;
        } else {
            self.text(&held, &mut out);
        }
        if self.calls == 0 && !self.blank.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.blank)));
        }
        (out, unclosed)
    }

    /// A call's body read: its calls, or (a body that does not read) its text as it was.
    fn read(&mut self, body: &str, close: Option<&str>, out: &mut Vec<Piece>) {
        match (self.format.read)(body) {
            Ok(calls) => {
                self.blank.clear();
                self.calls += calls.len();
                out.extend(calls.into_iter().map(Piece::Call));
            }
            Err(_) => {
                let text = format!("{}{body}{}", self.format.open, close.unwrap_or(""));
                self.text(&text, out);
            }
        }
    }

    fn text(&mut self, text: &str, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        if text.trim().is_empty() {
            self.blank.push_str(text);
            return;
        }
        let text = format!("{}{text}", std::mem::take(&mut self.blank));
        self.spoke = true;
        match out.last_mut() {
            Some(Piece::Text(t)) => t.push_str(&text),
            _ => out.push(Piece::Text(text)),
        }
    }
}

/// The Markdown fence small models put bare calls in.
const FENCE: &str = "```json";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hermes() -> &'static Format {
        FORMATS.iter().find(|f| f.name == "hermes").unwrap()
    }

    /// Feeds `pieces` one by one; the pieces out, whole, and whether a call was left open.
    fn scan(format: &'static Format, pieces: &[&str]) -> (Vec<Piece>, bool) {
        let mut s = Scanner::new(format);
        let mut out = Vec::new();
        for p in pieces {
            out.extend(s.push(p));
        }
        let (last, unclosed) = s.finish();
        out.extend(last);
        // Adjacent texts as one, as a client sees them.
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        (merged, unclosed)
    }

    fn call(name: &str, arguments: Value) -> Piece {
        Piece::Call(Call {
            name: name.into(),
            arguments,
        })
    }

    #[test]
    fn a_call_split_across_pieces_anywhere_is_read_whole_and_no_marker_leaks_as_text() {
        let answer = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        for cut in 1..answer.len() {
            let (pieces, unclosed) = scan(hermes(), &[&answer[..cut], &answer[cut..]]);
            assert_eq!(pieces, [call("f", json!({"x": 1}))], "cut at {cut}");
            assert!(!unclosed);
        }
    }

    #[test]
    fn an_answer_that_is_bare_json_calls_is_read_as_calls_and_other_json_stays_text() {
        let answer = " {\"name\": \"f\", \"arguments\": {\"x\": 1}}";
        for cut in 1..answer.len() {
            let (pieces, _) = scan(hermes(), &[&answer[..cut], &answer[cut..]]);
            assert_eq!(pieces, [call("f", json!({"x": 1}))], "cut at {cut}");
        }
        let fenced = "```json\n{\n  \"name\": \"f\",\n  \"arguments\": {}\n}\n```";
        for cut in 1..fenced.len() {
            let (pieces, _) = scan(hermes(), &[&fenced[..cut], &fenced[cut..]]);
            assert_eq!(pieces, [call("f", json!({}))], "cut at {cut}");
        }
        let (pieces, _) = scan(hermes(), &["```json\n[1, 2]\n```"]);
        assert_eq!(pieces, [Piece::Text("```json\n[1, 2]\n```".into())]);
        let (pieces, _) = scan(hermes(), &["{\"answer\": 42}"]);
        assert_eq!(pieces, [Piece::Text("{\"answer\": 42}".into())]);
        let (pieces, _) = scan(hermes(), &["{\"name\": \"f\", \"argu"]);
        assert_eq!(pieces, [Piece::Text("{\"name\": \"f\", \"argu".into())]);
    }

    #[test]
    fn text_before_between_and_after_calls_stays_text() {
        let (pieces, _) = scan(
            hermes(),
            &["Let me check.\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\"}</tool_call>\nDone"],
        );
        assert_eq!(
            pieces,
            [
                Piece::Text("Let me check.\n".into()),
                call("a", json!({})),
                call("b", json!({})),
                Piece::Text("\nDone".into()),
            ]
        );
    }

    #[test]
    fn an_answer_without_calls_is_given_out_exactly_even_if_it_ends_like_an_opening() {
        let (pieces, unclosed) = scan(hermes(), &["Hello ", "world <tool", "_"]);
        assert_eq!(pieces, [Piece::Text("Hello world <tool_".into())]);
        assert!(!unclosed);
        let (pieces, _) = scan(hermes(), &["  trailing  \n"]);
        assert_eq!(pieces, [Piece::Text("  trailing  \n".into())]);
    }

    #[test]
    fn a_call_opened_and_never_closed_comes_back_as_text_and_says_so() {
        let (pieces, unclosed) = scan(hermes(), &["<tool_call>\n{\"name\": \"f\", \"argu"]);
        assert_eq!(
            pieces,
            [Piece::Text("<tool_call>\n{\"name\": \"f\", \"argu".into())]
        );
        assert!(unclosed);
    }

    #[test]
    fn a_closed_call_that_does_not_read_comes_back_as_its_text() {
        let (pieces, unclosed) = scan(hermes(), &["<tool_call>not json</tool_call>"]);
        assert_eq!(
            pieces,
            [Piece::Text("<tool_call>not json</tool_call>".into())]
        );
        assert!(!unclosed);
    }

    #[test]
    fn an_answer_long_format_reads_its_calls_at_the_end() {
        let mistral = FORMATS.iter().find(|f| f.name == "mistral").unwrap();
        let (pieces, unclosed) = scan(
            mistral,
            &["[TOOL_", "CALLS][{\"name\": \"f\", ", "\"arguments\": {}}]"],
        );
        assert_eq!(pieces, [call("f", json!({}))]);
        assert!(!unclosed);
    }

    #[test]
    fn a_format_whose_calls_open_the_answer_reads_none_after_text() {
        let llama = FORMATS.iter().find(|f| f.name == "llama3-json").unwrap();
        let (pieces, _) = scan(llama, &[" {\"name\": \"f\", \"parameters\": {\"a\": 2}}"]);
        assert_eq!(pieces, [call("f", json!({"a": 2}))]);
        let (pieces, _) = scan(llama, &["Sure: ", "{\"name\": \"f\"}"]);
        assert_eq!(pieces, [Piece::Text("Sure: {\"name\": \"f\"}".into())]);
    }

    #[test]
    fn a_tool_is_shown_to_templates_in_openais_shape() {
        let t = Tool {
            name: "f".into(),
            description: Some("does f".into()),
            parameters: json!({"type": "object"}),
        };
        assert_eq!(
            t.for_template(),
            json!({"type": "function", "function": {"name": "f", "description": "does f", "parameters": {"type": "object"}}})
        );
    }
}
