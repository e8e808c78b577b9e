//! One file per subcommand.

pub mod ppl;
pub mod run;
pub mod tokenize;
