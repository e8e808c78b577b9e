//! A question set answered at a model's own sampling: how often is its first answer right?
//! Each question is one user message in the model's chat template (no system message, as
//! `kvchat run` sends it), answered once per seed at the sampling `kvchat run --seed S` would use,
//! so a quiz answer for seed S is the answer `kvchat run --seed S "QUESTION"` prints. The set is a
//! file of tab-separated lines (`assets/questions.tsv` is the repository's); an answer is right
//! when it holds an accepted answer and no rejected one, compared without case on word
//! boundaries.

use crate::engine::Engine;
use crate::kv::CacheSpec;
use crate::model::sampling::SamplingPrefs;
use crate::session::Sampler;
use crate::template::{ChatTemplate, Message};
use anyhow::{bail, Result};

/// The repository's question set, compiled in: `kvchat quiz` without a file asks these.
pub const BUILTIN_QUESTIONS: &str = include_str!("../../assets/questions.tsv");

/// The most questions a set may hold, and the longest line: a set is a hand-written file.
const MAX_QUESTIONS: usize = 10_000;
const MAX_LINE_BYTES: usize = 4096;

/// One question and how its answers are judged.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Question {
    /// What kind of skill it asks for (fact, arithmetic, instruction, code, reasoning, …).
    pub kind: String,
    pub text: String,
    /// Any of these in the answer makes it right…
    pub accept: Vec<String>,
    /// …unless one of these is there too.
    pub reject: Vec<String>,
}

impl Question {
    /// Whether `answer` holds an accepted answer and no rejected one.
    pub fn judge(&self, answer: &str) -> bool {
        let answer = answer.to_lowercase();
        let holds = |w: &String| contains_word(&answer, &w.to_lowercase());
        self.accept.iter().any(holds) && !self.reject.iter().any(holds)
    }
}

/// Whether `needle` occurs in `hay` with no letter or digit touching it on either side where the
/// needle itself begins or ends with one ("15" is not in "150"; "s[::-1]" is in "`s[::-1]`").
fn contains_word(hay: &str, needle: &str) -> bool {
    if needle.is_empty() {
        return false;
    }
    // A letter, a digit, or a mark combining with the one before it ("é" as e + U+0301).
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || is_combining(c));
    let starts_word = word(needle.chars().next());
    let ends_word = word(needle.chars().last());
    hay.match_indices(needle).any(|(i, m)| {
        let before = hay[..i].chars().next_back();
        let after = hay[i + m.len()..].chars().next();
        let touches_before = starts_word && word(before);
        let touches_after = ends_word && word(after);
        !(touches_before || touches_after)
    })
}

/// Whether `c` is a combining diacritical mark (the blocks U+0300–036F, U+1AB0–1AFF, U+1DC0–1DFF,
/// U+20D0–20FF, U+FE20–FE2F): part of the letter before it, never a word's edge.
fn is_combining(c: char) -> bool {
    matches!(c as u32, 0x300..=0x36F | 0x1AB0..=0x1AFF | 0x1DC0..=0x1DFF | 0x20D0..=0x20FF | 0xFE20..=0xFE2F)
}

/// Parses a question set: `kind<TAB>question<TAB>accept|accept…<TAB>reject|reject…` (the last
/// field may be empty or absent); blank lines and `#` lines skipped. A malformed line is refused
/// with its number.
pub fn parse_questions(text: &str) -> Result<Vec<Question>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        if line.len() > MAX_LINE_BYTES {
            bail!(
                "line {n}: {} bytes, more than the {MAX_LINE_BYTES} a question line may take",
                line.len()
            );
        }
        let fields: Vec<&str> = line.split('\t').collect();
        if !(3..=4).contains(&fields.len()) {
            bail!(
                "line {n}: {} tab-separated fields; a question line has kind, question, accepted answers and (optionally) rejected ones",
                fields.len()
            );
        }
        let list = |f: &str| -> Vec<String> {
            f.split('|')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(String::from)
                .collect()
        };
        let (kind, question) = (fields[0].trim(), fields[1].trim());
        if kind.is_empty() || kind.contains(char::is_whitespace) {
            bail!("line {n}: the kind must be one word, not '{kind}'");
        }
        if question.is_empty() {
            bail!("line {n}: the question is empty");
        }
        let accept = list(fields[2]);
        if accept.is_empty() {
            bail!("line {n}: no accepted answer (the third field lists them, separated by '|')");
        }
        let reject = fields.get(3).map_or_else(Vec::new, |f| list(f));
        if let Some(both) = accept
            .iter()
            .find(|a| reject.iter().any(|r| r.to_lowercase() == a.to_lowercase()))
        {
            bail!("line {n}: '{both}' is both accepted and rejected");
        }
        out.push(Question {
            kind: kind.to_string(),
            text: question.to_string(),
            accept,
            reject,
        });
        if out.len() > MAX_QUESTIONS {
            bail!("more than {MAX_QUESTIONS} questions");
        }
    }
    if out.is_empty() {
        bail!("no questions (every line is blank or a # comment)");
    }
    Ok(out)
}

