//! CPU kernels: the fused causal attention (f32 and INT8 keys/values) and the Q4_1 matrix kernel.
//! Parallel writes to shared output go through [`disjoint::DisjointOut`], the one place that holds
//! that `unsafe`; SIMD code sits in its own file per format (`q4_1_avx2.rs`), each path tested against
//! its scalar reference.

pub mod attention;
pub mod disjoint;
pub mod q4_1;
#[cfg(target_arch = "x86_64")]
mod q4_1_avx2;
