//! An answer's text on its way to its client, watched for stop texts: decoded text that may be
//! the start of a stop text is held until it cannot be; a stop text ends the answer before it.

use super::Event;
use crate::tokenizer::TextStream;
use tokio::sync::mpsc::UnboundedSender;

/// An answer's text on its way to the client.
pub(super) struct Text {
    pub first_token: bool,
    pub stream: TextStream,
    /// Decoded text not sent yet: it may be the start of a stop text.
    pub held: String,
    /// The stop text that ended the answer.
    pub stopped_by: Option<String>,
}

impl Text {
    /// `keep_special`: control tokens' text is part of it ([`TextStream::keeping_special`]).
    pub fn new(keep_special: bool) -> Self {
        Self {
            first_token: false,
            stream: match keep_special {
                true => TextStream::keeping_special(),
                false => TextStream::new(),
            },
            held: String::new(),
            stopped_by: None,
        }
    }

    /// Adds decoded text; sends to `events` what cannot be part of one of the `stop` texts. True
    /// when a stop text appeared: what precedes it is sent and the answer ends there.
    pub fn push(&mut self, text: &str, stop: &[String], events: &UnboundedSender<Event>) -> bool {
        self.held.push_str(text);
        let first = stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, s)) = first {
            self.stopped_by = Some(s.clone());
            self.held.truncate(at);
            if !self.held.is_empty() {
                let _ = events.send(Event::Text(std::mem::take(&mut self.held)));
            }
            return true;
        }
        let keep = stop
            .iter()
            .map(|s| crate::partial_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let send = self.held.len() - keep;
        if send > 0 {
            let rest = self.held.split_off(send);
            let _ = events.send(Event::Text(std::mem::replace(&mut self.held, rest)));
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text on its way, with `stop` texts, and what its client receives.
    struct Client {
        text: Text,
        stop: Vec<String>,
        events: UnboundedSender<Event>,
    }

    impl Client {
        fn push_text(&mut self, text: &str) -> bool {
            self.text.push(text, &self.stop, &self.events)
        }
    }

    fn live(stop: &[&str]) -> (Client, tokio::sync::mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (
            Client {
                text: Text::new(false),
                stop: stop.iter().map(|s| s.to_string()).collect(),
                events: tx,
            },
            rx,
        )
    }

    fn sent(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> String {
        let mut s = String::new();
        while let Ok(Event::Text(t)) = rx.try_recv() {
            s.push_str(&t);
        }
        s
    }

    #[test]
    fn text_that_may_start_a_stop_text_is_held_until_it_cannot() {
        let (mut l, mut rx) = live(&["END"]);
        assert!(!l.push_text("one E"));
        assert_eq!(sent(&mut rx), "one ");
        assert!(!l.push_text("Nx"));
        assert_eq!(sent(&mut rx), "ENx");
    }

    #[test]
    fn a_stop_text_split_across_tokens_ends_the_answer_before_it() {
        let (mut l, mut rx) = live(&["\n\n", "END"]);
        assert!(!l.push_text("two E"));
        assert!(l.push_text("ND three"));
        assert_eq!(sent(&mut rx), "two ");
    }

    #[test]
    fn the_partial_suffix_never_splits_a_character() {
        assert_eq!(crate::partial_suffix("caf\u{e9}", "\u{e9}t\u{e9}"), 2);
        assert_eq!(crate::partial_suffix("abc", "xyz"), 0);
    }
}
