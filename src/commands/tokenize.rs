//! `kvchat tokenize TEXT`: the ids the model sees, as a JSON array.

use crate::model::gguf::GgufFile;
use crate::source::Location;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use std::path::PathBuf;

/// `kvchat tokenize`, resolved.
#[derive(Debug, Clone)]
pub struct TokenizeOptions {
    pub text: String,
    /// The model whose tokenizer to use (None: the default).
    pub model: Option<String>,
    pub models_file: Option<PathBuf>,
    /// A tokenizer.json instead of the model's.
    pub tokenizer: Option<PathBuf>,
}

pub fn run(args: TokenizeOptions) -> Result<()> {
    let tokenizer = match (&args.tokenizer, &args.model) {
        (Some(tj), None) => Tokenizer::from_file(tj, None)?,
        _ => match crate::source::resolve(args.model.as_deref(), args.models_file.as_deref())? {
            Location::Gguf(path) => {
                // Only the metadata is read: no weights are loaded to tokenize.
                let gguf = GgufFile::open(&path)?;
                let tk = Tokenizer::from_gguf(&gguf.content)
                    .with_context(|| format!("tokenizer of {}", path.display()))?;
                match &args.tokenizer {
                    Some(tj) => Tokenizer::from_file(tj, Some(&tk))?,
                    None => tk,
                }
            }
            Location::Safetensors(files) => {
                let tj = args
                    .tokenizer
                    .as_ref()
                    .or(files.tokenizer.as_ref())
                    .ok_or_else(|| {
                        crate::fixable(
                            crate::Fix::Tokenizer,
                            format!("{} has no tokenizer.json", files.label),
                        )
                    })?;
                Tokenizer::from_hf(tj, files.tokenizer_config.as_deref())?.0
            }
        },
    };
    let ids = tokenizer.encode(&args.text)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
