//! Subcommands of the `kvtier` binary.

mod bench;
mod info;
mod plan;
mod pool;
mod selftest;
mod table;
mod trace;
mod transfer;

use std::process::ExitCode;

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
    /// What a deployment holds: bytes per token on each tier, the requests a
    /// node serves at once with DRAM only and with CXL, and which resource
    /// runs out first.
    Plan(Box<plan::PlanArgs>),
    /// Create, inspect, check and destroy pools on memory devices.
    #[command(subcommand)]
    Pool(pool::PoolCommand),
    /// Tables in shared memory, loaded once per host and attached by every
    /// instance (DeepSeek-V4.1's Engram tables and the like).
    #[command(subcommand)]
    Table(table::TableCommand),
    /// Top-k selection traces: generate a synthetic one (`kvtier plan
    /// --trace` replays any).
    #[command(subcommand)]
    Trace(trace::TraceCommand),
    /// On this machine's GPU: every kernel kvtier serves against the CPU
    /// executor on random and hostile inputs, the per-layer calls in a CUDA
    /// graph, the link.
    /// Exit code 0: passed; 1: a check failed (or it could not run); 77: no
    /// usable GPU (nothing was checked).
    Selftest(selftest::SelftestArgs),
}

pub fn run(cli: Cli) -> kvtier::Result<ExitCode> {
    let done = |r: kvtier::Result<()>| r.map(|()| ExitCode::SUCCESS);
    match cli.command {
        Command::Info => done(info::run()),
        Command::Bench(args) => done(bench::run(*args)),
        Command::Plan(args) => done(plan::run(*args)),
        Command::Pool(cmd) => done(pool::run(cmd)),
        Command::Table(cmd) => done(table::run(cmd)),
        Command::Trace(cmd) => done(trace::run(cmd)),
        Command::Selftest(args) => selftest::run(args),
    }
}
