//! Every `kvchat …` command in the README and docs/ parses with today's flags: a manual that names
//! a flag the binary no longer has fails here, not in a reader's terminal.

use super::Cli;
use clap::Parser;
use std::path::{Path, PathBuf};

/// The shell words of `line` (quotes '…' and "…", backslash escapes outside single quotes),
/// up to a pipe, a redirection, `&&`, `;` or a comment; None for an unclosed quote.
fn words(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next()? {
                        '\'' => break,
                        c => w.push(c),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next()? {
                        '"' => break,
                        '\\' => w.push(chars.next()?),
                        c => w.push(c),
                    }
                }
            }
            '\\' => word.get_or_insert_with(String::new).push(chars.next()?),
            c if c.is_whitespace() => out.extend(word.take()),
            '|' | '>' | '<' | ';' | '&' => break,
            '#' if word.is_none() => break,
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    out.extend(word);
    Some(out)
}

/// The commands of a markdown text's ```sh blocks that run kvchat (`kvchat …`,
/// `scripts/kvchat …`, or kvchat after a pipe), joined over trailing backslashes, with their
/// line numbers.
fn commands(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let (mut in_sh, mut pending): (bool, Option<(usize, String)>) = (false, None);
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if let Some(lang) = trimmed.strip_prefix("```") {
            in_sh = !in_sh && matches!(lang, "sh" | "bash" | "shell");
            continue;
        }
        if !in_sh {
            continue;
        }
        let (start, mut cmd) = pending.take().unwrap_or((n + 1, String::new()));
        cmd.push_str(trimmed.trim_end_matches('\\'));
        cmd.push(' ');
        if trimmed.ends_with('\\') {
            pending = Some((start, cmd));
            continue;
        }
        for part in cmd.split('|') {
            let part = part.trim();
            let rest = part
                .strip_prefix("kvchat ")
                .or_else(|| part.strip_prefix("scripts/kvchat "))
                .or_else(|| part.strip_prefix("target/release/kvchat "));
            if let Some(rest) = rest {
                found.push((start, format!("kvchat {rest}")));
            }
        }
    }
    found
}

fn docs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

#[test]
fn every_kvchat_command_in_the_readme_and_docs_parses() {
    let mut bad = Vec::new();
    let mut checked = 0;
    for file in docs() {
        let text = std::fs::read_to_string(&file).expect("a doc");
        for (line, cmd) in commands(&text) {
            let name = file.file_name().unwrap().to_string_lossy().into_owned();
            let Some(args) = words(&cmd) else {
                bad.push(format!("{name}:{line}: unclosed quote in `{cmd}`"));
                continue;
            };
            checked += 1;
            if let Err(e) = Cli::try_parse_from(&args) {
                if !matches!(
                    e.kind(),
                    clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
                ) {
                    let why = e.to_string();
                    let why = why.lines().next().unwrap_or_default().to_string();
                    bad.push(format!("{name}:{line}: `{cmd}`: {why}"));
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} commands found in the docs");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn shell_words_keep_quotes_together_and_stop_at_a_pipe() {
    assert_eq!(
        words(r#"kvchat run "What is 'x'?" -n 4 | head"#).unwrap(),
        ["kvchat", "run", "What is 'x'?", "-n", "4"]
    );
    assert_eq!(
        words("kvchat run 'a b' # note").unwrap(),
        ["kvchat", "run", "a b"]
    );
    assert!(words("kvchat run \"open").is_none());
}

#[test]
fn commands_join_continued_lines_and_skip_other_blocks() {
    let md = "```sh\nkvchat bench \\\n  --ctx 512\necho hi | kvchat run --raw\n```\n```\nkvchat nothing\n```\n";
    assert_eq!(
        commands(md),
        [
            (2, "kvchat bench  --ctx 512".to_string()),
            (4, "kvchat run --raw".to_string())
        ]
    );
}

#[test]
fn a_command_with_a_flag_the_binary_lacks_does_not_parse() {
    let good = words("kvchat run --kv-type int4 \"Hi\"").unwrap();
    let bad = words("kvchat run --kv-typ int4 \"Hi\"").unwrap();
    assert!(Cli::try_parse_from(good).is_ok());
    assert!(Cli::try_parse_from(bad).is_err());
}
