//! GGUF bytes written by hand, for files that candle's writer would never produce (a tensor without
//! dimensions, a zero alignment, a header that lies about its counts).
#![allow(dead_code)]

/// One metadata value, as GGUF stores it.
pub enum Val {
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    Str(String),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file: `kvs` as metadata, `tensors` as (name, dims, ggml type id, data).
pub fn gguf_bytes(kvs: &[(&str, Val)], tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_str(&mut out, k);
        match v {
            Val::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Val::I32(x) => {
                out.extend(5u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Val::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Val::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Val::U64(x) => {
                out.extend(10u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        put_str(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += data.len().next_multiple_of(32) as u64;
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    for (_, _, _, data) in tensors {
        out.extend(data);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
    }
    out
}

/// Metadata of a small llama model: every key the config reader needs.
pub fn llama_kvs() -> Vec<(&'static str, Val)> {
    vec![
        ("general.architecture", Val::Str("llama".into())),
        ("llama.block_count", Val::U32(1)),
        ("llama.context_length", Val::U32(64)),
        ("llama.embedding_length", Val::U32(32)),
        ("llama.feed_forward_length", Val::U32(64)),
        ("llama.attention.head_count", Val::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", Val::F32(1e-5)),
    ]
}
