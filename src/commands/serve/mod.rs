//! `kvchat serve`: an OpenAI-compatible HTTP server. Many clients, one model, one KV pool.
//!
//! - `api`: the requests and responses' JSON shapes, read and written.
//! - `http`: routes, the API key, body limits, server-sent events (axum on hyper, tokio).
//! - `prepare`: prompts rendered and tokenized, on threads of their own.
//! - `metrics`: what `/metrics` says.
//!
//! The scheduler (`crate::sched`: queue, admission into the pool, continuous batching, prefix
//! sharing, stop texts) runs below, on token ids.
//!
//! Threads: the runtime (one thread) only moves bytes; [`prepare::THREADS`] threads render and
//! tokenize; the scheduler's thread runs the model, whose matmuls use candle's pool of
//! `--threads` workers.

pub mod api;
pub mod http;
pub mod metrics;
pub mod prepare;

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

/// Connections served at once; more are closed as they arrive.
const MAX_CONNECTIONS: usize = 512;
/// How long a client may take to send a request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

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
    let preparer = prepare::Preparer {
        engine: &engine,
        template,
        default_max_tokens: opts.max_tokens,
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
        let served = runtime.block_on(serve(listener, http::router(app), opts.exit_after));
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
) -> Result<()> {
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let stop = stop_signal(exit_after);
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: wait, then go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => return Ok(()),
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
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
