//! The tools of a chat request — OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and
//! the assistant `tool_calls` and `tool` messages of the conversation so far — read and checked;
//! and an answer's calls written back in OpenAI's shapes (`message.tool_calls`, streamed
//! `delta.tool_calls`). Which format the model writes calls in, and reading them out of its text,
//! is `crate::toolcall`'s.

use super::api::ApiError;
use crate::template::{Message, ToolCall};
use crate::toolcall::{Call, Choice, Tool};
use serde_json::{json, Map, Value};

/// The most tools a request may offer.
pub const MAX_TOOLS: usize = 128;
/// The largest parameters schema of one tool, as JSON.
pub const MAX_SCHEMA_BYTES: usize = 64 << 10;

/// The tools a chat request offers, and how the model may use them.
#[derive(Debug, Clone, PartialEq)]
pub struct Offered {
    pub tools: Vec<Tool>,
    pub choice: Choice,
    /// Whether more than one call may be returned (`parallel_tool_calls`, true by default).
    pub parallel: bool,
}

impl Default for Offered {
    fn default() -> Self {
        Self {
            tools: Vec::new(),
            choice: Choice::Auto,
            parallel: true,
        }
    }
}

impl Offered {
    /// Whether the answer's calls are to be read out of it.
    pub fn reads_calls(&self) -> bool {
        !self.tools.is_empty() && self.choice != Choice::None
    }
}

/// The calls of an answer as they are read out of it, and how many were given to the client.
pub struct Calls {
    pub scanner: crate::toolcall::Scanner,
    /// Whether more than one call may be given (`parallel_tool_calls`); past the first, calls are
    /// dropped where not.
    parallel: bool,
    pub given: usize,
}

impl Calls {
    pub fn new(format: &'static crate::toolcall::Format, parallel: bool) -> Self {
        Self {
            scanner: crate::toolcall::Scanner::new(format),
            parallel,
            given: 0,
        }
    }

    /// The number (from 1) of the call just read, if it may be given: None past the one call a
    /// request without parallel calls gets.
    pub fn take(&mut self) -> Option<usize> {
        if !self.parallel && self.given > 0 {
            return None;
        }
        self.given += 1;
        Some(self.given)
    }

    /// `tool_calls` where a call was given, else why the answer ended.
    pub fn finish_reason(&self, reason: crate::session::StopReason) -> &'static str {
        if self.given > 0 {
            "tool_calls"
        } else {
            super::api::finish_reason(reason)
        }
    }
}

/// A function name as OpenAI allows it: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`.
pub fn read(obj: &Map<String, Value>) -> Result<Offered, ApiError> {
    if obj.get("functions").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::field(
            "functions",
            "'functions' is OpenAI's deprecated form: send 'tools' ([{\"type\": \"function\", \"function\": {...}}])",
        ));
    }
    let mut offered = Offered::default();
    match obj.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.len() > MAX_TOOLS => {
            return Err(ApiError::field(
                "tools",
                format!(
                    "'tools' holds {} tools, more than the {MAX_TOOLS} kvchat serve takes",
                    a.len()
                ),
            ))
        }
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                let tool = read_tool(i, t)?;
                if offered.tools.iter().any(|o| o.name == tool.name) {
                    return Err(ApiError::field(
                        &format!("tools[{i}]"),
                        format!("tools[{i}]: a second tool named '{}'", tool.name),
                    ));
                }
                offered.tools.push(tool);
            }
        }
        Some(_) => return Err(ApiError::field("tools", "'tools' must be an array")),
    }
    offered.choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(ApiError::field(
                    "tool_choice",
                    format!("'tool_choice' '{other}' is not none, auto, required or a function"),
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::field(
                        "tool_choice",
                        "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !offered.tools.iter().any(|t| t.name == name) {
                return Err(ApiError::field(
                    "tool_choice",
                    format!("'tool_choice' names '{name}', which is not among the tools"),
                ));
            }
            Choice::Named(name.to_string())
        }
    };
    if offered.tools.is_empty() && matches!(offered.choice, Choice::Required | Choice::Named(_)) {
        return Err(ApiError::field(
            "tool_choice",
            "'tool_choice' asks for a call, but the request offers no tools",
        ));
    }
    offered.parallel = match obj.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::field(
                "parallel_tool_calls",
                "'parallel_tool_calls' must be true or false",
            ))
        }
    };
    Ok(offered)
}

/// One entry of `tools`: `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}`.
fn read_tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let param = format!("tools[{i}]");
    let bad = |why: &str| ApiError::field(&param, format!("{param}: {why}"));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("only tools of type 'function' are supported"));
    }
    let f = t
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("needs a 'function' object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("needs a function 'name'"))?;
    if !valid_name(name) {
        return Err(bad(&format!(
            "the function name '{}' must be 1 to 64 letters, digits, '_' or '-'",
            crate::template::one_line(name, 40)
        )));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return Err(bad("'description' must be a string")),
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(bad("'parameters' must be a JSON schema object")),
    };
    let size = parameters.to_string().len();
    if size > MAX_SCHEMA_BYTES {
        return Err(bad(&format!(
            "its parameters schema is {size} bytes, more than the {} KiB kvchat serve takes",
            MAX_SCHEMA_BYTES >> 10
        )));
    }
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
    })
}

