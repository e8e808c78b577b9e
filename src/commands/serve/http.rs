//! The HTTP side of `kvchat serve`: routes, the API key, body limits, and turning the
//! scheduler's events into a JSON answer or a stream of server-sent events. It only moves bytes:
//! a request takes a place in the scheduler's queue, goes to the preparing threads (template,
//! tokenizer), then to the scheduler as token ids; tokens come back over a channel per request.

use super::api::{self, ApiError, Endpoint, Head};
use super::metrics::Metrics;
use super::prepare::{Order, Prepared};
use super::tools;
use crate::sched::{Event, Failure, Job, Queue};
use crate::toolcall::{self, Piece};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The largest request body read.
pub const MAX_BODY: usize = 8 << 20;
/// How long a client may take to send a request's body (slow clients hold a connection, never
/// the engine).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of request bodies held at once, from their first byte read until their prompt is
/// prepared, beyond each body's first [`FREE_BODY`] bytes. Past it a large body waits up to
/// [`BUDGET_WAIT`] for a share, then gets a 503: a flood of large bodies costs this much memory,
/// not their count times [`MAX_BODY`].
pub const BODY_BUDGET: usize = 64 << 20;
/// The bytes of each body that need no share of the budget (the connection cap bounds them:
/// 512 × 64 KiB), so that an ordinary request never waits for large ones.
pub const FREE_BODY: usize = 64 << 10;
/// How long a large body waits for its share of the budget.
pub const BUDGET_WAIT: Duration = Duration::from_secs(1);
/// Large bodies read into JSON values at once. As values, JSON takes up to ~30 times its bytes (8
/// MiB of `{}` is ~270 MB), so this, not the body budget, bounds what their reading costs.
pub const LARGE_PARSES: usize = 2;
/// How long a large body waits for its turn to be read.
pub const PARSE_WAIT: Duration = Duration::from_secs(10);

/// What every handler shares.
pub struct App {
    /// The scheduler's queue (its places bound the requests being prepared or waiting).
    pub queue: Queue,
    /// The threads that render and tokenize prompts.
    pub prepare: Sender<Order>,
    pub api_key: Option<String>,
    /// The model's name, as /v1/models lists it and responses echo it.
    pub model: String,
    pub started: u64,
    pub metrics: Arc<Metrics>,
    /// [`BODY_BUDGET`]'s bytes, as permits.
    bodies: Arc<Semaphore>,
    /// [`LARGE_PARSES`] turns.
    parses: Arc<Semaphore>,
    next: AtomicU64,
}

impl App {
    pub fn new(
        queue: Queue,
        prepare: Sender<Order>,
        api_key: Option<String>,
        model: String,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            queue,
            prepare,
            api_key,
            model,
            started: now(),
            metrics,
            bodies: Arc::new(Semaphore::new(BODY_BUDGET)),
            parses: Arc::new(Semaphore::new(LARGE_PARSES)),
            next: AtomicU64::new(1),
        }
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.body())).into_response()
    }
}

/// The API key, where one is set: `Authorization: Bearer KEY`.
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(
            ApiError::new(401, "invalid_request_error", "incorrect API key")
                .with_code("invalid_api_key"),
        ),
        None => Err(ApiError::new(
            401,
            "invalid_request_error",
            "no API key: send the header 'Authorization: Bearer KEY'",
        )
        .with_code("invalid_api_key")),
    }
}

/// Compares without stopping at the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn not_found() -> Response {
    ApiError::new(404, "invalid_request_error", "no such endpoint").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        405,
        "invalid_request_error",
        "this endpoint does not take that method",
    )
    .into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    axum::Json(json!({"object": "list", "data": [
        {"id": app.model, "object": "model", "created": app.started, "owned_by": "kvchat"}
    ]}))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, headers, body, Endpoint::Chat).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, headers, body, Endpoint::Completions).await
}

/// A body's share of [`BODY_BUDGET`]: the bytes past its first [`FREE_BODY`] it may hold. When
/// the last share goes back, the freed memory goes back to the system.
struct BodyShare {
    budget: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
    /// Bytes the body may hold now.
    covered: usize,
}

impl BodyShare {
    fn new(budget: Arc<Semaphore>) -> Self {
        Self {
            budget,
            permit: None,
            covered: FREE_BODY,
        }
    }

