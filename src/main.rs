//! kvchat's entry point: parse flags, dispatch to a subcommand, print errors as one line.

use clap::{CommandFactory, FromArgMatches};
use kvchat::cli::{Cli, Command};
use kvchat::commands;

fn main() {
    let matches = Cli::command()
        .long_version(&*Box::leak(kvchat::cli::long_version().into_boxed_str()))
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Run(args) => commands::run::run(args),
        Command::Chat(args) => commands::chat::run(args),
        Command::Tokenize(args) => commands::tokenize::run(args),
        Command::Ppl(args) => commands::ppl::run(args),
        Command::KvSize(args) => commands::kv_size::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Models(args) => commands::models::run(args),
        Command::Cache(args) => commands::cache::run(args),
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "kvchat", &mut std::io::stdout());
            Ok(())
        }
    };
    if let Err(e) = result {
        kvchat::cli::report::exit_with(&e);
    }
}
