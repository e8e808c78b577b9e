//! Saving and restoring a sequence's KV state — the prompt cache (`--prompt-cache`) and chat's
//! `/save`/`/load`. The container is safetensors: each layer's stored rows as bytes (`k.{i}`,
//! `v.{i}`, `[n_kv_heads, positions held, row bytes]`, u8, in the cache's precision, oldest
//! first), a quantized cache's f16 residual (`rk.{i}`, `rv.{i}`, positions `residual_from..`), and
//! the token ids (`tokens`), a model with recurrent states' states at the end (`sc.{r}`, `sm.{r}`:
//! each DeltaNet layer's convolution window and matrices, f32) and the snapshots of them the cache
//! kept (`snap.pos`, u32 `[K]`, and `snap.{k}.sc.{r}`, `snap.{k}.sm.{r}`: going back to a shorter
//! prefix restores the nearest), with a JSON header naming the format, the model (a digest of its GGUF
//! metadata and tensor layout) and the cache's axes, which must match to load.
//!
//! Files are handled as if hostile: only a regular file is read (never a link, pipe or device), its
//! size is checked against what this model's cache can hold before a byte is read, and what it holds
//! is checked for shape, dtype and finite values. A file is only ever replaced when what is there is
//! a kvchat KV file (or nothing): the state goes to a temporary file created anew in the same
//! directory, which is removed on any failure or signal, then renamed over the old one.

use super::layer::RawState;
use super::KvCache;
use crate::interrupt::TempFile;
use crate::model::deltanet::RecurrentState;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;

pub const FORMAT: &str = "kvchat-kv/2";
/// What every version's format starts with: a file with an older version may be replaced.
const FORMAT_FAMILY: &str = "kvchat-kv/";

/// What a file holds, once checked.
pub struct Snapshot {
    pub tokens: Vec<u32>,
    /// Per layer: the stored rows.
    pub layers: Vec<RawState>,
    /// Per recurrent layer (Qwen3.5's DeltaNet): its state after the last token.
    pub states: Vec<RecurrentState>,
    /// Snapshots of the states at earlier positions (oldest first; `kv::States`).
    pub snapshots: Vec<(usize, Vec<RecurrentState>)>,
    /// Whatever the writer added (the chat's messages).
    pub extra: serde_json::Value,
}

/// What a file must match to be loaded into a cache.
pub struct Expect<'a> {
    pub model_digest: &'a str,
    pub cache_key: &'a str,
    /// Per layer of the cache: its KV heads and head size (Gemma 4's layers differ).
    pub shapes: Vec<(usize, usize)>,
    /// The most positions the cache may hold (`--ctx`).
    pub max_positions: usize,
    /// Per recurrent layer: the f32 values of its convolution window and of its matrices.
    pub states: Vec<(usize, usize)>,
}

impl Expect<'_> {
    /// The largest file that can hold such a state: f32 keys and values of every layer at full
    /// context, the token ids, and room for the header and the conversation's text.
    fn max_file_bytes(&self) -> u64 {
        let rows: usize = self.shapes.iter().map(|(nkv, hd)| nkv * hd).sum();
        let per_pos = (2 * rows * 4 + 4) as u64;
        let states: usize = self.states.iter().map(|(c, m)| 4 * (c + m)).sum();
        let states = states * (1 + super::MAX_SNAPSHOTS);
        per_pos
            .saturating_mul(self.max_positions as u64)
            .saturating_add((64 << 20) + 64 * self.max_positions as u64 + states as u64)
    }
}

/// The safetensors header's own limit (the crate refuses more).
const MAX_HEADER: u64 = 100_000_000;

/// The metadata of a safetensors file's header, read without reading its tensors.
fn read_header_metadata(f: &mut std::fs::File, path: &Path) -> Result<HashMap<String, String>> {
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|_| {
        anyhow!(
            "{} is not a kvchat KV file (shorter than a header)",
            path.display()
        )
    })?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        bail!(
            "{} is not a kvchat KV file (header length {n})",
            path.display()
        );
    }
    let mut header = Vec::new();
    f.take(n).read_to_end(&mut header)?;
    let json: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|_| anyhow!("{} is not a kvchat KV file", path.display()))?;
    let meta = json
        .get("__metadata__")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    Ok(meta)
}

/// Opens `path` for reading if it is a regular file (never a link, pipe or device).
fn open_regular(path: &Path) -> Result<std::fs::File> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.is_file() => bail!(
            "{} is {}, not a kvchat KV file",
            path.display(),
            crate::fsx::kind(&meta)
        ),
        _ => crate::fsx::open_regular_nofollow(path)
            .with_context(|| format!("cannot open {}", path.display())),
    }
}

