//! CPU kernels: the fused causal attention (f32 and INT8 keys/values), the KV row formats, and the
//! quantized matmuls (`quant`: one driver, one block format per GGUF type, per-row and tiled).
//! Parallel writes to shared output go through [`disjoint::DisjointOut`], the one place that holds
//! that `unsafe`; SIMD code sits in an `avx2`/`vnni` module beside each format's scalar code, each
//! path tested against its scalar reference.

pub mod attention;
pub mod kvrows;

pub mod disjoint;
pub mod glu;
pub mod norm;
pub mod quant;
