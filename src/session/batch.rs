//! Continuous batching's loop, without a server: sequences join a running batch between steps,
//! each step decodes one token of every sequence in one forward ([`Session::feed_each`]), and a
//! sequence leaves when it ends, or is preempted ([`Batch::preempt`]) and resumed later with the
//! same answer ([`Batch::resume`]). Each sequence samples with its own sampler and history exactly
//! as [`Session::decode`] does alone, and its rows get the bits of its own single steps, so its
//! tokens are the ones it would generate alone — whatever joined or left around it.

use super::{Sampler, Session, StopReason};
use anyhow::Result;
use candle_core::Tensor;

/// One sequence of a batch: its session, how it samples and when it stops.
struct Running<'m> {
    id: u64,
    session: Session<'m>,
    sampler: Sampler,
    /// The logits its next token is sampled from.
    logits: Tensor,
    out: Vec<u32>,
    /// How many of `out`'s last tokens are still to be fed again after a resumption.
    to_refeed: usize,
    max_tokens: usize,
    stop_ids: Vec<u32>,
}

/// A preempted sequence without its session: what it needs to go on as if it had never left.
pub struct Paused {
    sampler: Sampler,
    out: Vec<u32>,
    max_tokens: usize,
    stop_ids: Vec<u32>,
}

impl Paused {
    /// A sequence that has generated nothing yet.
    pub fn new(sampler: Sampler, max_tokens: usize, stop_ids: &[u32]) -> Self {
        Self {
            sampler,
            out: Vec::new(),
            max_tokens,
            stop_ids: stop_ids.to_vec(),
        }
    }

    /// The tokens it generated before it was preempted.
    pub fn tokens(&self) -> &[u32] {
        &self.out
    }
}

/// A sequence that left the batch: its id, its tokens, why it stopped, and its session (the
/// cache it filled, for a caller that keeps it).
pub struct Finished<'m> {
    pub id: u64,
    pub tokens: Vec<u32>,
    pub reason: StopReason,
    pub session: Session<'m>,
    /// Why it could not pick its next token, and whether the request's grammar was at fault
    /// (`grammar::GrammarFailed`) rather than the model (non-finite logits): it alone ends, the
    /// others go on.
    pub error: Option<(String, bool)>,
}

/// The sequences decoding together.
#[derive(Default)]
pub struct Batch<'m> {
    running: Vec<Running<'m>>,
}

impl<'m> Batch<'m> {
    pub fn new() -> Self {
        Self {
            running: Vec::new(),
        }
    }

    /// Sequences running.
    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// A sequence joins: `session` prefills `prompt` (on its own: a prompt's rows are many), and
    /// from the next step on it decodes with the others, up to `max_tokens` tokens, ending at any
    /// of `stop_ids` (not kept).
    pub fn join(
        &mut self,
        id: u64,
        session: Session<'m>,
        prompt: &[u32],
        sampler: Sampler,
        max_tokens: usize,
        stop_ids: &[u32],
    ) -> Result<()> {
        self.resume(
            id,
            session,
            prompt,
            Paused::new(sampler, max_tokens, stop_ids),
        )
    }

    /// A preempted sequence goes on: `session` holds (or is fed here) the prompt it had, and
    /// the tokens it generated before are fed again one a step with the others, as they were the
    /// first time, before it samples again with the sampler it had. Its rows then have the bits
    /// they had, and its next tokens are the ones it would have generated had it never left.
    pub fn resume(
        &mut self,
        id: u64,
        mut session: Session<'m>,
        prompt: &[u32],
        paused: Paused,
    ) -> Result<()> {
        let logits = session.feed(prompt)?;
        self.running.push(Running {
            id,
            session,
            sampler: paused.sampler,
            logits,
            to_refeed: paused.out.len(),
            out: paused.out,
            max_tokens: paused.max_tokens,
            stop_ids: paused.stop_ids,
        });
        Ok(())
    }

