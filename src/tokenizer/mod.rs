//! The tokenizer, built from the GGUF's own metadata (no tokenizer.json needed) or loaded from a
//! tokenizer.json given with `--tokenizer`.
//!
//! `tokenizer.ggml.model = gpt2` is byte-level BPE whose pre-tokenizer regexes are named by
//! `tokenizer.ggml.pre` (as in llama.cpp), run by the `tokenizers` crate; `llama` is SentencePiece,
//! run by our own encoder (`spm.rs`, llama.cpp's algorithm over the vocabulary's scores: a 262k
//! vocabulary is ready in milliseconds, where deriving BPE merges from it took 0.6 s).

mod bytes;
mod spm;

pub use bytes::CONTROL_MARK;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = spm::CONTROL as i32;
const TOKEN_TYPE_UNKNOWN: i32 = spm::UNKNOWN as i32;
const TOKEN_TYPE_USER_DEFINED: i32 = spm::USER_DEFINED as i32;

/// GPT-2's pre-tokenizer regex.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: like Llama 3's, but digits one at a time.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's (o200k, gpt-oss's tokenizer): words keep a leading mark and split at case runs,
/// contractions attach, digits in threes (tokenizer.json's regex; llama.cpp rewrites it without
/// Unicode classes, with the same splits).
const GPT4O_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The regexes, applied in order, that llama.cpp uses for each `tokenizer.ggml.pre`.
fn pre_tokenizer_regexes(pre: &str) -> Result<Vec<&'static str>> {
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" | "olmo" | "jais" => vec![GPT2_REGEX],
        // Digits split one by one, then GPT-2's regex (StarCoder's scheme, which SmolLM inherits).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2_REGEX]
        }
        "llama3" | "llama-bpe" | "llama-v3" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
            vec![LLAMA3_REGEX]
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => vec![QWEN2_REGEX],
        "gpt-4o" | "minimax-m2" => vec![GPT4O_REGEX],
        other => bail!(
            "unsupported tokenizer.ggml.pre '{other}' (supported: default, gpt2, smollm, starcoder, \
             llama-bpe, qwen2, gpt-4o and their aliases); give a tokenizer.json instead"
        ),
    })
}

/// A tokenizer plus the ids that matter to generation.
pub struct Tokenizer {
    backend: Backend,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Whether a BOS token goes before the prompt (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// The longest token text's bytes ([`Tokenizer::max_token_bytes`]), found on first use.
    longest: std::sync::OnceLock<usize>,
}

// One per loaded model: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Backend {
    /// The `tokenizers` crate: byte-level BPE from a GGUF, or any tokenizer.json.
    Hf {
        inner: tokenizers::Tokenizer,
        /// The same tokenizer with special-token text read as plain text (made on first use).
        literal: std::sync::OnceLock<tokenizers::Tokenizer>,
    },
    /// SentencePiece from a GGUF's scores.
    Spm(spm::Spm),
}

impl Backend {
    fn hf(inner: tokenizers::Tokenizer) -> Self {
        Backend::Hf {
            inner,
            literal: Default::default(),
        }
    }
}

