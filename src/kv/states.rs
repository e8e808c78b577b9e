//! The recurrent states of a model's DeltaNet layers (Qwen3.5) and their snapshots: the memory
//! kind beside the KV layers (llama.cpp's `llama-memory-recurrent`).

use super::*;

/// The recurrent states of a model's DeltaNet layers (Qwen3.5), and snapshots of them taken where
/// a forward of several positions begins (a prompt, a chat turn, a verified draft): a state
/// cannot drop its last positions as keys and values can, so going back restores the newest
/// snapshot at or before the target and the session computes the rest again (llama.cpp's
/// context checkpoints).
#[derive(Default)]
pub struct States {
    pub(super) now: Vec<RecurrentState>,
    /// The position the states stand at (all positions before it taken in).
    pub(super) at: usize,
    /// A forward changed the states and has not finished its step: `at` no longer says where
    /// they stand.
    pub(super) changed: bool,
    /// Oldest first, each at a different position; at most [`MAX_SNAPSHOTS`].
    pub(super) snapshots: Vec<(usize, Vec<RecurrentState>)>,
}

/// Snapshots of the recurrent states a cache keeps (llama.cpp's `--ctx-checkpoints` default).
pub const MAX_SNAPSHOTS: usize = 8;

impl States {
    pub(super) fn new(r: &crate::model::config::Recurrent) -> Self {
        Self {
            now: vec![RecurrentState::new(r); r.count()],
            ..Self::default()
        }
    }

    /// Clears the states back to before any token, with their snapshots.
    pub(super) fn clear(&mut self) {
        self.now.iter_mut().for_each(RecurrentState::clear);
        self.at = 0;
        self.changed = false;
        self.snapshots.clear();
    }

    /// Keeps a snapshot of the states as they stand at `pos` (when they do stand there).
    pub(super) fn snapshot(&mut self, pos: usize) {
        if self.now.is_empty() || self.changed || self.at != pos || pos == 0 {
            return;
        }
        if self.snapshots.last().is_some_and(|(p, _)| *p == pos) {
            return;
        }
        if self.snapshots.len() == MAX_SNAPSHOTS {
            self.snapshots.remove(0);
        }
        self.snapshots.push((pos, self.now.clone()));
    }

    /// The position the states go back to for a sequence cut to `len`: where they stand when
    /// that is not past `len`, else the newest snapshot at or before it (0: the start).
    pub(super) fn back_to(&self, len: usize) -> usize {
        if !self.changed && self.at <= len {
            return self.at;
        }
        self.snapshots
            .iter()
            .rev()
            .map(|(p, _)| *p)
            .find(|&p| p <= len)
            .unwrap_or(0)
    }

    /// Puts the states back to `pos` (a value [`States::back_to`] gave), dropping later snapshots.
    pub(super) fn restore(&mut self, pos: usize) {
        if !self.changed && self.at == pos {
            return;
        }
        self.snapshots.retain(|(p, _)| *p <= pos);
        match self.snapshots.last() {
            Some((p, states)) if *p == pos => self.now.clone_from(states),
            _ => {
                debug_assert_eq!(pos, 0, "a restore to a position without a snapshot");
                self.now.iter_mut().for_each(RecurrentState::clear);
            }
        }
        self.at = pos;
        self.changed = false;
    }

    /// The states as they stand.
    pub fn now(&self) -> &[RecurrentState] {
        &self.now
    }

    /// Bytes of the states now (fixed, whatever the sequence's length).
    pub fn bytes(&self) -> usize {
        self.now.iter().map(RecurrentState::bytes).sum()
    }

    /// Bytes of the snapshots kept.
    pub fn snapshot_bytes(&self) -> usize {
        self.snapshots
            .iter()
            .flat_map(|(_, s)| s)
            .map(RecurrentState::bytes)
            .sum()
    }

    /// The snapshots kept, oldest first: (position, each layer's state there).
    pub fn snapshots(&self) -> &[(usize, Vec<RecurrentState>)] {
        &self.snapshots
    }

    /// The snapshot at `pos`, if one is kept there.
    pub fn snapshot_at(&self, pos: usize) -> Option<&[RecurrentState]> {
        let found = self.snapshots.iter().find(|(p, _)| *p == pos);
        found.map(|(_, s)| s.as_slice())
    }

    /// How many recurrent layers, and how many snapshots are kept.
    pub fn counts(&self) -> (usize, usize) {
        (self.now.len(), self.snapshots.len())
    }

    /// `states` as bytes, for the prefix store: each layer's convolution window then its matrix,
    /// f32 little-endian ([`States::bytes`] of them).
    pub fn encode(states: &[RecurrentState]) -> Vec<u8> {
        let floats = states.iter().flat_map(|s| s.conv.iter().chain(&s.matrix));
        floats.flat_map(|x| x.to_le_bytes()).collect()
    }

    /// States of this model's shapes from [`States::encode`]'s bytes; refused when the length is
    /// not theirs or a value is not a finite number (a hostile file's checksum can be right).
    pub fn decode(&self, bytes: &[u8]) -> Result<Vec<RecurrentState>> {
        if bytes.len() != self.bytes() {
            anyhow::bail!(
                "{} bytes of recurrent states, where this model keeps {}",
                bytes.len(),
                self.bytes()
            );
        }
        let mut floats = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")));
        let mut take = |n: usize| -> Result<Vec<f32>> {
            let v: Vec<f32> = floats.by_ref().take(n).collect();
            if v.iter().any(|x| !x.is_finite()) {
                anyhow::bail!("a recurrent state holds a value that is not a finite number");
            }
            Ok(v)
        };
        self.now
            .iter()
            .map(|s| {
                Ok(RecurrentState {
                    conv: take(s.conv.len())?,
                    matrix: take(s.matrix.len())?,
                })
            })
            .collect()
    }
}
