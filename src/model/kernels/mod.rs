//! CPU kernels: the fused causal attention (f32 and INT8 keys/values) and the Q4_1 matrix kernel.
//! Parallel writes to shared output go through [`disjoint::DisjointOut`], the one place that holds
//! that `unsafe`; SIMD code sits in its own module per format (`q4_1::avx2`), apart from the driver
//! but in the same file (a separate file measured 5-15% slower in prefill), each path tested against
//! its scalar reference.

pub mod attention;
pub mod kvrows;

pub mod disjoint;
pub mod quant;
