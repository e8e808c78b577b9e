//! The answer to a started request, in its API's shape: OpenAI's chat and text completions
//! (whole, or chunks ending in `[DONE]`), Anthropic's messages (whole, or named events), OpenAI's
//! responses (whole, or `response.*` events, and stored for `previous_response_id`). Each reads
//! the scheduler's events for the request and the calls in its text (`tools::Calls`).

use super::api::{self, ApiError, Endpoint, Head};
use super::http::{dropped, failure, now, App, Started};
use super::messages;
use super::responses;
use super::tools::{self, Calls};
use crate::reasoning::{Part, Splitter};
use crate::toolcall::harmony::{self, Channels};

/// How an answer's reasoning is told from the rest: a thinking model's markers, or Harmony's
/// channels (which also carry its calls).
#[derive(Debug)]
pub enum Reader {
    Think(Splitter),
    Harmony(Channels),
}
use crate::sched::{Done, Event};
use crate::toolcall::Piece;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// The whole answer's text, and why and after how many tokens it ended.
async fn whole(rx: &mut UnboundedReceiver<Event>) -> Result<(String, Done), ApiError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done(done)) => return Ok((text, done)),
            Some(Event::Failed(f)) => return Err(failure(f)),
            Some(Event::Started { .. }) | None => return Err(dropped()),
        }
    }
}

/// A piece of a started answer: its reasoning, or its text or a call.
enum Bit {
    Reasoning(String),
    Piece(Piece),
}

/// What the answer's next text adds (`None`: the answer ended): a thinking model's reasoning
/// apart first (`reasoning::Splitter`), then calls read out of the rest (`tools::Calls`); all
/// text where the request offers no tools and the model does not think.
fn read(reasoning: &mut Option<Reader>, calls: &mut Option<Calls>, text: Option<&str>) -> Vec<Bit> {
    if let Some(Reader::Harmony(h)) = reasoning.as_mut() {
        let parts = match text {
            Some(t) => h.push(t),
            None => h.finish(),
        };
        return parts
            .into_iter()
            .map(|p| match p {
                harmony::Part::Reasoning(r) => Bit::Reasoning(r),
                // A call where the request reads none (tool_choice none): its arguments as text.
                harmony::Part::Piece(Piece::Call(c)) if calls.is_none() => {
                    Bit::Piece(Piece::Text(c.arguments.to_string()))
                }
                harmony::Part::Piece(p) => Bit::Piece(p),
            })
            .collect();
    }
    let splitter = match reasoning.as_mut() {
        Some(Reader::Think(s)) => Some(s),
        _ => None,
    };
    let parts = match (splitter, text) {
        (Some(r), Some(t)) => r.push(t),
        (Some(r), None) => r.finish(),
        (None, Some(t)) => vec![Part::Answer(t.to_string())],
        (None, None) => Vec::new(),
    };
    let mut out = Vec::new();
    for part in parts {
        match (part, calls.as_mut()) {
            (Part::Reasoning(r), _) => out.push(Bit::Reasoning(r)),
            (Part::Answer(a), Some(c)) => {
                out.extend(c.scanner.push(&a).into_iter().map(Bit::Piece))
            }
            (Part::Answer(a), None) => out.push(Bit::Piece(Piece::Text(a))),
        }
    }
    if text.is_none() {
        if let Some(c) = calls.as_mut() {
            out.extend(c.scanner.finish().0.into_iter().map(Bit::Piece));
        }
    }
    out
}

/// What an engine event adds to the answer: its text's bits, or (done) what was held.
fn read_event(reasoning: &mut Option<Reader>, calls: &mut Option<Calls>, ev: &Event) -> Vec<Bit> {
    match ev {
        Event::Text(t) => read(reasoning, calls, Some(t)),
        Event::Done(_) => read(reasoning, calls, None),
        _ => Vec::new(),
    }
}

/// The whole answer read: its bits in order.
fn read_whole(s: &mut Started, text: &str) -> Vec<Bit> {
    let mut bits = read(&mut s.reasoning, &mut s.calls, Some(text));
    bits.extend(read(&mut s.reasoning, &mut s.calls, None));
    bits
}

