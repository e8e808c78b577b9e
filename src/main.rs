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
        // One line: the context chain joined ("cannot open model file x: No such file"), each part
        // cut to its first line (candle appends a backtrace to its errors when RUST_BACKTRACE is set).
        let msg: Vec<String> = e.chain().map(kvchat::first_line).collect();
        eprintln!("error: {}", msg.join(": "));
        std::process::exit(1);
    }
}
