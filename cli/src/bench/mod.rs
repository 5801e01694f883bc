//! `kvtier bench`: the top-k fetch microbenchmark. Every method of a grid
//! point is timed side by side in one run, on the same bytes and the same
//! memory, and reported as a ratio to the link's limit.
//!
//! * `gather`: kvtier's top-k gather; the limit (one contiguous copy of the
//!   same bytes); per-entry `cudaMemcpyAsync`; a CPU gather into pinned
//!   staging and one copy; the full-context fetch RDMA pools do.
//! * `swap-in`: kvtier's swap-in; the one-block-per-request design SGLang
//!   uses; the limit (the missed bytes in one copy); per-entry copies of the
//!   misses; a CPU gather of the misses and one copy. On DSA's linear rows,
//!   or (`--swap-path`) DeepSeek-V4's C4 rows or MiniMax-M3's K and V.
//! * `writeback`: one layer of a prefill chunk, and every layer of one decode
//!   token per request: kvtier's writeback; the limit (one device→host copy);
//!   per-entry copies; one copy into pinned staging and a CPU scatter.
//!
//! * `engram-gather`: DeepSeek-V4.1's Engram lookups: kvtier's gather of
//!   e4m3 rows with e8m0 scales into bf16; the limit (the rows' bytes in one
//!   copy); SGLang's host staging (`index_select` into pinned staging, one
//!   copy).
//!
//! On a GPU the CUDA executor runs and times with CUDA events (host-driven
//! methods with the wall clock around a stream sync); the limit is a
//! copy-engine transfer. Without one the CPU executor runs, the limit is a
//! host memcpy, and every line of the output says so.

mod copy_choice;
mod decode_step;
mod engram;
mod figures;
mod gather;
mod link;
mod report;
pub(crate) use figures::PALETTE;
pub(crate) use report::{find_font, register_font};
mod sglang;
mod spec_swap_in;
mod swap_in;
mod swap_in_report;
mod swap_path;
mod watchdog;
mod writeback;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier::cuda::{DriverStatus, EventTimer, OwnedStream};
use kvtier::pool::{numa_nodes, parse_size};
use kvtier::{DeviceSpec, EntryFormat, Executor, Stream};