/// An OpenAI answer: the whole response, or a chunk per text piece (and a tool delta per call),
/// a last chunk with the finish reason, the usage chunk if asked, then `[DONE]`.
pub(super) async fn openai(
    app: &Arc<App>,
    mut s: Started,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let id = match endpoint {
        Endpoint::Chat => format!("chatcmpl-{}", s.n),
        Endpoint::Completions => format!("cmpl-{}", s.n),
    };
    let n = s.n;
    let call_id = move |k: usize| format!("call_{n}_{k}");
    let created = now();
    let (prompt_tokens, cached_tokens) = (s.prompt_tokens, s.cached_tokens);
    if !s.stream {
        let (text, done) = whole(&mut s.rx).await?;
        let head = Head {
            id: &id,
            model: &app.model,
            created,
            endpoint,
        };
        let usage = api::usage(prompt_tokens, cached_tokens, done.completion_tokens);
        let (mut content, mut made, mut thought) = (String::new(), Vec::new(), String::new());
        for bit in read_whole(&mut s, &text) {
            match bit {
                Bit::Reasoning(r) => thought.push_str(&r),
                Bit::Piece(Piece::Text(t)) => content.push_str(&t),
                Bit::Piece(Piece::Call(c)) => {
                    if let Some(k) = s.calls.as_mut().and_then(Calls::take) {
                        made.push(tools::call_json(&call_id(k), &c));
                    }
                }
            }
        }
        let finish = match &s.calls {
            Some(c) => c.finish_reason(done.reason),
            None => api::finish_reason(done.reason),
        };
        let mut body = head.response(&content, finish, usage);
        if !thought.is_empty() {
            body["choices"][0]["message"]["reasoning_content"] = Value::String(thought);
        }
        if !made.is_empty() {
            let message = &mut body["choices"][0]["message"];
            message["tool_calls"] = Value::Array(made);
            if content.is_empty() {
                message["content"] = Value::Null;
            }
        }
        return Ok(axum::Json(body).into_response());
    }
    // The stream owns the receiver: a client that goes drops it, and the engine sees the channel
    // closed and ends the sequence.
    let (model, include_usage, mut calls) = (app.model.clone(), s.include_usage, s.calls);
    let mut reasoning = s.reasoning;
    let mut first = true;
    let events = events_of(s.rx, move |ev| {
        let head = Head {
            id: &id,
            model: &model,
            created,
            endpoint,
        };
        let mut out = Vec::new();
        let mut chunk = |out: &mut Vec<Value>, bit: Bit, calls: &mut Option<Calls>| {
            match bit {
                Bit::Reasoning(r) => out.push(head.reasoning_chunk(&r, first)),
                Bit::Piece(Piece::Text(t)) => out.push(head.chunk(&t, first, None)),
                Bit::Piece(Piece::Call(c)) => {
                    let Some(k) = calls.as_mut().and_then(Calls::take) else {
                        return;
                    };
                    let delta = tools::call_delta(k - 1, &call_id(k), &c);
                    out.push(head.tool_chunk(delta, first));
                }
            }
            first = false;
        };
        for bit in read_event(&mut reasoning, &mut calls, &ev) {
            chunk(&mut out, bit, &mut calls);
        }
        match ev {
            Event::Text(_) => {}
            Event::Done(done) => {
                let finish = match &calls {
                    Some(c) => c.finish_reason(done.reason),
                    None => api::finish_reason(done.reason),
                };
                out.push(head.chunk("", first, Some(finish)));
                if include_usage {
                    let usage = api::usage(prompt_tokens, cached_tokens, done.completion_tokens);
                    out.push(head.usage_chunk(usage));
                }
                let mut events: Vec<SseEvent> = out.iter().map(data_event).collect();
                events.push(SseEvent::default().data("[DONE]"));
                return events;
            }
            Event::Failed(f) => {
                return vec![
                    data_event(&failure(f).body()),
                    SseEvent::default().data("[DONE]"),
                ]
            }
            Event::Started { .. } => {}
        }
        out.iter().map(data_event).collect()
    });
    Ok(Sse::new(events).into_response())
}

