//! The HTTP side of `kvchat serve`: routes, the API key, body limits, and turning the
//! scheduler's events into a JSON answer or a stream of server-sent events. It only moves bytes:
//! a request takes a place in the scheduler's queue, goes to the preparing threads (template,
//! tokenizer), then to the scheduler as token ids; tokens come back over a channel per request.

use super::answers;
use super::answers::Reader;
use super::api::{self, ApiError, Endpoint};
use super::body::{read_body, too_large, BODY_BUDGET, LARGE_PARSES, MAX_BODY, PARSE_WAIT};
use super::messages;
use super::metrics::Metrics;
use super::prepare::{Order, Prepared};
use super::responses;
use super::tools::Calls;
use crate::reasoning::Splitter;
use crate::sched::{Event, Failure, Job, Queue};
use crate::template::Message;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Semaphore;

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
    /// Stored responses (`previous_response_id`).
    pub responses: Arc<responses::Store>,
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
            responses: Arc::default(),
            next: AtomicU64::new(1),
        }
    }
}

pub(super) fn now() -> u64 {
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
        .route("/v1/messages", post(messages_endpoint))
        .route("/v1/responses", post(responses_endpoint))
        .route(
            "/v1/responses/{id}",
            get(stored_response).delete(delete_response),
        )
        .route("/v1/messages/count_tokens", post(count_tokens_endpoint))
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

/// The API key, where one is set: `Authorization: Bearer KEY` or `x-api-key: KEY`.
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    // OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`.
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    match given {
        Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(
            ApiError::new(401, "invalid_request_error", "incorrect API key")
                .with_code("invalid_api_key"),
        ),
        None => Err(ApiError::new(
            401,
            "invalid_request_error",
            "no API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
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
    handle(app, headers, body, Api::OpenAi(Endpoint::Chat)).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    handle(app, headers, body, Api::OpenAi(Endpoint::Completions)).await
}

async fn responses_endpoint(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(app, headers, body, Api::Responses).await
}

async fn count_tokens_endpoint(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(app, headers, body, Api::CountTokens).await
}

/// A stored response as it was sent (`store`), or a 404.
async fn stored_response(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    match app.responses.response(&id) {
        Some(r) => axum::Json(r.as_ref().clone()).into_response(),
        None => no_response(&id).into_response(),
    }
}

/// Forgets a stored response: its conversation can no longer be continued.
async fn delete_response(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    match app.responses.delete(&id) {
        true => {
            axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
        }
        false => no_response(&id).into_response(),
    }
}

fn no_response(id: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        format!(
            "no stored response '{}' (unknown, deleted, stored with store: false, or past the {} kept)",
            crate::template::one_line(id, 40),
            responses::MAX_STORED
        ),
    )
}

async fn messages_endpoint(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(app, headers, body, Api::Messages).await
}

/// Which API a request speaks: OpenAI's (chat or text completions) or Anthropic's Messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    OpenAi(Endpoint),
    Messages,
    Responses,
    /// Anthropic's `/v1/messages/count_tokens`: prepared, counted, never generated.
    CountTokens,
}

/// A request prepared: started by the scheduler, or (count_tokens) only counted. (One per
/// request, moved once: the variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
enum Begun {
    Started(Started),
    Counted(usize),
}

async fn handle(app: Arc<App>, headers: HeaderMap, body: Body, api: Api) -> Response {
    let answered = match start(&app, &headers, body, api).await {
        Ok(Begun::Counted(n)) => Ok(axum::Json(json!({"input_tokens": n})).into_response()),
        Ok(Begun::Started(started)) => match api {
            Api::OpenAi(endpoint) => answers::openai(&app, started, endpoint).await,
            Api::Messages | Api::CountTokens => answers::messages(&app, started).await,
            Api::Responses => answers::responses(&app, started).await,
        },
        Err(e) => Err(e),
    };
    let e = match answered {
        Ok(r) => return r,
        Err(e) => e,
    };
    if e.status != 429 && e.status < 500 {
        app.metrics.rejected_bad.fetch_add(1, Ordering::Relaxed);
    }
    let retry = e.status == 429 || e.status == 503;
    let mut r = match api {
        Api::OpenAi(_) | Api::Responses => e.into_response(),
        Api::Messages | Api::CountTokens => {
            let status =
                StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, axum::Json(messages::error_body(&e))).into_response()
        }
    };
    if retry {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// A request past admission: the scheduler's events for it, what its prompt cost, and the reader
/// of its calls where it offers tools.
pub(super) struct Started {
    pub rx: UnboundedReceiver<Event>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub calls: Option<Calls>,
    pub stream: bool,
    pub include_usage: bool,
    /// The request's number (its ids).
    pub n: u64,
    /// The conversation a stored response keeps (Responses with `store`).
    pub keep: Option<Vec<Message>>,
    /// A thinking model's reasoning, split from its answer before calls are read.
    pub reasoning: Option<Reader>,
}

/// Reads, prepares and admits a request, and waits until the scheduler starts it.
async fn start(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
    api: Api,
) -> Result<Begun, ApiError> {
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
    let store = app.responses.clone();
    let parse = move || match api {
        Api::OpenAi(Endpoint::Chat) => api::parse_chat(&body).map(|r| (r, None)),
        Api::OpenAi(Endpoint::Completions) => api::parse_completion(&body).map(|r| (r, None)),
        Api::Messages => messages::parse(&body).map(|r| (r, None)),
        Api::CountTokens => messages::parse_count(&body).map(|r| (r, None)),
        Api::Responses => responses::parse(&body, &store).map(|p| (p.request, p.keep)),
    };
    // A large body's JSON takes the runtime's one thread for tens of milliseconds (an 8 MiB
    // array of 289,260 messages: its parse and its refusal), so it is read on a blocking thread.
    let (request, keep) = if share.is_large() {
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
        offered: offered.clone(),
        answer: request.answer,
        template_kwargs: request.template_kwargs,
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
        thinking,
        constraint,
        harmony,
    } = prepared.await.map_err(|_| stopped())??;
    // The request is token ids now: its body's share of the budget goes back.
    drop(share);
    if api == Api::CountTokens {
        // Its place in the queue goes back with its ticket.
        return Ok(Begun::Counted(ids.len()));
    }
    // Where the request offers tools, the model's calls are read out of its answer.
    let calls = tool_format
        .filter(|_| offered.reads_calls())
        .map(|format| Calls::new(format, offered.parallel));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        prompt: ids,
        max_tokens,
        sampling: request.sampling,
        stop: request.stop,
        ignore_eos: false,
        keep_special: harmony,
        constraint,
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
        _ => return Err(dropped()),
    };
    Ok(Begun::Started(Started {
        rx,
        prompt_tokens,
        cached_tokens,
        calls,
        stream: request.stream,
        include_usage: request.include_usage,
        n: app.next.fetch_add(1, Ordering::Relaxed),
        keep,
        reasoning: match harmony {
            true => Some(Reader::Harmony(Default::default())),
            false => {
                thinking.map(|(markers, inside)| Reader::Think(Splitter::new(markers, inside)))
            }
        },
    }))
}

pub(super) fn dropped() -> ApiError {
    ApiError::new(500, "server_error", "the engine dropped the request")
}

/// A job's failure as the API words it: refused as asked (400), or the engine's fault (500).
pub(super) fn failure(f: Failure) -> ApiError {
    match f {
        Failure::Refused(why) => ApiError::bad(why),
        Failure::Engine(why) => ApiError::new(500, "server_error", why),
    }
}
