//! Anthropic's Messages API (`POST /v1/messages`) as `kvchat serve` reads and writes it: a request
//! is turned into the same conversation, sampling and tools a chat completion has (so it is
//! prepared, scheduled and its calls read the same way), and the answer is written in Anthropic's
//! shapes — content blocks (`text`, `tool_use`), `stop_reason`, and the named server-sent events
//! its clients read (`message_start`, `content_block_*`, `message_delta`, `message_stop`).

use super::api::{self, ApiError, Endpoint, Prompt, Request};
use super::fields::known;
use super::tools;
use crate::session::StopReason;
use crate::template::{Message, ToolCall};
use crate::toolcall::Call;
use serde_json::{json, Map, Value};

static BLOCK: known::Shape = known::Shape::Object(&[
    ("type", &known::ANY),
    ("text", &known::ANY),
    ("id", &known::ANY),
    ("name", &known::ANY),
    ("input", &known::ANY),
    ("tool_use_id", &known::ANY),
    ("content", &known::ANY),
    ("is_error", &known::ANY),
]);
static BLOCKS: known::Shape = known::Shape::Array(&BLOCK);
static MESSAGE: known::Shape = known::Shape::Object(&[("role", &known::ANY), ("content", &BLOCKS)]);
static MESSAGES: known::Shape = known::Shape::Array(&MESSAGE);
/// The fields of a Messages request kvchat reads (see `fields::known`).
static REQUEST: known::Shape = known::Shape::Object(&[
    ("system", &BLOCKS),
    ("messages", &MESSAGES),
    ("max_tokens", &known::ANY),
    ("stop_sequences", &known::ANY),
    ("temperature", &known::ANY),
    ("top_p", &known::ANY),
    ("top_k", &known::ANY),
    ("stream", &known::ANY),
    ("tools", &known::ANY),
    ("tool_choice", &known::ANY),
    ("thinking", &known::ANY),
]);

/// Reads a `/v1/messages` body into the request a chat completion would be.
pub fn parse(body: &[u8]) -> Result<Request, ApiError> {
    read(body, true)
}

/// Reads a `/v1/messages/count_tokens` body: a Messages request without `max_tokens`.
pub fn parse_count(body: &[u8]) -> Result<Request, ApiError> {
    read(body, false)
}

fn read(body: &[u8], answered: bool) -> Result<Request, ApiError> {
    let obj = api::object_with(body, &REQUEST)?;
    if obj
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t != "disabled")
    {
        return Err(ApiError::field(
            "thinking",
            "'thinking' is not supported by kvchat serve (send it disabled or not at all)",
        ));
    }
    let max_tokens = match obj.get("max_tokens").filter(|v| !v.is_null()) {
        Some(n) => Some(n),
        None if answered => return Err(ApiError::field("max_tokens", "'max_tokens' is required")),
        None => None,
    };
    let mut messages = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => {
            let text = text_of("system", s)?;
            if !text.is_empty() {
                messages.push(Message::new("system", &text));
            }
        }
    }
    for (i, m) in api::items(&obj, "messages", "an array of messages")?
        .iter()
        .enumerate()
    {
        messages.extend(message(i, m)?);
    }
    tools::check_answers(&messages)?;
    // The rest as a chat completion reads it, under OpenAI's names.
    let mut same = Map::new();
    if let Some(n) = max_tokens {
        same.insert("max_tokens".into(), n.clone());
    }
    for (ours, theirs) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
        ("stop_sequences", "stop"),
    ] {
        if let Some(v) = obj.get(ours) {
            same.insert(theirs.into(), v.clone());
        }
    }
    if let Some(t) = obj.get("tools").filter(|v| !v.is_null()) {
        same.insert("tools".into(), openai_tools(t)?);
    }
    if let Some(c) = obj.get("tool_choice").filter(|v| !v.is_null()) {
        let (choice, parallel) = openai_choice(c)?;
        same.insert("tool_choice".into(), choice);
        same.insert("parallel_tool_calls".into(), Value::Bool(parallel));
    }
    let renamed = |mut e: ApiError| {
        if e.param.as_deref() == Some("stop") {
            e.param = Some("stop_sequences".into());
            e.message = e.message.replace("'stop'", "'stop_sequences'");
        }
        e
    };
    let max_tokens = api::positive(&same, "max_tokens")?;
    let offered = tools::read(&same)?;
    let mut request =
        api::common(&same, Endpoint::Chat, Prompt::Chat(messages), max_tokens).map_err(renamed)?;
    request.offered = offered;
    Ok(request)
}

/// A text field: a string, or an array of text blocks.
fn text_of(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(
                |(j, b)| match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    (kind, _) => Err(ApiError::field(
                        param,
                        format!(
                            "{param}[{j}]: only text blocks are supported here (got {})",
                            kind.unwrap_or("no type")
                        ),
                    )),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.concat()),
        _ => Err(ApiError::field(
            param,
            format!("'{param}' must be a string or an array of text blocks"),
        )),
    }
}

