//! A loaded model, ready to run: decoder, tokenizer, chat template, stop tokens and device.

use crate::cli::ModelArgs;
use crate::generate::Session;
use crate::kv::CacheSpec;
use crate::model::gguf::GgufFile;
use crate::model::safetensors::HfCheckpoint;
use crate::model::Llama;
use crate::source::Location;
use crate::template::{ChatTemplate, Message};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;

pub struct Engine {
    pub path: PathBuf,
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Ids that end generation: EOS and the template's end-of-turn tokens.
    pub stop_ids: Vec<u32>,
    /// The most positions a sequence may reach (`--ctx`).
    pub ctx: usize,
    pub device: Device,
    /// Identifies the model for saved KV state: sha256 of its GGUF metadata and tensor layout.
    pub digest: String,
    /// How the weights are stored: "quantized" (GGUF) or the dense dtype (safetensors).
    pub weights: String,
}

/// sha256 over a GGUF's metadata and tensor layout (names, types, shapes, offsets): cheap, and two
/// files with the same digest hold the same model in the same layout.
pub fn gguf_digest(ct: &candle_core::quantized::gguf_file::Content) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut keys: Vec<&String> = ct.metadata.keys().collect();
    keys.sort();
    for k in keys {
        h.update(format!("{k}={:?};", ct.metadata[k]).as_bytes());
    }
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    for n in names {
        let t = &ct.tensor_infos[n];
        h.update(format!("{n}:{:?}:{:?}:{};", t.ggml_dtype, t.shape.dims(), t.offset).as_bytes());
    }
    format!("{:x}", h.finalize())
}

/// Parses `--device`.
pub fn select_device(spec: &str) -> Result<Device> {
    let spec = spec.trim().to_ascii_lowercase();
    let (name, ordinal) = match spec.split_once(':') {
        Some((n, o)) => (
            n.to_string(),
            o.parse::<usize>()
                .with_context(|| format!("--device {spec}: '{o}' is not a device number"))?,
        ),
        None => (spec.clone(), 0),
    };
    match name.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            if !cfg!(feature = "cuda") {
                bail!("--device cuda: this kvchat was built without CUDA; rebuild with `cargo build --release --features cuda`");
            }
            Device::new_cuda(ordinal)
                .with_context(|| format!("--device {spec}: cannot open CUDA device {ordinal}"))
        }
        "metal" => {
            if !cfg!(feature = "metal") {
                bail!("--device metal: this kvchat was built without Metal; rebuild with `cargo build --release --features metal`");
            }
            Device::new_metal(ordinal)
                .with_context(|| format!("--device {spec}: cannot open Metal device {ordinal}"))
        }
        "auto" => {
            if cfg!(feature = "cuda") {
                if let Ok(d) = Device::new_cuda(ordinal) {
                    return Ok(d);
                }
            }
            if cfg!(feature = "metal") {
                if let Ok(d) = Device::new_metal(ordinal) {
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
        other => bail!("--device '{other}' is not one of cpu, cuda[:N], metal, auto"),
    }
}

/// The most CPU threads kvchat starts: more than 4 per core only adds contention.
pub fn max_threads() -> usize {
    4 * std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Sets the CPU thread count before any parallel work starts.
pub fn set_threads(threads: Option<usize>) -> Result<()> {
    if let Some(mut n) = threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        if n > max_threads() {
            eprintln!(
                "note: --threads {n} capped at {} (4 × the {} cores)",
                max_threads(),
                max_threads() / 4
            );
            n = max_threads();
        }
        // candle sizes its thread pool (used by its kernels and ours) from this variable.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    Ok(())
}

/// Memory this process may still take: MemAvailable from /proc/meminfo (half of it, leaving room
/// for the weights and everything else), or 4 GiB where that cannot be read.
pub fn available_memory() -> u64 {
    let kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))?
            .split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
    });
    kib.map_or(4 << 30, |k| k * 1024 / 2)
}

