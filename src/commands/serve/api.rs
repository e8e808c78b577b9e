//! The OpenAI API's shapes as `kvchat serve` reads and writes them: a request is read from its
//! JSON field by field, so a wrong type or value is a 400 that names the field; responses, stream
//! chunks and errors are written in OpenAI's shapes. Fields kvchat does not know are ignored;
//! values it cannot honour (n > 1, logprobs, a tool_choice that needs a grammar) are refused,
//! never silently dropped. The tools of a request are `tools.rs`'s.

use super::fields::{counted, known};
use super::tools::{self, Offered};
use crate::grammar::{Grammar, MAX_GRAMMAR_BYTES};
use crate::model::sampling::SamplingPrefs;
use crate::template::Message;
use serde_json::{json, Map, Value};

/// The most stop texts a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;
/// The most messages, and content parts in one message, a request may hold: counted before
/// anything is rendered or tokenized, so that a body of many empty messages (no content bytes for
/// the byte checks to count) costs the engine nothing. Every message takes a few template tokens,
/// so 4,096 of them fill any context kvchat runs at below ~16k tokens a turn.
pub const MAX_MESSAGES: usize = 4096;
pub const MAX_PARTS: usize = 256;
/// The most variables a request may set for the chat template.
const MAX_TEMPLATE_KWARGS: usize = 32;
/// The longest stop text, in bytes.
const MAX_STOP_BYTES: usize = 256;

/// An error as the API reports it: an HTTP status and OpenAI's error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    /// OpenAI's `type`: invalid_request_error, authentication_error, server_error, …
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault, where there is one.
    pub param: Option<String>,
    /// OpenAI's `code` (invalid_api_key, context_length_exceeded, …).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about the request field `param`.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// A 400 about the request as a whole.
    pub fn bad(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// What to complete: a conversation (through the chat template) or a text as-is.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Chat(Vec<Message>),
    Text(String),
}

/// Which endpoint a request came to (its responses' shapes differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A request, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub endpoint: Endpoint,
    pub prompt: Prompt,
    /// Most tokens to generate; None: until the context or the server's default.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingPrefs,
    /// Texts that end the answer (not included in it).
    pub stop: Vec<String>,
    pub stream: bool,
    /// Streaming: a last chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The tools a chat request offers (none for completions).
    pub offered: Offered,
    /// Variables for the chat template (`chat_template_kwargs`: Qwen3's `enable_thinking`, …).
    pub template_kwargs: Map<String, Value>,
    /// What a text answer must be (`response_format`): None, any text.
    pub answer: Option<Grammar>,
}

/// `reasoning_effort` (`low`, `medium`, `high`) as the template variable gpt-oss's template reads,
/// unless `chat_template_kwargs` sets it; templates that do not read it ignore it, as vLLM does.
pub fn reasoning_effort(
    obj: &Map<String, Value>,
    kwargs: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    match obj.get("reasoning_effort") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(e)) if ["low", "medium", "high"].contains(&e.as_str()) => {
            kwargs
                .entry("reasoning_effort")
                .or_insert_with(|| Value::String(e.clone()));
            Ok(())
        }
        Some(_) => Err(ApiError::field(
            "reasoning_effort",
            "'reasoning_effort' must be \"low\", \"medium\" or \"high\"",
        )),
    }
}

/// OpenAI's `response_format` (the Responses API's `text.format` is the same without the
/// `json_schema` wrapper: `flat`): `text`, `json_object`, or `json_schema` with its `schema`.
pub fn response_format(v: Option<&Value>, param: &str) -> Result<Option<Grammar>, ApiError> {
    let Some(rf) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |why: String| ApiError::field(param, format!("'{param}' {why}"));
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            // Chat completions wrap it (`json_schema: {name, schema, strict}`); Responses do not.
            let holder = rf.get("json_schema").unwrap_or(rf);
            let schema = holder
                .get("schema")
                .ok_or_else(|| bad("of type json_schema needs a 'schema'".into()))?;
            if !schema.is_object() && !schema.is_boolean() {
                return Err(bad("has a 'schema' that is not a JSON object".into()));
            }
            let size = schema.to_string().len();
            if size > MAX_GRAMMAR_BYTES {
                return Err(bad(format!(
                    "has a schema of {size} bytes, more than the {MAX_GRAMMAR_BYTES} kvchat serve takes"
                )));
            }
            Ok(Some(Grammar::JsonSchema(schema.clone())))
        }
        _ => Err(bad(
            "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", ...}".into(),
        )),
    }
}