pub(crate) use decode_step::DECODE_STEP_KVTIER_METHOD;
pub(crate) use link::{LinkFigures, link_figures};
use swap_path::SwapPath;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which scenarios to run.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// gather: top-k entries per request and layer (default 256,512,1024,2048;
    /// the CPU executor's default grid and --quick: 256,2048).
    #[arg(long, value_delimiter = ',')]
    k: Vec<u32>,
    /// Entry formats: fp8-dsa (656 B), bf16-mla (1152 B) or byte counts
    /// (default: fp8-dsa,bf16-mla; swap-in: fp8-dsa, --swap-path m3-kv: 256
    /// a plane; spec-swap-in: 576; --quick: fp8-dsa).
    #[arg(long, value_delimiter = ',')]
    entry: Vec<String>,
    /// Batch sizes (default: gather and writeback 1,8,64; swap-in
    /// 1,10,100,256; spec-swap-in 1,8,32,64; the CPU executor's default grid:
    /// 1,8,64; --quick: 1,8).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<u32>,
    /// gather: tokens of context per request (default 32768,131072; the CPU
    /// executor's default grid: 32768; --quick: 8192).
    #[arg(long, value_delimiter = ',')]
    context: Vec<u32>,
    /// gather: how top-k indices are drawn (default uniform,locality).
    #[arg(long, value_enum, value_delimiter = ',')]
    indices: Vec<Indices>,
    /// gather: pages of the pool's anonymous or NUMA memory, each a pool of
    /// its own (default base: the kernel's choice; transparent: transparent
    /// huge pages asked for; the output says how many bytes got them).
    #[arg(long, value_enum, value_delimiter = ',')]
    host_pages: Vec<PoolPages>,
    /// swap-in: hot buffer sizes (LRU slots per request; default 4096,8192;
    /// the CPU executor's default grid and --quick: 4096).
    #[arg(long, value_delimiter = ',')]
    hot: Vec<u32>,
    /// swap-in: misses per request (of the top-k).
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 410])]
    misses: Vec<u32>,
    /// swap-in: top-k per request: tokens (default 2048; --swap-path
    /// dsv4-c4: 512, DeepSeek-V4-Flash's) or, for m3-kv, blocks of 128
    /// tokens (default 16, MiniMax-M3's).
    #[arg(long)]
    swap_k: Option<u32>,
    /// swap-in: the SGLang path whose rows and queries the grid has: mla
    /// (load_cache_to_device_buffer_mla: linear rows of --entry bytes, token
    /// queries; DeepSeek-V3.2, GLM), dsv4-c4
    /// (load_cache_to_device_buffer_dsv4_mla: DeepSeek-V4's page-padded C4
    /// rows, 576 B of value and 8 B of scale; --entry not taken) or m3-kv
    /// (load_blocks_to_device_buffer_mha: MiniMax-M3's K and V planes of
    /// --entry bytes each, default 256, queries of 128-token blocks). Paths
    /// other than mla: --scenario swap-in only, no --trace.
    #[arg(long, value_enum, default_value_t = SwapPath::Mla)]
    swap_path: SwapPath,
    /// swap-in: time calls of a top-k trace (recorded by the SGLang shim's
    /// `trace` setting, or `kvtier trace synth`) instead of drawn indices:
    /// each call from the hot-buffer state the trace's replay reaches before
    /// it, at the trace's HOT size, its items --entry bytes (default: the
    /// trace's item size, else fp8-dsa). Runs the swap-in scenario only,
    /// unless --scenario decode-step: then every decode step of the trace
    /// (or of a recipe, `kvtier trace synth --recipe`) is replayed (default:
    /// the committed recipes).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// decode-step: replay every step once and check each row's misses
    /// against the trace's recorded outcome; time nothing.
    #[arg(long)]
    replay_only: bool,
    /// decode-step, a trace with shared-index layers, on a GPU: the length
    /// of the compute stand-in (a device memset) each layer's swap-in or
    /// replay is followed by, in µs, to measure the replays on a second
    /// stream against in order.
    #[arg(long, default_value_t = 100.0)]
    compute_us: f64,
    /// swap-in --trace: calls to time, spread evenly over the calls that
    /// have a request longer than its HOT buffer (the others copy nothing).
    #[arg(long, default_value_t = 8, requires = "trace")]
    trace_calls: u32,
    /// engram-gather: tokens whose Engram rows one layer gathers (24 rows a
    /// token; default 1,8,64,320,8192: decode, a 64-token verify of 5
    /// drafts, prefill; the CPU executor's default grid: 1,64,8192;
    /// --quick: 1,64).
    #[arg(long, value_delimiter = ',')]
    engram_tokens: Vec<u32>,
    /// engram-gather: rows of the table (264 B each; default: as many as
    /// --pool-memory holds, at most 384M, DeepSeek-V4.1-Flash's; the CPU
    /// executor's default grid: 2M; --quick: 64K).
    #[arg(long)]
    engram_rows: Option<u64>,
    /// writeback: tokens of the prefill chunk written back for one layer
    /// (default 1024,8192; --quick: 1024).
    #[arg(long, value_delimiter = ',')]
    prefill_tokens: Vec<u32>,
    /// writeback: layers of a decode token written back at once.
    #[arg(long, default_value_t = 61)]
    layers: u32,
    /// Timed iterations per measurement (default 50; the CPU executor's
    /// default grid: 20; --quick: 10).
    #[arg(long)]
    iters: Option<u32>,
    /// Untimed warm-up iterations per measurement (default 5; the CPU
    /// executor's default grid: 3; --quick: 2).
    #[arg(long)]
    warmup: Option<u32>,
    /// Time budget per measurement in seconds: a slow method stops warming up
    /// after this (with at least one warm-up call) and stops sampling after
    /// it (with at least 5 samples); the output says how many it took
    /// (default 5; the CPU executor's default grid and --quick: 1).
    #[arg(long)]
    max_seconds: Option<f64>,
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
    /// without a GPU; CI runs it). It lowers defaults only: a flag given
    /// keeps its value.
    #[arg(long)]
    quick: bool,
    /// The full grid on the CPU executor too (several minutes and several
    /// GB). Without it the CPU executor runs a grid of about a minute (lower
    /// defaults, said on stderr; a flag given keeps its value); on a GPU the
    /// full grid is the default.
    #[arg(long, conflicts_with = "quick")]
    full: bool,
    /// Seed of the index and data generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write every measurement as one JSON object per line here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the figures into this folder (made if missing):
    /// headline.png, every method against the link's limit at each grid
    /// point; and one figure per scenario (gather.png, swap-in.png, ...),
    /// latency against k or batch; medians with the samples' spread.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// TrueType font for the figures' text (default: DejaVu Sans or another
    /// font found under /usr/share/fonts).
    #[arg(long)]
    plot_font: Option<PathBuf>,
    /// Measure nothing: draw the figures (--plot DIR) or write the copy
    /// method table (--copy-choice FILE) from these files of earlier runs'
    /// --json output (a COMMIT file beside one names the commit its lines do
    /// not).
    #[arg(long, value_delimiter = ',', value_name = "FILE")]
    from_json: Vec<PathBuf>,
    /// Write the copy method table the gather and writeback rows decide (the
    /// run's, or --from-json's) to FILE: per copy path, GPU architecture,
    /// entry size and call size, the method that was clearly faster than
    /// the default's somewhere and clearly slower nowhere (the library embeds
    /// the committed runs' table, `kvtier::CopyMethodTable::measured`).
    #[arg(long, value_name = "FILE")]
    copy_choice: Option<PathBuf>,
    /// With --from-json: print where the files' swap-in rows leave the
    /// swap-in's goals (the default against SGLang's kernel at every point,
    /// every other kvtier row against the default, the latency-bound and
    /// link-bound regimes), by the quartile rule the defaults are decided by.
    #[arg(long, requires = "from_json")]
    swap_in_report: bool,
    /// A file naming swap-in builds no GPU had run before that hung (made
    /// if missing; one a line): they are skipped (and the run ends with an
    /// error saying so), and one that does not finish within 2 x
    /// --max-seconds + 10 s now is added to it before the bench ends (exit
    /// status 75) with the points before it written. A build no GPU has
    /// run that fails otherwise is left out of its point, and the run ends
    /// with an error naming it. The GPU suite passes one file a bundle to
    /// all its benches.
    #[arg(long, value_name = "FILE")]
    hung_builds: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Gather,
    SwapIn,
    /// The speculative swap-in (MTP/EAGLE verify).
    SpecSwapIn,
    Writeback,
    /// DeepSeek-V4.1's Engram row gather.
    EngramGather,
    /// Every swap-in of a decode step replayed from a trace, in a CUDA
    /// graph, beside SGLang's kernel and the link's floor.
    DecodeStep,
    All,
}

