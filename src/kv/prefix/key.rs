//! Chained block keys, and the pieces of a prompt a store may hold.

use super::*;
use sha2::{Digest, Sha256};

impl PrefixStore {
    /// The chained key of each full block of `tokens`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<[u8; 32]> {
        let mut out: Vec<[u8; 32]> = Vec::with_capacity(tokens.len() / STORE_BLOCK);
        for block in tokens.chunks_exact(STORE_BLOCK) {
            let key = self.key(out.last(), false, block);
            out.push(key);
        }
        out
    }

    /// The key of a block of `tokens` after the block keyed `parent` (None: the first).
    pub(super) fn key(&self, parent: Option<&[u8; 32]>, tail: bool, tokens: &[u32]) -> [u8; 32] {
        let mut h = Sha256::new();
        match parent {
            None => {
                for part in [FORMAT, &self.ident.model, &self.ident.axes] {
                    h.update((part.len() as u64).to_le_bytes());
                    h.update(part.as_bytes());
                }
                h.update((STORE_BLOCK as u64).to_le_bytes());
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
    pub(super) fn key_of(
        &self,
        tokens: &[u32],
        piece: Piece,
        full: &[[u8; 32]],
    ) -> ([u8; 32], Option<[u8; 32]>) {
        let i = piece.start / STORE_BLOCK;
        let parent = (i > 0).then(|| full[i - 1]);
        let key = if piece.is_tail() {
            self.key(parent.as_ref(), true, &tokens[piece.start..piece.end()])
        } else {
            full[i]
        };
        (key, parent)
    }

    pub(super) fn path_of(&self, key: &[u8; 32]) -> PathBuf {
        self.dir.join(format!("{}.kvb", hex(key)))
    }

    /// The pieces of `tokens[..upto]` a store may hold: its full blocks, and for each of
    /// `boundaries` that is not a block's end, the tail from the block it falls in to it.
    pub fn pieces(&self, upto: usize, boundaries: &[usize]) -> Vec<Piece> {
        let mut out: Vec<Piece> = (0..upto / STORE_BLOCK)
            .map(|i| Piece {
                start: i * STORE_BLOCK,
                len: STORE_BLOCK,
            })
            .collect();
        for &b in boundaries {
            let tail = Piece {
                start: b / STORE_BLOCK * STORE_BLOCK,
                len: b % STORE_BLOCK,
            };
            if b <= upto && tail.len > 0 && !out.contains(&tail) {
                out.push(tail);
            }
        }
        out
    }
}