fn data_event(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// An Anthropic Messages answer: the whole message, or its named events (`message_start`, a
/// block's start, deltas and stop per text run or call, `message_delta`, `message_stop`).
pub(super) async fn messages(app: &Arc<App>, mut s: Started) -> Result<Response, ApiError> {
    let id = format!("msg_{}", s.n);
    let n = s.n;
    let tool_id = move |k: usize| format!("toolu_{n}_{k}");
    let (prompt_tokens, cached_tokens) = (s.prompt_tokens, s.cached_tokens);
    if !s.stream {
        let (text, done) = whole(&mut s.rx).await?;
        let mut content = Vec::new();
        for bit in read_whole(&mut s, &text) {
            let piece = match bit {
                Bit::Piece(p) => p,
                Bit::Reasoning(r) => {
                    match content.last_mut() {
                        Some(Value::Object(b)) if b["type"] == "thinking" => {
                            let joined =
                                format!("{}{r}", b["thinking"].as_str().unwrap_or_default());
                            b.insert("thinking".into(), Value::String(joined));
                        }
                        _ => content
                            .push(json!({"type": "thinking", "thinking": r, "signature": ""})),
                    }
                    continue;
                }
            };
            match piece {
                Piece::Text(t) => match content.last_mut() {
                    Some(Value::Object(b)) if b["type"] == "text" => {
                        let joined = format!("{}{t}", b["text"].as_str().unwrap_or_default());
                        b.insert("text".into(), Value::String(joined));
                    }
                    _ => content.push(json!({"type": "text", "text": t})),
                },
                Piece::Call(c) => {
                    if let Some(k) = s.calls.as_mut().and_then(Calls::take) {
                        content.push(messages::tool_use(&tool_id(k), &c));
                    }
                }
            }
        }
        let called = s.calls.as_ref().is_some_and(|c| c.given > 0);
        let reason = messages::stop_reason(done.reason, called, done.stop_text.as_deref());
        let usage = messages::usage(prompt_tokens, cached_tokens, done.completion_tokens);
        let body = messages::response(
            &id,
            &app.model,
            content,
            reason,
            done.stop_text.as_deref(),
            usage,
        );
        return Ok(axum::Json(body).into_response());
    }
    // The message as it starts: no content yet, its stop_reason null until message_delta.
    let mut start = messages::response(
        &id,
        &app.model,
        Vec::new(),
        "",
        None,
        messages::usage(prompt_tokens, cached_tokens, 0),
    );
    start["stop_reason"] = Value::Null;
    let begin_event = named_event(
        "message_start",
        &json!({"type": "message_start", "message": start}),
    );
    let (mut calls, mut blocks) = (s.calls, messages::Blocks::default());
    let mut reasoning = s.reasoning;
    let events = events_of(s.rx, move |ev| {
        let mut out = Vec::new();
        let mut add =
            |out: &mut Vec<(&'static str, Value)>, bit: Bit, calls: &mut Option<Calls>| match bit {
                Bit::Reasoning(r) => out.extend(blocks.thinking(&r)),
                Bit::Piece(Piece::Text(t)) => out.extend(blocks.text(&t)),
                Bit::Piece(Piece::Call(c)) => {
                    if let Some(k) = calls.as_mut().and_then(Calls::take) {
                        out.extend(blocks.call(&tool_id(k), &c));
                    }
                }
            };
        for bit in read_event(&mut reasoning, &mut calls, &ev) {
            add(&mut out, bit, &mut calls);
        }
        match ev {
            Event::Text(_) => {}
            Event::Done(done) => {
                out.extend(blocks.close_text());
                let called = calls.as_ref().is_some_and(|c| c.given > 0);
                let reason = messages::stop_reason(done.reason, called, done.stop_text.as_deref());
                out.push((
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": done.stop_text},
                           "usage": {"output_tokens": done.completion_tokens}}),
                ));
                out.push(("message_stop", json!({"type": "message_stop"})));
            }
            Event::Failed(f) => out.push(("error", messages::error_body(&failure(f)))),
            Event::Started { .. } => {}
        }
        out.iter().map(|(name, v)| named_event(name, v)).collect()
    });
    use futures_util::StreamExt;
    let all = futures_util::stream::once(async move { Ok(begin_event) }).chain(events);
    Ok(Sse::new(all).into_response())
}

