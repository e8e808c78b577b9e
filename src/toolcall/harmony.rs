//! OpenAI's Harmony format (gpt-oss): an answer is a run of messages, each a header and a body,
//! `<|channel|>analysis<|message|>…<|end|>` (reasoning), `<|start|>assistant<|channel|>final
//! <|message|>…` (the answer), and `<|channel|>commentary to=functions.NAME <|constrain|>json
//! <|message|>{…}<|call|>` (a call). The markers are control tokens, so the answer's text must
//! keep them (`TextStream::keeping_special`). Read as the answer streams: text that may be a
//! marker is held until it is known.

use super::{Call, Format, Piece};
use serde_json::Value;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
/// What ends a message's body (`<|call|>` and `<|return|>` also end the answer: stop tokens).
const ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", START];

/// Whether a chat template's model speaks Harmony.
pub fn is_harmony(template_source: &str) -> bool {
    template_source.contains(CHANNEL) && template_source.contains(MESSAGE)
}

/// A piece of a Harmony answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Reasoning(String),
    Piece(Piece),
}

/// What the message being read is.
#[derive(Debug, Clone, PartialEq)]
enum Body {
    /// Its header is not read yet.
    Header,
    Reasoning,
    Text,
    /// A call of this function: its arguments are read whole.
    Call(String),
}

/// Reads a Harmony answer as its text arrives.
#[derive(Debug)]
pub struct Channels {
    held: String,
    body: Body,
    /// The body of a call so far.
    arguments: String,
}

impl Default for Channels {
    fn default() -> Self {
        Self::new()
    }
}

impl Channels {
    pub fn new() -> Self {
        Self {
            held: String::new(),
            body: Body::Header,
            arguments: String::new(),
        }
    }

    /// The parts that `text`, the answer's next piece, completes.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.body == Body::Header {
                let held = self.held.trim_start();
                let opens_header = [START, CHANNEL]
                    .iter()
                    .any(|m| held.starts_with(m) || (held.len() < m.len() && m.starts_with(held)));
                if held.is_empty() || (opens_header && !held.contains(MESSAGE)) {
                    break;
                }
                if !opens_header {
                    // Text without a header: the answer itself.
                    self.body = Body::Text;
                    continue;
                }
                let at = self.held.find(MESSAGE).unwrap_or_default();
                let header: String = self.held.drain(..at + MESSAGE.len()).collect();
                self.body = body_of(&header);
                continue;
            }
            // A body: up to the first end marker, holding back what may become one.
            let end = ENDS
                .iter()
                .filter_map(|m| self.held.find(m).map(|i| (i, *m)))
                .min();
            let (upto, marker) = match end {
                Some((i, m)) => (i, Some(m)),
                None => {
                    let hold = ENDS
                        .iter()
                        .map(|m| crate::partial_suffix(&self.held, m))
                        .max()
                        .unwrap_or(0);
                    (self.held.len() - hold, None)
                }
            };
            let text: String = self.held.drain(..upto).collect();
            self.give(text, &mut out);
            match marker {
                // `<|start|>` opens the next message: it stays for the header.
                Some(m) if m == START => self.close(&mut out),
                Some(m) => {
                    self.held.drain(..m.len());
                    self.close(&mut out);
                }
                None => break,
            }
        }
        out
    }

    /// What is left when the answer ends (a call's `<|call|>` is a stop token: its body ends here).
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        match self.body {
            Body::Header if !rest.trim().is_empty() => {
                // A header that never reached its body: text.
                out.push(Part::Piece(Piece::Text(rest)));
            }
            Body::Header => {}
            _ => {
                self.give(rest, &mut out);
                self.close(&mut out);
            }
        }
        out
    }

    fn give(&mut self, text: String, out: &mut Vec<Part>) {
        if text.is_empty() {
            return;
        }
        match &self.body {
            Body::Reasoning => out.push(Part::Reasoning(text)),
            Body::Text => out.push(Part::Piece(Piece::Text(text))),
            Body::Call(_) => self.arguments.push_str(&text),
            Body::Header => {}
        }
    }

    /// The message ends: a call is read (one that is not a JSON object comes back as text).
    fn close(&mut self, out: &mut Vec<Part>) {
        if let Body::Call(name) = std::mem::replace(&mut self.body, Body::Header) {
            let args = std::mem::take(&mut self.arguments);
            match serde_json::from_str::<Value>(args.trim()) {
                Ok(arguments @ Value::Object(_)) => {
                    out.push(Part::Piece(Piece::Call(Call { name, arguments })))
                }
                _ => out.push(Part::Piece(Piece::Text(args))),
            }
        }
    }
}

