//! The process's one Ctrl-C / SIGTERM handler. While an answer streams, Ctrl-C stops that answer
//! (`stop` is set, the generation loop sees it). Otherwise the signal ends the process as it would
//! without a handler (exit 130), after removing the temporary files registered with [`TempFile`], so
//! a save cut short never leaves a half-written file behind.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

pub struct Interrupt {
    /// An answer is streaming: Ctrl-C stops it instead of the process.
    pub generating: AtomicBool,
    /// Set by Ctrl-C while `generating`.
    pub stop: AtomicBool,
}

static STATE: OnceLock<Interrupt> = OnceLock::new();
static TEMP_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Set (under the lock) once the handler has removed the temporary files: none may be created after.
static EXITING: AtomicBool = AtomicBool::new(false);

fn temp_files() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    TEMP_FILES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Removes the temporary files and ends the process, holding the list's lock to the end so that no
/// other thread can create one in between. (ctrlc runs handlers on a thread of their own, not inside
/// the signal, so waiting for the lock is safe.)
fn remove_temp_files_and_exit() -> ! {
    let mut files = temp_files();
    EXITING.store(true, Ordering::SeqCst);
    for f in files.drain(..) {
        let _ = std::fs::remove_file(f);
    }
    eprintln!();
    std::process::exit(130)
}

/// Installs the handler once; later calls return the same state.
pub fn install() -> Result<&'static Interrupt> {
    if let Some(s) = STATE.get() {
        return Ok(s);
    }
    let state = STATE.get_or_init(|| Interrupt {
        generating: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    ctrlc::set_handler(|| {
        let s = STATE.get().expect("set before the handler");
        if s.generating.load(Ordering::SeqCst) {
            s.stop.store(true, Ordering::SeqCst);
        } else {
            remove_temp_files_and_exit();
        }
    })
    .context("cannot install the Ctrl-C handler")?;
    Ok(state)
}

/// Whether Ctrl-C asked to stop what is running now (false when no handler is installed).
pub fn stop_requested() -> bool {
    STATE.get().is_some_and(|s| s.stop.load(Ordering::SeqCst))
}

/// A file being written under a temporary name: removed when dropped unless [`TempFile::keep`]
/// moved it into place, and removed by the signal handler if the process is stopped meanwhile.
pub struct TempFile {
    path: PathBuf,
    done: bool,
}

impl TempFile {
    /// Creates `path` (never reusing or following anything already there) and registers it, both
    /// under the list's lock, so a signal handler either sees it or stops it from being made.
    pub fn create(path: PathBuf) -> std::io::Result<(Self, std::fs::File)> {
        let mut files = temp_files();
        if EXITING.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("kvchat is exiting"));
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        files.push(path.clone());
        Ok((Self { path, done: false }, f))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the file to `dest`; from then on it is no longer temporary.
    pub fn keep(mut self, dest: &Path) -> Result<()> {
        std::fs::rename(&self.path, dest).with_context(|| {
            format!("cannot move {} to {}", self.path.display(), dest.display())
        })?;
        self.done = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.path);
        }
        temp_files().retain(|p| p != &self.path);
    }
}
