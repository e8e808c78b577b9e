//! `kvchat cache`: the prefix store's figures, its stored prefixes, and clearing it.

use crate::kv::prefix;
use crate::source::human_bytes;
use anyhow::Result;
use std::path::PathBuf;
use std::time::SystemTime;

/// What `kvchat cache` does.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheTask {
    Stats,
    Ls,
    /// Remove the stored blocks (of the models whose file path contains this, when given).
    Clear(Option<String>),
}

/// `kvchat cache`, resolved.
#[derive(Debug, Clone)]
pub struct CacheOptions {
    pub task: CacheTask,
    /// The prefix store's directory.
    pub root: PathBuf,
}

pub fn run(args: CacheOptions) -> Result<()> {
    let root = args.root;
    if let Ok(m) = std::fs::symlink_metadata(&root) {
        if !m.is_dir() {
            anyhow::bail!(
                "the prefix store {} is {}, not a directory",
                root.display(),
                crate::fsx::kind(&m)
            );
        }
    }
    match args.task {
        CacheTask::Stats => {
            let (t, blocks, bytes) = prefix::stats(&root);
            println!(
                "prefix store {}: {blocks} blocks, {} on disk",
                root.display(),
                human_bytes(bytes)
            );
            println!(
                "lookups {}, hits {}: {} of {} prompt tokens reused (hit rate {:.1} %), {} read",
                t.lookups,
                t.hits,
                t.reused_tokens,
                t.prompt_tokens,
                t.hit_rate(),
                human_bytes(t.bytes_read)
            );
            println!(
                "written {} blocks ({}), evictions {}, damaged blocks removed {}",
                t.blocks_written,
                human_bytes(t.bytes_written),
                t.evictions,
                t.removed_damaged
            );
        }
        CacheTask::Ls => {
            let entries = prefix::list(&root);
            if entries.is_empty() {
                println!("the prefix store {} is empty", root.display());
                return Ok(());
            }
            println!(
                "{:>8}  {:>10}  {:>12}  {:<24}  model",
                "tokens", "size", "last use", "cache"
            );
            for e in entries {
                println!(
                    "{:>8}  {:>10}  {:>12}  {:<24}  {}",
                    e.tokens,
                    human_bytes(e.bytes),
                    ago(e.last_use),
                    e.axes,
                    e.model
                );
            }
            println!("(a prefix's size counts the blocks it shares with others)");
        }
        CacheTask::Clear(model) => {
            let (n, bytes) = prefix::clear(&root, model.as_deref())?;
            match (&model, n) {
                (Some(m), 0) => println!("no stored blocks of a model matching '{m}'"),
                _ => println!("removed {n} blocks ({})", human_bytes(bytes)),
            }
        }
    }
    Ok(())
}

/// How long ago `t` was, in the largest whole unit.
fn ago(t: SystemTime) -> String {
    let s = t.elapsed().map_or(0, |d| d.as_secs());
    match s {
        0..=59 => format!("{s} s ago"),
        60..=3599 => format!("{} min ago", s / 60),
        3600..=86399 => format!("{} h ago", s / 3600),
        _ => format!("{} d ago", s / 86400),
    }
}
