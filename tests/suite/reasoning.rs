//! A thinking model's reasoning never reaches the answer's content (issue 63): a chat template
//! with `<think>` markers that opens the reasoning for the model puts everything the model says
//! before `</think>` in `reasoning_content` (OpenAI), a thinking block (Anthropic) or a reasoning
//! item (Responses); `chat_template_kwargs` reaches the template (`enable_thinking: false` closes
//! the reasoning in the prompt, and the answer is all content). The tests' model, greedy.

use crate::common::server::Server;
use serde_json::{json, Value};

/// Qwen3's way: reasoning opened in the generation prompt unless `enable_thinking` is false.
const THINKING_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}";

fn ask(server: &Server, path: &str, body: Value) -> Value {
    let (code, v, _) = server.post(path, &body.to_string(), None);
    assert_eq!(code, 200, "{v}");
    v
}

#[test]
fn reasoning_goes_apart_from_content_in_every_api_and_enable_thinking_reaches_the_template() {
    let server = Server::start(&["--ctx", "512", "--chat-template", THINKING_TEMPLATE]);
    let user = json!([{"role": "user", "content": "What is 2 + 2?"}]);
    // The tests' model never closes the reasoning the prompt opened: all of it is reasoning.
    let v = ask(
        &server,
        "/v1/chat/completions",
        json!({"messages": user, "temperature": 0, "max_tokens": 12}),
    );
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], "", "{v}");
    let thought = message["reasoning_content"].as_str().unwrap_or_default();
    assert!(!thought.is_empty(), "{v}");
    // Told not to think, the same model's answer is all content.
    let v = ask(
        &server,
        "/v1/chat/completions",
        json!({"messages": user, "temperature": 0, "max_tokens": 12,
               "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let message = &v["choices"][0]["message"];
    assert!(
        !message["content"].as_str().unwrap_or_default().is_empty(),
        "{v}"
    );
    assert_eq!(message.get("reasoning_content"), None, "{v}");
    // Anthropic's thinking block and the Responses reasoning item hold the same reasoning.
    let v = ask(
        &server,
        "/v1/messages",
        json!({"messages": user, "temperature": 0, "max_tokens": 12}),
    );
    assert_eq!(v["content"][0]["type"], "thinking", "{v}");
    assert_eq!(v["content"][0]["thinking"], thought, "{v}");
    let v = ask(
        &server,
        "/v1/responses",
        json!({"input": user, "temperature": 0, "max_output_tokens": 12}),
    );
    assert_eq!(v["output"][0]["type"], "reasoning", "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], thought, "{v}");
    // Streamed, no piece of it is content.
    let body = json!({"messages": user, "temperature": 0, "max_tokens": 12, "stream": true});
    let (code, v, _) = server.post("/v1/chat/completions", &body.to_string(), None);
    assert_eq!(code, 200);
    let text = v.as_str().unwrap_or_default();
    let (mut reasoning, mut content) = (String::new(), String::new());
    for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(chunk) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert_eq!((reasoning.as_str(), content.as_str()), (thought, ""));
    server.assert_settles();
}
