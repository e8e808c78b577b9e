//! The pool's arithmetic: what a sequence's own stores take in the KV pool, by the positions
//! they hold (`KvDims`), and the cache they are built as. The scheduler sums these with the
//! shared blocks' bytes against the bound.

use crate::kv::size::KvDims;
use crate::kv::CacheSpec;
use crate::model::Decoder;

/// Positions a sequence's own stores grow by (`CacheSpec::grow_by`), the size of a page of its
/// page table (`kv/paged.rs`: growing appends a page and copies no row): a sequence holds at
/// most 63 positions it has not used, where doubling from 256 held up to half its store unused.
pub const GROW_BY: usize = 64;

/// Positions past its next step that each sequence is counted for when a request asks to join:
/// it joins only when every running sequence (and itself) could go on that far beside it. An
/// answer shorter than this is never preempted by the ones that joined after it; a longer one
/// may be, when the pool is tight.
pub const ADMIT_AHEAD: usize = 2 * GROW_BY;

/// The KV pool: its bound, and the cache each sequence's own stores are built as.
pub struct Pool<'e> {
    model: &'e Decoder,
    spec: CacheSpec,
    /// The bound in bytes.
    pub bound: u64,
}

impl<'e> Pool<'e> {
    pub fn new(model: &'e Decoder, spec: CacheSpec, bound: u64) -> Self {
        Self { model, spec, bound }
    }

    /// The cache a sequence's own stores make, built for `positions` positions.
    pub fn own_spec(&self, positions: usize) -> CacheSpec {
        CacheSpec {
            max_positions: positions,
            grow_by: Some(GROW_BY),
            ..self.spec.clone()
        }
    }

    /// Bytes a sequence's own stores may ever allocate (`KvDims::bytes_at_most`), its first
    /// forward `prompt` positions: a request needing more than the pool is refused.
    pub fn most_bytes(&self, prompt: usize, positions: usize) -> u64 {
        let m = self.model;
        KvDims::bytes_at_most(&self.own_spec(positions), &m.cfg, prompt, m.prefill_chunk).ceil()
            as u64
    }

    /// Bytes a sequence's own stores hold once it is `upto` positions long
    /// (`KvDims::bytes_up_to`): its prompt `prompt` positions, the first `off` of them read from
    /// shared blocks (its own stores start after them), and `max_tokens` to generate.
    pub fn seq_bytes(&self, prompt: usize, off: usize, max_tokens: usize, upto: usize) -> u64 {
        let m = self.model;
        let spec = self.own_spec(prompt + max_tokens - off);
        KvDims::bytes_up_to(&spec, &m.cfg, prompt - off, m.prefill_chunk, upto - off).ceil() as u64
    }
}
