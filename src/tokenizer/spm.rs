//! SentencePiece tokenization as llama.cpp does it for `tokenizer.ggml.model = llama` (its
//! `llm_tokenizer_spm`): no merge list, only the vocabulary's scores.
//!
//! Encoding a text:
//! 1. Special tokens are cut out first (`partition`): user-defined ones always (Gemma's "\n",
//!    "\t\t", …), control ones (`<start_of_turn>`) only when special text is parsed; longer tokens
//!    first, each token's occurrences left to right, as llama.cpp's `tokenizer_st_partition`.
//! 2. Each remaining piece gets a leading space if the model asks for one (at the start and after a
//!    special token), spaces become "▁", and the piece is split into UTF-8 characters.
//! 3. Neighbouring symbols whose concatenation is a token merge, highest score first (ties: the
//!    leftmost), until no pair is a token (`merge`).
//! 4. A symbol that is not a token (a character outside the vocabulary) becomes its bytes' `<0xXX>`
//!    tokens, or the unknown token.
//!
//! Gemma 4's tokenizer (`tokenizer.ggml.model = gemma4`, llama.cpp's BPE with its `gemma4`
//! pre-tokenizer) is the same with a merge list ([`Spm::with_merges`]): in step 3 the pair of
//! lowest merge rank merges first (ties: the leftmost), whether or not the scores say anything;
//! and each piece is first cut into runs of newlines and runs of other characters, merged apart,
//! a run of newlines that is a token being that token whole.
//!
//! Decoding is the reverse per token: "▁" → space, a byte token → its byte, a control token →
//! nothing (or its text when asked for), the bytes joined as UTF-8.

use aho_corasick::{AhoCorasick, MatchKind};
use anyhow::{anyhow, Result};
use hashbrown::DefaultHashBuilder;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::hash::BuildHasher;

/// GGUF token types (llama.cpp's `llama_token_type`).
pub const NORMAL: u8 = 1;
pub const UNKNOWN: u8 = 2;
pub const CONTROL: u8 = 3;
pub const USER_DEFINED: u8 = 4;
pub const BYTE: u8 = 6;

/// What "▁" stands for.
const SPACE_MARK: &str = "\u{2581}";

pub struct Spm {
    vocab: Vocab,
    scores: Vec<f32>,
    /// GGUF token type per id (NORMAL when the file gives none).
    types: Vec<u8>,
    /// `<0xXX>` token per byte value.
    bytes: [Option<u32>; 256],
    unk: Option<u32>,
    add_space_prefix: bool,
    /// Control, user-defined and unknown tokens, found in text by one automaton; `special[i]` is
    /// the id of pattern i.
    matcher: Option<AhoCorasick>,
    special: Vec<u32>,
    /// BPE merge ranks keyed by "left right" (Gemma 4): merging follows them instead of scores.
    merges: Option<std::collections::HashMap<String, u32>>,
}

