//! `kvtier`: the command-line front end (kernel/driver info, benchmarks).

mod bench;
mod info;
mod plan;
mod pool;
mod prefix;
mod selftest;
mod table;
mod trace;
mod transfer;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvtier: the KV-cache tier for sparse-attention LLMs.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version = kvtier::VERSION, about)]
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
    /// Prefix stores (SGLang HiCache's storage tier in shared memory): what
    /// they hold, and removing one no process has open.
    #[command(subcommand)]
    Prefix(prefix::PrefixCommand),
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
        Command::Prefix(cmd) => done(prefix::run(cmd)),
        Command::Trace(cmd) => done(trace::run(cmd)),
        Command::Selftest(args) => selftest::run(args),
    }
}

/// `hypotf` for this binary, in place of libm's: the plotting crate's
/// `f32::hypot` (the figures' line widths) calls it, and glibc 2.35 gave
/// `hypotf` a new symbol version, GLIBC_2.35, that a binary linked on a
/// newer glibc then needs; it would not start on glibc 2.34 (RHEL 9), which
/// the wheel's manylinux_2_34 tag promises. Computed in f64, where the
/// squares of any f32 neither overflow nor lose the result's precision.
#[unsafe(no_mangle)]
pub extern "C" fn hypotf(x: f32, y: f32) -> f32 {
    if x.is_infinite() || y.is_infinite() {
        return f32::INFINITY; // as IEEE 754 says, even against a NaN
    }
    let (x, y) = (x as f64, y as f64);
    (x * x + y * y).sqrt() as f32
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so `kvtier info | head -1` made the next print
    // panic ("failed printing to stdout: Broken pipe", exit 101). A command
    // line tool ends quietly when its reader goes away, as the shell's do.
    // SAFETY: restoring a signal's default action at startup, before any
    // thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args = Cli::parse();
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::hypotf;

    #[test]
    fn hypotf_is_the_length_of_the_hypotenuse() {
        assert_eq!(hypotf(3.0, 4.0), 5.0);
        assert_eq!(hypotf(-3.0, 0.0), 3.0);
        assert_eq!(hypotf(3e30, 4e30), 5e30, "no overflow in the squares");
        assert_eq!(hypotf(3e-30, 4e-30), 5e-30, "no underflow either");
        assert_eq!(hypotf(f32::INFINITY, f32::NAN), f32::INFINITY);
        assert!(hypotf(1.0, f32::NAN).is_nan());
        for (x, y) in [(1.5f32, 2.25f32), (0.1, 0.7), (1e5, 3.0)] {
            let want = (x as f64).hypot(y as f64) as f32;
            assert_eq!(hypotf(x, y), want, "{x} {y}");
        }
    }
}
