//! A block file: its header, its exact size, and reading one back with every check.

use super::*;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// A block file read and checked: its bytes, where its rows start (each layer's keys then
/// values, `[n_kv_heads, len, row]` each), and where the recurrent states at its end start when
/// it keeps them.
pub(super) struct BlockFile {
    pub(super) bytes: Vec<u8>,
    pub(super) at: usize,
    pub(super) states_at: Option<usize>,
}

/// Why a block could not be used.
pub(super) enum BlockError {
    /// It cannot be read (permissions, I/O): reported, left alone.
    Unreadable(String),
    /// It is not what its name says (damaged, truncated, foreign): reported and removed.
    Damaged(String),
}

impl PrefixStore {
    /// Reads and checks one block: `Ok(None)` when there is none; with it the open file.
    pub(super) fn read_block(
        &self,
        path: &Path,
        key: &[u8; 32],
        parent: Option<&[u8; 32]>,
        piece: Piece,
        tokens: &[u32],
    ) -> std::result::Result<Option<(BlockFile, std::fs::File)>, BlockError> {
        use BlockError::{Damaged, Unreadable};
        let f = match crate::fsx::open_regular_nofollow(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            // A link, pipe or directory where a block belongs was not written by kvchat.
            Err(e) if e.kind() == std::io::ErrorKind::Other => return Err(Damaged(e.to_string())),
            Err(e) => return Err(Unreadable(e.to_string())),
        };
        let size = f.metadata().map_err(|e| Unreadable(e.to_string()))?.len() as usize;
        let most = self.shape.file_bytes(MAX_HEADER, piece.len, true);
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
        let sized = |states| self.shape.file_bytes(hlen, piece.len, states) == bytes.len();
        let states = if hlen > MAX_HEADER {
            None
        } else if sized(false) {
            Some(false)
        } else if self.shape.state_bytes > 0 && sized(true) {
            Some(true)
        } else {
            None
        };
        let Some(states) = states else {
            return bad(format!(
                "{} bytes, not a block of this cache's shape",
                bytes.len()
            ));
        };
        let header: serde_json::Value = match serde_json::from_slice(&body[12..12 + hlen]) {
            Ok(h) => h,
            Err(_) => return bad("unreadable header".into()),
        };
        if header != self.header(key, parent, piece, states) {
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
        let states_at = states.then(|| at + 2 * self.shape.layers * self.shape.part(piece.len));
        Ok(Some((
            BlockFile {
                bytes,
                at,
                states_at,
            },
            f,
        )))
    }

    /// The header of `piece`'s file, which keeps the recurrent states at its end when `states`.
    pub(super) fn header(
        &self,
        key: &[u8; 32],
        parent: Option<&[u8; 32]>,
        piece: Piece,
        states: bool,
    ) -> serde_json::Value {
        let mut h = serde_json::json!({
            "format": FORMAT,
            "key": hex(key),
            "parent": parent.map(|p| hex(p)).unwrap_or_default(),
            "start": piece.start,
            "len": piece.len,
            "block": STORE_BLOCK,
            "model": self.ident.model,
            "axes": self.ident.axes,
            "layers": self.shape.layers,
            "n_kv_heads": self.shape.n_kv_heads,
            "row_bytes": self.shape.row_bytes,
        });
        // (A model without states writes the header it always wrote.)
        if self.shape.state_bytes > 0 {
            h["state_bytes"] = self.shape.state_bytes.into();
            h["states"] = states.into();
        }
        h
    }
    /// The exact size of the file of `piece`, with the states at its end or without.
    pub(super) fn file_size(
        &self,
        key: &[u8; 32],
        parent: Option<[u8; 32]>,
        piece: Piece,
        states: bool,
    ) -> u64 {
        let h = serde_json::to_vec(&self.header(key, parent.as_ref(), piece, states))
            .map_or(0, |h| h.len());
        self.shape.file_bytes(h, piece.len, states) as u64
    }

    /// Bytes the file of a block of `len` positions takes (at most: the header's numbers may be
    /// a few digits longer than these).
    pub(super) fn block_bytes(&self, len: usize, states: bool) -> u64 {
        self.file_size(&[0; 32], Some([0; 32]), Piece { start: 0, len }, states) + 16
    }
}
