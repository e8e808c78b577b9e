//! Side-by-side speed of kvchat's decoder and candle-transformers' `quantized_llama` on the same GGUF,
//! interleaved in one process so machine noise hits both alike.
//!
//! Measures decode tok/s after a prompt of 128 and 2048 tokens (64 greedy tokens each), and prefill
//! tok/s for a 512-token prompt. The prompt is real text (assets/bench-text.txt, repeated as needed).
//! Usage: cargo run --release --features bench-candle --example vs_quantized_llama -- [MODEL.gguf] [REPEATS]

use anyhow::Result;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use kvchat::engine::Engine;
use kvchat::engine::LoadOptions;
use kvchat::kv::CacheSpec;
use kvchat::session::argmax;
use std::time::Instant;

const GEN: usize = 64;

fn prompt_of(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/bench-text.txt"
    ))?;
    let ids = engine.tokenizer.encode(&text)?;
    Ok(ids.iter().copied().cycle().take(n).collect())
}

/// (prefill seconds, decode seconds for GEN tokens) with kvchat's full cache.
fn ours(engine: &Engine, prompt: &[u32]) -> Result<(f64, f64)> {
    let mut s = engine.session(&CacheSpec::full(kvchat::kv::Precision::F32, engine.ctx));
    let t0 = Instant::now();
    let mut logits = s.feed(prompt)?;
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..GEN {
        let next = argmax(&logits.to_vec1::<f32>()?);
        logits = s.feed(&[next])?;
    }
    Ok((prefill, t1.elapsed().as_secs_f64()))
}

fn theirs(path: &str, prompt: &[u32]) -> Result<(f64, f64)> {
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut model = ModelWeights::from_gguf(ct, &mut f, &dev)?;
    let t0 = Instant::now();
    let mut logits = model.forward(&Tensor::new(prompt, &dev)?.unsqueeze(0)?, 0)?;
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..GEN {
        let next = argmax(&logits.squeeze(0)?.to_vec1::<f32>()?);
        logits = model.forward(&Tensor::new(&[next], &dev)?.unsqueeze(0)?, prompt.len() + i)?;
    }
    Ok((prefill, t1.elapsed().as_secs_f64()))
}

fn median(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[0], xs[xs.len() - 1])
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| kvchat::source::test_model_path().display().to_string());
    let repeats: usize = args.get(2).map_or(Ok(3), |s| s.parse())?;
    let engine = Engine::load(&LoadOptions {
        ctx: Some(4096),
        ..LoadOptions::for_path(&path)
    })?;
    println!(
        "model {path}, {} threads, {repeats} interleaved repeats, {GEN} decoded tokens per run",
        candle_core::utils::get_num_threads()
    );
    // Warm-up of both paths.
    ours(&engine, &prompt_of(&engine, 16)?)?;
    theirs(&path, &prompt_of(&engine, 16)?)?;
    println!(
        "{:<34} {:>12} {:>12} {:>8}",
        "measure (median [min–max])", "kvchat", "quantized_llama", "ratio"
    );
    for (label, n, decode) in [
        ("decode tok/s @128", 128, true),
        ("decode tok/s @2048", 2048, true),
        ("prefill tok/s, 512-token prompt", 512, false),
    ] {
        let prompt = prompt_of(&engine, n)?;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            let (p, d) = ours(&engine, &prompt)?;
            a.push(if decode { GEN as f64 / d } else { n as f64 / p });
            let (p, d) = theirs(&path, &prompt)?;
            b.push(if decode { GEN as f64 / d } else { n as f64 / p });
        }
        let (ma, la, ha) = median(a);
        let (mb, lb, hb) = median(b);
        println!(
            "{label:<34} {ma:>6.1} [{la:.0}–{ha:.0}] {mb:>6.1} [{lb:.0}–{hb:.0}] {:>7.2}×",
            ma / mb
        );
    }
    Ok(())
}
