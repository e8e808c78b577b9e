//! kvchat's entry point: parse flags, dispatch to a subcommand, print errors as one line.

use clap::Parser;
use kvchat::cli::{Cli, Command};
use kvchat::commands;

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => commands::run::run(args),
        Command::Tokenize(args) => commands::tokenize::run(args),
    };
    if let Err(e) = result {
        // `{:#}` joins the context chain on one line: "cannot open model file x: No such file".
        let msg = format!("{e:#}").replace('\n', " ");
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}
