//! Shared by the integration tests: the real model, loaded once per test binary.
#![allow(dead_code)]

pub mod tiny;

use kvchat::cli::ModelArgs;
use kvchat::engine::Engine;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The real model file: $KVCHAT_MODEL, or where scripts/fetch-models.sh puts it.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("KVCHAT_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(kvchat::cli::default_model_path);
    assert!(
        p.exists(),
        "the test model is missing at {}: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

pub fn model_args() -> ModelArgs {
    ModelArgs {
        model: Some(model_path()),
        tokenizer: None,
        device: "cpu".into(),
        threads: None,
        ctx: Some(4096),
    }
}

/// The real model (SmolLM2-135M-Instruct Q4_1), loaded once.
pub fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| Engine::load(&model_args()).expect("loading the test model"))
}

/// max |a - b| / max |b|: how far two logit vectors are apart, relative to their scale.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}
