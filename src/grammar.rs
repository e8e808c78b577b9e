//! Constrained decoding: the tokens a grammar allows next, so that an answer is always JSON of a
//! schema, a Lark grammar's sentence, or a tool call that parses. The grammar engine is
//! llguidance (what llama.cpp and mistral.rs use): it compiles JSON schemas and Lark grammars and
//! computes a token mask per step over a trie of the vocabulary's bytes.
//!
//! One [`Grammars`] per model (its vocabulary's trie, built on first use); one [`Constraint`] per
//! answer. A constraint computes the mask for the next token on its own thread as soon as a token
//! is committed, so the mask is ready while the model's forward pass for that token runs.

use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The most bytes a schema or grammar's text may have (a 50-field schema is ~5 KB).
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// What an answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// A Lark grammar as llguidance reads it (`%json {…}` embeds a schema; `<[ID]>` is a token).
    Lark(String),
}

impl Grammar {
    /// The JSON written the way models write it: ", " and ": " between items, no other
    /// whitespace (a grammar that allows any whitespace lets a small model loop on newlines).
    fn json_options() -> Value {
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
    }

    fn top_level(&self) -> Result<TopLevelGrammar> {
        let text_len = match self {
            Grammar::JsonObject => 0,
            Grammar::JsonSchema(s) => serde_json::to_string(s)?.len(),
            Grammar::Lark(g) => g.len(),
        };
        if text_len > MAX_GRAMMAR_BYTES {
            bail!("it has {text_len} bytes, more than the {MAX_GRAMMAR_BYTES} allowed");
        }
        if let Grammar::JsonSchema(s) = self {
            if let Some(r) = endless_ref(s) {
                bail!("the schema has no finite value: every value of it nests another through '$ref': '{r}' without end");
            }
        }
        Ok(match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_options(json!({"type": "object"})))
            }
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_options(s.clone())),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// A `$ref` through which every value of `schema` must nest again without end (a required
/// property that refers back to its own object, say), if there is one: such a schema has no
/// finite value, and an answer held to it could only end by running out of tokens. Only local
/// references (`#/…`) are followed; a schema too large to walk within a budget of steps is left
/// to the grammar engine's own limits.
pub fn endless_ref(schema: &Value) -> Option<String> {
    let mut walk = Walk {
        root: schema,
        stack: Vec::new(),
        steps: 100_000,
        culprit: None,
    };
    if walk.finite(schema) {
        None
    } else {
        walk.culprit
    }
}

struct Walk<'a> {
    root: &'a Value,
    /// The references being followed, outermost first.
    stack: Vec<&'a str>,
    steps: usize,
    culprit: Option<String>,
}

impl<'a> Walk<'a> {
    /// Whether `s` has a finite value (true where unsure).
    fn finite(&mut self, s: &'a Value) -> bool {
        if self.steps == 0 {
            return true;
        }
        self.steps -= 1;
        let m = match s {
            Value::Bool(b) => return *b,
            Value::Object(m) => m,
            _ => return true,
        };
        if let Some(r) = m.get("$ref").and_then(Value::as_str) {
            if self.stack.contains(&r) {
                self.culprit.get_or_insert_with(|| r.to_string());
                return false;
            }
            if let Some(target) = r.strip_prefix('#').and_then(|p| self.root.pointer(p)) {
                self.stack.push(r);
                let ok = self.finite(target);
                self.stack.pop();
                if !ok {
                    return false;
                }
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(alts)) = m.get(key) {
                if !alts.iter().any(|a| self.finite(a)) {
                    return false;
                }
            }
        }
        if let Some(Value::Array(all)) = m.get("allOf") {
            if !all.iter().all(|a| self.finite(a)) {
                return false;
            }
        }
        // A type list with a scalar in it ("null", "string") always has a finite value.
        let types: Vec<&str> = match m.get("type") {
            Some(Value::String(t)) => vec![t],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if types.iter().any(|t| *t != "object" && *t != "array") {
            return true;
        }
        let props = m.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = m.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                let p = props
                    .and_then(|p| p.get(name))
                    .or_else(|| m.get("additionalProperties"));
                if let Some(p) = p {
                    if !self.finite(p) {
                        return false;
                    }
                }
            }
        }
        let least = m.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        if least > 0 {
            if let Some(items) = m.get("items") {
                if !self.finite(items) {
                    return false;
                }
            }
        }
        true
    }
}

