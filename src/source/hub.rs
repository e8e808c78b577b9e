//! Hugging Face hub downloads into the hub's own cache layout (the one `huggingface_hub` and hf-hub
//! share, so files are found by every tool):
//!
//! ```text
//! $HF_HOME/hub/models--{owner}--{name}/blobs/{etag}              the bytes
//! $HF_HOME/hub/models--{owner}--{name}/snapshots/{commit}/{file}  a relative link to the blob
//! $HF_HOME/hub/models--{owner}--{name}/refs/{revision}            the commit the revision named
//! ```
//!
//! hf-hub 0.4 names those paths for us (`Cache`, `Repo::folder_name`, `ApiRepo::url`), but its
//! downloader builds them from the server's `etag` and `x-repo-commit` headers unchecked, so a hostile
//! server could write outside the cache. kvchat therefore places the files itself: every name that
//! becomes a path (repo, revision, file, commit, etag) is checked first (`paths`), downloads go to
//! `blobs/{etag}.part` under a lock and resume from where they stopped, the byte count is checked,
//! and only then is the blob moved into place and linked.

use super::paths::{check_commit, check_etag, check_repo_file, check_repo_id, check_revision};
use super::progress::Bar;
use crate::human_bytes;
use anyhow::{bail, Context, Result};
use hf_hub::{Cache, Repo, RepoType};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        .unwrap_or(false)
}

/// The hub cache root: `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_root() -> Result<PathBuf> {
    if std::env::var_os("HF_HOME").is_some() {
        return Ok(Cache::from_env().path().clone());
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).context(
        "neither HF_HOME nor HOME is set: set HF_HOME to the directory for hub downloads",
    )?;
    Ok(PathBuf::from(home).join(".cache/huggingface/hub"))
}

/// One repo at one revision, checked, with its directory in the cache.
pub struct RepoAt {
    pub id: String,
    pub revision: String,
    dir: PathBuf,
}

impl RepoAt {
    pub fn new(root: &Path, id: &str, revision: &str) -> Result<Self> {
        check_repo_id(id)?;
        check_revision(revision)?;
        let folder = Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string())
            .folder_name();
        Ok(Self {
            id: id.to_string(),
            revision: revision.to_string(),
            dir: root.join(folder),
        })
    }

    /// The commit this revision points at in the cache: the revision itself when it is a commit id,
    /// else what `refs/{revision}` says (checked, so a damaged ref leads nowhere).
    fn cached_commit(&self) -> Option<String> {
        if check_commit(&self.revision).is_ok() {
            return Some(self.revision.clone());
        }
        let text =
            crate::fsx::read_text(&self.dir.join("refs").join(&self.revision), 256, "ref").ok()?;
        let commit = text.trim().to_string();
        check_commit(&commit).ok()?;
        Some(commit)
    }

    /// `file` from the cache, if it is there.
    pub fn cached(&self, file: &str) -> Option<PathBuf> {
        check_repo_file(file).ok()?;
        let commit = self.cached_commit()?;
        let p = self.dir.join("snapshots").join(commit).join(file);
        // metadata follows the link: a dangling link (blob removed) is not a cached file.
        std::fs::metadata(&p).ok()?.is_file().then_some(p)
    }
}

/// The hub client: endpoint, token and cache from the environment (HF_ENDPOINT, HF_TOKEN or the
/// token file, HF_HOME, HF_HUB_OFFLINE).
pub struct Hub {
    root: PathBuf,
    endpoint: String,
    token: Option<String>,
    offline: bool,
}

/// What the hub says of a file before its bytes are fetched.
struct Meta {
    commit: String,
    etag: String,
    size: u64,
}

/// Why a request failed: the server's answer, or a header that cannot be trusted.
enum Failure {
    Http(Box<ureq::Error>),
    Untrusted(String),
}

impl From<ureq::Error> for Failure {
    fn from(e: ureq::Error) -> Self {
        Failure::Http(Box::new(e))
    }
}

/// The most a single file may be (a sanity bound on a server's claim).
const MAX_FILE: u64 = 1 << 40;