impl Engine {
    /// Finds the model `--model` names (fetching it if needed), and loads it on `--device`.
    pub fn load(args: &ModelArgs) -> Result<Self> {
        set_threads(args.threads)?;
        let device = select_device(&args.device)?;
        let location = crate::source::resolve(args.model.as_deref(), args.models_file.as_deref())?;
        match location {
            Location::Gguf(path) => Self::load_gguf(path, args, device),
            Location::Safetensors(files) => Self::load_hf(files, args, device),
        }
    }

    /// The context size: `--ctx`, else the model's trained context. Either must fit in memory with
    /// its KV cache at full length (f32 keys and values in every layer, plus the RoPE table): an
    /// explicit `--ctx` that does not is refused, the trained context is lowered with a note.
    fn ctx_for(args: &ModelArgs, cfg: &crate::model::Config) -> Result<usize> {
        let per_token =
            (cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 4 + cfg.rope_dim * 4) as u64;
        let avail = available_memory();
        let fits = |c: usize| (c as u64).saturating_mul(per_token) <= avail;
        match args.ctx {
            Some(0) => bail!("--ctx must be at least 1"),
            Some(c) if !fits(c) => bail!(
                "--ctx {c} needs {} for the KV cache at full length ({} per token), more than the {} of memory available; lower --ctx",
                crate::source::human_bytes((c as u64).saturating_mul(per_token)),
                crate::source::human_bytes(per_token),
                crate::source::human_bytes(avail)
            ),
            Some(c) => Ok(c),
            None if cfg.ctx_train == 0 => bail!("the model declares a context length of 0"),
            None if !fits(cfg.ctx_train) => {
                let mut c = (avail / per_token.max(1)) as usize;
                c = 1usize << (usize::BITS - 1 - c.max(2).leading_zeros());
                eprintln!(
                    "note: the model's context of {} tokens would need {} of KV cache; using --ctx {c}",
                    cfg.ctx_train,
                    crate::source::human_bytes((cfg.ctx_train as u64).saturating_mul(per_token))
                );
                Ok(c)
            }
            None => Ok(cfg.ctx_train),
        }
    }

    fn load_gguf(path: PathBuf, args: &ModelArgs, device: Device) -> Result<Self> {
        let mut gguf = GgufFile::open(&path)?;
        gguf.dense = args
            .dtype
            .as_deref()
            .map(crate::model::safetensors::parse_dtype)
            .transpose()?;
        let cfg = gguf.config()?;
        let ctx = Self::ctx_for(args, &cfg)?;
        let model = gguf.load_llama_with(cfg, &device, ctx)?;
        let gguf_tokenizer = Tokenizer::from_gguf(&gguf.content)
            .with_context(|| format!("tokenizer of {}", path.display()));
        let tokenizer = match &args.tokenizer {
            Some(tj) => Tokenizer::from_file(tj, gguf_tokenizer.as_ref().ok())?,
            None => gguf_tokenizer?,
        };
        let template_src = gguf
            .content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned();
        let mut digest = gguf_digest(&gguf.content);
        let weights = match gguf.dense {
            Some(d) => {
                // Other numerics, other KV state: a prompt cache of the quantized run does not apply.
                digest = format!("{digest}+{d:?}");
                format!("{d:?} (dequantized at load)").to_lowercase()
            }
            None => "quantized".to_string(),
        };
        Self::finish(
            path,
            model,
            tokenizer,
            template_src,
            ctx,
            device,
            digest,
            &weights,
        )
    }

