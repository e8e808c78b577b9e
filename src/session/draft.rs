//! Drafting for speculative decoding: guesses of the next tokens that one batched forward then
//! verifies (`Session::decode_drafted`).
//!
//! `Ngram` is prompt-lookup decoding (Saxena 2023; llama.cpp's `lookup`): the sequence's last n
//! tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`) are looked for earlier in the sequence — the
//! prompt and the answer so far — and the tokens that followed their latest earlier occurrence
//! are the guess. It costs no model; it pays where the answer copies (quotes, edits, code). Where
//! guesses keep failing it backs off: each wholly rejected draft doubles the number of plain
//! steps before the next try (up to `MAX_COOLDOWN`), and each accepted one shortens the wait; a
//! draft's length starts at 2 and doubles while drafts are accepted whole (up to `--draft-max`).

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

    /// Up to `limit` (and the drafter's most) tokens guessed to follow `tokens`; none when it waits
    /// after failures or finds no match.
    pub fn propose(&mut self, tokens: &[u32], limit: usize) -> Vec<u32> {
        if self.cooldown > 0 {
            self.cooldown -= 1;
            return Vec::new();
        }
        lookup(tokens, self.len.min(limit))
    }

    /// Tells the drafter how many of a draft's `drafted` tokens were accepted.
    pub fn accepted(&mut self, accepted: usize, drafted: usize) {
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
        assert_eq!(d.propose(&t, 8), vec![3, 0], "a first draft is short");
        d.accepted(0, 2);
        assert!(d.propose(&t, 8).is_empty());
        assert_eq!(d.propose(&t, 8), vec![3]);
        d.accepted(0, 1);
        assert!(d.propose(&t, 8).is_empty() && d.propose(&t, 8).is_empty());
        assert_eq!(d.propose(&t, 8), vec![3]);
        d.accepted(1, 1);
        assert_eq!(
            d.propose(&t, 8),
            vec![3, 0],
            "a whole accepted draft doubles the next"
        );
        d.accepted(2, 2);
        assert_eq!(d.propose(&t, 8), vec![3, 0, 1, 2]);
        assert_eq!(d.propose(&t, 1), vec![3], "the limit caps a draft");
    }
}
