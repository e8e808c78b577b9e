//! The prefix store: the KV state of every full block of [`STORE_BLOCK`] prompt tokens, kept on disk under
//! the cache directory, so that any later run or chat whose prompt starts with the same tokens
//! restores those blocks instead of prefilling them (vLLM's automatic prefix caching, across
//! processes and on disk).
//!
//! **Keys** are chained, so a block names everything before it:
//! `key(0) = sha256(FORMAT, model identity, cache axes, B, tokens 0..B)`,
//! `key(i) = sha256(key(i − 1), tokens iB..(i+1)B)`. A *tail* — the positions from a block's start
//! to a boundary inside it where prompts tend to part (the end of the system message) — is keyed
//! `sha256(key(i − 1), "tail", length, its tokens)` and ends its chain. A prompt reuses the longest
//! run of stored blocks from its start, then the longest stored tail after them.
//!
//! **Last use** is a block's mtime; a chain's deeper blocks are given slightly older times than
//! its first ones, so the least-recently-used eviction takes a chain from its end and never strands
//! blocks behind a missing one. Concurrent writers may overshoot the budget by what they write at
//! once (each makes room under the lock, then writes without it); the next run's eviction takes it
//! back.
//!
//! **Layout**: `<root>/<model id>/<key>.kvb`, one directory per model identity (its GGUF digest, a
//! sample of its weight bytes, and the numerics that produced the rows), with a `model.json` naming
//! the file; `<root>/stats.json` holds the cumulative figures and `<root>/lock` serializes their
//! update and eviction between processes.
//!
//! **A block file**: `"KVCHATB1"`, a u32 (LE) header length, the JSON header (key, parent key,
//! model, axes, block size, index, shape), the block's B token ids (u32 LE), each layer's key rows
//! then value rows (`[n_kv_heads, B, row bytes]`, in the cache's precision, as `Layer::raw_range`
//! gives them), for a model with recurrent states (Qwen3.5) maybe those states as they stand at the
//! block's end (`kv::States::encode`; the header says whether), and a sha256 of everything before
//! it. A state is large (MiBs where a block's rows are KiBs), so only the blocks where a resume is
//! likely carry one: a prompt's last full block and its boundaries (`Session::state_marks`); a
//! model with states resumes only at a block that carries them. A block is written to a temporary file and
//! renamed into place, so a reader sees a whole block or none; one that fails any check (size,
//! checksum, header, tokens) is removed, reported once, and never used. A block that cannot be read
//! (permissions, I/O) is reported and left alone.

//!
//! - `key`: the chained keys and the pieces a prompt may store; `block`: a block file, read and
//!   checked; `store`: open, lookup, write; `evict`: the lock, last use, eviction and totals;
//!   `admin`: listing and clearing (`kvchat cache`).

mod admin;
mod block;
mod evict;
mod key;
mod store;
#[cfg(test)]
mod tests;

pub use admin::{clear, list, stats, StoredPrefix};

use super::layer::RawState;
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// Tokens per block. 64 rather than 256: a prompt reuses only whole blocks, so a shared document
/// followed by different questions loses on average half a block; at 64 that is ~32 tokens. (Reading
/// 28 blocks of 64, 39 MiB, takes ~80 ms here; 256-token blocks were not measured against it.)
pub const STORE_BLOCK: usize = 64;
/// The default byte budget of the whole store (`--kv-store-budget`).
pub const DEFAULT_BUDGET: u64 = 2 << 30;
const MAGIC: &[u8; 8] = b"KVCHATB1";
const FORMAT: &str = "kvchat-kv-block/1";
/// The longest header a block may have.
const MAX_HEADER: usize = 64 << 10;

/// What the rows of a block depend on besides its tokens.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The model's digest, a sample of its weights and the numerics (kernels, SIMD level, device).
    pub model: String,
    /// The model file, for `kvchat cache ls` and `clear --model`.
    pub file: String,
    /// The cache's axes (`KvCache::persist_key`).
    pub axes: String,
}

impl Identity {
    /// The model's directory name: 16 hex digits of its identity.
    fn dir_name(&self) -> String {
        hex(&Sha256::digest(self.model.as_bytes()))[..16].to_string()
    }
}

