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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_references_parse_into_repo_revision_and_file() {
        let ModelRef::Hub(Source::Hf {
            repo,
            revision,
            file,
            ..
        }) = ModelRef::parse("hf:a/b@refs/pr/1:sub/m.gguf").unwrap()
        else {
            panic!("not a hub ref")
        };
        assert_eq!(
            (repo.as_str(), revision.as_str(), file.as_deref()),
            ("a/b", "refs/pr/1", Some("sub/m.gguf"))
        );
        let ModelRef::Hub(Source::Hf { revision, file, .. }) = ModelRef::parse("hf:a/b").unwrap()
        else {
            panic!("not a hub ref")
        };
        assert_eq!((revision.as_str(), file), ("main", None));
    }

    #[test]
    fn names_paths_and_bad_hub_references_are_told_apart() {
        assert_eq!(
            ModelRef::parse("smollm2-135m").unwrap(),
            ModelRef::Named("smollm2-135m".into())
        );
        assert!(matches!(
            ModelRef::parse("./x.gguf").unwrap(),
            ModelRef::Path(_)
        ));
        assert!(matches!(
            ModelRef::parse("model.gguf").unwrap(),
            ModelRef::Path(_)
        ));
        for bad in [
            "hf:a",
            "hf:a/b@",
            "hf:a/b:",
            "hf:a/b@../x",
            "hf:a/b:../x",
            "hf:/b",
        ] {
            assert!(ModelRef::parse(bad).is_err(), "{bad}");
        }
    }
}
