//! A loaded model, ready to run: decoder, tokenizer, chat template, stop tokens and device.

pub mod fit;

use crate::model::gguf::GgufFile;
use crate::model::safetensors::HfCheckpoint;
use crate::model::sampling::SamplingPrefs;
use crate::model::Decoder;
use crate::source::Location;
use crate::template::{ChatTemplate, Message};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;

pub struct Engine {
    path: PathBuf,
    model: Decoder,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// Why the model's own template is not `template`, when it has one that cannot run.
    template_problem: Option<String>,
    /// Ids that end generation: EOS and the template's end-of-turn tokens.
    stop_ids: Vec<u32>,
    /// The most positions a sequence may reach (`--ctx`, or what the memory plan chose).
    ctx: usize,
    /// The KV precision the memory plan (`--fit`) chose in place of the default one.
    fitted_precision: Option<crate::kv::Precision>,
    device: Device,
    /// Identifies the model for saved KV state: sha256 of its GGUF header (metadata and tensor
    /// layout; `GgufFile::digest`).
    digest: String,
    /// How the weights are stored: "quantized" (GGUF) or the dense dtype (safetensors).
    weights: String,
    /// Recommended sampling settings, most important first: the registry entry's ("models.toml"),
    /// then the model file's (GGUF `general.sampling.*` or generation_config.json). Flags go on top
    /// (`Resolved::from_layers`).
    sampling: Vec<(String, SamplingPrefs)>,
    /// What was wrong with the model's recommendations and was set aside (printed by the
    /// commands that sample).
    sampling_notes: Vec<String>,
    /// Number of weights (every tensor's elements).
    params: u64,
    /// What else decides the computed values bit for bit: device, SIMD level, quantized kernels
    /// (part of the prefix store's model identity).
    numerics: String,
    /// The tensors' storage types and how many of each, most common first ("q4_1 ×182, f32 ×61").
    tensor_types: String,
    /// How long opening the model took: reading its header and weights, building the tokenizer
    /// (from an on-disk copy; a download is not counted).
    load_time: std::time::Duration,
    /// Steps run as on a GPU: KV rows as tensors, attention by candle ops (a CUDA/Metal device,
    /// or `--kernels gpu` on the CPU).
    gpu_path: bool,
    /// The vocabulary as the grammar engine reads it, built on the first constrained answer.
    grammars: std::sync::OnceLock<Result<crate::grammar::Grammars, String>>,
}

/// What a loader (GGUF or safetensors) read: the engine's parts that depend on the format.
struct Loaded {
    path: PathBuf,
    model: Decoder,
    tokenizer: Tokenizer,
    /// The model's own chat template, when it has one.
    template_src: Option<String>,
    /// The context and KV precision the run loads with, and what it takes.
    plan: fit::Plan,
    digest: String,
    weights: String,
    /// The model file's sampling recommendations, and where they were read.
    file_sampling: (&'static str, SamplingPrefs),
    sampling_notes: Vec<String>,
    params: u64,
    tensor_types: String,
}

impl Engine {
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
    pub fn model(&self) -> &Decoder {
        &self.model
    }
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// Ids that end generation: EOS and the template's end-of-turn tokens.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }
    /// The model's vocabulary for constrained decoding (its trie is built on first use: ~0.1 s
    /// for a 150k vocabulary). Constrained answers end with the last stop id, the template's end
    /// of turn where it has one.
    pub fn grammars(&self) -> Result<&crate::grammar::Grammars> {
        self.grammars
            .get_or_init(|| {
                let end = *self
                    .stop_ids
                    .last()
                    .ok_or("the model has no end-of-text token")?;
                crate::grammar::Grammars::new(&self.tokenizer, self.model.cfg.vocab, end)
                    .map_err(|e| crate::error_line(&e))
            })
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))
    }
    /// The most positions a sequence may reach.
    pub fn ctx(&self) -> usize {
        self.ctx
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Identifies the model for saved KV state (see the field).
    pub fn digest(&self) -> &str {
        &self.digest
    }
    /// How the weights are stored: "quantized" (GGUF) or the dense dtype.
    pub fn weights(&self) -> &str {
        &self.weights
    }
    /// The model's sampling recommendations, most important first, each with where it was read.
    pub fn sampling(&self) -> &[(String, SamplingPrefs)] {
        &self.sampling
    }
    /// What was wrong with the model's sampling recommendations and was set aside.
    pub fn sampling_notes(&self) -> &[String] {
        &self.sampling_notes
    }
    /// Number of weights.
    pub fn params(&self) -> u64 {
        self.params
    }
    /// What else decides the computed values bit for bit (device, SIMD level, kernels).
    pub fn numerics(&self) -> &str {
        &self.numerics
    }
    /// The tensors' storage types and how many of each.
    pub fn tensor_types(&self) -> &str {
        &self.tensor_types
    }
    /// How long opening the model took.
    pub fn load_time(&self) -> std::time::Duration {
        self.load_time
    }
    /// Steps run as on a GPU (KV rows as tensors, attention by candle ops).
    pub fn gpu_path(&self) -> bool {
        self.gpu_path
    }
}

