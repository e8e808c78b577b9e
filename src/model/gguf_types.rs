//! The weight types a GGUF file may hold, by ggml's ids, and which of them kvchat runs. candle's
//! reader knows only the types candle runs and refuses any other with a bare "unknown dtype";
//! [`tensor_types`] walks the header's tensor list itself (bounded, hostile input) to find each
//! tensor's true type, so that a type kvchat runs and candle does not (the i-quants) can still be
//! read (`GgufFile::open`), and [`unsupported_tensor`] names a tensor whose type kvchat cannot run.

use super::kernels::quant::{WeightType, WEIGHT_TYPES};
use std::io::{BufReader, Read};
use std::path::Path;

/// Whether kvchat runs weight type `id`: the quantized-matmul driver's table
/// (`kernels::quant::WEIGHT_TYPES`).
fn supported(id: u32) -> bool {
    WEIGHT_TYPES.iter().any(|(i, ..)| *i == id)
}

/// A type's name, or "type N (unknown to kvchat)".
pub fn type_name(id: u32) -> String {
    let t = WeightType(id);
    if t.known() {
        format!("type {t}")
    } else {
        format!("type {id} (unknown to kvchat)")
    }
}

/// One entry of a GGUF header's tensor list: the tensor's name, its type, and the byte position
/// of the type field in the file.
pub struct TensorType {
    pub name: String,
    pub ty: WeightType,
    pub at: u64,
}

/// Each tensor of the GGUF at `path` with its type, in the header's order; None when the header
/// cannot be read this far (the caller then reports the file as unreadable).
pub fn tensor_types(path: &Path) -> Option<Vec<TensorType>> {
    let mut r = Counted {
        r: BufReader::new(std::fs::File::open(path).ok()?),
        at: 0,
    };
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).ok()?;
    if &magic != b"GGUF" {
        return None;
    }
    let version = u32_le(&mut r)?;
    if !(2..=3).contains(&version) {
        return None;
    }
    let n_tensors = u64_le(&mut r)?;
    let n_kv = u64_le(&mut r)?;
    // Bounds far above any real file: past them the header is damaged, not unsupported.
    if n_tensors > 1 << 20 || n_kv > 1 << 20 {
        return None;
    }
    for _ in 0..n_kv {
        skip_string(&mut r)?;
        let ty = u32_le(&mut r)?;
        skip_value(&mut r, ty, 0)?;
    }
    let mut out = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = read_string(&mut r)?;
        let n_dims = u32_le(&mut r)?;
        if n_dims > 8 {
            return None;
        }
        for _ in 0..n_dims {
            u64_le(&mut r)?;
        }
        let at = r.at;
        let ty = WeightType(u32_le(&mut r)?);
        u64_le(&mut r)?; // offset
        out.push(TensorType { name, ty, at });
    }
    Some(out)
}

/// The first tensor of `tensors` whose type kvchat cannot run, as a one-line reason; None when
/// every tensor's type is supported.
pub fn unsupported_tensor(tensors: &[TensorType]) -> Option<String> {
    let t = tensors.iter().find(|t| !supported(t.ty.0))?;
    // Float types first, then the quantized ones by id.
    let mut types: Vec<(u32, &str)> = WEIGHT_TYPES.iter().map(|(i, n, _)| (*i, *n)).collect();
    types.sort_by_key(|&(i, n)| (!n.starts_with(['F', 'B']), i));
    let names: Vec<&str> = types.iter().map(|(_, n)| *n).collect();
    Some(format!(
        "tensor {} has {}, which kvchat cannot run yet; supported: {}",
        t.name,
        type_name(t.ty.0),
        names.join(", ")
    ))
}

/// A buffered reader that counts the bytes read and skipped (the position of each type field).
struct Counted {
    r: BufReader<std::fs::File>,
    at: u64,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.r.read(buf)?;
        self.at += n as u64;
        Ok(n)
    }
}

impl Counted {
    fn skip(&mut self, n: i64) -> Option<()> {
        self.r.seek_relative(n).ok()?;
        self.at = self.at.checked_add_signed(n)?;
        Some(())
    }
}

fn u32_le(r: &mut impl Read) -> Option<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b).ok()?;
    Some(u32::from_le_bytes(b))
}

fn u64_le(r: &mut impl Read) -> Option<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

/// Strings longer than this are a damaged header.
const MAX_STRING: u64 = 1 << 24;

fn read_string(r: &mut impl Read) -> Option<String> {
    let n = u64_le(r)?;
    if n > MAX_STRING {
        return None;
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b).ok()?;
    Some(String::from_utf8_lossy(&b).into_owned())
}

fn skip_string(r: &mut Counted) -> Option<()> {
    let n = u64_le(r)?;
    if n > MAX_STRING {
        return None;
    }
    r.skip(n as i64)
}

/// Skips one metadata value of GGUF type `ty` (arrays nest at most a few levels).
fn skip_value(r: &mut Counted, ty: u32, depth: u32) -> Option<()> {
    let size = match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => return skip_string(r),
        9 if depth < 4 => {
            let elem = u32_le(r)?;
            let count = u64_le(r)?;
            if count > 1 << 28 {
                return None;
            }
            return match elem {
                8 | 9 => (0..count).try_for_each(|_| skip_value(r, elem, depth + 1)),
                _ => {
                    let one: i64 = match elem {
                        0 | 1 | 7 => 1,
                        2 | 3 => 2,
                        4..=6 => 4,
                        10..=12 => 8,
                        _ => return None,
                    };
                    r.skip(one.checked_mul(count as i64)?)
                }
            };
        }
        _ => return None,
    };
    r.skip(size)
}
