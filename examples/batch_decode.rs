//! What decoding several sequences in one step buys (continuous batching's step, issue 39):
//! aggregate decode tok/s of N sequences decoded together (`Session::feed_each`: one pass over the
//! weights for all N, each row attending its own cache) against one sequence decoded alone, the
//! cells alternated in rounds so machine noise hits them alike; and a check that every batched
//! sequence's tokens are the ones it decodes alone.
//!
//! Usage: RAYON_NUM_THREADS=2 cargo run --release --example batch_decode -- MODEL.gguf [TOKENS] [ROUNDS] [N ...]
//! (defaults: 48 tokens, 3 rounds, N = 1 2 4 6 8). Prompts: distinct 100–200-token slices of
//! assets/bench-text.txt, in the model's chat template.

use anyhow::{bail, Context, Result};
use kvchat::engine::{Engine, LoadOptions};
use kvchat::kv::CacheSpec;
use kvchat::session::{argmax, Session};
use kvchat::template::Message;
use std::time::Instant;

/// N prompts of 100–200 tokens, each a different slice of the bench text.
fn prompts(engine: &Engine, n: usize) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/bench-text.txt"
    ))?;
    let words: Vec<&str> = text.split_whitespace().collect();
    let template = engine.chat_template(None)?;
    (0..n)
        .map(|i| {
            let len = 70 + (i * 37) % 80;
            let from = (i * 131) % words.len().saturating_sub(len).max(1);
            let slice = words[from..(from + len).min(words.len())].join(" ");
            let question = format!("Continue this text:\n\n{slice}");
            engine.chat_prompt(&template, &[Message::new("user", &question)])
        })
        .collect()
}

/// Decodes `tokens` greedy tokens of every prompt together; returns (seconds, each one's tokens).
fn together(engine: &Engine, prompts: &[Vec<u32>], tokens: usize) -> Result<(f64, Vec<Vec<u32>>)> {
    let spec = CacheSpec::full(kvchat::kv::DEFAULT_PRECISION, 4096);
    let mut sessions: Vec<Session> = prompts.iter().map(|_| engine.session(&spec)).collect();
    let mut next = Vec::new();
    for (s, p) in sessions.iter_mut().zip(prompts) {
        next.push(argmax(&s.feed(p)?.to_vec1::<f32>()?));
    }
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let t = Instant::now();
    for _ in 0..tokens {
        for (o, &n) in out.iter_mut().zip(&next) {
            o.push(n);
        }
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        let logits = if refs.len() == 1 {
            vec![refs[0].feed(&next[..1])?]
        } else {
            Session::feed_each(&mut refs, &next)?
        };
        next = logits
            .iter()
            .map(|l| Ok(argmax(&l.to_vec1::<f32>()?)))
            .collect::<Result<_>>()?;
    }
    Ok((t.elapsed().as_secs_f64(), out))
}

fn main() {
    // One line for a person, as kvchat's errors are.
    if let Err(e) = run() {
        eprintln!("error: {}", kvchat::error_line(&e));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .context("usage: batch_decode MODEL.gguf [TOKENS] [ROUNDS] [N ...]")?;
    let num = |i: usize, default: usize| -> Result<usize> {
        args.get(i).map_or(Ok(default), |v| {
            v.parse().with_context(|| format!("'{v}' is not a count"))
        })
    };
    let tokens = num(1, 48)?;
    let rounds = num(2, 3)?;
    let mut ns: Vec<usize> = args
        .iter()
        .skip(3)
        .map(|v| v.parse().with_context(|| format!("'{v}' is not a count")))
        .collect::<Result<_>>()?;
    if ns.is_empty() {
        ns = vec![1, 2, 4, 6, 8];
    }
    if tokens == 0 || rounds == 0 || ns.contains(&0) {
        bail!("tokens, rounds and every N must be at least 1");
    }
    let engine = Engine::load(&LoadOptions {
        ctx: Some(4096),
        ..LoadOptions::for_path(model)
    })?;
    let most = *ns.iter().max().expect("at least one N");
    let all = prompts(&engine, most)?;
    println!(
        "{model}: {tokens} greedy tokens a sequence, {} threads, {rounds} rounds; prompts of {}..{} tokens",
        candle_core::utils::get_num_threads(),
        all.iter().map(Vec::len).min().unwrap_or(0),
        all.iter().map(Vec::len).max().unwrap_or(0)
    );
    // Each sequence alone, once: the tokens the batched runs must give.
    let alone: Vec<Vec<u32>> = all
        .iter()
        .map(|p| {
            Ok(together(&engine, std::slice::from_ref(p), tokens)?
                .1
                .remove(0))
        })
        .collect::<Result<_>>()?;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); ns.len()];
    for _ in 0..rounds {
        for (cell, &n) in ns.iter().enumerate() {
            let (secs, out) = together(&engine, &all[..n], tokens)?;
            if out[..] != alone[..n] {
                bail!("{n} sequences decoded together gave other tokens than each alone");
            }
            rates[cell].push((n * tokens) as f64 / secs);
        }
    }
    let median = |xs: &[f64]| {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&rates[0]);
    println!(
        "{:>3}  {:>28}  {:>8}  same tokens as alone",
        "N", "aggregate tok/s", "vs N=1"
    );
    for (cell, &n) in ns.iter().enumerate() {
        let each: Vec<String> = rates[cell].iter().map(|r| format!("{r:.1}")).collect();
        println!(
            "{n:>3}  {:>28}  {:>7.2}x  yes",
            each.join("/"),
            median(&rates[cell]) / base
        );
    }
    Ok(())
}
