//! Gemma's call syntax (FunctionGemma's `<start_function_call>call:NAME{…}<end_function_call>`,
//! Gemma 4's `<|tool_call>call:NAME{…}<tool_call|>`): `call:` and the function's name, then its
//! arguments as an object whose keys are bare and whose strings sit between a quote token
//! (`<escape>`, `<|"|>`) — `{location:<escape>Tokyo<escape>,days:3}` — read here into JSON.

use super::grammar::{parameters, Parts, Rules};
use super::Call;
use serde_json::{Map, Number, Value};

/// FunctionGemma's string quote.
pub const ESCAPE: &str = "<escape>";
/// Gemma 4's.
pub const QUOTE: &str = "<|\"|>";

/// A JSON schema as a Lark expression of Gemma's syntax for its values: objects with bare keys
/// (the required properties in the schema's order, then the optional ones, each optional), strings
/// between the quote token (`quote`: its Lark term) holding no `<`, numbers, booleans, `null`,
/// enums and consts of them, arrays, `anyOf`. None: a schema it cannot express (a `$ref`, a
/// pattern, nesting past 16), for which a call is read but not constrained.
pub fn lark_value(schema: &Value, quote: &str, depth: usize) -> Option<String> {
    if depth > 16 {
        return None;
    }
    let m = match schema {
        Value::Bool(true) => return Some(any_value(quote)),
        Value::Object(m) => m,
        _ => return None,
    };
    let literal = |v: &Value| -> Option<String> {
        match v {
            Value::String(s) if !s.contains('<') => Some(format!(
                "{quote} {} {quote}",
                serde_json::to_string(s).ok()?
            )),
            Value::Number(_) | Value::Bool(_) | Value::Null => {
                Some(serde_json::to_string(&v.to_string()).ok()?)
            }
            _ => None,
        }
    };
    if let Some(c) = m.get("const") {
        return literal(c);
    }
    if let Some(Value::Array(options)) = m.get("enum") {
        let alts = options.iter().map(literal).collect::<Option<Vec<_>>>()?;
        return Some(format!("({})", alts.join(" | ")));
    }
    if let Some(Value::Array(alts)) = m.get("anyOf").or_else(|| m.get("oneOf")) {
        let alts = alts
            .iter()
            .map(|a| lark_value(a, quote, depth + 1))
            .collect::<Option<Vec<_>>>()?;
        return Some(format!("({})", alts.join(" | ")));
    }
    if m.contains_key("$ref") || m.contains_key("pattern") || m.contains_key("allOf") {
        return None;
    }
    let number = r#"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"#;
    match m.get("type").and_then(Value::as_str) {
        Some("string") => Some(format!("{quote} /[^<]*/ {quote}")),
        Some("integer") => Some(r#"/-?(0|[1-9][0-9]*)/"#.to_string()),
        Some("number") => Some(number.to_string()),
        Some("boolean") => Some(r#"("true" | "false")"#.to_string()),
        Some("null") => Some(r#""null""#.to_string()),
        Some("array") => {
            let item = match m.get("items") {
                Some(i) => lark_value(i, quote, depth + 1)?,
                None => any_value(quote),
            };
            Some(format!(r#""[" ({item} ("," {item})*)? "]""#))
        }
        Some("object") | None if m.contains_key("properties") || m.get("type").is_some() => {
            let props = m.get("properties").and_then(Value::as_object);
            let required: Vec<&str> = m
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut fields = Vec::new();
            for (key, s) in props.into_iter().flatten() {
                if !key.chars().all(|c| c.is_alphanumeric() || c == '_') {
                    return None;
                }
                let v = lark_value(s, quote, depth + 1)?;
                fields.push((required.contains(&key.as_str()), format!(r#""{key}:" {v}"#)));
            }
            let (req, opt): (Vec<_>, Vec<_>) = fields.into_iter().partition(|(r, _)| *r);
            let body = if req.is_empty() {
                // No field is required: any of them, in any order (a repeated key is read as
                // its last value).
                let any: Vec<String> = opt.into_iter().map(|(_, f)| f).collect();
                if any.is_empty() {
                    String::new()
                } else {
                    let one = format!("({})", any.join(" | "));
                    format!(r#"({one} ("," {one})*)?"#)
                }
            } else {
                // The required ones in order, then each optional one after a comma.
                let mut parts: Vec<String> = req.into_iter().map(|(_, f)| f).collect();
                let first = parts.remove(0);
                let mut body = first;
                for f in parts {
                    body.push_str(&format!(r#" "," {f}"#));
                }
                for (_, f) in opt {
                    body.push_str(&format!(r#" ("," {f})?"#));
                }
                body
            };
            Some(format!(r#""{{" {body} "}}""#))
        }
        _ => None,
    }
}

/// Any value: a string, a number, a boolean or null (no nesting).
fn any_value(quote: &str) -> String {
    format!(r#"({quote} /[^<]*/ {quote} | /-?[0-9][0-9.eE+-]*/ | "true" | "false" | "null")"#)
}

/// A Gemma row's calls as Lark: `open` `call:NAME{…}` `close`, the arguments held to the
/// function's parameters in Gemma's syntax ([`lark_value`]); consecutive calls where parallel.
pub fn rules(p: &Parts, open: &str, close: &str, quote: &str) -> Option<Rules> {
    let t = p.term;
    let q = t(quote);
    let calls = p
        .tools
        .iter()
        .map(|tool| {
            let args = lark_value(&parameters(tool), &q, 0)?;
            Some(format!("{} {args}", t(&format!("call:{}", tool.name))))
        })
        .collect::<Option<Vec<_>>>()?;
    let after = format!("({}) {}", calls.join(" | "), t(close));
    let one = format!("{} {after}", t(open));
    Some(Rules {
        calls: p.repeated(&one, ""),
        after_open: Some(after),
    })
}

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

    /// An answer the grammar allows, over a toy vocabulary, reads back by [`read`] as a call
    /// whose arguments match the schema.
    #[test]
    fn a_functiongemma_grammar_holds_a_call_to_its_schema_and_reads_back() {
        use crate::grammar::{Grammar, Grammars};
        use crate::toolcall::grammar::Parts;
        use crate::toolcall::Tool;
        let words: Vec<Vec<u8>> = [
            &b"\xff<start_function_call>"[..],
            b"\xff<end_function_call>",
            b"\xff<escape>",
            b"call:get_weather",
            b"{",
            b"}",
            b"city:",
            b"days:",
            b",",
            b"Paris",
            b"3",
            b"x",
            b"\xff<eos>",
        ]
        .iter()
        .map(|w| w.to_vec())
        .collect();
        let g = Grammars::from_words(&words, 12).unwrap();
        let term = |t: &str| g.term(t);
        let tool = Tool {
            name: "get_weather".into(),
            description: None,
            parameters: json!({"type": "object", "required": ["city"],
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}),
        };
        let parts = Parts {
            tools: &[&tool],
            parallel: false,
            term: &term,
        };
        let r = rules(
            &parts,
            "<start_function_call>",
            "<end_function_call>",
            ESCAPE,
        )
        .unwrap();
        let lark = format!("start: {}\n", r.calls);
        let mut c = g.compile(&Grammar::Lark(lark)).unwrap();
        // Walk: the lowest-numbered allowed token, but "Paris" (a string's text) once.
        let mut out = Vec::new();
        for _ in 0..20 {
            let mut logits = vec![0.0f32; words.len()];
            c.apply(&mut logits).unwrap();
            let allowed: Vec<usize> = (0..words.len()).filter(|&i| logits[i] == 0.0).collect();
            let pick = if allowed.contains(&9) && !out.contains(&9) {
                9
            } else {
                allowed[0]
            };
            if pick == 12 {
                break;
            }
            out.push(pick);
            c.commit(pick as u32).unwrap();
        }
        let text: String = out
            .iter()
            .map(|&i| {
                String::from_utf8_lossy(words[i].strip_prefix(b"\xff").unwrap_or(&words[i]))
                    .to_string()
            })
            .collect();
        assert_eq!(
            text,
            "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>"
        );
        let inner = text
            .strip_prefix("<start_function_call>")
            .and_then(|t| t.strip_suffix("<end_function_call>"))
            .unwrap();
        assert_eq!(
            read(inner, ESCAPE).unwrap()[0].arguments,
            json!({"city": "Paris"})
        );
    }

    #[test]
    fn a_schema_gemmas_syntax_cannot_say_is_left_unconstrained() {
        let q = "<[7]>";
        assert_eq!(lark_value(&json!({"$ref": "#/$defs/x"}), q, 0), None);
        assert_eq!(
            lark_value(&json!({"type": "string", "pattern": "a+"}), q, 0),
            None
        );
        assert_eq!(
            lark_value(&json!({"enum": ["a", 2]}), q, 0).as_deref(),
            Some(r#"(<[7]> "a" <[7]> | "2")"#)
        );
        let none_required = json!({"type": "object", "properties": {"a": {"type": "boolean"}}});
        let g = lark_value(&none_required, q, 0).unwrap();
        assert!(g.starts_with(r#""{" (("a:" ("true" | "false"))"#), "{g}");
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
