//! The scheduler's counts, kept where the scheduler changes them and read by the front end
//! (`kvchat serve`'s `/metrics` renders them): one owner for each count.

use std::sync::Mutex;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
pub const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
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
    /// Requests refused because the queue was full ([`super::Queue::reserve`]).
    pub rejected_busy: u64,
    pub prompt_tokens: u64,
    /// Prompt tokens taken from shared blocks or the prefix store instead of prefilled.
    pub cached_tokens: u64,
    /// Requests that started from shared blocks or the prefix store.
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

impl Counters {
    pub fn observe_ttft(&mut self, seconds: f64) {
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if seconds <= *b {
                self.ttft_counts[i] += 1;
            }
        }
        self.ttft_count += 1;
        self.ttft_sum += seconds;
    }

    /// Positions of the pool neither taken by a sequence's next step nor held by shared blocks.
    pub fn free_bytes(&self) -> u64 {
        self.pool_bytes
            .saturating_sub(self.committed_bytes + self.shared_bytes)
    }

    /// Prompt tokens taken from shared blocks over all prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens > 0 {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        } else {
            0.0
        }
    }

    /// Generated tokens over the time spent in decode steps.
    pub fn decode_rate(&self) -> f64 {
        if self.decode_seconds > 0.0 {
            self.generated_tokens as f64 / self.decode_seconds
        } else {
            0.0
        }
    }
}

/// The counts, shared between the scheduler's thread and whoever reads them.
#[derive(Default)]
pub struct Shared(Mutex<Counters>);

impl Shared {
    pub fn update(&self, f: impl FnOnce(&mut Counters)) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
    }

    pub fn snapshot(&self) -> Counters {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttft_histogram_counts_each_answer_in_every_bucket_above_it() {
        let mut c = Counters::default();
        c.observe_ttft(0.07);
        c.observe_ttft(3.0);
        assert_eq!(c.ttft_counts[0], 0, "0.05 s");
        assert_eq!(c.ttft_counts[1], 1, "0.1 s");
        assert_eq!(c.ttft_counts[6], 2, "5 s");
        assert_eq!(c.ttft_count, 2);
    }

    #[test]
    fn the_hit_rate_is_cached_over_prompt_tokens() {
        let c = Counters {
            prompt_tokens: 400,
            cached_tokens: 300,
            ..Default::default()
        };
        assert_eq!(c.hit_rate(), 0.75);
    }
}