/// One Anthropic message as the conversation's messages: a user turn's `tool_result` blocks are
/// tool messages (before its text), an assistant turn's `tool_use` blocks its calls.
fn message(i: usize, m: &Value) -> Result<Vec<Message>, ApiError> {
    let param = format!("messages[{i}]");
    let bad = |why: String| ApiError::field(&param, format!("{param}: {why}"));
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => return Err(bad(format!("unknown role '{r}' (user or assistant)"))),
        None => return Err(bad("needs a 'role' string".into())),
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => return Ok(vec![Message::new(role, s)]),
        Some(Value::Array(b)) => b,
        _ => return Err(bad("needs 'content': a string or an array of blocks".into())),
    };
    let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("content[{j}]");
        match (role, b.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => match b.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => return Err(bad(format!("{at}: a text block needs 'text'"))),
            },
            ("assistant", Some("tool_use")) => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(bad(format!("{at}: a tool_use block needs 'id' and 'name'")));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                if !input.is_object() {
                    return Err(bad(format!("{at}: 'input' must be a JSON object")));
                }
                calls.push(ToolCall::function(id.into(), name.into(), input));
            }
            ("user", Some("tool_result")) => {
                let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(bad(format!(
                        "{at}: a tool_result block needs 'tool_use_id'"
                    )));
                };
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(&format!("{param}.{at}.content"), c)?,
                };
                let content = match b.get("is_error").and_then(Value::as_bool) {
                    Some(true) => format!("Error: {content}"),
                    _ => content,
                };
                let mut r = Message::new("tool", &content);
                r.tool_call_id = Some(id.to_string());
                results.push(r);
            }
            (_, kind) => {
                return Err(bad(format!(
                    "{at}: block type '{}' is not supported in a {role} message (text{})",
                    kind.unwrap_or("none"),
                    if role == "user" {
                        ", tool_result"
                    } else {
                        ", tool_use"
                    }
                )))
            }
        }
    }
    let mut out = results;
    if !text.is_empty() || !calls.is_empty() || out.is_empty() {
        let mut m = Message::new(role, &text);
        m.tool_calls = calls;
        out.push(m);
    }
    Ok(out)
}

/// Anthropic's tools (`name`, `description`, `input_schema`) in OpenAI's shape, for
/// `tools::read` to check.
fn openai_tools(t: &Value) -> Result<Value, ApiError> {
    let Some(list) = t.as_array() else {
        return Err(ApiError::field("tools", "'tools' must be an array"));
    };
    Ok(Value::Array(
        list.iter()
            .map(|t| {
                let mut f = Map::new();
                for (ours, theirs) in [
                    ("name", "name"),
                    ("description", "description"),
                    ("input_schema", "parameters"),
                ] {
                    if let Some(v) = t.get(ours) {
                        f.insert(theirs.into(), v.clone());
                    }
                }
                json!({"type": "function", "function": f})
            })
            .collect(),
    ))
}

/// Anthropic's `tool_choice` as OpenAI's, and whether calls may come in parallel.
fn openai_choice(c: &Value) -> Result<(Value, bool), ApiError> {
    let parallel = !c
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let choice = match c.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("none") => json!("none"),
        Some("any") => json!("required"),
        Some("tool") => {
            json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}})
        }
        _ => {
            return Err(ApiError::field(
                "tool_choice",
                "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
            ))
        }
    };
    Ok((choice, parallel))
}

/// Why the answer ended, as Anthropic says it.
pub fn stop_reason(reason: StopReason, called: bool, stop_text: Option<&str>) -> &'static str {
    match (called, stop_text, reason) {
        (true, _, _) => "tool_use",
        (_, Some(_), _) => "stop_sequence",
        (_, _, StopReason::EndOfText) => "end_turn",
        _ => "max_tokens",
    }
}

/// The usage object: input tokens read from the cache apart from the rest.
pub fn usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({"input_tokens": prompt - cached.min(prompt), "output_tokens": output,
           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0})
}

/// A `tool_use` block.
pub fn tool_use(id: &str, call: &Call) -> Value {
    json!({"type": "tool_use", "id": id, "name": call.name, "input": call.arguments})
}

/// The whole answer, not streamed.
pub fn response(
    id: &str,
    model: &str,
    content: Vec<Value>,
    stop_reason: &str,
    stop_text: Option<&str>,
    usage: Value,
) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "model": model,
           "content": content, "stop_reason": stop_reason, "stop_sequence": stop_text,
           "usage": usage})
}

/// An error in Anthropic's shape (its `type` from the status).
pub fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        401 => "authentication_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