/// Where to run: what a front end asks for, before the device is opened.
/// (The library's default is the CPU, so that a program or test gets the same bits on every
/// build; the command line's is `auto`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    Cuda(usize),
    Metal(usize),
    /// The best one built in and present: CUDA, then Metal, then the CPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = anyhow::Error;

    /// `cpu`, `cuda[:N]`, `metal[:N]` or `auto`.
    fn from_str(spec: &str) -> Result<Self> {
        let spec = spec.trim().to_ascii_lowercase();
        let (name, ordinal) = match spec.split_once(':') {
            Some((n, o)) => (
                n,
                o.parse::<usize>()
                    .with_context(|| format!("device '{spec}': '{o}' is not a device number"))?,
            ),
            None => (spec.as_str(), 0),
        };
        Ok(match name {
            "cpu" => DeviceChoice::Cpu,
            "cuda" => DeviceChoice::Cuda(ordinal),
            "metal" => DeviceChoice::Metal(ordinal),
            "auto" => DeviceChoice::Auto,
            other => bail!("device '{other}' is not one of cpu, cuda[:N], metal, auto"),
        })
    }
}

impl DeviceChoice {
    /// Opens the device.
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => {
                if !cfg!(feature = "cuda") {
                    return Err(crate::fixable(
                        crate::Fix::BuildWithCuda,
                        "this kvchat was built without CUDA".into(),
                    ));
                }
                open_cuda(n)
            }
            DeviceChoice::Metal(n) => {
                if !cfg!(feature = "metal") {
                    return Err(crate::fixable(
                        crate::Fix::BuildWithMetal,
                        "this kvchat was built without Metal".into(),
                    ));
                }
                Device::new_metal(n).with_context(|| format!("cannot open Metal device {n}"))
            }
            DeviceChoice::Auto => {
                if cfg!(feature = "cuda") {
                    if let Ok(d) = open_cuda(0) {
                        return Ok(d);
                    }
                }
                if cfg!(feature = "metal") {
                    if let Ok(d) = Device::new_metal(0) {
                        return Ok(d);
                    }
                }
                Ok(Device::Cpu)
            }
        }
    }
}

/// Opens CUDA device `n`. A binary built by scripts/build-cuda.sh loads the CUDA libraries at
/// run time (cudarc's `dynamic-loading`): the driver, cuBLAS and cuRAND here, when the device is
/// opened, and cudarc panics where one is missing. That panic becomes an error naming the library,
/// so that `auto` falls back to the CPU and `cuda` says what to install. (A function looked up
/// later, when first called, that a library lacks would still panic: a library of another major
/// version than the one built against.)
fn open_cuda(n: usize) -> Result<Device> {
    match crate::guard::no_panic(|| Device::new_cuda(n)) {
        Ok(opened) => opened.with_context(|| format!("cannot open CUDA device {n}")),
        Err(panic) if panic.starts_with("Unable to dynamically load") => {
            // `Unable to dynamically load the "cublas" shared library - searched for …`
            let lib = panic.split('"').nth(1).unwrap_or("a CUDA");
            Err(crate::fixable(
                crate::Fix::CudaLibraries,
                format!("cannot open CUDA device {n}: lib{lib} was not found"),
            ))
        }
        Err(panic) => bail!("cannot open CUDA device {n}: {}", crate::first_line(&panic)),
    }
}

