//! OpenAI's Responses API (`POST /v1/responses`) as `kvchat serve` reads and writes it, and the
//! store of responses that `previous_response_id` continues.
//!
//! A request — `input` (text or items), `instructions`, `previous_response_id`, tools — becomes
//! the conversation a chat completion would have: the stored conversation of the previous
//! response, then the new items. Its prompt therefore starts with the previous prompt, whose
//! blocks the server's pool and prefix store already hold: the next turn prefills only what is new
//! (`usage.input_tokens_details.cached_tokens`). Instructions are not carried from one response to
//! the next, as OpenAI's are not.

use super::api::{self, ApiError, Endpoint, Prompt, Request};
use super::fields::known;
use super::tools;
use crate::template::{Message, ToolCall};
use crate::toolcall::Call;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Responses kept at once, and their conversations' bytes; past either the oldest go (a later
/// `previous_response_id` naming one is a 404).
pub const MAX_STORED: usize = 1024;
pub const MAX_STORED_BYTES: usize = 64 << 20;

static PART: known::Shape = known::Shape::Object(&[("type", &known::ANY), ("text", &known::ANY)]);
static PARTS: known::Shape = known::Shape::Array(&PART);
static ITEM: known::Shape = known::Shape::Object(&[
    ("type", &known::ANY),
    ("role", &known::ANY),
    ("content", &PARTS),
    ("call_id", &known::ANY),
    ("name", &known::ANY),
    ("arguments", &known::ANY),
    ("output", &known::ANY),
]);
static ITEMS: known::Shape = known::Shape::Array(&ITEM);
/// The fields of a Responses request kvchat reads (see `fields::known`).
static REQUEST: known::Shape = known::Shape::Object(&[
    ("input", &ITEMS),
    ("instructions", &known::ANY),
    ("previous_response_id", &known::ANY),
    ("store", &known::ANY),
    ("max_output_tokens", &known::ANY),
    ("temperature", &known::ANY),
    ("top_p", &known::ANY),
    ("stream", &known::ANY),
    ("tools", &known::ANY),
    ("tool_choice", &known::ANY),
    ("parallel_tool_calls", &known::ANY),
    ("text", &known::ANY),
    ("reasoning", &known::ANY),
]);

/// Stored responses: each one's conversation, its answer included.
#[derive(Default)]
pub struct Store {
    inner: Mutex<Stored>,
}

#[derive(Default)]
struct Stored {
    by_id: HashMap<String, Kept>,
    order: VecDeque<(String, usize)>,
    bytes: usize,
}

/// One stored response: its conversation (its answer included) and the response as it was sent.
#[derive(Clone)]
struct Kept {
    conversation: Arc<Vec<Message>>,
    response: Arc<Value>,
}

fn bytes_of(messages: &[Message]) -> usize {
    messages
        .iter()
        .map(|m| {
            64 + m.content.len()
                + m.tool_calls
                    .iter()
                    .map(|c| c.function.arguments.to_string().len() + c.function.name.len())
                    .sum::<usize>()
        })
        .sum()
}

impl Store {
    /// Response `id`'s conversation.
    pub fn get(&self, id: &str) -> Option<Arc<Vec<Message>>> {
        Some(self.inner.lock().ok()?.by_id.get(id)?.conversation.clone())
    }

    /// Response `id` as it was sent (`GET /v1/responses/{id}`).
    pub fn response(&self, id: &str) -> Option<Arc<Value>> {
        Some(self.inner.lock().ok()?.by_id.get(id)?.response.clone())
    }

    /// Forgets response `id` (`DELETE /v1/responses/{id}`); whether it was kept.
    pub fn delete(&self, id: &str) -> bool {
        let Ok(mut s) = self.inner.lock() else {
            return false;
        };
        if s.by_id.remove(id).is_none() {
            return false;
        }
        if let Some(i) = s.order.iter().position(|(k, _)| k == id) {
            if let Some((_, n)) = s.order.remove(i) {
                s.bytes -= n;
            }
        }
        true
    }