/// The gather pool's pages (`kvtier::HostPages`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum PoolPages {
    /// The kernel's choice (4 KiB pages unless the system makes every
    /// anonymous mapping huge).
    Base,
    /// Transparent huge pages asked for (2 MiB where the kernel finds them).
    Transparent,
}

impl PoolPages {
    fn name(self) -> &'static str {
        match self {
            PoolPages::Base => "base",
            PoolPages::Transparent => "transparent",
        }
    }

    fn host_pages(self) -> kvtier::HostPages {
        match self {
            PoolPages::Base => kvtier::HostPages::Base,
            PoolPages::Transparent => kvtier::HostPages::Transparent,
        }
    }
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

/// The fewest samples a p99 is reported for: below this the nearest-rank
/// 99th percentile is the largest sample, reported as the max.
pub(super) const P99_MIN_SAMPLES: usize = 100;

/// A method's timing: its samples' median, quartiles and max, the 99th
/// percentile where there are enough of them (see [`P99_MIN_SAMPLES`]), and
/// how many.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Stats {
    pub median_us: f64,
    /// First and third quartiles (the figures' spread).
    pub q1_us: f64,
    pub q3_us: f64,
    pub p99_us: Option<f64>,
    pub max_us: f64,
    pub samples: usize,
}

impl Stats {
    /// The statistics of `samples` (at least one), percentiles nearest-rank.
    fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let rank = |q: f64| samples[((n as f64 * q).ceil() as usize).clamp(1, n) - 1];
        let p99 = rank(0.99);
        Stats {
            median_us: samples[n / 2],
            q1_us: rank(0.25),
            q3_us: rank(0.75),
            p99_us: (n >= P99_MIN_SAMPLES).then_some(p99),
            max_us: samples[n - 1],
            samples: n,
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
    /// Its samples' statistics.
    pub time: Stats,
    /// The point's limit: the ratio column divides its time by the others'.
    pub limit: bool,
}

impl Measurement {
    /// A method's timing at the point `params`.
    pub fn new(
        scenario: &'static str,
        method: &'static str,
        params: &[(&'static str, serde_json::Value)],
        bytes: usize,
        t: Stats,
        limit: bool,
    ) -> Self {
        Measurement {
            scenario,
            method,
            params: params.to_vec(),
            bytes: bytes as u64,
            time: t,
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

/// The byte every piece of host row `row` holds on plane `plane` (a V row
/// differs from its K row, so that a plane copied from the other shows).
pub(super) fn host_pattern(plane: usize, row: usize) -> u8 {
    row_pattern(row) ^ (plane as u8).wrapping_mul(0x5a)
}

/// A pool of `pages` pages of `layout` (`page_bytes` each) on each of
/// `planes` planes, a layer a plane and an entry a page as SGLang's host
/// pools lay rows out (a linear layout's page is one row), every row's
/// pieces filled with [`host_pattern`]; and the region that holds them.
pub(super) fn patterned_host_pool(
    b: &Bench,
    layout: &kvtier::ItemLayout,
    page_bytes: u32,
    planes: usize,
    pages: usize,
) -> kvtier::Result<(Arc<kvtier::Pool>, kvtier::Region)> {
    let pool_layout = kvtier::LayerFirstLayout::new(page_bytes, planes as u32, pages as u32)?;
    let pool = kvtier::Pool::create(
        pool_layout,
        b.pool_device(kvtier::Pool::device_bytes_for(&pool_layout, 1)?),
    )?;
    let region = pool.alloc_region()?;
    let (page, per_page) = (page_bytes as usize, layout.rows_per_page() as usize);
    // pages a write, about 4096 rows
    let chunk = (4096 / per_page).max(1);
    let mut bytes = vec![0u8; chunk * page];
    for plane in 0..planes {
        for first in (0..pages).step_by(chunk) {
            let n = chunk.min(pages - first);
            for row in first * per_page..(first + n) * per_page {
                for (at, len) in layout.pieces(row as u64) {
                    let at = at as usize - first * page;
                    bytes[at..at + len].fill(host_pattern(plane, row));
                }
            }
            pool.write_tokens(&region, plane as u32, first as u32, &bytes[..n * page])?;
        }
    }
    Ok((pool, region))
}

/// A method's name for the executor it ran on.
pub(super) fn named(exec: &Executor, cpu: &'static str, cuda: &'static str) -> &'static str {
    match exec {
        Executor::Cpu => cpu,
        Executor::Cuda(_) => cuda,
    }
}

/// What every scenario needs: the arguments, the executor, the progress bar,
/// and where each point's measurements go as it completes (--json).
pub(super) struct Bench<'a> {
    pub args: &'a BenchArgs,
    pub exec: Executor,
    pub progress: ProgressBar,
    json: Option<report::JsonSink>,
    /// Timings that failed and were left out (Bench::failed).
    failures: std::cell::RefCell<Vec<String>>,
    /// The time limit on timings of builds no GPU has run yet.
    watchdog: watchdog::Watchdog,
}

impl<'a> Bench<'a> {
    /// A bench of `args` on `exec`: no progress bar, no --json file yet, the
    /// watchdog on --hung-builds.
    pub fn new(args: &'a BenchArgs, exec: Executor) -> kvtier::Result<Self> {
        Ok(Bench {
            args,
            exec,
            progress: ProgressBar::hidden(),
            json: None,
            failures: Default::default(),
            watchdog: watchdog::Watchdog::new(args.hung_builds.as_deref(), args.untried_limit())?,
        })
    }

    /// A grid point is done: `point` (its measurements) goes to the --json
    /// file at once, and the progress bar moves on.
    pub fn point_done(&self, point: &[Measurement]) -> kvtier::Result<()> {
        if let Some(sink) = &self.json {
            sink.append(point)?;
        }
        self.progress.inc(1);
        Ok(())
    }

    /// `what` failed at the point under way and is left out of it: said at
    /// once, and the run ends with an error naming every such failure, after
    /// writing every point (a method no GPU has run yet must not cost the
    /// others' timings).
    pub fn failed(&self, what: &str, e: &kvtier::Error) {
        let msg = format!("{what} failed at {}: {e}", self.progress.message());
        self.progress
            .suspend(|| println!("note: {msg}; left out of this point"));
        self.failures.borrow_mut().push(msg);
    }

    /// Times build `what`, one no GPU had run before (see --hung-builds):
    /// skipped where an earlier run found it hung, under the watchdog's
    /// limit, and left out of the point ([`Bench::failed`]) if it fails. An
    /// error is returned only when the failure broke the GPU's context
    /// (every later call would fail, and be blamed): it names the build.
    pub fn untried(
        &self,
        what: &str,
        time: impl FnOnce() -> kvtier::Result<Stats>,
    ) -> kvtier::Result<Option<Stats>> {
        if self.watchdog.hung_before(what) {
            self.failed(
                what,
                &kvtier::Error::Pool(
                    "skipped: an earlier run found it hung (--hung-builds)".into(),
                ),
            );
            return Ok(None);
        }
        match self.watchdog.guard(what, time) {
            Ok(t) => Ok(Some(t)),
            Err(e) => {
                self.failed(what, &e);
                if let Executor::Cuda(dev) = &self.exec
                    && let Err(broken) = dev.synchronize_all()
                {
                    return Err(kvtier::Error::Pool(format!(
                        "{what} failed ({e}) and left the GPU's context broken: {broken}"
                    )));
                }
                Ok(None)
            }
        }
    }

    /// An error naming the timings that failed ([`Bench::failed`]), if any.
    pub fn no_failures(&self) -> kvtier::Result<()> {
        let failures = self.failures.borrow();
        if failures.is_empty() {
            return Ok(());
        }
        Err(kvtier::Error::Pool(format!(
            "{} left out of the measurements: {}",
            count(
                failures.len() as u64,
                "timing failed and was",
                "timings failed and were"
            ),
            failures.join("; ")
        )))
    }

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

    /// The default or given hot buffer sizes.
    pub fn hot(&self) -> &[u32] {
        self.args.hot()
    }

    /// The timing (µs) of `f` on `clock`'s stream; `reset` runs
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
    ) -> kvtier::Result<Stats> {
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
    fn sample(&self, mut once: impl FnMut() -> kvtier::Result<f64>) -> kvtier::Result<Stats> {
        let budget = self.budget();
        let warm = Instant::now();
        for i in 0..self.args.warmup() {
            if i >= 1 && warm.elapsed() > budget {
                break;
            }
            once()?;
        }
        let mut samples = Vec::with_capacity(self.args.iters() as usize);
        let start = Instant::now();
        for i in 0..self.args.iters() {
            if i >= 5 && start.elapsed() > budget {
                break;
            }
            samples.push(once()?);
        }
        Ok(Stats::of(samples))
    }

    /// The gather's pool memory budget in bytes.
    pub fn pool_budget(&self) -> kvtier::Result<u64> {
        pool_budget(self.args)
    }

    fn budget(&self) -> Duration {
        Duration::from_secs_f64(self.args.max_seconds().max(0.0))
    }
}

// The full grid's defaults of the flags that the CPU executor's default grid
// or `--quick` lower.
const HOT: [u32; 2] = [4096, 8192];
const ITERS: u32 = 50;
const WARMUP: u32 = 5;
const MAX_SECONDS: f64 = 5.0;

/// The full grid's Engram tokens per gather.
const ENGRAM_TOKENS: [u32; 5] = [1, 8, 64, 320, 8192];
/// DeepSeek-V4.1-Flash's table rows (its config's engram_num_embeddings).
const ENGRAM_MAX_ROWS: u64 = 384_016_682;

impl BenchArgs {
    fn engram_tokens(&self) -> &[u32] {
        if self.engram_tokens.is_empty() {
            &ENGRAM_TOKENS
        } else {
            &self.engram_tokens
        }
    }

    /// The rows given, else as many as the pool budget holds (at most a
    /// real table's).
    fn engram_rows(&self) -> u64 {
        self.engram_rows
            .unwrap_or_else(|| (pool_budget(self).unwrap_or(0) / 264).min(ENGRAM_MAX_ROWS))
    }

    /// Timed iterations per measurement: the value given or the default.
    fn iters(&self) -> u32 {
        self.iters.unwrap_or(ITERS)
    }

    fn warmup(&self) -> u32 {
        self.warmup.unwrap_or(WARMUP)
    }

    /// How long a timing of a build no GPU has run may take: its warm-up
    /// and its samples stop after --max-seconds each, and 10 s more covers
    /// the calls that cross those limits, the state resets and the checks.
    /// Short, so that a hang is caught well inside the GPU suite's limit
    /// for the bench (its `timeout` would end it with the build unnamed).
    fn untried_limit(&self) -> Duration {
        Duration::from_secs_f64(2.0 * self.max_seconds().max(0.0) + 10.0)
    }

    fn max_seconds(&self) -> f64 {
        self.max_seconds.unwrap_or(MAX_SECONDS)
    }

    fn hot(&self) -> &[u32] {
        if self.hot.is_empty() { &HOT } else { &self.hot }
    }

    /// The swap-in's top-k: the value given or the path's.
    fn swap_k(&self) -> u32 {
        self.swap_k.unwrap_or(self.swap_path.default_k())
    }
}

/// Which defaults a run takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grid {
    /// The full grid (a GPU, or `--full`).
    Full,
    /// The CPU executor's grid of about a minute.
    Cpu,
    /// `--quick`.
    Quick,
}

/// A smaller grid's defaults (see [`Grid`]).
struct Lower {
    k: &'static [u32],
    batch: &'static [u32],
    context: &'static [u32],
    /// None: the full grid's.
    prefill_tokens: Option<&'static [u32]>,
    hot: &'static [u32],
    engram_tokens: &'static [u32],
    engram_rows: u64,
    iters: u32,
    warmup: u32,
    max_seconds: f64,
}

/// Sets the flags not given to `grid`'s defaults where they are lower than
/// the full grid's; a flag given keeps its value. Returns what was lowered,
/// as "--flag used (not default)".
fn lower_defaults(args: &mut BenchArgs, grid: Grid) -> Vec<String> {
    let mut lowered = Vec::new();
    let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let Lower {
        k,
        batch,
        context,
        prefill_tokens: prefill,
        hot,
        engram_tokens,
        engram_rows,
        iters,
        warmup,
        max_seconds,
    } = match grid {
        Grid::Full => return lowered,
        Grid::Cpu => Lower {
            k: &[256, 2048],
            batch: &[1, 8, 64],
            context: &[32768],
            prefill_tokens: None,
            hot: &[4096],
            engram_tokens: &[1, 64, 8192],
            engram_rows: 2 << 20,
            iters: 20,
            warmup: 3,
            max_seconds: 1.0,
        },
        Grid::Quick => Lower {
            k: &[256, 2048],
            batch: &[1, 8],
            context: &[8192],
            prefill_tokens: Some(&[1024]),
            hot: &[4096],
            engram_tokens: &[1, 64],
            engram_rows: 64 << 10,
            iters: 10,
            warmup: 2,
            max_seconds: 1.0,
        },
    };
    // Reported only where it changes what the scenarios run measure.
    let runs =
        |these: &[Scenario]| args.scenario == Scenario::All || these.contains(&args.scenario);
    let (gather, swap, spec) = (
        runs(&[Scenario::Gather]),
        runs(&[Scenario::SwapIn]),
        runs(&[Scenario::SpecSwapIn]),
    );
    let batch_lowered = match grid {
        // gather's and writeback's own are the CPU grid's
        Grid::Cpu => swap || spec,
        _ => true,
    };
    let mut set = |flag: &str, v: &mut Vec<u32>, to: &[u32], full: &str, matters: bool| {
        if v.is_empty() {
            *v = to.to_vec();
            if matters {
                lowered.push(format!("{flag} {} (not {full})", list(to)));
            }
        }
    };
    set("--k", &mut args.k, k, "256,512,1024,2048", gather);
    set(
        "--batch",
        &mut args.batch,
        batch,
        "each scenario's own",
        batch_lowered,
    );
    set(
        "--context",
        &mut args.context,
        context,
        "32768,131072",
        gather,
    );
    if let Some(p) = prefill {
        let writeback = runs(&[Scenario::Writeback]);
        set(
            "--prefill-tokens",
            &mut args.prefill_tokens,
            p,
            "1024,8192",
            writeback,
        );
    }
    // the speculative swap-in takes the first size only
    set("--hot", &mut args.hot, hot, &list(&HOT), swap);
    let engram = runs(&[Scenario::EngramGather]);
    set(
        "--engram-tokens",
        &mut args.engram_tokens,
        engram_tokens,
        &list(&ENGRAM_TOKENS),
        engram,
    );
    if args.engram_rows.is_none() {
        args.engram_rows = Some(engram_rows);
        if engram {
            lowered.push(format!(
                "--engram-rows {engram_rows} (not as many as --pool-memory holds)"
            ));
        }
    }
    // (DeepSeek-V4's C4 rows take no --entry, MiniMax-M3's have their own)
    if grid == Grid::Quick && args.entry.is_empty() && args.swap_path == SwapPath::Mla {
        args.entry = vec!["fp8-dsa".into()];
        lowered.push("--entry fp8-dsa (not each scenario's own)".into());
    }
    let mut set = |flag: &str, v: &mut Option<u32>, to: u32, full: u32| {
        if v.is_none() {
            *v = Some(to);
            lowered.push(format!("{flag} {to} (not {full})"));
        }
    };
    set("--iters", &mut args.iters, iters, ITERS);
    set("--warmup", &mut args.warmup, warmup, WARMUP);
    if args.max_seconds.is_none() {
        args.max_seconds = Some(max_seconds);
        lowered.push(format!("--max-seconds {max_seconds} (not {MAX_SECONDS})"));
    }
    lowered
}

/// "1 point", "2 points".
pub(crate) fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

pub fn run(mut args: BenchArgs) -> kvtier::Result<()> {
    if args.iters == Some(0) || args.batch.contains(&0) {
        return Err(invalid(
            "--iters/--batch",
            "need at least one iteration and batch sizes >= 1",
        ));
    }
    if args.swap_path != SwapPath::Mla
        && (args.scenario != Scenario::SwapIn || args.trace.is_some())
    {
        // Its rows and queries are the swap-in grid's alone; a trace's
        // calls are timed as DSA's linear token rows.
        return Err(invalid(
            "--swap-path",
            format!(
                "{} is for the swap-in scenario's grid: give --scenario swap-in, without --trace",
                args.swap_path.name()
            ),
        ));
    }
    if args.trace.is_some() {
        // A trace runs at its own HOT size and is swap-in's alone.
        if !args.hot.is_empty() {
            return Err(invalid(
                "--hot",
                "a trace runs at the HOT size it names (kvtier plan --trace replays it at others)",
            ));
        }
        match args.scenario {
            Scenario::All | Scenario::SwapIn => args.scenario = Scenario::SwapIn,
            Scenario::DecodeStep => {}
            other => {
                let name = other
                    .to_possible_value()
                    .map(|v| v.get_name().to_string())
                    .unwrap_or_default();
                return Err(invalid(
                    "--trace",
                    format!("is for the swap-in scenario, not {name}"),
                ));
            }
        }
    }
    // A typo in an output path or a missing font must not cost the run.
    check_outputs(&args)?;
    if !args.from_json.is_empty() {
        if args.plot.is_none() && args.copy_choice.is_none() && !args.swap_in_report {
            return Err(invalid(
                "--from-json",
                "measures nothing: give --plot DIR, --copy-choice FILE, --swap-in-report or \
                 several",
            ));
        }
        let records = figures::read(&args.from_json)?;
        if args.swap_in_report {
            print!("{}", swap_in_report::report(&records)?);
        }
        write_copy_choice(&args, &records)?;
        return draw_figures(&args, &records);
    }
    pool_budget(&args)?;
    let (exec, why_cpu) = choose_executor(&args)?;
    let grid = if args.quick {
        Grid::Quick
    } else if !args.full && matches!(exec, Executor::Cpu) {
        // About a minute on a CPU: fewer points and samples than the full
        // grid, every scenario and method still there.
        Grid::Cpu
    } else {
        Grid::Full
    };
    let lowered = lower_defaults(&mut args, grid);
    if grid == Grid::Cpu && !lowered.is_empty() {
        // Said once, on stderr, so that no value is changed unseen.
        eprintln!(
            "note: the CPU executor's default grid (about a minute) lowers the defaults of flags not \
             given: {}; give those flags to set them, or --full for the full grid",
            lowered.join(", ")
        );
    }
    let env = report::Environment::probe(&exec, why_cpu.as_deref());
    println!("{}", env.banner());

    let bench = Bench::new(&args, exec)?;
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
            all.push(Scenario::EngramGather);
            all.push(Scenario::DecodeStep);
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
            Scenario::EngramGather => engram::points(&bench),
            Scenario::DecodeStep => decode_step::points(&bench),
            Scenario::All => Ok(0),
        })
        .sum::<kvtier::Result<u64>>()?;
    // A bar on a terminal (stderr); nothing in logs and CI.
    let progress = ProgressBar::new(total);
    progress.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} points {elapsed_precise} {msg}")
            .expect("a valid template"),
    );
    // one timestamp for the run (its start), on every line
    let timestamp = report::rfc3339_now();
    let json = match &args.json {
        Some(path) => Some(report::JsonSink::create(path, env.clone(), &timestamp)?),
        None => None,
    };
    let bench = Bench {
        progress,
        json,
        ..bench
    };
    println!(
        "plan: {}, each method timed {} after {} (at most {} s per measurement); the gather pool \
         uses up to {}{}",
        count(total, "grid point", "grid points"),
        count(args.iters(), "time", "times"),
        count(args.warmup(), "warm-up call", "warm-up calls"),
        args.max_seconds(),
        kvtier::pool::human_size(pool_budget(&args)?),
        if grid == Grid::Cpu && !lowered.is_empty() {
            "; the CPU executor's default grid (about a minute): --full for all of it"
        } else {
            ""
        }
    );

    let mut all = Vec::new();
    for s in scenarios {
        let rows = match s {
            Scenario::Gather => gather::run(&bench)?,
            Scenario::SwapIn => swap_in::run(&bench)?,
            Scenario::SpecSwapIn => spec_swap_in::run(&bench)?,
            Scenario::Writeback => writeback::run(&bench)?,
            Scenario::EngramGather => engram::run(&bench)?,
            Scenario::DecodeStep => decode_step::run(&bench)?,
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
        "\nn = samples. p99 is given from {P99_MIN_SAMPLES} samples on (\"-\" below: there it would be the \
         max). GB/s = bytes the method moves / median time (\"-\": no bytes). vs limit = the limit's \
         median time / this method's median time, for the same useful bytes (1.00 = as fast as the \
         limit)."
    );
    let lines = report::json_lines(&env, &all, &timestamp);
    if let Some(sink) = &bench.json {
        // every measurement went to the file with its point (Bench::point_done)
        if sink.written() != all.len() as u64 {
            return Err(kvtier::Error::Pool(format!(
                "internal: {} of {} measurements reached {}",
                sink.written(),
                all.len(),
                sink.path().display()
            )));
        }
        println!(
            "wrote {} to {}",
            count(all.len() as u64, "measurement", "measurements"),
            sink.path().display()
        );
    }
    if args.plot.is_some() || args.copy_choice.is_some() {
        // The figures and the table come from the JSON lines, as
        // --from-json's do.
        let records = lines
            .iter()
            .map(|l| figures::Record::parse(l, None))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                invalid(
                    "--plot",
                    format!("a measurement the figures cannot read: {e}"),
                )
            })?;
        write_copy_choice(&args, &records)?;
        draw_figures(&args, &records)?;
    }
    bench.no_failures()
}

