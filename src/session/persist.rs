//! Saving and restoring a session's state (the prompt cache, chat's /save and /load). The file
//! format and its checks are `kv::persist`; this adds what only a session knows: its tokens, the
//! shapes its model's cache holds, and the context it may reach.

use super::Session;
use crate::kv::persist;
use anyhow::Result;
use std::path::Path;

impl Session<'_> {
    /// Replaces what the session holds by a saved state (tokens and every layer's keys and values).
    pub fn restore(&mut self, snap: &persist::Snapshot) -> Result<()> {
        self.cache.reset()?;
        self.tokens.clear();
        let n = snap.tokens.len();
        if snap.layers.len() != self.cache.layers().len() {
            anyhow::bail!(
                "the saved state has {} layers, this model {}",
                snap.layers.len(),
                self.cache.layers().len()
            );
        }
        for (i, st) in snap.layers.iter().enumerate() {
            if let Err(e) = self.cache.layers_mut()[i].restore_raw(n, st) {
                // Never leave a half-restored cache behind.
                self.cache.reset()?;
                return Err(anyhow::anyhow!("layer {i}: {e}"));
            }
        }
        if let Err(e) = self
            .cache
            .restore_states(snap.states.clone(), n, snap.snapshots.clone())
        {
            self.cache.reset()?;
            return Err(e);
        }
        self.tokens = snap.tokens.clone();
        Ok(())
    }

    /// What a saved state must match to be restored into this session.
    pub fn persist_expect<'a>(
        &self,
        model_digest: &'a str,
        cache_key: &'a str,
    ) -> persist::Expect<'a> {
        let cfg = &self.model.cfg;
        persist::Expect {
            model_digest,
            cache_key,
            shapes: (0..self.cache.layers().len())
                .map(|c| cfg.kv_shape(c))
                .collect(),
            max_positions: self.max_positions,
            states: self
                .cache
                .states()
                .now()
                .iter()
                .map(|s| (s.conv.len(), s.matrix.len()))
                .collect(),
        }
    }

    /// Writes the tokens and every layer's keys and values to `path` (see `kv::persist::save`).
    pub fn save_state(
        &self,
        path: &Path,
        model_digest: &str,
        extra: serde_json::Value,
    ) -> Result<()> {
        let key = self.cache.persist_key()?;
        persist::save(path, &self.tokens, &self.cache, model_digest, &key, extra)
    }

    /// Reads a saved state for this model and cache configuration, and puts it in the session.
    /// Returns what the writer added (the chat's messages).
    pub fn load_state(&mut self, path: &Path, model_digest: &str) -> Result<serde_json::Value> {
        let key = self.cache.persist_key()?;
        let snap = persist::load(path, &self.persist_expect(model_digest, &key))?;
        self.restore(&snap)?;
        Ok(snap.extra)
    }

    /// The prompt cache: restores the state saved at `path`, then keeps the part of it that `ids`
    /// starts with; returns the positions reused. An error means the file could not be used (the
    /// session is then empty).
    pub fn reuse_saved_prefix(
        &mut self,
        path: &Path,
        model_digest: &str,
        ids: &[u32],
    ) -> Result<usize> {
        if let Err(e) = self.load_state(path, model_digest) {
            self.reset()?;
            return Err(e);
        }
        if self.resume_margin() > 1 {
            // A budget scores by the prompt's last queries: they are prefilled again.
            let keep = self
                .keep_prefix_of(ids)?
                .min(ids.len().saturating_sub(self.resume_margin()));
            self.truncate(keep)?;
            return Ok(self.tokens.len());
        }
        self.keep_prefix_of(ids)
    }
}
