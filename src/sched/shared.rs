//! The shared-block index: blocks of [`SHARED_BLOCK`] positions that sequences attend to
//! together, found by the tokens from position 0 to the block's end, least recently used out
//! first when the pool needs their room. It owns the blocks' bytes; the pool's bound is the
//! scheduler's.

use crate::kv::{SharedBlock, SHARED_BLOCK};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// A shared block in the index, and when it was last used (a tick: larger is later).
struct Indexed {
    block: Arc<SharedBlock>,
    bytes: u64,
    last_use: u64,
}

/// The shared blocks, by the chained hash of their tokens ([`block_keys`]).
#[derive(Default)]
pub struct SharedIndex {
    blocks: HashMap<u64, Indexed>,
    tick: u64,
}

impl SharedIndex {
    /// Bytes the indexed blocks hold.
    pub fn bytes(&self) -> u64 {
        self.blocks.values().map(|b| b.bytes).sum()
    }

    /// Blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Blocks a sequence attends to.
    pub fn in_use(&self) -> usize {
        self.blocks.values().filter(|b| b.block.in_use()).count()
    }

    /// The longest run of indexed blocks that `ids` starts with, at most `limit` blocks; marked
    /// used now.
    pub fn lookup(&mut self, ids: &[u32], limit: usize) -> Vec<Arc<SharedBlock>> {
        let mut found = Vec::new();
        let keys = block_keys(ids);
        for (i, key) in keys.iter().take(limit).enumerate() {
            let span = i * SHARED_BLOCK..(i + 1) * SHARED_BLOCK;
            match self.blocks.get(key) {
                Some(b) if b.block.tokens[span.clone()] == ids[span] => found.push(b.block.clone()),
                _ => break,
            }
        }
        // A run's first blocks are the most recently used: the least recently used one is then
        // always the end of a run, and a run is never left with a missing block inside it.
        let m = found.len() as u64;
        for (j, key) in keys.iter().take(found.len()).enumerate() {
            if let Some(b) = self.blocks.get_mut(key) {
                b.last_use = self.tick + m - j as u64;
            }
        }
        self.tick += m + 1;
        found
    }

    /// Indexes `blocks`, the blocks `from..` of `ids` (made from one sequence's rows), and marks
    /// the run they end used; returns them as the index holds them.
    pub fn insert(
        &mut self,
        ids: &[u32],
        from: usize,
        blocks: Vec<SharedBlock>,
    ) -> Vec<Arc<SharedBlock>> {
        let keys = block_keys(ids);
        let mut held = Vec::new();
        for (i, block) in (from..).zip(blocks) {
            let block = Arc::new(block);
            let bytes = block.bytes() as u64;
            self.blocks.insert(
                keys[i],
                Indexed {
                    block: block.clone(),
                    bytes,
                    last_use: 0,
                },
            );
            held.push(block);
        }
        self.lookup(ids, from + held.len());
        held
    }

    /// Bytes that dropping every block no sequence attends to would give back.
    pub fn droppable(&self) -> u64 {
        self.blocks
            .values()
            .filter(|b| Self::unused(b))
            .map(|b| b.bytes)
            .sum()
    }

    /// Drops blocks no sequence attends to, least recently used first, until `over` bytes are
    /// given back; drops nothing and says false when all of them would not be enough.
    pub fn drop_lru(&mut self, over: u64) -> bool {
        let mut free: Vec<(u64, u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| Self::unused(b))
            .map(|(k, b)| (b.last_use, *k, b.bytes))
            .collect();
        if over > free.iter().map(|f| f.2).sum::<u64>() {
            return false;
        }
        free.sort_unstable();
        let mut over = over;
        for (_, key, bytes) in free {
            if over == 0 {
                break;
            }
            self.blocks.remove(&key);
            over = over.saturating_sub(bytes);
        }
        true
    }

    /// Whether the index holds the block alone (no sequence, and no lookup's caller, holds it).
    fn unused(b: &Indexed) -> bool {
        Arc::strong_count(&b.block) == 1 && !b.block.in_use()
    }
}