    /// Keeps `messages` as response `id`'s conversation, and `response` as it was sent, the
    /// oldest going past the bounds.
    pub fn put(&self, id: String, messages: Vec<Message>, response: Value) {
        let size = bytes_of(&messages) + response.to_string().len();
        let Ok(mut s) = self.inner.lock() else {
            return;
        };
        if size > MAX_STORED_BYTES {
            return;
        }
        while s.order.len() >= MAX_STORED || s.bytes + size > MAX_STORED_BYTES {
            let Some((old, n)) = s.order.pop_front() else {
                break;
            };
            s.by_id.remove(&old);
            s.bytes -= n;
        }
        s.bytes += size;
        s.order.push_back((id.clone(), size));
        s.by_id.insert(
            id,
            Kept {
                conversation: Arc::new(messages),
                response: Arc::new(response),
            },
        );
    }
}

/// A Responses request: the chat request it becomes, and what to store once it is answered.
pub struct Parsed {
    pub request: Request,
    /// The conversation to store with the answer (None: `store: false`); without instructions.
    pub keep: Option<Vec<Message>>,
}

/// Reads a `/v1/responses` body, continuing a stored response where it names one.
pub fn parse(body: &[u8], store: &Store) -> Result<Parsed, ApiError> {
    let obj = api::object_with(body, &REQUEST)?;
    let mut messages: Vec<Message> = match obj.get("previous_response_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(id)) => match store.get(id) {
            Some(m) => m.as_ref().clone(),
            None => {
                return Err(ApiError::new(
                    404,
                    "invalid_request_error",
                    format!(
                        "no stored response '{}' (unknown, stored with store: false, or past the {MAX_STORED} kept)",
                        crate::template::one_line(id, 40)
                    ),
                )
                .with_param("previous_response_id"))
            }
        },
        Some(_) => {
            return Err(ApiError::field(
                "previous_response_id",
                "'previous_response_id' must be a string",
            ))
        }
    };
    if let Some(Value::String(s)) = obj.get("input") {
        messages.push(Message::new("user", s));
    } else {
        let input = api::items(&obj, "input", "a string or an array of items")?;
        for (i, item) in input.iter().enumerate() {
            add_item(&mut messages, i, item)?;
        }
    }
    tools::check_answers(&messages)?;
    let answer =
        api::response_format(obj.get("text").and_then(|t| t.get("format")), "text.format")?;
    let keep = match obj.get("store") {
        None | Some(Value::Null) | Some(Value::Bool(true)) => Some(messages.clone()),
        Some(Value::Bool(false)) => None,
        Some(_) => return Err(ApiError::field("store", "'store' must be true or false")),
    };
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.insert(0, Message::new("system", s)),
        Some(_) => {
            return Err(ApiError::field(
                "instructions",
                "'instructions' must be a string",
            ))
        }
    }
    // The rest as a chat completion reads it, under its names.
    let mut same = Map::new();
    if let Some(effort) = obj.get("reasoning").and_then(|r| r.get("effort")) {
        same.insert("reasoning_effort".into(), effort.clone());
    }
    for (ours, theirs) in [
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("tool_choice", "tool_choice"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ] {
        if let Some(v) = obj.get(ours) {
            same.insert(theirs.into(), v.clone());
        }
    }
    if let Some(Value::Object(c)) = same.get("tool_choice") {
        // Responses name a function at the top: {"type": "function", "name": …}.
        let named = json!({"type": "function", "function": {"name": c.get("name")}});
        same.insert("tool_choice".into(), named);
    }
    if let Some(t) = obj.get("tools").filter(|v| !v.is_null()) {
        same.insert("tools".into(), chat_tools(t)?);
    }
    let renamed = |mut e: ApiError| {
        if e.param.as_deref() == Some("max_tokens") {
            e.param = Some("max_output_tokens".into());
            e.message = e.message.replace("'max_tokens'", "'max_output_tokens'");
        }
        e
    };
    let max_tokens = api::positive(&same, "max_tokens").map_err(renamed)?;
    let offered = tools::read(&same)?;
    let mut request =
        api::common(&same, Endpoint::Chat, Prompt::Chat(messages), max_tokens).map_err(renamed)?;
    request.offered = offered;
    request.answer = answer;
    api::reasoning_effort(&same, &mut request.template_kwargs).map_err(|mut e| {
        e.param = Some("reasoning.effort".into());
        e
    })?;
    Ok(Parsed { request, keep })
}