/// The schema with kvchat's JSON layout, unless it sets its own (`x-guidance`).
fn with_options(schema: Value) -> Value {
    match schema {
        Value::Object(mut m) => {
            m.entry("x-guidance").or_insert_with(Grammar::json_options);
            Value::Object(m)
        }
        // `true`, `false`: the JSON compiler reads them as schemas too.
        other => other,
    }
}

/// A model's vocabulary as the grammar engine reads it.
pub struct Grammars {
    factory: ParserFactory,
    end: u32,
}

impl Grammars {
    /// The vocabulary of `tokenizer`, padded to the `logits` rows the model computes (rows past
    /// the vocabulary are never allowed); `end` is the token that ends an answer.
    pub fn new(tokenizer: &Tokenizer, logits: usize, end: u32) -> Result<Self> {
        let mut words = tokenizer.token_bytes();
        words.resize(words.len().max(logits), Vec::new());
        Self::from_words(&words, end)
    }

    /// A vocabulary given as each token's bytes (a control token's after [`CONTROL_MARK`]).
    ///
    /// [`CONTROL_MARK`]: crate::tokenizer::CONTROL_MARK
    pub fn from_words(words: &[Vec<u8>], end: u32) -> Result<Self> {
        let info = TokRxInfo::new(words.len() as u32, end);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, words)));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| anyhow!("the grammar engine could not read the vocabulary: {e}"))?;
        factory.quiet();
        Ok(Self { factory, end })
    }

    /// The one token whose text is `text` (a control token's too), if there is one.
    pub fn token_of(&self, text: &str) -> Option<u32> {
        let trie = self.factory.tok_env().tok_trie();
        trie.token_id_at_bytes(text.as_bytes())
            .or_else(|| self.control_token(text))
    }

    /// The control token whose text is `text` (its bytes after the mark), if there is one.
    fn control_token(&self, text: &str) -> Option<u32> {
        let mut marked = vec![crate::tokenizer::CONTROL_MARK];
        marked.extend_from_slice(text.as_bytes());
        self.factory.tok_env().tok_trie().token_id_at_bytes(&marked)
    }

    /// `text` as a Lark term: the control token it is (`<[ID]>`, which no string literal
    /// matches), else a string literal.
    pub fn term(&self, text: &str) -> String {
        match self.control_token(text) {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(text).unwrap_or_default(),
        }
    }

    /// A constraint that starts at once; an error says what in the grammar cannot be honoured
    /// (a keyword, a size, a syntax error), for the user.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        let matcher = self.matcher(grammar)?;
        Constraint::started(matcher, self.end)
    }

    /// A constraint that starts only when the model writes `trigger` (a tool call's opening
    /// token), constrains what follows up to the grammar's end, then waits for the next one.
    pub fn compile_lazy(&self, grammar: &Grammar, trigger: u32) -> Result<Constraint> {
        let matcher = self.matcher(grammar)?;
        // Compiled and checked now, so that a bad grammar is refused before the answer starts.
        let mut first = matcher.clone();
        mask_of(&mut first)?;
        Ok(Constraint {
            state: State::Waiting,
            end: self.end,
            lazy: Some((trigger, Box::new(matcher))),
        })
    }

    fn matcher(&self, grammar: &Grammar) -> Result<Matcher> {
        let top = grammar.top_level()?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| anyhow!("{e}"))?;
        Ok(Matcher::new(Ok(parser)))
    }
}

fn mask_of(m: &mut Matcher) -> Result<SimpleVob> {
    let mask = m.compute_mask_or_eos().map_err(|e| anyhow!("{e}"))?;
    if let Some(e) = m.get_error() {
        bail!("{e}");
    }
    Ok(mask)
}

/// A grammar that failed while its answer was generated (its engine's limits, a dead end): the
/// request's grammar is at fault, not the model; a server fails that answer alone, as a 4xx.
#[derive(Debug)]
pub struct GrammarFailed(pub String);

impl std::fmt::Display for GrammarFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the answer's grammar failed: {}", self.0)
    }
}

impl std::error::Error for GrammarFailed {}

fn failed(e: anyhow::Error) -> anyhow::Error {
    match e.downcast::<GrammarFailed>() {
        Ok(g) => g.into(),
        Err(e) => GrammarFailed(crate::first_line(e)).into(),
    }
}

