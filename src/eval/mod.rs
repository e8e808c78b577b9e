//! Measurements of a model through a cache: perplexity (`ppl`, llama-perplexity's method) and
//! speed and memory (`bench`), and the cache's memory arithmetic (`kv_size`). The commands `kvchat ppl` and `kvchat bench` print them; tests
//! call them directly.

pub mod bench;
pub mod kv_size;
pub mod logits_file;
pub mod needle;
pub mod ppl;
pub mod quiz;
