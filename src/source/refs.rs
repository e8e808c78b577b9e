//! What `-m` names: a path, a registry name, or a hub reference `hf:owner/repo[@revision][:file]`.

use super::paths::{check_repo_file, check_repo_id, check_revision};
use super::registry::{main_revision, Source};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// What `-m` named.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelRef {
    Path(PathBuf),
    Named(String),
    Hub(Source),
    /// No `-m`: the registry's default entry.
    Default,
}

/// Parses `hf:owner/repo[@revision][:file]`.
pub fn parse_hf(spec: &str) -> Result<Source> {
    let rest = spec
        .strip_prefix("hf:")
        .context("a hub model is written hf:owner/repo[@revision][:file]")?;
    let (repo_rev, file) = match rest.split_once(':') {
        Some((r, f)) if !f.is_empty() => (r, Some(f.to_string())),
        Some(_) => bail!("model '{spec}': empty file name after ':'"),
        None => (rest, None),
    };
    let (repo, revision) = match repo_rev.split_once('@') {
        Some((r, v)) if !v.is_empty() => (r, v.to_string()),
        Some(_) => bail!("model '{spec}': empty revision after '@'"),
        None => (repo_rev, main_revision()),
    };
    check_repo_id(repo)
        .with_context(|| format!("model '{spec}' (write hf:owner/repo[@revision][:file])"))?;
    check_revision(&revision).with_context(|| format!("model '{spec}'"))?;
    if let Some(f) = &file {
        check_repo_file(f).with_context(|| format!("model '{spec}'"))?;
    }
    Ok(Source::Hf {
        repo: repo.to_string(),
        revision,
        file,
        sha256: None,
    })
}

impl ModelRef {
    pub fn parse(spec: &str) -> Result<Self> {
        if spec.starts_with("hf:") {
            return Ok(ModelRef::Hub(parse_hf(spec)?));
        }
        let p = Path::new(spec);
        let looks_like_path = spec.contains('/')
            || spec.contains(std::path::MAIN_SEPARATOR)
            || spec.ends_with(".gguf")
            || spec.starts_with('.');
        if p.exists() || looks_like_path {
            return Ok(ModelRef::Path(p.to_path_buf()));
        }
        Ok(ModelRef::Named(spec.to_string()))
    }
}
