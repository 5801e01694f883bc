//! `kvtier bench`: the top-k fetch microbenchmark. Every method of a grid
//! point is timed side by side in one run, on the same bytes and the same
//! memory, and reported as a ratio to the link's limit.
//!
//! * `gather`: kvtier's top-k gather; the limit (one contiguous copy of the
//!   same bytes); per-entry `cudaMemcpyAsync`; a CPU gather into pinned
//!   staging and one copy; the full-context fetch RDMA pools do.
//! * `swap-in`: kvtier's swap-in; the one-block-per-request design SGLang
//!   uses; the limit (the missed bytes in one copy); per-entry copies of the
//!   misses; a CPU gather of the misses and one copy.
//! * `writeback`: one layer of a prefill chunk, and every layer of one decode
//!   token per request: kvtier's writeback; the limit (one device→host copy);
//!   per-entry copies; one copy into pinned staging and a CPU scatter.
//!
//! On a GPU the CUDA executor runs and times with CUDA events (host-driven
//! methods with the wall clock around a stream sync); the limit is a
//! copy-engine transfer. Without one the CPU executor runs, the limit is a
//! host memcpy, and every line of the output says so.

mod gather;
mod link;
mod report;
pub(crate) use report::{find_font, register_font};
mod sglang;
mod spec_swap_in;
mod swap_in;
mod writeback;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier::cuda::{DriverStatus, EventTimer, OwnedStream};
use kvtier::pool::{numa_nodes, parse_size};
use kvtier::{DeviceSpec, EntryFormat, Executor, Stream};

pub(crate) use link::link_figures;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which scenarios to run.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// gather: top-k entries per request and layer (default 256,512,1024,2048).
    #[arg(long, value_delimiter = ',')]
    k: Vec<u32>,
    /// Entry formats: fp8-dsa (656 B), bf16-mla (1152 B) or byte counts
    /// (default: fp8-dsa,bf16-mla; swap-in: fp8-dsa).
    #[arg(long, value_delimiter = ',')]
    entry: Vec<String>,
    /// Batch sizes (default: gather and writeback 1,8,64; swap-in 1,10,100,256).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<u32>,
    /// gather: tokens of context per request (default 32768,131072).
    #[arg(long, value_delimiter = ',')]
    context: Vec<u32>,
    /// gather: how top-k indices are drawn (default uniform,locality).
    #[arg(long, value_enum, value_delimiter = ',')]
    indices: Vec<Indices>,
    /// swap-in: hot buffer sizes (LRU slots per request).
    #[arg(long, value_delimiter = ',', default_values_t = [4096u32, 8192])]
    hot: Vec<u32>,
    /// swap-in: misses per request (of the top-k).
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 410])]
    misses: Vec<u32>,
    /// swap-in: top-k per request.
    #[arg(long, default_value_t = 2048)]
    swap_k: u32,
    /// writeback: tokens of the prefill chunk written back for one layer
    /// (default 1024,8192).
    #[arg(long, value_delimiter = ',')]
    prefill_tokens: Vec<u32>,
    /// writeback: layers of a decode token written back at once.
    #[arg(long, default_value_t = 61)]
    layers: u32,
    /// Timed iterations per measurement.
    #[arg(long, default_value_t = 50)]
    iters: u32,
    /// Untimed warm-up iterations per measurement.
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// Time budget per measurement in seconds: a slow method stops warming up
    /// after this (with at least one warm-up call) and stops sampling after
    /// it (with at least 5 samples); the output says how many it took.
    #[arg(long, default_value_t = 5.0)]
    max_seconds: f64,
    /// Pool memory the gather scenario may use (a size, or auto: 8 GiB, or
    /// half the available memory when that is less); requests share regions
    /// (round-robin) beyond it, and the output says how many are distinct.
    #[arg(long, default_value = "auto")]
    pool_memory: String,
    /// Executor: auto (CUDA when a GPU and the kernels are there), cpu or cuda.
    #[arg(long, default_value = "auto")]
    executor: String,
    /// GPU ordinal for the CUDA executor.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// A small grid of every scenario, few iterations (about a second
    /// without a GPU; CI runs it).
    #[arg(long)]
    quick: bool,
    /// The full grid on the CPU executor too (several minutes and several
    /// GB). Without it the CPU executor runs a grid of about a minute; on a
    /// GPU the full grid is the default.
    #[arg(long, conflicts_with = "quick")]
    full: bool,
    /// Seed of the index and data generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write every measurement as one JSON object per line here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw latency and bandwidth against k or batch, one line per
    /// method, into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// TrueType font for the plot's text (default: DejaVu Sans or another
    /// font found under /usr/share/fonts).
    #[arg(long)]
    plot_font: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Gather,
    SwapIn,
    /// The speculative swap-in (MTP/EAGLE verify).
    SpecSwapIn,
    Writeback,
    All,
}

