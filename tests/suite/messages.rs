//! Anthropic's Messages API over `kvchat serve` (issue 63): the official `anthropic` client (2.17,
//! which no longer sends sampling settings: greedy goes as `extra_body`) gets
//! the answer a chat completion gets, streamed and whole, a `tool_use` block for a call and an
//! answer built on its `tool_result`, `stop_sequence` with the text that stopped it, and errors in
//! Anthropic's shape; `count_tokens` counts what the same request prefills. The real
//! Qwen2.5-Coder-0.5B, greedy.

use crate::common::server::{greedy_chat, python_json, Server};
use crate::qwen_coder::qwen_path;
use serde_json::json;

const ANTHROPIC_CLIENT: &str = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-test", max_retries=0, timeout=300)
q = [{"role": "user", "content": "What is the capital of France?"}]
out = {}
m = c.messages.create(model="m", max_tokens=24, extra_body={"temperature": 0}, messages=q)
out["text"] = "".join(b.text for b in m.content if b.type == "text")
out["stop"] = m.stop_reason
out["usage"] = [m.usage.input_tokens, m.usage.output_tokens]
with c.messages.stream(model="m", max_tokens=24, extra_body={"temperature": 0}, messages=q) as s:
    out["streamed"] = "".join(s.text_stream)
    out["stream_stop"] = s.get_final_message().stop_reason
tools = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
w = [{"role": "user", "content": "What is the weather in Paris?"}]
m = c.messages.create(model="m", max_tokens=80, extra_body={"temperature": 0}, tools=tools, messages=w)
out["tool_stop"] = m.stop_reason
out["tool_use"] = [[b.name, b.input] for b in m.content if b.type == "tool_use"]
with c.messages.stream(model="m", max_tokens=80, extra_body={"temperature": 0}, tools=tools, messages=w) as s:
    f = s.get_final_message()
    out["streamed_tool_use"] = [[b.name, b.input] for b in f.content if b.type == "tool_use"]
    out["streamed_tool_stop"] = f.stop_reason
tu = [b for b in m.content if b.type == "tool_use"][0]
back = w + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": tu.id, "name": tu.name, "input": tu.input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id,
                                  "content": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"}]},
]
m = c.messages.create(model="m", max_tokens=60, extra_body={"temperature": 0}, tools=tools, messages=back)
out["after"] = [m.stop_reason, "".join(b.text for b in m.content if b.type == "text")]
m = c.messages.create(model="m", max_tokens=24, extra_body={"temperature": 0}, stop_sequences=["Paris"], messages=q)
out["stop_sequence"] = [m.stop_reason, m.stop_sequence]
try:
    c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    out["error"] = None
except anthropic.BadRequestError as e:
    out["error"] = [e.status_code, e.body["error"]["type"], e.body["error"]["message"]]
print(json.dumps(out))
"#;

#[test]
fn the_anthropic_client_gets_the_chat_answer_tool_use_stop_sequences_and_errors() {
    let server = Server::start_model(&qwen_path(), &["--ctx", "2048"]);
    let v = python_json(&["-c", ANTHROPIC_CLIENT, &server.base]);
    // The same greedy answer a chat completion gives.
    let chat = server.chat(greedy_chat("What is the capital of France?", 24));
    let text = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["text"], text, "{v}");
    assert_eq!(v["streamed"], text, "{v}");
    assert_eq!(
        (&v["stop"], &v["stream_stop"]),
        (&json!("end_turn"), &json!("end_turn"))
    );
    assert_eq!(
        v["usage"][1].as_u64(),
        chat["usage"]["completion_tokens"].as_u64()
    );
    let call = json!([["get_weather", {"city": "Paris"}]]);
    assert_eq!(v["tool_use"], call, "{v}");
    assert_eq!(v["streamed_tool_use"], call, "{v}");
    assert_eq!(
        (&v["tool_stop"], &v["streamed_tool_stop"]),
        (&json!("tool_use"), &json!("tool_use"))
    );
    assert_eq!(v["after"][0], "end_turn", "{v}");
    assert!(
        v["after"][1].as_str().unwrap_or_default().contains("18"),
        "{v}"
    );
    assert_eq!(v["stop_sequence"], json!(["stop_sequence", "Paris"]), "{v}");
    assert_eq!(v["error"][0], 400, "{v}");
    assert_eq!(v["error"][1], "invalid_request_error", "{v}");
    assert!(
        v["error"][2]
            .as_str()
            .unwrap_or_default()
            .contains("'image'"),
        "{v}"
    );
    server.assert_settles();
}

#[test]
fn a_messages_or_count_tokens_request_with_a_fault_gets_anthropics_error_shape() {
    let server = Server::start(&["--ctx", "512"]);
    let count = "/v1/messages/count_tokens";
    for (path, body, says) in [
        // count_tokens reads the same body, without max_tokens, and refuses the same faults.
        (count, json!({"system": "x"}), "'messages'"),
        (
            count,
            json!({"messages": [{"role": "user", "content": [{"type": "document"}]}]}),
            "block type 'document'",
        ),
        (
            "/v1/messages",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            "'max_tokens' is required",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document"}]}]}),
            "block type 'document'",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                   "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
            "does not show tools",
        ),
    ] {
        let (code, v, _) = server.post(path, &body.to_string(), None);
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains(says),
            "{body}: {v}"
        );
    }
    server.assert_settles();
}

const COUNT_TOKENS: &str = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-test", max_retries=0, timeout=300)
q = [{"role": "user", "content": "What is the capital of France?"}]
tools = [{"name": "lookup", "description": "Look a fact up",
          "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}]
n = c.messages.count_tokens(model="m", system="Be brief.", messages=q, tools=tools).input_tokens
m = c.messages.create(model="m", max_tokens=1, system="Be brief.", messages=q, tools=tools,
                      extra_body={"temperature": 0})
used = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
print(json.dumps({"counted": n, "used": used}))
"#;

#[test]
fn count_tokens_counts_the_prompt_a_message_request_would_prefill() {
    let server = Server::start_model(&qwen_path(), &["--ctx", "2048"]);
    let v = python_json(&["-c", COUNT_TOKENS, &server.base]);
    assert!(v["counted"].as_u64().unwrap_or(0) > 50, "{v}");
    assert_eq!(v["counted"], v["used"], "{v}");
    server.assert_settles();
}