/// Which tokens an answer may take next, step by step.
pub struct Constraint {
    state: State,
    /// The token that ends the answer: allowed where the grammar is complete, never consumed.
    end: u32,
    /// For a lazy constraint: the token that starts it, and its grammar unstarted.
    lazy: Option<(u32, Box<Matcher>)>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Ready(..) => "ready",
            State::Computing(_) => "computing",
            State::Waiting => "waiting for its trigger",
            State::Empty => "failed",
        };
        write!(f, "Constraint({state})")
    }
}

enum State {
    /// The mask for the next token is known.
    Ready(Box<Matcher>, SimpleVob),
    /// It is being computed on its own thread.
    Computing(JoinHandle<(Box<Matcher>, Result<SimpleVob>)>),
    /// A lazy constraint before its trigger: every token is allowed.
    Waiting,
    /// Taken while it changes.
    Empty,
}

impl Constraint {
    fn started(mut matcher: Matcher, end: u32) -> Result<Self> {
        let mask = mask_of(&mut matcher)?;
        Ok(Self {
            state: State::Ready(Box::new(matcher), mask),
            end,
            lazy: None,
        })
    }

    /// Sets the logit of every token the grammar does not allow next to −∞. An error (a
    /// [`GrammarFailed`]): the grammar allows no token (a dead end) or its engine failed.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        self.apply_inner(logits).map_err(failed)
    }

    fn apply_inner(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = match self.ready()? {
            Some(mask) => mask,
            None => return Ok(()),
        };
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if mask.is_allowed(i as u32) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            bail!("the grammar allows no token here");
        }
        Ok(())
    }

    /// The mask for the next token, waiting for its thread if it is still at work; None while a
    /// lazy constraint waits for its trigger.
    fn ready(&mut self) -> Result<Option<&SimpleVob>> {
        if let State::Computing(_) = self.state {
            let State::Computing(handle) = std::mem::replace(&mut self.state, State::Empty) else {
                unreachable!("matched above")
            };
            let (matcher, mask) = handle
                .join()
                .map_err(|_| anyhow!("the grammar engine failed"))?;
            self.state = State::Ready(matcher, mask?);
        }
        match &self.state {
            State::Ready(_, mask) => Ok(Some(mask)),
            State::Waiting => Ok(None),
            State::Computing(_) | State::Empty => bail!("the grammar engine failed earlier"),
        }
    }

    /// `token` was picked: the grammar moves past it, and the next mask starts computing. An
    /// error is a [`GrammarFailed`].
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.commit_inner(token).map_err(failed)
    }

    fn commit_inner(&mut self, token: u32) -> Result<()> {
        self.ready()?;
        if token == self.end {
            // The answer ends here (the grammar allowed it: it is complete, or not started).
            return Ok(());
        }
        let matcher = match std::mem::replace(&mut self.state, State::Empty) {
            State::Ready(mut m, _) => {
                m.consume_token(token)
                    .map_err(|e| anyhow!("the answer left its grammar: {e}"))?;
                if self.lazy.is_some() && m.is_stopped() {
                    // The call is complete: free text again until the next trigger.
                    self.state = State::Waiting;
                    return Ok(());
                }
                m
            }
            // A lazy constraint's trigger is not the grammar's: the grammar starts after it.
            State::Waiting => match &self.lazy {
                Some((trigger, unstarted)) if *trigger == token => unstarted.clone(),
                _ => {
                    self.state = State::Waiting;
                    return Ok(());
                }
            },
            State::Computing(_) | State::Empty => bail!("the grammar engine failed earlier"),
        };
        let mut matcher = matcher;
        self.state = State::Computing(std::thread::spawn(move || {
            let mask = mask_of(&mut matcher);
            (matcher, mask)
        }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of whole JSON pieces, two control tokens (a call's opening and the end) and
    /// some words.
    const WORDS: &[&[u8]] = &[
        b"{",
        b"}",
        b"\"",
        b"a",
        b"b",
        b": ",
        b", ",
        b"1",
        b"hello",
        b" ",
        b"\xff<call>",
        b"\xff<end>",
        b"[",
        b"]",
    ];
    const CALL: u32 = 10;
    const END: u32 = 11;

    fn grammars() -> Grammars {
        let words: Vec<Vec<u8>> = WORDS.iter().map(|w| w.to_vec()).collect();
        Grammars::from_words(&words, END).unwrap()
    }

    /// The tokens a constraint allows next.
    fn allowed(c: &mut Constraint) -> Vec<&'static str> {
        let mut logits = vec![0.0; WORDS.len()];
        c.apply(&mut logits).unwrap();
        (0..WORDS.len())
            .filter(|&i| logits[i] == 0.0)
            .map(|i| std::str::from_utf8(WORDS[i]).unwrap_or("<ctl>"))
            .collect()
    }

    fn feed(c: &mut Constraint, tokens: &[u32]) {
        for &t in tokens {
            c.commit(t).unwrap();
        }
    }

    fn schema(s: Value) -> Grammar {
        Grammar::JsonSchema(s)
    }

    #[test]
    fn a_schema_allows_only_what_can_start_its_value() {
        let mut c = grammars()
            .compile(&schema(json!({"type": "array"})))
            .unwrap();
        assert_eq!(allowed(&mut c), vec!["["]);
    }

    #[test]
    fn the_end_token_is_allowed_only_once_the_value_is_complete() {
        let g = schema(
            json!({"type": "object", "properties": {"a": {"type": "integer"}},
                               "required": ["a"], "additionalProperties": false}),
        );
        let mut c = grammars().compile(&g).unwrap();
        // {"a": 1}
        feed(&mut c, &[0, 2, 3, 2, 5, 7]);
        assert!(!allowed(&mut c).contains(&"<ctl>"));
        feed(&mut c, &[1]);
        assert_eq!(allowed(&mut c), vec!["<ctl>"], "only the end token");
        // The end is taken without complaint: the answer stops there.
        c.commit(END).unwrap();
    }

    #[test]
    fn a_lazy_constraint_is_free_until_its_trigger_then_holds_the_call_then_is_free_again() {
        let g = Grammar::Lark(r#"start: "{" "}""#.into());
        let mut c = grammars().compile_lazy(&g, CALL).unwrap();
        assert_eq!(
            allowed(&mut c).len(),
            WORDS.len(),
            "free before the trigger"
        );
        feed(&mut c, &[8, 9, CALL]);
        assert_eq!(allowed(&mut c), vec!["{"]);
        feed(&mut c, &[0, 1]);
        assert_eq!(allowed(&mut c).len(), WORDS.len(), "free after the call");
        feed(&mut c, &[CALL]);
        assert_eq!(allowed(&mut c), vec!["{"], "the next call is held too");
    }

    #[test]
    fn a_control_token_is_a_term_of_its_id_and_plain_text_a_literal() {
        let g = grammars();
        assert_eq!(g.term("<call>"), "<[10]>");
        assert_eq!(g.term("hello"), "\"hello\"");
        assert_eq!(g.token_of("<call>"), Some(CALL));
        assert_eq!(g.token_of("hello"), Some(8));
        assert_eq!(g.token_of("nope"), None);
    }

    #[test]
    fn a_schema_that_must_nest_without_end_is_refused_naming_its_ref() {
        let endless = json!({"type": "object", "properties": {"next": {"$ref": "#"}},
                             "required": ["next"]});
        let e = grammars()
            .compile(&schema(endless))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no finite value") && e.contains("'#'"), "{e}");
        // Through $defs, and through a list that must hold one.
        let list = json!({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                          "minItems": 1}}, "$ref": "#/$defs/n"});
        assert_eq!(endless_ref(&list).as_deref(), Some("#/$defs/n"));
    }

    #[test]
    fn a_recursive_schema_with_a_way_out_is_accepted() {
        let tree = json!({"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["a"]});
        assert_eq!(endless_ref(&tree), None);
        let optional = json!({"anyOf": [{"type": "null"},
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}]});
        assert_eq!(endless_ref(&optional), None);
        grammars().compile(&schema(tree)).unwrap();
    }

    #[test]
    fn a_schema_the_engine_cannot_honour_is_an_error_naming_the_part() {
        let e = grammars()
            .compile(&schema(json!({"type": "strin"})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("strin"), "{e}");
        let e = grammars()
            .compile(&schema(json!({"$ref": "#/$defs/missing"})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/$defs/missing"), "{e}");
    }

    #[test]
    fn a_grammar_over_the_size_cap_is_refused_before_it_is_compiled() {
        let big = Grammar::Lark(format!("start: \"{}\"", "a".repeat(MAX_GRAMMAR_BYTES)));
        let e = grammars().compile(&big).unwrap_err().to_string();
        assert!(e.contains("more than the"), "{e}");
    }
}