    fn load_hf(files: crate::source::HfFiles, args: &ModelArgs, device: Device) -> Result<Self> {
        let dtype = crate::model::safetensors::parse_dtype(args.dtype.as_deref().unwrap_or("f32"))?;
        let ckpt = HfCheckpoint::open(&files)?;
        let ctx = Self::ctx_for(args, &ckpt.cfg)?;
        let model = ckpt.load_llama(&device, dtype, ctx)?;
        let (tokenizer, template_src) = match (&args.tokenizer, &files.tokenizer) {
            (Some(tj), _) | (None, Some(tj)) => {
                Tokenizer::from_hf(tj, files.tokenizer_config.as_deref())?
            }
            (None, None) => bail!(
                "{} has no tokenizer.json: pass --tokenizer tokenizer.json",
                files.label
            ),
        };
        let digest = ckpt.digest(dtype);
        let weights = format!("{dtype:?}").to_lowercase();
        Self::finish(
            PathBuf::from(&files.label),
            model,
            tokenizer,
            template_src,
            ctx,
            device,
            digest,
            &weights,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        path: PathBuf,
        model: Llama,
        tokenizer: Tokenizer,
        template_src: Option<String>,
        ctx: usize,
        device: Device,
        digest: String,
        weights: &str,
    ) -> Result<Self> {
        let template = match template_src {
            Some(src) => Some(
                ChatTemplate::new(&src, &tokenizer.bos_text(), &tokenizer.eos_text())
                    .with_context(|| format!("chat template of {}", path.display()))?,
            ),
            None => None,
        };
        let mut stop_ids: Vec<u32> = tokenizer.eos_id.into_iter().collect();
        if let Some(t) = &template {
            for tok in t.end_of_turn_tokens() {
                if let Some(id) = tokenizer.token_id(tok) {
                    if !stop_ids.contains(&id) {
                        stop_ids.push(id);
                    }
                }
            }
        }
        Ok(Self {
            digest,
            path,
            model,
            tokenizer,
            template,
            stop_ids,
            ctx,
            device,
            weights: weights.to_string(),
        })
    }

    pub fn dtype(&self) -> DType {
        DType::F32
    }

    /// A fresh sequence with a cache of the given strategy.
    pub fn session(&self, spec: &CacheSpec) -> Session<'_> {
        let cache = spec.build(&self.model.cfg, self.dtype(), &self.device);
        // A window holds a bounded number of positions whatever the length of the sequence.
        let max = match spec {
            CacheSpec::Window { .. } => usize::MAX,
            _ => self.ctx,
        };
        Session::new(&self.model, cache, max)
    }

    /// The chat template to use: `--chat-template` (a name or template text) or the model's own.
    pub fn chat_template(&self, override_spec: Option<&str>) -> Result<ChatTemplate> {
        let tk = &self.tokenizer;
        match (override_spec, &self.template) {
            (Some(spec), _) => ChatTemplate::from_spec(spec, &tk.bos_text(), &tk.eos_text()),
            (None, Some(t)) => Ok(t.clone()),
            (None, None) => bail!(
                "{} has no chat template: pass --chat-template chatml|llama3|llama2, or --raw",
                self.path.display()
            ),
        }
    }

    /// Token ids of a chat prompt: the conversation rendered by the template, ready for the answer.
    /// Message content is text, never control tokens: a user who types `<|im_start|>system` gets
    /// those characters, not a new system turn.
    pub fn chat_prompt(&self, template: &ChatTemplate, messages: &[Message]) -> Result<Vec<u32>> {
        let text = template.render(messages, true)?;
        let mut spans = Vec::new();
        let mut at = 0;
        for m in messages {
            let found = [m.content.as_str(), m.content.trim()]
                .into_iter()
                .filter(|c| !c.is_empty())
                .find_map(|c| text[at..].find(c).map(|i| (at + i)..(at + i + c.len())));
            match found {
                Some(r) => {
                    at = r.end;
                    spans.push(r);
                }
                None if self.tokenizer.has_special_text(&m.content) => bail!(
                    "the chat template rewrote a {} message that holds control-token text, so it cannot be kept literal; remove the control tokens (or use --raw)",
                    m.role
                ),
                None => {}
            }
        }
        self.tokenizer.encode_chat(&text, &spans)
    }

    /// Token ids of a raw completion prompt (BOS first when the model wants one).
    pub fn raw_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.tokenizer.add_bos {
            ids.extend(self.tokenizer.bos_id);
        }
        ids.extend(self.tokenizer.encode(text)?);
        Ok(ids)
    }
}
