//! Measuring what the KV cache buys and costs: prefill and decode speed, KV bytes and RSS of
//! one cache mode at one context length (`measure_cell`), and a typical chat turn cached against
//! recomputed (`chat_turn`), over a real text (assets/bench-text.txt, built in); the report as a
//! table and as an SVG plot.

use crate::engine::Engine;
use crate::kv::CacheSpec;
use crate::session::argmax;
use anyhow::Result;
use std::time::{Duration, Instant};

/// The bundled benchmark text: the Apache-2.0 license (the project's own), real English prose.
pub const BENCH_TEXT: &str = include_str!("../../assets/bench-text.txt");

/// Median and spread of a measure over the measured runs.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(xs: &[f64]) -> Self {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n == 0 {
            f64::NAN
        } else if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Self {
            median,
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// One (mode, context) cell. JSON keys are stable.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    pub mode: String,
    pub context: usize,
    pub prefill_tok_s: Spread,
    pub decode_ms_per_token: Spread,
    /// Tokens decoded in each measured run (fewer than --gen when capped).
    pub decode_tokens: usize,
    pub runs: usize,
    pub kv_positions: usize,
    pub kv_bytes: usize,
    /// What a cache of the same axes would hold with no layer kept to a declared window (equal to
    /// kv_bytes for models that declare none).
    pub kv_bytes_uniform: usize,
    pub kv_bytes_allocated: usize,
    /// A model with recurrent layers (Qwen3.5): their states and the snapshots kept, beside the
    /// keys and values of `kv_bytes` (0 for other models).
    #[serde(default)]
    pub state_bytes: usize,
    /// The same, by kind (`kv::size::MemoryByKind`), for a model with recurrent layers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_by_kind: Option<crate::kv::size::MemoryByKind>,
    pub rss_bytes: Option<u64>,
    /// The cell hit its time budget.
    pub capped: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatTurn {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub cached_mode: String,
    pub cached_s: f64,
    pub no_cache_s: f64,
    pub speedup: f64,
    /// How the no-cache figure was obtained.
    pub no_cache_method: String,
}

/// Speculative decoding by prompt lookup against plain decoding, on a text the answer copies and
/// on one it does not (`draft_summary`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct DraftSummary {
    pub mode: String,
    pub max: usize,
    pub generated_tokens: usize,
    /// (plain tok/s, drafted tok/s, guesses kept in percent, tokens a forward), per text.
    pub copy: DraftFigures,
    pub novel: DraftFigures,
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct DraftFigures {
    pub plain_tok_s: f64,
    pub drafted_tok_s: f64,
    pub speedup: f64,
    pub kept_pct: f64,
    pub tokens_per_forward: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub model: String,
    pub threads: usize,
    pub gen: usize,
    pub repeat: usize,
    pub cells: Vec<Cell>,
    pub chat_turn: Option<ChatTurn>,
    /// With `--draft ngram`: drafting against plain decoding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftSummary>,
    pub peak_rss_bytes: Option<u64>,
}

/// The first `n` tokens of the bench text, repeated as needed.
pub fn bench_tokens(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    let ids = engine.tokenizer().encode(BENCH_TEXT)?;
    let mut out = Vec::with_capacity(n);
    out.extend(
        engine
            .tokenizer()
            .add_bos
            .then_some(engine.tokenizer().bos_id)
            .flatten(),
    );
    out.extend(ids.iter().copied().cycle().take(n - out.len()));
    Ok(out)
}

/// Resident and peak memory of this process (Linux), in bytes.
pub fn rss() -> (Option<u64>, Option<u64>) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

struct Run {
    prefill: Duration,
    steps: Vec<Duration>,
    kv_positions: usize,
    kv_bytes: usize,
    kv_bytes_uniform: usize,
    kv_bytes_allocated: usize,
    state_bytes: usize,
    memory_by_kind: Option<crate::kv::size::MemoryByKind>,
}

/// One prefill + decode, stopping early once `deadline` would be passed.
fn one_run(
    engine: &Engine,
    spec: &CacheSpec,
    prompt: &[u32],
    gen: usize,
    deadline: Instant,
) -> Result<Run> {
    let mut s = engine.session(spec);
    let t0 = Instant::now();
    let mut logits = s.feed(prompt)?;
    let prefill = t0.elapsed();
    let mut steps = Vec::with_capacity(gen);
    // Expected cost of the next step: a recomputing step is a forward over the whole sequence.
    let mut last = if spec.recomputes() {
        prefill
    } else {
        Duration::ZERO
    };
    for _ in 0..gen {
        if Instant::now() + last > deadline {
            break;
        }
        let next = argmax(&logits.to_vec1::<f32>()?);
        let t = Instant::now();
        logits = s.feed(&[next])?;
        last = t.elapsed();
        steps.push(last);
    }
    Ok(Run {
        prefill,
        steps,
        kv_positions: s.cache().len(),
        kv_bytes: s.cache().bytes_used(),
        kv_bytes_uniform: s.cache().bytes_uniform(&engine.model().cfg) as usize,
        kv_bytes_allocated: s.cache().bytes(),
        state_bytes: s.cache().states().bytes() + s.cache().states().snapshot_bytes(),
        memory_by_kind: s.cache().memory_by_kind(&engine.model().cfg),
    })
}

/// How each cell is run: `gen` tokens decoded per run, `warmup` unmeasured runs then `repeat`
/// measured ones; a cell that recomputes (no cache) stops after `budget_s` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Runs {
    pub gen: usize,
    pub repeat: usize,
    pub warmup: usize,
    pub budget_s: f64,
}

