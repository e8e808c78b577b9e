//! Where a located model's files are on disk: one GGUF file, or the files of a Hugging Face layout.

use std::path::{Path, PathBuf};

/// The files of an HF-layout model, wherever they are.
#[derive(Debug, Clone)]
pub struct HfFiles {
    /// What to call it in messages (the directory, or hf:repo).
    pub label: String,
    pub config: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    /// Recommended generation settings (sampling), when the model has them.
    pub generation_config: Option<PathBuf>,
    pub weights: Vec<PathBuf>,
}

/// A model's files on disk, ready to load.
#[derive(Debug, Clone)]
pub enum Location {
    Gguf(PathBuf),
    Safetensors(HfFiles),
}

impl Location {
    pub fn describe(&self) -> String {
        match self {
            Location::Gguf(p) => p.display().to_string(),
            Location::Safetensors(f) => f.label.clone(),
        }
    }

    /// Bytes on disk (the weights; the small JSON files of an HF layout are left out).
    pub fn size(&self) -> u64 {
        let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        match self {
            Location::Gguf(p) => len(p),
            Location::Safetensors(f) => f.weights.iter().map(|p| len(p)).sum(),
        }
    }
}

/// The hyperparameters of a located model, read from its metadata only (no weights loaded).
pub fn config_of(loc: &Location) -> anyhow::Result<super::Config> {
    match loc {
        Location::Gguf(p) => super::gguf::GgufFile::open(p)?.config(),
        Location::Safetensors(f) => Ok(super::safetensors::read_config(&f.config)?.0),
    }
}
