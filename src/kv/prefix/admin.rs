//! `kvchat cache`: the stored prefixes listed, counted, cleared.

use super::*;
use anyhow::{Context, Result};
use std::io::Read;
use std::path::Path;

use super::evict::{blocks, blocks_in, check_dir, model_dirs, read_totals, with_lock};

/// The store's cumulative figures and what it holds now: (totals, blocks, bytes).
pub fn stats(root: &Path) -> (Totals, usize, u64) {
    let b = blocks(root);
    (read_totals(root), b.len(), b.iter().map(|x| x.1).sum())
}

/// A stored prefix: a chain of blocks that no other stored block extends.
#[derive(Debug, Clone)]
pub struct StoredPrefix {
    pub model: String,
    /// The cache's axes ("all, f16").
    pub axes: String,
    pub tokens: usize,
    /// Bytes of its blocks (blocks shared with other entries are counted in each).
    pub bytes: u64,
    pub last_use: SystemTime,
}

/// The stored prefixes, most recently used first.
pub fn list(root: &Path) -> Vec<StoredPrefix> {
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
            out.push(StoredPrefix {
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
pub(super) fn block_links(path: &Path) -> Option<(String, String, usize, String)> {
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
pub(super) fn model_file(dir: &Path) -> String {
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
