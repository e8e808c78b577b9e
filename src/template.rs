//! Chat templates: the model's own Jinja template (`tokenizer.chat_template`), rendered with minijinja
//! in its sandbox, with named fallbacks for models that ship none.
//!
//! A template is a program from the model file or the command line, so it runs under limits: fuel
//! (instructions), a recursion depth, an output size, and a wall-clock deadline that Ctrl-C cuts
//! short. A template that trips one of them on a one-message probe is refused when it is loaded.

use anyhow::{anyhow, bail, Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// One turn of a conversation, as chat templates read it (Hugging Face's shape: an assistant's
/// `tool_calls`, a tool's answer with the `tool_call_id` it answers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool message's function name, where the client gave it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

/// A call an assistant made: `{"id", "type": "function", "function": {"name", "arguments"}}`,
/// its arguments a JSON object (templates print them with `tojson`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

impl ToolCall {
    pub fn function(id: String, name: String, arguments: serde_json::Value) -> Self {
        Self {
            id,
            kind: "function",
            function: FunctionCall { name, arguments },
        }
    }
}

/// Named templates for `--chat-template NAME` and for models without one.
pub const NAMED: &[(&str, &str)] = &[
    (
        "chatml",
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    ),
    (
        "llama3",
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
    (
        "llama2",
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '[INST] <<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% elif message['role'] == 'user' %}{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'system' %}{{ '[INST] ' }}{% endif %}{{ message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}",
    ),
    (
        // Gemma's turns (Gemma 3 has no system role: a system message opens the first user turn,
        // as its own template does).
        "gemma",
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\\n' + (ns.system if role == 'user' else '') + message['content'] | trim + '<end_of_turn>\\n' }}{% if role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    ),
];

/// Tokens that end an assistant turn in the common templates.
pub const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
];

/// Instructions a render may run: a base plus a share per message (real templates use a few
/// hundred per message).
const FUEL_BASE: u64 = 200_000;
const FUEL_PER_MESSAGE: u64 = 20_000;
/// Macro and include depth.
const RECURSION_LIMIT: usize = 64;
/// The most text a render may produce.
pub const MAX_OUTPUT: usize = 16 << 20;
/// How long a render may take.
const DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// The memory a render may hold at once (`membudget`), besides twice its messages' bytes (the
/// template's copy of them and the output that repeats them): the output's 16 MiB, with room.
pub const MEMORY_BUDGET: usize = 64 << 20;

/// `text` as it can be shown inside a one-line message: control characters escaped, at most
/// `max` characters (an ellipsis says the rest was cut).
pub fn one_line(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

/// A writer that fails once more than `left` bytes are written.
struct Capped {
    out: Vec<u8>,
    left: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.left {
            self.left = 0;
            return Err(std::io::Error::other("output limit"));
        }
        self.left -= buf.len();
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

/// A render stopped by one of the limits every template runs under (output, instructions,
/// recursion, memory, time) or by Ctrl-C: a fault of the template (or of the wait), unlike a
/// conversation the template refuses on purpose (`raise_exception`).
#[derive(Debug)]
pub struct OverLimit(pub String);

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OverLimit {}

fn over_limit(why: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(OverLimit(why.into()))
}

/// `strftime_now(fmt)` for templates that print today's date (Llama 3.1's "%d %b %Y",
/// gpt-oss's "%Y-%m-%d"): a fixed, documented date, Friday 26 July 2024, keeps output
/// reproducible; the common format codes give its fields, others stay as written.
fn fixed_date(fmt: &str) -> String {
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str("2024"),
            Some('y') => out.push_str("24"),
            Some('m') => out.push_str("07"),
            Some('d') => out.push_str("26"),
            Some('e') => out.push_str("26"),
            Some('b') | Some('h') => out.push_str("Jul"),
            Some('B') => out.push_str("July"),
            Some('a') => out.push_str("Fri"),
            Some('A') => out.push_str("Friday"),
            Some('j') => out.push_str("208"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    /// Whether `spec` (a `--chat-template` value) names a template that parses and renders, checked
    /// before any model is loaded (placeholder BOS/EOS text stands in for the model's).
    pub fn check_spec(spec: &str) -> Result<()> {
        Self::from_spec(spec, "<s>", "</s>").map(|_| ())
    }

    /// `spec` as the user gives it (`--chat-template`): the name of a built-in template, Jinja text
    /// (it has `{{` or `{%`), or a file holding one. Anything else is a mistyped name.
    pub fn from_spec(spec: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        if let Some((_, src)) = NAMED.iter().find(|(n, _)| *n == spec) {
            return Self::new(src, bos_token, eos_token);
        }
        if spec.contains("{{") || spec.contains("{%") {
            return Self::new(spec, bos_token, eos_token);
        }
        if spec.trim().is_empty() {
            bail!(
                "the chat template '{}' is blank: give a template name, Jinja text or a file",
                one_line(spec, 40)
            );
        }
        let path = std::path::Path::new(spec);
        if std::fs::symlink_metadata(path).is_ok() {
            let text = crate::fsx::read_text(path, MAX_OUTPUT as u64, "chat template file")?;
            return Self::new(&text, bos_token, eos_token);
        }
        let names: Vec<&str> = NAMED.iter().map(|(n, _)| *n).collect();
        let hint = crate::did_you_mean(spec, names.iter().copied());
        bail!(
            "chat template '{}' is not a template name ({}), Jinja text or an existing file{hint}",
            one_line(spec, 80),
            names.join(", ")
        )
    }

    /// A template's Jinja source (the model's own). It must parse, and render a one-message
    /// conversation within the limits.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let t = Self {
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        };
        // Fail at load, not mid-chat, on a template that does not parse or runs away.
        t.env(1)?;
        if let Err(e) = t.render(&[Message::new("user", "Hello")], true) {
            // A template may refuse a conversation shape on purpose (raise_exception); that is
            // not a fault of the template. Running out of a limit is.
            if e.downcast_ref::<OverLimit>().is_some() {
                return Err(e);
            }
        }
        Ok(t)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    fn env(&self, messages: usize) -> Result<Environment<'static>> {
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL_BASE + FUEL_PER_MESSAGE * messages as u64));
        env.set_recursion_limit(RECURSION_LIMIT);
        // Python string methods (.strip(), .startswith(), …) that HF templates use.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { fixed_date(&fmt) });
        env.add_template_owned("chat", self.source.clone())
            .map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        Ok(env)
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the assistant speaks.
    /// Runs on a worker thread under a memory budget (`membudget`), so that a deadline, Ctrl-C
    /// and the budget can end the wait: a render cut off by time stops on its own when its fuel
    /// runs out, one cut off by memory sleeps for good holding at most its budget.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// Whether the template reads a request's `tools` (renders them into the prompt).
    pub fn takes_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// [`Self::render`], with the functions the model may call (OpenAI's `tools` entries, which
    /// templates read as `tools`; none: `tools` is undefined, as without them).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_full(
            messages,
            tools,
            &serde_json::Map::new(),
            add_generation_prompt,
        )
    }

    /// [`Self::render_with_tools`], with variables a request sets for the template (its
    /// `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); the template's own variables
    /// (`messages`, `tools`, …) are not theirs to change.
    pub fn render_full(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
        extra: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.env(messages.len() + tools.len() + extra.len())?;
        let extra = minijinja::Value::from_serialize(extra);
        let messages = messages.to_vec();
        let tools = (!tools.is_empty()).then(|| tools.to_vec());
        let input: usize = messages
            .iter()
            .map(|m| {
                m.role.len()
                    + m.content.len()
                    + m.tool_calls
                        .iter()
                        .map(|c| c.function.name.len() + c.function.arguments.to_string().len())
                        .sum::<usize>()
            })
            .sum::<usize>()
            + tools
                .iter()
                .flatten()
                .map(|t| t.to_string().len())
                .sum::<usize>();
        let budget =
            crate::membudget::Budget::new(MEMORY_BUDGET.saturating_add(input.saturating_mul(2)));
        let (bos, eos) = (self.bos_token.clone(), self.eos_token.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let thread_budget = budget.clone();
        std::thread::Builder::new()
            .name("chat-template".into())
            .spawn(move || {
                let _budget = crate::membudget::Budget::enter(&thread_budget);
                let result = (|| -> Result<String> {
                    let tmpl = env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
                    let mut out = Capped {
                        out: Vec::new(),
                        left: MAX_OUTPUT,
                    };
                    let rendered = tmpl.render_captured_to(
                        context! {
                            messages => messages,
                            tools => tools,
                            add_generation_prompt => add_generation_prompt,
                            bos_token => bos,
                            eos_token => eos,
                            ..extra
                        },
                        &mut out,
                    );
                    if let Err(e) = rendered.map(drop) {
                        if out.left == 0 {
                            return Err(over_limit(format!(
                                "chat template output exceeds the limit of {} MiB",
                                MAX_OUTPUT >> 20
                            )));
                        }
                        if e.kind() == ErrorKind::OutOfFuel {
                            return Err(over_limit(
                                "chat template exceeded its instruction limit (a runaway loop?)",
                            ));
                        }
                        // minijinja's runtime recursion check (`set_recursion_limit`).
                        if e.kind() == ErrorKind::InvalidOperation
                            && e.detail() == Some("recursion limit exceeded")
                        {
                            return Err(over_limit(format!(
                                "chat template exceeded its recursion limit of {RECURSION_LIMIT}"
                            )));
                        }
                        bail!("chat template failed to render: {e}");
                    }
                    String::from_utf8(out.out)
                        .map_err(|_| anyhow!("chat template rendered invalid UTF-8"))
                })();
                let _ = tx.send(result);
            })
            .context("cannot start the template thread")?;
        let start = std::time::Instant::now();
        let out = loop {
            match rx.recv_timeout(std::time::Duration::from_millis(20)) {
                Ok(r) => break r?,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("chat template rendering failed")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if budget.exceeded() {
                        return Err(over_limit(format!(
                            "chat template needs more than its memory limit of {} MiB (a value that grows without bound?)",
                            budget.limit() >> 20
                        )));
                    }
                    if crate::interrupt::stop_requested() {
                        return Err(over_limit("chat template rendering interrupted"));
                    }
                    if start.elapsed() > DEADLINE {
                        return Err(over_limit(format!(
                            "chat template exceeded its time limit of {} s (deadline)",
                            DEADLINE.as_secs()
                        )));
                    }
                }
            }
        };
        if out.is_empty() {
            bail!("chat template rendered an empty prompt");
        }
        Ok(out)
    }

    /// End-of-turn tokens this template writes.
    pub fn end_of_turn_tokens(&self) -> Vec<&'static str> {
        END_OF_TURN_TOKENS
            .iter()
            .copied()
            .filter(|t| self.source.contains(t))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_now_prints_the_fixed_date_in_the_templates_format() {
        assert_eq!(fixed_date("%d %b %Y"), "26 Jul 2024"); // Llama 3.1's
        assert_eq!(fixed_date("%Y-%m-%d"), "2024-07-26"); // gpt-oss's
        assert_eq!(
            fixed_date("%A %B %e, %y: %Q 100%%"),
            "Friday July 26, 24: %Q 100%"
        );
    }

    #[test]
    fn the_gemma_template_folds_the_system_message_into_the_first_user_turn() {
        let t = ChatTemplate::from_spec("gemma", "<bos>", "<eos>").unwrap();
        let text = t
            .render(
                &[
                    Message::new("system", "Be brief."),
                    Message::new("user", "Hi"),
                    Message::new("assistant", "Hello."),
                    Message::new("user", "Bye"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(t.end_of_turn_tokens(), vec!["<end_of_turn>"]);
    }

    #[test]
    fn a_model_template_that_recurses_without_end_is_refused_as_over_its_limit() {
        let src = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        let e = ChatTemplate::new(src, "<s>", "</s>").unwrap_err();
        assert!(e.downcast_ref::<OverLimit>().is_some(), "{e:#}");
        assert_eq!(
            e.to_string(),
            format!("chat template exceeded its recursion limit of {RECURSION_LIMIT}")
        );
    }

    #[test]
    fn a_model_template_that_refuses_a_conversation_on_purpose_still_loads() {
        let src = "{% if messages|length < 2 %}{{ raise_exception('needs two') }}{% endif %}x";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let e = t.render(&[Message::new("user", "Hi")], true).unwrap_err();
        assert!(e.downcast_ref::<OverLimit>().is_none(), "{e:#}");
        assert!(e.to_string().contains("needs two"), "{e:#}");
    }
}
