//! `kvchat serve`: an OpenAI-compatible HTTP server. Many clients, one model, one KV pool.
//!
//! - `api`: the requests and responses' JSON shapes, read and written.
//! - `http`: routes, the API key, a request read, prepared and started (axum on hyper, tokio).
//! - `answers`: a started request's answer in its API's shape, whole or as server-sent events.
//! - `body`: a request's body read within its size, time and the budget all bodies share.
//! - `fields`: what of a request's JSON is read, and counted before it is.
//! - `messages`: Anthropic's Messages API, read into the same request and written back.
//! - `responses`: OpenAI's Responses API and the store `previous_response_id` continues.
//! - `conns`: which connections are let in, and which are closed to make room.
//! - `prepare`: prompts rendered and tokenized, on threads of their own.
//! - `tools`: a request's tools and tool messages read; an answer's calls written.
//! - `metrics`: what `/metrics` says.
//!
//! The scheduler (`crate::sched`: queue, admission into the pool, continuous batching, prefix
//! sharing, stop texts) runs below, on token ids.
//!
//! Threads: the runtime (one thread) only moves bytes; [`prepare::THREADS`] threads render and
//! tokenize; the scheduler's thread runs the model, whose matmuls use candle's pool of
//! `--threads` workers.

pub mod answers;
pub mod api;
pub mod body;
pub mod conns;
pub mod fields;
pub mod http;
pub mod messages;
pub mod metrics;
pub mod prepare;
pub mod responses;
pub mod tools;

use super::{StoreChoice, TemplateChoice};
use crate::engine::{Engine, LoadOptions};
use crate::kv::CacheMode;
use crate::model::sampling::SamplingPrefs;
use crate::sched;
use crate::session::prefix::PrefixReuse;
use crate::source::human_bytes;
use anyhow::{Context, Result};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Connections open at once, of one peer address, and how long an idle one is kept (less as the
/// server fills): see `conns`.
const CONNECTIONS: conns::Limits = conns::Limits {
    total: 512,
    per_peer: 256,
    idle: Duration::from_secs(10),
    min_idle: Duration::from_millis(500),
};
/// How long a client may take to send a request's headers once it has begun them.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a connection buffers of a request's head (a larger head is a 431).
const MAX_HEAD: usize = 64 << 10;
/// Sockets being told "503, full" at once; past it a newcomer is closed without a word.
const REFUSING: usize = 512;
/// How long a refused socket is read from after its 503, so that the client reads the answer
/// rather than a reset.
const REFUSAL_LINGER: Duration = Duration::from_millis(250);
/// Open files the server asks for (connections and refusals, with the model's files): raised to
/// this, or the hard limit if lower, from a soft limit that is often 1,024.
const OPEN_FILES: u64 = 4096;

/// `kvchat serve`, resolved.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub load: LoadOptions,
    pub mode: CacheMode,
    /// Sampling defaults under each request's own settings.
    pub sampling: SamplingPrefs,
    pub template: Option<TemplateChoice>,
    pub addr: SocketAddr,
    /// Most sequences decoding together.
    pub parallel: usize,
    /// The KV pool's bound; None: what the machine can spare.
    pub pool: Option<u64>,
    /// Requests that may wait for room before a 429.
    pub queue: usize,
    /// Required as `Authorization: Bearer KEY`, where set.
    pub api_key: Option<String>,
    /// Tokens an answer gets when its request names no max_tokens.
    pub max_tokens: usize,
    /// Stop serving after this long (scripts and tests).
    pub exit_after: Option<Duration>,
    /// The on-disk prefix store behind the shared blocks.
    pub store: StoreChoice,
}

impl ServeOptions {
    pub fn host(&self) -> IpAddr {
        self.addr.ip()
    }
}

