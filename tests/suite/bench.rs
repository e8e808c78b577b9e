//! `kvchat bench` and `kvchat kv-size`: the arithmetic, the table/JSON, the time budget (on a tiny
//! model, fast), and the measured KV bytes against the prediction (on the real model).

use kvchat::engine::Engine;
use kvchat::engine::LoadOptions;
use kvchat::eval::bench::{measure_cell, render_table, BenchReport, Runs};
use kvchat::eval::kv_size::{report, DimsFrom, KvSizeQuery};
use kvchat::kv::size::KvDims;
use kvchat::kv::CacheMode;
use kvchat::kv::Precision as Storage;

fn kv_size_args(layers: usize, kv_heads: usize, head_dim: usize) -> KvSizeQuery {
    KvSizeQuery {
        dims: DimsFrom::Given(KvDims {
            layers,
            kv_heads,
            head_dim,
        }),
        heads: None,
        precision: Storage::F16,
        ctx: 4096,
        users: 8,
        window: None,
        budget: None,
        residual: 32,
    }
}

#[test]
fn a_budget_of_a_quarter_of_the_context_holds_a_quarter_of_its_bytes() {
    let r = report(&KvSizeQuery {
        budget: Some(1024),
        ..kv_size_args(80, 8, 128)
    })
    .unwrap();
    let row = r
        .modes
        .iter()
        .find(|m| m.mode.starts_with("budget:1024"))
        .unwrap();
    let full = r.modes.iter().find(|m| m.mode == "f16").unwrap();
    assert_eq!(row.bytes_per_context * 4.0, full.bytes_per_context);
    assert_eq!(row.bytes_all_users, 8.0 * row.bytes_per_context);
}

#[test]
fn llama3_70b_f16_holds_320_kib_per_token_and_10_gib_for_8_users() {
    let r = report(&kv_size_args(80, 8, 128)).unwrap();
    let f16 = r.modes.iter().find(|m| m.mode == "f16").unwrap();
    assert_eq!(f16.bytes_per_token, 327_680.0);
    assert_eq!(f16.bytes_per_context, 1.25 * (1u64 << 30) as f64);
    assert_eq!(f16.bytes_all_users, 10.0 * (1u64 << 30) as f64);
    let text = kvchat::eval::kv_size::render(&r);
    assert!(
        text.contains("327,680 bytes (320.00 KiB) per token"),
        "{text}"
    );
    assert!(
        text.contains("1.25 GiB per user at 4096 tokens, 10.00 GiB for 8 user(s)"),
        "{text}"
    );
}

#[test]
fn sixty_four_kv_heads_hold_eight_times_more() {
    let gqa = report(&kv_size_args(80, 8, 128)).unwrap();
    let mha = report(&kv_size_args(80, 64, 128)).unwrap();
    let f16 = |r: &kvchat::eval::kv_size::KvSizeReport| {
        r.modes
            .iter()
            .find(|m| m.mode == "f16")
            .unwrap()
            .bytes_per_token
    };
    assert_eq!(f16(&mha) / f16(&gqa), 8.0);
    let mut with_heads = kv_size_args(80, 8, 128);
    with_heads.heads = Some(64);
    let (_, mha_bytes, saving) = report(&with_heads).unwrap().gqa.unwrap();
    assert_eq!((mha_bytes, saving), (2_621_440.0, 8.0));
}

#[test]
fn int8_costs_at_most_0_27_of_f32_per_token_in_the_formula() {
    let d = KvDims {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
    };
    assert_eq!(d.bytes_per_token(Storage::F32), 46_080.0);
    let r = d.bytes_per_token(Storage::Int8) / d.bytes_per_token(Storage::F32);
    assert!(r <= 0.27, "{r}");
}

fn tiny_engine(name: &str) -> Engine {
    let path = crate::common::tiny::write_tiny_with_tokenizer(name);
    Engine::load(&LoadOptions {
        ctx: Some(512),
        ..LoadOptions::for_path(path)
    })
    .unwrap()
}

/// How the cells below run: 8 tokens decoded, one warm-up run and two measured ones.
fn bench_args(budget_s: f64) -> Runs {
    Runs {
        gen: 8,
        repeat: 2,
        warmup: 1,
        budget_s,
    }
}

fn mode(name: &str) -> CacheMode {
    name.parse().unwrap()
}