fn md_u32(ct: &Content, key: &str) -> Option<u32> {
    ct.metadata.get(key).and_then(|v| v.to_u32().ok())
}
fn md_bool(ct: &Content, key: &str) -> Option<bool> {
    ct.metadata.get(key).and_then(|v| v.to_bool().ok())
}
fn md_strings<'a>(ct: &'a Content, key: &str) -> Result<Vec<&'a str>> {
    let v = ct
        .metadata
        .get(key)
        .with_context(|| format!("GGUF has no {key}"))?
        .to_vec()?;
    v.iter()
        .map(|x| Ok(x.to_string()?.as_str()))
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("GGUF {key} is not a list of strings"))
}
fn md_numbers(ct: &Content, key: &str, n: usize) -> Result<Option<Vec<f32>>> {
    let Some(v) = ct.metadata.get(key) else {
        return Ok(None);
    };
    let v = v.to_vec()?;
    if v.len() != n {
        bail!("GGUF {key} has {} entries, the vocabulary {n}", v.len());
    }
    v.iter()
        .map(|x| match x {
            Value::F32(f) => Ok(*f),
            Value::I32(i) => Ok(*i as f32),
            Value::U32(i) => Ok(*i as f32),
            Value::I8(i) => Ok(*i as f32),
            Value::U8(i) => Ok(*i as f32),
            _ => Err(anyhow!("GGUF {key} holds a non-number")),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

impl Tokenizer {
    /// Builds the tokenizer that a GGUF file describes.
    pub fn from_gguf(ct: &Content) -> Result<Self> {
        let model = ct
            .metadata
            .get("tokenizer.ggml.model")
            .ok_or_else(|| {
                crate::fixable(
                    crate::Fix::Tokenizer,
                    "GGUF has no tokenizer.ggml.model".into(),
                )
            })?
            .to_string()?
            .clone();
        let tokens = md_strings(ct, "tokenizer.ggml.tokens")?;
        let types = md_numbers(ct, "tokenizer.ggml.token_type", tokens.len())?;
        let backend = match model.as_str() {
            "gpt2" => {
                let vocab: Vocab = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.to_string(), i as u32))
                    .collect();
                let merges = md_strings(ct, "tokenizer.ggml.merges")?
                    .into_iter()
                    .map(|m| {
                        m.split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                            .with_context(|| format!("GGUF merge '{m}' is not two tokens"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .map_err(|e| anyhow!("building BPE from GGUF: {e}"))?;
                let pre = ct
                    .metadata
                    .get("tokenizer.ggml.pre")
                    .and_then(|v| v.to_string().ok())
                    .map(|s| s.as_str())
                    .unwrap_or("default");
                let mut pres: Vec<PreTokenizerWrapper> = Vec::new();
                for re in pre_tokenizer_regexes(pre)? {
                    let split =
                        Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                            .map_err(|e| anyhow!("pre-tokenizer regex: {e}"))?;
                    pres.push(split.into());
                }
                pres.push(ByteLevel::new(false, false, false).into());
                let mut tk = tokenizers::Tokenizer::new(bpe);
                tk.with_pre_tokenizer(Some(PreSequence::new(pres)));
                tk.with_decoder(Some(ByteLevelDecoder::default()));
                if let Some(types) = &types {
                    add_special_tokens(&mut tk, &tokens, types.iter().map(|&t| t as i32))?;
                }
                Backend::hf(tk)
            }
            "llama" => {
                let scores = md_numbers(ct, "tokenizer.ggml.scores", tokens.len())?
                    .context("GGUF llama tokenizer has no tokenizer.ggml.scores")?;
                let types = types.map(|t| t.iter().map(|&x| x as u8).collect());
                let spm = spm::Spm::new(
                    &tokens,
                    scores,
                    types,
                    md_u32(ct, "tokenizer.ggml.unknown_token_id"),
                    md_bool(ct, "tokenizer.ggml.add_space_prefix").unwrap_or(true),
                )
                .context("GGUF llama tokenizer")?;
                Backend::Spm(spm)
            }
            // SentencePiece-style BPE: "▁" for spaces, raw UTF-8, merges by rank (`spm.rs`).
            "gemma4" => {
                let n = tokens.len();
                let types = types.map(|t| t.iter().map(|&x| x as u8).collect());
                let spm = spm::Spm::new(
                    &tokens,
                    vec![0.0; n],
                    types,
                    md_u32(ct, "tokenizer.ggml.unknown_token_id"),
                    md_bool(ct, "tokenizer.ggml.add_space_prefix").unwrap_or(false),
                )
                .context("GGUF gemma4 tokenizer")?
                .with_merges(&md_strings(ct, "tokenizer.ggml.merges")?)
                .context("GGUF gemma4 tokenizer")?;
                Backend::Spm(spm)
            }
            other => bail!(
                "unsupported tokenizer.ggml.model '{other}' (supported: gpt2, llama, gemma4); give a tokenizer.json instead"
            ),
        };
        Ok(Self {
            backend,
            bos_id: md_u32(ct, "tokenizer.ggml.bos_token_id"),
            eos_id: md_u32(ct, "tokenizer.ggml.eos_token_id"),
            // Gemma 4 always starts with BOS, whatever the file says (llama.cpp overrides it).
            add_bos: model == "gemma4"
                || md_bool(ct, "tokenizer.ggml.add_bos_token").unwrap_or(model == "llama"),
            longest: Default::default(),
        })
    }

    /// Loads a tokenizer.json; BOS/EOS ids still come from the model (`fallback`) when it has them.
    pub fn from_file(path: &Path, fallback: Option<&Tokenizer>) -> Result<Self> {
        crate::fsx::check_regular(path, crate::fsx::MAX_TOKENIZER_JSON, "tokenizer file")?;
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        Ok(Self {
            backend: Backend::hf(inner),
            bos_id: fallback.and_then(|t| t.bos_id),
            eos_id: fallback.and_then(|t| t.eos_id),
            add_bos: fallback.is_some_and(|t| t.add_bos),
            longest: Default::default(),
        })
    }

    /// An HF-layout tokenizer: tokenizer.json, with BOS/EOS and `add_bos_token` from
    /// tokenizer_config.json when given (token text, or `{"content": …}` objects). Returns the
    /// tokenizer and the config's `chat_template`, if any.
    pub fn from_hf(tokenizer_json: &Path, config: Option<&Path>) -> Result<(Self, Option<String>)> {
        crate::fsx::check_regular(
            tokenizer_json,
            crate::fsx::MAX_TOKENIZER_JSON,
            "tokenizer file",
        )?;
        let inner = tokenizers::Tokenizer::from_file(tokenizer_json)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", tokenizer_json.display()))?;
        let json = match config {
            Some(p) => crate::read_json(p)?,
            None => serde_json::Value::Null,
        };
        let token = |key: &str| -> Option<u32> {
            let v = json.get(key)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            inner.token_to_id(text)
        };
        let template = match json.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            // A list of named templates: the one named "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        let tk = Self {
            bos_id: token("bos_token"),
            eos_id: token("eos_token"),
            add_bos: json
                .get("add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            longest: Default::default(),
            backend: Backend::hf(inner),
        };
        Ok((tk, template))
    }

    /// Text to ids. Special-token text (`<|im_start|>`) becomes its one id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Hf { inner, .. } => hf_ids(inner, text),
            Backend::Spm(spm) => Ok(spm.encode(text, true)),
        }
    }

    /// Text to ids with special-token text taken literally: `<|im_start|>` typed by a user is the
    /// characters `<`, `|`, … and never the control token.
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Hf { inner, literal } => {
                let tk = literal.get_or_init(|| {
                    let mut t = inner.clone();
                    t.set_encode_special_tokens(true);
                    t
                });
                hf_ids(tk, text)
            }
            Backend::Spm(spm) => Ok(spm.encode(text, false)),
        }
    }

    /// Whether `text` holds the text of a special token (`<|im_start|>`, `<|eot_id|>`, …).
    pub fn has_special_text(&self, text: &str) -> bool {
        match &self.backend {
            Backend::Hf { inner, .. } => inner
                .get_added_tokens_decoder()
                .values()
                .any(|t| t.special && !t.content.is_empty() && text.contains(t.content.as_str())),
            Backend::Spm(spm) => spm.has_control_text(text),
        }
    }

    /// A rendered chat prompt to ids: the template's own text with special tokens parsed, the
    /// `literal` byte ranges (the messages' content) with special-token text taken as plain text.
    /// When no content holds special-token text this is exactly [`Tokenizer::encode`].
    pub fn encode_chat(&self, text: &str, literal: &[std::ops::Range<usize>]) -> Result<Vec<u32>> {
        if !literal
            .iter()
            .any(|r| self.has_special_text(&text[r.clone()]))
        {
            return self.encode(text);
        }
        let mut ids = Vec::new();
        let mut at = 0;
        for r in literal {
            if r.start > at {
                ids.extend(self.encode(&text[at..r.start])?);
            }
            if !r.is_empty() {
                ids.extend(self.encode_literal(&text[r.clone()])?);
            }
            at = r.end;
        }
        if at < text.len() {
            ids.extend(self.encode(&text[at..])?);
        }
        Ok(ids)
    }

    /// Ids to text; special tokens are left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.decode_part(ids, skip_special, true)
    }

    /// [`Tokenizer::decode`] of ids that may continue earlier text: `first` says whether they
    /// start the text (where a SentencePiece model's added leading space is dropped).
    fn decode_part(&self, ids: &[u32], skip_special: bool, first: bool) -> Result<String> {
        match &self.backend {
            Backend::Hf { inner, .. } => inner
                .decode(ids, skip_special)
                .map_err(|e| anyhow!("detokenizing failed: {e}")),
            Backend::Spm(spm) => spm.decode(ids, skip_special, first),
        }
    }

    /// A token's text as the vocabulary spells it ("▁Hello", "<0x0A>").
    pub fn token_text(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Hf { inner, .. } => inner.id_to_token(id),
            Backend::Spm(spm) => spm.token_text(id).map(str::to_string),
        }
    }

    /// The BOS token's text ("" when the model has none), as chat templates print it.
    pub fn bos_text(&self) -> String {
        self.bos_id
            .and_then(|i| self.token_text(i))
            .unwrap_or_default()
    }

    /// The EOS token's text ("" when the model has none).
    pub fn eos_text(&self) -> String {
        self.eos_id
            .and_then(|i| self.token_text(i))
            .unwrap_or_default()
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf { inner, .. } => inner.token_to_id(token),
            Backend::Spm(spm) => spm.token_id(token),
        }
    }

    /// The most bytes of text one token stands for: the longest token text of the vocabulary. A
    /// token's text is never shorter than the text it covers (byte-level BPE spells each byte as
    /// one character, SentencePiece a space as the 3-byte "▁" and a byte as "<0xNN>"), so a text
    /// of n bytes is at least n / this many tokens: [`Tokenizer::min_tokens`].
    pub fn max_token_bytes(&self) -> usize {
        *self.longest.get_or_init(|| {
            let longest = match &self.backend {
                Backend::Hf { inner, .. } => inner.get_vocab(true).keys().map(String::len).max(),
                Backend::Spm(spm) => (0..spm.len() as u32)
                    .filter_map(|i| spm.token_text(i))
                    .map(str::len)
                    .max(),
            };
            longest.unwrap_or(1).max(1)
        })
    }

    /// The fewest tokens that `bytes` bytes of text can become: what a text can be checked
    /// against before it is tokenized (which takes ~180 bytes of memory per byte of text).
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_token_bytes())
    }

    /// The length of `text` in tokens, counted only when its bytes do not already show it is
    /// `limit` or more.
    pub fn length_within(&self, text: &str, limit: usize) -> Result<Length> {
        let at_least = self.min_tokens(text.len());
        if at_least >= limit {
            return Ok(Length::AtLeast(at_least, text.len()));
        }
        Ok(Length::Counted(self.encode_literal(text)?.len()))
    }

    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf { inner, .. } => inner.get_vocab_size(true),
            Backend::Spm(spm) => spm.len(),
        }
    }

    /// The tokenizer as a `tokenizers` one, to write as tokenizer.json (`model::export`). A
    /// SentencePiece vocabulary becomes BPE with byte fallback whose merges are recovered from its
    /// scores (slow for a large vocabulary: 0.6 s for Gemma's 262k tokens).
    pub fn to_hf(&self) -> Result<tokenizers::Tokenizer> {
        let spm = match &self.backend {
            Backend::Hf { inner, .. } => return Ok(inner.clone()),
            Backend::Spm(spm) => spm,
        };
        let (tokens, scores, types) = spm.vocabulary();
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = spm
            .merge_list()
            .unwrap_or_else(|| spm_merges(&tokens, scores, types));
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(true)
            .fuse_unk(true);
        if let Some(unk) = spm.unknown().and_then(|i| tokens.get(i as usize)) {
            builder = builder.unk_token(unk.to_string());
        }
        let bpe = builder
            .build()
            .map_err(|e| anyhow!("building BPE from GGUF: {e}"))?;
        let add_space_prefix = spm.adds_space_prefix();
        let mut norms: Vec<NormalizerWrapper> = Vec::new();
        if add_space_prefix {
            norms.push(Prepend::new("▁".to_string()).into());
        }
        norms.push(Replace::new(" ", "▁").map_err(|e| anyhow!("{e}"))?.into());
        let mut decs: Vec<DecoderWrapper> = vec![
            tokenizers::decoders::DecoderWrapper::Replace(
                tokenizers::normalizers::Replace::new("▁", " ").map_err(|e| anyhow!("{e}"))?,
            ),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if add_space_prefix {
            decs.push(Strip::new(' ', 1, 0).into());
        }
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_normalizer(Some(NormalizerSequence::new(norms)))
            .map_err(|e| anyhow!("the tokenizer's normalizer: {e}"))?;
        tk.with_decoder(Some(DecoderSequence::new(decs)));
        add_special_tokens(&mut tk, &tokens, types.iter().map(|&t| t as i32))?;
        Ok(tk)
    }
}