impl Engine {
    /// Where the KV cache keeps its rows as tensors: the device on the GPU's path, None for host
    /// rows that the CPU's attention kernel reads in place.
    pub fn kv_device(&self) -> Option<&Device> {
        self.gpu_path.then_some(&self.device)
    }
}

/// The device as `--device` names it: `cpu`, `cuda:N`, `metal:N`.
pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The most CPU threads worth starting: more than 4 per core only adds contention.
pub fn max_threads() -> usize {
    4 * std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What to load and how: the library's view of a model's flags, decided once by the front end.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// A registry name, `hf:owner/repo[@rev][:file]`, a GGUF file or an HF-layout directory;
    /// None = the registry's default.
    pub model: Option<String>,
    /// Another registry than the built-in models.toml.
    pub models_file: Option<PathBuf>,
    /// A tokenizer.json instead of the model's own.
    pub tokenizer: Option<PathBuf>,
    pub device: DeviceChoice,
    /// Dense weight dtype (safetensors; for GGUF, dequantize at load). None = f32 / keep quantized.
    pub dtype: Option<DType>,
    /// Context size; None = the model's trained context (lowered to what memory holds).
    pub ctx: Option<usize>,
    /// The memory the run may take in all (weights, KV cache, state); None: the KV cache is
    /// checked against the memory available (`available_memory`).
    pub mem: Option<u64>,
    /// When the run would not fit: narrow the default KV precision, then shorten the context,
    /// until it does (`fit::plan`), instead of refusing.
    pub fit: bool,
    /// The KV precisions the run will use: each must fit the model's heads (checked once its
    /// metadata is read, before the weights load), the widest sizes the context's memory check.
    pub kv_precisions: Vec<crate::kv::Precision>,
    /// Which CPU matmul runs quantized GGUF matrices (ours or candle's, per type).
    pub kernels: crate::model::kernels::quant::Kernels,
}

impl LoadOptions {
    /// A model file or directory, everything else at its default.
    pub fn for_path(path: impl AsRef<std::path::Path>) -> Self {
        Self {
            model: Some(path.as_ref().display().to_string()),
            ..Self::default()
        }
    }
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
    /// What `/show` prints: the model's facts, one per line.
    pub fn facts(&self) -> Vec<(&'static str, String)> {
        let c = &self.model.cfg;
        vec![
            ("model", self.path.display().to_string()),
            ("architecture", c.arch.clone()),
            ("parameters", format!("{:.1}M", self.params as f64 / 1e6)),
            ("weights", self.tensor_types.clone()),
            (
                "shape",
                format!(
                    "{} layers, hidden {}, {} heads ({} KV) of {}, ffn {}, vocab {}",
                    c.n_layer, c.hidden, c.n_head, c.n_kv_head, c.head_dim, c.ffn, c.vocab
                ),
            ),
            (
                "context",
                format!("{} tokens (trained: {})", self.ctx, c.ctx_train),
            ),
            ("device", device_name(&self.device)),
        ]
    }

    /// Finds the model the options name (fetching it if needed), and loads it on their device.
    pub fn load(args: &LoadOptions) -> Result<Self> {
        let device = args.device.open()?;
        let (location, registry) =
            crate::source::resolve_model(args.model.as_deref(), args.models_file.as_deref())?;
        let started = std::time::Instant::now();
        let loaded = match location {
            Location::Gguf(path) => Self::load_gguf(path, args, &device)?,
            Location::Safetensors(files) => Self::load_hf(files, args, &device)?,
        };
        Self::assemble(loaded, device, registry, args, started.elapsed())
    }

