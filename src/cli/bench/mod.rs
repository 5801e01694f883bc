//! `kvtier bench`: microbenchmarks of the per-layer calls, each method timed
//! side by side with the others in one run, on the same bytes and memory.
//!
//! * `gather`: kvtier's top-k gather next to a contiguous copy of the same
//!   bytes out of the same pool (the limit of the link).
//! * `swap-in`: kvtier's swap-in (plan per request, one copy over all misses)
//!   next to the one-block-per-request design SGLang uses, and to a contiguous
//!   copy of the missed bytes (the limit).
//!
//! On a GPU the CUDA executor runs and times with CUDA events; the limit is a
//! copy-engine transfer. Without one the CPU executor runs, the limit is a
//! host memcpy, and the table says so.

mod gather;
mod swap_in;

use std::time::Instant;

use clap::{Args, ValueEnum};
use kvtier::cuda::EventTimer;
use kvtier::{EntryFormat, Executor, Stream};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which scenarios to run.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// Top-k entries per request and layer.
    #[arg(long, default_value_t = 2048)]
    k: u32,
    /// Entry format: fp8-dsa (656 B), bf16-mla (1152 B) or a byte count.
    #[arg(long, default_value = "fp8-dsa")]
    entry: String,
    /// Batch sizes, comma-separated (default: gather 1,64; swap-in 1,16,64,256).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<u32>,
    /// gather: tokens of context per request; top-k indices are drawn from it.
    #[arg(long, default_value_t = 32768)]
    context: u32,
    /// swap-in: hot buffer sizes (LRU slots per request), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [4096u32, 8192])]
    hot: Vec<u32>,
    /// swap-in: misses per request (of the top-k), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 410])]
    misses: Vec<u32>,
    /// Timed iterations per measurement.
    #[arg(long, default_value_t = 50)]
    iters: u32,
    /// Untimed warm-up iterations per measurement.
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// Executor: auto (CUDA when a GPU and the kernels are there), cpu or cuda.
    #[arg(long, default_value = "auto")]
    executor: String,
    /// GPU ordinal for the CUDA executor.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// A short run of every scenario (small contexts and grids, few
    /// iterations) for smoke tests and CI.
    #[arg(long)]
    quick: bool,
    /// Seed of the index and data generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Gather,
    SwapIn,
    All,
}

/// One timed method at one point of a grid.
struct Row {
    /// The grid point, e.g. "batch 64" or "batch 16, hot 8192, 410 misses".
    point: String,
    method: &'static str,
    /// Bytes the method moves (the same for every method of a point).
    bytes: u64,
    median_us: f64,
    p99_us: f64,
    /// True for the point's limit (the ratio column divides by it).
    limit: bool,
}

pub fn run(mut args: BenchArgs) -> kvtier::Result<()> {
    if args.quick {
        args.context = args.context.min(4096);
        args.iters = args.iters.min(10);
        args.warmup = args.warmup.min(2);
    }
    if args.iters == 0 || args.batch.contains(&0) {
        return Err(invalid(
            "--iters/--batch",
            "need at least one iteration and batch sizes >= 1",
        ));
    }
    let entry = args.entry.parse::<EntryFormat>()?.bytes();
    let (exec, why_cpu) = choose_executor(&args)?;
    match &why_cpu {
        Some(why) => println!(
            "executor: CPU executor (no CUDA executor: {why}); the limits are host memcpys"
        ),
        None => println!(
            "executor: {}; the limits are copy-engine transfers",
            exec.describe()
        ),
    }
    if matches!(args.scenario, Scenario::Gather | Scenario::All) {
        println!();
        print_table(&gather::run(&args, &exec, entry)?);
    }
    if matches!(args.scenario, Scenario::SwapIn | Scenario::All) {
        println!();
        print_table(&swap_in::run(&args, &exec, entry)?);
    }
    println!(
        "\nvs limit = the limit's median time / this method's median time (1.00 = as fast as the limit)"
    );
    Ok(())
}

fn invalid(arg: &'static str, msg: impl Into<String>) -> kvtier::Error {
    kvtier::Error::InvalidArgument {
        arg,
        msg: msg.into(),
    }
}

fn choose_executor(args: &BenchArgs) -> kvtier::Result<(Executor, Option<String>)> {
    match args.executor.as_str() {
        "cpu" => Ok((Executor::cpu(), Some("--executor cpu was given".into()))),
        "cuda" => Ok((Executor::cuda(args.device)?, None)),
        "auto" => match Executor::cuda(args.device) {
            Ok(e) => Ok((e, None)),
            Err(e) => Ok((Executor::cpu(), Some(e.to_string()))),
        },
        other => Err(invalid(
            "--executor",
            format!("{other:?} is not auto, cpu or cuda"),
        )),
    }
}

/// (median, p99) in µs of `f` timed with the wall clock; `reset` runs
/// untimed before every call. Both get the mutable `state` the call works on.
fn time_cpu<S>(
    args: &BenchArgs,
    state: &mut S,
    mut reset: impl FnMut(&mut S),
    mut f: impl FnMut(&mut S) -> kvtier::Result<()>,
) -> kvtier::Result<(f64, f64)> {
    for _ in 0..args.warmup {
        reset(state);
        f(state)?;
    }
    let mut samples = Vec::with_capacity(args.iters as usize);
    for _ in 0..args.iters {
        reset(state);
        let t = Instant::now();
        f(state)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median_p99(samples))
}

/// (median, p99) in µs of `f` timed with CUDA events on `stream`; `reset`
/// runs (enqueued on the stream) untimed before every call.
fn time_cuda(
    args: &BenchArgs,
    timer: &EventTimer,
    stream: Stream,
    mut reset: impl FnMut(Stream) -> kvtier::Result<()>,
    mut f: impl FnMut(Stream) -> kvtier::Result<()>,
) -> kvtier::Result<(f64, f64)> {
    for _ in 0..args.warmup {
        reset(stream)?;
        f(stream)?;
    }
    let mut samples = Vec::with_capacity(args.iters as usize);
    for _ in 0..args.iters {
        reset(stream)?;
        timer.start(stream)?;
        f(stream)?;
        timer.stop(stream)?;
        samples.push(timer.elapsed_us()?);
    }
    Ok(median_p99(samples))
}

/// (median, p99) of the samples, nearest-rank.
fn median_p99(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let p99 = samples[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1];
    (samples[n / 2], p99)
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<34} {:<34} {:>10} {:>11} {:>11} {:>9} {:>9}",
        "point", "method", "bytes", "median µs", "p99 µs", "GB/s", "vs limit"
    );
    for group in rows.chunk_by(|a, b| a.point == b.point) {
        let limit = group.iter().find(|r| r.limit).map(|r| r.median_us);
        for r in group {
            let gbps = r.bytes as f64 / r.median_us / 1e3;
            let ratio = limit.map(|l| l / r.median_us).unwrap_or(f64::NAN);
            println!(
                "{:<34} {:<34} {:>10} {:>11.1} {:>11.1} {:>9.2} {:>9.2}",
                r.point,
                r.method,
                format_bytes(r.bytes),
                r.median_us,
                r.p99_us,
                gbps,
                ratio
            );
        }
    }
}

fn format_bytes(bytes: u64) -> String {
    if bytes >= 1_000_000 {
        format!("{:.2} MB", bytes as f64 / 1e6)
    } else {
        format!("{:.1} KB", bytes as f64 / 1e3)
    }
}
