//! Preparing a request for the scheduler, on threads of its own: the prompt rendered with the
//! chat template and tokenized, checked against the context, its `max_tokens` fitted. A request
//! that takes long to prepare (a long conversation, a slow template) delays no other request's
//! tokens: the scheduler's thread only ever sees token ids.

use super::api::{ApiError, Prompt};
use super::tools::Offered;
use crate::engine::Engine;
use crate::grammar::{Constraint, Grammar};
use crate::reasoning;
use crate::sched::Ticket;
use crate::template::ChatTemplate;
use crate::toolcall::grammar::Plan;
use crate::toolcall::{self, Choice, Format, Tool};
use std::sync::mpsc::Receiver;
use std::sync::Mutex;

/// Threads that prepare requests.
pub const THREADS: usize = 2;

/// A request's prompt as token ids, and how many tokens its answer may take; with its place in
/// the scheduler's queue, held from before it was prepared until the scheduler takes it.
#[derive(Debug)]
pub struct Prepared {
    pub ids: Vec<u32>,
    pub max_tokens: usize,
    pub ticket: Ticket,
    /// How the model writes tool calls, where the request offers tools.
    pub tool_format: Option<&'static Format>,
    /// A thinking model's reasoning markers, and whether the prompt opened its reasoning.
    pub thinking: Option<(&'static reasoning::Markers, bool)>,
    /// The grammar its answer keeps to (`response_format`, `tool_choice`), compiled.
    pub constraint: Option<Constraint>,
    /// The model speaks Harmony (gpt-oss): its answer is read by channels, markers kept.
    pub harmony: bool,
}

/// A prompt to prepare, its place in the queue, and where its answer goes.
pub struct Order {
    pub prompt: Prompt,
    pub offered: Offered,
    /// What a text answer must be (`response_format`).
    pub answer: Option<Grammar>,
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub max_tokens: Option<usize>,
    pub ticket: Ticket,
    pub reply: tokio::sync::oneshot::Sender<Result<Prepared, ApiError>>,
}

/// What preparing needs: the model's tokenizer and context, its chat template (or why there is
/// none), the server's default answer length.
pub struct Preparer<'e> {
    pub engine: &'e Engine,
    pub template: Result<ChatTemplate, String>,
    pub default_max_tokens: usize,
    /// The template is a Harmony model's (gpt-oss): its answers are read by channels.
    pub harmony: bool,
}