/// One cache mode (`spec`, named `mode`) at a context of `ctx` prompt tokens.
pub fn measure_cell(
    engine: &Engine,
    mode: &str,
    spec: &CacheSpec,
    ctx: usize,
    a: &Runs,
) -> Result<Cell> {
    let prompt = bench_tokens(engine, ctx)?;
    let start = Instant::now();
    let budget = if spec.recomputes() {
        a.budget_s
    } else {
        24.0 * 3600.0
    };
    let deadline = start + Duration::from_secs_f64(budget);
    let total = a.warmup + a.repeat;
    let mut runs: Vec<(bool, Run)> = Vec::new(); // (measured, run)
    let mut capped = false;
    for i in 0..total {
        let r = one_run(engine, spec, &prompt, a.gen, deadline)?;
        let short = r.steps.len() < a.gen;
        runs.push((i >= a.warmup, r));
        if short || Instant::now() >= deadline {
            capped = short || i + 1 < total;
            break;
        }
    }
    // The measured runs that decoded; when the budget cut those short, whatever runs decoded.
    let mut used: Vec<&Run> = runs
        .iter()
        .filter(|(m, r)| *m && !r.steps.is_empty())
        .map(|(_, r)| r)
        .collect();
    if used.is_empty() {
        used = runs
            .iter()
            .filter(|(_, r)| !r.steps.is_empty())
            .map(|(_, r)| r)
            .collect();
    }
    if used.is_empty() {
        used = runs.iter().map(|(_, r)| r).collect();
    }
    let prefill: Vec<f64> = used
        .iter()
        .map(|r| ctx as f64 / r.prefill.as_secs_f64())
        .collect();
    let decode: Vec<f64> = used
        .iter()
        .filter(|r| !r.steps.is_empty())
        .map(|r| r.steps.iter().map(|d| d.as_secs_f64()).sum::<f64>() * 1e3 / r.steps.len() as f64)
        .collect();
    let r = used.last().expect("at least one run");
    Ok(Cell {
        mode: mode.to_string(),
        context: ctx,
        prefill_tok_s: Spread::of(&prefill),
        decode_ms_per_token: Spread::of(&decode),
        decode_tokens: r.steps.len(),
        runs: used.len(),
        kv_positions: r.kv_positions,
        kv_bytes: r.kv_bytes,
        kv_bytes_uniform: r.kv_bytes_uniform,
        kv_bytes_allocated: r.kv_bytes_allocated,
        state_bytes: r.state_bytes,
        memory_by_kind: r.memory_by_kind.clone(),
        rss_bytes: rss().0,
        capped,
    })
}

/// A typical chat turn, 512 prompt + 256 generated tokens: measured end to end with `cached`; for
/// no-cache, each of the 256 steps is a forward over the whole sequence, so its total is the sum of
/// forwards over 512..767 tokens, integrated (trapezoid) from forwards measured at 512 and 768.
pub fn chat_turn(engine: &Engine, cached_mode: &str, cached: &CacheSpec) -> Result<ChatTurn> {
    let (p, g) = (512, 256);
    let far = Instant::now() + Duration::from_secs(3600);
    let r = one_run(engine, cached, &bench_tokens(engine, p)?, g, far)?;
    let cached_s = r.prefill.as_secs_f64() + r.steps.iter().map(|d| d.as_secs_f64()).sum::<f64>();
    let forward = |n: usize| -> Result<f64> {
        // The recompute at the cached mode's precision: the same numbers, none of the reuse.
        let mut s = engine.session(&CacheSpec::none(cached.precision()));
        let toks = bench_tokens(engine, n)?;
        let t = Instant::now();
        s.feed(&toks)?;
        Ok(t.elapsed().as_secs_f64())
    };
    let (f0, f1) = (forward(p)?, forward(p + g)?);
    // Prefill (one forward over 512) + 255 recomputing steps over 513..767 tokens.
    let no_cache_s = (0..g)
        .map(|i| f0 + (f1 - f0) * i as f64 / g as f64)
        .sum::<f64>();
    Ok(ChatTurn {
        prompt_tokens: p,
        generated_tokens: g,
        cached_mode: cached_mode.to_string(),
        cached_s,
        no_cache_s,
        speedup: no_cache_s / cached_s,
        no_cache_method: format!(
            "256 forwards over 512..767 tokens, interpolated from measured forwards over 512 ({f0:.2} s) and 768 ({f1:.2} s)"
        ),
    })
}

