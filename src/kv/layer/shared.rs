//! Rows shared between sequences: a server's prompts that start with the same tokens attend to
//! one copy of those positions' keys and values (PagedAttention's shared prefix blocks).
//!
//! A shared block holds [`SHARED_BLOCK`] positions of one layer in the layer's precision and is
//! never written once made. A layer attending to shared blocks holds them by counted reference
//! (`Arc`) for its first positions; its main store holds the positions after them, from slot 0
//! (`Layer::slot`). Going back before their end keeps the blocks wholly before the new length
//! and copies the rest of the next one into the layer's own store (copy on write). Only a float
//! cache that keeps every position shares: the same rows give the same bits whatever steps made
//! them, and the attention kernel's sums do not depend on how a view's positions are split into
//! parts (`kernels::attention`), so a sequence attending to shared blocks computes what it would
//! holding its own copy, bit for bit.

use super::*;
use std::sync::Arc;

/// Positions in a shared block: vLLM's block size. Prompts share whole blocks, so a smaller block
/// shares more of a short common start (a chat template's system prompt and a request's first
/// words); a 1,500-token prefix is then ~94 parts of the attention's view, which the kernel reads
/// as it reads one.
pub const SHARED_BLOCK: usize = 16;

/// One block of positions shared by sequences, every layer's rows of it: made once from one
/// sequence's rows, then attended to by any sequence whose tokens start with the same ones.
pub struct SharedBlock {
    /// The tokens of every position from 0 to this block's end (a block names its prefix).
    pub tokens: Vec<u32>,
    /// Each layer's rows of the block's positions.
    pub layers: Vec<Arc<dyn RowStore>>,
}

impl SharedBlock {
    /// Bytes its rows take, in all layers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }

    /// Whether a sequence attends to it (someone but its maker's index holds its rows).
    pub fn in_use(&self) -> bool {
        self.layers
            .first()
            .is_some_and(|l| Arc::strong_count(l) > 1)
    }
}

impl Layer {
    /// Positions held in shared blocks (from position 0).
    pub(super) fn shared_len(&self) -> usize {
        self.shared.len() * SHARED_BLOCK
    }

    /// Why this layer cannot attend to shared blocks, if it cannot.
    pub fn share_refusal(&self) -> Option<&'static str> {
        if self.retention != Retention::All || self.precision.quantized() {
            Some("only a float cache that keeps every position shares rows between sequences")
        } else if self.offload_to.is_some() || self.pending.is_some() {
            Some("an offloaded cache does not share rows between sequences")
        } else {
            None
        }
    }

    /// Blocks `from..to` of this layer's positions as shared blocks: those it already attends
    /// to, and new ones holding a copy of its own rows.
    pub fn share(&self, from: usize, to: usize) -> Result<Vec<Arc<dyn RowStore>>> {
        if let Some(why) = self.share_refusal() {
            bail!(why);
        }
        if to * SHARED_BLOCK > self.seen {
            bail!(
                "blocks up to position {} are not held (the layer has seen {})",
                to * SHARED_BLOCK,
                self.seen
            );
        }
        (from..to)
            .map(|i| {
                if let Some(b) = self.shared.get(i) {
                    return Ok(b.clone());
                }
                let (k, v) = self.raw_range(i * SHARED_BLOCK, (i + 1) * SHARED_BLOCK)?;
                let mut store =
                    new_store(self.precision, self.nkv, self.hd, self.store_on.as_ref());
                store.grow(SHARED_BLOCK, 0)?;
                store.write_raw(0, SHARED_BLOCK, &k, &v)?;
                Ok(Arc::from(store))
            })
            .collect()
    }

    /// Attends from now on to `blocks` for its first positions. An empty layer takes them as
    /// all it has seen; a layer that holds those positions already (the same rows: [`Layer::share`]
    /// copied them from it or from a sequence with the same tokens) gives up its own copy and
    /// keeps the positions after them in a store sized for what is left of its context.
    pub fn adopt_shared(&mut self, blocks: Vec<Arc<dyn RowStore>>) -> Result<()> {
        if let Some(why) = self.share_refusal() {
            bail!(why);
        }
        let n = blocks.len() * SHARED_BLOCK;
        if let Some(b) = blocks
            .iter()
            .find(|b| b.precision() != self.precision || b.capacity() < SHARED_BLOCK)
        {
            bail!(
                "a shared block of {} {} rows does not fit a {} cache",
                b.capacity(),
                b.precision().name(),
                self.precision.name()
            );
        }
        if n > self.max_positions {
            bail!(
                "{n} shared positions do not fit a context of {}",
                self.max_positions
            );
        }
        if n < self.shared_len() || (self.seen > 0 && n > self.seen) {
            bail!(
                "{n} shared positions cannot replace a layer's {} (it has seen {})",
                self.shared_len(),
                self.seen
            );
        }
        let own = |layer: &Self, len: usize| -> Result<Box<dyn RowStore>> {
            let mut store = layer.new_main_store();
            if len > 0 {
                let room = layer.max_positions - n;
                store.grow(grown_capacity(len, room, layer.grow_by), 0)?;
            }
            Ok(store)
        };
        if self.seen == 0 {
            self.store = own(self, 0)?;
            self.shared = blocks;
            self.seen = n;
            return Ok(());
        }
        // The positions after the blocks move to slots from 0 of a store of their own.
        let tail = self.seen - n;
        let (k, v) = self.raw_range(n, self.seen)?;
        let mut store = own(self, tail)?;
        if tail > 0 {
            store.write_raw(0, tail, &k, &v)?;
        }
        self.store = store;
        self.shared = blocks;
        Ok(())
    }

    /// Goes back to `len` positions, fewer than the shared blocks hold: the blocks wholly before
    /// `len` stay shared, and the positions of the next one before `len` are copied into a store
    /// of this layer's own (copy on write: a shared block is never written).
    pub(super) fn unshare_to(&mut self, len: usize) -> Result<()> {
        let keep = len / SHARED_BLOCK;
        let rest = len - keep * SHARED_BLOCK;
        let mut store = self.new_main_store();
        if rest > 0 {
            let (k, v) = self.shared[keep].raw(0, rest)?;
            let room = self.max_positions - keep * SHARED_BLOCK;
            store.grow(grown_capacity(rest, room, self.grow_by), 0)?;
            store.write_raw(0, rest, &k, &v)?;
        }
        self.store = store;
        self.shared.truncate(keep);
        Ok(())
    }

    /// Bytes of the shared blocks this layer attends to (not its own: every sequence attending
    /// to them holds them).
    pub fn shared_bytes(&self) -> usize {
        self.shared.iter().map(|b| b.bytes()).sum()
    }
}
