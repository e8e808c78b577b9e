//! `kvchat models list|pull`: the model registry (models.toml) and what of it is on disk.

use crate::source::{self, human_bytes, Registry};
use anyhow::Result;
use std::path::PathBuf;

/// What `kvchat models` does.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelsTask {
    List,
    /// Download a model (None: the registry's default).
    Pull(Option<String>),
}

/// `kvchat models`, resolved.
#[derive(Debug, Clone)]
pub struct ModelsOptions {
    pub task: ModelsTask,
    /// Another registry than the built-in models.toml.
    pub models_file: Option<PathBuf>,
}

pub fn run(args: ModelsOptions) -> Result<()> {
    match args.task {
        ModelsTask::List => list(&Registry::load(args.models_file.as_deref())?),
        ModelsTask::Pull(model) => {
            let loc = source::resolve(model.as_deref(), args.models_file.as_deref())?;
            println!("{}", loc.describe());
            eprintln!("on disk: {}", human_bytes(loc.size()));
            Ok(())
        }
    }
}

fn list(reg: &Registry) -> Result<()> {
    let rows: Vec<[String; 4]> = reg
        .models
        .iter()
        .map(|e| {
            let on_disk = e
                .sources
                .iter()
                .find_map(source::cached)
                .map_or_else(|| "-".to_string(), |l| human_bytes(l.size()));
            let mark = if e.name == reg.default { "*" } else { " " };
            let sources: Vec<String> = e.sources.iter().map(|s| s.to_string()).collect();
            [
                format!("{mark}{}", e.name),
                on_disk,
                sources.join(" | "),
                e.description.clone(),
            ]
        })
        .collect();
    let w0 = rows.iter().map(|r| r[0].len()).max().unwrap_or(0).max(5);
    let w1 = rows.iter().map(|r| r[1].len()).max().unwrap_or(0).max(7);
    println!("{:w0$}  {:>w1$}  DESCRIPTION / SOURCES", " NAME", "ON DISK");
    for r in rows {
        println!("{:w0$}  {:>w1$}  {}", r[0], r[1], r[3]);
        println!("{:w0$}  {:>w1$}    {}", "", "", r[2]);
    }
    println!("(* = default; registry: {})", reg.origin);
    Ok(())
}
