//! Drafting for speculative decoding: guesses of the next tokens that one batched forward then
//! verifies (`Session::decode_drafted`). A [`Drafter`] guesses; two do: [`Ngram`] (prompt lookup)
//! and [`ModelDraft`] (a small model with the same vocabulary decodes the guess greedily).
//!
//! `Ngram` is prompt-lookup decoding (Saxena 2023; llama.cpp's `lookup`): the sequence's last n
//! tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`) are looked for earlier in the sequence — the
//! prompt and the answer so far — and the tokens that followed their latest earlier occurrence
//! are the guess. It costs no model; it pays where the answer copies (quotes, edits, code). Where
//! guesses keep failing it backs off: each wholly rejected draft doubles the number of plain
//! steps before the next try (up to `MAX_COOLDOWN`), and each accepted one shortens the wait; a
//! draft's length starts at 2 and doubles while drafts are accepted whole (up to `--draft-max`).

use super::Session;
use anyhow::Result;

/// What guesses the next tokens.
pub trait Drafter {
    /// Up to `limit` tokens guessed to follow `tokens` (the whole sequence: prompt, answer so far
    /// and the token just sampled); empty for no guess.
    fn propose(&mut self, tokens: &[u32], limit: usize) -> Result<Vec<u32>>;
    /// How many of the last guess's `drafted` tokens were accepted.
    fn accepted(&mut self, accepted: usize, drafted: usize);
    /// How it guesses, for a person.
    fn name(&self) -> &'static str;
}

/// The most tokens one draft guesses (`--draft-max`'s bound). A declared sliding-window layer
/// keeps more spare positions than a draft and the token before it take back.
pub const MAX_DRAFT: usize = 32;
const _: () = assert!(crate::kv::DECLARED_WINDOW_SPARE > MAX_DRAFT + 1);

/// The longest and shortest runs of tokens matched.
const MAX_NGRAM: usize = 4;
const MIN_NGRAM: usize = 3;
/// The most plain steps between two tries after repeated failures.
const MAX_COOLDOWN: usize = 64;

/// A drafter and what it did.
#[derive(Debug, Clone)]
pub struct Ngram {
    /// The most tokens one draft guesses.
    max: usize,
    /// Plain steps left before the next try.
    cooldown: usize,
    /// The wait after the next wholly rejected draft.
    backoff: usize,
    /// The length of the next draft: doubled after a draft accepted whole, cut to what was
    /// accepted (and one more) otherwise — a failed guess costs a wider forward.
    len: usize,
}

impl Ngram {
    /// A drafter of at most `max` tokens a draft (at least 1).
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            cooldown: 0,
            backoff: 1,
            len: 2.min(max.max(1)),
        }
    }
}

impl Drafter for Ngram {
    /// Up to `limit` (and the draft's length) tokens guessed to follow `tokens`; none when it
    /// waits after failures or finds no match.
    fn propose(&mut self, tokens: &[u32], limit: usize) -> Result<Vec<u32>> {
        if self.cooldown > 0 {
            self.cooldown -= 1;
            return Ok(Vec::new());
        }
        Ok(lookup(tokens, self.len.min(limit)))
    }

    fn name(&self) -> &'static str {
        "prompt lookup"
    }

    fn accepted(&mut self, accepted: usize, drafted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.cooldown = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_COOLDOWN);
        } else {
            self.backoff = (self.backoff / 2).max(1);
        }
        self.len = if accepted == drafted {
            (self.len * 2).min(self.max)
        } else {
            (accepted + 1).min(self.max)
        };
    }
}

/// A small model with the target's vocabulary, drafting greedily: its own session follows the
/// target's sequence (keeping what they share, feeding the rest), decodes `max` tokens, and keeps
/// them for the next call, which keeps whatever of them the target accepted.
pub struct ModelDraft<'d> {
    session: Session<'d>,
    max: usize,
}

