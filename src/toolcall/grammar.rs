//! Tool calls as a grammar: what a request's `tool_choice` lets the model write, in its family's
//! format, as a Lark grammar for `crate::grammar` — so that under `required` or a named function
//! every call parses and its arguments match the function's parameter schema, and under `auto` a
//! call, once the model opens one, does too (a lazy grammar: llama.cpp's trigger words).

use super::{Choice, Format, Tool};
use crate::grammar::Grammar;
use serde_json::{json, Value};

/// How an answer is constrained.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Not at all.
    Free,
    /// From its first token.
    Whole(Grammar),
    /// Free until the model writes `trigger` (a format's opening); then `grammar` (what follows
    /// the opening, to the call's end), then free again.
    Lazy { grammar: Grammar, trigger: String },
}

/// A format's calls as Lark: `calls` is one or more whole calls; `after_open` what follows the
/// opening of one (None: the opening is part of the call, so no lazy grammar).
pub struct Rules {
    pub calls: String,
    pub after_open: Option<String>,
}

/// What a format's rules are made of.
pub struct Parts<'a> {
    pub tools: &'a [&'a Tool],
    pub parallel: bool,
    /// The Lark term for a fixed text (a literal, or the one token it is: `<[ID]>`).
    pub term: &'a dyn Fn(&str) -> String,
}

impl Parts<'_> {
    /// `%json{…}` of one call object `{"name": …, "arguments": {…}}`, any of the tools.
    pub fn call_json(&self) -> String {
        lark_json(&self.call_schema())
    }

    /// `%json{…}` of a list of call objects (one only, unless calls may be parallel).
    pub fn call_list_json(&self) -> String {
        let mut list = json!({"type": "array", "items": self.call_schema(), "minItems": 1});
        if !self.parallel {
            list["maxItems"] = json!(1);
        }
        lark_json(&list)
    }

    fn call_schema(&self) -> Value {
        let one = |t: &Tool| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        match self.tools {
            [t] => one(t),
            many => json!({"anyOf": many.iter().map(|t| one(t)).collect::<Vec<_>>()}),
        }
    }

    /// `one` once, or (parallel) one or more times separated by `sep`.
    pub fn repeated(&self, one: &str, sep: &str) -> String {
        if self.parallel {
            format!("{one} ({sep} {one})*")
        } else {
            one.to_string()
        }
    }
}

/// A tool's parameter schema; none given is any object.
pub fn parameters(t: &Tool) -> Value {
    match &t.parameters {
        Value::Object(m) if !m.is_empty() => t.parameters.clone(),
        _ => json!({"type": "object"}),
    }
}

pub fn lark_json(schema: &Value) -> String {
    format!("%json {schema}")
}

/// The plan for an answer: `format` is how the model writes calls (None: no tools offered),
/// `answer` what a text answer must be (`response_format`).
pub fn plan(
    format: Option<&Format>,
    tools: &[Tool],
    choice: &Choice,
    parallel: bool,
    answer: Option<&Grammar>,
    term: &dyn Fn(&str) -> String,
) -> Result<Plan, String> {
    let whole_answer = || answer.cloned().map_or(Plan::Free, Plan::Whole);
    let Some(format) = format.filter(|_| !tools.is_empty() && *choice != Choice::None) else {
        return Ok(whole_answer());
    };
    let callable: Vec<&Tool> = match choice {
        Choice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
        _ => tools.iter().collect(),
    };
    let parts = Parts {
        tools: &callable,
        parallel,
        term,
    };
    let Some(rules) = (format.grammar)(&parts) else {
        return match choice {
            Choice::Auto => Ok(whole_answer()),
            _ => Err(format!(
                "kvchat cannot constrain the {} tool-call format: use tool_choice auto",
                format.name
            )),
        };
    };
    let calls = format!("calls: {}\n", rules.calls);
    Ok(match (choice, answer) {
        (Choice::Required | Choice::Named(_), _) => {
            Plan::Whole(Grammar::Lark(format!("start: calls\n{calls}")))
        }
        (_, Some(a)) => Plan::Whole(Grammar::Lark(format!(
            "start: calls | answer\n{calls}answer: {}\n",
            answer_term(a)?
        ))),
        (_, None) => match rules.after_open {
            Some(after) => Plan::Lazy {
                grammar: Grammar::Lark(format!("start: {after}\n")),
                trigger: format.open.to_string(),
            },
            None => Plan::Free,
        },
    })
}

