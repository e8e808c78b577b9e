//! The prefix store: the KV state of every full block of [`BLOCK`] prompt tokens, kept on disk under
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
//! gives them), and a sha256 of everything before it. A block is written to a temporary file and
//! renamed into place, so a reader sees a whole block or none; one that fails any check (size,
//! checksum, header, tokens) is removed, reported once, and never used. A block that cannot be read
//! (permissions, I/O) is reported and left alone.

use super::layer::RawState;
use crate::interrupt::TempFile;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// Tokens per block. 64 rather than 256: a prompt reuses only whole blocks, so a shared document
/// followed by different questions loses on average half a block; at 64 that is ~32 tokens. (Reading
/// 28 blocks of 64, 39 MiB, takes ~80 ms here; 256-token blocks were not measured against it.)
pub const BLOCK: usize = 64;
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
}

impl Shape {
    /// Bytes of one layer's keys (or values) for `len` positions: `[n_kv_heads, len, row]`.
    fn part(&self, len: usize) -> usize {
        self.n_kv_heads * len * self.row_bytes
    }
    /// Bytes of a block file of `len` positions with a header of `header` bytes.
    fn file_bytes(&self, header: usize, len: usize) -> usize {
        MAGIC.len() + 4 + header + 4 * len + 2 * self.layers * self.part(len) + 32
    }
}

/// The positions a stored block holds: a full block (`start` a multiple of [`BLOCK`], `len` =
/// BLOCK), or a *tail*: the positions from the last full block to a boundary where prompts tend to
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
        self.len != BLOCK
    }
}

/// A block file read and checked: its bytes, and where its rows start (each layer's keys then
/// values, `[n_kv_heads, len, row]` each).
struct Rows {
    bytes: Vec<u8>,
    at: usize,
}

/// Why a block could not be used.
enum BlockError {
    /// It cannot be read (permissions, I/O): reported, left alone.
    Unreadable(String),
    /// It is not what its name says (damaged, truncated, foreign): reported and removed.
    Damaged(String),
}

/// The last-use time given to `piece` at `now`: a microsecond older per position into the prompt,
/// so that eviction takes a chain from its end.
fn last_use(now: SystemTime, piece: Piece) -> SystemTime {
    now.checked_sub(Duration::from_micros(piece.start as u64 + 1))
        .unwrap_or(now)
}

/// One block's rows, per layer `(keys, values)`, each `[n_kv_heads, len, row]`.
pub type BlockRows = Vec<(Vec<u8>, Vec<u8>)>;

