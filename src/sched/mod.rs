//! The scheduler: many sequences over one model and one KV pool. It takes token ids and options
//! (a [`Job`]) and answers with [`Event`]s; it knows no HTTP and no JSON (`commands/serve` is
//! its front end: it renders and tokenizes prompts, then hands them here).
//!
//! - [`scheduler`]: the loop — queue, admission into the pool, chunked prefill, the batched
//!   decode step, preemption, cancellation.
//! - [`pool`]: what a sequence's own rows take in the pool.
//! - [`shared`]: the shared-block index (prefix sharing, least recently used out first).
//! - [`stop`]: an answer's text watched for stop texts.
//! - [`counters`]: the counts the front end reports.
//! - [`Queue`]: the waiting room's bound, counted by the tickets it hands out.

pub mod counters;
pub mod pool;
pub mod scheduler;
pub mod shared;
mod stop;

pub use scheduler::{Limits, Prefixes, Scheduler};

use crate::model::sampling::SamplingPrefs;
use crate::session::StopReason;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request as the scheduler takes it: a prompt's token ids and how to answer it.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (the front end has fitted it to the context).
    pub max_tokens: usize,
    /// Sampling settings over the scheduler's own ([`Limits::sampling`]).
    pub sampling: SamplingPrefs,
    /// Texts that end the answer (not included in it).
    pub stop: Vec<String>,
    /// Generate `max_tokens` tokens whatever the model's end-of-text tokens say (llama.cpp
    /// server's and vLLM's `ignore_eos`: load tests and tests that need answers of a length).
    pub ignore_eos: bool,
    /// Its text keeps control tokens' text (a Harmony answer's markers, read by the front end).
    pub keep_special: bool,
    /// The grammar its answer keeps to, compiled (`crate::grammar`).
    pub constraint: Option<crate::grammar::Constraint>,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    /// Its place in the queue, given back when it starts (or is refused, or its client goes).
    pub ticket: Ticket,
}

/// What the scheduler tells a job's sender, in order: `Started` (or `Failed`), then `Text`
/// pieces, then `Done` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Text(String),
    Done(Done),
    Failed(Failure),
}

/// How an answer ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    pub reason: StopReason,
    pub completion_tokens: usize,
    /// The stop text that ended it, where one did (its reason is then `EndOfText`).
    pub stop_text: Option<String>,
}

/// Why a job ended without its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// It can never be served as asked (the text says what to change): the client's to mend.
    Refused(String),
    /// The engine failed while serving it.
    Engine(String),
}

/// The sending side of the scheduler's queue: at most `limit` jobs wait (or are being prepared
/// to) at once, each holding a [`Ticket`].
#[derive(Clone)]
pub struct Queue {
    jobs: Sender<Job>,
    waiting: Arc<AtomicUsize>,
    limit: usize,
    counts: Arc<counters::Shared>,
}

/// The receiving side, for [`Scheduler::run`].
pub struct Inbox(pub(crate) Receiver<Job>);

/// The queue was full: `limit` jobs wait already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy {
    pub limit: usize,
}

/// The scheduler has stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// A queue of `limit` places, counting refusals in `counts`.
pub fn queue(limit: usize, counts: Arc<counters::Shared>) -> (Queue, Inbox) {
    let (jobs, inbox) = std::sync::mpsc::channel();
    let q = Queue {
        jobs,
        waiting: Arc::new(AtomicUsize::new(0)),
        limit,
        counts,
    };
    (q, Inbox(inbox))
}

impl Queue {
    /// A place in the queue, taken before a job is prepared (so that preparing is bounded too);
    /// `Busy` when all are taken.
    pub fn reserve(&self) -> Result<Ticket, Busy> {
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.limit {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            self.counts.update(|c| c.rejected_busy += 1);
            return Err(Busy { limit: self.limit });
        }
        Ok(Ticket(Some(self.waiting.clone())))
    }

    /// Hands a job to the scheduler.
    pub fn submit(&self, job: Job) -> Result<(), Stopped> {
        self.jobs.send(job).map_err(|_| Stopped)
    }

    /// Jobs holding a place now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

/// A place in the queue: given back when released or dropped, once.
#[derive(Debug)]
pub struct Ticket(Option<Arc<AtomicUsize>>);

impl Ticket {
    /// Gives the place back now (the job started).
    pub fn release(&mut self) {
        if let Some(w) = self.0.take() {
            w.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_holds_at_most_its_limit_and_counts_the_refused() {
        let counts = Arc::new(counters::Shared::default());
        let (q, _inbox) = queue(2, counts.clone());
        let a = q.reserve().unwrap();
        let _b = q.reserve().unwrap();
        assert_eq!(q.reserve().unwrap_err(), Busy { limit: 2 });
        assert_eq!(counts.snapshot().rejected_busy, 1);
        drop(a);
        assert_eq!(q.waiting(), 1);
        assert!(q.reserve().is_ok());
    }

    #[test]
    fn a_ticket_released_then_dropped_gives_its_place_back_once() {
        let (q, _inbox) = queue(3, Arc::default());
        let mut a = q.reserve().unwrap();
        let _b = q.reserve().unwrap();
        a.release();
        drop(a);
        assert_eq!(q.waiting(), 1);
    }
}
