//! kvchat's entry point: parse flags, dispatch to a subcommand, print errors as one line.

use clap::Parser;
use kvchat::cli::{Cli, Command};
use kvchat::commands;

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => commands::run::run(args),
        Command::Chat(args) => commands::chat::run(args),
        Command::Tokenize(args) => commands::tokenize::run(args),
        Command::Ppl(args) => commands::ppl::run(args),
        Command::KvSize(args) => commands::kv_size::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Models(args) => commands::models::run(args),
    };
    if let Err(e) = result {
        kvchat::cli::report::exit_with(&e);
    }
}