/// An assistant message's `tool_calls`, as the conversation so far gives them (arguments as a
/// JSON string holding an object).
pub fn read_calls(param: &str, v: &Value) -> Result<Vec<ToolCall>, ApiError> {
    let Some(calls) = v.as_array() else {
        return Err(ApiError::field(
            param,
            format!("{param}.tool_calls must be an array"),
        ));
    };
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let at = format!("{param}.tool_calls[{j}]");
            let bad = |why: &str| ApiError::field(param, format!("{at}: {why}"));
            let id = c
                .get("id")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("needs an 'id' string"))?;
            let f = c
                .get("function")
                .ok_or_else(|| bad("needs a 'function' object"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("needs a function 'name'"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                    .map_err(|e| bad(&format!("'arguments' is not JSON: {e}")))?,
                Some(o @ Value::Object(_)) => o.clone(),
                _ => return Err(bad("needs 'arguments' (a JSON object, as a string)")),
            };
            if !arguments.is_object() {
                return Err(bad("'arguments' must hold a JSON object"));
            }
            Ok(ToolCall::function(
                id.to_string(),
                name.to_string(),
                arguments,
            ))
        })
        .collect()
}

/// Every tool message answers a call an earlier assistant message made.
pub fn check_answers(messages: &[Message]) -> Result<(), ApiError> {
    for (i, m) in messages.iter().enumerate() {
        let Some(id) = &m.tool_call_id else { continue };
        let made = messages[..i]
            .iter()
            .flat_map(|earlier| &earlier.tool_calls)
            .any(|c| &c.id == id);
        if !made {
            let param = format!("messages[{i}]");
            return Err(ApiError::field(
                &param,
                format!(
                    "{param}: tool_call_id '{}' answers no call an earlier assistant message made",
                    crate::template::one_line(id, 40)
                ),
            ));
        }
    }
    Ok(())
}

/// A call as OpenAI writes it in `message.tool_calls` (its arguments as a JSON string).
pub fn call_json(id: &str, call: &Call) -> Value {
    json!({"id": id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments.to_string()}})
}

/// A call as one streamed `delta.tool_calls` entry: whole, at its index.
pub fn call_delta(index: usize, id: &str, call: &Call) -> Value {
    let mut v = call_json(id, call);
    v["index"] = json!(index);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offered(body: Value) -> Result<Offered, ApiError> {
        read(body.as_object().unwrap())
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    #[test]
    fn tools_are_read_with_auto_and_parallel_calls_by_default() {
        let o = offered(json!({"tools": [weather()]})).unwrap();
        assert_eq!(o.tools[0].name, "get_weather");
        assert_eq!((&o.choice, o.parallel), (&Choice::Auto, true));
        assert!(o.reads_calls());
        let o = offered(json!({"tools": [weather()], "tool_choice": "none"})).unwrap();
        assert!(!o.reads_calls());
    }

    #[test]
    fn bad_tools_are_refused_naming_the_tool_and_the_fault() {
        for (tools, says) in [
            (
                json!([weather(), weather()]),
                "a second tool named 'get_weather'",
            ),
            (
                json!([{"type": "function", "function": {"name": "no spaces"}}]),
                "must be 1 to 64",
            ),
            (json!([{"type": "retrieval"}]), "type 'function'"),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": []}}]),
                "'parameters' must be",
            ),
            (json!({"f": 1}), "must be an array"),
        ] {
            let e = offered(json!({"tools": tools})).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(says), "{}", e.message);
        }
        let huge = json!([{"type": "function", "function": {"name": "f",
                           "parameters": {"description": "x".repeat(MAX_SCHEMA_BYTES)}}}]);
        assert!(offered(json!({"tools": huge}))
            .unwrap_err()
            .message
            .contains("more than the 64 KiB"));
    }

    #[test]
    fn a_tool_choice_naming_an_absent_tool_or_asking_a_call_of_no_tools_is_refused() {
        let e = offered(json!({"tools": [weather()],
                               "tool_choice": {"type": "function", "function": {"name": "nope"}}}))
        .unwrap_err();
        assert!(
            e.message.contains("'nope', which is not among"),
            "{}",
            e.message
        );
        let e = offered(json!({"tool_choice": "required"})).unwrap_err();
        assert!(e.message.contains("offers no tools"), "{}", e.message);
        let o = offered(json!({"tools": [weather()], "tool_choice": "required"})).unwrap();
        assert_eq!(o.choice, Choice::Required);
        assert!(offered(json!({"functions": []})).is_err());
    }

    #[test]
    fn a_tool_message_must_answer_an_earlier_call() {
        let mut asked = Message::new("assistant", "");
        asked.tool_calls = read_calls(
            "messages[0]",
            &json!([{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]),
        )
        .unwrap();
        assert_eq!(
            asked.tool_calls[0].function.arguments,
            json!({"city": "Paris"})
        );
        let mut answer = Message::new("tool", "18 C");
        answer.tool_call_id = Some("call_1".into());
        assert!(check_answers(&[asked.clone(), answer.clone()]).is_ok());
        answer.tool_call_id = Some("call_9".into());
        let e = check_answers(&[asked, answer]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1]"));
    }

    #[test]
    fn call_arguments_that_are_not_a_json_object_are_refused() {
        for args in [json!("{not json"), json!("[1]"), json!(7)] {
            let calls = json!([{"id": "c", "function": {"name": "f", "arguments": args}}]);
            assert!(read_calls("messages[0]", &calls).is_err(), "{args}");
        }
    }

    #[test]
    fn calls_are_written_with_their_arguments_as_a_json_string() {
        let call = Call {
            name: "f".into(),
            arguments: json!({"a": 1}),
        };
        assert_eq!(
            call_delta(2, "call_7", &call),
            json!({"index": 2, "id": "call_7", "type": "function",
                   "function": {"name": "f", "arguments": "{\"a\":1}"}})
        );
    }
}
