//! Each subcommand's flags. The shared groups (model, cache, sampling) are in `options.rs`, with
//! their conversion into library options.

use super::options::{precision_parser, CacheArgs, DraftArgs, ModelArgs, SamplingArgs, StoreArgs};
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The prompt; read from stdin when absent
    pub prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Complete the text as-is, without the chat template; special-token text in it (<|im_start|>)
    /// is parsed as control tokens, whereas a chat message's text never is
    #[arg(long)]
    pub raw: bool,
    /// System message for the chat template
    #[arg(long, conflicts_with = "raw")]
    pub system: Option<String>,
    /// Chat template: a name (chatml, llama3, llama2, gemma), Jinja text or a file, instead of the model's own
    #[arg(long, conflicts_with = "raw")]
    pub chat_template: Option<String>,
    /// Most tokens to generate
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// Keep generating past end-of-text tokens (for benchmarks)
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print prompt/decode speed and KV cache size to stderr
    #[arg(long)]
    pub stats: bool,
    /// After the answer, print each generated token with its logit and the runner-up's (stderr):
    /// how near a tie each pick was, where two devices or caches part
    #[arg(long)]
    pub trace_picks: bool,
    /// Reuse the KV state of an earlier prompt that shares a prefix with this one, from FILE, and save
    /// this prompt's state there
    #[arg(long, value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,
    /// A thinking model's reasoning (<think> … </think>) is not shown; without it, reasoning is
    /// shown dimmed on a terminal and as the model wrote it into a pipe
    #[arg(long)]
    pub hide_reasoning: bool,
    /// The answer is JSON valid under this JSON Schema (a file, or the schema's text): every
    /// token is picked among those the schema allows (docs/structured.md)
    #[arg(long, value_name = "FILE|JSON", conflicts_with_all = ["grammar", "draft"])]
    pub json_schema: Option<String>,
    /// The answer is a sentence of this Lark grammar (llguidance's dialect; `%json {…}` embeds a
    /// schema): docs/structured.md
    #[arg(long, value_name = "FILE", conflicts_with = "draft")]
    pub grammar: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Chat template: a name (chatml, llama3, llama2, gemma), Jinja text or a file, instead of the model's own
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Address to listen on; one that is not loopback needs --api-key
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start)
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences decoding together in one batch (1 to 256)
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// The KV memory all requests share (e.g. 512MiB, 2GiB) [default: a quarter of the memory available]
    #[arg(long, value_name = "SIZE")]
    pub kv_pool: Option<String>,
    /// Requests that may wait for room before the server answers 429
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Require `Authorization: Bearer KEY` on every /v1 request and /metrics
    #[arg(
        long,
        env = "KVCHAT_API_KEY",
        value_name = "KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Most tokens per answer when a request names none
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// Stop serving after this many seconds (for scripts and load tests)
    #[arg(long, value_name = "SECONDS")]
    pub exit_after: Option<f64>,
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// System message
    #[arg(long)]
    pub system: Option<String>,
    /// Chat template: a name (chatml, llama3, llama2, gemma), Jinja text or a file, instead of the model's own
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Most tokens per answer
    #[arg(short = 'n', long = "max-tokens", default_value_t = 1024)]
    pub max_tokens: usize,
    /// After each answer, print what the turn reused, prefilled and how fast (stderr)
    #[arg(long)]
    pub stats: bool,
    /// When the context is full: stop (refuse the turn), shift (drop the oldest whole turns) or
    /// compact (the model summarises the oldest half of the turns into a note kept with the
    /// system message; /compact does it on demand)
    #[arg(long, value_parser = ["stop", "shift", "compact"], default_value = "stop")]
    pub on_full: String,
    /// Load the conversation's KV state from FILE when it matches, and save it there after each turn
    #[arg(long, value_name = "FILE")]
    pub prompt_cache: Option<PathBuf>,
    /// A thinking model's reasoning (<think> … </think>) is not shown; without it, reasoning is
    /// shown dimmed on a terminal and as the model wrote it into a pipe
    #[arg(long)]
    pub hide_reasoning: bool,
    /// History file [default: the platform's data dir, kvchat/history.txt]
    #[arg(long)]
    pub history: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Cache modes: none, full, int8, offload, window:N or window:N+S (S sinks, default 4)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,full,int8,window:256"
    )]
    pub modes: Vec<String>,
    /// Context lengths (prompt tokens before decoding)
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    pub contexts: Vec<usize>,
    /// Tokens decoded per run
    #[arg(long, default_value_t = 32)]
    pub gen: usize,
    /// Measured runs per cell
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Unmeasured runs per cell before the measured ones
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Seconds a no-cache cell may take: it recomputes the whole sequence every step, so at long
    /// context it stops early and the table says so (cached cells always run in full)
    #[arg(long, default_value_t = 60.0)]
    pub budget_s: f64,
    /// Also measure speculative decoding by prompt lookup against plain decoding (`ngram`), on
    /// the first of --modes that keeps a cache (every mode but none)
    #[arg(long, value_name = "ngram")]
    pub draft: Option<String>,
    /// The most tokens one draft guesses (1 to 32)
    #[arg(long, value_name = "K", default_value_t = 16, requires = "draft")]
    pub draft_max: usize,
    /// Skip the chat-turn summary (512 + 256 tokens, cached vs no-cache)
    #[arg(long)]
    pub no_summary: bool,
    /// Write the results as JSON to this file (`-`: to stdout, the table then goes to stderr)
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw decode ms/token against context per mode to this .svg file
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct NeedleArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Chat template: a name (chatml, llama3, llama2, gemma), Jinja text or a file, instead of the model's own
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Prompt lengths in tokens
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    pub contexts: Vec<usize>,
    /// Depths of the key in the filler, in percent (0 = its start, 100 = its end)
    #[arg(long, value_delimiter = ',', default_value = "5,25,50,75,95")]
    pub depths: Vec<u32>,
    /// Keys per cell (each a different 5-digit number)
    #[arg(long, default_value_t = 3)]
    pub keys: usize,
    /// Seed of the keys: the same seed gives every cache the same keys
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Ask in the next turn: the text with the key is one user turn (fed, and so compressed by a
    /// budget, on its own), the question a second one
    #[arg(long)]
    pub ask_later: bool,
    /// Write the results as JSON to this file (`-`: to stdout, the table then goes to stderr)
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the grid as a heat map to this .svg file
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct QuizArgs {
    /// Question set: tab-separated lines of kind, question, accepted answers (`a|b`) and rejected
    /// ones [default: the built-in set, assets/questions.tsv]
    pub questions: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Chat template: a name (chatml, llama3, llama2, gemma), Jinja text or a file, instead of the model's own
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Answer each question once per seed, seeds 1 to N (the answers `kvchat run --seed S -n MAX_TOKENS` gives)
    #[arg(long, default_value_t = 4)]
    pub seeds: u64,
    /// Most tokens per answer
    #[arg(short = 'n', long = "max-tokens", default_value_t = 64)]
    pub max_tokens: usize,
    /// Write the results as JSON to this file (`-`: to stdout, the table then goes to stderr)
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct PplArgs {
    /// Text file to score (none with --kl-divergence: the base file's tokens are scored)
    #[arg(
        required_unless_present = "kl_divergence",
        conflicts_with = "kl_divergence"
    )]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Chunk size in tokens (llama-perplexity's -c)
    #[arg(long = "chunk", default_value_t = 512)]
    pub chunk: usize,
    /// Score at most this many chunks (0 = all)
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
    /// Score the whole text as one sequence (after a warm-up of chunk/2 tokens) instead of chunks
    #[arg(long)]
    pub long: bool,
    /// Also score the text through another cache (a mode name: full+f32, window:256+4, …), in
    /// lockstep, and report the difference with its paired standard error, the KL divergence of
    /// this cache's next-token distributions from that one's, and how often their top tokens agree
    #[arg(long, value_name = "MODE")]
    pub against: Option<String>,
    /// Save every scored token's next-token distribution to FILE, in llama-perplexity's format
    /// (its --kl-divergence-base): another run of either tool compares with it. Never overwrites
    #[arg(
        long = "kl-divergence-base",
        value_name = "FILE",
        conflicts_with = "long"
    )]
    pub kl_divergence_base: Option<PathBuf>,
    /// Score the tokens of the --kl-divergence-base FILE (written by llama-perplexity or kvchat
    /// ppl) in its chunks, and report this run's perplexity against the file's, paired, the KL
    /// divergence from the file's distributions and how often their top tokens agree
    #[arg(
        long = "kl-divergence",
        requires = "kl_divergence_base",
        conflicts_with_all = ["against", "long", "chunk"]
    )]
    pub kl_divergence: bool,
    /// Print {"ppl", "ppl_stderr", "tokens_scored", "chunks", "against"?, "divergence"?} as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct KvSizeArgs {
    /// Model to read the dimensions from, as for `run -m` [default: the default model, unless
    /// dimensions are given]
    #[arg(short = 'm', long, env = "KVCHAT_MODEL")]
    pub model: Option<String>,
    /// Model registry to read instead of the built-in models.toml
    #[arg(long, env = "KVCHAT_MODELS_FILE", value_name = "FILE")]
    pub models_file: Option<PathBuf>,
    /// Decoder layers
    #[arg(long, requires_all = ["kv_heads", "head_dim"])]
    pub layers: Option<usize>,
    /// KV heads per layer
    #[arg(long, requires = "layers")]
    pub kv_heads: Option<usize>,
    /// Size of one head
    #[arg(long, requires = "layers")]
    pub head_dim: Option<usize>,
    /// Query heads per layer: shows what GQA saves over full multi-head attention
    #[arg(long)]
    pub heads: Option<usize>,
    /// The KV precision of the headline figures: f32, f16 (the cache's default), bf16, int8, int4
    /// (as run's --kv-type; --dtype is kept as another name)
    #[arg(long = "kv-type", alias = "dtype", value_name = "TYPE", default_value = "f16", value_parser = precision_parser(false))]
    pub kv_type: crate::kv::Precision,
    /// Context length, in tokens
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Concurrent users (sequences), each with its own cache
    #[arg(long, default_value_t = 1)]
    pub users: usize,
    /// Also show a sliding window of N positions (+ --sinks)
    #[arg(long)]
    pub window: Option<usize>,
    /// Also show a KV budget of N positions per layer (--kv-budget; sinks among them)
    #[arg(long, value_name = "N")]
    pub budget: Option<usize>,
    #[arg(long, default_value_t = 4)]
    pub sinks: usize,
    /// Recent positions a quantized cache also keeps in f16, as --kv-residual
    #[arg(long, default_value_t = 32)]
    pub residual: usize,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Text to tokenize (special-token text such as <|im_start|> becomes its one id)
    pub text: String,
    /// Model whose tokenizer to use, as for `run -m` [default: the default model]
    #[arg(short = 'm', long, env = "KVCHAT_MODEL")]
    pub model: Option<String>,
    /// Model registry to read instead of the built-in models.toml
    #[arg(long, env = "KVCHAT_MODELS_FILE", value_name = "FILE")]
    pub models_file: Option<PathBuf>,
    /// tokenizer.json to use instead of the GGUF's metadata
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ModelsArgs {
    #[command(subcommand)]
    pub action: ModelsAction,
    /// Model registry to read instead of the built-in models.toml
    #[arg(long, global = true, env = "KVCHAT_MODELS_FILE", value_name = "FILE")]
    pub models_file: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum ModelsAction {
    /// The registry's entries: name (* = default), size on disk or "-", sources, description.
    List,
    /// Download a model (a registry name or hf:owner/repo[@rev][:file]) and print where it is.
    Pull {
        /// Registry name or hf:owner/repo[@rev][:file] [default: the registry's default]
        model: Option<String>,
    },
}

#[derive(Args, Debug)]
pub struct CacheCmdArgs {
    #[command(subcommand)]
    pub action: CacheAction,
    /// The prefix store's directory [default: $KVCHAT_HOME/kv-store]
    #[arg(long, global = true, value_name = "DIR", env = "KVCHAT_KV_STORE")]
    pub kv_store_dir: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum CacheAction {
    /// Cumulative figures: lookups, prompt tokens reused (hit rate), bytes read and written,
    /// evictions; and what the store holds now.
    Stats,
    /// The stored prefixes: model, tokens, size, last use (most recent first).
    Ls,
    /// Remove stored blocks: all, or those of the models whose file path contains MODEL.
    Clear {
        #[arg(long, value_name = "MODEL")]
        model: Option<String>,
    },
}