/// How the gather's top-k indices are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Indices {
    /// Distinct tokens drawn uniformly from the context.
    Uniform,
    /// Runs of neighbouring tokens (lengths 1 to 32) at uniform starts, as
    /// real top-k sets cluster.
    Locality,
}

impl Indices {
    fn name(self) -> &'static str {
        match self {
            Indices::Uniform => "uniform",
            Indices::Locality => "locality",
        }
    }
}

/// One timed method at one grid point.
#[derive(Clone, Debug)]
pub(super) struct Measurement {
    pub scenario: &'static str,
    pub method: &'static str,
    /// The grid point, in order (the JSON `params` object).
    pub params: Vec<(&'static str, serde_json::Value)>,
    /// Bytes this method moves (the full-context fetch moves more than the
    /// others, which move the point's useful bytes).
    pub bytes: u64,
    pub median_us: f64,
    pub p99_us: f64,
    pub samples: usize,
    /// The point's limit: the ratio column divides its time by the others'.
    pub limit: bool,
}

impl Measurement {
    /// A method's timing `(median, p99, samples)` at the point `params`.
    pub fn new(
        scenario: &'static str,
        method: &'static str,
        params: &[(&'static str, serde_json::Value)],
        bytes: usize,
        (median_us, p99_us, samples): (f64, f64, usize),
        limit: bool,
    ) -> Self {
        Measurement {
            scenario,
            method,
            params: params.to_vec(),
            bytes: bytes as u64,
            median_us,
            p99_us,
            samples,
            limit,
        }
    }

    /// The point as a short label, e.g. "k 2048, 656 B, batch 8".
    pub fn point(&self) -> String {
        let batch = self
            .params
            .iter()
            .find(|(k, _)| *k == "batch")
            .map(|(_, v)| v);
        self.params
            .iter()
            // distinct regions matter only when fewer than the batch
            .filter(|(k, v)| *k != "distinct_regions" || batch != Some(v))
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => format!("{k} {s}"),
                other => format!("{k} {other}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// How a method is timed on the CUDA executor (see [`Bench::time`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Timing {
    /// Work enqueued on the stream: CUDA events around it.
    Device,
    /// Work the host drives (a copy call per entry, host loops): the wall
    /// clock up to the stream's synchronisation.
    HostDriven,
}

/// Where a scenario's methods run and are timed: the wall clock for the CPU
/// executor; a stream of its own and an event pair for the CUDA executor.
pub(super) enum Clock {
    Wall,
    Cuda {
        dev: Arc<kvtier::CudaDevice>,
        stream: OwnedStream,
        timer: EventTimer,
    },
}

impl Clock {
    pub fn new(exec: &Executor) -> kvtier::Result<Self> {
        Ok(match exec {
            Executor::Cpu => Clock::Wall,
            Executor::Cuda(dev) => Clock::Cuda {
                dev: dev.clone(),
                stream: dev.create_stream()?,
                timer: EventTimer::new(dev)?,
            },
        })
    }

    /// The stream methods run on (the null stream for the CPU executor,
    /// which ignores it).
    pub fn stream(&self) -> Stream {
        match self {
            Clock::Wall => Stream::null(),
            Clock::Cuda { stream, .. } => stream.stream(),
        }
    }

    /// Waits for the work on the stream (before the host reads what it wrote).
    pub fn sync(&self) -> kvtier::Result<()> {
        match self {
            Clock::Wall => Ok(()),
            Clock::Cuda { dev, stream, .. } => dev.synchronize(stream.stream()),
        }
    }
}

/// The byte every byte of host row `row` holds in the swap-in scenarios.
pub(super) fn row_pattern(row: usize) -> u8 {
    (row.wrapping_mul(2_654_435_761) >> 7) as u8
}

/// A method's name for the executor it ran on.
pub(super) fn named(exec: &Executor, cpu: &'static str, cuda: &'static str) -> &'static str {
    match exec {
        Executor::Cpu => cpu,
        Executor::Cuda(_) => cuda,
    }
}

/// What every scenario needs: the arguments, the executor, the progress bar.
pub(super) struct Bench<'a> {
    pub args: &'a BenchArgs,
    pub exec: Executor,
    pub progress: ProgressBar,
}

impl Bench<'_> {
    /// Where pool memory comes from: bound to the GPU's NUMA node when the
    /// machine has several nodes and says which is the GPU's, else anonymous.
    pub fn pool_device(&self, bytes: u64) -> DeviceSpec {
        if let Executor::Cuda(dev) = &self.exec
            && numa_nodes(std::path::Path::new("/sys")).len() > 1
            && let Some(node) = dev.numa_node()
        {
            return DeviceSpec::Numa {
                nodes: vec![node],
                bytes,
            };
        }
        DeviceSpec::Anon { bytes }
    }

    /// The default or given entry sizes.
    pub fn entries(&self, default: &[&str]) -> kvtier::Result<Vec<u32>> {
        let given: Vec<String> = if self.args.entry.is_empty() {
            default.iter().map(|s| s.to_string()).collect()
        } else {
            self.args.entry.clone()
        };
        given
            .iter()
            .map(|e| e.parse::<EntryFormat>().map(|f| f.bytes()))
            .collect()
    }

    /// The default or given batch sizes.
    pub fn batches(&self, default: &[u32]) -> Vec<u32> {
        if self.args.batch.is_empty() {
            default.to_vec()
        } else {
            self.args.batch.clone()
        }
    }

    /// (median, p99, samples) in µs of `f` on `clock`'s stream; `reset` runs
    /// untimed before every call. On the CUDA executor `how` picks CUDA
    /// events around the call (device work) or the wall clock up to the
    /// stream's synchronisation (host-driven work); the CPU executor always
    /// uses the wall clock.
    pub fn time(
        &self,
        clock: &Clock,
        how: Timing,
        mut reset: impl FnMut(Stream) -> kvtier::Result<()>,
        mut f: impl FnMut(Stream) -> kvtier::Result<()>,
    ) -> kvtier::Result<(f64, f64, usize)> {
        let s = clock.stream();
        match (clock, how) {
            (Clock::Wall, _) => self.sample(|| {
                reset(s)?;
                let t = Instant::now();
                f(s)?;
                Ok(t.elapsed().as_secs_f64() * 1e6)
            }),
            (Clock::Cuda { timer, .. }, Timing::Device) => self.sample(|| {
                reset(s)?;
                timer.start(s)?;
                f(s)?;
                timer.stop(s)?;
                timer.elapsed_us()
            }),
            (Clock::Cuda { dev, .. }, Timing::HostDriven) => self.sample(|| {
                reset(s)?;
                dev.synchronize(s)?;
                let t = Instant::now();
                f(s)?;
                dev.synchronize(s)?;
                Ok(t.elapsed().as_secs_f64() * 1e6)
            }),
        }
    }

    /// Runs `once` (one call, returning its time in µs) for the warm-up and
    /// then for the samples, within the time budget: warm-up stops after the
    /// budget once there was one call, sampling once there are 5 samples.
    fn sample(
        &self,
        mut once: impl FnMut() -> kvtier::Result<f64>,
    ) -> kvtier::Result<(f64, f64, usize)> {
        let budget = self.budget();
        let warm = Instant::now();
        for i in 0..self.args.warmup {
            if i >= 1 && warm.elapsed() > budget {
                break;
            }
            once()?;
        }
        let mut samples = Vec::with_capacity(self.args.iters as usize);
        let start = Instant::now();
        for i in 0..self.args.iters {
            if i >= 5 && start.elapsed() > budget {
                break;
            }
            samples.push(once()?);
        }
        Ok(median_p99(samples))
    }

    /// The gather's pool memory budget in bytes.
    pub fn pool_budget(&self) -> kvtier::Result<u64> {
        pool_budget(self.args)
    }

    fn budget(&self) -> Duration {
        Duration::from_secs_f64(self.args.max_seconds.max(0.0))
    }
}

pub fn run(mut args: BenchArgs) -> kvtier::Result<()> {
    if args.quick {
        let keep = |v: &mut Vec<u32>, quick: &[u32]| {
            if v.is_empty() {
                *v = quick.to_vec();
            }
        };
        keep(&mut args.k, &[256, 2048]);
        keep(&mut args.batch, &[1, 8]);
        keep(&mut args.context, &[8192]);
        keep(&mut args.prefill_tokens, &[1024]);
        if args.entry.is_empty() {
            args.entry = vec!["fp8-dsa".into()];
        }
        args.hot.truncate(1);
        args.iters = args.iters.min(10);
        args.warmup = args.warmup.min(2);
        args.max_seconds = args.max_seconds.min(1.0);
    }
    if args.iters == 0 || args.batch.contains(&0) {
        return Err(invalid(
            "--iters/--batch",
            "need at least one iteration and batch sizes >= 1",
        ));
    }
    // A typo in an output path or a missing font must not cost the run.
    check_outputs(&args)?;
    pool_budget(&args)?;
    let (exec, why_cpu) = choose_executor(&args)?;
    if !args.quick && !args.full && matches!(exec, Executor::Cpu) {
        // About a minute on a CPU: fewer points and samples than the full
        // grid, every scenario and method still there.
        let keep = |v: &mut Vec<u32>, d: &[u32]| {
            if v.is_empty() {
                *v = d.to_vec();
            }
        };
        keep(&mut args.k, &[256, 2048]);
        keep(&mut args.batch, &[1, 8, 64]);
        keep(&mut args.context, &[32768]);
        keep(&mut args.prefill_tokens, &[1024, 8192]);
        args.hot.truncate(1);
        args.iters = args.iters.min(20);
        args.warmup = args.warmup.min(3);
        args.max_seconds = args.max_seconds.min(1.0);
    }
    let env = report::Environment::probe(&exec, why_cpu.as_deref());
    println!("{}", env.banner());

    let bench = Bench {
        args: &args,
        exec,
        progress: ProgressBar::hidden(),
    };
    let scenarios: Vec<Scenario> = match args.scenario {
        Scenario::All => {
            let mut all = vec![Scenario::Gather, Scenario::SwapIn];
            // The speculative grid takes fewer shapes than the single-step
            // one: settings it refuses skip it, named alone they are an error.
            match spec_swap_in::points(&bench) {
                Ok(_) => all.push(Scenario::SpecSwapIn),
                Err(e) => println!("note: {} skipped: {e}", spec_swap_in::SCENARIO),
            }
            all.push(Scenario::Writeback);
            all
        }
        s => vec![s],
    };
    let total: u64 = scenarios
        .iter()
        .map(|s| match s {
            Scenario::Gather => gather::points(&bench),
            Scenario::SwapIn => swap_in::points(&bench),
            Scenario::SpecSwapIn => spec_swap_in::points(&bench),
            Scenario::Writeback => writeback::points(&bench),
            Scenario::All => Ok(0),
        })
        .sum::<kvtier::Result<u64>>()?;
    // A bar on a terminal (stderr); nothing in logs and CI.
    let progress = ProgressBar::new(total);
    progress.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} points {elapsed_precise} {msg}")
            .expect("a valid template"),
    );
    let bench = Bench { progress, ..bench };
    println!(
        "plan: {total} grid points, each method timed {} times after {} warm-up calls (at most {} s per \
         measurement); the gather pool uses up to {}{}",
        args.iters,
        args.warmup,
        args.max_seconds,
        kvtier::pool::human_size(pool_budget(&args)?),
        if args.quick || args.full || !matches!(bench.exec, Executor::Cpu) {
            String::new()
        } else {
            "; the CPU executor's default grid (about a minute): --full for all of it".into()
        }
    );