#[test]
fn cached_cells_decode_every_token_and_hold_context_plus_gen_minus_one() {
    let e = tiny_engine("cell");
    let spec = mode("full").spec(e.ctx()).unwrap();
    let c = measure_cell(&e, "full", &spec, 40, &bench_args(60.0)).unwrap();
    assert!(!c.capped);
    assert_eq!((c.decode_tokens, c.runs), (8, 2));
    assert_eq!(c.kv_positions, 40 + 8);
    assert!(c.decode_ms_per_token.min <= c.decode_ms_per_token.median);
    assert!(c.decode_ms_per_token.median <= c.decode_ms_per_token.max);
}

#[test]
fn a_cell_over_its_time_budget_stops_early_and_says_so() {
    let e = tiny_engine("budget");
    let spec = mode("none").spec(e.ctx()).unwrap();
    let c = measure_cell(&e, "none", &spec, 200, &bench_args(0.0)).unwrap();
    assert!(c.capped);
    assert!(c.decode_tokens < 8);
    let report = BenchReport {
        model: "tiny".into(),
        threads: 1,
        gen: 8,
        repeat: 2,
        cells: vec![c],
        chat_turn: None,
        draft: None,
        peak_rss_bytes: None,
    };
    let table = render_table(&report);
    // The note is a numbered footnote under the table, not a wide column.
    assert!(table.contains("[1] none @ "), "{table}");
    assert!(table.contains("capped by the time budget"), "{table}");
    let json: serde_json::Value = serde_json::to_value(&report).unwrap();
    assert_eq!(json["cells"][0]["capped"], true);
    assert_eq!(json["cells"][0]["mode"], "none");
    for key in [
        "prefill_tok_s",
        "decode_ms_per_token",
        "decode_tokens",
        "kv_bytes",
        "kv_positions",
        "context",
    ] {
        assert!(json["cells"][0].get(key).is_some(), "missing {key}");
    }
}

#[test]
fn table_has_one_aligned_row_per_cell_and_plot_is_svg() {
    let e = tiny_engine("table");
    let cells = ["full", "window:16+2", "window:16+2+bf16+offload"]
        .iter()
        .map(|m| {
            measure_cell(
                &e,
                m,
                &mode(m).spec(e.ctx()).unwrap(),
                32,
                &bench_args(60.0),
            )
            .unwrap()
        })
        .collect();
    let mut report = BenchReport {
        model: "tiny".into(),
        threads: 1,
        gen: 8,
        repeat: 2,
        cells,
        chat_turn: None,
        draft: None,
        peak_rss_bytes: None,
    };
    // A slow cell (a recompute at long context) with a big cache must not widen its columns.
    let mut slow = report.cells[0].clone();
    slow.decode_ms_per_token = kvchat::eval::bench::Spread {
        median: 1234.5,
        min: 999.9,
        max: 2345.6,
    };
    slow.kv_bytes = 1_048_000_000;
    report.cells.push(slow);
    let table = render_table(&report);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines.len(),
        6,
        "two header lines and a row per cell: {table}"
    );
    assert!(
        lines[2..].iter().all(|l| l.len() == lines[2].len()),
        "rows of different widths: {table}"
    );
    let width = lines[2].find("32").unwrap();
    assert!(
        lines.iter().skip(2).all(|l| l.find("32") == Some(width)),
        "{table}"
    );
    assert!(
        lines.iter().all(|l| l.chars().count() <= 100),
        "wider than 100 columns: {table}"
    );
    assert!(table.contains(" KiB"), "kv bytes are readable: {table}");
    let svg = kvchat::eval::bench::plot_svg(&report);
    assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.contains("window:16+2"));
}

#[test]
fn measured_kv_bytes_equal_kv_size_prediction_on_the_real_model() {
    let e = crate::common::engine();
    let d = KvDims {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
    };
    let args = bench_args(120.0);
    for (name, ctx) in [
        ("full", 300),
        ("int8", 300),
        ("window:64+4", 300),
        ("full", 40),
    ] {
        let spec = mode(name).spec(e.ctx()).unwrap();
        let c = measure_cell(
            e,
            name,
            &spec,
            ctx,
            &Runs {
                repeat: 1,
                warmup: 0,
                ..args
            },
        )
        .unwrap();
        let n = ctx + 8; // the prompt, then 8 decode steps that each feed one token
        let predicted = d.bytes_for_mode(&mode(name), n);
        assert_eq!(c.kv_bytes as f64, predicted, "{name} @ {ctx}");
    }
}

