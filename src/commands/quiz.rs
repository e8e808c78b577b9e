//! `kvchat quiz`: a question set answered at the model's own sampling over several seeds
//! (`eval::quiz`), as a table and JSON: which model's first answer can be trusted.

use super::{write_report, JsonOut};
use crate::engine::{Engine, LoadOptions};
use crate::eval::quiz::{parse_questions, render_table, run_quiz, QuizPlan, BUILTIN_QUESTIONS};
use crate::kv::CacheMode;
use anyhow::{Context, Result};
use std::path::PathBuf;

/// The largest question-set file read.
const MAX_SET_BYTES: u64 = 4 << 20;

/// `kvchat quiz`, resolved.
#[derive(Debug, Clone)]
pub struct QuizOptions {
    pub load: LoadOptions,
    pub mode: CacheMode,
    /// A chat template instead of the model's own (checked).
    pub chat_template: Option<String>,
    /// A question-set file; None: the built-in set (assets/questions.tsv).
    pub questions: Option<PathBuf>,
    pub plan: QuizPlan,
    pub json: Option<JsonOut>,
}

pub fn run(opts: QuizOptions) -> Result<()> {
    // The set is read and checked before the model loads: a malformed line costs no load.
    let text = match &opts.questions {
        Some(p) => crate::fsx::read_text(p, MAX_SET_BYTES, "the question set")?,
        None => BUILTIN_QUESTIONS.to_string(),
    };
    let questions = parse_questions(&text).with_context(|| match &opts.questions {
        Some(p) => format!("question set {}", p.display()),
        None => "the built-in question set".into(),
    })?;
    let engine = Engine::load(&opts.load)?;
    let spec = engine.cache_spec(&opts.mode, engine.ctx())?;
    let template = engine.chat_template(opts.chat_template.as_deref())?;
    let bar = indicatif::ProgressBar::new(questions.len() as u64)
        .with_finish(indicatif::ProgressFinish::AndClear);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} questions, {elapsed} (ETA {eta}) {msg}",
        )
        .expect("valid template"),
    );
    let mut right = 0;
    let mut asked = 0;
    let report = run_quiz(
        &engine,
        &template,
        &spec,
        &questions,
        &opts.plan,
        &mut |item| {
            right += item.right;
            asked += item.asked;
            bar.inc(1);
            bar.set_message(format!("{right}/{asked} right"));
        },
    )?;
    bar.finish_and_clear();
    write_report(&opts.json, &render_table(&report), &report)
}
