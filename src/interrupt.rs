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
    // The line the ^C was typed on ends (through the front end's sink).
    crate::notes::note("");
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
    /// A temporary file for writing `dest`: `.NAME.tmp-PID-N` beside it (NAME: dest's file name,
    /// N: counts this process's temporary files). Temporary files for `dest` that a process no
    /// longer running left behind (killed with SIGKILL mid-write) are removed first.
    pub fn beside(dest: &Path) -> std::io::Result<(Self, std::fs::File)> {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("kvchat");
        remove_stale(dir, Some(name));
        let n = N.fetch_add(1, Ordering::Relaxed);
        Self::create(dir.join(format!(".{name}.tmp-{}-{n}", std::process::id())))
    }

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

/// The process id in `file_name` if it is the name of one of kvchat's temporary files for a file
/// named `for_name` (any name when None): `.NAME.tmp-PID-N`, or `.NAME.tmp-PID` as earlier
/// versions wrote them.
fn temp_owner(file_name: &str, for_name: Option<&str>) -> Option<u32> {
    let rest = file_name.strip_prefix('.')?;
    let (name, tail) = rest.rsplit_once(".tmp-")?;
    if name.is_empty() || for_name.is_some_and(|n| n != name) {
        return None;
    }
    let (pid, n) = tail.split_once('-').unwrap_or((tail, "0"));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(n) {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` is running (or may be: anything but "no such process" counts as yes).
fn running(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(raw) = i32::try_from(pid) else {
            return true;
        };
        !matches!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None),
            Err(nix::errno::Errno::ESRCH)
        )
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Removes from `dir` kvchat's temporary files (for a file named `for_name`, or any) whose
/// process no longer runs: plain files only, never links, and never anything of another name.
/// Returns how many went.
pub fn remove_stale(dir: &Path, for_name: Option<&str>) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|f| temp_owner(f, for_name)) else {
            continue;
        };
        // (DirEntry's file type does not follow links.)
        let plain = e.file_type().is_ok_and(|t| t.is_file());
        if plain
            && pid != std::process::id()
            && !running(pid)
            && std::fs::remove_file(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kvchat_temporary_names_have_an_owner() {
        assert_eq!(
            temp_owner(".chat.kvc.tmp-123-4", Some("chat.kvc")),
            Some(123)
        );
        assert_eq!(temp_owner(".chat.kvc.tmp-123", Some("chat.kvc")), Some(123));
        assert_eq!(temp_owner(".chat.kvc.tmp-123-4", None), Some(123));
        assert_eq!(temp_owner(".chat.kvc.tmp-123-4", Some("other.kvc")), None);
        for not_ours in [
            "chat.kvc.tmp-123",
            ".chat.kvc.tmp-",
            ".chat.kvc.tmp-12a",
            ".chat.kvc.tmp-123-",
            ".chat.kvc.tmp-123-4-5",
            "..tmp-123",
            ".notes.tmp",
            "chat.kvc",
        ] {
            assert_eq!(temp_owner(not_ours, None), None, "{not_ours}");
        }
    }

    #[test]
    fn a_dead_process_temporary_file_goes_and_nothing_else_does() {
        let dir = std::env::temp_dir().join(format!("kvchat-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A process that has exited: its pid runs no more (until reused, which a test cannot rule
        // out, so the reaped child's pid is checked first).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        assert!(!running(dead));
        let me = std::process::id();
        let files = [
            format!(".a.kvc.tmp-{dead}-0"), // dead, ours: goes
            format!(".a.kvc.tmp-{dead}"),   // dead, older form: goes
            format!(".a.kvc.tmp-{me}-0"),   // this process: stays
            format!(".b.kvc.tmp-{dead}-0"), // another file's: stays when asked for a.kvc
            format!("a.kvc.tmp-{dead}-0"),  // not our pattern: stays
            "a.kvc".to_string(),            // the file itself: stays
        ];
        for f in &files {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        assert_eq!(remove_stale(&dir, Some("a.kvc")), 2);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = files[2..].to_vec();
        want.sort();
        assert_eq!(left, want);
        // Asked for any name: the other file's goes too.
        assert_eq!(remove_stale(&dir, None), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