/// One input item into the conversation: a message, a call the model made, or a call's output.
fn add_item(messages: &mut Vec<Message>, i: usize, item: &Value) -> Result<(), ApiError> {
    let param = format!("input[{i}]");
    let bad = |why: &str| ApiError::field(&param, format!("{param}: {why}"));
    let kind = item.get("type").and_then(Value::as_str);
    match kind {
        None | Some("message") => {
            let role = match item.get("role").and_then(Value::as_str) {
                Some(r @ ("user" | "assistant" | "system")) => r,
                Some("developer") => "system",
                Some(r) => return Err(bad(&format!("unknown role '{r}'"))),
                None => return Err(bad("a message needs a 'role'")),
            };
            let text = match item.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("input_text" | "output_text" | "text"), Some(t)) => {
                                text.push_str(t)
                            }
                            (t, _) => {
                                return Err(bad(&format!(
                                    "content[{j}]: only text parts are supported (got {})",
                                    t.unwrap_or("no type")
                                )))
                            }
                        }
                    }
                    text
                }
                _ => return Err(bad("a message needs 'content': a string or text parts")),
            };
            messages.push(Message::new(role, &text));
        }
        Some("function_call") => {
            let (Some(id), Some(name), Some(args)) = (
                item.get("call_id").and_then(Value::as_str),
                item.get("name").and_then(Value::as_str),
                item.get("arguments").and_then(Value::as_str),
            ) else {
                return Err(bad(
                    "a function_call needs 'call_id', 'name' and 'arguments' strings",
                ));
            };
            let arguments: Value = serde_json::from_str(args)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| bad("'arguments' must hold a JSON object"))?;
            let call = ToolCall::function(id.into(), name.into(), arguments);
            // Calls made together are one assistant turn.
            match messages.last_mut() {
                Some(m) if m.role == "assistant" && !m.tool_calls.is_empty() => {
                    m.tool_calls.push(call)
                }
                _ => {
                    let mut m = Message::new("assistant", "");
                    m.tool_calls.push(call);
                    messages.push(m);
                }
            }
        }
        Some("function_call_output") => {
            let Some(id) = item.get("call_id").and_then(Value::as_str) else {
                return Err(bad("a function_call_output needs a 'call_id'"));
            };
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            let mut m = Message::new("tool", &output);
            m.tool_call_id = Some(id.to_string());
            messages.push(m);
        }
        // A reasoning item carries nothing this server's prompt shows.
        Some("reasoning") => {}
        Some(other) => return Err(bad(&format!("item type '{other}' is not supported"))),
    }
    Ok(())
}

/// Responses' function tools (`{"type": "function", "name", "description", "parameters"}`) in
/// the chat shape, for `tools::read` to check.
fn chat_tools(t: &Value) -> Result<Value, ApiError> {
    let Some(list) = t.as_array() else {
        return Err(ApiError::field("tools", "'tools' must be an array"));
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::field(
                    &format!("tools[{i}]"),
                    format!("tools[{i}]: only function tools are supported"),
                ));
            }
            let mut f = Map::new();
            for key in ["name", "description", "parameters"] {
                if let Some(v) = t.get(key) {
                    f.insert(key.into(), v.clone());
                }
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// The conversation a stored response continues with: what it was asked, then its answer.
pub fn answered(mut asked: Vec<Message>, text: &str, calls: &[(String, Call)]) -> Vec<Message> {
    let mut answer = Message::new("assistant", text);
    answer.tool_calls = calls
        .iter()
        .map(|(id, c)| ToolCall::function(id.clone(), c.name.clone(), c.arguments.clone()))
        .collect();
    asked.push(answer);
    asked
}

/// An output message item.
pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// An output reasoning item (a thinking model's reasoning, never in the message).
pub fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": "completed", "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

/// An output function-call item.
pub fn call_item(id: &str, call_id: &str, call: &Call) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": call.name,
           "arguments": call.arguments.to_string(), "status": "completed"})
}

