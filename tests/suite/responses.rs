//! OpenAI's Responses API over `kvchat serve` (issue 63): a conversation continued by
//! `previous_response_id` answers each turn as the same conversation sent whole to
//! /v1/chat/completions does, and prefills only what is new (scripts/responses-turns.py, the
//! official openai client, the real Qwen2.5-Coder-0.5B, greedy); function tools go out as
//! `function_call` items and come back as `function_call_output`; a response it never stored is a
//! 404; a stored one is retrieved as it was sent, and once deleted is a 404 too.

use crate::common::server::{python_json, Server};
use crate::qwen_coder::qwen_path;
use serde_json::{json, Value};

fn script(args: &[&str]) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/responses-turns.py");
    python_json(&[&[path], args].concat())
}

#[test]
fn a_conversation_by_previous_response_id_answers_as_sent_whole_and_prefills_only_what_is_new() {
    let server = Server::start_model(&qwen_path(), &["--ctx", "4096"]);
    let v = script(&[&server.base, "--turns", "4"]);
    assert_eq!(v["all_same"], true, "{v}");
    // Every turn after the first finds at least 90 % of its prompt in memory (the target).
    let least = v["least_cached_share_after_first"].as_f64().unwrap();
    assert!(least >= 0.9, "{v}");
    assert_eq!(v["turns"][3]["streamed"], true);
    server.assert_settles();
}

const TOOLS: &str = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk", max_retries=0, timeout=300)
tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
r = c.responses.create(model="m", input="What is the weather in Paris?", tools=tools, temperature=0,
                       max_output_tokens=80)
calls = [o for o in r.output if o.type == "function_call"]
out = {"calls": [[o.name, json.loads(o.arguments)] for o in calls]}
r2 = c.responses.create(model="m", previous_response_id=r.id, tools=tools, temperature=0, max_output_tokens=60,
                        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                "output": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"}])
out["after"] = r2.output_text
try:
    c.responses.create(model="m", input="hi", previous_response_id="resp_never")
    out["unknown"] = None
except openai.NotFoundError as e:
    out["unknown"] = [e.status_code, e.body["param"]]
r3 = c.responses.create(model="m", input="Say hi.", store=False, temperature=0, max_output_tokens=8)
try:
    c.responses.create(model="m", input="again", previous_response_id=r3.id)
    out["unstored"] = None
except openai.NotFoundError as e:
    out["unstored"] = e.status_code
print(json.dumps(out))
"#;

#[test]
fn function_calls_go_out_as_items_and_their_output_comes_back_and_unstored_responses_are_404s() {
    let server = Server::start_model(&qwen_path(), &["--ctx", "2048"]);
    let v = python_json(&["-c", TOOLS, &server.base]);
    assert_eq!(
        v["calls"],
        json!([["get_weather", {"city": "Paris"}]]),
        "{v}"
    );
    assert!(
        v["after"].as_str().unwrap_or_default().contains("18"),
        "{v}"
    );
    assert_eq!(v["unknown"], json!([404, "previous_response_id"]), "{v}");
    assert_eq!(v["unstored"], 404, "{v}");
    server.assert_settles();
}

const RETRIEVE_DELETE: &str = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-test", max_retries=0, timeout=300)
r = c.responses.create(model="m", input="Say hi.", temperature=0, max_output_tokens=8)
out = {"id": r.id, "text": r.output_text}
got = c.responses.retrieve(r.id)
out["retrieved"] = [got.id, got.output_text, got.usage.output_tokens == r.usage.output_tokens]
out["deleted"] = c.responses.delete(r.id) is None
def status(f):
    try:
        f()
        return 200
    except openai.APIStatusError as e:
        return e.status_code
out["after"] = [status(lambda: c.responses.retrieve(r.id)),
                status(lambda: c.responses.delete(r.id)),
                status(lambda: c.responses.create(model="m", input="More.", previous_response_id=r.id,
                                                  max_output_tokens=4))]
print(json.dumps(out))
"#;

#[test]
fn a_stored_response_is_retrieved_as_it_was_sent_and_once_deleted_is_a_404() {
    let server = Server::start(&["--ctx", "512"]);
    let v = python_json(&["-c", RETRIEVE_DELETE, &server.base]);
    assert_eq!(v["retrieved"], json!([v["id"], v["text"], true]), "{v}");
    assert_eq!(v["deleted"], true, "{v}");
    assert_eq!(v["after"], json!([404, 404, 404]), "{v}");
    server.assert_settles();
}

#[test]
fn retrieving_or_deleting_a_hostile_id_is_a_404_in_one_line() {
    let server = Server::start(&["--ctx", "512"]);
    let agent = ureq::AgentBuilder::new().build();
    let id = format!("resp_{}%0Aforged%20line{}", "x".repeat(2000), "%E2%80%AE");
    for method in ["GET", "DELETE"] {
        let url = server.url(&format!("/v1/responses/{id}"));
        let (code, text) = match agent.request(method, &url).call() {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
            Err(e) => panic!("{method}: {e}"),
        };
        assert_eq!(code, 404, "{method}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.starts_with("no stored response"), "{msg}");
        assert!(!msg.contains('\n') && msg.len() < 300, "{method}: {msg}");
    }
    server.assert_settles();
}