    /// The context and KV precision the run loads with (`fit::plan`): the context asked for,
    /// else the model's trained one, checked with the weights, KV cache, RoPE table and state
    /// against the memory limit given, else against the memory available (the trained context
    /// lowered to fit with a note). A precision that cannot hold the model's heads is refused.
    fn plan_memory(
        args: &LoadOptions,
        cfg: &crate::model::Config,
        weights: u64,
    ) -> Result<fit::Plan> {
        use crate::kv::{Precision, DEFAULT_PRECISION};
        if let Some(why) = args
            .kv_precisions
            .iter()
            .find_map(|p| cfg.kv_shapes().find_map(|(_, hd)| p.unfit(hd)))
        {
            return Err(crate::fixable(crate::Fix::KvType, why));
        }
        let per_token = |p: Precision| crate::kv::size::KvDims::model_bytes_per_token(cfg, p);
        let widest = args
            .kv_precisions
            .iter()
            .copied()
            .max_by(|a, b| per_token(*a).total_cmp(&per_token(*b)))
            .unwrap_or(DEFAULT_PRECISION);
        let limit = match args.mem {
            Some(m) => fit::Limit::Given(m),
            None => fit::Limit::Available(available_memory()),
        };
        let plan = fit::plan(cfg, weights, widest, args.ctx, limit, args.fit)?;
        if args.mem.is_some() && !args.fit {
            crate::notes::note(format!(
                "memory: the run takes {}, within {}",
                plan.need,
                crate::human_bytes(args.mem.unwrap_or(0))
            ));
        }
        Ok(plan)
    }

    fn load_gguf(path: PathBuf, args: &LoadOptions, device: &Device) -> Result<Loaded> {
        let mut gguf = GgufFile::open(&path)?;
        gguf.dense = args.dtype;
        gguf.kernels = args.kernels;
        let cfg = gguf.config()?;
        let file_bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        let plan = Self::plan_memory(args, &cfg, file_bytes)?;
        let model = gguf.load_decoder_with(cfg, device, plan.need.ctx)?;
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
        let mut notes = Vec::new();
        let file_sampling = SamplingPrefs::from_gguf(&gguf.content.metadata, &mut notes);
        let infos = gguf.content.tensor_infos.values();
        let params = infos.clone().map(|t| t.shape.elem_count() as u64).sum();
        let names = gguf.content.tensor_infos.keys();
        let tensor_types = crate::tally(names.map(|n| {
            let ty = gguf.tensor_type(n).map(|t| t.name());
            ty.unwrap_or_default().to_lowercase()
        }));
        let mut digest = gguf.digest()?;
        let weights = match gguf.dense {
            Some(d) => {
                // Other numerics, other KV state: a prompt cache of the quantized run does not apply.
                digest = format!("{digest}+{d:?}");
                format!("{d:?} (dequantized at load)").to_lowercase()
            }
            None => "quantized".to_string(),
        };
        Ok(Loaded {
            path,
            model,
            tokenizer,
            template_src,
            plan,
            digest,
            weights,
            file_sampling: ("GGUF general.sampling", file_sampling),
            sampling_notes: notes,
            params,
            tensor_types,
        })
    }

    fn load_hf(
        files: crate::source::HfFiles,
        args: &LoadOptions,
        device: &Device,
    ) -> Result<Loaded> {
        let dtype = args.dtype.unwrap_or(DType::F32);
        let ckpt = HfCheckpoint::open(&files)?;
        let file_bytes = files
            .weights
            .iter()
            .map(|w| std::fs::metadata(w).map_or(0, |m| m.len()))
            .sum();
        let plan = Self::plan_memory(args, &ckpt.cfg, file_bytes)?;
        let model = ckpt.load_decoder(device, dtype, plan.need.ctx)?;
        let (tokenizer, template_src) = match (&args.tokenizer, &files.tokenizer) {
            (Some(tj), _) | (None, Some(tj)) => {
                Tokenizer::from_hf(tj, files.tokenizer_config.as_deref())?
            }
            (None, None) => {
                return Err(crate::fixable(
                    crate::Fix::Tokenizer,
                    format!("{} has no tokenizer.json", files.label),
                ))
            }
        };
        let digest = ckpt.digest(dtype);
        let (params, tensor_types) = ckpt.tensor_summary();
        let weights = format!("{dtype:?}").to_lowercase();
        let mut notes = Vec::new();
        let file_sampling = match &files.generation_config {
            Some(p) => match crate::read_json(p) {
                Ok(j) => SamplingPrefs::from_generation_config(&j, &mut notes),
                Err(e) => {
                    notes.push(format!(
                        "ignoring generation_config.json: {}",
                        crate::error_line(&e)
                    ));
                    SamplingPrefs::default()
                }
            },
            None => SamplingPrefs::default(),
        };
        Ok(Loaded {
            path: PathBuf::from(&files.label),
            model,
            tokenizer,
            template_src,
            plan,
            digest,
            tensor_types: format!("{tensor_types} in the files, loaded as {weights}"),
            weights,
            file_sampling: ("generation_config.json", file_sampling),
            sampling_notes: notes,
            params,
        })
    }