/// The response object.
pub fn response(
    id: &str,
    model: &str,
    created: u64,
    output: Vec<Value>,
    incomplete: bool,
    usage: Option<(usize, usize, usize)>,
) -> Value {
    json!({
        "id": id, "object": "response", "created_at": created, "model": model,
        "status": if usage.is_none() { "in_progress" } else if incomplete { "incomplete" } else { "completed" },
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "error": null, "output": output, "parallel_tool_calls": true, "tool_choice": "auto",
        "tools": [], "text": {"format": {"type": "text"}},
        "usage": usage.map(|(prompt, cached, output)| json!({
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: Value, store: &Store) -> Result<Parsed, ApiError> {
        parse(body.to_string().as_bytes(), store)
    }

    #[test]
    fn a_response_continues_its_stored_conversation_and_its_instructions_are_not_kept() {
        let store = Store::default();
        let first = parsed(json!({"input": "Hi", "instructions": "Be brief."}), &store).unwrap();
        let Prompt::Chat(m) = &first.request.prompt else {
            panic!()
        };
        assert_eq!(m.len(), 2);
        let kept = first.keep.unwrap();
        assert_eq!(kept.len(), 1, "instructions are not stored");
        store.put("resp_1".into(), answered(kept, "Hello!", &[]), json!({}));
        let next = parsed(
            json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Again"}]}],
                   "previous_response_id": "resp_1"}),
            &store,
        )
        .unwrap();
        let Prompt::Chat(m) = &next.request.prompt else {
            panic!()
        };
        let turns: Vec<(&str, &str)> = m
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            turns,
            [("user", "Hi"), ("assistant", "Hello!"), ("user", "Again")]
        );
    }

    #[test]
    fn an_unknown_previous_response_is_a_404_and_bad_items_are_400s() {
        let store = Store::default();
        let e = parsed(
            json!({"input": "x", "previous_response_id": "resp_nope"}),
            &store,
        )
        .err()
        .unwrap();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (404, Some("previous_response_id"))
        );
        for (body, says) in [
            (json!({}), "'input' is required"),
            (
                json!({"input": [{"type": "web_search_call"}]}),
                "item type 'web_search_call'",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}),
                "answers no call",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
                "'text.format' of type json_schema needs a 'schema'",
            ),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "'max_output_tokens'",
            ),
        ] {
            let e = parsed(body.clone(), &store).err().unwrap();
            assert_eq!(e.status, 400, "{body}");
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
    }

    #[test]
    fn function_calls_and_their_outputs_become_a_call_turn_and_tool_messages() {
        let store = Store::default();
        let p = parsed(
            json!({"input": [
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "18 C"}],
                "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}]}),
            &store,
        )
        .unwrap();
        let Prompt::Chat(m) = &p.request.prompt else {
            panic!()
        };
        assert_eq!(
            m[1].tool_calls[0].function.arguments,
            json!({"city": "Paris"})
        );
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(p.request.offered.tools[0].name, "w");
    }

    #[test]
    fn the_store_drops_its_oldest_responses_past_its_bound() {
        let store = Store::default();
        for i in 0..=MAX_STORED {
            store.put(
                format!("resp_{i}"),
                vec![Message::new("user", "x")],
                json!({}),
            );
        }
        assert!(store.get("resp_0").is_none());
        assert!(store.get(&format!("resp_{MAX_STORED}")).is_some());
    }
}