/// What is at `path` now: `Ok(false)` nothing, `Ok(true)` a kvchat KV file that may be replaced,
/// an error for anything else (a model, a text file, a link, a device, a directory), which kvchat
/// will not overwrite.
pub fn check_target(path: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(anyhow!("cannot check {}: {e}", path.display())),
        Ok(_) => {}
    }
    let refuse = |why: String| {
        anyhow!("{why}; kvchat will not overwrite it (choose another file for the KV state)")
    };
    let mut f = open_regular(path).map_err(|e| refuse(crate::first_line(e)))?;
    let meta = read_header_metadata(&mut f, path).map_err(|e| refuse(crate::first_line(e)))?;
    if !meta
        .get("format")
        .is_some_and(|f| f.starts_with(FORMAT_FAMILY))
    {
        return Err(refuse(format!(
            "{} is not a kvchat KV file",
            path.display()
        )));
    }
    Ok(true)
}

/// Writes the session's state (its tokens and every layer's cache) to `path`, atomically; refuses
/// to replace anything but a kvchat KV file.
pub fn save(
    path: &Path,
    tokens: &[u32],
    cache: &KvCache,
    model_digest: &str,
    cache_key: &str,
    extra: serde_json::Value,
) -> Result<()> {
    check_target(path)?;
    let n = tokens.len();
    if n == 0 {
        bail!("there is nothing to save yet (no positions in the cache)");
    }
    if cache.seen() != n {
        bail!(
            "the cache has seen {} of {} positions: only the state of the whole sequence can be saved",
            cache.seen(),
            n
        );
    }
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    tensors.push(("tokens".into(), Tensor::new(tokens, &Device::Cpu)?));
    let mut residual_from = None;
    for (i, layer) in cache.layers().iter().enumerate() {
        let st = layer.raw_state()?;
        let nkv = layer.n_kv_heads();
        let bytes = |b: Vec<u8>| -> Result<Tensor> {
            let per_head = b.len() / nkv;
            Ok(Tensor::from_vec(b, (nkv, per_head), &Device::Cpu)?)
        };
        tensors.push((format!("k.{i}"), bytes(st.k)?));
        tensors.push((format!("v.{i}"), bytes(st.v)?));
        if !st.residual_k.is_empty() {
            tensors.push((format!("rk.{i}"), bytes(st.residual_k)?));
            tensors.push((format!("rv.{i}"), bytes(st.residual_v)?));
        }
        residual_from.get_or_insert(st.residual_from);
    }
    let mut states = |prefix: &str, states: &[RecurrentState]| -> Result<()> {
        for (r, s) in states.iter().enumerate() {
            let conv = Tensor::new(s.conv.as_slice(), &Device::Cpu)?;
            tensors.push((format!("{prefix}sc.{r}"), conv));
            let matrix = Tensor::new(s.matrix.as_slice(), &Device::Cpu)?;
            tensors.push((format!("{prefix}sm.{r}"), matrix));
        }
        Ok(())
    };
    states("", cache.states().now())?;
    let snapshots = cache.states().snapshots();
    for (k, (_, s)) in snapshots.iter().enumerate() {
        states(&format!("snap.{k}."), s)?;
    }
    if !snapshots.is_empty() {
        let at: Vec<u32> = snapshots.iter().map(|(p, _)| *p as u32).collect();
        tensors.push(("snap.pos".into(), Tensor::new(at, &Device::Cpu)?));
    }
    let meta: HashMap<String, String> = [
        ("format".to_string(), FORMAT.to_string()),
        ("model".to_string(), model_digest.to_string()),
        ("cache".to_string(), cache_key.to_string()),
        ("extra".to_string(), extra.to_string()),
        (
            "residual_from".to_string(),
            residual_from.unwrap_or(n).to_string(),
        ),
    ]
    .into_iter()
    .collect();
    let bytes = safetensors::serialize(tensors.iter().map(|(k, t)| (k.as_str(), t)), Some(meta))
        .map_err(|e| anyhow!("cannot serialize the KV state: {e}"))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // create_new: never reuse (or follow a link planted at) the temporary name; a temporary file
    // for this path that a killed kvchat left is removed first.
    let (tmp, mut f) = TempFile::beside(path)
        .with_context(|| format!("cannot write a temporary file in {}", dir.display()))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.path().display()))?;
    drop(f);
    // Checked again just before the rename: nothing else appeared at the path meanwhile.
    check_target(path)?;
    tmp.keep(path)
}