/// What a header (`<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json
/// <|message|>`) says its body is.
fn body_of(header: &str) -> Body {
    let channel = header
        .split(CHANNEL)
        .nth(1)
        .and_then(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next())
        .unwrap_or("final");
    let recipient = header
        .split("to=")
        .nth(1)
        .and_then(|r| r.split(|ch: char| ch.is_whitespace() || ch == '<').next());
    match (
        channel,
        recipient.and_then(|r| r.strip_prefix("functions.")),
    ) {
        (_, Some(name)) => Body::Call(name.to_string()),
        ("analysis", _) => Body::Reasoning,
        _ => Body::Text,
    }
}

/// A whole Harmony answer's text for the client's side of a conversation: its answer (final
/// channel, or text without a header), not its reasoning or its calls — what a chat keeps as the
/// assistant's turn (the template writes the turn's channels back itself).
pub fn final_text(answer: &str) -> String {
    let mut c = Channels::new();
    let mut parts = c.push(answer);
    parts.extend(c.finish());
    parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Piece(Piece::Text(t)) => Some(t),
            _ => None,
        })
        .collect()
}

/// The Harmony row's reader, for calls met outside a Harmony stream (not used by the server,
/// which reads Harmony answers whole with [`Channels`]).
pub fn read(text: &str) -> Result<Vec<Call>, String> {
    let mut c = Channels::new();
    let mut parts = c.push(&format!("<|channel|>commentary to=functions.{text}"));
    parts.extend(c.finish());
    let calls: Vec<Call> = parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Piece(Piece::Call(call)) => Some(call),
            _ => None,
        })
        .collect();
    if calls.is_empty() {
        return Err("no call".into());
    }
    Ok(calls)
}

/// Whether `format` is this one.
pub fn is(format: &Format) -> bool {
    format.name == "harmony"
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read_all(pieces: &[&str]) -> Vec<Part> {
        let mut c = Channels::new();
        let mut out = Vec::new();
        for p in pieces {
            out.extend(c.push(p));
        }
        out.extend(c.finish());
        // Adjacent pieces of one kind joined, as a client would show them.
        let mut joined: Vec<Part> = Vec::new();
        for p in out {
            match (joined.last_mut(), p) {
                (Some(Part::Reasoning(a)), Part::Reasoning(b)) => a.push_str(&b),
                (Some(Part::Piece(Piece::Text(a))), Part::Piece(Piece::Text(b))) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    #[test]
    fn analysis_is_reasoning_and_final_is_the_answer_however_the_text_is_cut() {
        let whole = "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.";
        let want = vec![
            Part::Reasoning("User asks 2+2. Answer 4.".into()),
            Part::Piece(Piece::Text("2 + 2 = 4.".into())),
        ];
        assert_eq!(read_all(&[whole]), want);
        let bytes: Vec<String> = whole.chars().map(String::from).collect();
        let pieces: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(read_all(&pieces), want, "one character at a time");
    }

    #[test]
    fn a_commentary_message_to_a_function_is_a_call_in_either_header_order() {
        let want = Part::Piece(Piece::Call(Call {
            name: "get_weather".into(),
            arguments: json!({"city": "Paris"}),
        }));
        let a = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";
        assert_eq!(read_all(&[a])[1], want);
        let b = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}";
        assert_eq!(read_all(&[b]), vec![want]);
    }

    #[test]
    fn text_without_a_header_is_the_answer_and_a_call_that_is_not_json_is_text() {
        assert_eq!(
            read_all(&["Hello there"]),
            vec![Part::Piece(Piece::Text("Hello there".into()))]
        );
        let bad = "<|channel|>commentary to=functions.f<|message|>{oops";
        assert_eq!(
            read_all(&[bad]),
            vec![Part::Piece(Piece::Text("{oops".into()))]
        );
    }

    #[test]
    fn a_chat_keeps_only_the_final_answer_of_a_turn() {
        let whole = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.";
        assert_eq!(final_text(whole), "Paris.");
    }

    #[test]
    fn a_template_speaks_harmony_when_it_has_channels_and_messages() {
        assert!(is_harmony(
            "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
        ));
        assert!(!is_harmony("<|im_start|>assistant"));
    }
}