    /// Lets the body hold `bytes`, waiting up to [`BUDGET_WAIT`] for the share; a 503 if none came.
    async fn cover(&mut self, bytes: usize) -> Result<(), ApiError> {
        if bytes <= self.covered {
            return Ok(());
        }
        let more = (bytes - self.covered).next_multiple_of(FREE_BODY);
        let got = tokio::time::timeout(
            BUDGET_WAIT,
            self.budget.clone().acquire_many_owned(more as u32),
        )
        .await;
        let Ok(Ok(permit)) = got else {
            return Err(ApiError::new(
                503,
                "server_error",
                format!(
                    "the server is receiving too many large request bodies at once (its budget is {} MiB); retry in a second",
                    BODY_BUDGET >> 20
                ),
            ));
        };
        match &mut self.permit {
            Some(held) => held.merge(permit),
            None => self.permit = Some(permit),
        }
        self.covered += more;
        Ok(())
    }
}

impl Drop for BodyShare {
    fn drop(&mut self) {
        if self.permit.take().is_some() && self.budget.available_permits() == BODY_BUDGET {
            // The last large body is gone: what it and its parse took goes back to the system
            // (the allocator keeps freed memory otherwise; main.rs).
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn_blocking(crate::membudget::release_free_memory)),
                Err(_) => crate::membudget::release_free_memory(),
            }
        }
    }
}

/// Reads the body within its limits of size, time and the budget of bodies held at once.
async fn read_body(
    body: Body,
    announced: Option<u64>,
    budget: &Arc<Semaphore>,
) -> Result<(axum::body::Bytes, BodyShare), ApiError> {
    use http_body_util::BodyExt;
    let mut share = BodyShare::new(budget.clone());
    // A body that says its length takes its whole share before a byte of it is read.
    let announced = announced.map_or(0, |n| n as usize);
    share.cover(announced).await?;
    let read = async {
        let mut body = body;
        let mut bytes = Vec::with_capacity(announced);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(body_error)?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if bytes.len() + data.len() > MAX_BODY {
                return Err(too_large());
            }
            share.cover(bytes.len() + data.len()).await?;
            bytes.extend_from_slice(&data);
        }
        Ok(bytes)
    };
    match tokio::time::timeout(BODY_TIMEOUT, read).await {
        Err(_) => Err(ApiError::new(
            408,
            "invalid_request_error",
            format!(
                "the request body took more than {} s to arrive",
                BODY_TIMEOUT.as_secs()
            ),
        )),
        Ok(Err(e)) => Err(e),
        Ok(Ok(b)) => Ok((b.into(), share)),
    }
}

/// A body that could not be read: past the size limit (413), else badly framed or cut short by the
/// client (400, with what was wrong: a chunk size that is not hex, a connection closed early).
fn body_error(e: axum::Error) -> ApiError {
    let inner = e.into_inner();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
    // The innermost cause says what was wrong ("invalid chunk size line"); the outer ones only
    // that a body could not be read.
    let mut cause = inner.to_string();
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return too_large();
        }
        cause = crate::first_line(s);
        source = s.source();
    }
    ApiError::new(
        400,
        "invalid_request_error",
        format!("the request body is malformed or was cut short: {cause}"),
    )
}

fn too_large() -> ApiError {
    ApiError::new(
        413,
        "invalid_request_error",
        format!("the request body is larger than {} MiB", MAX_BODY >> 20),
    )
}