/// Reads a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<Request, ApiError> {
    let obj = object(body)?;
    let messages = items(&obj, "messages", "an array of messages")?;
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::field(
            "messages",
            format!(
                "'messages' holds {} messages, more than the {MAX_MESSAGES} kvchat serve takes in one request",
                messages.len()
            ),
        ));
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let offered = tools::read(&obj)?;
    tools::check_answers(&messages)?;
    let answer = response_format(obj.get("response_format"), "response_format")?;
    let max_tokens = match positive(&obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => positive(&obj, "max_tokens")?,
    };
    let mut request = common(&obj, Endpoint::Chat, Prompt::Chat(messages), max_tokens)?;
    request.offered = offered;
    request.answer = answer;
    request.template_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) if m.len() <= MAX_TEMPLATE_KWARGS => m.clone(),
        Some(_) => {
            return Err(ApiError::field(
                "chat_template_kwargs",
                format!("'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} variables"),
            ))
        }
    };
    reasoning_effort(&obj, &mut request.template_kwargs)?;
    Ok(request)
}

/// A field that must hold a non-empty array (`what` says what it must be otherwise): its items,
/// or the 400 that names it.
pub fn items<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<&'a [Value], ApiError> {
    match obj.get(key) {
        Some(Value::Array(a)) if !a.is_empty() => Ok(a),
        Some(Value::Array(_)) => Err(ApiError::field(key, format!("'{key}' is empty"))),
        Some(_) => Err(ApiError::field(key, format!("'{key}' must be {what}"))),
        None => Err(ApiError::field(key, format!("'{key}' is required"))),
    }
}

/// Reads a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<Request, ApiError> {
    let obj = object(body)?;
    let text = match obj.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => return Err(ApiError::field(
            "prompt",
            "'prompt' must be one string (batches of prompts and token arrays are not supported)",
        )),
        Some(_) => return Err(ApiError::field("prompt", "'prompt' must be a string")),
        None => return Err(ApiError::field("prompt", "'prompt' is required")),
    };
    if text.is_empty() {
        return Err(ApiError::field("prompt", "'prompt' is empty"));
    }
    if obj.get("echo").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::field("echo", "'echo' is not supported"));
    }
    if obj.get("suffix").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::field("suffix", "'suffix' is not supported"));
    }
    if obj.get("best_of").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Err(ApiError::field(
            "best_of",
            "'best_of' above 1 is not supported",
        ));
    }
    let max_tokens = positive(&obj, "max_tokens")?;
    common(&obj, Endpoint::Completions, Prompt::Text(text), max_tokens)
}

/// The body as a JSON object, holding only the fields kvchat reads (`known::REQUEST`).
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    object_with(body, &known::REQUEST)
}