/// A `response_format` as a Lark term beside the calls.
fn answer_term(a: &Grammar) -> Result<String, String> {
    match a {
        Grammar::JsonObject => Ok(lark_json(&json!({"type": "object"}))),
        Grammar::JsonSchema(s) => Ok(lark_json(s)),
        Grammar::Lark(_) => Err("a Lark grammar cannot stand beside tool calls".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::toolcall::FORMATS;

    fn tool(name: &str) -> Tool {
        Tool {
            name: name.into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        }
    }

    fn hermes() -> &'static Format {
        FORMATS.iter().find(|f| f.name == "hermes").unwrap()
    }

    fn literal(s: &str) -> String {
        serde_json::to_string(s).unwrap()
    }

    #[test]
    fn required_constrains_the_whole_answer_to_calls_of_the_offered_tools() {
        let tools = [tool("weather"), tool("time")];
        let Plan::Whole(Grammar::Lark(g)) = plan(
            Some(hermes()),
            &tools,
            &Choice::Required,
            true,
            None,
            &literal,
        )
        .unwrap() else {
            panic!("not a whole grammar")
        };
        assert!(g.starts_with("start: calls\n"), "{g}");
        assert!(g.contains("\"<tool_call>\""), "{g}");
        assert!(
            g.contains(r#""const":"weather""#) && g.contains(r#""const":"time""#),
            "{g}"
        );
    }

    #[test]
    fn a_named_function_leaves_the_other_tools_out() {
        let tools = [tool("weather"), tool("time")];
        let choice = Choice::Named("time".into());
        let Plan::Whole(Grammar::Lark(g)) =
            plan(Some(hermes()), &tools, &choice, false, None, &literal).unwrap()
        else {
            panic!("not a whole grammar")
        };
        assert!(!g.contains("weather"), "{g}");
    }

    #[test]
    fn auto_is_lazy_from_the_formats_opening() {
        let tools = [tool("weather")];
        let p = plan(Some(hermes()), &tools, &Choice::Auto, true, None, &literal).unwrap();
        let Plan::Lazy {
            grammar: Grammar::Lark(g),
            trigger,
        } = p
        else {
            panic!("not lazy: {p:?}")
        };
        assert_eq!(trigger, "<tool_call>");
        assert!(g.starts_with("start: \"\\n\" %json"), "{g}");
    }

    #[test]
    fn auto_with_a_response_format_allows_calls_or_the_answer() {
        let tools = [tool("weather")];
        let answer = Grammar::JsonObject;
        let Plan::Whole(Grammar::Lark(g)) = plan(
            Some(hermes()),
            &tools,
            &Choice::Auto,
            true,
            Some(&answer),
            &literal,
        )
        .unwrap() else {
            panic!("not a whole grammar")
        };
        assert!(g.starts_with("start: calls | answer\n"), "{g}");
    }

    #[test]
    fn no_tools_or_tool_choice_none_leaves_only_the_response_format() {
        let answer = Grammar::JsonObject;
        let none = plan(
            Some(hermes()),
            &[tool("w")],
            &Choice::None,
            true,
            Some(&answer),
            &literal,
        );
        assert_eq!(none.unwrap(), Plan::Whole(Grammar::JsonObject));
        assert_eq!(
            plan(None, &[], &Choice::Auto, true, None, &literal).unwrap(),
            Plan::Free
        );
    }
}