async fn handle(app: Arc<App>, headers: HeaderMap, body: Body, endpoint: Endpoint) -> Response {
    match respond(&app, &headers, body, endpoint).await {
        Ok(r) => r,
        Err(e) => {
            if e.status != 429 && e.status < 500 {
                app.metrics.rejected_bad.fetch_add(1, Ordering::Relaxed);
            }
            let retry = e.status == 429 || e.status == 503;
            let mut r = e.into_response();
            if retry {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            r
        }
    }
}

async fn respond(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    authorize(app, headers)?;
    // A body announced larger than the limit is refused before a byte of it is read.
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let (body, share) = read_body(body, announced, &app.bodies).await?;
    let parse = move || match endpoint {
        Endpoint::Chat => api::parse_chat(&body),
        Endpoint::Completions => api::parse_completion(&body),
    };
    // A large body's JSON takes the runtime's one thread for tens of milliseconds (an 8 MiB
    // array of 289,260 messages: its parse and its refusal), so it is read on a blocking thread.
    let request = if share.permit.is_some() {
        let busy = || {
            ApiError::new(
                503,
                "server_error",
                "the server is reading too many large requests at once; retry in a second",
            )
        };
        let turn = tokio::time::timeout(PARSE_WAIT, app.parses.clone().acquire_owned())
            .await
            .map_err(|_| busy())?
            .map_err(|_| busy())?;
        let parsed = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            parse()
        })
        .await;
        parsed.map_err(|_| ApiError::new(500, "server_error", "reading the request failed"))??
    } else {
        parse()?
    };
    let arrived = Instant::now();
    // Admission: a place in the queue, held while the prompt is prepared and while it waits.
    let ticket = app.queue.reserve().map_err(|busy| {
        ApiError::new(
            429,
            "rate_limit_error",
            format!(
                "the server is busy: {} requests are already waiting",
                busy.limit
            ),
        )
    })?;
    let stopped = || ApiError::new(503, "server_error", "the engine has stopped");
    let (reply, prepared) = tokio::sync::oneshot::channel();
    let offered = request.offered;
    let order = Order {
        prompt: request.prompt,
        tools: offered.tools.clone(),
        max_tokens: request.max_tokens,
        ticket,
        reply,
    };
    app.prepare.send(order).map_err(|_| stopped())?;
    let Prepared {
        ids,
        max_tokens,
        ticket,
        tool_format,
    } = prepared.await.map_err(|_| stopped())??;
    // Where the request offers tools, the model's calls are read out of its answer.
    let mut calls = tool_format
        .filter(|_| offered.reads_calls())
        .map(|format| Calls {
            scanner: toolcall::Scanner::new(format),
            parallel: offered.parallel,
            given: 0,
        });
    // The request is token ids now: its body's share of the budget goes back.
    drop(share);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (stream, include_usage) = (request.stream, request.include_usage);
    let job = Job {
        prompt: ids,
        max_tokens,
        sampling: request.sampling,
        stop: request.stop,
        ignore_eos: false,
        events: tx,
        arrived,
        ticket,
    };
    app.queue.submit(job).map_err(|_| stopped())?;
    let (prompt_tokens, cached_tokens) = match rx.recv().await {
        Some(Event::Started {
            prompt_tokens,
            cached_tokens,
        }) => (prompt_tokens, cached_tokens),
        Some(Event::Failed(f)) => return Err(failure(f)),
        _ => {
            return Err(ApiError::new(
                500,
                "server_error",
                "the engine dropped the request",
            ))
        }
    };
    let n = app.next.fetch_add(1, Ordering::Relaxed);
    let id = match endpoint {
        Endpoint::Chat => format!("chatcmpl-{n}"),
        Endpoint::Completions => format!("cmpl-{n}"),
    };
    let created = now();
    if !stream {
        let mut text = String::new();
        loop {
            match rx.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done {
                    reason,
                    completion_tokens,
                }) => {
                    let head = Head {
                        id: &id,
                        model: &app.model,
                        created,
                        endpoint,
                    };
                    let usage = api::usage(prompt_tokens, cached_tokens, completion_tokens);
                    let Some(calls) = calls.as_mut() else {
                        let body = head.response(&text, api::finish_reason(reason), usage);
                        return Ok(axum::Json(body).into_response());
                    };
                    // The answer's text and its calls apart.
                    let mut pieces = calls.scanner.push(&text);
                    pieces.extend(calls.scanner.finish().0);
                    let (mut content, mut made) = (String::new(), Vec::new());
                    for piece in pieces {
                        match piece {
                            Piece::Text(t) => content.push_str(&t),
                            Piece::Call(c) => made.extend(calls.give(&id, &c)),
                        }
                    }
                    let finish = calls.finish_reason(reason);
                    let mut body = head.response(&content, finish, usage);
                    if !made.is_empty() {
                        let message = &mut body["choices"][0]["message"];
                        message["tool_calls"] = Value::Array(made);
                        if content.is_empty() {
                            message["content"] = Value::Null;
                        }
                    }
                    return Ok(axum::Json(body).into_response());
                }
                Some(Event::Failed(f)) => return Err(failure(f)),
                Some(Event::Started { .. }) | None => {
                    return Err(ApiError::new(
                        500,
                        "server_error",
                        "the engine dropped the request",
                    ))
                }
            }
        }
    }
    // Streamed: a chunk per text piece, a last chunk with the finish reason, the usage chunk if
    // asked, then [DONE]. The stream owns the receiver: a client that goes drops it, and the
    // engine sees the channel closed and ends the sequence.
    let model = app.model.clone();
    let events = async_stream(rx, move |ev, mut first| {
        let head = Head {
            id: &id,
            model: &model,
            created,
            endpoint,
        };
        // A tool call's pieces, as chunks: text as content, each call whole as a tool delta.
        let chunks = |pieces: Vec<Piece>, calls: &mut Calls, first: &mut bool| {
            let mut out = Vec::new();
            for piece in pieces {
                match piece {
                    Piece::Text(t) => out.push(head.chunk(&t, *first, None).to_string()),
                    Piece::Call(c) => out.extend(
                        calls
                            .give_delta(&id, &c)
                            .map(|d| head.tool_chunk(d, *first).to_string()),
                    ),
                }
                if !out.is_empty() {
                    *first = false;
                }
            }
            out
        };
        match ev {
            Event::Text(t) => match calls.as_mut() {
                None => vec![head.chunk(&t, first, None).to_string()],
                Some(c) => {
                    let pieces = c.scanner.push(&t);
                    chunks(pieces, c, &mut first)
                }
            },
            Event::Done {
                reason,
                completion_tokens,
            } => {
                let (mut out, finish) = match calls.as_mut() {
                    None => (Vec::new(), api::finish_reason(reason)),
                    Some(c) => {
                        let pieces = c.scanner.finish().0;
                        (chunks(pieces, c, &mut first), c.finish_reason(reason))
                    }
                };
                out.push(head.chunk("", first, Some(finish)).to_string());
                if include_usage {
                    let usage = api::usage(prompt_tokens, cached_tokens, completion_tokens);
                    out.push(head.usage_chunk(usage).to_string());
                }
                out.push("[DONE]".to_string());
                out
            }
            Event::Failed(f) => vec![failure(f).body().to_string(), "[DONE]".to_string()],
            Event::Started { .. } => Vec::new(),
        }
    });
    Ok(Sse::new(events).into_response())
}

