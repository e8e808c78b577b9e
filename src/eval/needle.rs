//! Pass-key retrieval ("needle in a haystack"): a 5-digit key hidden at a depth in filler text,
//! then the question; the model answers greedily and the key is found or not. A grid of context
//! lengths × depths, several keys per cell, through any cache: what a cache that forgets (a
//! window, a budget) costs in the one thing a long context is for.
//!
//! The prompt is the passkey test of Mohtashami & Jaggi (2023, "Landmark Attention"), as
//! LongLLaMA and many since use it: an instruction, the filler sentences repeated, the key
//! sentence at the depth, more filler, and the question — one user message in the model's chat
//! template, so an instruct model answers in its own format.

use crate::engine::Engine;
use crate::kv::CacheSpec;

use crate::session::{Sampler, SamplingParams};
use crate::template::{ChatTemplate, Message};
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};

const INSTRUCTION: &str =
    "There is an important piece of information hidden inside a lot of irrelevant text. \
Find it and memorize it. I will quiz you about the important information there.\n\n";
/// The filler sentence, repeated around the key.
pub const FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
const QUESTION: &str = "\n\nWhat is the pass key?";
/// The model's reply to the text when the question comes in the next turn.
const ACK: &str = "I have memorized the important information.";
/// The start of the assistant's answer, given with the prompt (so the next tokens are the key).
const ANSWER_PREFIX: &str = "The pass key is";

/// Tokens an answer may take to state the key.
const ANSWER_TOKENS: usize = 16;

/// The grid to run.
#[derive(Debug, Clone, PartialEq)]
pub struct NeedleGrid {
    /// Prompt lengths in tokens (the whole rendered prompt, within a few tokens).
    pub contexts: Vec<usize>,
    /// Where the key sits, in percent of the filler before it (0 = first, 100 = last).
    pub depths: Vec<u32>,
    /// Keys per cell, each a different 5-digit number.
    pub keys: usize,
    /// Seeds the keys (the same seed, the same keys: modes compare on equal footing).
    pub seed: u64,
    /// The question in a turn of its own after the text (and the model's short reply), fed as
    /// a second forward: a cache that compresses after each prompt has compressed the text
    /// before it knows the question.
    pub ask_later: bool,
}

/// One cell: how many of its keys the answer stated.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NeedleCell {
    pub context: usize,
    pub depth: u32,
    pub found: usize,
    pub keys: usize,
    /// The prompt's length in tokens, as rendered (the last key's).
    pub prompt_tokens: usize,
    /// The answers that missed, as text: (key, answer).
    pub misses: Vec<(u32, String)>,
}

/// The grid's results for one cache.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NeedleReport {
    pub model: String,
    /// The cache, in words (`CacheSpec::describe`).
    pub cache: String,
    /// Whether the question came in a turn of its own ([`NeedleGrid::ask_later`]).
    pub ask_later: bool,
    pub cells: Vec<NeedleCell>,
}

impl NeedleReport {
    pub fn found(&self) -> usize {
        self.cells.iter().map(|c| c.found).sum()
    }
    pub fn keys(&self) -> usize {
        self.cells.iter().map(|c| c.keys).sum()
    }
    /// The grid's contexts (in run order) and depths (ascending).
    fn axes(&self) -> (Vec<usize>, Vec<u32>) {
        let mut contexts: Vec<usize> = self.cells.iter().map(|c| c.context).collect();
        contexts.dedup();
        let mut depths: Vec<u32> = self.cells.iter().map(|c| c.depth).collect();
        depths.sort_unstable();
        depths.dedup();
        (contexts, depths)
    }
}

/// The prompt's user message: the key at `depth` percent of `repeats` filler sentences, then the
/// question.
pub fn haystack(key: u32, depth: u32, repeats: usize) -> String {
    text(key, depth, repeats) + QUESTION
}

/// The instruction and the filler with the key at `depth` percent of `repeats` sentences.
fn text(key: u32, depth: u32, repeats: usize) -> String {
    let before = (repeats * depth.min(100) as usize).div_ceil(100);
    let mut s = String::from(INSTRUCTION);
    for _ in 0..before {
        s += FILLER;
    }
    s += &format!("The pass key is {key}. Remember it. {key} is the pass key. ");
    for _ in before..repeats {
        s += FILLER;
    }
    s
}

