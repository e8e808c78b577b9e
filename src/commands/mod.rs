//! One file per subcommand.

pub mod bench;
pub mod cache;
pub mod chat;
pub mod kv_size;
pub mod models;
pub mod ppl;
pub mod run;
pub mod tokenize;