/// The body as a JSON object, holding only the fields `shape` lists (see `known`).
pub fn object_with(
    body: &[u8],
    shape: &'static known::Shape,
) -> Result<Map<String, Value>, ApiError> {
    counted::check(body)?;
    if let Some(n) = known::count(body, shape).filter(|&n| n > known::MAX_VALUES) {
        return Err(ApiError::bad(format!(
            "the request holds {n} JSON values in the fields kvchat reads, more than the {} it takes",
            known::MAX_VALUES
        )));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let read = serde::de::DeserializeSeed::deserialize(known::Keep(shape), &mut de)
        .and_then(|v| de.end().map(|()| v));
    match read {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// One chat message: a known role and text content (a string, or text parts).
fn message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let param = format!("messages[{i}]");
    let Some(m) = m.as_object() else {
        return Err(ApiError::field(
            &param,
            format!("{param} must be an object"),
        ));
    };
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        // OpenAI's newer name for the system message.
        Some("developer") => "system",
        Some("function") => {
            return Err(ApiError::field(
                &param,
                format!("{param}: role 'function' is OpenAI's deprecated form: send role 'tool' with a 'tool_call_id'"),
            ))
        }
        Some(r) => {
            return Err(ApiError::field(
                &param,
                format!("{param}: unknown role '{r}' (system, developer, user, assistant or tool)"),
            ))
        }
        None => {
            return Err(ApiError::field(
                &param,
                format!("{param} needs a 'role' string"),
            ))
        }
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        // An assistant message with tool calls has no content; here it is empty.
        Some(Value::Null) | None if role == "assistant" => String::new(),
        Some(Value::Array(parts)) if parts.len() > MAX_PARTS => {
            return Err(ApiError::field(
                &param,
                format!(
                    "{param}: {} content parts, more than the {MAX_PARTS} kvchat serve takes in one message",
                    parts.len()
                ),
            ))
        }
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::field(
                            &param,
                            format!(
                                "{param}.content[{j}]: only text parts are supported (got type {})",
                                kind.unwrap_or("none")
                            ),
                        ))
                    }
                }
            }
            text
        }
        _ => {
            return Err(ApiError::field(
                &param,
                format!("{param} needs 'content': a string or an array of text parts"),
            ))
        }
    };
    let mut message = Message::new(role, &content);
    if role == "assistant" {
        if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
            message.tool_calls = tools::read_calls(&param, calls)?;
        }
    }
    if role == "tool" {
        let id = m
            .get("tool_call_id")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                ApiError::field(
                    &param,
                    format!("{param}: a tool message needs a 'tool_call_id'"),
                )
            })?;
        message.tool_call_id = Some(id.to_string());
        message.name = m.get("name").and_then(Value::as_str).map(str::to_string);
    }
    Ok(message)
}

/// What both endpoints read the same way: sampling, stop texts, streaming, n.
pub fn common(
    obj: &Map<String, Value>,
    endpoint: Endpoint,
    prompt: Prompt,
    max_tokens: Option<usize>,
) -> Result<Request, ApiError> {
    if let Some(n) = obj.get("n").filter(|v| !v.is_null()) {
        if n.as_u64() != Some(1) {
            return Err(ApiError::field("n", "only n = 1 is supported"));
        }
    }
    if obj
        .get("logprobs")
        .is_some_and(|v| v.as_bool() == Some(true) || v.is_number())
    {
        return Err(ApiError::field("logprobs", "'logprobs' is not supported"));
    }
    // A bias kvchat would not apply is refused, not dropped: an empty map is no bias.
    match obj.get("logit_bias").filter(|v| !v.is_null()) {
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(Value::Object(m)) => {
            return Err(ApiError::field(
                "logit_bias",
                format!(
                    "'logit_bias' is not supported by kvchat serve ({} entries given; send none)",
                    m.len()
                ),
            ))
        }
        Some(_) => {
            return Err(ApiError::field(
                "logit_bias",
                "'logit_bias' must be an object of token ids to biases",
            ))
        }
        None => {}
    }
    for penalty in ["presence_penalty", "frequency_penalty"] {
        if let Some(v) = number(obj, penalty, -2.0, 2.0)? {
            if v != 0.0 {
                return Err(ApiError::field(
                    penalty,
                    format!("'{penalty}' is not supported (kvchat's 'repeat_penalty' is)"),
                ));
            }
        }
    }
    let sampling = SamplingPrefs {
        temperature: number(obj, "temperature", 0.0, 2.0)?,
        top_p: match number(obj, "top_p", 0.0, 1.0)? {
            Some(p) if p <= 0.0 => return Err(ApiError::field("top_p", "'top_p' must be above 0")),
            p => p,
        },
        top_k: match obj.get("top_k").filter(|v| !v.is_null()) {
            Some(v) => Some(v.as_u64().map(|k| k as usize).ok_or_else(|| {
                ApiError::field("top_k", "'top_k' must be a whole number (0: off)")
            })?),
            None => None,
        },
        min_p: number(obj, "min_p", 0.0, 1.0)?,
        repeat_penalty: match number(obj, "repeat_penalty", 0.0, 10.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::field(
                    "repeat_penalty",
                    "'repeat_penalty' must be above 0 (1: off)",
                ))
            }
            p => p,
        },
        repeat_last_n: None,
        seed: match obj.get("seed").filter(|v| !v.is_null()) {
            // OpenAI's seed is any integer; a negative one is taken as its two's complement.
            Some(v) => Some(
                v.as_u64()
                    .or_else(|| v.as_i64().map(|i| i as u64))
                    .ok_or_else(|| ApiError::field("seed", "'seed' must be an integer"))?,
            ),
            None => None,
        },
    };
    if let Some((name, why)) = sampling.problems().into_iter().next() {
        return Err(ApiError::field(name, format!("'{name}' {why}")));
    }
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::field("stop", "'stop' must be strings"))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ApiError::field(
                "stop",
                "'stop' must be a string or an array of strings",
            ))
        }
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::field(
            "stop",
            format!("'stop' has {} texts, more than {MAX_STOPS}", stop.len()),
        ));
    }
    if stop
        .iter()
        .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::field(
            "stop",
            format!("each 'stop' text must be 1 to {MAX_STOP_BYTES} bytes"),
        ));
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::field("stream", "'stream' must be true or false")),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Request {
        endpoint,
        prompt,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        offered: Offered::default(),
        template_kwargs: Map::new(),
        answer: None,
    })
}

