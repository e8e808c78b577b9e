//! What `GET /metrics` reports, in Prometheus' text format: the scheduler's counts
//! (`sched::counters`), published before a step's last events reach their clients, and the HTTP
//! side's count of what it refused as invalid before a request reached the scheduler.

use super::conns::Conns;
use crate::sched::counters::{self, Counters, TTFT_BUCKETS};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// What `/metrics` reads: the scheduler's counts, and the front end's own (requests refused
/// as invalid before they reached the scheduler).
#[derive(Default)]
pub struct Metrics {
    pub sched: Arc<counters::Shared>,
    pub rejected_bad: AtomicU64,
    /// The connection table, once the server listens.
    pub conns: OnceLock<Arc<Conns>>,
}

impl Metrics {
    pub fn render(&self) -> String {
        let (connections_open, connections_busy) =
            self.conns.get().map_or((0, 0), |c| (c.open(), c.busy()));
        Figures {
            counts: self.sched.snapshot(),
            rejected_bad: self.rejected_bad.load(Ordering::Relaxed),
            connections_open,
            connections_busy,
        }
        .render()
    }
}

/// The figures `/metrics` renders, read at one moment.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub counts: Counters,
    pub rejected_bad: u64,
    pub connections_open: usize,
    /// Connections with a request in flight.
    pub connections_busy: usize,
}

impl std::ops::Deref for Figures {
    type Target = Counters;
    fn deref(&self) -> &Counters {
        &self.counts
    }
}

impl Figures {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut gauge = |name: &str, help: &str, v: f64| {
            let _ = writeln!(
                s,
                "# HELP kvchat_{name} {help}\n# TYPE kvchat_{name} gauge\nkvchat_{name} {v}"
            );
        };
        gauge(
            "connections_open",
            "HTTP connections open (at most 512; 256 from one address).",
            self.connections_open as f64,
        );
        gauge(
            "connections_busy",
            "HTTP connections with a request in flight (the others are idle, and closed first).",
            self.connections_busy as f64,
        );
        gauge(
            "kv_pool_bytes",
            "The KV pool's bound (--kv-pool).",
            self.pool_bytes as f64,
        );
        gauge(
            "kv_pool_used_bytes",
            "KV bytes running sequences' own rows take by their next step, plus the shared blocks'.",
            (self.committed_bytes + self.shared_bytes) as f64,
        );
        gauge(
            "kv_pool_free_bytes",
            "KV bytes of the pool neither taken nor held.",
            self.free_bytes() as f64,
        );
        gauge(
            "kv_allocated_bytes",
            "KV bytes the caches have allocated now.",
            self.allocated_bytes as f64,
        );
        gauge(
            "kv_shared_bytes",
            "KV bytes of the shared prefix blocks, each held once.",
            self.shared_bytes as f64,
        );
        gauge(
            "kv_shared_blocks",
            "Shared prefix blocks held (the in-memory prefix cache).",
            self.shared_blocks as f64,
        );
        gauge(
            "kv_shared_blocks_in_use",
            "Shared prefix blocks a running sequence attends to.",
            self.shared_blocks_in_use as f64,
        );
        gauge(
            "running_sequences",
            "Sequences decoding in the batch.",
            self.running as f64,
        );
        gauge(
            "queue_depth",
            "Requests waiting for room in the batch or the pool.",
            self.waiting as f64,
        );
        let hit_rate = self.hit_rate();
        gauge(
            "prefix_hit_rate",
            "Prompt tokens taken from shared blocks over all prompt tokens.",
            hit_rate,
        );
        let tps = self.decode_rate();
        gauge(
            "decode_tokens_per_second",
            "Generated tokens over the time spent in decode steps.",
            tps,
        );
        let mut counter = |name: &str, help: &str, v: f64| {
            let _ = writeln!(
                s,
                "# HELP kvchat_{name} {help}\n# TYPE kvchat_{name} counter\nkvchat_{name} {v}"
            );
        };
        counter(
            "requests_total",
            "Requests the engine took.",
            self.requests as f64,
        );
        counter(
            "requests_finished_total",
            "Requests answered in full.",
            self.finished as f64,
        );
        counter(
            "requests_cancelled_total",
            "Requests whose client left before the answer ended.",
            self.cancelled as f64,
        );
        counter(
            "requests_failed_total",
            "Requests that failed in the engine.",
            self.failed as f64,
        );
        counter(
            "preemptions_total",
            "Sequences preempted for memory (their rows freed, refed when they resume).",
            self.preempted as f64,
        );
        counter(
            "recomputed_tokens_total",
            "Positions refed to resume preempted sequences.",
            self.recomputed_tokens as f64,
        );
        counter(
            "requests_rejected_busy_total",
            "Requests refused with 429: the queue was full.",
            self.rejected_busy as f64,
        );
        counter(
            "requests_rejected_invalid_total",
            "Requests refused as invalid (4xx).",
            self.rejected_bad as f64,
        );
        counter(
            "prompt_tokens_total",
            "Prompt tokens of the requests taken.",
            self.prompt_tokens as f64,
        );
        counter(
            "prefix_cached_tokens_total",
            "Prompt tokens taken from shared blocks instead of prefilled.",
            self.cached_tokens as f64,
        );
        counter(
            "prefix_hits_total",
            "Requests that started from shared blocks.",
            self.prefix_hits as f64,
        );
        counter(
            "generated_tokens_total",
            "Tokens generated.",
            self.generated_tokens as f64,
        );
        counter(
            "decode_steps_total",
            "Batched decode steps.",
            self.decode_steps as f64,
        );
        counter(
            "prefill_seconds_total",
            "Seconds spent prefilling prompts.",
            self.prefill_seconds,
        );
        counter(
            "decode_seconds_total",
            "Seconds spent in batched decode steps.",
            self.decode_seconds,
        );
        let _ = writeln!(
            s,
            "# HELP kvchat_time_to_first_token_seconds From a request's arrival to its first token.\n# TYPE kvchat_time_to_first_token_seconds histogram"
        );
        for (b, c) in TTFT_BUCKETS.iter().zip(self.ttft_counts) {
            let _ = writeln!(
                s,
                "kvchat_time_to_first_token_seconds_bucket{{le=\"{b}\"}} {c}"
            );
        }
        let _ = writeln!(
            s,
            "kvchat_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {0}\nkvchat_time_to_first_token_seconds_sum {1}\nkvchat_time_to_first_token_seconds_count {0}",
            self.ttft_count, self.ttft_sum
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttft_histogram_counts_each_answer_in_every_bucket_above_it() {
        let mut f = Figures::default();
        f.counts.observe_ttft(0.07);
        f.counts.observe_ttft(3.0);
        let text = f.render();
        assert!(text.contains("kvchat_time_to_first_token_seconds_bucket{le=\"0.05\"} 0\n"));
        assert!(text.contains("kvchat_time_to_first_token_seconds_bucket{le=\"0.1\"} 1\n"));
        assert!(text.contains("kvchat_time_to_first_token_seconds_bucket{le=\"5\"} 2\n"));
        assert!(text.contains("kvchat_time_to_first_token_seconds_count 2\n"));
    }

    #[test]
    fn the_hit_rate_is_cached_over_prompt_tokens() {
        let f = Figures {
            counts: Counters {
                prompt_tokens: 400,
                cached_tokens: 300,
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(f.render().contains("kvchat_prefix_hit_rate 0.75\n"));
    }
}