impl<'d> ModelDraft<'d> {
    /// Drafts of `max` tokens from `session` (a fresh session of the draft model).
    pub fn new(session: Session<'d>, max: usize) -> Self {
        Self {
            session,
            max: max.max(1),
        }
    }
}

impl Drafter for ModelDraft<'_> {
    fn propose(&mut self, tokens: &[u32], limit: usize) -> Result<Vec<u32>> {
        let n = self.max.min(limit);
        if n == 0 || tokens.is_empty() {
            return Ok(Vec::new());
        }
        // The draft's context ends where the target's would: no guess past it.
        if tokens.len() + n > self.session.max_positions() {
            return Ok(Vec::new());
        }
        let kept = self.session.keep_prefix_of(tokens)?;
        let mut logits = self.session.feed(&tokens[kept..])?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let next = super::argmax(&logits.to_vec1::<f32>()?);
            out.push(next);
            if i + 1 < n {
                logits = self.session.feed(&[next])?;
            }
        }
        Ok(out)
    }

    fn accepted(&mut self, _accepted: usize, _drafted: usize) {}

    fn name(&self) -> &'static str {
        "draft model"
    }
}

/// The tokens that followed the latest earlier occurrence of the last n tokens of `tokens` (the
/// longest n that occurs, from `MAX_NGRAM` down to `MIN_NGRAM`), at most `max` of them.
pub fn lookup(tokens: &[u32], max: usize) -> Vec<u32> {
    if max == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if tokens.len() <= n {
            continue;
        }
        let tail = &tokens[tokens.len() - n..];
        // The latest start before the tail itself whose n tokens equal it.
        let found = (0..tokens.len() - n)
            .rev()
            .find(|&s| &tokens[s..s + n] == tail);
        if let Some(s) = found {
            let from = s + n;
            let to = (from + max).min(tokens.len());
            return tokens[from..to].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_continuation_of_the_latest_earlier_match_is_proposed() {
        let _: &dyn Drafter = &Ngram::new(1);
        // "1 2 3 4 5 ... 1 2 3 9 ... 1 2 3": the latest earlier "1 2 3" was followed by 9.
        let t = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 8, 7, 1, 2, 3];
        assert_eq!(lookup(&t, 3), vec![9, 8, 7]);
        assert_eq!(lookup(&t, 1), vec![9]);
        // The longest n wins: "0 1 2 3" occurs nowhere earlier, "1 2 3" does.
        assert_eq!(lookup(&[1, 2, 3, 7, 0, 1, 2, 3], 2), vec![7, 0]);
        // Two repeated tokens are not enough to draft from (their matches guess badly).
        assert_eq!(lookup(&[5, 1, 2, 6, 1, 2], 4), Vec::<u32>::new());
        assert_eq!(lookup(&[1, 2, 3], 4), Vec::<u32>::new());
    }

    #[test]
    fn rejected_drafts_make_the_drafter_wait_longer_each_time() {
        let t = [0, 1, 2, 3, 0, 1, 2];
        let mut d = Ngram::new(4);
        assert_eq!(
            d.propose(&t, 8).unwrap(),
            vec![3, 0],
            "a first draft is short"
        );
        d.accepted(0, 2);
        assert!(d.propose(&t, 8).unwrap().is_empty());
        assert_eq!(d.propose(&t, 8).unwrap(), vec![3]);
        d.accepted(0, 1);
        assert!(d.propose(&t, 8).unwrap().is_empty() && d.propose(&t, 8).unwrap().is_empty());
        assert_eq!(d.propose(&t, 8).unwrap(), vec![3]);
        d.accepted(1, 1);
        assert_eq!(
            d.propose(&t, 8).unwrap(),
            vec![3, 0],
            "a whole accepted draft doubles the next"
        );
        d.accepted(2, 2);
        assert_eq!(d.propose(&t, 8).unwrap(), vec![3, 0, 1, 2]);
        assert_eq!(d.propose(&t, 1).unwrap(), vec![3], "the limit caps a draft");
    }
}
