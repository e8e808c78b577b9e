//! Chat templates: the model's own Jinja template (`tokenizer.chat_template`), rendered with minijinja
//! in its sandbox, with named fallbacks for models that ship none.

use anyhow::{anyhow, bail, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
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
];

/// Tokens that end an assistant turn in the common templates.
pub const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
];

#[derive(Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// `spec` is a template text, or the name of a built-in one.
    pub fn new(spec: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let source = NAMED
            .iter()
            .find(|(n, _)| *n == spec)
            .map_or(spec, |(_, s)| *s)
            .to_string();
        let t = Self {
            source,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        };
        // Fail at load, not mid-chat, on a template that does not parse.
        t.env()?;
        Ok(t)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    fn env(&self) -> Result<Environment<'static>> {
        let mut env = Environment::new();
        // Python string methods (.strip(), .startswith(), …) that HF templates use.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            // Templates use this to print today's date; a fixed, documented date keeps output reproducible.
            let _ = fmt;
            "26 Jul 2024".to_string()
        });
        env.add_template_owned("chat", self.source.clone())
            .map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        Ok(env)
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the assistant speaks.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let env = self.env()?;
        let tmpl = env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        let out = tmpl
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| anyhow!("chat template failed to render: {e}"))?;
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