/// Greedy decoding of `gen` tokens after `prompt`, plain and drafted (plain first, then drafted,
/// then each again; the better of each pair): the decode speeds, the guesses kept, the tokens a
/// forward. The two give the same tokens (checked).
fn draft_figures(
    engine: &Engine,
    spec: &CacheSpec,
    prompt: &[u32],
    gen: usize,
    max: usize,
) -> Result<DraftFigures> {
    let run = |draft: bool| -> Result<(Vec<u32>, crate::session::GenStats)> {
        let mut s = engine.session(spec);
        let logits = s.feed(prompt)?;
        let mut sampler = crate::session::Sampler::new(crate::session::SamplingParams::greedy());
        let mut d = crate::session::draft::Ngram::new(max);
        let drafter = draft.then_some(&mut d as &mut dyn crate::session::draft::Drafter);
        let (out, _, stats) =
            s.decode_drafted(logits, &mut sampler, gen, &[], true, drafter, |_| Ok(true))?;
        Ok((out, stats))
    };
    let (mut plain, mut drafted) = (0f64, 0f64);
    let mut last = None;
    for _ in 0..2 {
        let (a, pa) = run(false)?;
        let (b, pb) = run(true)?;
        if a != b {
            anyhow::bail!("drafted decoding gave other tokens than plain decoding");
        }
        plain = plain.max(pa.decode_tok_s());
        drafted = drafted.max(pb.decode_tok_s());
        last = Some(pb);
    }
    let s = last.expect("two rounds");
    Ok(DraftFigures {
        plain_tok_s: plain,
        drafted_tok_s: drafted,
        speedup: drafted / plain.max(1e-9),
        kept_pct: 100.0 * s.accepted as f64 / s.drafted.max(1) as f64,
        tokens_per_forward: s.decode_steps as f64 / s.forwards.max(1) as f64,
    })
}

/// Drafting by prompt lookup (at most `max` tokens a guess) against plain decoding with `spec`,
/// 128 greedy tokens after two prompts: one whose answer copies (in the model's chat template,
/// "Repeat the following text exactly, word for word:" and 256 tokens of the bench text; without
/// a template, those tokens and then their first 16 again), and one with nothing to copy (a story
/// asked for; without a template, 272 fresh tokens of the text).
pub fn draft_summary(
    engine: &Engine,
    mode: &str,
    spec: &CacheSpec,
    max: usize,
) -> Result<DraftSummary> {
    let gen = 128;
    let text = bench_tokens(engine, 272 + 256)?;
    let (copy, novel) = match engine.chat_template(None) {
        Ok(t) => {
            let doc = engine.tokenizer().decode(&text[..256], true)?;
            let ask = |q: &str| engine.chat_prompt(&t, &[crate::template::Message::new("user", q)]);
            (
                ask(&format!(
                    "Repeat the following text exactly, word for word:\n\n{doc}"
                ))?,
                ask("Write a long story about a dragon who learns to cook.")?,
            )
        }
        Err(_) => {
            let mut copy = text[..256].to_vec();
            copy.extend_from_slice(&text[..16]);
            (copy, text[256..256 + 272].to_vec())
        }
    };
    Ok(DraftSummary {
        mode: mode.to_string(),
        max,
        generated_tokens: gen,
        copy: draft_figures(engine, spec, &copy, gen, max)?,
        novel: draft_figures(engine, spec, &novel, gen, max)?,
    })
}