/// How a quiz is run.
#[derive(Debug, Clone)]
pub struct QuizPlan {
    /// One answer per seed per question.
    pub seeds: Vec<u64>,
    /// Sampling flags over the model's recommendations (the seed is each of `seeds`).
    pub sampling: SamplingPrefs,
    /// Most tokens per answer.
    pub max_tokens: usize,
}

/// One question's answers, one per seed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QuizItem {
    pub kind: String,
    pub question: String,
    pub right: usize,
    pub asked: usize,
    /// The answers judged wrong, with their seeds.
    pub wrong: Vec<(u64, String)>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct QuizReport {
    pub model: String,
    /// The sampling every answer used (the seed aside), as `--stats` describes it.
    pub sampling: String,
    pub seeds: Vec<u64>,
    pub right: usize,
    pub asked: usize,
    /// Right answers per kind: (kind, right, asked), in the set's order of first appearance.
    pub by_kind: Vec<(String, usize, usize)>,
    pub items: Vec<QuizItem>,
}

impl QuizReport {
    pub fn score(&self) -> f64 {
        self.right as f64 / self.asked.max(1) as f64
    }
}

/// Asks every question once per seed, each answer from a fresh prefill of its prompt: the answer
/// a fresh `kvchat run --seed S -n MAX_TOKENS` gives.
pub fn run_quiz(
    engine: &Engine,
    template: &ChatTemplate,
    spec: &CacheSpec,
    questions: &[Question],
    plan: &QuizPlan,
    tick: &mut dyn FnMut(&QuizItem),
) -> Result<QuizReport> {
    if plan.seeds.is_empty() || plan.max_tokens == 0 {
        bail!("a quiz needs at least one seed and one token per answer");
    }
    let mut session = engine.session(spec);
    let mut items = Vec::new();
    let mut described = String::new();
    for q in questions {
        let messages = [Message::new("user", &q.text)];
        let text = template.render(&messages, true)?;
        let ids = engine.encode_rendered(&text, &messages)?;
        if spec.bounded_by_context() && ids.len() + plan.max_tokens > engine.ctx() {
            bail!(
                "the question '{}' ({} tokens) and its answer do not fit the context of {}",
                q.text,
                ids.len(),
                engine.ctx()
            );
        }
        let mut item = QuizItem {
            kind: q.kind.clone(),
            question: q.text.clone(),
            right: 0,
            asked: plan.seeds.len(),
            wrong: Vec::new(),
        };
        for &seed in &plan.seeds {
            // Each answer from a fresh prefill of the prompt: truncating back to it would read a
            // quantized cache's last positions from its rows where a fresh run reads its f16
            // residual, and a window or budget cannot go back at all.
            session.reset()?;
            let logits = session.feed(&ids)?;
            let prefs = SamplingPrefs {
                seed: Some(seed),
                ..plan.sampling.clone()
            };
            let resolved = engine.sampling_for(&prefs);
            described = resolved.describe();
            let mut sampler = Sampler::new(resolved.params);
            let (out, _, _) = session.decode(
                logits,
                &mut sampler,
                plan.max_tokens,
                engine.stop_ids(),
                false,
                |_| Ok(true),
            )?;
            let answer = engine.tokenizer().decode(&out, true)?;
            if q.judge(&answer) {
                item.right += 1;
            } else {
                item.wrong.push((seed, answer));
            }
        }
        tick(&item);
        items.push(item);
    }
    let mut by_kind: Vec<(String, usize, usize)> = Vec::new();
    for it in &items {
        match by_kind.iter_mut().find(|(k, _, _)| *k == it.kind) {
            Some(k) => {
                k.1 += it.right;
                k.2 += it.asked;
            }
            None => by_kind.push((it.kind.clone(), it.right, it.asked)),
        }
    }
    Ok(QuizReport {
        model: engine
            .path()
            .file_name()
            .map_or("model".into(), |f| f.to_string_lossy().into_owned()),
        sampling: described,
        seeds: plan.seeds.clone(),
        right: items.iter().map(|i| i.right).sum(),
        asked: items.iter().map(|i| i.asked).sum(),
        by_kind,
        items,
    })
}