impl Hub {
    pub fn from_env() -> Result<Self> {
        let root = cache_root()?;
        let endpoint = std::env::var("HF_ENDPOINT")
            .unwrap_or_else(|_| "https://huggingface.co".into())
            .trim_end_matches('/')
            .to_string();
        let token = std::env::var("HF_TOKEN")
            .ok()
            .or_else(|| {
                let file = root.parent()?.join("token");
                crate::fsx::read_text(&file, 4096, "token file").ok()
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        Ok(Self {
            root,
            endpoint,
            token,
            offline: env_flag("HF_HUB_OFFLINE"),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn repo(&self, id: &str, revision: &str) -> Result<RepoAt> {
        RepoAt::new(&self.root, id, revision)
    }

    fn agent(&self, redirects: u32) -> ureq::Agent {
        ureq::AgentBuilder::new()
            .try_proxy_from_env(true)
            .redirects(redirects)
            .build()
    }

    fn request(&self, agent: &ureq::Agent, url: &str) -> ureq::Request {
        let mut r = agent
            .get(url)
            .set("user-agent", concat!("kvchat/", env!("CARGO_PKG_VERSION")));
        if let Some(t) = &self.token {
            r = r.set("authorization", &format!("Bearer {t}"));
        }
        r
    }

    fn url(&self, repo: &RepoAt, file: &str) -> String {
        // The revision goes into the URL percent-encoded (`refs/pr/1` → `refs%2Fpr%2F1`).
        format!(
            "{}/{}/resolve/{}/{file}",
            self.endpoint,
            repo.id,
            repo.revision.replace('/', "%2F")
        )
    }

    /// A repo file from the cache, else downloaded; `optional` files that the repo lacks are None.
    pub fn get(&self, repo: &RepoAt, file: &str, optional: bool) -> Result<Option<PathBuf>> {
        check_repo_file(file)?;
        if let Some(p) = repo.cached(file) {
            return Ok(Some(p));
        }
        let id = &repo.id;
        if self.offline {
            if optional {
                return Ok(None);
            }
            bail!(
                "HF_HUB_OFFLINE is set and {file} of hf:{id} is not in the hub cache {}",
                self.root.display()
            );
        }
        let url = self.url(repo, file);
        let meta = match self.metadata(&url) {
            Ok(m) => m,
            Err(Failure::Http(e)) => return self.explain(*e, repo, file, optional),
            Err(Failure::Untrusted(why)) => {
                bail!("{file} from hf:{id}: {why}; nothing was written")
            }
        };
        let blobs = repo.dir.join("blobs");
        let blob = blobs.join(&meta.etag);
        std::fs::create_dir_all(&blobs)
            .with_context(|| format!("cannot create {}", blobs.display()))?;
        let complete = std::fs::metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == meta.size);
        if !complete {
            if let Err(e) = self.download(&url, &blob, &meta, &format!("{id}/{file}")) {
                return match e.downcast::<ureq::Error>() {
                    Ok(u) => self.explain(u, repo, file, optional),
                    Err(e) => Err(e),
                };
            }
            crate::notes::note(format!(
                "fetched {file} from hf:{id} ({})",
                human_bytes(meta.size)
            ));
        }
        let pointer = self.link(repo, &meta, file)?;
        Ok(Some(pointer))
    }

    /// The hub's answer to a one-byte request: commit, etag and size, all checked.
    fn metadata(&self, url: &str) -> std::result::Result<Meta, Failure> {
        // No redirects: the commit and etag headers are the hub's, not the storage server's.
        let plain = self.agent(0);
        let mut resp = self.request(&plain, url).set("range", "bytes=0-0").call()?;
        // Relative redirects stay on the hub (renamed repos); absolute ones go to storage.
        let mut hops = 0;
        while (300..400).contains(&resp.status()) && hops < 5 {
            let Some(loc) = resp.header("location").map(str::to_string) else {
                break;
            };
            if loc.contains("://") {
                break;
            }
            let next = format!("{}{loc}", self.endpoint);
            resp = self
                .request(&plain, &next)
                .set("range", "bytes=0-0")
                .call()?;
            hops += 1;
        }
        let bad = Failure::Untrusted;
        let commit = resp
            .header("x-repo-commit")
            .ok_or_else(|| bad("the hub sent no x-repo-commit header".into()))?
            .trim()
            .to_string();
        check_commit(&commit).map_err(|e| bad(e.to_string()))?;
        let etag = resp
            .header("x-linked-etag")
            .or_else(|| resp.header("etag"))
            .ok_or_else(|| bad("the hub sent no ETag header".into()))?
            .trim()
            .trim_start_matches("W/")
            .replace('"', "");
        check_etag(&etag).map_err(|e| bad(e.to_string()))?;
        let size = match resp.header("x-linked-size") {
            Some(s) => s.trim().parse::<u64>().ok(),
            None => {
                let range_of = |r: &ureq::Response| {
                    r.header("content-range")
                        .and_then(|c| c.rsplit('/').next())
                        .and_then(|n| n.trim().parse::<u64>().ok())
                };
                if (300..400).contains(&resp.status()) {
                    let loc = resp.header("location").unwrap_or_default().to_string();
                    let r = self.agent(5).get(&loc).set("range", "bytes=0-0").call()?;
                    range_of(&r)
                } else {
                    range_of(&resp)
                }
            }
        };
        let size = size
            .filter(|&s| s <= MAX_FILE)
            .ok_or_else(|| bad("the hub sent no usable file size".into()))?;
        Ok(Meta { commit, etag, size })
    }

    /// Fetches the file's bytes into `blob`, through `blob.part` under `blob.lock`.
    fn download(&self, url: &str, blob: &Path, meta: &Meta, label: &str) -> Result<()> {
        let part = blob.with_extension("part");
        let lock_path = blob.with_extension("lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("cannot create {}", lock_path.display()))?;
        // Another kvchat fetching the same blob: wait for it, then use what it wrote.
        lock.lock()
            .with_context(|| format!("cannot lock {}", lock_path.display()))?;
        if std::fs::metadata(blob).is_ok_and(|m| m.len() == meta.size) {
            return Ok(());
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&part)
            .with_context(|| format!("cannot write {}", part.display()))?;
        let mut start = file.metadata()?.len();
        if start > meta.size {
            file.set_len(0)?;
            start = 0;
        }
        let bar = Bar::new(label.to_string());
        bar.start(meta.size, start);
        if start < meta.size {
            let resp = self
                .request(&self.agent(5), url)
                .set("range", &format!("bytes={start}-"))
                .call()?;
            if start > 0 && resp.status() != 206 {
                // The server ignored the range: start over.
                file.set_len(0)?;
                start = 0;
                bar.start(meta.size, 0);
            }
            let mut reader = resp.into_reader().take(meta.size - start);
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = match reader.read(&mut buf) {
                    Ok(n) => n,
                    Err(e) => bail!(
                        "download of {label} was interrupted ({e}); run the command again to resume it"
                    ),
                };
                if n == 0 {
                    break;
                }
                file.write_all(&buf[..n])
                    .with_context(|| format!("cannot write {}", part.display()))?;
                bar.pb.inc(n as u64);
            }
        }
        file.sync_all()?;
        let got = file.metadata()?.len();
        if got != meta.size {
            bail!(
                "download of {label} ended after {got} of {} bytes; run the command again",
                meta.size
            );
        }
        std::fs::rename(&part, blob)
            .with_context(|| format!("cannot move {} into place", part.display()))?;
        Ok(())
    }

    /// Links `snapshots/{commit}/{file}` to the blob and points `refs/{revision}` at the commit.
    fn link(&self, repo: &RepoAt, meta: &Meta, file: &str) -> Result<PathBuf> {
        let pointer = repo.dir.join("snapshots").join(&meta.commit).join(file);
        let parent = pointer.parent().expect("a file under snapshots/");
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
        // From snapshots/{commit}/{dirs of file}/ back up to the repo directory, then blobs/{etag}.
        let ups = 2 + file.matches('/').count();
        let target = PathBuf::from("../".repeat(ups))
            .join("blobs")
            .join(&meta.etag);
        if std::fs::symlink_metadata(&pointer).is_ok() {
            std::fs::remove_file(&pointer)
                .with_context(|| format!("cannot replace {}", pointer.display()))?;
        }
        std::os::unix::fs::symlink(&target, &pointer)
            .with_context(|| format!("cannot link {}", pointer.display()))?;
        if repo.revision != meta.commit {
            let r = repo.dir.join("refs").join(&repo.revision);
            let dir = r.parent().expect("refs/");
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let tmp = dir.join(format!(".ref-{}.tmp", std::process::id()));
            std::fs::write(&tmp, &meta.commit)
                .and_then(|()| std::fs::rename(&tmp, &r))
                .with_context(|| format!("cannot write {}", r.display()))?;
        }
        Ok(pointer)
    }

    /// A failed request in words: repo or file not found, access denied, unreachable.
    fn explain<T>(
        &self,
        e: ureq::Error,
        repo: &RepoAt,
        file: &str,
        optional: bool,
    ) -> Result<Option<T>> {
        let id = &repo.id;
        match e {
            ureq::Error::Status(code, resp) => {
                match resp.header("x-error-code") {
                    Some("RepoNotFound") => bail!(
                        "hub repo hf:{id} not found at {} (check the name; private repos need HF_TOKEN)",
                        self.endpoint
                    ),
                    Some("RevisionNotFound") => {
                        bail!("hub repo hf:{id} has no revision '{}'", repo.revision)
                    }
                    _ => {}
                }
                match code {
                    404 if optional => Ok(None),
                    404 => bail!("hub repo hf:{id} has no file {file}"),
                    401 | 403 => bail!(
                        "hub repo hf:{id}: access denied (not found, private or gated: set HF_TOKEN)"
                    ),
                    code => bail!("{file} from hf:{id}: the hub answered HTTP {code}"),
                }
            }
            ureq::Error::Transport(t) => bail!(
                "cannot reach the hub at {} for hf:{id}/{file} ({}); set HF_HUB_OFFLINE=1 to use only the cache",
                self.endpoint,
                crate::first_line(t)
            ),
        }
    }
}
