//! The tokenizer: built from the GGUF's own metadata with the `tokenizers` crate (no tokenizer.json
//! needed), or loaded from a tokenizer.json given with `--tokenizer`.
//!
//! `tokenizer.ggml.model = gpt2` is byte-level BPE whose pre-tokenizer regexes are named by
//! `tokenizer.ggml.pre` (as in llama.cpp); `llama` is SentencePiece-style BPE with byte fallback, whose
//! merges are recovered from the vocabulary's scores.

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
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's pre-tokenizer regex.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: like Llama 3's, but digits one at a time.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

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
        other => bail!(
            "unsupported tokenizer.ggml.pre '{other}' (supported: default, gpt2, smollm, starcoder, \
             llama-bpe, qwen2 and their aliases); give a tokenizer.json instead"
        ),
    })
}

/// A tokenizer plus the ids that matter to generation.
pub struct Tokenizer {
    pub inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Whether a BOS token goes before the prompt (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// The same tokenizer with special-token text read as plain text (made on first use).
    literal: std::sync::OnceLock<tokenizers::Tokenizer>,
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
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let mut inner = match model.as_str() {
            "gpt2" => {
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
                tk
            }
            "llama" => {
                let scores = md_numbers(ct, "tokenizer.ggml.scores", tokens.len())?
                    .context("GGUF llama tokenizer has no tokenizer.ggml.scores")?;
                let merges = spm_merges(&tokens, &scores, types.as_deref());
                let unk = md_u32(ct, "tokenizer.ggml.unknown_token_id")
                    .and_then(|i| tokens.get(i as usize))
                    .map(|s| s.to_string());
                let mut builder = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .byte_fallback(true)
                    .fuse_unk(true);
                if let Some(unk) = unk {
                    builder = builder.unk_token(unk);
                }
                let bpe = builder.build().map_err(|e| anyhow!("building BPE from GGUF: {e}"))?;
                let add_space_prefix = md_bool(ct, "tokenizer.ggml.add_space_prefix").unwrap_or(true);
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
                tk.with_normalizer(Some(NormalizerSequence::new(norms)));
                tk.with_decoder(Some(DecoderSequence::new(decs)));
                tk
            }
            other => bail!(
                "unsupported tokenizer.ggml.model '{other}' (supported: gpt2, llama); give a tokenizer.json instead"
            ),
        };
        // Control and user-defined tokens (<|im_start|>, <|eot_id|>, …) are matched whole in text.
        if let Some(types) = &types {
            let specials: Vec<AddedToken> = tokens
                .iter()
                .zip(types)
                .filter(|(_, &ty)| {
                    ty as i32 == TOKEN_TYPE_CONTROL || ty as i32 == TOKEN_TYPE_USER_DEFINED
                })
                .map(|(t, _)| AddedToken::from(t.to_string(), true))
                .collect();
            inner.add_special_tokens(&specials);
        }
        Ok(Self {
            inner,
            literal: Default::default(),
            bos_id: md_u32(ct, "tokenizer.ggml.bos_token_id"),
            eos_id: md_u32(ct, "tokenizer.ggml.eos_token_id"),
            add_bos: md_bool(ct, "tokenizer.ggml.add_bos_token").unwrap_or(model == "llama"),
        })
    }

    /// Loads a tokenizer.json; BOS/EOS ids still come from the model (`fallback`) when it has them.
    pub fn from_file(path: &Path, fallback: Option<&Tokenizer>) -> Result<Self> {
        crate::fsx::check_regular(path, crate::fsx::MAX_TOKENIZER_JSON, "tokenizer file")?;
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        Ok(Self {
            inner,
            literal: Default::default(),
            bos_id: fallback.and_then(|t| t.bos_id),
            eos_id: fallback.and_then(|t| t.eos_id),
            add_bos: fallback.is_some_and(|t| t.add_bos),
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
            inner,
            literal: Default::default(),
        };
        Ok((tk, template))
    }

    /// Text to ids. Special-token text (`<|im_start|>`) becomes its one id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text to ids with special-token text taken literally: `<|im_start|>` typed by a user is the
    /// characters `<`, `|`, … and never the control token.
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>> {
        let tk = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = tk
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether `text` holds the text of a special token (`<|im_start|>`, `<|eot_id|>`, …).
    pub fn has_special_text(&self, text: &str) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .values()
            .any(|t| t.special && !t.content.is_empty() && text.contains(t.content.as_str()))
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
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("detokenizing failed: {e}"))
    }

    /// The BOS token's text ("" when the model has none), as chat templates print it.
    pub fn bos_text(&self) -> String {
        self.bos_id
            .and_then(|i| self.inner.id_to_token(i))
            .unwrap_or_default()
    }

    /// The EOS token's text ("" when the model has none).
    pub fn eos_text(&self) -> String {
        self.eos_id
            .and_then(|i| self.inner.id_to_token(i))
            .unwrap_or_default()
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// SentencePiece BPE merges recovered from the vocabulary: every split of a token into two tokens that
/// both exist is a merge, ranked by the merged token's score (higher merges first).
fn spm_merges(tokens: &[&str], scores: &[f32], types: Option<&[f32]>) -> Vec<(String, String)> {
    let index: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f32, usize, String, String)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        // Only normal tokens (type 1) are built by merges.
        if types.is_some_and(|ty| ty[id] as i32 != 1) {
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
}

impl TextStream {
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            prev: 0,
            cur: 0,
        }
    }

    /// Adds one id; returns the text that is now complete, if any.
    pub fn push(&mut self, tk: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let released = tk.decode(&self.ids[self.prev..self.cur], true)?;
        let text = tk.decode(&self.ids[self.prev..], true)?;
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
        let released = tk.decode(&self.ids[self.prev..self.cur], true)?;
        let text = tk.decode(&self.ids[self.prev..], true)?;
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
