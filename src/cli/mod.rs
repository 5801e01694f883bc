//! Subcommands of the `kvtier` binary.

mod bench;
mod info;
mod pool;

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
    /// The top-k fetch microbenchmark: gather, swap-in and writeback next to
    /// the link's limit and the baselines.
    Bench(Box<bench::BenchArgs>),
    /// Create, inspect, check and destroy pools on memory devices.
    #[command(subcommand)]
    Pool(pool::PoolCommand),
}

pub fn run(cli: Cli) -> kvtier::Result<()> {
    match cli.command {
        Command::Info => info::run(),
        Command::Bench(args) => bench::run(*args),
        Command::Pool(cmd) => pool::run(cmd),
    }
}
