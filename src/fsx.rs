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