    /// The engine of what a loader read, on `device`: its chat template and stop tokens, and the
    /// sampling recommendations of the registry (`registry`) over the model file's.
    fn assemble(
        loaded: Loaded,
        device: Device,
        registry: Option<SamplingPrefs>,
        args: &LoadOptions,
        load_time: std::time::Duration,
    ) -> Result<Self> {
        let Loaded {
            path,
            model,
            tokenizer,
            template_src,
            plan,
            digest,
            weights,
            file_sampling,
            sampling_notes,
            params,
            tensor_types,
        } = loaded;
        // A model whose own template cannot run (it does not parse, or trips a limit) still loads:
        // `--chat-template` or a raw prompt can use it, and asking for its template says why not.
        let (template, template_problem) = match template_src {
            Some(src) => {
                match ChatTemplate::new(&src, &tokenizer.bos_text(), &tokenizer.eos_text()) {
                    Ok(t) => (Some(t), None),
                    Err(e) => (
                        None,
                        Some(format!(
                            "the chat template of {}: {}",
                            path.display(),
                            crate::error_line(&e)
                        )),
                    ),
                }
            }
            None => (None, None),
        };
        let stop_ids = stop_ids(&tokenizer, template.as_ref());
        let numerics = format!(
            "device {:?}, simd {:?}, kernels {:?}",
            device.location(),
            crate::model::kernels::quant::level(),
            args.kernels
        );
        let sampling = [("models.toml", registry.unwrap_or_default()), file_sampling]
            .into_iter()
            .filter(|(_, p)| !p.is_empty())
            .map(|(origin, p)| (origin.to_string(), p))
            .collect();
        let gpu_path =
            !device.is_cpu() || args.kernels == crate::model::kernels::quant::Kernels::Gpu;
        Ok(Self {
            digest,
            path,
            model,
            tokenizer,
            template,
            template_problem,
            stop_ids,
            ctx: plan.need.ctx,
            fitted_precision: plan.precision,
            device,
            weights,
            sampling,
            sampling_notes,
            params,
            tensor_types,
            numerics,
            load_time,
            gpu_path,
            grammars: Default::default(),
        })
    }

    /// Refuses `text` (`what`, for the message) when its bytes alone show it is `limit` tokens
    /// or more: checked before it is tokenized, which takes ~180 bytes of memory per byte of text
    /// (n bytes are at least n / the longest token's bytes tokens).
    pub fn refuse_by_bytes(&self, what: &str, text: &str, limit: usize) -> Result<()> {
        let at_least = self.tokenizer.min_tokens(text.len());
        if at_least >= limit {
            let len = crate::tokenizer::Length::AtLeast(at_least, text.len());
            return Err(crate::fixable(
                crate::Fix::RaiseContext,
                format!("{what} is {len}, more than the context of {limit}"),
            ));
        }
        Ok(())
    }

    /// The chat template to use: `--chat-template` (a name or template text) or the model's own.
    pub fn chat_template(&self, override_spec: Option<&str>) -> Result<ChatTemplate> {
        let tk = &self.tokenizer;
        match (override_spec, &self.template) {
            (Some(spec), _) => ChatTemplate::from_spec(spec, &tk.bos_text(), &tk.eos_text()),
            (None, Some(t)) => Ok(t.clone()),
            (None, None) if self.template_problem.is_some() => Err(crate::fixable(
                crate::Fix::ChatTemplate,
                self.template_problem.clone().unwrap_or_default(),
            )),
            (None, None) => Err(crate::fixable(
                crate::Fix::ChatTemplate,
                format!("{} has no chat template", self.path.display()),
            )),
        }
    }

