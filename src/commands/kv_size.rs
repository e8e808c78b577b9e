//! `kvchat kv-size`: the KV cache's memory arithmetic (`eval::kv_size`), as a table or JSON.

use crate::eval::kv_size::{render, report, KvSizeQuery};
use anyhow::Result;

/// `kvchat kv-size`, resolved.
#[derive(Debug, Clone)]
pub struct KvSizeOptions {
    pub query: KvSizeQuery,
    pub json: bool,
}

pub fn run(opts: KvSizeOptions) -> Result<()> {
    let r = report(&opts.query)?;
    if opts.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    print!("{}", render(&r));
    Ok(())
}