/// A Responses answer: the response object, or its events (`response.created`, an output item
/// per text run or call with its deltas, `response.completed`); stored, where asked, for a later
/// `previous_response_id`.
pub(super) async fn responses(app: &Arc<App>, mut s: Started) -> Result<Response, ApiError> {
    let (n, created) = (s.n, now());
    let id = format!("resp_{n}");
    let (prompt_tokens, cached_tokens) = (s.prompt_tokens, s.cached_tokens);
    if !s.stream {
        let (text, done) = whole(&mut s.rx).await?;
        let (mut content, mut made, mut thought) = (String::new(), Vec::new(), String::new());
        for bit in read_whole(&mut s, &text) {
            match bit {
                Bit::Reasoning(r) => thought.push_str(&r),
                Bit::Piece(Piece::Text(t)) => content.push_str(&t),
                Bit::Piece(Piece::Call(c)) => {
                    if let Some(k) = s.calls.as_mut().and_then(Calls::take) {
                        made.push((format!("call_{n}_{k}"), c));
                    }
                }
            }
        }
        let mut output = Vec::new();
        if !thought.is_empty() {
            output.push(responses::reasoning_item(&format!("rs_{n}"), &thought));
        }
        if !content.is_empty() || made.is_empty() {
            output.push(responses::message_item(
                &format!("msg_{n}"),
                &content,
                "completed",
            ));
        }
        for (k, (call_id, c)) in made.iter().enumerate() {
            output.push(responses::call_item(
                &format!("fc_{n}_{}", k + 1),
                call_id,
                c,
            ));
        }
        let incomplete = done.reason != crate::session::StopReason::EndOfText;
        let usage = (prompt_tokens, cached_tokens, done.completion_tokens);
        let body = responses::response(&id, &app.model, created, output, incomplete, Some(usage));
        if let Some(keep) = s.keep {
            let conversation = responses::answered(keep, &content, &made);
            app.responses.put(id.clone(), conversation, body.clone());
        }
        return Ok(axum::Json(body).into_response());
    }
    let model = app.model.clone();
    let store = app.responses.clone();
    let (mut calls, mut keep, mut reasoning) = (s.calls, s.keep, s.reasoning);
    // A thinking model's reasoning, given as one item once it ends.
    let (mut thought, mut thought_given) = (String::new(), false);
    let rs_id = format!("rs_{n}");
    // What the stream has said so far: the output items, the open message's text, the count.
    let (mut output, mut text, mut open, mut seq) =
        (Vec::<Value>::new(), String::new(), false, 0u64);
    let mut made: Vec<(String, crate::toolcall::Call)> = Vec::new();
    let msg_id = format!("msg_{n}");
    let begin = responses::response(&id, &model, created, Vec::new(), false, None);
    let event = |seq: &mut u64, kind: &'static str, mut v: Value| {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(*seq);
        *seq += 1;
        named_event(kind, &v)
    };
    let first = vec![
        event(
            &mut seq,
            "response.created",
            json!({"response": begin.clone()}),
        ),
        event(&mut seq, "response.in_progress", json!({"response": begin})),
    ];
    let events = events_of(s.rx, move |ev| {
        let mut out = Vec::new();
        let close_text = |out: &mut Vec<SseEvent>,
                          seq: &mut u64,
                          output: &mut Vec<Value>,
                          text: &str,
                          open: &mut bool| {
            if !*open {
                return;
            }
            *open = false;
            let i = output.len();
            let part = json!({"type": "output_text", "text": text, "annotations": []});
            out.push(event(
                seq,
                "response.output_text.done",
                json!({"item_id": msg_id, "output_index": i, "content_index": 0, "text": text}),
            ));
            out.push(event(
                seq,
                "response.content_part.done",
                json!({"item_id": msg_id, "output_index": i, "content_index": 0, "part": part}),
            ));
            let item = responses::message_item(&msg_id, text, "completed");
            out.push(event(
                seq,
                "response.output_item.done",
                json!({"output_index": i, "item": item}),
            ));
            output.push(item);
        };
        let finished = match &ev {
            Event::Done(done) => Some(done.clone()),
            _ => None,
        };
        let bits = match ev {
            Event::Text(_) | Event::Done(_) => read_event(&mut reasoning, &mut calls, &ev),
            Event::Failed(f) => {
                let e = failure(f);
                return vec![event(
                    &mut seq,
                    "error",
                    json!({"code": e.kind, "message": e.message, "param": e.param}),
                )];
            }
            Event::Started { .. } => Vec::new(),
        };
        let give_thought = |out: &mut Vec<SseEvent>,
                            seq: &mut u64,
                            output: &mut Vec<Value>,
                            thought: &str,
                            given: &mut bool| {
            if *given || thought.is_empty() {
                return;
            }
            *given = true;
            let i = output.len();
            let item = responses::reasoning_item(&rs_id, thought);
            out.push(event(
                seq,
                "response.output_item.added",
                json!({"output_index": i, "item": item}),
            ));
            out.push(event(
                seq,
                "response.output_item.done",
                json!({"output_index": i, "item": item}),
            ));
            output.push(item);
        };
        let mut pieces = Vec::new();
        for bit in bits {
            match bit {
                Bit::Reasoning(r) => thought.push_str(&r),
                Bit::Piece(p) => {
                    give_thought(
                        &mut out,
                        &mut seq,
                        &mut output,
                        &thought,
                        &mut thought_given,
                    );
                    pieces.push(p);
                }
            }
        }
        if finished.is_some() {
            give_thought(
                &mut out,
                &mut seq,
                &mut output,
                &thought,
                &mut thought_given,
            );
        }
        for piece in pieces.drain(..) {
            match piece {
                Piece::Text(t) => {
                    let i = output.len();
                    if !open {
                        open = true;
                        let item = json!({"type": "message", "id": msg_id, "status": "in_progress",
                                          "role": "assistant", "content": []});
                        out.push(event(
                            &mut seq,
                            "response.output_item.added",
                            json!({"output_index": i, "item": item}),
                        ));
                        out.push(event(
                            &mut seq,
                            "response.content_part.added",
                            json!({"item_id": msg_id, "output_index": i, "content_index": 0,
                                   "part": {"type": "output_text", "text": "", "annotations": []}}),
                        ));
                    }
                    text.push_str(&t);
                    out.push(event(&mut seq, "response.output_text.delta",
                        json!({"item_id": msg_id, "output_index": i, "content_index": 0, "delta": t})));
                }
                Piece::Call(c) => {
                    let Some(k) = calls.as_mut().and_then(Calls::take) else {
                        continue;
                    };
                    close_text(&mut out, &mut seq, &mut output, &text, &mut open);
                    let i = output.len();
                    let call_id = format!("call_{n}_{k}");
                    let item = responses::call_item(&format!("fc_{n}_{k}"), &call_id, &c);
                    let mut added = item.clone();
                    added["arguments"] = json!("");
                    added["status"] = json!("in_progress");
                    out.push(event(
                        &mut seq,
                        "response.output_item.added",
                        json!({"output_index": i, "item": added}),
                    ));
                    out.push(event(&mut seq, "response.function_call_arguments.delta",
                        json!({"item_id": item["id"], "output_index": i, "delta": item["arguments"]})));
                    out.push(event(&mut seq, "response.function_call_arguments.done",
                        json!({"item_id": item["id"], "output_index": i, "arguments": item["arguments"]})));
                    out.push(event(
                        &mut seq,
                        "response.output_item.done",
                        json!({"output_index": i, "item": item}),
                    ));
                    output.push(item);
                    made.push((call_id, c));
                }
            }
        }
        if let Some(done) = finished {
            close_text(&mut out, &mut seq, &mut output, &text, &mut open);
            if output.is_empty() {
                output.push(responses::message_item(&msg_id, "", "completed"));
            }
            let incomplete = done.reason != crate::session::StopReason::EndOfText;
            let usage = (prompt_tokens, cached_tokens, done.completion_tokens);
            let body = responses::response(
                &id,
                &model,
                created,
                output.clone(),
                incomplete,
                Some(usage),
            );
            if let Some(keep) = keep.take() {
                let conversation = responses::answered(keep, &text, &made);
                store.put(id.clone(), conversation, body.clone());
            }
            out.push(event(
                &mut seq,
                "response.completed",
                json!({"response": body}),
            ));
        }
        out
    });
    use futures_util::StreamExt;
    let all = futures_util::stream::iter(first.into_iter().map(Ok)).chain(events);
    Ok(Sse::new(all).into_response())
}

fn named_event(name: &str, v: &Value) -> SseEvent {
    SseEvent::default().event(name).data(v.to_string())
}

/// The SSE events of a request's engine events, `render` giving each one's.
fn events_of(
    rx: UnboundedReceiver<Event>,
    mut render: impl FnMut(Event) -> Vec<SseEvent> + Send + 'static,
) -> impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>> + Send + 'static {
    use futures_util::StreamExt;
    // The stream ends when the engine drops the sender: after Done or Failed.
    futures_util::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) },
    )
    .flat_map(move |ev| futures_util::stream::iter(render(ev).into_iter().map(Ok)))
}