    let mut all = Vec::new();
    for s in scenarios {
        let rows = match s {
            Scenario::Gather => gather::run(&bench)?,
            Scenario::SwapIn => swap_in::run(&bench)?,
            Scenario::SpecSwapIn => spec_swap_in::run(&bench)?,
            Scenario::Writeback => writeback::run(&bench)?,
            Scenario::All => unreachable!(),
        };
        bench.progress.suspend(|| {
            println!();
            report::print_table(&rows);
        });
        all.extend(rows);
    }
    bench.progress.finish_and_clear();
    println!(
        "\nGB/s = bytes the method moves / median time. vs limit = the limit's median time / this method's \
         median time, for the same useful bytes (1.00 = as fast as the limit)."
    );
    if let Some(path) = &args.json {
        report::write_json(path, &env, &all)?;
        println!("wrote {} measurements to {}", all.len(), path.display());
    }
    if let Some(path) = &args.plot {
        report::plot(path, args.plot_font.as_deref(), &env, &all)?;
        println!("wrote the plot to {}", path.display());
    }
    Ok(())
}

/// `--pool-memory` in bytes: the size given, or (auto) 8 GiB or half the
/// available memory, whichever is less.
/// Opens every output path for writing (and finds the plot's font) before
/// anything is measured; a file made here is removed again.
fn check_outputs(args: &BenchArgs) -> kvtier::Result<()> {
    for (flag, path) in [("--json", &args.json), ("--plot", &args.plot)] {
        let Some(path) = path else { continue };
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| invalid(flag, format!("cannot write {}: {e}", path.display())))?;
        if !existed {
            let _ = std::fs::remove_file(path);
        }
    }
    if args.plot.is_some() {
        report::find_font(args.plot_font.as_deref())?;
    }
    Ok(())
}

fn pool_budget(args: &BenchArgs) -> kvtier::Result<u64> {
    if args.pool_memory != "auto" {
        return parse_size(&args.pool_memory);
    }
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(u64::MAX);
    Ok((8u64 << 30).min(available / 2))
}

pub(super) fn invalid(arg: &'static str, msg: impl Into<String>) -> kvtier::Error {
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

/// (median, p99, samples) of the samples, nearest-rank.
fn median_p99(mut samples: Vec<f64>) -> (f64, f64, usize) {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let p99 = samples[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1];
    (samples[n / 2], p99, n)
}

/// The driver's version as "13.0", or why there is none.
pub(super) fn driver_text() -> String {
    match kvtier::cuda::probe_driver() {
        DriverStatus::Ready { version, .. } => {
            format!("CUDA {}.{}", version / 1000, version % 1000 / 10)
        }
        DriverStatus::Missing => "none (libcuda not found)".into(),
        DriverStatus::InitFailed(why) => format!("none ({why})"),
    }
}