/// The prompt's ids: the haystack as the user's message, then the start of the answer.
pub fn prompt_ids(
    engine: &Engine,
    template: &ChatTemplate,
    key: u32,
    depth: u32,
    repeats: usize,
) -> Result<Vec<u32>> {
    Ok(prompt_turns(engine, template, (key, depth, repeats), false)?.0)
}

/// The prompt's ids and where its first forward ends: all of it, or (`ask_later`) the text as a
/// turn of its own, the model's [`ACK`], then the question in the next turn.
pub fn prompt_turns(
    engine: &Engine,
    template: &ChatTemplate,
    (key, depth, repeats): (u32, u32, usize),
    ask_later: bool,
) -> Result<(Vec<u32>, usize)> {
    let m = if ask_later {
        vec![
            Message::new("user", &text(key, depth, repeats)),
            Message::new("assistant", ACK),
            Message::new("user", QUESTION.trim_start()),
        ]
    } else {
        vec![Message::new("user", &haystack(key, depth, repeats))]
    };
    let mut ids = engine.chat_prompt(template, &m)?;
    let split = match engine.message_boundaries(template, &m, &ids).get(1) {
        _ if !ask_later => None,
        Some(&at) => Some(at),
        None => bail!("the chat template does not render the first turn as a prefix of the second, so the question cannot come later"),
    };
    ids.extend(engine.tokenizer().encode_literal(ANSWER_PREFIX)?);
    // One forward (the question in the prompt), or two split after the first turn.
    let split = split.unwrap_or(ids.len());
    Ok((ids, split))
}