/// --copy-choice FILE: the copy method table `records` decide.
fn write_copy_choice(args: &BenchArgs, records: &[figures::Record]) -> kvtier::Result<()> {
    let Some(path) = &args.copy_choice else {
        return Ok(());
    };
    let table = copy_choice::derive(records)?;
    std::fs::write(path, table.to_json()).map_err(|e| {
        invalid(
            "--copy-choice",
            format!("cannot write {}: {e}", path.display()),
        )
    })?;
    println!(
        "wrote {} to {}",
        count(
            table.choices.len() as u64,
            "copy method choice",
            "copy method choices"
        ),
        path.display()
    );
    Ok(())
}

fn draw_figures(args: &BenchArgs, records: &[figures::Record]) -> kvtier::Result<()> {
    let Some(dir) = &args.plot else {
        return Ok(()); // --copy-choice alone
    };
    register_font(args.plot_font.as_deref())?;
    let files = figures::draw_all(dir, records)?;
    println!(
        "wrote {} to {}: {}",
        count(files.len() as u64, "figure", "figures"),
        dir.display(),
        files
            .iter()
            .filter_map(|f| f.file_name()?.to_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// `--pool-memory` in bytes: the size given, or (auto) 8 GiB or half the
/// available memory, whichever is less.
/// Opens every output path for writing (and finds the plot's font) before
/// anything is measured; a file made here is removed again.
fn check_outputs(args: &BenchArgs) -> kvtier::Result<()> {
    if args.plot.is_some() {
        report::find_font(args.plot_font.as_deref())?;
    }
    if let Some(dir) = &args.plot {
        if dir
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("png"))
        {
            return Err(invalid(
                "--plot",
                format!(
                    "takes a folder for the figures (headline.png and one per scenario), not a \
                     PNG file: {}",
                    dir.display()
                ),
            ));
        }
        if dir.exists() && !dir.is_dir() {
            return Err(invalid(
                "--plot",
                format!("{} is a file, not a folder for the figures", dir.display()),
            ));
        }
        // A folder made here stays (empty) if the run fails: harmless.
        std::fs::create_dir_all(dir)
            .and_then(|()| {
                let probe = dir.join(".kvtier-write-check");
                std::fs::write(&probe, b"")?;
                std::fs::remove_file(probe)
            })
            .map_err(|e| {
                invalid(
                    "--plot",
                    format!("cannot write into {}: {e}", dir.display()),
                )
            })?;
    }
    for (flag, path) in [("--json", &args.json), ("--copy-choice", &args.copy_choice)] {
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

#[cfg(test)]
mod tests {
    use super::{Bench, Measurement, P99_MIN_SAMPLES, Stats, report};

    /// Each point reaches the --json file as it completes (a run cut later
    /// keeps it), and a timing left out makes the run's result an error
    /// naming it and the point.
    #[test]
    fn points_are_written_as_they_complete_and_failures_are_named() {
        let dir = std::env::temp_dir().join(format!("kvtier-sink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("points.jsonl");
        let args = super::link::bench_args(&[]).unwrap();
        let exec = kvtier::Executor::cpu();
        let env = report::Environment::probe(&exec, Some("test"));
        let b = Bench {
            json: Some(report::JsonSink::create(&path, env, "2026-11-28T00:00:00Z").unwrap()),
            ..Bench::new(&args, exec).unwrap()
        };
        let lines = || std::fs::read_to_string(&path).unwrap().lines().count();
        let m = |method| {
            let t = Stats::of(vec![2.0, 1.0, 3.0]);
            Measurement::new("swap-in", method, &[("batch", 1.into())], 64, t, false)
        };
        assert_eq!(lines(), 0);
        b.point_done(&[m("a"), m("b")]).unwrap();
        assert_eq!(lines(), 2, "the first point is on disk before the run ends");
        b.point_done(&[m("c")]).unwrap();
        assert_eq!(lines(), 3);
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains(r#""method":"c""#)
        );
        b.no_failures().unwrap();
        b.progress
            .set_message("swap-in: 656 B, hot 4096, batch 1, 2 misses");
        b.failed(
            "the kvtier swap-in, split planner",
            &kvtier::Error::Pool("launch refused".into()),
        );
        let e = b.no_failures().unwrap_err().to_string();
        for part in [
            "1 timing failed",
            "split planner",
            "batch 1, 2 misses",
            "launch refused",
        ] {
            assert!(e.contains(part), "{part:?} not in {e:?}");
        }
        // Bench::untried: a timing's result, or None with the failure named
        let t = b.untried("the fixed-shape build", || Ok(Stats::of(vec![4.0])));
        assert_eq!(t.unwrap().map(|t| t.median_us), Some(4.0));
        let t = b.untried("the cluster build", || {
            Err(kvtier::Error::Pool("wrong page table".into()))
        });
        assert!(t.unwrap().is_none());
        let e = b.no_failures().unwrap_err().to_string();
        // every failure named, in order
        assert!(e.contains("2 timings failed"), "{e}");
        let (split, cluster) = (e.find("launch refused"), e.find("wrong page table"));
        assert!(
            split.is_some() && cluster.is_some() && split < cluster,
            "{e}"
        );
        // one timestamp for the run, on every line
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.matches(r#""timestamp":"2026-11-28T00:00:00Z""#)
                .count(),
            3,
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_p99_needs_enough_samples() {
        // 1..=n µs: below 100 samples the 99th percentile would be the max
        let of = |n: usize| Stats::of((1..=n).rev().map(|x| x as f64).collect());
        let few = of(P99_MIN_SAMPLES - 1);
        assert_eq!((few.p99_us, few.max_us, few.samples), (None, 99.0, 99));
        let enough = of(P99_MIN_SAMPLES);
        assert_eq!((enough.p99_us, enough.max_us), (Some(99.0), 100.0));
        assert_eq!(of(1000).p99_us, Some(990.0));
        assert_eq!(of(1).median_us, 1.0);
        // quartiles, nearest-rank: 1..=20 µs gives 5 and 15
        let q = of(20);
        assert_eq!((q.q1_us, q.median_us, q.q3_us), (5.0, 11.0, 15.0));
    }
}
