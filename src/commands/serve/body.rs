//! A request's body, read within its limits: its size, its time, and a budget of the bytes all
//! bodies hold at once (issue 64), so that a flood of large bodies costs the budget, not their
//! count times the largest.

use super::api::ApiError;
use axum::body::Body;
use std::sync::Arc;
use std::time::Duration;
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

/// A body's share of [`BODY_BUDGET`]: the bytes past its first [`FREE_BODY`] it may hold. When
/// the last share goes back, the freed memory goes back to the system.
pub struct BodyShare {
    budget: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
    /// Bytes the body may hold now.
    covered: usize,
}

impl BodyShare {
    /// Whether the body holds a share of the budget (it is larger than [`FREE_BODY`]).
    pub fn is_large(&self) -> bool {
        self.permit.is_some()
    }

    pub fn new(budget: Arc<Semaphore>) -> Self {
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
pub async fn read_body(
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

pub fn too_large() -> ApiError {
    ApiError::new(
        413,
        "invalid_request_error",
        format!("the request body is larger than {} MiB", MAX_BODY >> 20),
    )
}