/// Reads and checks a file written by [`save`] for this model and cache configuration.
pub fn load(path: &Path, expect: &Expect<'_>) -> Result<Snapshot> {
    let mut f = open_regular(path)?;
    let size = f.metadata()?.len();
    let limit = expect.max_file_bytes();
    if size > limit {
        bail!(
            "{} is {size} bytes, more than a KV state of this model with a context of {} can be ({limit}); it is not for this model",
            path.display(),
            expect.max_positions
        );
    }
    let mut bytes = Vec::with_capacity(size as usize);
    Read::by_ref(&mut f).take(limit).read_to_end(&mut bytes)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
        anyhow!(
            "{} is not a kvchat KV file (or is truncated): {e}",
            path.display()
        )
    })?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| meta.get(k).map(String::as_str).unwrap_or("");
    if get("format") != FORMAT {
        bail!(
            "{} is not a kvchat KV file (format '{}')",
            path.display(),
            get("format")
        );
    }
    if get("model") != expect.model_digest {
        bail!("{} was made with another model", path.display());
    }
    if get("cache") != expect.cache_key {
        bail!(
            "{} was made with another cache configuration ({}, this run uses {})",
            path.display(),
            get("cache"),
            expect.cache_key
        );
    }
    let mut tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| {
        anyhow!(
            "{} is corrupt or truncated: {}",
            path.display(),
            crate::first_line(e)
        )
    })?;
    drop(bytes);
    let tokens = tensors
        .remove("tokens")
        .ok_or_else(|| anyhow!("{} has no tokens", path.display()))?;
    if tokens.dtype() != DType::U32 || tokens.rank() != 1 {
        bail!("{} has malformed tokens", path.display());
    }
    let tokens: Vec<u32> = tokens.to_vec1()?;
    if tokens.is_empty() {
        bail!("{} holds no positions", path.display());
    }
    if tokens.len() >= expect.max_positions {
        bail!(
            "{} holds {} positions, which leave no room in the context of {}",
            path.display(),
            tokens.len(),
            expect.max_positions
        );
    }
    let residual_from: usize = get("residual_from")
        .parse()
        .map_err(|_| anyhow!("{} has no valid residual_from", path.display()))?;
    let mut layers = Vec::with_capacity(expect.shapes.len());
    let mut take = |name: String, nkv: usize, required: bool| -> Result<Vec<u8>> {
        let Some(t) = tensors.remove(&name) else {
            if required {
                bail!("{} lacks {name} (a layer's keys or values)", path.display());
            }
            return Ok(Vec::new());
        };
        if t.dtype() != DType::U8 || t.rank() != 2 || t.dim(0)? != nkv {
            bail!(
                "{}: {name} is {:?} {:?}, not the [{nkv}, bytes] u8 rows this model's cache holds",
                path.display(),
                t.dtype(),
                t.dims()
            );
        }
        Ok(t.flatten_all()?.to_vec1::<u8>()?)
    };
    for (i, &(nkv, _)) in expect.shapes.iter().enumerate() {
        let (k, v) = (
            take(format!("k.{i}"), nkv, true)?,
            take(format!("v.{i}"), nkv, true)?,
        );
        let (residual_k, residual_v) = (
            take(format!("rk.{i}"), nkv, false)?,
            take(format!("rv.{i}"), nkv, false)?,
        );
        layers.push(RawState {
            k,
            v,
            residual_k,
            residual_v,
            residual_from,
        });
    }
    let snap_pos = tensors.remove("snap.pos");
    let mut take_states = |prefix: &str| -> Result<Vec<RecurrentState>> {
        let mut take = |name: String, len: usize| -> Result<Vec<f32>> {
            let t = tensors.remove(&name).ok_or_else(|| {
                anyhow!(
                    "{} lacks {name} (a recurrent layer's state)",
                    path.display()
                )
            })?;
            if t.dtype() != DType::F32 || t.dims() != [len] {
                bail!(
                    "{}: {name} is {:?} {:?}, not the [{len}] f32 state this model keeps",
                    path.display(),
                    t.dtype(),
                    t.dims()
                );
            }
            let v = t.to_vec1::<f32>()?;
            if v.iter().any(|x| !x.is_finite()) {
                bail!(
                    "{}: {name} holds a value that is not a finite number",
                    path.display()
                );
            }
            Ok(v)
        };
        expect
            .states
            .iter()
            .enumerate()
            .map(|(r, &(conv, matrix))| {
                Ok(RecurrentState {
                    conv: take(format!("{prefix}sc.{r}"), conv)?,
                    matrix: take(format!("{prefix}sm.{r}"), matrix)?,
                })
            })
            .collect()
    };
    let states = take_states("")?;
    let mut snapshots = Vec::new();
    if let Some(at) = snap_pos {
        let at: Vec<u32> = match (at.dtype(), at.rank()) {
            (DType::U32, 1) => at.to_vec1()?,
            _ => bail!("{} has malformed snapshot positions", path.display()),
        };
        // Oldest first, each inside the sequence, no more than a cache keeps.
        let ordered = at.windows(2).all(|w| w[0] < w[1]);
        let inside = at.iter().all(|&p| p > 0 && (p as usize) <= tokens.len());
        if expect.states.is_empty() || at.len() > super::MAX_SNAPSHOTS || !ordered || !inside {
            bail!(
                "{} has snapshots of recurrent states at positions {at:?}, which a sequence of {} cannot have",
                path.display(),
                tokens.len()
            );
        }
        for (k, &p) in at.iter().enumerate() {
            snapshots.push((p as usize, take_states(&format!("snap.{k}."))?));
        }
    }
    if !tensors.is_empty() {
        bail!("{} holds more layers than this model has", path.display());
    }
    let extra = serde_json::from_str(get("extra")).unwrap_or(serde_json::Value::Null);
    Ok(Snapshot {
        tokens,
        layers,
        states,
        snapshots,
        extra,
    })
}