/// The report as text: the score, per kind, then each question answered wrong at least once.
pub fn render_table(r: &QuizReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let pct = |a: usize, b: usize| 100.0 * a as f64 / b.max(1) as f64;
    let _ = writeln!(s, "model     {}", r.model);
    let _ = writeln!(s, "sampling  {}", r.sampling);
    let _ = writeln!(
        s,
        "score     {}/{} right ({:.1} %) over {} seeds",
        r.right,
        r.asked,
        pct(r.right, r.asked),
        r.seeds.len()
    );
    for (kind, right, asked) in &r.by_kind {
        let _ = writeln!(
            s,
            "  {kind:<12} {right:>4}/{asked:<4} {:5.1} %",
            pct(*right, *asked)
        );
    }
    for it in r.items.iter().filter(|i| i.right < i.asked) {
        let _ = writeln!(s, "{}/{}  {}", it.right, it.asked, it.question);
        if let Some((seed, answer)) = it.wrong.first() {
            let short: String = answer.split_whitespace().collect::<Vec<_>>().join(" ");
            let short: String = short.chars().take(100).collect();
            let _ = writeln!(s, "      seed {seed}: {short}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(accept: &[&str], reject: &[&str]) -> Question {
        Question {
            kind: "fact".into(),
            text: "?".into(),
            accept: accept.iter().map(|s| s.to_string()).collect(),
            reject: reject.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn an_answer_holding_an_accepted_one_is_right_whatever_its_case() {
        assert!(q(&["Paris"], &[]).judge("The capital of France is PARIS."));
    }

    #[test]
    fn a_number_inside_a_longer_number_is_not_the_answer() {
        assert!(!q(&["15"], &[]).judge("It is 150."));
        assert!(q(&["15"], &[]).judge("15 pens"));
        assert!(q(&["100"], &[]).judge("100°C"));
    }

    #[test]
    fn a_word_inside_a_longer_word_is_not_the_answer() {
        assert!(!q(&["def"], &[]).judge("undefined"));
        assert!(q(&["def"], &[]).judge("`def`"));
    }

    #[test]
    fn an_answer_of_punctuation_matches_where_it_stands() {
        assert!(q(&["s[::-1]"], &[]).judge("Use `s[::-1]`."));
        assert!(q(&[".py"], &[]).judge("Python files end in .py"));
    }

    #[test]
    fn a_combining_accent_after_a_word_makes_it_another_word() {
        assert!(!q(&["cafe"], &[]).judge("un cafe\u{301} noir"));
        assert!(q(&["cafe\u{301}"], &[]).judge("un cafe\u{301} noir"));
    }

    #[test]
    fn a_rejected_answer_beside_the_accepted_one_makes_it_wrong() {
        let canberra = q(&["Canberra"], &["Sydney"]);
        assert!(canberra.judge("Canberra."));
        assert!(!canberra.judge("Sydney, or maybe Canberra."));
    }

    #[test]
    fn the_builtin_set_parses_with_at_least_forty_questions_of_five_kinds() {
        let set = parse_questions(BUILTIN_QUESTIONS).unwrap();
        assert!(set.len() >= 40, "{}", set.len());
        let mut kinds: Vec<&str> = set.iter().map(|q| q.kind.as_str()).collect();
        kinds.sort();
        kinds.dedup();
        assert_eq!(
            kinds,
            ["arithmetic", "code", "fact", "instruction", "reasoning"]
        );
        let paris = set
            .iter()
            .find(|q| q.text.contains("capital of France"))
            .unwrap();
        assert_eq!(paris.accept, ["Paris"]);
        assert_eq!(paris.reject, ["Lyon", "Marseille"]);
    }

    #[test]
    fn a_line_with_too_few_fields_is_refused_with_its_number() {
        let e = parse_questions("# c\nfact\tWhat?\tyes\nfact\tno answers here\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 3: 2 tab-separated fields; a question line has kind, question, accepted answers and (optionally) rejected ones"
        );
    }

    #[test]
    fn a_line_without_an_accepted_answer_is_refused() {
        let e = parse_questions("fact\tWhat?\t | \n").unwrap_err();
        assert!(
            e.to_string().starts_with("line 1: no accepted answer"),
            "{e}"
        );
    }

    #[test]
    fn an_answer_both_accepted_and_rejected_is_refused() {
        let e = parse_questions("fact\tWhat?\tyes\tYES\n").unwrap_err();
        assert_eq!(e.to_string(), "line 1: 'yes' is both accepted and rejected");
    }

    #[test]
    fn a_set_of_only_comments_is_refused() {
        assert!(parse_questions("# nothing\n\n").is_err());
    }
}
