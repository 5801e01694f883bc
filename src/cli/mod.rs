//! Subcommands of the `kvtier` binary.

mod bench;
mod info;

use clap::{Parser, Subcommand};

/// kvtier: the KV-cache tier for sparse-attention LLMs.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The CUDA driver and GPUs, the kernels this build carries, pool devices.
    Info,
    /// The top-k fetch microbenchmark: kvtier's gather next to a contiguous
    /// copy of the same bytes (the link's limit).
    Bench(bench::BenchArgs),
}

pub fn run(cli: Cli) -> kvtier::Result<()> {
    match cli.command {
        Command::Info => info::run(),
        Command::Bench(args) => bench::run(args),
    }
}
