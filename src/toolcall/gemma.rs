//! Gemma's call syntax (FunctionGemma's `<start_function_call>call:NAME{…}<end_function_call>`,
//! Gemma 4's `<|tool_call>call:NAME{…}<tool_call|>`): `call:` and the function's name, then its
//! arguments as an object whose keys are bare and whose strings sit between a quote token
//! (`<escape>`, `<|"|>`) — `{location:<escape>Tokyo<escape>,days:3}` — read here into JSON.

use super::Call;
use serde_json::{Map, Number, Value};

/// FunctionGemma's string quote.
pub const ESCAPE: &str = "<escape>";
/// Gemma 4's.
pub const QUOTE: &str = "<|\"|>";

/// The calls between one opening and its closing: `call:NAME{…}` (one or more).
pub fn read(text: &str, quote: &str) -> Result<Vec<Call>, String> {
    let mut rest = text.trim();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let body = rest
            .strip_prefix("call:")
            .ok_or("a call that does not start with call:NAME")?;
        let brace = body.find('{').ok_or("a call without its {arguments}")?;
        let name = body[..brace].trim();
        if name.is_empty() {
            return Err("a call without a function name".into());
        }
        let mut r = Reader {
            text: &body[brace..],
            quote,
        };
        let arguments = r.value(0)?;
        calls.push(Call {
            name: name.to_string(),
            arguments,
        });
        rest = r.text.trim_start().trim_start_matches(',').trim_start();
    }
    if calls.is_empty() {
        return Err("no call".into());
    }
    Ok(calls)
}

/// The most nesting read (an object in an array in …): past it, the call is refused.
const MAX_DEPTH: usize = 64;

struct Reader<'a> {
    text: &'a str,
    quote: &'a str,
}

impl Reader<'_> {
    fn value(&mut self, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("arguments nested too deep".into());
        }
        self.text = self.text.trim_start();
        if let Some(s) = self.text.strip_prefix(self.quote) {
            let end = s.find(self.quote).ok_or("an unclosed string")?;
            self.text = &s[end + self.quote.len()..];
            return Ok(Value::String(s[..end].to_string()));
        }
        if let Some(s) = self.text.strip_prefix('{') {
            self.text = s;
            let mut m = Map::new();
            loop {
                self.text = self.text.trim_start();
                if let Some(s) = self.text.strip_prefix('}') {
                    self.text = s;
                    return Ok(Value::Object(m));
                }
                let colon = self.text.find(':').ok_or("a key without ':'")?;
                let key = self.text[..colon].trim();
                let key = key
                    .strip_prefix(self.quote)
                    .and_then(|k| k.strip_suffix(self.quote))
                    .unwrap_or(key);
                self.text = &self.text[colon + 1..];
                let v = self.value(depth + 1)?;
                m.insert(key.to_string(), v);
                self.separator('}')?;
            }
        }
        if let Some(s) = self.text.strip_prefix('[') {
            self.text = s;
            let mut items = Vec::new();
            loop {
                self.text = self.text.trim_start();
                if let Some(s) = self.text.strip_prefix(']') {
                    self.text = s;
                    return Ok(Value::Array(items));
                }
                items.push(self.value(depth + 1)?);
                self.separator(']')?;
            }
        }
        // A bare word: a number, true, false or null.
        let end = self.text.find([',', '}', ']']).unwrap_or(self.text.len());
        let word = self.text[..end].trim();
        self.text = &self.text[end..];
        match word {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            "null" => Ok(Value::Null),
            _ => word
                .parse::<i64>()
                .map(Value::from)
                .ok()
                .or_else(|| {
                    word.parse::<f64>()
                        .ok()
                        .and_then(Number::from_f64)
                        .map(Value::Number)
                })
                .ok_or_else(|| format!("'{word}' is not a value")),
        }
    }

    /// After an item: `,` (another follows) or the closing (left for the caller).
    fn separator(&mut self, close: char) -> Result<(), String> {
        self.text = self.text.trim_start();
        if let Some(s) = self.text.strip_prefix(',') {
            self.text = s;
            Ok(())
        } else if self.text.starts_with(close) {
            Ok(())
        } else {
            Err(format!("expected ',' or '{close}'"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_functiongemma_call_reads_as_json_arguments() {
        let calls = read(
            "call:get_weather{location:<escape>Tokyo, Japan<escape>,days:3,metric:true}",
            ESCAPE,
        )
        .unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            calls[0].arguments,
            json!({"location": "Tokyo, Japan", "days": 3, "metric": true})
        );
    }

    #[test]
    fn gemma_4_quotes_strings_with_its_own_token_and_nests_lists_and_objects() {
        let calls = read(
            "call:plan{stops:[<|\"|>Paris<|\"|>,<|\"|>Rome<|\"|>],budget:{eur:1.5e3}}",
            QUOTE,
        )
        .unwrap();
        assert_eq!(
            calls[0].arguments,
            json!({"stops": ["Paris", "Rome"], "budget": {"eur": 1500.0}})
        );
    }

    #[test]
    fn a_string_keeps_braces_and_commas_between_its_quotes() {
        let calls = read("call:say{text:<escape>a, {b}: c<escape>}", ESCAPE).unwrap();
        assert_eq!(calls[0].arguments, json!({"text": "a, {b}: c"}));
    }

    #[test]
    fn a_streamed_functiongemma_answer_gives_its_call_apart_from_its_text() {
        use crate::toolcall::{Piece, Scanner, FORMATS};
        let row = FORMATS.iter().find(|f| f.name == "functiongemma").unwrap();
        let mut s = Scanner::new(row);
        let mut pieces = Vec::new();
        for part in [
            "<start_function",
            "_call>call:get_weather{location:",
            "<escape>Paris<escape>}",
            "<end_function_call>",
        ] {
            pieces.extend(s.push(part));
        }
        pieces.extend(s.finish().0);
        assert_eq!(
            pieces,
            vec![Piece::Call(Call {
                name: "get_weather".into(),
                arguments: json!({"location": "Paris"})
            })]
        );
    }

    #[test]
    fn broken_calls_are_errors_not_guesses() {
        for bad in [
            "get_weather{}",
            "call:{x:1}",
            "call:f{x:<escape>open}",
            "call:f{x:1 y:2}",
            "call:f{x:what}",
        ] {
            assert!(read(bad, ESCAPE).is_err(), "{bad}");
        }
    }
}
