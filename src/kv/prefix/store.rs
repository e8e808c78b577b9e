//! The store of one model and cache: open it, look a prompt up, write its missing pieces.

use super::*;
use anyhow::Result;
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Instant;

use super::block::{BlockError, BlockFile};
use super::evict::{add_totals, check_dir, evict, last_use, with_lock, write_atomically};

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
        let mut read: Vec<(Piece, PathBuf, BlockFile)> = Vec::new();
        let now = SystemTime::now();
        let try_piece =
            |piece: Piece, read: &mut Vec<(Piece, PathBuf, BlockFile)>, found: &mut Found| {
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
                start: i * STORE_BLOCK,
                len: STORE_BLOCK,
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
                .filter(|&b| b > at && b < at + STORE_BLOCK && b <= limit && ok(b))
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
        // Back to the last end a resume may start from: one a quantized cache may resume at,
        // and, for a model with recurrent states, one that keeps them.
        let states = self.shape.state_bytes > 0;
        while read
            .last()
            .is_some_and(|(p, _, r)| !ok(p.end()) || (states && r.states_at.is_none()))
        {
            read.pop();
        }
        found.tokens = read.last().map_or(0, |(p, _, _)| p.end());
        found.states = read.last().and_then(|(_, _, r)| {
            let at = r.states_at?;
            Some(r.bytes[at..at + self.shape.state_bytes].to_vec())
        });
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
    /// The pieces of `tokens[..upto]` (see [`PrefixStore::pieces`]) to write: those not stored
    /// yet or not of their exact size (truncated), those stored without the recurrent states at
    /// their end when their end is one of `states_at` (where the writer has them), and every one
    /// from `rewrite_from` on (after a damaged block was found there).
    pub fn missing(
        &self,
        tokens: &[u32],
        upto: usize,
        boundaries: &[usize],
        rewrite_from: usize,
        states_at: &[usize],
    ) -> Vec<Piece> {
        let upto = upto.min(tokens.len());
        let full = self.keys(&tokens[..upto]);
        self.pieces(upto, boundaries)
            .into_iter()
            .filter(|&p| {
                let (key, parent) = self.key_of(tokens, p, &full);
                let size = std::fs::symlink_metadata(self.path_of(&key)).map(|m| m.len());
                let is =
                    |states| size.as_ref().ok() == Some(&self.file_size(&key, parent, p, states));
                // Kept states are never written over by a block without them.
                let with = self.shape.state_bytes > 0 && is(true);
                let stored = with || (is(false) && !states_at.contains(&p.end()));
                p.start >= rewrite_from || !stored
            })
            .collect()
    }
    /// Writes `pieces` of `tokens` (`rows[j]` holding `pieces[j]`), after making room for them
    /// within the budget (least recently used blocks first, of any model).
    pub fn write(&self, tokens: &[u32], pieces: &[Piece], rows: Vec<PieceRows>) -> Written {
        let t0 = Instant::now();
        let mut out = self.write_timed(tokens, pieces, rows);
        out.elapsed = t0.elapsed();
        out
    }

    fn write_timed(&self, tokens: &[u32], pieces: &[Piece], rows: Vec<PieceRows>) -> Written {
        let mut out = Written::default();
        if pieces.is_empty() {
            return out;
        }
        let need: u64 = pieces
            .iter()
            .zip(&rows)
            .map(|(p, r)| self.block_bytes(p.len, r.states.is_some()))
            .sum();
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
        let fits = |p: &Piece, b: &PieceRows| {
            b.rows.len() == self.shape.layers
                && b.rows
                    .iter()
                    .all(|(k, v)| k.len() == self.shape.part(p.len) && v.len() == k.len())
                && b.states
                    .as_ref()
                    .is_none_or(|s| self.shape.state_bytes > 0 && s.len() == self.shape.state_bytes)
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
            let states = block.states.is_some();
            let header = serde_json::to_vec(&self.header(&key, parent.as_ref(), piece, states))
                .expect("a JSON value serializes");
            let size = self.shape.file_bytes(header.len(), piece.len, states);
            let mut body = Vec::with_capacity(size);
            body.extend_from_slice(MAGIC);
            body.extend_from_slice(&(header.len() as u32).to_le_bytes());
            body.extend_from_slice(&header);
            for t in &tokens[piece.start..piece.end()] {
                body.extend_from_slice(&t.to_le_bytes());
            }
            for (k, v) in &block.rows {
                body.extend_from_slice(k);
                body.extend_from_slice(v);
            }
            if let Some(s) = &block.states {
                body.extend_from_slice(s);
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
