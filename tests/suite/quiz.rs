//! `kvchat quiz`: a question set answered at the model's sampling, one answer per seed.

use crate::common::{kvchat, stderr};

/// A question set in a temporary file (under the target directory).
fn set(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("quiz");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_quiz_answer_is_the_answer_kvchat_run_gives_with_the_same_seed() {
    // No answer holds "zzzz", so every answer is reported (as wrong) with its seed.
    let q = "Name a colour of the rainbow.";
    let f = set("rainbow.tsv", &format!("fact\t{q}\tzzzz\n"));
    let out = kvchat(
        &[
            "quiz",
            f.to_str().unwrap(),
            "--seeds",
            "2",
            "-n",
            "12",
            "--json",
            "-",
        ],
        "",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["right"].as_u64(), report["asked"].as_u64()),
        (Some(0), Some(2))
    );
    let wrong = report["items"][0]["wrong"].as_array().unwrap();
    for w in wrong {
        let seed = w[0].as_u64().unwrap().to_string();
        let run = kvchat(&["run", "--seed", &seed, "-n", "12", q], "");
        assert!(run.status.success(), "{}", stderr(&run));
        assert_eq!(
            String::from_utf8_lossy(&run.stdout).trim_end(),
            w[1].as_str().unwrap().trim_end()
        );
    }
}

#[test]
fn a_greedy_answer_is_right_by_an_accepted_answer_it_holds_and_wrong_by_a_rejected_one() {
    // SmolLM2's greedy answer with its registry entry's repeat penalty: "L'Étoile: Paris, la
    // maquette de la France. …" (kvchat run --temperature 0 --repeat-penalty 1.1 -n 24 QUESTION).
    let q = "What is the capital of France?";
    let judged = |name: &str, accept: &str, reject: &str| {
        let f = set(name, &format!("fact\t{q}\t{accept}\t{reject}\n"));
        let out = kvchat(
            &[
                "quiz",
                f.to_str().unwrap(),
                "--seeds",
                "1",
                "--temperature",
                "0",
                "--repeat-penalty",
                "1.1",
                "-n",
                "24",
                "--json",
                "-",
            ],
            "",
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["by_kind"][0][0], "fact", "{r}");
        (
            r["right"].as_u64().unwrap(),
            r["by_kind"][0][1].as_u64().unwrap(),
        )
    };
    assert_eq!(judged("paris.tsv", "Paris", ""), (1, 1));
    assert_eq!(judged("paris-lyon.tsv", "Paris", "Lyon"), (1, 1));
    assert_eq!(judged("paris-etoile.tsv", "Paris", "étoile"), (0, 0));
    assert_eq!(judged("lyon.tsv", "Lyon", ""), (0, 0));
}

#[test]
fn a_malformed_question_set_is_refused_by_line_before_the_model_loads() {
    let f = set(
        "bad.tsv",
        "# a comment\nfact\tWhat?\tyes\nfact only two fields\there\n",
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvchat"))
        .args(["quiz", f.to_str().unwrap(), "-m", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // The set is checked first: the missing model is never looked at.
    assert!(err.contains("line 3: 2 tab-separated fields"), "{err}");
    assert!(!err.contains("nonexistent"), "{err}");
}

#[test]
fn quiz_refuses_seed_beside_seeds() {
    let out = kvchat(&["quiz", "--seed", "3"], "");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--seed conflicts with --seeds"), "{err}");
}