    /// Sequence `id` leaves to make room (its session, and so its rows, are dropped) and may be
    /// [`resume`](Self::resume)d later. None: no such sequence runs.
    pub fn preempt(&mut self, id: u64) -> Option<Paused> {
        let i = self.running.iter().position(|r| r.id == id)?;
        let r = self.running.remove(i);
        Some(Paused {
            sampler: r.sampler,
            out: r.out,
            max_tokens: r.max_tokens,
            stop_ids: r.stop_ids,
        })
    }

    /// The running sequences' ids and sessions (what a new sequence may copy a prefix from).
    pub fn sessions(&self) -> impl Iterator<Item = (u64, &Session<'m>)> {
        self.running.iter().map(|r| (r.id, &r.session))
    }

    /// Sequence `id`'s session, to change where its cache keeps its rows between steps without
    /// changing what it holds (a server sharing its prompt's rows with other sequences).
    pub fn session_mut(&mut self, id: u64) -> Option<&mut Session<'m>> {
        self.running
            .iter_mut()
            .find(|r| r.id == id)
            .map(|r| &mut r.session)
    }

    /// Sequence `id` leaves before it ends by itself (its client left, or a stop text ended it):
    /// what it generated so far, with `reason`. None: no such sequence runs.
    pub fn leave(&mut self, id: u64, reason: StopReason) -> Option<Finished<'m>> {
        let i = self.running.iter().position(|r| r.id == id)?;
        let r = self.running.remove(i);
        Some(Finished {
            id: r.id,
            tokens: r.out,
            reason,
            session: r.session,
            error: None,
        })
    }

    /// One step: every sequence samples its next token (`on_token(id, token)` for each kept
    /// one); those that end leave and are returned — one whose sampler failed with its `error`;
    /// the others are fed their token together, in one forward. After an error the running sequences' sessions are as before the forward
    /// (`Session::feed_each`) but their answers hold the token sampled for it: end them.
    pub fn step(&mut self, mut on_token: impl FnMut(u64, u32)) -> Result<Vec<Finished<'m>>> {
        let mut done = Vec::new();
        let mut next = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if r.to_refeed > 0 {
                // Resumed: a token it generated before is fed again, not sampled or told.
                next.push(r.out[r.out.len() - r.to_refeed]);
                r.to_refeed -= 1;
                i += 1;
                continue;
            }
            let token = match r.sampler.sample(&r.logits, r.session.tokens()) {
                Ok(t) => t,
                Err(e) => {
                    // Nothing was fed or told for it: it leaves, and only it fails.
                    let r = self.running.remove(i);
                    done.push(Finished {
                        id: r.id,
                        tokens: r.out,
                        reason: StopReason::Interrupted,
                        session: r.session,
                        error: Some((
                            crate::first_line(&e),
                            e.is::<crate::grammar::GrammarFailed>(),
                        )),
                    });
                    continue;
                }
            };
            // As `Session::decode` takes a token: a stop id is not kept.
            let reason = if r.stop_ids.contains(&token) {
                Some(StopReason::EndOfText)
            } else {
                r.out.push(token);
                on_token(r.id, token);
                StopReason::after_kept(
                    r.out.len(),
                    r.max_tokens,
                    r.session.tokens().len(),
                    r.session.max_positions(),
                )
            };
            match reason {
                Some(reason) => {
                    let r = self.running.remove(i);
                    done.push(Finished {
                        id: r.id,
                        tokens: r.out,
                        reason,
                        session: r.session,
                        error: None,
                    });
                }
                None => {
                    next.push(token);
                    i += 1;
                }
            }
        }
        if !self.running.is_empty() {
            let mut sessions: Vec<&mut Session<'m>> =
                self.running.iter_mut().map(|r| &mut r.session).collect();
            let logits = Session::feed_each(&mut sessions, &next)?;
            for (r, l) in self.running.iter_mut().zip(logits) {
                r.logits = l;
            }
        }
        Ok(done)
    }
}