pub fn run(opts: ServeOptions) -> Result<()> {
    let engine = Engine::load(&opts.load)?;
    let spec = engine.cache_spec(&opts.mode, engine.ctx())?;
    let template = engine
        .chat_template(opts.template.as_ref().map(|t| t.spec.as_str()))
        .map_err(|e| {
            format!(
                "the model's chat template cannot be used ({}); start the server with a --chat-template, or use /v1/completions",
                crate::first_line(e)
            )
        });
    // What the machine can spare once the weights are in: half of `available_memory`, itself
    // half of MemAvailable, so a quarter of it (the start line says so).
    let pool = opts
        .pool
        .unwrap_or_else(|| crate::engine::available_memory() / 2);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the server's runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(opts.addr))
        .with_context(|| format!("cannot listen on {}", opts.addr))?;
    let addr = listener.local_addr()?;
    let model = engine
        .path()
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let probe = engine.session(&crate::kv::CacheSpec {
        max_positions: 1,
        ..spec.clone()
    });
    let share_refusal = probe.share_refusal();
    let sharing = match share_refusal {
        None => "prefix sharing on".to_string(),
        Some(why) => format!("prefix sharing off: {why}"),
    };
    let store = match &opts.store {
        StoreChoice::Off(why) => PrefixReuse::off(*why),
        // (Its prefill would have to stop at block ends to snapshot the states, as `run`'s does.)
        StoreChoice::On { .. } if engine.model().cfg.recurrent.is_some() => {
            PrefixReuse::off("a model with recurrent states (the server does not snapshot them)")
        }
        StoreChoice::On { root, budget } => PrefixReuse::open(&engine, &probe, root, *budget),
    };
    drop(probe);
    let on_disk = match (&opts.store, store.is_on()) {
        (StoreChoice::On { root, .. }, true) => format!("prefix store {}", root.display()),
        _ => format!(
            "prefix store off: {}",
            store.off.as_deref().unwrap_or("unusable")
        ),
    };
    eprintln!(
        "kvchat serve: {model} at http://{addr}/v1 — up to {} sequences at once, KV pool {} ({}), cache {}, context {}; {sharing}; {on_disk}",
        opts.parallel,
        human_bytes(pool),
        if opts.pool.is_some() { "--kv-pool" } else { "a quarter of the memory available; --kv-pool sets it" },
        spec.name(),
        engine.ctx(),
    );
    let metrics = Arc::new(metrics::Metrics::default());
    let (queue, inbox) = sched::queue(opts.queue, metrics.sched.clone());
    let (orders, to_prepare) = std::sync::mpsc::channel();
    let app = Arc::new(http::App::new(
        queue,
        orders,
        opts.api_key.clone(),
        model,
        metrics.clone(),
    ));
    let limits = sched::Limits {
        parallel: opts.parallel,
        pool,
        sampling: opts.sampling.clone(),
    };
    let harmony = template
        .as_ref()
        .is_ok_and(|t| crate::toolcall::harmony::is_harmony(t.source()));
    let preparer = prepare::Preparer {
        engine: &engine,
        template,
        default_max_tokens: opts.max_tokens,
        harmony,
    };
    let to_prepare = Mutex::new(to_prepare);
    std::thread::scope(|s| {
        let engine = &engine;
        let counts = metrics.sched.clone();
        s.spawn(move || {
            let prefixes = sched::Prefixes {
                share_refusal,
                store,
            };
            sched::Scheduler::new(engine, spec, prefixes, limits, counts).run(inbox)
        });
        for _ in 0..prepare::THREADS {
            s.spawn(|| preparer.serve(&to_prepare));
        }
        let router = http::router(app);
        let served = runtime.block_on(serve(listener, router, opts.exit_after, &metrics));
        // Dropping the runtime closes every connection; the engine thread then sees each
        // request's channel closed and the job channel gone, and returns.
        drop(runtime);
        eprintln!("kvchat serve: stopped");
        served
    })
}

/// Accepts connections until Ctrl-C, SIGTERM or `exit_after`.
async fn serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    exit_after: Option<Duration>,
    metrics: &metrics::Metrics,
) -> Result<()> {
    raise_open_files();
    let conns = conns::Conns::new(CONNECTIONS);
    let _ = metrics.conns.set(conns.clone());
    let refusing = Arc::new(tokio::sync::Semaphore::new(REFUSING));
    let stop = stop_signal(exit_after);
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: wait, then go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => return Ok(()),
        };
        match conns.admit(peer.ip()) {
            conns::Admission::In(conn) => {
                tokio::spawn(serve_connection(stream, conn, router.clone()));
            }
            conns::Admission::Full(why) => {
                if let Ok(permit) = refusing.clone().try_acquire_owned() {
                    tokio::spawn(async move {
                        let _permit = permit;
                        refuse(stream, why).await;
                    });
                }
            }
        }
    }
}

/// Serves one connection's requests until the client closes it or `conn` must close.
async fn serve_connection(stream: tokio::net::TcpStream, conn: conns::Conn, router: axum::Router) {
    let conn = Arc::new(conn);
    let router = hyper_util::service::TowerToHyperService::new(router);
    let marker = conn.clone();
    let service = hyper::service::service_fn(move |req| {
        // In flight from its headers until its answer's last byte (the body holds the mark).
        let in_flight = marker.request();
        let answer = hyper::service::Service::call(&router, req);
        async move {
            let answer = answer.await?;
            Ok::<_, std::convert::Infallible>(
                answer.map(|body| axum::body::Body::new(conns::Tracked { body, in_flight })),
            )
        }
    });
    let serving = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    // Dropping the connection closes it: done only while it is idle (no request to cut short).
    tokio::select! {
        _ = serving => {}
        _ = conn.must_close() => {}
    }
}

/// Raises the soft limit on open files to [`OPEN_FILES`] (within the hard limit), so that the
/// connection cap, not the file table, is what refuses a flood.
#[cfg(unix)]
fn raise_open_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let want = OPEN_FILES.min(hard);
        if soft < want {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, want, hard);
        }
    }
}

#[cfg(not(unix))]
fn raise_open_files() {}

/// Tells a connection there is no place for it (503, `Retry-After`), then reads what it sent for
/// a moment before closing, so that the client sees the answer rather than a reset.
async fn refuse(mut stream: tokio::net::TcpStream, why: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let moment = REFUSAL_LINGER;
    let told = tokio::time::timeout(moment, stream.write_all(&conns::full_answer(why))).await;
    if !matches!(told, Ok(Ok(()))) || stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(moment, async {
        let mut read = 0;
        while read < MAX_HEAD {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    })
    .await;
}

/// Resolves at Ctrl-C, SIGTERM or after `exit_after`.
async fn stop_signal(exit_after: Option<Duration>) {
    let deadline = async {
        match exit_after {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
        _ = deadline => {}
    }
}