#[test]
fn the_bench_bar_on_a_terminal_has_an_eta_and_covers_the_chat_turn_summary() {
    let model = crate::common::tiny::write_tiny_with_tokenizer("bench-bar");
    let cmd = format!(
        "exec {} bench -m {} --modes full,none --contexts 32,64 --gen 4 --repeat 1",
        env!("CARGO_BIN_EXE_kvchat"),
        model.display()
    );
    let out = std::process::Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("SHELL", "/bin/sh")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("script (util-linux) gives kvchat a pseudo-terminal");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    // Four cells and the summary: five steps.
    assert!(shown.contains("/5 steps"), "{shown}");
    assert!(shown.contains("(ETA "), "{shown}");
    assert!(
        shown.contains("chat turn (512 prompt + 256 generated tokens)"),
        "{shown}"
    );
}

#[test]
fn a_needle_grid_runs_every_cell_at_its_length_and_draws_it() {
    use kvchat::eval::needle::{heat_map_svg, render_table, run_grid, NeedleGrid};
    let e = Engine::load(&LoadOptions {
        ctx: Some(1024),
        ..LoadOptions::for_path(crate::common::tiny::write_tiny_with_tokenizer("needle"))
    })
    .unwrap();
    let template = kvchat::template::ChatTemplate::from_spec("chatml", "", "").unwrap();
    let grid = NeedleGrid {
        contexts: vec![600, 900],
        depths: vec![0, 50, 100],
        keys: 2,
        seed: 1,
        ask_later: false,
    };
    let sentence = e
        .tokenizer()
        .encode_literal(kvchat::eval::needle::FILLER)
        .unwrap()
        .len();
    let mut ticks = 0;
    let r = run_grid(
        &e,
        &template,
        &mode("full").spec(e.ctx()).unwrap(),
        &grid,
        &mut |_| ticks += 1,
    )
    .unwrap();
    assert_eq!((r.cells.len(), ticks, r.keys()), (6, 6, 12));
    for c in &r.cells {
        // The prompt is sized to its context, to within one filler sentence.
        assert!(
            c.prompt_tokens <= c.context && c.prompt_tokens + sentence + 2 > c.context,
            "{} tokens for {}",
            c.prompt_tokens,
            c.context
        );
        assert_eq!(c.found + c.misses.len(), c.keys);
    }
    let table = render_table(&r);
    assert!(
        table.contains("600 tok") && table.contains("900 tok") && table.contains("100%"),
        "{table}"
    );
    assert!(
        table.contains(&format!("found {} of 12 keys", r.found())),
        "{table}"
    );
    let svg = heat_map_svg(&r);
    assert_eq!(svg.matches("<rect").count(), 6);
}

#[test]
fn the_draft_summary_measures_both_texts_and_drafting_changes_no_token() {
    let e = tiny_engine("draft-summary");
    let spec = mode("full").spec(e.ctx()).unwrap();
    // (draft_summary fails if drafted decoding gives another token than plain decoding.)
    let d = kvchat::eval::bench::draft_summary(&e, "full", &spec, 8).unwrap();
    for f in [d.copy, d.novel] {
        assert!(f.plain_tok_s > 0.0 && f.drafted_tok_s > 0.0, "{f:?}");
        assert!(f.tokens_per_forward >= 1.0, "{f:?}");
    }
    assert_eq!((d.max, d.generated_tokens), (8, 128));
}

#[test]
fn a_needle_prompt_is_one_forward_unless_the_question_comes_in_the_next_turn() {
    use kvchat::eval::needle::prompt_turns;
    let e = crate::common::engine();
    let t = e.chat_template(None).unwrap();
    let (ids, split) = prompt_turns(e, &t, (12345, 50, 20), false).unwrap();
    assert_eq!(
        split,
        ids.len(),
        "the question and the answer's start in one forward"
    );
    let (later, split) = prompt_turns(e, &t, (12345, 50, 20), true).unwrap();
    let second = e.tokenizer().decode(&later[split..], false).unwrap();
    assert!(second.contains("What is the pass key?"), "{second}");
    assert!(second.ends_with("The pass key is"), "{second}");
    let first = e.tokenizer().decode(&later[..split], false).unwrap();
    assert!(
        first.contains("12345") && first.contains("I have memorized"),
        "{first}"
    );
}
