//! What `GET /metrics` reports, in Prometheus' text format: the engine thread updates the figures
//! after each step; the HTTP side counts what it refused before a request reached the engine.

use std::fmt::Write;
use std::sync::Mutex;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
pub const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// The KV pool's bound, what running sequences' own rows take in it by their next step,
    /// and what the shared blocks hold in it.
    pub pool_bytes: u64,
    pub committed_bytes: u64,
    pub shared_bytes: u64,
    /// What the caches have allocated now (≤ committed + shared).
    pub allocated_bytes: u64,
    pub running: usize,
    pub waiting: usize,
    /// Shared blocks indexed, and those a running sequence attends to.
    pub shared_blocks: usize,
    pub shared_blocks_in_use: usize,
    pub requests: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    /// Sequences preempted for memory, and the positions their resumption refed.
    pub preempted: u64,
    pub recomputed_tokens: u64,
    /// Refused before the engine saw them: queue full (429), bad request (4xx).
    pub rejected_busy: u64,
    pub rejected_bad: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens taken from shared blocks instead of prefilled.
    pub cached_tokens: u64,
    /// Requests that started from shared blocks.
    pub prefix_hits: u64,
    pub generated_tokens: u64,
    pub decode_steps: u64,
    /// Seconds spent in decode steps and prefills.
    pub decode_seconds: f64,
    pub prefill_seconds: f64,
    pub ttft_counts: [u64; TTFT_BUCKETS.len()],
    pub ttft_count: u64,
    pub ttft_sum: f64,
}

impl Figures {
    pub fn observe_ttft(&mut self, seconds: f64) {
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if seconds <= *b {
                self.ttft_counts[i] += 1;
            }
        }
        self.ttft_count += 1;
        self.ttft_sum += seconds;
    }

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
            self.pool_bytes
                .saturating_sub(self.committed_bytes + self.shared_bytes) as f64,
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
        let hit_rate = if self.prompt_tokens > 0 {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        } else {
            0.0
        };
        gauge(
            "prefix_hit_rate",
            "Prompt tokens taken from shared blocks over all prompt tokens.",
            hit_rate,
        );
        let tps = if self.decode_seconds > 0.0 {
            self.generated_tokens as f64 / self.decode_seconds
        } else {
            0.0
        };
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

/// The figures, shared between the engine thread and the HTTP side.
#[derive(Default)]
pub struct Metrics(Mutex<Figures>);

impl Metrics {
    pub fn update(&self, f: impl FnOnce(&mut Figures)) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
    }

    pub fn snapshot(&self) -> Figures {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttft_histogram_counts_each_answer_in_every_bucket_above_it() {
        let mut f = Figures::default();
        f.observe_ttft(0.07);
        f.observe_ttft(3.0);
        let text = f.render();
        assert!(text.contains("kvchat_time_to_first_token_seconds_bucket{le=\"0.05\"} 0\n"));
        assert!(text.contains("kvchat_time_to_first_token_seconds_bucket{le=\"0.1\"} 1\n"));
        assert!(text.contains("kvchat_time_to_first_token_seconds_bucket{le=\"5\"} 2\n"));
        assert!(text.contains("kvchat_time_to_first_token_seconds_count 2\n"));
    }

    #[test]
    fn the_hit_rate_is_cached_over_prompt_tokens() {
        let f = Figures {
            prompt_tokens: 400,
            cached_tokens: 300,
            ..Default::default()
        };
        assert!(f.render().contains("kvchat_prefix_hit_rate 0.75\n"));
    }
}
