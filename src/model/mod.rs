//! Loading a model: hyperparameters, weights and the decoder built on them.

pub mod arch;
pub mod cache;
pub mod config;
pub mod decoder;
pub mod deltanet;
pub mod export;
pub mod files;
pub mod gguf;
pub mod gguf_types;
pub mod kernels;
pub mod layers;
pub mod moe;
pub mod rope;
pub mod safetensors;
pub mod sampling;

pub use config::Config;
pub use decoder::{Decoder, Logits};