/// The key of each full block of `ids`: a hash chained over every token from position 0 to the
/// block's end (a block names its whole prefix; the index checks the tokens too).
fn block_keys(ids: &[u32]) -> Vec<u64> {
    let mut key = 0u64;
    ids.chunks_exact(SHARED_BLOCK)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (key, block).hash(&mut h);
            key = h.finish();
            key
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block ending `ids`'s first `n` blocks: one layer of f32 rows, one head of 4 values
    /// (512 bytes; the index reads only its tokens, its bytes and its holders).
    fn block(ids: &[u32], n: usize) -> SharedBlock {
        let mut rows = crate::kv::rows::new_store(crate::kv::Precision::F32, 1, 4, None);
        rows.grow(SHARED_BLOCK, 0).unwrap();
        SharedBlock {
            tokens: ids[..n * SHARED_BLOCK].to_vec(),
            layers: vec![std::sync::Arc::from(rows)],
        }
    }

    fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
        (0..(blocks * SHARED_BLOCK) as u32)
            .map(|i| i * 7 + seed)
            .collect()
    }

    #[test]
    fn a_prompt_finds_the_longest_run_of_blocks_it_starts_with() {
        let mut index = SharedIndex::default();
        let a = prompt(1, 3);
        index.insert(&a, 0, (1..=3).map(|n| block(&a, n)).collect());
        let mut b = a.clone();
        b[2 * SHARED_BLOCK + 5] += 1; // parts from `a` inside the third block
        assert_eq!(index.lookup(&b, 3).len(), 2);
        assert_eq!(index.lookup(&a, 3).len(), 3);
        assert_eq!(index.lookup(&a, 1).len(), 1, "at most `limit` blocks");
        assert_eq!(index.lookup(&prompt(2, 3), 3).len(), 0);
    }

    #[test]
    fn a_block_of_the_same_tokens_after_another_prefix_is_not_found() {
        let mut index = SharedIndex::default();
        let a = prompt(1, 2);
        index.insert(&a, 0, (1..=2).map(|n| block(&a, n)).collect());
        let mut b = a.clone();
        b[0] += 1; // the second block's tokens are the same, their prefix is not
        assert!(index.lookup(&b, 2).is_empty());
    }

    #[test]
    fn the_least_recently_used_run_goes_first_and_from_its_end() {
        let mut index = SharedIndex::default();
        let (a, b) = (prompt(1, 2), prompt(2, 2));
        index.insert(&a, 0, (1..=2).map(|n| block(&a, n)).collect());
        index.insert(&b, 0, (1..=2).map(|n| block(&b, n)).collect());
        index.lookup(&a, 2); // `a` is now the most recently used
        assert_eq!(index.bytes(), 4 * 512);
        assert!(index.drop_lru(0));
        assert_eq!(index.len(), 4, "nothing is dropped when nothing is needed");
        assert!(index.drop_lru(1));
        assert_eq!(index.len(), 3, "one block gives back enough");
        assert_eq!(index.lookup(&b, 2).len(), 1, "b's last block went first");
        assert_eq!(index.lookup(&a, 2).len(), 2);
    }

    #[test]
    fn a_block_someone_holds_is_never_dropped() {
        let mut index = SharedIndex::default();
        let a = prompt(1, 1);
        let held = index.insert(&a, 0, vec![block(&a, 1)]);
        assert!(!index.drop_lru(1));
        assert_eq!((index.len(), index.in_use()), (1, 0));
        drop(held);
        assert!(index.drop_lru(1));
        assert!(index.is_empty());
    }

    #[test]
    fn nothing_is_dropped_unless_dropping_is_enough() {
        let mut index = SharedIndex::default();
        let a = prompt(1, 2);
        index.insert(&a, 0, (1..=2).map(|n| block(&a, n)).collect());
        assert_eq!(index.droppable(), 1024);
        assert!(!index.drop_lru(1025));
        assert_eq!(index.len(), 2);
    }
}