/// The stream's events, as (name, data) pairs: what a text piece, a piece of reasoning or a call
/// adds, given which block is open.
#[derive(Default)]
pub struct Blocks {
    /// The index the next block takes.
    next: usize,
    /// The kind of the block open (at `next - 1`): "text" or "thinking".
    open: Option<&'static str>,
}

impl Blocks {
    pub fn text(&mut self, t: &str) -> Vec<(&'static str, Value)> {
        self.piece("text", json!({"type": "text_delta", "text": t}))
    }

    /// A thinking model's reasoning, as Anthropic's thinking blocks (no signature: kvchat signs
    /// nothing).
    pub fn thinking(&mut self, t: &str) -> Vec<(&'static str, Value)> {
        self.piece("thinking", json!({"type": "thinking_delta", "thinking": t}))
    }

    fn piece(&mut self, kind: &'static str, delta: Value) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if self.open != Some(kind) {
            out.extend(self.close_text());
            let block = match kind {
                "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": self.next, "content_block": block}),
            ));
            self.open = Some(kind);
            self.next += 1;
        }
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.next - 1, "delta": delta}),
        ));
        out
    }

    pub fn call(&mut self, id: &str, call: &Call) -> Vec<(&'static str, Value)> {
        let mut out = self.close_text();
        let i = self.next;
        self.next += 1;
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": i,
                   "content_block": {"type": "tool_use", "id": id, "name": call.name, "input": {}}}),
        ));
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i,
                   "delta": {"type": "input_json_delta", "partial_json": call.arguments.to_string()}}),
        ));
        out.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        ));
        out
    }

    /// Closes the open text or thinking block, if any.
    pub fn close_text(&mut self) -> Vec<(&'static str, Value)> {
        if self.open.take().is_none() {
            return Vec::new();
        }
        vec![(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.next - 1}),
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: Value) -> Result<Request, ApiError> {
        parse(body.to_string().as_bytes())
    }

    #[test]
    fn a_request_becomes_the_conversation_a_chat_completion_has() {
        let r = parsed(json!({
            "model": "m", "max_tokens": 64, "system": "Be brief.", "temperature": 0,
            "stop_sequences": ["END"],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "text", "text": "And tomorrow?"}]},
            ],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        }))
        .unwrap();
        let Prompt::Chat(m) = &r.prompt else {
            panic!("not a chat")
        };
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(
            m[2].tool_calls[0].function.arguments,
            json!({"city": "Paris"})
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].content, "18 C");
        assert_eq!(
            (r.max_tokens, r.stop.clone()),
            (Some(64), vec!["END".to_string()])
        );
        assert_eq!(r.offered.tools[0].name, "get_weather");
    }

    #[test]
    fn bad_messages_requests_are_refused_naming_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (body, param, says) in [
            (json!({"messages": user}), "max_tokens", "required"),
            (
                json!({"max_tokens": 8, "messages": []}),
                "messages",
                "empty",
            ),
            (
                json!({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}),
                "messages[0]",
                "unknown role",
            ),
            (
                json!({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                "messages[0]",
                "block type 'image'",
            ),
            (
                json!({"max_tokens": 8, "messages": [{"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}),
                "messages[0]",
                "answers no call",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "stop_sequences": ["a","b","c","d","e"]}),
                "stop_sequences",
                "'stop_sequences'",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
                "thinking",
                "not supported",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "tools": [{"name": "f"}],
                       "tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice",
                "'g', which is not among the tools",
            ),
        ] {
            let e = parsed(body.clone()).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{body}: {}",
                e.message
            );
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }

    #[test]
    fn the_stop_reason_says_a_call_a_stop_sequence_the_end_or_the_limit() {
        assert_eq!(stop_reason(StopReason::EndOfText, true, None), "tool_use");
        assert_eq!(
            stop_reason(StopReason::EndOfText, false, Some("END")),
            "stop_sequence"
        );
        assert_eq!(stop_reason(StopReason::EndOfText, false, None), "end_turn");
        assert_eq!(
            stop_reason(StopReason::MaxTokens, false, None),
            "max_tokens"
        );
    }

    #[test]
    fn streamed_blocks_open_close_and_count_in_order() {
        let mut b = Blocks::default();
        let call = Call {
            name: "f".into(),
            arguments: json!({"a": 1}),
        };
        let mut names: Vec<(&str, usize)> = Vec::new();
        for (name, data) in b
            .text("Hi")
            .into_iter()
            .chain(b.text(" there"))
            .chain(b.call("toolu_1", &call))
            .chain(b.close_text())
        {
            names.push((name, data["index"].as_u64().unwrap() as usize));
        }
        assert_eq!(
            names,
            [
                ("content_block_start", 0),
                ("content_block_delta", 0),
                ("content_block_delta", 0),
                ("content_block_stop", 0),
                ("content_block_start", 1),
                ("content_block_delta", 1),
                ("content_block_stop", 1),
            ]
        );
    }
}
