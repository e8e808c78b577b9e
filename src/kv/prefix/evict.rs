//! The store's lock, last-use times, least-recently-used eviction and cumulative totals, and
//! the directory walk they share with `admin`.

use super::*;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;

use crate::interrupt::TempFile;

/// The last-use time given to `piece` at `now`: a microsecond older per position into the prompt,
/// so that eviction takes a chain from its end.
pub(super) fn last_use(now: SystemTime, piece: Piece) -> SystemTime {
    now.checked_sub(Duration::from_micros(piece.start as u64 + 1))
        .unwrap_or(now)
}

/// Runs `f` holding `<root>/lock` exclusively.
pub(super) fn with_lock<T>(root: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let path = root.join("lock");
    use std::os::unix::fs::OpenOptionsExt;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(crate::fsx::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    lock.lock()
        .with_context(|| format!("cannot lock {}", path.display()))?;
    let r = f();
    let _ = lock.unlock();
    r
}

/// `dir` exists as a directory (created if absent); anything else is an error naming it.
pub(super) fn check_dir(dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => bail!(
            "{} is {}, not a directory",
            dir.display(),
            crate::fsx::kind(&m)
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
        }
        Err(e) => bail!("cannot read {}: {e}", dir.display()),
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory, renamed into place,
/// with the modification time `mtime` when given.
pub(super) fn write_atomically(path: &Path, bytes: &[u8], mtime: Option<SystemTime>) -> Result<()> {
    let (tmp, mut f) = TempFile::beside(path).context("cannot create a temporary file")?;
    f.write_all(bytes)?;
    if let Some(t) = mtime {
        f.set_modified(t)?;
    }
    drop(f);
    tmp.keep(path)
}

/// Every block file of the store: (path, bytes, last use).
pub(super) fn blocks(root: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    model_dirs(root).iter().flat_map(|d| blocks_in(d)).collect()
}

/// The block files of one model directory: (path, bytes, last use).
pub(super) fn blocks_in(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "kvb"))
        .filter_map(|e| {
            // (DirEntry metadata does not follow links.)
            let m = e.metadata().ok().filter(|m| m.is_file())?;
            let when = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            Some((e.path(), m.len(), when))
        })
        .collect()
}

pub(super) fn model_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    dirs
}

/// Removes least recently used blocks until the store holds at most `budget` bytes (and temporary
/// files left by processes that died); returns how many blocks went. Call under the lock.
pub(super) fn evict(root: &Path, budget: u64) -> Result<usize> {
    for dir in std::iter::once(root.to_path_buf()).chain(model_dirs(root)) {
        crate::interrupt::remove_stale(&dir, None);
    }
    let mut all = blocks(root);
    let mut total: u64 = all.iter().map(|b| b.1).sum();
    if total <= budget {
        return Ok(0);
    }
    all.sort_by_key(|b| b.2);
    let mut n = 0;
    for (path, bytes, _) in all {
        if total <= budget {
            break;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => n += 1,
            // Another process removed it first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => bail!("cannot remove {}: {e}", path.display()),
        }
        total -= bytes;
    }
    if n > 0 {
        let evicted = Totals {
            evictions: n as u64,
            ..Totals::default()
        };
        add_totals(root, &evicted)?;
    }
    Ok(n)
}

/// Adds `add` to `<root>/stats.json` (under the lock).
pub(super) fn add_totals(root: &Path, add: &Totals) -> Result<()> {
    let mut t = read_totals(root);
    t += add;
    let json = serde_json::to_string_pretty(&t)?;
    write_atomically(&root.join("stats.json"), json.as_bytes(), None)
}

impl std::ops::AddAssign<&Totals> for Totals {
    fn add_assign(&mut self, a: &Totals) {
        self.lookups += a.lookups;
        self.hits += a.hits;
        self.prompt_tokens += a.prompt_tokens;
        self.reused_tokens += a.reused_tokens;
        self.bytes_read += a.bytes_read;
        self.blocks_written += a.blocks_written;
        self.bytes_written += a.bytes_written;
        self.evictions += a.evictions;
        self.removed_damaged += a.removed_damaged;
    }
}

pub(super) fn read_totals(root: &Path) -> Totals {
    crate::fsx::read_bounded(&root.join("stats.json"), 1 << 20, "the store's totals")
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}
