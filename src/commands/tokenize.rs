//! `kvchat tokenize TEXT`: the ids the model sees, as a JSON array.

use crate::cli::default_model_path;
use crate::model::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Text to tokenize (special-token text such as <|im_start|> becomes its one id)
    pub text: String,
    /// GGUF model whose tokenizer to use [default: the default model]
    #[arg(short = 'm', long, env = "KVCHAT_MODEL")]
    pub model: Option<PathBuf>,
    /// tokenizer.json to use instead of the GGUF's metadata
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let tokenizer = match (&args.tokenizer, &args.model) {
        (Some(tj), None) => Tokenizer::from_file(tj, None)?,
        _ => {
            let path = args.model.clone().unwrap_or_else(default_model_path);
            // Only the metadata is read: no weights are loaded to tokenize.
            let gguf = GgufFile::open(&path)?;
            let tk = Tokenizer::from_gguf(&gguf.content)
                .with_context(|| format!("tokenizer of {}", path.display()))?;
            match &args.tokenizer {
                Some(tj) => Tokenizer::from_file(tj, Some(&tk))?,
                None => tk,
            }
        }
    };
    let ids = tokenizer.encode(&args.text)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}