/// The calls of an answer as they are read out of it, and how many were given to the client.
struct Calls {
    scanner: toolcall::Scanner,
    /// Whether more than one call may be given (`parallel_tool_calls`); past the first, calls are
    /// dropped where not.
    parallel: bool,
    given: usize,
}

impl Calls {
    /// A call as `message.tool_calls` holds it, with an id of its own; None past the one call a
    /// request without parallel calls gets.
    fn give(&mut self, id: &str, call: &toolcall::Call) -> Option<Value> {
        if !self.parallel && self.given > 0 {
            return None;
        }
        self.given += 1;
        Some(tools::call_json(&format!("call_{id}_{}", self.given), call))
    }

    /// The same, as a streamed `delta.tool_calls` entry (its index counts from 0).
    fn give_delta(&mut self, id: &str, call: &toolcall::Call) -> Option<Value> {
        let json = self.give(id, call)?;
        let mut delta = tools::call_delta(self.given - 1, "", call);
        delta["id"] = json["id"].clone();
        Some(delta)
    }

    /// `tool_calls` where a call was given, else why the answer ended.
    fn finish_reason(&self, reason: crate::session::StopReason) -> &'static str {
        if self.given > 0 {
            "tool_calls"
        } else {
            api::finish_reason(reason)
        }
    }
}

/// The SSE events of a request's engine events: `render(event, first)` gives each one's data
/// lines (`first`: no text chunk was sent before).
fn async_stream(
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    mut render: impl FnMut(Event, bool) -> Vec<String> + Send + 'static,
) -> impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>> + Send + 'static {
    use futures_util::StreamExt;
    let mut first = true;
    // The stream ends when the engine drops the sender: after Done or Failed.
    futures_util::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) },
    )
    .flat_map(move |ev| {
        let lines = render(ev, first);
        if !lines.is_empty() {
            first = false;
        }
        futures_util::stream::iter(lines.into_iter().map(|l| Ok(SseEvent::default().data(l))))
    })
}

/// A job's failure as the API words it: refused as asked (400), or the engine's fault (500).
fn failure(f: Failure) -> ApiError {
    match f {
        Failure::Refused(why) => ApiError::bad(why),
        Failure::Engine(why) => ApiError::new(500, "server_error", why),
    }
}