/// A piece of text to tokenize, or a special token already cut out of it.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl Spm {
    /// The tokenizer of a vocabulary: token texts, their scores and (optionally) their GGUF types.
    pub fn new(
        tokens: &[&str],
        scores: Vec<f32>,
        types: Option<Vec<u8>>,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self> {
        let n = tokens.len();
        if scores.len() != n {
            return Err(anyhow!("{} scores for {n} tokens", scores.len()));
        }
        let types = types.unwrap_or_else(|| vec![NORMAL; n]);
        if types.len() != n {
            return Err(anyhow!("{} token types for {n} tokens", types.len()));
        }
        let vocab = Vocab::new(tokens);
        let mut bytes = [None; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = vocab.id(&format!("<0x{b:02X}>"));
        }
        // Longest first (ties by id), as llama.cpp's cache of special tokens.
        let mut special: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                matches!(types[i as usize], CONTROL | USER_DEFINED | UNKNOWN)
                    && !vocab.text(i).is_empty()
            })
            .collect();
        special.sort_by_key(|&i| (std::cmp::Reverse(vocab.text(i).len()), i));
        let matcher = if special.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::Standard)
                    .build(special.iter().map(|&i| vocab.text(i).as_bytes()))
                    .map_err(|e| anyhow!("indexing special tokens: {e}"))?,
            )
        };
        Ok(Self {
            vocab,
            scores,
            types,
            bytes,
            unk: unk.filter(|&u| (u as usize) < n),
            add_space_prefix,
            matcher,
            special,
            merges: None,
        })
    }

    /// The same vocabulary merged by BPE ranks: `merges[r]` is "left right", rank r (Gemma 4).
    pub fn with_merges(mut self, merges: &[&str]) -> Result<Self> {
        let mut ranks = std::collections::HashMap::with_capacity(merges.len());
        for (r, m) in merges.iter().enumerate() {
            if !m.contains(' ') {
                return Err(anyhow!("merge '{m}' is not two tokens"));
            }
            // The first rank of a pair listed twice, as llama.cpp's map keeps.
            ranks.entry(m.to_string()).or_insert(r as u32);
        }
        self.merges = Some(ranks);
        Ok(self)
    }

    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// The vocabulary, for building the same tokenizer in another form (`Tokenizer::to_hf`).
    pub fn vocabulary(&self) -> (Vec<&str>, &[f32], &[u8]) {
        let texts = (0..self.len() as u32).map(|i| self.vocab.text(i)).collect();
        (texts, &self.scores, &self.types)
    }

    /// The merge list in rank order, for a vocabulary merged by BPE ranks (Gemma 4).
    pub fn merge_list(&self) -> Option<Vec<(String, String)>> {
        let ranks = self.merges.as_ref()?;
        let mut list: Vec<(&String, &u32)> = ranks.iter().collect();
        list.sort_by_key(|(_, &r)| r);
        Some(
            list.into_iter()
                .filter_map(|(m, _)| m.split_once(' '))
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        )
    }

    pub fn unknown(&self) -> Option<u32> {
        self.unk
    }

    pub fn adds_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    pub fn token_text(&self, id: u32) -> Option<&str> {
        ((id as usize) < self.len()).then(|| self.vocab.text(id))
    }

    /// Control and unknown tokens: their text becomes them only when special text is parsed
    /// (llama.cpp's partition skips both otherwise).
    pub fn is_control(&self, id: u32) -> bool {
        matches!(self.types.get(id as usize), Some(&CONTROL) | Some(&UNKNOWN))
    }

    /// Whether `text` holds the text of a control (or the unknown) token.
    pub fn has_control_text(&self, text: &str) -> bool {
        let Some(m) = &self.matcher else { return false };
        m.find_overlapping_iter(text)
            .any(|hit| self.is_control(self.special[hit.pattern().as_usize()]))
    }

    /// Text to ids (no BOS). `parse_control`: control-token text becomes that token.
    pub fn encode(&self, text: &str, parse_control: bool) -> Vec<u32> {
        if text.is_empty() {
            return Vec::new(); // no fragment, so no space prefix either (llama.cpp)
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut after_special = true;
        for fragment in self.partition(text, parse_control) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    let mut piece = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && after_special {
                        piece.push(' ');
                    }
                    piece.push_str(t);
                    let piece = piece.replace(' ', SPACE_MARK);
                    match self.merges {
                        None => self.merge(&piece, &mut out),
                        Some(_) => self.merge_lines(&piece, &mut out),
                    }
                    after_special = false;
                }
            }
        }
        out
    }

    /// Cuts special tokens out of `text`: for each special token, longest first, its occurrences
    /// left to right that lie wholly in text not yet cut (llama.cpp's `tokenizer_st_partition`).
    fn partition<'a>(&self, text: &'a str, parse_control: bool) -> Vec<Fragment<'a>> {
        let Some(m) = &self.matcher else {
            return vec![Fragment::Text(text)];
        };
        // Every occurrence of every special token, as (rank, start, end); rank = place in
        // `special`, so sorting puts longer tokens first and each token's hits left to right.
        let mut hits: Vec<(usize, usize, usize)> = m
            .find_overlapping_iter(text)
            .map(|h| (h.pattern().as_usize(), h.start(), h.end()))
            .filter(|&(rank, _, _)| parse_control || !self.is_control(self.special[rank]))
            .collect();
        if hits.is_empty() {
            return vec![Fragment::Text(text)];
        }
        hits.sort_unstable();
        let mut cut = vec![false; text.len()];
        let mut taken: Vec<(usize, usize, u32)> = Vec::new();
        let mut last: Option<(usize, usize)> = None; // (rank, end) of the last hit taken
        for (rank, start, end) in hits {
            if last.is_some_and(|(r, e)| r == rank && start < e)
                || cut[start..end].iter().any(|&c| c)
            {
                continue;
            }
            cut[start..end].iter_mut().for_each(|c| *c = true);
            taken.push((start, end, self.special[rank]));
            last = Some((rank, end));
        }
        taken.sort_unstable();
        let mut out = Vec::with_capacity(2 * taken.len() + 1);
        let mut at = 0;
        for (start, end, id) in taken {
            if start > at {
                out.push(Fragment::Text(&text[at..start]));
            }
            out.push(Fragment::Token(id));
            at = end;
        }
        if at < text.len() {
            out.push(Fragment::Text(&text[at..]));
        }
        out
    }

    /// Gemma 4: runs of newlines and runs of other characters merged apart (llama.cpp's
    /// `[^\n]+|[\n]+` split); a run of newlines that is a token is that token.
    fn merge_lines(&self, text: &str, out: &mut Vec<u32>) {
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            let newlines = c == '\n';
            let end = rest
                .find(|c: char| (c == '\n') != newlines)
                .unwrap_or(rest.len());
            let (run, after) = rest.split_at(end);
            match self.token_id(run).filter(|_| newlines) {
                Some(id) => out.push(id),
                None => self.merge(run, out),
            }
            rest = after;
        }
    }

    /// The priority of merging the neighbours `left` and `right` (texts), if they merge: the
    /// score of their concatenation's token, or with a merge list minus the pair's rank.
    fn pair_score(&self, left: &str, right: &str, key: &mut String) -> Option<f32> {
        match &self.merges {
            None => {
                key.clear();
                key.push_str(left);
                key.push_str(right);
                let id = self.token_id(key)?;
                Some(self.scores[id as usize])
            }
            Some(ranks) => {
                key.clear();
                key.push_str(left);
                key.push(' ');
                key.push_str(right);
                // Ranks stay below 2^24, exact in f32.
                ranks.get(key.as_str()).map(|&r| -(r as f32))
            }
        }
    }

    /// The score-ordered merging of one piece (spaces already "▁") into ids.
    fn merge(&self, text: &str, out: &mut Vec<u32>) {
        // Symbols: byte ranges of `text` in a doubly linked list; a merged-away symbol has len 0.
        struct Symbol {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        let Some(last) = symbols.last_mut() else {
            return;
        };
        last.next = None;

        let mut queue = BinaryHeap::new();
        let mut key = String::new();
        let mut bigram = |symbols: &[Symbol], left: usize, right: usize| -> Option<Bigram> {
            let (l, r) = (&symbols[left], &symbols[right]);
            let (lt, rt) = (&text[l.start..][..l.len], &text[r.start..][..r.len]);
            Some(Bigram {
                score: self.pair_score(lt, rt, &mut key)?,
                left,
                right,
                len: l.len + r.len,
            })
        };
        for i in 1..symbols.len() {
            queue.extend(bigram(&symbols, i - 1, i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (&symbols[b.left], &symbols[b.right]);
            // Stale: one side has merged since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            let next = r.next;
            symbols[b.left].len = b.len;
            symbols[b.left].next = next;
            symbols[b.right].len = 0;
            if let Some(n) = next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = symbols[b.left].prev {
                queue.extend(bigram(&symbols, p, b.left));
            }
            if let Some(n) = next {
                queue.extend(bigram(&symbols, b.left, n));
            }
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let s = &symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.token_id(piece) {
                Some(id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.extend(self.bytes[b as usize].or(self.unk));
                    }
                }
            }
            at = s.next;
        }
    }

    /// Ids to text. Control (and unknown) tokens give nothing when `skip_control`, their text
    /// otherwise; user-defined tokens are text (Gemma's "\n" is one); an
    /// unknown id is an error. `strip_space`: drop the space the model put before the first word.
    pub fn decode(&self, ids: &[u32], skip_control: bool, strip_space: bool) -> Result<String> {
        let mut bytes: Vec<u8> = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let text = self.token_text(id).ok_or_else(|| {
                anyhow!("token id {id} is outside the vocabulary of {}", self.len())
            })?;
            match self.types[id as usize] {
                CONTROL | UNKNOWN if skip_control => {}
                CONTROL | UNKNOWN | USER_DEFINED => bytes.extend_from_slice(text.as_bytes()),
                BYTE => match byte_of(text) {
                    Some(b) => bytes.push(b),
                    None => bytes.extend_from_slice(text.as_bytes()),
                },
                _ => bytes.extend_from_slice(text.replace(SPACE_MARK, " ").as_bytes()),
            }
        }
        if strip_space && self.add_space_prefix && bytes.first() == Some(&b' ') {
            bytes.remove(0);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Token texts in one string, and a hash table from text to id: three allocations for a 262k
/// vocabulary, not half a million (building and dropping those was 15 % of Gemma 3's load).
struct Vocab {
    text: String,
    /// End of token i's text in `text` (it starts where token i - 1's ends).
    ends: Vec<usize>,
    /// Ids, found by their text's hash (the last id, when a text repeats, as llama.cpp's map).
    index: hashbrown::HashTable<u32>,
    hasher: DefaultHashBuilder,
}

impl Vocab {
    fn new(tokens: &[&str]) -> Self {
        let mut text = String::with_capacity(tokens.iter().map(|t| t.len()).sum());
        let mut ends = Vec::with_capacity(tokens.len());
        for t in tokens {
            text.push_str(t);
            ends.push(text.len());
        }
        // hashbrown's hasher (foldhash, randomly seeded): SipHash was a third of building
        // Gemma 3's 262k-token index.
        let hasher = DefaultHashBuilder::default();
        let mut index = hashbrown::HashTable::with_capacity(tokens.len());
        for id in 0..tokens.len() as u32 {
            let t = piece(&text, &ends, id);
            let hash = hasher.hash_one(t);
            match index.find_mut(hash, |&i| piece(&text, &ends, i) == t) {
                Some(slot) => *slot = id,
                None => {
                    index.insert_unique(hash, id, |&i| hasher.hash_one(piece(&text, &ends, i)));
                }
            }
        }
        Self {
            text,
            ends,
            index,
            hasher,
        }
    }

    fn text(&self, id: u32) -> &str {
        piece(&self.text, &self.ends, id)
    }

    fn id(&self, t: &str) -> Option<u32> {
        let hash = self.hasher.hash_one(t);
        self.index.find(hash, |&i| self.text(i) == t).copied()
    }
}

fn piece<'a>(text: &'a str, ends: &[usize], id: u32) -> &'a str {
    let id = id as usize;
    let start = if id == 0 { 0 } else { ends[id - 1] };
    &text[start..ends[id]]
}

/// The byte of a `<0xXX>` token.
fn byte_of(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// A pair of neighbouring symbols whose concatenation is a token.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged text: a pair is stale once either side has changed length.
    len: usize,
}

/// Max-heap order: higher score first, then the leftmost pair.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of (text, score, type); ids are the positions.
    fn spm(vocab: &[(&str, f32, u8)], add_space_prefix: bool) -> Spm {
        let tokens: Vec<&str> = vocab.iter().map(|v| v.0).collect();
        Spm::new(
            &tokens,
            vocab.iter().map(|v| v.1).collect(),
            Some(vocab.iter().map(|v| v.2).collect()),
            Some(0),
            add_space_prefix,
        )
        .unwrap()
    }

    /// Gemma 4's merging: by rank, whatever the scores; newline runs apart.
    fn ranked() -> Spm {
        let v = [
            ("<unk>", 0.0, UNKNOWN),
            ("a", 0.0, NORMAL),
            ("b", 0.0, NORMAL),
            ("c", 0.0, NORMAL),
            ("ab", 5.0, NORMAL),
            ("bc", 0.0, NORMAL),
            ("\n", 0.0, NORMAL),
            ("\n\n", 0.0, NORMAL),
            ("▁a", 0.0, NORMAL),
        ];
        spm(&v, false)
            .with_merges(&["b c", "a b", "▁ a", "\n \n"])
            .unwrap()
    }

    #[test]
    fn with_merges_the_lowest_ranked_pair_merges_first_whatever_the_scores() {
        // "b c" has rank 0: it merges before "a b" (rank 1), though "ab" scores higher.
        assert_eq!(ranked().encode("abc", false), vec![1, 5]);
    }

    #[test]
    fn with_merges_runs_of_newlines_are_merged_apart_and_taken_whole_when_a_token() {
        // "a\n\nb": "a", then the run "\n\n" (a token), then "b"; "▁" is never merged into a
        // run of newlines (there is no "▁" token: it becomes the unknown token's bytes).
        assert_eq!(ranked().encode("a\n\nb", false), vec![1, 7, 2]);
        assert_eq!(ranked().encode("\n\n\n a", false), vec![7, 6, 8]);
    }

    #[test]
    fn a_merge_that_is_not_two_tokens_is_refused_naming_it() {
        let err = ranked().with_merges(&["ab"]).err().unwrap().to_string();
        assert_eq!(err, "merge 'ab' is not two tokens");
    }

    fn letters(extra: &[(&'static str, f32, u8)]) -> Spm {
        let mut v = vec![
            ("<unk>", 0.0, UNKNOWN),
            ("a", -10.0, NORMAL),
            ("b", -10.0, NORMAL),
            ("c", -10.0, NORMAL),
        ];
        v.extend_from_slice(extra);
        spm(&v, false)
    }

    #[test]
    fn the_higher_scored_pair_merges_first() {
        let left = letters(&[("ab", -1.0, NORMAL), ("bc", -2.0, NORMAL)]);
        assert_eq!(left.encode("abc", true), vec![4, 3]); // ab c
        let right = letters(&[("ab", -2.0, NORMAL), ("bc", -1.0, NORMAL)]);
        assert_eq!(right.encode("abc", true), vec![1, 5]); // a bc
    }

    #[test]
    fn equal_scores_merge_the_leftmost_pair_first() {
        let s = letters(&[("aa", -1.0, NORMAL)]);
        assert_eq!(s.encode("aaa", true), vec![4, 1]); // aa a
    }

    #[test]
    fn merges_continue_through_merged_symbols() {
        let s = letters(&[
            ("ab", -1.0, NORMAL),
            ("bc", -2.0, NORMAL),
            ("abc", -3.0, NORMAL),
        ]);
        assert_eq!(s.encode("abcabc", true), vec![6, 6]);
    }

    #[test]
    fn a_character_outside_the_vocabulary_becomes_its_byte_tokens() {
        let mut v = vec![("<unk>", 0.0, UNKNOWN), ("a", -1.0, NORMAL)];
        let hex: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        v.extend(hex.iter().map(|h| (h.as_str(), 0.0, BYTE)));
        let s = spm(&v, false);
        // é = C3 A9; byte b is id 2 + b.
        assert_eq!(s.encode("aé", true), vec![1, 2 + 0xC3, 2 + 0xA9]);
        assert_eq!(
            s.decode(&[1, 2 + 0xC3, 2 + 0xA9], true, true).unwrap(),
            "aé"
        );
    }

    #[test]
    fn without_byte_tokens_an_unknown_character_is_the_unknown_token_per_byte() {
        let s = letters(&[]);
        assert_eq!(s.encode("é", true), vec![0, 0]);
    }

    #[test]
    fn spaces_are_marked_and_a_space_prefix_is_added_at_the_start_and_after_special_tokens() {
        let s = spm(
            &[
                ("<unk>", 0.0, UNKNOWN),
                ("<c>", 0.0, CONTROL),
                ("▁", -5.0, NORMAL),
                ("a", -5.0, NORMAL),
                ("▁a", -1.0, NORMAL),
            ],
            true,
        );
        assert_eq!(s.encode("a a", true), vec![4, 4]);
        assert_eq!(s.encode("a<c>a", true), vec![4, 1, 4]);
        assert_eq!(s.decode(&[4, 1, 4], true, true).unwrap(), "a a");
        assert_eq!(s.decode(&[4, 1, 4], false, true).unwrap(), "a<c> a");
        assert_eq!(
            s.decode(&[4], true, false).unwrap(),
            " a",
            "a continuation keeps its space"
        );
    }

    #[test]
    fn control_text_is_a_token_only_when_parsed_but_user_defined_text_always_is() {
        let s = letters(&[
            ("<c>", 0.0, CONTROL),
            ("\n", 0.0, USER_DEFINED),
            ("<", -1.0, NORMAL),
            (">", -1.0, NORMAL),
        ]);
        assert_eq!(s.encode("a<c>\nb", true), vec![1, 4, 5, 2]);
        assert_eq!(s.encode("a<c>\nb", false), vec![1, 6, 3, 7, 5, 2]);
        assert!(s.has_control_text("x<c>"));
        assert!(
            !s.has_control_text("x\n"),
            "user-defined tokens are not control text"
        );
    }

    #[test]
    fn unknown_token_text_is_plain_text_unless_special_text_is_parsed() {
        let s = letters(&[("<", -1.0, NORMAL), (">", -1.0, NORMAL)]);
        let t = spm(
            &[
                ("<unk>", 0.0, UNKNOWN),
                ("<", -1.0, NORMAL),
                ("u", -1.0, NORMAL),
                ("n", -1.0, NORMAL),
                ("k", -1.0, NORMAL),
                (">", -1.0, NORMAL),
            ],
            false,
        );
        assert_eq!(t.encode("<unk>", true), vec![0]);
        assert_eq!(t.encode("<unk>", false), vec![1, 2, 3, 4, 5]);
        assert!(t.has_control_text("a <unk>"));
        assert!(!s.has_control_text("a <b>"));
    }

    #[test]
    fn empty_text_is_no_tokens_even_with_a_space_prefix() {
        let s = spm(&[("<unk>", 0.0, UNKNOWN), ("▁", -1.0, NORMAL)], true);
        assert_eq!(s.encode("", true), Vec::<u32>::new());
        assert_eq!(s.encode(" ", true), vec![1, 1]);
    }

    #[test]
    fn a_repeated_token_text_maps_to_its_last_id() {
        let s = letters(&[("a", -5.0, NORMAL)]); // "a" is id 1 and id 4
        assert_eq!(s.token_id("a"), Some(4));
    }

    #[test]
    fn longer_special_tokens_are_cut_first() {
        let s = letters(&[("\n", 0.0, USER_DEFINED), ("\n\n", 0.0, USER_DEFINED)]);
        assert_eq!(s.encode("\n\n\na", true), vec![5, 4, 1]);
        // llama.cpp's order, not leftmost-longest: "b\n\n" is cut before "\nb" could be.
        let t = letters(&[("\nb", 0.0, USER_DEFINED), ("b\n\n", 0.0, USER_DEFINED)]);
        assert_eq!(
            t.encode("\nb\n\n", true),
            vec![0, 5],
            "\\n is no token: <unk>"
        );
    }

    #[test]
    fn decoding_gives_user_defined_text_and_drops_control_tokens() {
        let s = letters(&[("<c>", 0.0, CONTROL), ("\n", 0.0, USER_DEFINED)]);
        assert_eq!(s.decode(&[1, 4, 5, 2], true, true).unwrap(), "a\nb");
        assert!(s.decode(&[99], true, true).is_err());
    }
}