/// A number field within `lo..=hi`, if present and not null.
fn number(obj: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
            _ => Err(ApiError::field(
                key,
                format!("'{key}' must be a number from {lo} to {hi}"),
            )),
        },
    }
}

/// A whole number ≥ 1, if present and not null.
pub fn positive(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n.min(usize::MAX as u64) as usize)),
            _ => Err(ApiError::field(
                key,
                format!("'{key}' must be a whole number of at least 1"),
            )),
        },
    }
}

/// Why an answer ended, as OpenAI names it.
pub fn finish_reason(reason: crate::session::StopReason) -> &'static str {
    match reason {
        crate::session::StopReason::EndOfText => "stop",
        _ => "length",
    }
}

/// The `usage` object.
pub fn usage(prompt: usize, cached: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Names and times one response: its id, the model and when it was made.
pub struct Head<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub created: u64,
    pub endpoint: Endpoint,
}

impl Head<'_> {
    /// The whole answer, not streamed.
    pub fn response(&self, text: &str, finish: &str, usage: Value) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": text},
                             "logprobs": null, "finish_reason": finish}],
                "usage": usage,
            }),
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null,
                             "finish_reason": finish}],
                "usage": usage,
            }),
        }
    }

    /// A stream chunk: `text` (the first chat chunk also names the role), `finish` on the last.
    pub fn chunk(&self, text: &str, first: bool, finish: Option<&str>) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                 "finish_reason": finish}],
                })
            }
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null,
                             "finish_reason": finish}],
            }),
        }
    }

    /// A stream chunk of a thinking model's reasoning (`delta.reasoning_content`).
    pub fn reasoning_chunk(&self, text: &str, first: bool) -> Value {
        let mut delta = json!({"reasoning_content": text});
        if first {
            delta["role"] = json!("assistant");
        }
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}],
        })
    }

    /// A stream chunk with one whole tool call (`delta.tool_calls`, see `tools::call_delta`).
    pub fn tool_chunk(&self, call: Value, first: bool) -> Value {
        let mut delta = json!({"tool_calls": [call]});
        if first {
            delta["role"] = json!("assistant");
            delta["content"] = Value::Null;
        }
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}],
        })
    }

    /// The usage chunk a stream ends with when the client asked for it (no choices).
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": usage})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_keeps_the_fields_kvchat_reads_and_reads_past_the_rest() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi","x":[1]}],"meta":{"a":[{}]}}],
                        "temperature":0,"stop":["a"],"tools":[{"type":"function","function":{"name":"f","extra":1}}],
                        "metadata":{"big":[{},{},{}]},"user":"u"}"#;
        let v = Value::Object(object(body).unwrap());
        assert_eq!(
            v,
            json!({"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                   "temperature":0,"stop":["a"],
                   "tools":[{"type":"function","function":{"name":"f","extra":1}}]})
        );
        // Wrong types are kept whole, for their readers to name.
        let v = Value::Object(object(br#"{"messages":"hi","prompt":[1,{"a":2}]}"#).unwrap());
        assert_eq!(v, json!({"messages":"hi","prompt":[1,{"a":2}]}));
        assert!(object(b"{} trailing").is_err());
        assert!(object(b"[1]").is_err());
    }

    #[test]
    fn values_past_the_count_are_refused_before_they_are_made_and_unread_ones_do_not_count() {
        let many = vec!["{}"; known::MAX_VALUES as usize].join(",");
        let inside = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"tools":[{{"type":"function","function":{{"name":"f","parameters":{{"x":[{many}]}}}}}}]}}"#
        );
        let e = object(inside.as_bytes()).unwrap_err();
        assert!(
            e.message.contains("JSON values in the fields kvchat reads"),
            "{}",
            e.message
        );
        let beside = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"x":[{many}]}}"#);
        assert!(object(beside.as_bytes()).is_ok());
        // The object, each key kept and its value: 1 + (1 + array 1 + (message 1 + 2 + 2)).
        let body = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(known::count(body, &known::REQUEST), Some(8));
    }

    #[test]
    fn counts_refuse_a_body_before_it_is_read_into_values_and_pass_what_they_cannot_read() {
        let many = format!(
            "{{\"messages\":[{}]}}",
            vec![r#"{"role":"user","content":""}"#; MAX_MESSAGES + 1].join(",")
        );
        let e = counted::check(many.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.message.contains("4097 messages"), "{}", e.message);
        // What the count cannot read is left to the full reading, whose errors name the field.
        for body in [
            r#"{"messages":"hi"}"#,
            r#"{"messages":[1,2]}"#,
            r#"{"messages":[{"role":"user","content":7}]}"#,
            "not json",
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"n":1}"#,
        ] {
            assert_eq!(counted::check(body.as_bytes()), Ok(()), "{body}");
        }
    }

    fn chat(body: &str) -> Result<Request, ApiError> {
        parse_chat(body.as_bytes())
    }

    #[test]
    fn a_chat_request_reads_its_messages_sampling_and_stops() {
        let r = chat(
            r#"{"model":"x","messages":[{"role":"developer","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}],
                "max_completion_tokens":7,"temperature":0,"top_p":0.5,"seed":-1,"stop":"\n\n",
                "stream":true,"stream_options":{"include_usage":true},"unknown_field":[1,2]}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![
                Message::new("system", "Be brief."),
                Message::new("user", "Hi there")
            ])
        );
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.sampling.temperature, Some(0.0));
        assert_eq!(r.sampling.top_p, Some(0.5));
        assert_eq!(r.sampling.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["\n\n".to_string()]);
        assert!(r.stream && r.include_usage);
    }

    #[test]
    fn an_empty_logit_bias_is_no_bias_and_accepted() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"logit_bias":{}}"#);
        assert!(r.is_ok(), "{r:?}");
    }

    #[test]
    fn malformed_json_is_a_400_that_says_so() {
        let e = chat("{\"messages\": [").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message.starts_with("the request body is not valid JSON"),
            "{}",
            e.message
        );
    }

    #[test]
    fn each_wrong_field_is_a_400_naming_it() {
        let user = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (body, param) in [
            (r#"{"messages":[]}"#.to_string(), "messages"),
            (r#"{"messages":"hi"}"#.to_string(), "messages"),
            (
                r#"{"messages":[{"role":"wizard","content":"hi"}]}"#.to_string(),
                "messages[0]",
            ),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#.to_string(),
                "messages[0]",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#.to_string(),
                "messages[0]",
            ),
            (format!("{{{user},\"temperature\":\"hot\"}}"), "temperature"),
            (format!("{{{user},\"temperature\":3}}"), "temperature"),
            (format!("{{{user},\"max_tokens\":0}}"), "max_tokens"),
            (format!("{{{user},\"n\":2}}"), "n"),
            (
                format!("{{{user},\"tools\":[{{\"type\":\"function\"}}]}}"),
                "tools[0]",
            ),
            (format!("{{{user},\"tools\":{{}}}}"), "tools"),
            // Every field kvchat reads has a case here: one left out of `known::REQUEST` would be
            // read past, and its case would fail.
            (format!("{{{user},\"top_p\":7}}"), "top_p"),
            (format!("{{{user},\"top_k\":-1}}"), "top_k"),
            (format!("{{{user},\"min_p\":2}}"), "min_p"),
            (
                format!("{{{user},\"repeat_penalty\":-1}}"),
                "repeat_penalty",
            ),
            (format!("{{{user},\"seed\":\"x\"}}"), "seed"),
            (
                format!("{{{user},\"max_completion_tokens\":0}}"),
                "max_completion_tokens",
            ),
            (
                format!("{{{user},\"response_format\":{{\"type\":\"yaml\"}}}}"),
                "response_format",
            ),
            (
                format!("{{{user},\"tool_choice\":\"always\"}}"),
                "tool_choice",
            ),
            (
                format!("{{{user},\"parallel_tool_calls\":1}}"),
                "parallel_tool_calls",
            ),
            (format!("{{{user},\"functions\":[]}}"), "functions"),
            (
                format!("{{{user},\"frequency_penalty\":0.5}}"),
                "frequency_penalty",
            ),
            (
                format!("{{{user},\"chat_template_kwargs\":[1]}}"),
                "chat_template_kwargs",
            ),
            (
                format!("{{{user},\"reasoning_effort\":\"max\"}}"),
                "reasoning_effort",
            ),
            (
                format!("{{{user},\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}}"),
                "stop",
            ),
            (format!("{{{user},\"stream\":\"yes\"}}"), "stream"),
            (
                format!("{{{user},\"presence_penalty\":0.5}}"),
                "presence_penalty",
            ),
            (format!("{{{user},\"logprobs\":true}}"), "logprobs"),
            (
                format!("{{{user},\"logit_bias\":{{\"42\":-100}}}}"),
                "logit_bias",
            ),
            (format!("{{{user},\"logit_bias\":[1]}}"), "logit_bias"),
            (
                format!(
                    "{{\"messages\":[{}]}}",
                    vec![r#"{"role":"user","content":""}"#; MAX_MESSAGES + 1].join(",")
                ),
                "messages",
            ),
            (
                format!(
                    "{{\"messages\":[{{\"role\":\"user\",\"content\":[{}]}}]}}",
                    vec![r#"{"type":"text","text":""}"#; MAX_PARTS + 1].join(",")
                ),
                "messages[0]",
            ),
        ] {
            let e = chat(&body).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{body}: {}",
                e.message
            );
        }
    }

    #[test]
    fn reasoning_effort_reaches_the_template_unless_its_kwargs_set_it() {
        let user = r#"{"messages":[{"role":"user","content":"hi"}]"#;
        let r = parse_chat(format!(r#"{user},"reasoning_effort":"high"}}"#).as_bytes()).unwrap();
        assert_eq!(r.template_kwargs["reasoning_effort"], "high");
        let both = format!(
            r#"{user},"reasoning_effort":"high","chat_template_kwargs":{{"reasoning_effort":"low"}}}}"#
        );
        let r = parse_chat(both.as_bytes()).unwrap();
        assert_eq!(r.template_kwargs["reasoning_effort"], "low");
    }

    #[test]
    fn a_completion_takes_one_prompt_string() {
        let r = parse_completion(br#"{"prompt":["Once upon"],"max_tokens":3}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("Once upon".into()));
        assert_eq!(r.endpoint, Endpoint::Completions);
        for body in [
            r#"{"prompt":""}"#,
            r#"{"prompt":[1,2,3]}"#,
            r#"{"prompt":"a","echo":true}"#,
            r#"{}"#,
        ] {
            let e = parse_completion(body.as_bytes()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
        }
    }

    #[test]
    fn an_error_body_has_openais_shape() {
        let e = ApiError::field("n", "only n = 1 is supported");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "only n = 1 is supported", "type": "invalid_request_error",
                             "param": "n", "code": null}})
        );
    }
}
