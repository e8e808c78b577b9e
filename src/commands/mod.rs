//! One file per subcommand.

pub mod run;
pub mod tokenize;