impl Preparer<'_> {
    /// Answers orders until every sender is gone; `THREADS` threads may share `orders`.
    pub fn serve(&self, orders: &Mutex<Receiver<Order>>) {
        loop {
            let order = {
                let rx = orders.lock().unwrap_or_else(|p| p.into_inner());
                rx.recv()
            };
            let Ok(order) = order else { return };
            // A client gone while its order waited is not prepared (its place goes with it).
            if order.reply.is_closed() {
                continue;
            }
            // A fault in preparing one request (a template's, say) answers that request alone.
            let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let prepared = self.prepare(
                    &order.prompt,
                    &order.offered.tools,
                    &order.template_kwargs,
                    order.max_tokens,
                )?;
                let constraint =
                    self.constrain(&order.offered, order.answer.as_ref(), prepared.2)?;
                Ok((prepared, constraint))
            }))
            .unwrap_or_else(|_| {
                Err(ApiError::new(
                    500,
                    "server_error",
                    "preparing this request's prompt failed inside kvchat",
                ))
            });
            let harmony = self.harmony;
            let answer =
                prepared.map(
                    |((ids, max_tokens, tool_format, thinking), constraint)| Prepared {
                        ids,
                        max_tokens,
                        ticket: order.ticket,
                        tool_format,
                        thinking,
                        constraint,
                        harmony,
                    },
                );
            let _ = order.reply.send(answer);
        }
    }

    /// The grammar an answer keeps to: the calls `tool_choice` asks for in the model's format
    /// (`tool_format`), the text `response_format` asks for, both, or none. An error names the
    /// part of the request that cannot be honoured.
    fn constrain(
        &self,
        offered: &Offered,
        answer: Option<&Grammar>,
        tool_format: Option<&'static Format>,
    ) -> Result<Option<Constraint>, ApiError> {
        let calls = !offered.tools.is_empty() && offered.choice != Choice::None;
        if !calls && answer.is_none() {
            return Ok(None);
        }
        let param = if calls { "tools" } else { "response_format" };
        let grammars = self
            .engine
            .grammars()
            .map_err(|e| ApiError::field(param, crate::first_line(e)))?;
        let term = |text: &str| grammars.term(text);
        let plan = toolcall::grammar::plan(
            tool_format,
            &offered.tools,
            &offered.choice,
            offered.parallel,
            answer,
            &term,
        )
        .map_err(|e| ApiError::field("tool_choice", e))?;
        let refused = |e: anyhow::Error| {
            ApiError::field(
                param,
                format!("'{param}' cannot be honoured: {}", crate::first_line(e)),
            )
        };
        match plan {
            Plan::Free => Ok(None),
            Plan::Whole(g) => grammars.compile(&g).map(Some).map_err(refused),
            Plan::Lazy { grammar, trigger } => match grammars.token_of(&trigger) {
                Some(token) => grammars
                    .compile_lazy(&grammar, token)
                    .map(Some)
                    .map_err(refused),
                // The opening is no single token: calls are read and checked after the fact.
                None => Ok(None),
            },
        }
    }

    /// The prompt's token ids, how many tokens the answer may take, and (where `tools` are
    /// offered) how the model writes its calls.
    #[allow(clippy::type_complexity)]
    pub fn prepare(
        &self,
        prompt: &Prompt,
        tools: &[Tool],
        template_kwargs: &serde_json::Map<String, serde_json::Value>,
        max_tokens: Option<usize>,
    ) -> Result<
        (
            Vec<u32>,
            usize,
            Option<&'static Format>,
            Option<(&'static reasoning::Markers, bool)>,
        ),
        ApiError,
    > {
        let ctx = self.engine.ctx();
        let tools: Vec<serde_json::Value> = tools.iter().map(Tool::for_template).collect();
        let tools_len: usize = tools.iter().map(|t| t.to_string().len()).sum();
        let text_len = tools_len
            + match prompt {
                Prompt::Text(t) => t.len(),
                Prompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
            };
        let too_long = |n: &str| {
            ApiError::bad(format!(
                "the prompt is {n}, which does not fit the context of {ctx} tokens"
            ))
            .with_code("context_length_exceeded")
        };
        // Refused by its bytes before it is tokenized (all messages together).
        if self.engine.tokenizer().min_tokens(text_len) >= ctx {
            return Err(too_long(&format!("{text_len} bytes")));
        }
        let (mut tool_format, mut thinking) = (None, None);
        let ids = match prompt {
            Prompt::Text(t) => self
                .engine
                .raw_prompt(t)
                .map_err(|e| ApiError::bad(crate::first_line(e)))?,
            Prompt::Chat(messages) => {
                let template = self
                    .template
                    .as_ref()
                    .map_err(|why| ApiError::bad(why.clone()))?;
                if !tools.is_empty() {
                    tool_format = Some(self.tool_format(template, &tools, messages)?);
                }
                thinking = reasoning::for_template(template.source()).map(|m| (m, false));
                self.engine
                    .chat_prompt_with_tools(template, messages, &tools, template_kwargs)
                    .map_err(|e| {
                        ApiError::bad(format!(
                            "the chat template cannot render these messages: {}",
                            crate::first_line(e)
                        ))
                    })?
            }
        };
        if ids.is_empty() {
            return Err(ApiError::bad(
                "the prompt is empty once rendered and tokenized: there is nothing to continue",
            ));
        }
        if ids.len() >= ctx {
            return Err(too_long(&format!("{} tokens", ids.len())));
        }
        let room = ctx - ids.len();
        let max_tokens = max_tokens.unwrap_or(self.default_max_tokens).min(room);
        // A template that opens the reasoning for the model: its answer begins inside it.
        if let Some((markers, inside)) = &mut thinking {
            *inside = reasoning::prompt_opens(self.engine.tokenizer(), &ids, markers);
        }
        Ok((ids, max_tokens, tool_format, thinking))
    }

    /// The format this model writes tool calls in; refused where its template does not show the
    /// tools to it, kvchat does not know its format, or the tools or earlier calls hold
    /// control-token text (only message content is kept literal).
    fn tool_format(
        &self,
        template: &ChatTemplate,
        tools: &[serde_json::Value],
        messages: &[crate::template::Message],
    ) -> Result<&'static Format, ApiError> {
        if !template.takes_tools() {
            return Err(ApiError::field(
                "tools",
                "this model's chat template does not show tools to the model (it never reads 'tools'); start the server with a --chat-template that does",
            ));
        }
        let format = toolcall::for_template(template.source()).ok_or_else(|| {
            let known: Vec<&str> = toolcall::FORMATS.iter().map(|f| f.name).collect();
            ApiError::field(
                "tools",
                format!(
                    "kvchat does not know how this model writes tool calls (its chat template is none of: {})",
                    known.join(", ")
                ),
            )
        })?;
        let texts = tools.iter().map(|t| t.to_string()).chain(
            messages
                .iter()
                .flat_map(|m| &m.tool_calls)
                .map(|c| c.function.arguments.to_string()),
        );
        for text in texts {
            if self.engine.tokenizer().has_special_text(&text) {
                return Err(ApiError::field(
                    "tools",
                    "a tool definition or call holds control-token text, which would not stay text in the prompt",
                ));
            }
        }
        Ok(format)
    }
}