fn hf_ids(tk: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tk
        .encode_fast(text, false)
        .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// Control and user-defined tokens (<|im_start|>, <|eot_id|>, Gemma's "\n", …) are matched whole
/// in text; only control tokens are special (left out of decoded text, taken literally in content).
fn add_special_tokens(
    tk: &mut tokenizers::Tokenizer,
    tokens: &[&str],
    types: impl Iterator<Item = i32>,
) -> Result<()> {
    let (mut control, mut user) = (Vec::new(), Vec::new());
    for (t, ty) in tokens.iter().zip(types) {
        match ty {
            // The unknown token as a control token: decoded only when specials are shown, as
            // llama.cpp's token_to_piece and our SentencePiece decoder do.
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => {
                control.push(AddedToken::from(t.to_string(), true))
            }
            // Matched on the raw text: a normalizer (SentencePiece's "▁" prefix) must not
            // change what "\n" matches.
            TOKEN_TYPE_USER_DEFINED => {
                user.push(AddedToken::from(t.to_string(), false).normalized(false))
            }
            _ => {}
        }
    }
    tk.add_special_tokens(control)
        .map_err(|e| anyhow!("the vocabulary's control tokens: {e}"))?;
    tk.add_tokens(user)
        .map_err(|e| anyhow!("the vocabulary's user-defined tokens: {e}"))?;
    Ok(())
}

/// SentencePiece BPE merges recovered from the vocabulary: every split of a token into two tokens that
/// both exist is a merge, ranked by the merged token's score (higher merges first).
fn spm_merges(tokens: &[&str], scores: &[f32], types: &[u8]) -> Vec<(String, String)> {
    let index: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f32, usize, String, String)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        // Only normal tokens (type 1) are built by merges.
        if types[id] != spm::NORMAL {
            continue;
        }
        for (split, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(split);
            if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                merges.push((scores[id], li.max(ri), l.to_string(), r.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    merges.into_iter().map(|(_, _, l, r)| (l, r)).collect()
}

/// Streams text out of generated ids without ever printing half a UTF-8 character. Only a short tail
/// is decoded per id (from the last point where text was released), so streaming stays O(n).
pub struct TextStream {
    ids: Vec<u32>,
    /// Start of the ids being decoded now.
    prev: usize,
    /// End of the ids whose text has been released.
    cur: usize,
    /// Control tokens' text is kept (a Harmony answer's markers), not left out.
    keep_special: bool,
}

impl TextStream {
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            prev: 0,
            cur: 0,
            keep_special: false,
        }
    }

    /// A stream that keeps control tokens' text (`<|channel|>`): for answers whose structure
    /// is written in them (gpt-oss's Harmony).
    pub fn keeping_special() -> Self {
        Self {
            keep_special: true,
            ..Self::new()
        }
    }

    /// Adds one id; returns the text that is now complete, if any.
    pub fn push(&mut self, tk: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let first = self.prev == 0;
        let released = tk.decode_part(&self.ids[self.prev..self.cur], !self.keep_special, first)?;
        let text = tk.decode_part(&self.ids[self.prev..], !self.keep_special, first)?;
        if text.len() > released.len()
            && !text.ends_with('\u{FFFD}')
            && text.is_char_boundary(released.len())
        {
            let new = text[released.len()..].to_string();
            self.prev = self.cur;
            self.cur = self.ids.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// What is left at the end (an incomplete tail is released as-is).
    pub fn finish(&mut self, tk: &Tokenizer) -> Result<Option<String>> {
        let first = self.prev == 0;
        let released = tk.decode_part(&self.ids[self.prev..self.cur], !self.keep_special, first)?;
        let text = tk.decode_part(&self.ids[self.prev..], !self.keep_special, first)?;
        self.prev = self.cur;
        self.cur = self.ids.len();
        if text.len() > released.len() && text.is_char_boundary(released.len()) {
            Ok(Some(text[released.len()..].to_string()))
        } else {
            Ok(None)
        }
    }
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

/// How long a text is in tokens: counted, or the fewest it can be from its bytes (not tokenized).
#[derive(Debug, Clone, Copy)]
pub enum Length {
    Counted(usize),
    /// (tokens at least, bytes)
    AtLeast(usize, usize),
}

impl Length {
    pub fn tokens(self) -> usize {
        match self {
            Length::Counted(n) | Length::AtLeast(n, _) => n,
        }
    }
}

impl std::fmt::Display for Length {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Length::Counted(n) => write!(f, "{n} tokens"),
            Length::AtLeast(n, bytes) => write!(f, "{bytes} bytes, at least {n} tokens"),
        }
    }
}

#[cfg(test)]
mod pre_tokenizer_tests {
    use super::*;
    use tokenizers::PreTokenizer;

    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let pres: Vec<PreTokenizerWrapper> = pre_tokenizer_regexes(pre)
            .unwrap()
            .iter()
            .map(|re| {
                let isolated = SplitDelimiterBehavior::Isolated;
                Split::new(SplitPattern::Regex(re.to_string()), isolated, false)
                    .unwrap()
                    .into()
            })
            .collect();
        let mut s = tokenizers::PreTokenizedString::from(text);
        PreSequence::new(pres).pre_tokenize(&mut s).unwrap();
        s.get_splits(
            tokenizers::OffsetReferential::Original,
            tokenizers::OffsetType::Byte,
        )
        .into_iter()
        .map(|(p, _, _)| p.to_string())
        .collect()
    }

    /// The splits of Python's `regex.findall` with tokenizer.json's pattern.
    #[test]
    fn gpt_4o_keeps_case_runs_contractions_and_digit_triples_as_o200k_splits_them() {
        assert_eq!(
            pieces("gpt-4o", "Hello WORLDwide don't 12345!\n\n x  ÉCOLE"),
            [
                "Hello",
                " WORLDwide",
                " don't",
                " ",
                "123",
                "45",
                "!\n\n",
                " x",
                " ",
                " ÉCOLE"
            ]
        );
    }
}
