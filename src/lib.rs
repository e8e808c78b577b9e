//! kvchat: run a local LLM over an explicit, swappable KV cache.
//!
//! The binary (`main.rs`) is a thin clap front over these modules.

pub mod cli;
pub mod commands;
pub mod engine;
pub mod eval;
pub mod fsx;
pub mod grammar;
pub mod guard;
pub mod interrupt;
pub mod kv;
pub mod membudget;
pub mod model;
pub mod notes;
pub mod plot;
pub mod reasoning;
pub mod sched;
pub mod session;
pub mod source;
pub mod template;
pub mod tokenizer;
pub mod toolcall;

/// The system allocator, counting the bytes of threads under a memory budget (chat templates:
/// `membudget`). Declared here so that the binary and every test of the library run on it.
#[global_allocator]
static ALLOCATOR: membudget::Counting = membudget::Counting;

/// A JSON file, with errors that name it (config.json, tokenizer_config.json, safetensors indexes).
pub fn read_json(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;
    let text = fsx::read_text(path, fsx::MAX_JSON, "JSON file")?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// What a person can change to avoid an error. Core code names values, never flags; a front end
/// (the CLI's `report`) words the fix in its own terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fix {
    /// A longer context would hold the sequence.
    RaiseContext,
    /// A shorter context would fit in memory.
    LowerContext,
    /// The run does not fit the memory limit given: a narrower KV precision or a shorter
    /// context (each named in the message) would, or letting kvchat choose.
    FitMemory,
    /// The CPU device runs this.
    CpuDevice,
    /// A tokenizer.json must be given.
    Tokenizer,
    /// A chat template must be given (or the raw prompt used).
    ChatTemplate,
    /// Only the full cache can do this yet.
    FullCache,
    /// Another KV precision would fit this model.
    KvType,
    /// A chat that no longer fits: drop turns or grow the context.
    ChatFull,
    /// The prefix store's budget cannot hold what would be stored.
    StoreBudget,
    /// A build with the cuda / metal feature.
    BuildWithCuda,
    BuildWithMetal,
    /// The NVIDIA driver and CUDA 13's cuBLAS/cuRAND libraries, where the loader finds them.
    CudaLibraries,
    /// A window (with its sinks) no wider than the context, or a wider context.
    WindowOverContext,
    /// A KV budget larger than the context.
    BudgetOverContext,
    /// A larger time budget would let a benchmark cell run in full.
    BenchTimeBudget,
    /// A shorter longest context of a measured grid (which sizes the context) would fit in memory.
    LowerLongestContext,
}

/// A front end's words for each [`Fix`] (the CLI's name its flags). A command is given them with
/// its options, to word the errors it reports and goes on from.
pub type Advice = fn(Fix) -> &'static str;

/// The error as one line ([`error_line`]), with `advice`'s words for the fix the library named.
pub fn describe_with(e: &anyhow::Error, advice: Advice) -> String {
    let line = error_line(e);
    let fix = e
        .chain()
        .find_map(|c| c.downcast_ref::<Fixable>())
        .map(|f| f.fix);
    match fix {
        Some(f) => format!("{line} ({})", advice(f)),
        None => line,
    }
}

/// An error that a [`Fix`] would avoid; its text names the values involved.
#[derive(Debug)]
pub struct Fixable {
    pub fix: Fix,
    pub message: String,
}

impl std::fmt::Display for Fixable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Fixable {}

pub fn fixable(fix: Fix, message: String) -> anyhow::Error {
    anyhow::Error::new(Fixable { fix, message })
}

/// An error as one line: its context chain joined by ": ", each part cut to its first line (candle
/// appends a captured backtrace to its messages). The one way kvchat words an error for a person.
pub fn error_line(e: &anyhow::Error) -> String {
    e.chain().map(first_line).collect::<Vec<_>>().join(": ")
}

/// A byte count as people read it ("1.50 MiB").
pub fn human_bytes(n: u64) -> String {
    indicatif::BinaryBytes(n).to_string()
}

/// The longest end of `text` (shorter than `marker`) that `marker` starts with: text held back
/// while it may still become `marker` (a stop text, a tool call's opening, a reasoning marker),
/// never splitting a character.
pub fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && marker
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

/// The first line of an error's text: candle appends a captured backtrace to its messages.
pub fn first_line(e: impl std::fmt::Display) -> String {
    e.to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end()
        .to_string()
}

/// Edit distance (insertions, deletions, substitutions), for "did you mean".
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// "; did you mean 'x'?" for the candidate nearest to `word` (at most 2 edits, or a third of its
/// length for longer names), else "".
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    let limit = (word.chars().count() / 3).max(2);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, c)| format!("; did you mean '{c}'?"))
        .unwrap_or_default()
}

/// "a ×3, b ×1": each distinct name with how often it occurs, most common first.
pub fn tally(names: impl IntoIterator<Item = String>) -> String {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for n in names {
        match counts.iter_mut().find(|(m, _)| *m == n) {
            Some((_, c)) => *c += 1,
            None => counts.push((n, 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    counts
        .iter()
        .map(|(n, c)| format!("{n} ×{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod did_you_mean_tests {
    #[test]
    fn a_near_miss_is_suggested_and_a_stranger_is_not() {
        let names = ["smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b"];
        assert_eq!(
            super::did_you_mean("smollm-135m", names),
            "; did you mean 'smollm2-135m'?"
        );
        assert_eq!(
            super::did_you_mean("qwen2.5-05b", names),
            "; did you mean 'qwen2.5-0.5b'?"
        );
        assert_eq!(super::did_you_mean("gpt-17", names), "");
    }
}
