//! Errors for a person: one line, the context chain joined, and — when the library says what would
//! fix it ([`crate::Fixable`]) — the flag or command that does, in this front end's words. Every
//! error kvchat shows goes through [`describe`].

use crate::Fix;

/// How to apply a fix with kvchat's flags.
pub fn advice(fix: Fix) -> &'static str {
    match fix {
        Fix::RaiseContext => "raise --ctx",
        Fix::LowerContext => "lower --ctx",
        Fix::FitMemory => "set --kv-type or --ctx as named, or pass --fit to let kvchat choose",
        Fix::CpuDevice => "use --device cpu",
        Fix::Tokenizer => "pass --tokenizer tokenizer.json",
        Fix::ChatTemplate => "pass --chat-template chatml|llama3|llama2|gemma, or --raw",
        Fix::FullCache => "use a cache: drop --no-cache",
        Fix::KvType => "choose another --kv-type (f16, bf16 or f32 store any head size)",
        Fix::ChatFull => "/undo, /reset, or run with --on-full shift or a larger --ctx",
        Fix::StoreBudget => "raise --kv-store-budget",
        Fix::BuildWithCuda => "rebuild with `cargo build --release --features cuda`",
        Fix::BuildWithMetal => "rebuild with `cargo build --release --features metal`",
        Fix::CudaLibraries => {
            "install the NVIDIA driver and CUDA 13's cuBLAS and cuRAND (pip install nvidia-cublas nvidia-curand) and put their lib folders on LD_LIBRARY_PATH, or use --device cpu"
        }
        Fix::WindowOverContext => "lower --kv-window or --kv-sinks, or raise --ctx",
        Fix::BudgetOverContext => "lower --kv-budget or raise --ctx",
        Fix::BenchTimeBudget => "raise --budget-s",
        Fix::LowerLongestContext => "lower the longest of --contexts",
    }
}

/// The error as one line, with the fix in kvchat's flags when the library named one.
pub fn describe(e: &anyhow::Error) -> String {
    crate::describe_with(e, advice)
}

/// Prints the error as kvchat's last words and exits with status 1.
pub fn exit_with(e: &anyhow::Error) -> ! {
    eprintln!("error: {}", describe(e));
    std::process::exit(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn a_fixable_error_gets_its_flag_even_under_context() {
        let e = Err::<(), _>(crate::fixable(
            Fix::RaiseContext,
            "the KV cache is full".into(),
        ))
        .context("turn 3")
        .unwrap_err();
        assert_eq!(describe(&e), "turn 3: the KV cache is full (raise --ctx)");
    }

    #[test]
    fn other_errors_are_their_chain_on_one_line() {
        let e = anyhow::anyhow!("not found\nbacktrace…").context("model x");
        assert_eq!(describe(&e), "model x: not found");
    }
}
