//! The one map of a model's layers, built with its [`Config`] (llama.cpp's `map_layer_ids`):
//! which memory each decoder block's mixer reads, and back from each KV-cache layer and each
//! recurrent state to its block. Three index spaces, named once:
//! - block `i`: `0..n_layer`, the decoder's blocks;
//! - KV layer `c`: `0..kv_layers()`, the cache's layers (`DecoderCache::layer`,
//!   `CacheSpec::layer_spec`): one per block that keeps keys and values of its own;
//! - state `r`: `0..states()`, the recurrent states (`DecoderCache::state`: Qwen3.5's DeltaNet).

use super::config::Config;

/// What block `i`'s mixer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMemory {
    /// Attention over KV layer `kv`: the block's own (`own`), or the one it shares (Gemma 4's
    /// last `shared_kv` blocks; `kv` is then the source, held by block `kv_block(kv)`).
    Kv { kv: usize, own: bool },
    /// A Gated DeltaNet over recurrent state `state` (Qwen3.5).
    State { state: usize },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerMap {
    blocks: Vec<BlockMemory>,
    /// KV layer c → the block whose keys and values it holds.
    kv_blocks: Vec<usize>,
    /// State r → its block.
    state_blocks: Vec<usize>,
}

impl LayerMap {
    /// The map of `n_layer` blocks, the last `shared` of which read an earlier block's keys and
    /// values; `recurrent(i)`: block i is a DeltaNet; `window(i)`: it attends within a sliding
    /// window. Never panics: a file's numbers are checked by `Config::validate` after.
    pub fn new(
        n_layer: usize,
        shared: usize,
        recurrent: impl Fn(usize) -> bool,
        window: impl Fn(usize) -> bool,
    ) -> Self {
        let first_shared = n_layer.saturating_sub(shared);
        let mut m = Self::default();
        for i in 0..n_layer {
            let b = if recurrent(i) {
                m.state_blocks.push(i);
                BlockMemory::State {
                    state: m.state_blocks.len() - 1,
                }
            } else if i < first_shared {
                m.kv_blocks.push(i);
                BlockMemory::Kv {
                    kv: m.kv_blocks.len() - 1,
                    own: true,
                }
            } else {
                // llama.cpp's choice for Gemma 4: the last own layer of the block's kind, the
                // own layers ending with a window layer and a global one (`validate` checks it).
                let own = m.kv_blocks.len();
                let back = if window(i) { 2 } else { 1 };
                BlockMemory::Kv {
                    kv: own.saturating_sub(back),
                    own: false,
                }
            };
            m.blocks.push(b);
        }
        m
    }

    /// The map of `cfg`, from its fields (never from the map-backed `Config` methods).
    pub fn of(cfg: &Config) -> Self {
        let shared = cfg.layers.as_ref().map_or(0, |l| l.shared_kv);
        let recurrent = |i: usize| {
            cfg.recurrent
                .as_ref()
                .is_some_and(|r| r.layers.get(i).copied().unwrap_or(false))
        };
        Self::new(cfg.n_layer, shared, recurrent, |i| {
            cfg.layer_window(i).is_some()
        })
    }

    /// Blocks mapped.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// What block `i` reads.
    pub fn block(&self, i: usize) -> BlockMemory {
        self.blocks[i]
    }

    pub fn get(&self, i: usize) -> Option<BlockMemory> {
        self.blocks.get(i).copied()
    }

    /// KV layers: blocks that keep keys and values of their own.
    pub fn kv_layers(&self) -> usize {
        self.kv_blocks.len()
    }

    /// The block whose keys and values KV layer `c` holds.
    pub fn kv_block(&self, c: usize) -> usize {
        self.kv_blocks[c]
    }

    pub fn kv_blocks(&self) -> &[usize] {
        &self.kv_blocks
    }

    /// Recurrent states: blocks that keep one.
    pub fn states(&self) -> usize {
        self.state_blocks.len()
    }

    /// The KV layer block `i` attends over, if it attends.
    pub fn kv_source(&self, i: usize) -> Option<usize> {
        match self.get(i)? {
            BlockMemory::Kv { kv, .. } => Some(kv),
            BlockMemory::State { .. } => None,
        }
    }

    /// The recurrent state of block `i`, if it keeps one.
    pub fn state_index(&self, i: usize) -> Option<usize> {
        match self.get(i)? {
            BlockMemory::State { state } => Some(state),
            BlockMemory::Kv { .. } => None,
        }
    }

    /// Whether block `i` keeps keys and values of its own.
    pub fn own_kv(&self, i: usize) -> bool {
        matches!(self.get(i), Some(BlockMemory::Kv { own: true, .. }))
    }

    /// Whether block `i` keeps a recurrent state instead of attending.
    pub fn is_recurrent(&self, i: usize) -> bool {
        matches!(self.get(i), Some(BlockMemory::State { .. }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hybrid_model_numbers_its_kv_layers_and_states_apart() {
        // Qwen3.5's shape: every 4th block attends.
        let m = LayerMap::new(8, 0, |i| (i + 1) % 4 != 0, |_| false);
        assert_eq!(m.kv_blocks(), [3, 7]);
        assert_eq!(m.block(3), BlockMemory::Kv { kv: 0, own: true });
        assert_eq!(m.block(7), BlockMemory::Kv { kv: 1, own: true });
        assert_eq!(m.block(6), BlockMemory::State { state: 5 });
        assert_eq!((m.kv_layers(), m.states()), (2, 6));
    }

    #[test]
    fn shared_blocks_read_the_last_own_layer_of_their_kind() {
        // Gemma 4's shape: window, window, global, window, global; the last two shared.
        let window = |i: usize| [true, true, false, true, false][i];
        let m = LayerMap::new(5, 2, |_| false, window);
        assert_eq!(m.kv_blocks(), [0, 1, 2]);
        assert_eq!(m.block(3), BlockMemory::Kv { kv: 1, own: false });
        assert_eq!(m.block(4), BlockMemory::Kv { kv: 2, own: false });
        assert!(!m.own_kv(3) && m.own_kv(2));
    }
}