/// The most filler sentences whose prompt is at most `tokens` tokens in `template` (found by
/// bisection: a prompt's length grows with its sentences).
fn repeats_for(engine: &Engine, template: &ChatTemplate, tokens: usize) -> Result<usize> {
    let len = |r: usize| -> Result<usize> { Ok(prompt_ids(engine, template, 10000, 50, r)?.len()) };
    let least = len(1)?;
    if tokens < least {
        bail!("a context of {tokens} tokens cannot hold the pass-key prompt ({least} tokens at the least)");
    }
    // Every sentence is at least one token: `tokens` sentences are too many.
    let (mut lo, mut hi) = (1, tokens.max(2));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if len(mid)? <= tokens {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// Runs the grid through `spec`; `tick` is told each cell as it is done.
pub fn run_grid(
    engine: &Engine,
    template: &ChatTemplate,
    spec: &CacheSpec,
    grid: &NeedleGrid,
    tick: &mut dyn FnMut(&NeedleCell),
) -> Result<NeedleReport> {
    if grid.keys == 0 || grid.contexts.is_empty() || grid.depths.is_empty() {
        bail!("a needle grid needs at least one context, one depth and one key");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(grid.seed);
    let mut cells = Vec::new();
    for &context in &grid.contexts {
        let repeats = repeats_for(engine, template, context)?;
        for &depth in &grid.depths {
            let mut cell = NeedleCell {
                context,
                depth,
                found: 0,
                keys: grid.keys,
                prompt_tokens: 0,
                misses: Vec::new(),
            };
            for _ in 0..grid.keys {
                let key: u32 = rng.random_range(10000..100000);
                let (ids, split) =
                    prompt_turns(engine, template, (key, depth, repeats), grid.ask_later)?;
                if spec.bounded_by_context() && ids.len() + ANSWER_TOKENS > engine.ctx() {
                    bail!(
                        "the pass-key prompt of {} tokens and its answer do not fit the context of {}",
                        ids.len(),
                        engine.ctx()
                    );
                }
                cell.prompt_tokens = ids.len();
                let answer = answer(engine, spec, &ids, split)?;
                if answer.contains(&key.to_string()) {
                    cell.found += 1;
                } else {
                    cell.misses.push((key, answer));
                }
            }
            tick(&cell);
            cells.push(cell);
        }
    }
    Ok(NeedleReport {
        model: engine
            .path()
            .file_name()
            .map_or("model".into(), |f| f.to_string_lossy().into_owned()),
        cache: spec.describe(),
        ask_later: grid.ask_later,
        cells,
    })
}

/// The model's greedy answer to `prompt`, fed in two forwards split at `split`, as text.
fn answer(engine: &Engine, spec: &CacheSpec, prompt: &[u32], split: usize) -> Result<String> {
    let mut session = engine.session(spec);
    let logits = if split > 0 && split < prompt.len() {
        session.feed(&prompt[..split])?;
        session.feed(&prompt[split..])?
    } else {
        session.feed(prompt)?
    };
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let (ids, _, _) = session.decode(
        logits,
        &mut sampler,
        ANSWER_TOKENS,
        engine.stop_ids(),
        false,
        |_| Ok(true),
    )?;
    engine.tokenizer().decode(&ids, true)
}

/// The grid as a table: a row per depth, a column per context, "found/keys" in each cell.
pub fn render_table(r: &NeedleReport) -> String {
    let (contexts, depths) = r.axes();
    let mut s = format!(
        "pass-key retrieval{}: {} | cache: {}\n",
        if r.ask_later {
            " (question in the next turn)"
        } else {
            ""
        },
        r.model,
        r.cache
    );
    s += &format!("{:>7}", "depth");
    for c in &contexts {
        s += &format!(" {:>9}", format!("{c} tok"));
    }
    s += "\n";
    for d in &depths {
        s += &format!("{:>6}%", d);
        for c in &contexts {
            let cell = r.cells.iter().find(|x| x.context == *c && x.depth == *d);
            s += &format!(
                " {:>9}",
                cell.map_or("-".into(), |x| format!("{}/{}", x.found, x.keys))
            );
        }
        s += "\n";
    }
    s += &format!("found {} of {} keys\n", r.found(), r.keys());
    s
}

/// The grid as an SVG heat map (depth down, context across; green = every key found).
pub fn heat_map_svg(r: &NeedleReport) -> String {
    let (contexts, depths) = r.axes();
    let (cw, ch, left, top) = (90.0, 28.0, 70.0, 50.0);
    let w = left + cw * contexts.len() as f64 + 20.0;
    let h = top + ch * depths.len() as f64 + 40.0;
    let esc = |t: &str| {
        t.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <text x=\"{left}\" y=\"18\" font-size=\"13\">pass-key retrieval: {}</text>\n\
         <text x=\"{left}\" y=\"34\" fill=\"#555\">{}</text>\n",
        esc(&r.model),
        esc(&r.cache)
    );
    for (j, c) in contexts.iter().enumerate() {
        let x = left + cw * (j as f64 + 0.5);
        s += &format!(
            "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{c} tok</text>\n",
            h - 20.0
        );
    }
    for (i, d) in depths.iter().enumerate() {
        let y = top + ch * i as f64;
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{d}%</text>\n",
            left - 8.0,
            y + ch * 0.65
        );
        for (j, c) in contexts.iter().enumerate() {
            let Some(cell) = r.cells.iter().find(|x| x.context == *c && x.depth == *d) else {
                continue;
            };
            let f = cell.found as f64 / cell.keys.max(1) as f64;
            // Red (none found) to green (all found).
            let (red, green) = ((220.0 * (1.0 - f)) as u8 + 30, (180.0 * f) as u8 + 40);
            let x = left + cw * j as f64;
            s += &format!(
                "<rect x=\"{x}\" y=\"{y}\" width=\"{cw}\" height=\"{ch}\" fill=\"rgb({red},{green},60)\" stroke=\"white\"/>\n\
                 <text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"white\">{}/{}</text>\n",
                x + cw / 2.0,
                y + ch * 0.65,
                cell.found,
                cell.keys
            );
        }
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_sits_at_its_depth_of_the_filler() {
        let at = |depth| {
            let h = haystack(54321, depth, 10);
            let i = h.find("54321").unwrap();
            h[INSTRUCTION.len()..i].matches(FILLER).count()
        };
        assert_eq!((at(0), at(50), at(95), at(100)), (0, 5, 10, 10));
        assert_eq!(haystack(54321, 50, 10).matches("54321").count(), 2);
        assert!(haystack(54321, 50, 10).ends_with(QUESTION));
    }
}