/// The table a person reads: at most 100 columns for the usual mode names (notes are numbered
/// footnotes under it), byte counts in KiB/MiB. The JSON keeps the exact integers.
pub fn render_table(r: &BenchReport) -> String {
    // The mode column is as wide as the longest name (`window:1024+4+int8+offload`).
    let mw = r
        .cells
        .iter()
        .map(|c| c.mode.len())
        .max()
        .unwrap_or(0)
        .max(4);
    let mut s = format!(
        "{:<mw$} {:>7} {:>9} {:>22} {:>7} {:>11} {:>7}\n",
        "mode", "context", "prefill", "decode ms/tok", "kv pos", "kv mem", "rss"
    );
    s += &format!(
        "{:<mw$} {:>7} {:>9} {:>22} {:>7} {:>11} {:>7}\n",
        "", "", "tok/s", "median [min-max]", "", "", "MiB"
    );
    let mut notes = Vec::new();
    for c in &r.cells {
        let d = c.decode_ms_per_token;
        let decode = if d.median.is_nan() {
            "-".to_string()
        } else {
            // Fewer decimals as the numbers grow, so the column keeps its width.
            let prec = match d.max {
                m if m < 100.0 => 2,
                m if m < 1000.0 => 1,
                _ => 0,
            };
            format!("{:.prec$} [{:.prec$}-{:.prec$}]", d.median, d.min, d.max)
        };
        let mark = if c.capped {
            notes.push(format!(
                "{} @ {}: capped by the time budget: {} of {} tokens decoded, {} run(s)",
                c.mode, c.context, c.decode_tokens, r.gen, c.runs
            ));
            format!(" [{}]", notes.len())
        } else {
            String::new()
        };
        s += &format!(
            "{:<mw$} {:>7} {:>9.1} {:>22} {:>7} {:>11} {:>7}{mark}\n",
            c.mode,
            c.context,
            c.prefill_tok_s.median,
            decode,
            c.kv_positions,
            crate::source::human_bytes(c.kv_bytes as u64),
            c.rss_bytes
                .map_or("-".into(), |b| format!("{:.0}", b as f64 / 1048576.0)),
        );
    }
    for (i, n) in notes.iter().enumerate() {
        s += &format!("[{}] {n}\n", i + 1);
    }
    let saved: Vec<String> = r
        .cells
        .iter()
        .filter(|c| c.kv_bytes_uniform > c.kv_bytes + c.state_bytes)
        .map(|c| match &c.memory_by_kind {
            Some(m) => format!("{} @ {}: {m}", c.mode, c.context),
            None => format!(
                "{} @ {}: {} against {} ({:.2}×)",
                c.mode,
                c.context,
                crate::source::human_bytes(c.kv_bytes as u64),
                crate::source::human_bytes(c.kv_bytes_uniform as u64),
                c.kv_bytes as f64 / c.kv_bytes_uniform as f64
            ),
        })
        .collect();
    if !saved.is_empty() {
        s += match r.cells.iter().any(|c| c.state_bytes > 0) {
            true => "memory by kind:\n",
            false => "kv mem with the model's sliding-window layers kept to their window, against a uniform cache:\n",
        };
        for l in saved {
            s += &format!("  {l}\n");
        }
    }
    if let Some(t) = &r.chat_turn {
        s += &format!(
            "\nchat turn ({} prompt + {} generated tokens): {} {:.2} s vs no-cache {:.2} s,\n  the cache is {:.1}× faster end to end (no-cache: {})\n",
            t.prompt_tokens, t.generated_tokens, t.cached_mode, t.cached_s, t.no_cache_s, t.speedup, t.no_cache_method
        );
    }
    if let Some(d) = &r.draft {
        s += &format!(
            "\ndraft (prompt lookup, at most {} tokens a guess), {} greedy tokens with {}, decode tok/s plain → drafted:\n",
            d.max, d.generated_tokens, d.mode
        );
        for (what, f) in [
            ("a text it copies", &d.copy),
            ("a text it does not", &d.novel),
        ] {
            s += &format!(
                "  {what:<19} {:>7.1} → {:>7.1} ({:.2}×), {:.0} % of guesses kept, {:.2} tokens a forward\n",
                f.plain_tok_s, f.drafted_tok_s, f.speedup, f.kept_pct, f.tokens_per_forward
            );
        }
    }
    s
}

pub fn plot_svg(r: &BenchReport) -> String {
    let mut modes: Vec<&str> = Vec::new();
    for c in &r.cells {
        if !modes.contains(&c.mode.as_str()) {
            modes.push(&c.mode);
        }
    }
    let series: Vec<crate::plot::Series> = modes
        .iter()
        .map(|m| crate::plot::Series {
            name: m.to_string(),
            points: r
                .cells
                .iter()
                .filter(|c| c.mode == *m && !c.decode_ms_per_token.median.is_nan())
                .map(|c| (c.context as f64, c.decode_ms_per_token.median))
                .collect(),
        })
        .collect();
    crate::plot::line_chart_svg(
        &format!(
            "decode cost vs context ({}, {} threads)",
            r.model, r.threads
        ),
        "context (tokens, log scale)",
        "decode ms/token (log scale)",
        &series,
    )
}
