//! kvchat's entry point: parse flags, dispatch to a subcommand, print errors as one line.

use clap::{CommandFactory, FromArgMatches};
use kvchat::cli::{Cli, Command};
use kvchat::commands;

/// glibc's allocator, told to keep what a forward pass frees. By default it returns the top of
/// the heap to the kernel once 128 KiB+ lie free there, so the [tokens, hidden] activations of
/// each layer, allocated and freed over and over in a prefill, were zeroed and faulted in anew each
/// time. Keeping up to 256 MiB free at the top and serving blocks up to 32 MiB (glibc's maximum for
/// this setting) from the heap removes that; peak RSS is unchanged (figures and commands:
/// docs/perf-notes.md §7).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator parameters, and is called before any thread starts
    // (glibc: "MT-Unsafe init"). It returns 1 when it took the value.
    let took = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20)
            + libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20)
    };
    debug_assert_eq!(took, 2, "glibc refused a mallopt setting");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

/// How many times an idle worker of candle's barrier pool (our matmuls' and candle's) polls for
/// work before it parks, unless the user set `CANDLE_BARRIER_POOL_SPIN_LIMIT`: candle's default
/// keeps a worker spinning through a decode step's gaps, and when another process wants that core
/// the scheduler charges the spin to it and preempts it mid-step while the other thread waits at
/// the barrier. One sequence's step: 500 polls is still longer than the gap between two matmuls
/// (figures and commands: docs/perf-notes.md §9). A server's batched step has longer gaps (each
/// sequence's rope and appends run on the calling thread): at 500 the worker parks in them and
/// every dispatch after one pays a wake-up, so `serve` polls 2,000 times (§28). Set before the pool
/// or any other thread starts (the variable is read once, when the pool is made).
const SPIN_LIMIT_VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// Sets the pool's spin limit to `polls` unless the user set one; a value of theirs that candle
/// could not read (it would fall back to 25,000 without a word) is refused in one line naming it.
fn pool_spin_limit(polls: u32) -> anyhow::Result<()> {
    match std::env::var_os(SPIN_LIMIT_VAR) {
        None => std::env::set_var(SPIN_LIMIT_VAR, polls.to_string()),
        Some(v) if v.to_str().and_then(|s| s.parse::<u32>().ok()).is_some() => {}
        Some(v) => anyhow::bail!(
            "{SPIN_LIMIT_VAR}={v:?} is not a whole number of polls (0 to {}); unset it for \
             kvchat's {polls}",
            u32::MAX
        ),
    }
    Ok(())
}

fn main() {
    keep_freed_memory();
    // The library's notes (a lowered context, a download) go to stderr.
    kvchat::notes::install(Box::new(kvchat::notes::Stderr));
    let matches = Cli::command()
        .long_version(&*Box::leak(kvchat::cli::long_version().into_boxed_str()))
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = pool_spin_limit(cli.command.pool_spin_polls()) {
        kvchat::cli::report::exit_with(&e);
    }
    // candle sizes its thread pool (its kernels' and ours) from this variable, once, when the
    // first matmul starts it: set before anything runs.
    if let Some(n) = cli.command.threads() {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let result = match cli.command {
        Command::Run(args) => args.resolve().and_then(commands::run::run),
        Command::Chat(args) => args.resolve().and_then(commands::chat::run),
        Command::Serve(args) => args.resolve().and_then(commands::serve::run),
        Command::Tokenize(args) => args.resolve().and_then(commands::tokenize::run),
        Command::Ppl(args) => args.resolve().and_then(commands::ppl::run),
        Command::Needle(args) => args.resolve().and_then(commands::needle::run),
        Command::Quiz(args) => args.resolve().and_then(commands::quiz::run),
        Command::KvSize(args) => args.resolve().and_then(commands::kv_size::run),
        Command::Bench(args) => args.resolve().and_then(commands::bench::run),
        Command::Models(args) => args.resolve().and_then(commands::models::run),
        Command::Cache(args) => args.resolve().and_then(commands::cache::run),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "kvchat", &mut std::io::stdout());
            Ok(())
        }
    };
    if let Err(e) = result {
        kvchat::cli::report::exit_with(&e);
    }
}