/// What a lookup found.
#[derive(Default)]
pub struct Found {
    /// Positions restored (the end of a full block or of a tail).
    pub tokens: usize,
    /// Per layer, the stored rows of positions `0..tokens`, ready for `Layer::restore_raw`.
    pub layers: Vec<RawState>,
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

impl PrefixStore {
    /// Opens (creating) the store under `root` for this model and cache. An error says, in one
    /// line, why the store cannot be used (the caller goes on without it).
    pub fn open(root: &Path, ident: Identity, shape: Shape, budget: u64) -> Result<Self> {
        check_dir(root)?;
        let dir = root.join(ident.dir_name());
        check_dir(&dir)?;
        let store = Self {
            root: root.to_path_buf(),
            dir,
            ident,
            shape,
            budget,
        };
        let meta = store.dir.join("model.json");
        if !meta.exists() {
            let json = serde_json::json!({ "file": store.ident.file, "model": store.ident.model });
            // Best effort: without it `cache ls` shows the id instead of the file.
            let _ = write_atomically(&meta, json.to_string().as_bytes(), None);
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The chained key of each full block of `tokens`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<[u8; 32]> {
        let mut out: Vec<[u8; 32]> = Vec::with_capacity(tokens.len() / BLOCK);
        for block in tokens.chunks_exact(BLOCK) {
            let key = self.key(out.last(), false, block);
            out.push(key);
        }
        out
    }

    /// The key of a block of `tokens` after the block keyed `parent` (None: the first).
    fn key(&self, parent: Option<&[u8; 32]>, tail: bool, tokens: &[u32]) -> [u8; 32] {
        let mut h = Sha256::new();
        match parent {
            None => {
                for part in [FORMAT, &self.ident.model, &self.ident.axes] {
                    h.update((part.len() as u64).to_le_bytes());
                    h.update(part.as_bytes());
                }
                h.update((BLOCK as u64).to_le_bytes());
            }
            Some(p) => h.update(p),
        }
        if tail {
            h.update(b"tail");
            h.update((tokens.len() as u64).to_le_bytes());
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        h.finalize().into()
    }

    /// The key and parent of `piece` of `tokens`, given the keys of the full blocks before it.
    fn key_of(
        &self,
        tokens: &[u32],
        piece: Piece,
        full: &[[u8; 32]],
    ) -> ([u8; 32], Option<[u8; 32]>) {
        let i = piece.start / BLOCK;
        let parent = (i > 0).then(|| full[i - 1]);
        let key = if piece.is_tail() {
            self.key(parent.as_ref(), true, &tokens[piece.start..piece.end()])
        } else {
            full[i]
        };
        (key, parent)
    }

    fn path_of(&self, key: &[u8; 32]) -> PathBuf {
        self.dir.join(format!("{}.kvb", hex(key)))
    }

    /// The pieces of `tokens[..upto]` a store may hold: its full blocks, and for each of
    /// `boundaries` that is not a block's end, the tail from the block it falls in to it.
    pub fn pieces(&self, upto: usize, boundaries: &[usize]) -> Vec<Piece> {
        let mut out: Vec<Piece> = (0..upto / BLOCK)
            .map(|i| Piece {
                start: i * BLOCK,
                len: BLOCK,
            })
            .collect();
        for &b in boundaries {
            let tail = Piece {
                start: b / BLOCK * BLOCK,
                len: b % BLOCK,
            };
            if b <= upto && tail.len > 0 && !out.contains(&tail) {
                out.push(tail);
            }
        }
        out
    }

    /// Restores the longest run of stored full blocks that `tokens[..limit]` starts with, then
    /// the longest stored tail after them (ending at one of `boundaries`), ending where `ok` allows
    /// (a quantized cache may not resume everywhere). Blocks found damaged or foreign are removed
    /// and named in `problems`; the run stops there.
    pub fn lookup(
        &self,
        tokens: &[u32],
        limit: usize,
        boundaries: &[usize],
        ok: &dyn Fn(usize) -> bool,
    ) -> Found {
        let t0 = Instant::now();
        let mut found = Found::default();
        let limit = limit.min(tokens.len());
        let full = self.keys(&tokens[..limit]);
        // (piece, path, rows) of each block read, in order.
        let mut read: Vec<(Piece, PathBuf, Rows)> = Vec::new();
        let now = SystemTime::now();
        let try_piece =
            |piece: Piece, read: &mut Vec<(Piece, PathBuf, Rows)>, found: &mut Found| {
                let (key, parent) = self.key_of(tokens, piece, &full);
                let path = self.path_of(&key);
                let range = &tokens[piece.start..piece.end()];
                match self.read_block(&path, &key, parent.as_ref(), piece, range) {
                    Ok(Some((r, f))) => {
                        found.bytes_read += r.bytes.len() as u64;
                        // Its last use, for the LRU eviction (deeper blocks a little older).
                        let _ = f.set_modified(last_use(now, piece));
                        read.push((piece, path, r));
                        true
                    }
                    Ok(None) => false,
                    Err(BlockError::Unreadable(e)) => {
                        found
                            .problems
                            .push(format!("cannot read {}: {e}", path.display()).into());
                        false
                    }
                    Err(BlockError::Damaged(e)) => {
                        let removed = std::fs::remove_file(&path);
                        found.removed += usize::from(removed.is_ok());
                        found.problems.push(Problem::from(match removed {
                            Ok(()) => format!("removed {}: {e}", path.display()),
                            Err(r) => format!(
                                "{} is damaged ({e}) and cannot be removed: {r}",
                                path.display()
                            ),
                        }));
                        found.damaged_at = Some(piece.start);
                        false
                    }
                }
            };
        let mut at = 0;
        for i in 0..full.len() {
            let piece = Piece {
                start: i * BLOCK,
                len: BLOCK,
            };
            if !try_piece(piece, &mut read, &mut found) {
                break;
            }
            at = piece.end();
        }
        if found.problems.is_empty() {
            let mut tails: Vec<usize> = boundaries
                .iter()
                .copied()
                .filter(|&b| b > at && b < at + BLOCK && b <= limit && ok(b))
                .collect();
            tails.sort_unstable_by_key(|&b| std::cmp::Reverse(b));
            for b in tails {
                let piece = Piece {
                    start: at,
                    len: b - at,
                };
                if try_piece(piece, &mut read, &mut found) {
                    break;
                }
                if !found.problems.is_empty() {
                    break;
                }
            }
        }
        // Back to the last end a resume may start from.
        while read.last().is_some_and(|(p, _, _)| !ok(p.end())) {
            read.pop();
        }
        found.tokens = read.last().map_or(0, |(p, _, _)| p.end());
        // Each layer's keys and values, `[nkv, tokens, row]`, straight from the files' bytes.
        let nkv = self.shape.n_kv_heads;
        let row = self.shape.row_bytes;
        found.layers = (0..self.shape.layers)
            .map(|l| {
                let join = |which: usize| {
                    let mut out = Vec::with_capacity(nkv * found.tokens * row);
                    for h in 0..nkv {
                        for (p, _, r) in &read {
                            let part = self.shape.part(p.len);
                            let start = r.at + (2 * l + which) * part + h * p.len * row;
                            out.extend_from_slice(&r.bytes[start..start + p.len * row]);
                        }
                    }
                    out
                };
                RawState {
                    k: join(0),
                    v: join(1),
                    residual_k: Vec::new(),
                    residual_v: Vec::new(),
                    residual_from: found.tokens,
                }
            })
            .collect();
        found.paths = read.into_iter().map(|(_, p, _)| p).collect();
        found.elapsed = t0.elapsed();
        found
    }

    /// Removes blocks whose rows were refused although their checks passed; returns one line.
    pub fn discard(&self, paths: &[PathBuf], why: &str) -> String {
        let removed = paths
            .iter()
            .filter(|p| std::fs::remove_file(p).is_ok())
            .count();
        format!(
            "the stored prefix could not be restored ({why}); removed its {removed} of {} blocks",
            paths.len()
        )
    }

    /// Reads and checks one block: `Ok(None)` when there is none; with it the open file.
    fn read_block(
        &self,
        path: &Path,
        key: &[u8; 32],
        parent: Option<&[u8; 32]>,
        piece: Piece,
        tokens: &[u32],
    ) -> std::result::Result<Option<(Rows, std::fs::File)>, BlockError> {
        use BlockError::{Damaged, Unreadable};
        let f = match crate::fsx::open_regular_nofollow(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            // A link, pipe or directory where a block belongs was not written by kvchat.
            Err(e) if e.kind() == std::io::ErrorKind::Other => return Err(Damaged(e.to_string())),
            Err(e) => return Err(Unreadable(e.to_string())),
        };
        let size = f.metadata().map_err(|e| Unreadable(e.to_string()))?.len() as usize;
        let most = self.shape.file_bytes(MAX_HEADER, piece.len);
        if size > most {
            return Err(Damaged(format!(
                "{size} bytes, more than a block of this cache can be ({most})"
            )));
        }
        let mut bytes = Vec::with_capacity(size);
        (&f).take(most as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Unreadable(e.to_string()))?;
        let bad = |why: String| Err(Damaged(why));
        if bytes.len() < MAGIC.len() + 4 + 32 || &bytes[..8] != MAGIC {
            return bad("not a kvchat KV block (truncated or another format)".into());
        }
        let (body, sum) = bytes.split_at(bytes.len() - 32);
        if Sha256::digest(body).as_slice() != sum {
            return bad("checksum mismatch (damaged)".into());
        }
        let hlen = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes")) as usize;
        if hlen > MAX_HEADER || self.shape.file_bytes(hlen, piece.len) != bytes.len() {
            return bad(format!(
                "{} bytes, not a block of this cache's shape",
                bytes.len()
            ));
        }
        let header: serde_json::Value = match serde_json::from_slice(&body[12..12 + hlen]) {
            Ok(h) => h,
            Err(_) => return bad("unreadable header".into()),
        };
        if header != self.header(key, parent, piece) {
            return bad("made for another model, cache or position (foreign block)".into());
        }
        let at = 12 + hlen;
        let stored = body[at..at + 4 * piece.len]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")));
        if !stored.eq(tokens.iter().copied()) {
            return bad("holds other tokens than its key says".into());
        }
        let at = at + 4 * piece.len;
        Ok(Some((Rows { bytes, at }, f)))
    }

    fn header(&self, key: &[u8; 32], parent: Option<&[u8; 32]>, piece: Piece) -> serde_json::Value {
        serde_json::json!({
            "format": FORMAT,
            "key": hex(key),
            "parent": parent.map(|p| hex(p)).unwrap_or_default(),
            "start": piece.start,
            "len": piece.len,
            "block": BLOCK,
            "model": self.ident.model,
            "axes": self.ident.axes,
            "layers": self.shape.layers,
            "n_kv_heads": self.shape.n_kv_heads,
            "row_bytes": self.shape.row_bytes,
        })
    }

    /// The pieces of `tokens[..upto]` (see [`PrefixStore::pieces`]) to write: those not stored
    /// yet or not of their exact size (truncated), and every one from `rewrite_from` on (after a
    /// damaged block was found there).
    pub fn missing(
        &self,
        tokens: &[u32],
        upto: usize,
        boundaries: &[usize],
        rewrite_from: usize,
    ) -> Vec<Piece> {
        let upto = upto.min(tokens.len());
        let full = self.keys(&tokens[..upto]);
        self.pieces(upto, boundaries)
            .into_iter()
            .filter(|&p| {
                let (key, parent) = self.key_of(tokens, p, &full);
                let size = std::fs::symlink_metadata(self.path_of(&key)).map(|m| m.len());
                p.start >= rewrite_from || size.ok() != Some(self.file_size(&key, parent, p))
            })
            .collect()
    }

    /// The exact size of the file of `piece`.
    fn file_size(&self, key: &[u8; 32], parent: Option<[u8; 32]>, piece: Piece) -> u64 {
        let h =
            serde_json::to_vec(&self.header(key, parent.as_ref(), piece)).map_or(0, |h| h.len());
        self.shape.file_bytes(h, piece.len) as u64
    }

    /// Bytes the file of a block of `len` positions takes (at most: the header's numbers may be
    /// a few digits longer than these).
    fn block_bytes(&self, len: usize) -> u64 {
        self.file_size(&[0; 32], Some([0; 32]), Piece { start: 0, len }) + 16
    }

    /// Writes `pieces` of `tokens` (`rows[j]` holding `pieces[j]`), after making room for them
    /// within the budget (least recently used blocks first, of any model).
    pub fn write(&self, tokens: &[u32], pieces: &[Piece], rows: Vec<BlockRows>) -> Written {
        let t0 = Instant::now();
        let mut out = self.write_timed(tokens, pieces, rows);
        out.elapsed = t0.elapsed();
        out
    }

    fn write_timed(&self, tokens: &[u32], pieces: &[Piece], rows: Vec<BlockRows>) -> Written {
        let mut out = Written::default();
        if pieces.is_empty() {
            return out;
        }
        let need: u64 = pieces.iter().map(|p| self.block_bytes(p.len)).sum();
        if need > self.budget {
            out.problems.push(Problem {
                text: format!(
                    "{} of blocks do not fit the store's budget of {}; nothing stored",
                    human(need),
                    human(self.budget)
                ),
                fix: Some(crate::Fix::StoreBudget),
            });
            return out;
        }
        match self.locked(|| evict(&self.root, self.budget - need)) {
            Ok(n) => out.evicted = n,
            Err(e) => {
                out.problems.push(format!("cannot make room: {e:#}").into());
                return out;
            }
        }
        let upto = pieces.iter().map(|p| p.end()).max().unwrap_or(0);
        let fits = |p: &Piece, b: &BlockRows| {
            b.len() == self.shape.layers
                && b.iter()
                    .all(|(k, v)| k.len() == self.shape.part(p.len) && v.len() == k.len())
        };
        let all_fit = pieces.iter().zip(&rows).all(|(p, b)| fits(p, b));
        if rows.len() != pieces.len() || upto > tokens.len() || !all_fit {
            out.problems
                .push("the rows to store do not match their blocks; nothing stored".into());
            return out;
        }
        let full = self.keys(&tokens[..upto]);
        let now = SystemTime::now();
        for (&piece, block) in pieces.iter().zip(rows) {
            let (key, parent) = self.key_of(tokens, piece, &full);
            let header = serde_json::to_vec(&self.header(&key, parent.as_ref(), piece))
                .expect("a JSON value serializes");
            let mut body = Vec::with_capacity(self.shape.file_bytes(header.len(), piece.len));
            body.extend_from_slice(MAGIC);
            body.extend_from_slice(&(header.len() as u32).to_le_bytes());
            body.extend_from_slice(&header);
            for t in &tokens[piece.start..piece.end()] {
                body.extend_from_slice(&t.to_le_bytes());
            }
            for (k, v) in &block {
                body.extend_from_slice(k);
                body.extend_from_slice(v);
            }
            let sum = Sha256::digest(&body);
            body.extend_from_slice(&sum);
            let mtime = Some(last_use(now, piece));
            if let Err(e) = write_atomically(&self.path_of(&key), &body, mtime) {
                out.problems.push(
                    format!(
                        "cannot write blocks in {}: {}; this prompt's prefix is not stored",
                        self.dir.display(),
                        crate::first_line(e)
                    )
                    .into(),
                );
                break;
            }
            out.blocks += 1;
            out.bytes += body.len() as u64;
        }
        out
    }

    /// Adds a run's figures to the store's totals.
    pub fn record(&self, add: &Totals) -> Result<()> {
        self.locked(|| add_totals(&self.root, add))
    }

    /// Runs `f` holding the store's lock (shared with every process using this root).
    fn locked<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        with_lock(&self.root, f)
    }
}

/// Runs `f` holding `<root>/lock` exclusively.
fn with_lock<T>(root: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let path = root.join("lock");
    use std::os::unix::fs::OpenOptionsExt;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(crate::fsx::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    lock.lock()
        .with_context(|| format!("cannot lock {}", path.display()))?;
    let r = f();
    let _ = lock.unlock();
    r
}

/// `dir` exists as a directory (created if absent); anything else is an error naming it.
fn check_dir(dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => bail!(
            "{} is {}, not a directory",
            dir.display(),
            crate::fsx::kind(&m)
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
        }
        Err(e) => bail!("cannot read {}: {e}", dir.display()),
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory, renamed into place,
/// with the modification time `mtime` when given.
fn write_atomically(path: &Path, bytes: &[u8], mtime: Option<SystemTime>) -> Result<()> {
    let (tmp, mut f) = TempFile::beside(path).context("cannot create a temporary file")?;
    f.write_all(bytes)?;
    if let Some(t) = mtime {
        f.set_modified(t)?;
    }
    drop(f);
    tmp.keep(path)
}

/// Every block file of the store: (path, bytes, last use).
fn blocks(root: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    model_dirs(root).iter().flat_map(|d| blocks_in(d)).collect()
}

/// The block files of one model directory: (path, bytes, last use).
fn blocks_in(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "kvb"))
        .filter_map(|e| {
            // (DirEntry metadata does not follow links.)
            let m = e.metadata().ok().filter(|m| m.is_file())?;
            let when = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            Some((e.path(), m.len(), when))
        })
        .collect()
}

fn model_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

/// Removes least recently used blocks until the store holds at most `budget` bytes (and temporary
/// files left by processes that died); returns how many blocks went. Call under the lock.
fn evict(root: &Path, budget: u64) -> Result<usize> {
    for dir in std::iter::once(root.to_path_buf()).chain(model_dirs(root)) {
        crate::interrupt::remove_stale(&dir, None);
    }
    let mut all = blocks(root);
    let mut total: u64 = all.iter().map(|b| b.1).sum();
    if total <= budget {
        return Ok(0);
    }
    all.sort_by_key(|b| b.2);
    let mut n = 0;
    for (path, bytes, _) in all {
        if total <= budget {
            break;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => n += 1,
            // Another process removed it first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => bail!("cannot remove {}: {e}", path.display()),
        }
        total -= bytes;
    }
    if n > 0 {
        let evicted = Totals {
            evictions: n as u64,
            ..Totals::default()
        };
        add_totals(root, &evicted)?;
    }
    Ok(n)
}

/// Adds `add` to `<root>/stats.json` (under the lock).
fn add_totals(root: &Path, add: &Totals) -> Result<()> {
    let mut t = read_totals(root);
    t += add;
    let json = serde_json::to_string_pretty(&t)?;
    write_atomically(&root.join("stats.json"), json.as_bytes(), None)
}

impl std::ops::AddAssign<&Totals> for Totals {
    fn add_assign(&mut self, a: &Totals) {
        self.lookups += a.lookups;
        self.hits += a.hits;
        self.prompt_tokens += a.prompt_tokens;
        self.reused_tokens += a.reused_tokens;
        self.bytes_read += a.bytes_read;
        self.blocks_written += a.blocks_written;
        self.bytes_written += a.bytes_written;
        self.evictions += a.evictions;
        self.removed_damaged += a.removed_damaged;
    }
}

fn read_totals(root: &Path) -> Totals {
    crate::fsx::read_bounded(&root.join("stats.json"), 1 << 20, "the store's totals")
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The store's cumulative figures and what it holds now: (totals, blocks, bytes).
pub fn stats(root: &Path) -> (Totals, usize, u64) {
    let b = blocks(root);
    (read_totals(root), b.len(), b.iter().map(|x| x.1).sum())
}

/// A stored prefix: a chain of blocks that no other stored block extends.
#[derive(Debug, Clone)]
pub struct Entry {
    pub model: String,
    /// The cache's axes ("all, f16").
    pub axes: String,
    pub tokens: usize,
    /// Bytes of its blocks (blocks shared with other entries are counted in each).
    pub bytes: u64,
    pub last_use: SystemTime,
}

/// The stored prefixes, most recently used first.
pub fn list(root: &Path) -> Vec<Entry> {
    let mut out = Vec::new();
    for dir in model_dirs(root) {
        let model = model_file(&dir);
        // key → (parent, index, bytes, last use)
        let mut nodes = std::collections::HashMap::new();
        for (path, bytes, when) in blocks_in(&dir) {
            let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
            match block_links(&path) {
                // A header must name its own file (a forged one could make a cycle).
                Some((key, parent, end, axes)) if Some(&key) == stem.as_ref() => {
                    nodes.insert(key, (parent, end, bytes, when, axes));
                }
                _ => {}
            }
        }
        let parents: std::collections::HashSet<&String> = nodes.values().map(|n| &n.0).collect();
        for (key, (_, end, _, _, axes)) in &nodes {
            if parents.contains(key) {
                continue;
            }
            let (mut bytes, mut last, mut at) = (0, SystemTime::UNIX_EPOCH, Some(key));
            // At most one step per block: a forged cycle cannot hang the walk.
            for _ in 0..nodes.len() {
                let Some((p, _, b, w, _)) = at.and_then(|k| nodes.get(k)) else {
                    break;
                };
                bytes += b;
                last = last.max(*w);
                at = Some(p);
            }
            out.push(Entry {
                model: model.clone(),
                axes: axes.clone(),
                tokens: *end,
                bytes,
                last_use: last,
            });
        }
    }
    out.sort_by_key(|e| std::cmp::Reverse(e.last_use));
    out
}

/// A block's (key, parent, end position, axes), from its header alone.
fn block_links(path: &Path) -> Option<(String, String, usize, String)> {
    let mut f = crate::fsx::open_regular_nofollow(path).ok()?;
    let mut head = [0u8; 12];
    f.read_exact(&mut head).ok()?;
    let n = u32::from_le_bytes(head[8..12].try_into().ok()?) as usize;
    if &head[..8] != MAGIC || n > MAX_HEADER {
        return None;
    }
    let mut h = vec![0u8; n];
    f.read_exact(&mut h).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&h).ok()?;
    Some((
        v["key"].as_str()?.to_string(),
        v["parent"].as_str()?.to_string(),
        usize::try_from(v["start"].as_u64()?.checked_add(v["len"].as_u64()?)?).ok()?,
        v["axes"].as_str()?.to_string(),
    ))
}

/// The model file a model directory's blocks were made with (its id when unknown).
fn model_file(dir: &Path) -> String {
    crate::fsx::read_bounded(&dir.join("model.json"), 1 << 20, "the store's model.json")
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["file"].as_str().map(str::to_string))
        .unwrap_or_else(|| {
            dir.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        })
}

/// Removes the stored blocks (of the models whose file name or path contains `model`, when
/// given); returns (blocks, bytes) removed.
pub fn clear(root: &Path, model: Option<&str>) -> Result<(usize, u64)> {
    if !root.exists() {
        return Ok((0, 0));
    }
    check_dir(root)?;
    with_lock(root, || {
        let mut n = (0, 0);
        for dir in model_dirs(root) {
            if let Some(m) = model {
                let file = model_file(&dir);
                let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
                if !file.contains(m) && name.as_deref() != Some(m) {
                    continue;
                }
            }
            for (path, bytes, _) in blocks_in(&dir) {
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove {}", path.display()))?;
                n.0 += 1;
                n.1 += bytes;
            }
        }
        Ok(n)
    })
}

/// A sample of a model's weight bytes for its identity: its size and 16 slices of 4 KiB spread
/// over the file (every `.safetensors` file of a directory), so that two files with the same
/// layout but other weights (random-weight test models) never share blocks. Reads 64 KiB.
pub fn weights_sample(path: &Path) -> String {
    use std::io::{Seek, SeekFrom};
    let mut files = vec![path.to_path_buf()];
    if path.is_dir() {
        files = std::fs::read_dir(path)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
    }
    let mut h = Sha256::new();
    for p in files {
        let Ok(mut f) = std::fs::File::open(&p) else {
            continue;
        };
        let len = f.metadata().map_or(0, |m| m.len());
        h.update(len.to_le_bytes());
        let mut buf = vec![0u8; 4096];
        for i in 0..16u64 {
            if f.seek(SeekFrom::Start(len / 16 * i)).is_ok() {
                let n = f.read(&mut buf).unwrap_or(0);
                h.update(&buf[..n]);
            }
        }
    }
    hex(&h.finalize())[..16].to_string()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn human(n: u64) -> String {
    crate::human_bytes(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        layers: 2,
        n_kv_heads: 2,
        row_bytes: 8,
    };

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvchat-prefix-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn store(root: &Path, model: &str, budget: u64) -> PrefixStore {
        let ident = Identity {
            model: model.into(),
            file: format!("/models/{model}.gguf"),
            axes: "all, f16".into(),
        };
        PrefixStore::open(root, ident, SHAPE, budget).unwrap()
    }

    /// Rows whose every byte says which position, layer, head and part it is.
    fn rows(p: Piece) -> BlockRows {
        (0..SHAPE.layers)
            .map(|l| {
                let part = |which: u8| -> Vec<u8> {
                    let mut out = Vec::new();
                    for h in 0..SHAPE.n_kv_heads {
                        for pos in p.start..p.end() {
                            for b in 0..SHAPE.row_bytes {
                                out.push((pos * 7 + l * 13 + h * 29 + b * 3) as u8 ^ which);
                            }
                        }
                    }
                    out
                };
                (part(0), part(0xff))
            })
            .collect()
    }

    /// The rows of positions 0..n as a lookup returns them, per layer `[nkv, n, row]`.
    fn expected(n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let all = rows(Piece { start: 0, len: n });
        all.into_iter().collect()
    }

    fn write_all(s: &PrefixStore, tokens: &[u32], upto: usize, boundaries: &[usize]) -> Written {
        let pieces = s.missing(tokens, upto, boundaries, usize::MAX);
        let r = pieces.iter().map(|&p| rows(p)).collect();
        s.write(tokens, &pieces, r)
    }

    fn prompt(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| i.wrapping_mul(2654435761) ^ seed)
            .collect()
    }

    #[test]
    fn a_stored_prefix_is_found_again_with_its_rows() {
        let root = tmp("roundtrip");
        let s = store(&root, "m", 1 << 30);
        let t = prompt(200, 1);
        let w = write_all(&s, &t, 200, &[150]);
        // Blocks 0..64, 64..128 and the tail 128..150 (the block 128..192 too).
        assert_eq!((w.blocks, w.problems.len()), (4, 0));
        let f = s.lookup(&t, 199, &[150], &|_| true);
        assert_eq!(f.tokens, 192);
        let f = s.lookup(&t, 160, &[150], &|_| true);
        assert_eq!(f.tokens, 150);
        let want = expected(150);
        for (l, st) in f.layers.iter().enumerate() {
            assert_eq!((&st.k, &st.v), (&want[l].0, &want[l].1), "layer {l}");
            assert_eq!(st.residual_from, 150);
        }
        assert!(f.problems.is_empty());
    }

    #[test]
    fn a_prompt_reuses_only_the_blocks_it_shares() {
        let root = tmp("shares");
        let s = store(&root, "m", 1 << 30);
        let t = prompt(256, 1);
        write_all(&s, &t, 256, &[]);
        let mut other = t.clone();
        other[100] ^= 1; // differs in the second block
        assert_eq!(s.lookup(&other, 255, &[], &|_| true).tokens, 64);
        other[3] ^= 1; // and in the first
        assert_eq!(s.lookup(&other, 255, &[], &|_| true).tokens, 0);
    }

    #[test]
    fn the_same_tokens_under_another_model_or_cache_share_nothing() {
        let root = tmp("identity");
        let t = prompt(128, 1);
        write_all(&store(&root, "a", 1 << 30), &t, 128, &[]);
        assert_eq!(
            store(&root, "b", 1 << 30)
                .lookup(&t, 127, &[], &|_| true)
                .tokens,
            0
        );
        let mut s = store(&root, "a", 1 << 30);
        s.ident.axes = "all, bf16".into();
        assert_eq!(s.lookup(&t, 127, &[], &|_| true).tokens, 0);
    }

    /// Damages the stored block of positions 0..64 with `f`, then looks the prompt up.
    fn damaged(name: &str, f: impl FnOnce(&Path)) -> Found {
        let root = tmp(name);
        let s = store(&root, "m", 1 << 30);
        let t = prompt(128, 1);
        write_all(&s, &t, 128, &[]);
        let first = s.path_of(&s.keys(&t)[0]);
        f(&first);
        let found = s.lookup(&t, 127, &[], &|_| true);
        assert!(!first.exists(), "{name}: the damaged block is removed");
        found
    }

    #[test]
    fn a_bit_flipped_block_is_removed_reported_and_not_used() {
        let f = damaged("flip", |p| {
            let mut b = std::fs::read(p).unwrap();
            let i = b.len() / 2;
            b[i] ^= 0x10;
            std::fs::write(p, b).unwrap();
        });
        assert_eq!(f.tokens, 0);
        assert_eq!(f.problems.len(), 1);
        assert!(
            f.problems[0].text.contains("checksum mismatch"),
            "{}",
            f.problems[0]
        );
    }

    #[test]
    fn a_truncated_block_is_removed_reported_and_not_used() {
        let f = damaged("truncated", |p| {
            let b = std::fs::read(p).unwrap();
            std::fs::write(p, &b[..b.len() - 100]).unwrap();
        });
        assert_eq!((f.tokens, f.problems.len()), (0, 1));
    }

    #[test]
    fn a_zero_length_block_is_removed_reported_and_not_used() {
        let f = damaged("empty", |p| std::fs::write(p, b"").unwrap());
        assert_eq!((f.tokens, f.problems.len()), (0, 1));
        assert!(
            f.problems[0].text.contains("not a kvchat KV block"),
            "{}",
            f.problems[0]
        );
    }

    #[test]
    fn a_block_of_another_model_under_this_models_key_is_foreign() {
        let root = tmp("foreign");
        let t = prompt(128, 1);
        let other = store(&root, "other", 1 << 30);
        write_all(&other, &t, 128, &[]);
        let s = store(&root, "m", 1 << 30);
        let key = s.keys(&t)[0];
        std::fs::copy(other.path_of(&other.keys(&t)[0]), s.path_of(&key)).unwrap();
        let f = s.lookup(&t, 127, &[], &|_| true);
        assert_eq!((f.tokens, f.problems.len()), (0, 1));
        assert!(f.problems[0].text.contains("foreign"), "{}", f.problems[0]);
        assert!(!s.path_of(&key).exists());
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used_blocks_first() {
        let root = tmp("budget");
        let s0 = store(&root, "m", 1 << 30);
        let one = s0.block_bytes(BLOCK);
        // Room for 5 blocks (and a little).
        let s = store(&root, "m", 5 * one + one / 2);
        let (a, b, c) = (prompt(128, 1), prompt(128, 2), prompt(128, 3));
        write_all(&s, &a, 128, &[]);
        std::thread::sleep(Duration::from_millis(20));
        write_all(&s, &b, 128, &[]);
        std::thread::sleep(Duration::from_millis(20));
        // `a` used again: now `b` is the least recently used.
        assert_eq!(s.lookup(&a, 128, &[], &|_| true).tokens, 128);
        std::thread::sleep(Duration::from_millis(20));
        let w = write_all(&s, &c, 128, &[]);
        assert_eq!(w.evicted, 1);
        let (_, n, bytes) = stats(&root);
        assert!(bytes <= 5 * one + one / 2, "{bytes} bytes on disk");
        assert_eq!(n, 5);
        assert_eq!(s.lookup(&a, 128, &[], &|_| true).tokens, 128);
        // A chain goes from its end: b keeps its first block.
        assert_eq!(
            s.lookup(&b, 128, &[], &|_| true).tokens,
            64,
            "b's last block went"
        );
        assert_eq!(s.lookup(&c, 128, &[], &|_| true).tokens, 128);
        assert_eq!(stats(&root).0.evictions, 1);
    }

    #[test]
    fn blocks_that_cannot_fit_the_budget_are_not_written() {
        let root = tmp("tiny-budget");
        let s = store(&root, "m", 100);
        let w = write_all(&s, &prompt(128, 1), 128, &[]);
        assert_eq!(w.blocks, 0);
        assert_eq!(
            w.problems[0].fix,
            Some(crate::Fix::StoreBudget),
            "{:?}",
            w.problems
        );
        assert!(
            w.problems[0].text.contains("budget of 100 B"),
            "{:?}",
            w.problems
        );
    }

    #[test]
    fn a_store_directory_that_is_a_file_is_refused_in_one_line() {
        let root = tmp("file");
        std::fs::write(&root, b"not a directory").unwrap();
        let ident = Identity {
            model: "m".into(),
            file: "m".into(),
            axes: "a".into(),
        };
        let e = PrefixStore::open(&root, ident, SHAPE, 1 << 30).unwrap_err();
        let msg = crate::first_line(e);
        assert!(msg.contains("is a regular file, not a directory"), "{msg}");
        assert_eq!(std::fs::read(&root).unwrap(), b"not a directory");
    }

    #[test]
    fn concurrent_writers_and_readers_see_whole_blocks_or_none() {
        let root = tmp("concurrent");
        let t = prompt(64 * 6, 9);
        let want = expected(64 * 6);
        std::thread::scope(|sc| {
            for w in 0..3 {
                let (root, t) = (root.clone(), t.clone());
                sc.spawn(move || {
                    let s = store(&root, "m", 1 << 30);
                    for _ in 0..5 {
                        let pieces = s.pieces(t.len(), &[]);
                        let r = pieces.iter().map(|&p| rows(p)).collect();
                        let out = s.write(&t, &pieces, r);
                        assert!(out.problems.is_empty(), "writer {w}: {:?}", out.problems);
                    }
                });
            }
            for _ in 0..3 {
                let (root, t, want) = (root.clone(), t.clone(), want.clone());
                sc.spawn(move || {
                    let s = store(&root, "m", 1 << 30);
                    for _ in 0..20 {
                        let f = s.lookup(&t, t.len(), &[], &|_| true);
                        assert!(f.problems.is_empty(), "{:?}", f.problems);
                        for (l, st) in f.layers.iter().enumerate() {
                            let n = f.tokens;
                            // Head h's rows 0..n are the first n of its rows in `want`.
                            for h in 0..SHAPE.n_kv_heads {
                                let row = SHAPE.row_bytes;
                                let got = &st.k[h * n * row..(h + 1) * n * row];
                                let all = 64 * 6 * row;
                                assert_eq!(got, &want[l].0[h * all..h * all + n * row]);
                            }
                        }
                    }
                });
            }
        });
        let s = store(&root, "m", 1 << 30);
        assert_eq!(s.lookup(&t, t.len(), &[], &|_| true).tokens, 64 * 6);
    }

    #[test]
    fn totals_add_up_across_runs() {
        let root = tmp("totals");
        let s = store(&root, "m", 1 << 30);
        let add = Totals {
            lookups: 1,
            prompt_tokens: 100,
            reused_tokens: 90,
            ..Totals::default()
        };
        s.record(&add).unwrap();
        s.record(&add).unwrap();
        let (t, _, _) = stats(&root);
        assert_eq!((t.lookups, t.prompt_tokens, t.reused_tokens), (2, 200, 180));
        assert!((t.hit_rate() - 90.0).abs() < 1e-9);
    }

    #[test]
    fn clear_removes_only_the_named_models_blocks() {
        let root = tmp("clear");
        let t = prompt(128, 1);
        write_all(&store(&root, "alpha", 1 << 30), &t, 128, &[]);
        write_all(&store(&root, "beta", 1 << 30), &t, 128, &[]);
        let (n, _) = clear(&root, Some("alpha.gguf")).unwrap();
        assert_eq!(n, 2);
        assert_eq!(
            store(&root, "alpha", 1 << 30)
                .lookup(&t, 128, &[], &|_| true)
                .tokens,
            0
        );
        assert_eq!(
            store(&root, "beta", 1 << 30)
                .lookup(&t, 128, &[], &|_| true)
                .tokens,
            128
        );
        let listed = list(&root);
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].tokens, listed[0].model.as_str()),
            (128, "/models/beta.gguf")
        );
    }

