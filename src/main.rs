//! `kvtier`: the command-line front end (kernel/driver info, benchmarks).

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so `kvtier info | head -1` made the next print
    // panic ("failed printing to stdout: Broken pipe", exit 101). A command
    // line tool ends quietly when its reader goes away, as the shell's do.
    // SAFETY: restoring a signal's default action at startup, before any
    // thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::FAILURE
        }
    }
}
