//! Saving and restoring a sequence's KV state — the prompt cache (`--prompt-cache`) and chat's
//! `/save`/`/load`. The container is safetensors: each layer's keys and values (`k.{i}`, `v.{i}`,
//! `[1, n_kv_heads, positions, head_dim]`) and the token ids (`tokens`), with a JSON header naming the
//! format, the model (a digest of its GGUF metadata and tensor layout) and the cache configuration.
//! A file from another model or configuration, or a corrupt or truncated one, is refused with a reason.
//! Writes are atomic: a temporary file in the same directory, then a rename.

use crate::generate::Session;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

pub const FORMAT: &str = "kvchat-kv/1";

/// What a file holds, once checked.
pub struct Snapshot {
    pub tokens: Vec<u32>,
    /// Per layer: keys and values.
    pub kv: Vec<(Tensor, Tensor)>,
    /// Whatever the writer added (the chat's messages).
    pub extra: serde_json::Value,
}

/// Writes the session's state (its tokens and every layer's cache) to `path`, atomically.
pub fn save(
    path: &Path,
    session: &Session<'_>,
    model_digest: &str,
    cache_key: &str,
    extra: serde_json::Value,
) -> Result<()> {
    let n = session.tokens.len();
    if session.cache.seen() != n || session.cache.len() != n {
        bail!("the cache holds {} of {} positions: only a full cache of the whole sequence can be saved", session.cache.len(), n);
    }
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    tensors.push((
        "tokens".into(),
        Tensor::new(session.tokens.as_slice(), &Device::Cpu)?,
    ));
    let mut cache = session.cache.layers_state()?;
    for (i, kv) in cache.drain(..).enumerate() {
        let (k, v) = kv.ok_or_else(|| anyhow!("layer {i} holds nothing to save"))?;
        tensors.push((format!("k.{i}"), k.to_device(&Device::Cpu)?.contiguous()?));
        tensors.push((format!("v.{i}"), v.to_device(&Device::Cpu)?.contiguous()?));
    }
    let meta: HashMap<String, String> = [
        ("format".to_string(), FORMAT.to_string()),
        ("model".to_string(), model_digest.to_string()),
        ("cache".to_string(), cache_key.to_string()),
        ("extra".to_string(), extra.to_string()),
    ]
    .into_iter()
    .collect();
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|f| f.to_str()).unwrap_or("kv"),
        std::process::id()
    ));
    safetensors::serialize_to_file(
        tensors.iter().map(|(k, t)| (k.as_str(), t)),
        Some(meta),
        &tmp,
    )
    .map_err(|e| anyhow!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// Reads and checks a file written by [`save`] for this model and cache configuration.
pub fn load(path: &Path, model_digest: &str, cache_key: &str, n_layers: usize) -> Result<Snapshot> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
        anyhow!(
            "{} is not a kvchat KV file (or is truncated): {e}",
            path.display()
        )
    })?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| meta.get(k).map(String::as_str).unwrap_or("");
    if get("format") != FORMAT {
        bail!(
            "{} is not a kvchat KV file (format '{}')",
            path.display(),
            get("format")
        );
    }
    if get("model") != model_digest {
        bail!("{} was made with another model", path.display());
    }
    if get("cache") != cache_key {
        bail!(
            "{} was made with another cache configuration ({}, this run uses {cache_key})",
            path.display(),
            get("cache")
        );
    }
    let mut tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| {
        anyhow!(
            "{} is corrupt or truncated: {}",
            path.display(),
            crate::first_line(e)
        )
    })?;
    let tokens = tensors
        .remove("tokens")
        .ok_or_else(|| anyhow!("{} has no tokens", path.display()))?;
    if tokens.dtype() != DType::U32 || tokens.rank() != 1 {
        bail!("{} has malformed tokens", path.display());
    }
    let tokens: Vec<u32> = tokens.to_vec1()?;
    let mut kv = Vec::with_capacity(n_layers);
    for i in 0..n_layers {
        let (k, v) = match (
            tensors.remove(&format!("k.{i}")),
            tensors.remove(&format!("v.{i}")),
        ) {
            (Some(k), Some(v)) => (k, v),
            _ => bail!("{} lacks layer {i}'s keys or values", path.display()),
        };
        if k.rank() != 4 || k.dims() != v.dims() || k.dim(2)? != tokens.len() {
            bail!(
                "{}: layer {i}'s tensors do not match its {} tokens",
                path.display(),
                tokens.len()
            );
        }
        kv.push((k, v));
    }
    if !tensors.is_empty() {
        bail!("{} holds more layers than this model has", path.display());
    }
    let extra = serde_json::from_str(get("extra")).unwrap_or(serde_json::Value::Null);
    Ok(Snapshot { tokens, kv, extra })
}

/// Puts a snapshot's state into a fresh or used session (replacing what it held).
pub fn restore(session: &mut Session<'_>, snap: &Snapshot) -> Result<()> {
    session.cache.reset()?;
    session.tokens.clear();
    for (i, (k, v)) in snap.kv.iter().enumerate() {
        session.cache.layer(i).restore(k, v)?;
    }
    session.tokens = snap.tokens.clone();
    Ok(())
}