    /// The cache `mode` for this model at a context of `ctx`: a budget given in bytes becomes
    /// positions of this model's rows (`CacheMode::for_model`), then the context is checked.
    pub fn cache_spec(
        &self,
        mode: &crate::kv::CacheMode,
        ctx: usize,
    ) -> Result<crate::kv::CacheSpec> {
        // The precision the memory plan chose in place of the default one.
        // Never the recompute baseline (no cache): its rows are rounded as the cache would store
        // them, and it keeps none.
        let mode = match self.fitted_precision {
            Some(p)
                if mode.precision == crate::kv::DEFAULT_PRECISION
                    && mode.retention != crate::kv::Retention::None =>
            {
                crate::kv::CacheMode {
                    precision: p,
                    ..*mode
                }
            }
            _ => *mode,
        };
        mode.for_model(&self.model().cfg)?.spec(ctx)
    }

    /// Token ids of a chat prompt: the conversation rendered by the template, ready for the answer.
    /// Message content is text, never control tokens: a user who types `<|im_start|>system` gets
    /// those characters, not a new system turn.
    pub fn chat_prompt(&self, template: &ChatTemplate, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode_conversation(template, messages, true)
    }

    /// [`Self::chat_prompt`] with the functions the model may call, as the template shows them
    /// (OpenAI's `tools` entries), and variables the request sets for the template (`extra`). The
    /// caller keeps control-token text out of them: only the messages' content is kept literal.
    pub fn chat_prompt_with_tools(
        &self,
        template: &ChatTemplate,
        messages: &[Message],
        tools: &[serde_json::Value],
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>> {
        let text = template.render_full(messages, tools, extra, true)?;
        self.encode_rendered(&text, messages)
    }

    /// The positions of `ids` (`messages` rendered for an answer) where each leading run of
    /// messages ends, where the template renders that run as a prefix of `ids`: where prompts
    /// that share those messages part (the prefix store ends a block there).
    pub fn message_boundaries(
        &self,
        template: &ChatTemplate,
        messages: &[Message],
        ids: &[u32],
    ) -> Vec<usize> {
        (1..messages.len())
            .filter_map(|k| {
                self.encode_conversation(template, &messages[..k], false)
                    .ok()
            })
            .filter(|head| !head.is_empty() && ids.starts_with(head))
            .map(|head| head.len())
            .collect()
    }

    /// Token ids of `messages` rendered by `template` (ending where the assistant speaks when
    /// `add_generation_prompt`); message content never becomes control tokens.
    pub fn encode_conversation(
        &self,
        template: &ChatTemplate,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = template.render(messages, add_generation_prompt)?;
        self.encode_rendered(&text, messages)
    }

    /// Token ids of `text`, which a chat template rendered from `messages`: the messages' content
    /// is found in it and never becomes control tokens.
    pub fn encode_rendered(&self, text: &str, messages: &[Message]) -> Result<Vec<u32>> {
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
                    "the chat template rewrote a {} message that holds control-token text, so it cannot be kept literal; remove the control tokens (or complete raw text)",
                    m.role
                ),
                None => {}
            }
        }
        self.tokenizer.encode_chat(text, &spans)
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

/// Ids that end generation: EOS and the template's end-of-turn tokens, the one a constrained
/// answer ends with last. A Harmony model (gpt-oss) ends its answer with `<|return|>` or a call
/// with `<|call|>`; its `<|end|>` only ends a message (its reasoning) and the answer goes on.
fn stop_ids(tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> Vec<u32> {
    let harmony = template.is_some_and(|t| crate::toolcall::harmony::is_harmony(t.source()));
    let turn_ends = match (harmony, template) {
        (true, _) => vec!["<|call|>", "<|return|>"],
        (false, Some(t)) => t.end_of_turn_tokens(),
        (false, None) => Vec::new(),
    };
    let message_end = tokenizer.token_id("<|end|>").filter(|_| harmony);
    let mut ids: Vec<u32> = tokenizer
        .eos_id
        .filter(|&e| Some(e) != message_end)
        .into_iter()
        .collect();
    for id in turn_ends.iter().filter_map(|t| tokenizer.token_id(t)) {
        if harmony {
            // `<|return|>` last: the token a constrained answer ends with.
            ids.retain(|&i| i != id);
        }
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}
