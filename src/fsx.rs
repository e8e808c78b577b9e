//! Reading files from outside with limits: a regular file only (a FIFO would hang the read, a device
//! such as /dev/zero would never end), at most a stated number of bytes, with errors that name the
//! file and the limit.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::path::Path;

/// Limits for the files kvchat reads whole.
pub const MAX_JSON: u64 = 64 << 20; // config.json, tokenizer_config.json, safetensors indexes
pub const MAX_TOKENIZER_JSON: u64 = 256 << 20; // Gemma's is 33 MB; 8× headroom
pub const MAX_REGISTRY: u64 = 4 << 20; // models.toml
pub const MAX_TEXT: u64 = 256 << 20; // ppl input, templates from files

/// Fails unless `path` is a regular file (after following links) of at most `limit` bytes.
pub fn check_regular(path: &Path, limit: u64, what: &str) -> Result<u64> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    if !meta.is_file() {
        bail!(
            "{what} {} is not a regular file ({})",
            path.display(),
            kind(&meta)
        );
    }
    if meta.len() > limit {
        bail!(
            "{what} {} is {} bytes, more than the {} bytes kvchat reads",
            path.display(),
            meta.len(),
            limit
        );
    }
    Ok(meta.len())
}

/// What a non-regular path is, in words.
pub fn kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// The bytes of a regular file of at most `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    check_regular(path, limit, what)?;
    let f = std::fs::File::open(path)
        .with_context(|| format!("cannot open {what} {}", path.display()))?;
    let mut buf = Vec::new();
    // The file may have grown since it was measured: never read past the limit.
    f.take(limit + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    if buf.len() as u64 > limit {
        bail!(
            "{what} {} grew past the {limit} bytes kvchat reads",
            path.display()
        );
    }
    Ok(buf)
}

/// A UTF-8 text file of at most `limit` bytes.
pub fn read_text(path: &Path, limit: u64, what: &str) -> Result<String> {
    let bytes = read_bounded(path, limit, what)?;
    String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{what} {} is not UTF-8 text ({e})", path.display()))
}

/// Reads at most `limit` bytes from a stream (stdin); more is an error naming `what`.
pub fn read_stream_bounded(r: &mut dyn Read, limit: u64, what: &str) -> Result<String> {
    let mut buf = Vec::new();
    r.take(limit + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("cannot read {what}"))?;
    if buf.len() as u64 > limit {
        bail!("{what} is longer than {limit} bytes");
    }
    String::from_utf8(buf).map_err(|e| anyhow::anyhow!("{what} is not UTF-8 text ({e})"))
}

/// Opens `path` for reading if it is a regular file, without following a link and without blocking
/// on a pipe; the error keeps the OS's kind (`NotFound` when there is nothing).
pub fn open_regular_nofollow(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let not_regular = |m: &std::fs::Metadata| {
        std::io::Error::other(format!(
            "{} is {}, not a regular file",
            path.display(),
            kind(m)
        ))
    };
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NOFOLLOW | open_flags::O_NONBLOCK)
        .open(path)?;
    // Re-check what was opened: the path may have been swapped since it was measured.
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok(f)
}

/// Open flag from <fcntl.h>: do not follow a link at the last component (Linux values; the same
/// on every architecture Rust targets there except a few, which std does not expose).
#[cfg(any(target_arch = "aarch64", target_arch = "arm"))]
pub const O_NOFOLLOW: i32 = 0o100000;
#[cfg(not(any(target_arch = "aarch64", target_arch = "arm")))]
pub const O_NOFOLLOW: i32 = 0o400000;

mod open_flags {
    pub const O_NONBLOCK: i32 = 0o4000;
}
