//! A model already on disk: a GGUF file, or a directory in the Hugging Face layout.

use crate::model::files::{HfFiles, Location};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A local GGUF file, or a directory in the HF layout.
pub fn local(p: &Path) -> Result<Location> {
    let meta = std::fs::metadata(p)
        .with_context(|| format!("model path {} does not exist", p.display()))?;
    if meta.is_file() {
        return Ok(Location::Gguf(p.to_path_buf()));
    }
    if !meta.is_dir() {
        bail!(
            "model path {} is {}, not a GGUF file or a model directory",
            p.display(),
            crate::fsx::kind(&meta)
        );
    }
    let config = p.join("config.json");
    if !config.exists() {
        bail!(
            "model directory {} has no config.json (an HF-layout model needs config.json, tokenizer.json and model*.safetensors)",
            p.display()
        );
    }
    let index = p.join("model.safetensors.index.json");
    let weights = if index.exists() {
        shard_names(&index)?
            .into_iter()
            .map(|s| p.join(s))
            .collect::<Vec<_>>()
    } else {
        let mut w: Vec<PathBuf> = std::fs::read_dir(p)
            .with_context(|| format!("cannot list {}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| {
                f.extension().is_some_and(|x| x == "safetensors")
                    && f.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("model"))
            })
            .collect();
        w.sort();
        w
    };
    if weights.is_empty() {
        bail!("model directory {} has no model*.safetensors", p.display());
    }
    for w in &weights {
        if !w.exists() {
            bail!(
                "model directory {}: shard {} is missing",
                p.display(),
                w.display()
            );
        }
    }
    let opt = |n: &str| Some(p.join(n)).filter(|f| f.exists());
    Ok(Location::Safetensors(HfFiles {
        label: p.display().to_string(),
        config,
        tokenizer: opt("tokenizer.json"),
        tokenizer_config: opt("tokenizer_config.json"),
        generation_config: opt("generation_config.json"),
        weights,
    }))
}

/// The distinct shard files of a `model.safetensors.index.json`, in order of first appearance.
pub(super) fn shard_names(index: &Path) -> Result<Vec<String>> {
    let json = crate::read_json(index)?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no weight_map", index.display()))?;
    let mut names: Vec<String> = Vec::new();
    for v in map.values() {
        let n = v.as_str().with_context(|| {
            format!("{}: weight_map values must be file names", index.display())
        })?;
        if n.contains('/') || super::paths::check_repo_file(n).is_err() {
            bail!(
                "{}: shard name '{n}' is not a plain file name",
                index.display()
            );
        }
        if !names.iter().any(|x| x == n) {
            names.push(n.to_string());
        }
    }
    Ok(names)
}

/// A sample of a model's weight bytes for its identity: its size and 16 slices of 4 KiB spread
/// over the file (every `.safetensors` file of a directory), so that two files with the same
/// layout but other weights (random-weight test models) never share blocks. Reads 64 KiB.
pub fn weights_sample(path: &Path) -> String {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Seek, SeekFrom};
    let mut files = vec![path.to_path_buf()];
    if path.is_dir() {
        files = std::fs::read_dir(path)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
    }
    let mut h = Sha256::new();
    for p in files {
        let Ok(mut f) = std::fs::File::open(&p) else {
            continue;
        };
        let len = f.metadata().map_or(0, |m| m.len());
        h.update(len.to_le_bytes());
        let mut buf = vec![0u8; 4096];
        for i in 0..16u64 {
            if f.seek(SeekFrom::Start(len / 16 * i)).is_ok() {
                let n = f.read(&mut buf).unwrap_or(0);
                h.update(&buf[..n]);
            }
        }
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