    #[test]
    fn a_link_in_place_of_a_block_is_not_followed_and_its_target_is_untouched() {
        // The link points at the block itself, moved out of the store: valid bytes, reached the
        // wrong way. `damaged` checks that the link is removed, as a damaged block is.
        let mut target = None;
        let found = damaged("link", |p| {
            let outside = p.parent().unwrap().parent().unwrap().join("outside.kvb");
            std::fs::rename(p, &outside).unwrap();
            std::os::unix::fs::symlink(&outside, p).unwrap();
            target = Some((std::fs::read(&outside).unwrap(), outside));
        });
        assert_eq!(found.tokens, 0, "nothing is restored through a link");
        assert_eq!(found.problems.len(), 1, "{:?}", found.problems);
        let (before, outside) = target.unwrap();
        assert_eq!(
            std::fs::read(&outside).unwrap(),
            before,
            "the target is untouched"
        );
    }

    #[test]
    fn a_garbage_totals_file_reads_as_zero_totals() {
        let root = tmp("garbage-totals");
        let s = store(&root, "m", 1 << 30);
        write_all(&s, &prompt(64, 1), 64, &[]);
        std::fs::write(root.join("stats.json"), b"\x00not json{").unwrap();
        let (totals, blocks, bytes) = stats(&root);
        assert_eq!(totals, Totals::default());
        assert_eq!(blocks, 1, "what is on disk is still counted");
        assert!(bytes > 0);
    }
}