/// The shape of one block's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub layers: usize,
    pub n_kv_heads: usize,
    /// Bytes of one stored row (one position of one head).
    pub row_bytes: usize,
    /// Bytes of the recurrent states at a block's end (0: the model keeps none).
    pub state_bytes: usize,
}

impl Shape {
    /// Bytes of one layer's keys (or values) for `len` positions: `[n_kv_heads, len, row]`.
    fn part(&self, len: usize) -> usize {
        self.n_kv_heads * len * self.row_bytes
    }
    /// Bytes of a block file of `len` positions with a header of `header` bytes, with the
    /// recurrent states at its end or without.
    fn file_bytes(&self, header: usize, len: usize, states: bool) -> usize {
        let states = if states { self.state_bytes } else { 0 };
        MAGIC.len() + 4 + header + 4 * len + 2 * self.layers * self.part(len) + states + 32
    }
}

/// The positions a stored block holds: a full block (`start` a multiple of [`STORE_BLOCK`], `len` =
/// STORE_BLOCK), or a *tail*: the positions from the last full block to a boundary where prompts tend to
/// part (the end of the system message), shorter than a block. Full blocks chain; a tail ends its
/// chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub start: usize,
    pub len: usize,
}

impl Piece {
    pub fn end(&self) -> usize {
        self.start + self.len
    }
    fn is_tail(&self) -> bool {
        self.len != STORE_BLOCK
    }
}

/// One block's rows, per layer `(keys, values)`, each `[n_kv_heads, len, row]`.
pub type BlockRows = Vec<(Vec<u8>, Vec<u8>)>;

/// What a piece to write holds: its rows, and the recurrent states at its end when it keeps them
/// (`Shape::state_bytes` bytes).
pub struct PieceRows {
    pub rows: BlockRows,
    pub states: Option<Vec<u8>>,
}

/// What a lookup found.
#[derive(Default)]
pub struct Found {
    /// Positions restored (the end of a full block or of a tail).
    pub tokens: usize,
    /// Per layer, the stored rows of positions `0..tokens`, ready for `Layer::restore_raw`.
    pub layers: Vec<RawState>,
    /// The recurrent states at `tokens` (a model that keeps them resumes only where they are).
    pub states: Option<Vec<u8>>,
    pub bytes_read: u64,
    pub elapsed: Duration,
    /// Blocks found damaged or foreign (each removed), one line each.
    pub problems: Vec<Problem>,
    /// Where the first damaged block started (the blocks after it are suspect too).
    pub damaged_at: Option<usize>,
    /// The files restored, in order (removed if their rows are refused: [`PrefixStore::discard`]).
    pub paths: Vec<PathBuf>,
    /// Blocks removed as damaged or foreign.
    pub removed: usize,
}

/// Something the store could not do, for a person: the text names values, `fix` says what would
/// avoid it (the front end words it as its flag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub text: String,
    pub fix: Option<crate::Fix>,
}

impl From<String> for Problem {
    fn from(text: String) -> Self {
        Self { text, fix: None }
    }
}

impl From<&str> for Problem {
    fn from(text: &str) -> Self {
        text.to_string().into()
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// What a write did.
#[derive(Default, Debug)]
pub struct Written {
    pub blocks: usize,
    pub bytes: u64,
    pub evicted: usize,
    pub problems: Vec<Problem>,
    /// How long making room and writing took.
    pub elapsed: Duration,
}

/// The cumulative figures of a store (`stats.json`).
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct Totals {
    /// Prompts looked up.
    pub lookups: u64,
    /// Of those, the ones that reused at least one block.
    pub hits: u64,
    /// Prompt tokens looked up.
    pub prompt_tokens: u64,
    /// Of those, restored from the store.
    pub reused_tokens: u64,
    pub bytes_read: u64,
    pub blocks_written: u64,
    pub bytes_written: u64,
    pub evictions: u64,
    /// Blocks removed because they were damaged or foreign.
    pub removed_damaged: u64,
}

impl Totals {
    /// Reused prompt tokens out of those looked up, in percent.
    pub fn hit_rate(&self) -> f64 {
        100.0 * self.reused_tokens as f64 / (self.prompt_tokens.max(1)) as f64
    }
}

/// The store of one model identity and cache configuration.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    root: PathBuf,
    dir: PathBuf,
    ident: Identity,
    shape: Shape,
    budget: u64,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn human(n: u64) -> String {
    crate::human_bytes(n)
}
