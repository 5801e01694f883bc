//! `kvtier`: the command-line front end (kernel/driver info, benchmarks).

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::FAILURE
        }
    }
}
