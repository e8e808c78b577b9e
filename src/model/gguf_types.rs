//! The weight types a GGUF file may hold, by ggml's ids, and which of them kvchat runs. candle's
//! reader refuses a type it does not know with a bare "unknown dtype"; [`unsupported_tensor`] reads
//! the header's tensor list itself (bounded, hostile input) to name the tensor and its type instead.

use super::kernels::quant::WEIGHT_TYPES;
use std::io::{BufRead, BufReader, Read, Seek};
use std::path::Path;

/// The names of ggml's types (`ggml_type`) that kvchat does not run, by id, so that a file holding
/// one is refused naming it (the types it runs are named by `WEIGHT_TYPES`).
const NAMES: &[(u32, &str)] = &[
    (9, "Q8_1"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

/// Whether kvchat runs weight type `id`: the quantized-matmul driver's table
/// (`kernels::quant::WEIGHT_TYPES`; candle's reader and QMatMul know each of them too).
fn supported(id: u32) -> bool {
    WEIGHT_TYPES.iter().any(|(i, ..)| *i == id)
}

/// A type's name, or "type N (unknown to kvchat)".
pub fn type_name(id: u32) -> String {
    let run = WEIGHT_TYPES.iter().map(|(i, n, _)| (*i, *n));
    run.chain(NAMES.iter().copied())
        .find(|(i, _)| *i == id)
        .map_or_else(
            || format!("type {id} (unknown to kvchat)"),
            |(_, n)| format!("type {n}"),
        )
}

/// The first tensor of the GGUF at `path` whose type kvchat cannot run, as a one-line reason; None
/// when every tensor's type is supported or the header cannot be read this far (the caller then
/// reports the file as unreadable).
pub fn unsupported_tensor(path: &Path) -> Option<String> {
    let mut r = BufReader::new(std::fs::File::open(path).ok()?);
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
    for _ in 0..n_tensors {
        let name = read_string(&mut r)?;
        let n_dims = u32_le(&mut r)?;
        if n_dims > 8 {
            return None;
        }
        for _ in 0..n_dims {
            u64_le(&mut r)?;
        }
        let ty = u32_le(&mut r)?;
        u64_le(&mut r)?; // offset
        if !supported(ty) {
            // Float types first, then the quantized ones by id.
            let mut types: Vec<(u32, &str)> =
                WEIGHT_TYPES.iter().map(|(i, n, _)| (*i, *n)).collect();
            types.sort_by_key(|&(i, n)| (!n.starts_with(['F', 'B']), i));
            let names: Vec<&str> = types.iter().map(|(_, n)| *n).collect();
            return Some(format!(
                "tensor {name} has {}, which kvchat cannot run yet; supported: {}",
                type_name(ty),
                names.join(", ")
            ));
        }
    }
    None
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

fn skip_string<R: BufRead + Seek>(r: &mut R) -> Option<()> {
    let n = u64_le(r)?;
    if n > MAX_STRING {
        return None;
    }
    r.seek_relative(n as i64).ok()
}

/// Skips one metadata value of GGUF type `ty` (arrays nest at most a few levels).
fn skip_value<R: BufRead + Seek>(r: &mut R, ty: u32, depth: u32) -> Option<()> {
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
                    r.seek_relative(one.checked_mul(count as i64)?).ok()
                }
            };
        }
        _ => return None,
    };
    r.seek_relative(size).ok()
}
