//! The `decode-step` scenario: what a decode step costs in swap-ins. A
//! trace (a recorded one, or a recipe's synthetic one) is replayed a decode
//! step at a time: every layer's swap-in of the step back to back on one
//! stream, captured once in a CUDA graph and replayed, as SGLang's decode
//! runs them, at SGLang's padded CUDA-graph batch (the smallest of its
//! decode buckets that holds the step's requests; `num_real_reqs` the real
//! ones, padding rows with request row 0 and sequence length 1, as SGLang's
//! graph runner fills them). Per measured step, from the same state
//! restored untimed before every replay:
//!
//! 1. kvtier's swap-ins of the step ([`DECODE_STEP_KVTIER_METHOD`]) as
//!    `Tier::swap_in` runs them for the batch and GPU (the JSON's
//!    `strategy`, `build` and `copy`), and on a GPU the plain builds of the two
//!    strategies it chooses between (`FewMiss`, `FewMissOneLaunch`: the
//!    defaults before the H200 run of 2026-11-28 chose the split planner
//!    and the fixed-shape build);
//! 2. SGLang 0.5.23's own kernel for the trace's path on identical inputs
//!    (CUDA executor, with `KVTIER_SGLANG_KERNELS`, where its harness is
//!    built for the shape: [`SglangKernels::serves_swap_in`]), its page
//!    tables compared with kvtier's;
//! 3. the link's floor: each call's missed bytes in one contiguous copy a
//!    plane, the step's copies back to back (in a graph of their own).
//!
//! The rows lie as SGLang's entry point for the trace lays them out
//! ([`SwapPath::of_trace`]): linear MLA rows (DeepSeek-V3.2), DeepSeek-V4's
//! C4 pages (a value and a scale in separate runs of a 64-row page), or
//! MiniMax-M3's K and V planes, on the host and on the device, so that
//! kvtier's kernels and SGLang's address what they address in serving.
//!
//! Before that, untimed, every call of the step runs once with a miss plan,
//! and each row's misses are compared with the trace's recorded outcome
//! (and a recipe's per-layer totals): a replay that differs is an error,
//! so a run also proves the replay exact. Warm-up steps (the trace header's
//! `warmup_steps`) only run that check. The rows' host KV is one pool of at
//! most `--pool-memory` (request rows beyond it alias earlier ones, and
//! every layer reads the same host rows: aliasing changes address
//! translation, which the output says), and the device buffers are one per
//! layer where they fit, else shared by several layers (which changes
//! nothing a step measures: each layer's swap-in writes its own rows).

use std::path::Path;
use std::sync::Arc;

use serde_json::json;

use kvtier::trace::{TraceCall, TraceHeader, TraceReader, TraceRecipe, TraceShape, steps_of};
use kvtier::{
    Buf, BufMut, Executor, IndexBuf, ItemLayout, KvBuffers, KvPlane, MissPlan, Pool, QueryKind,
    Region, Stream, SwapInArgs, SwapInStrategy, Tier,
};

use super::sglang::SglangKernels;
use super::swap_path::{M3_BLOCK_TOKENS, SwapPath};
use super::{Bench, Clock, Measurement, Stats, Timing, count, host_pattern, invalid};
use crate::transfer::{self, Dir, ExecVec};

pub(super) const SCENARIO: &str = "decode-step";

/// How kvtier's method names begin (`kvtier plan --decode-step` reads its
/// lines): a CUDA graph on the GPU, the calls one after the other on the
/// CPU executor.
pub(crate) const DECODE_STEP_KVTIER_METHOD: &str = "kvtier: the step's swap-ins";
const KVTIER_GRAPH: &str = "kvtier: the step's swap-ins (CUDA graph)";
const KVTIER_CPU: &str = "kvtier: the step's swap-ins (CPU executor)";
/// Beside the default's graph (`Tier::default_swap_in_choice`: the GPU and
/// the bucket), the plain builds of the two strategies the default chooses
/// between: the few-miss planner copying every miss itself (one launch a
/// layer; each request's copy starts when its own plan is done), and the
/// few-miss planner and its copy kernel.
const KVTIER_ONE_LAUNCH: &str = "kvtier few_miss_one_launch: the step's swap-ins (CUDA graph)";
const KVTIER_FEW_MISS: &str = "kvtier few_miss: the step's swap-ins (CUDA graph)";
const SGLANG_METHOD: &str = "SGLang 0.5.23's kernel: the step's swap-ins (CUDA graph)";
const SGLANG_LAUNCHES: &str =
    "SGLang 0.5.23's kernel: the step's swap-ins (launched one by one, no graph)";
const FLOOR_METHOD: &str = "link floor: each call's misses in one contiguous copy";
const STAND_IN_ALONE: &str = "compute stand-in alone (one memset a layer)";
const OVERLAP_IN_ORDER: &str = "kvtier, a compute stand-in a layer: shared-index replays in order";
const OVERLAP_SIDE: &str =
    "kvtier, a compute stand-in a layer: shared-index replays on a second stream";

/// The committed recipes (`bench/traces/`, embedded by build.rs):
/// synthetic decode-step traces of three models at four batches and two
/// contexts, calibrated to the published miss rate for their hot buffer
/// (scripts/make-traces.sh).
pub(super) const RECIPES: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/trace_recipes.rs"));

/// The recipes `--quick` replays (the smallest of each model).
const QUICK: [&str; 3] = ["dsv32-32k-b8", "dsv4flash-32k-b8", "m3-32k-b8"];

/// SGLang 0.5.23's decode CUDA-graph batch sizes without speculation
/// (`generate_decode_cuda_graph_batch_sizes`: 1, 2, 4, 8, 12, then every 8
/// to 256, every 16 to 512, every 32 beyond) up to `max_bs`, and `max_bs`.
pub(super) fn decode_buckets(max_bs: u32) -> Vec<u32> {
    let mut v: Vec<u32> = [1, 2, 4, 8, 12]
        .into_iter()
        .chain((16..=256).step_by(8))
        .chain((272..512).step_by(16))
        .chain((512..=max_bs.max(512)).step_by(32))
        .filter(|&b| b <= max_bs)
        .collect();
    if v.last() != Some(&max_bs) {
        v.push(max_bs);
    }
    v
}

/// The graph a batch of `batch` requests replays: the smallest bucket that
/// holds it (SGLang's default largest bucket on an H100 or H200 at TP < 4
/// is 256, at TP ≥ 4 512; 512 here).
pub(super) fn bucket_of(batch: u32) -> kvtier::Result<u32> {
    decode_buckets(512)
        .into_iter()
        .find(|&b| b >= batch)
        .ok_or_else(|| {
            invalid(
                "--trace",
                format!("a step of {batch} requests is past SGLang's largest decode graph (512)"),
            )
        })
}

/// Where a trace comes from.
enum Source {
    Recipe(Box<TraceRecipe>),
    File(std::path::PathBuf),
}

impl Source {
    fn name(&self) -> String {
        match self {
            Source::Recipe(r) => r.name.clone(),
            Source::File(p) => p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }

    /// The sources a run replays: `--trace` (a trace or a recipe), else the
    /// committed recipes (`--quick` and the CPU executor's default grid:
    /// the smallest of each model).
    fn chosen(b: &Bench) -> kvtier::Result<Vec<Source>> {
        if let Some(path) = &b.args.trace {
            // a committed recipe by its name
            if !path.exists()
                && let Some((_, text)) = RECIPES
                    .iter()
                    .find(|(name, _)| Path::new(name) == path.as_path())
            {
                return Ok(vec![Source::Recipe(Box::new(TraceRecipe::parse(text)?))]);
            }
            let mut head = Vec::new();
            {
                use std::io::Read;
                let f = kvtier::shared_fs::open_input(path, "--trace")?;
                f.take(4096)
                    .read_to_end(&mut head)
                    .map_err(|e| kvtier::Error::Io {
                        context: format!("reading {}", path.display()),
                        source: e,
                    })?;
            }
            return Ok(vec![if TraceRecipe::looks_like(&head) {
                let mut r = TraceRecipe::read(path)?;
                if r.name.is_empty() {
                    r.name = path.display().to_string();
                }
                Source::Recipe(Box::new(r))
            } else {
                Source::File(path.clone())
            }]);
        }
        // the quick grid and the CPU executor's default grid (about a
        // minute): the smallest of each model; --full, a GPU and a replay
        // that times nothing: all
        let small = !b.args.replay_only
            && (b.args.quick || (!b.args.full && matches!(b.exec, Executor::Cpu)));
        RECIPES
            .iter()
            .filter(|(name, _)| !small || QUICK.contains(name))
            .map(|(name, text)| {
                TraceRecipe::parse(text)
                    .map(|r| Source::Recipe(Box::new(r)))
                    .map_err(|e| kvtier::Error::Pool(format!("the committed recipe {name}: {e}")))
            })
            .collect()
    }

    /// The header and the shape the replay allocates for (a first pass over
    /// a file; a recipe's spec says it).
    fn shape(&self) -> kvtier::Result<(TraceHeader, TraceShape, u32)> {
        match self {
            Source::Recipe(r) => {
                let s = &r.spec;
                let header = kvtier::trace::synth_header(s)?;
                let total = s.warmup_steps + s.steps;
                let shape = TraceShape {
                    calls: (total * s.layers) as u64,
                    calls_per_layer: vec![total as u64; s.layers as usize],
                    max_seq: s.context + total,
                    max_cols: s.top_k,
                };
                Ok((header, shape, s.requests))
            }
            Source::File(p) => {
                let f = kvtier::shared_fs::open_input(p, "--trace")?;
                let mut reader = TraceReader::new(std::io::BufReader::new(f))?;
                let mut reqs = std::collections::BTreeSet::new();
                let shape = TraceShape::of((&mut reader).inspect(|c| {
                    if let Ok(c) = c {
                        reqs.extend(c.rows.iter().map(|r| r.req));
                    }
                }))?;
                if shape.calls == 0 {
                    return Err(invalid(
                        "--trace",
                        format!("{} holds no calls", p.display()),
                    ));
                }
                Ok((reader.header, shape, reqs.len() as u32))
            }
        }
    }

    /// Hands the trace's calls, a step at a time, to `step` (memory for one
    /// step).
    fn each_step(
        &self,
        mut step: impl FnMut(usize, &[TraceCall]) -> kvtier::Result<()>,
    ) -> kvtier::Result<usize> {
        let mut pending: Vec<TraceCall> = Vec::new();
        let mut index = 0usize;
        let mut push = |c: TraceCall, pending: &mut Vec<TraceCall>| -> kvtier::Result<()> {
            if kvtier::trace::starts_step(pending.last().map(|p| p.layer), c.layer) {
                step(index, pending)?;
                index += 1;
                pending.clear();
            }
            pending.push(c);
            Ok(())
        };
        match self {
            Source::Recipe(r) => {
                r.synthesize_each(|c| push(c, &mut pending))?;
            }
            Source::File(p) => {
                let f = kvtier::shared_fs::open_input(p, "--trace")?;
                let mut reader = TraceReader::new(std::io::BufReader::new(f))?;
                while let Some(c) = reader.next_call()? {
                    push(c, &mut pending)?;
                }
            }
        }
        if !pending.is_empty() {
            debug_assert_eq!(steps_of(&pending).len(), 1);
            step(index, &pending)?;
            index += 1;
        }
        Ok(index)
    }
}

pub(super) fn points(b: &Bench) -> kvtier::Result<u64> {
    Ok(Source::chosen(b)?.len() as u64)
}

pub(super) fn run(b: &Bench) -> kvtier::Result<Vec<Measurement>> {
    let sglang = match b.exec {
        Executor::Cuda(_) => SglangKernels::from_env()?,
        Executor::Cpu => None,
    };
    let mut rows = Vec::new();
    for source in Source::chosen(b)? {
        b.progress
            .set_message(format!("decode-step: {}", source.name()));
        let point = Replay::run(b, &source, sglang.as_ref())?;
        b.point_done(&point)?;
        rows.extend(point);
    }
    Ok(rows)
}

/// A trace's replay: the state of every layer's hot buffers for the trace's
/// request rows, and the buffers of one step's calls.
struct Replay<'b> {
    b: &'b Bench<'b>,
    name: String,
    model: String,
    /// Where the trace's selections come from, in a few words for every
    /// line and figure panel: synthetic (calibrated or not) or recorded.
    selections: &'static str,
    header: TraceHeader,
    /// Request rows of the state (the trace's `req` values mapped densely).
    rows: usize,
    row_of: std::collections::HashMap<u32, usize>,
    layers: usize,
    hot: usize,
    /// Query columns, and the entries a row resolves (columns × block tokens).
    cols: usize,
    entries: usize,
    /// Bytes one miss moves over every plane (the trace's `item_bytes`).
    item: usize,
    /// SGLang's entry point whose rows the trace's calls move, its row
    /// layout, and a row's bytes on one plane.
    path: SwapPath,
    layout: ItemLayout,
    row_bytes: usize,
    /// Bytes of one plane of the host rows and of a device buffer, whole
    /// pages (a device buffer holds its planes back to back).
    host_plane_bytes: usize,
    device_plane_bytes: usize,
    max_seq: usize,
    /// Positions at the first step (a recipe's context; a file's longest).
    context: usize,
    bucket: usize,
    /// Distinct device buffers (layer `l` uses `l % device_buffers`) and
    /// distinct host rows (request row `r`'s position `t` is host row
    /// `(r × max_seq + t) % host_rows`).
    device_buffers: usize,
    host_rows: usize,
    /// `[layer][row][hot + 1]`, `[layer][row][hot]`: the state, its copy at
    /// the step's start and at its end.
    tokens: ExecVec<i32>,
    lru: ExecVec<i16>,
    start_tokens: ExecVec<i32>,
    start_lru: ExecVec<i16>,
    end_tokens: ExecVec<i32>,
    end_lru: ExecVec<i16>,
    locs: ExecVec<i32>,
    host_locs: ExecVec<i64>,
    device: Vec<ExecVec<u8>>,
    /// Per layer: `[bucket][cols]` queries, `[bucket]` request rows and
    /// lengths, `[bucket][entries]` page tables, and one miss plan.
    topk: ExecVec<i32>,
    req: ExecVec<i32>,
    seq: ExecVec<i32>,
    out: ExecVec<i32>,
    num_real: ExecVec<i32>,
    /// Per layer: `[bucket][entries]` miss plans and `[bucket]` counts (an
    /// anchor's plan is what its shared-index layers replay).
    plan_src: ExecVec<i64>,
    plan_dst: ExecVec<i32>,
    plan_count: ExecVec<i32>,
    /// Each layer's anchor where it is a shared-index layer (SGLang's
    /// `index_topk_freq`), and the engine that replays the anchor's plan.
    anchor_of: Vec<Option<usize>>,
    planned: kvtier::SwapInEngine,
    /// The compute stand-in of the overlap measurement (CUDA, shared-index
    /// traces): a device scratch and the bytes one layer's memset sets, and
    /// how long that took alone.
    stand_in: Option<(ExecVec<u8>, usize, f64)>,
    pool: std::sync::Arc<Pool>,
    region: Region,
    tier: Tier,
    /// A recipe's recorded per-layer misses, `[step][layer]`.
    recorded: Option<Vec<Vec<u64>>>,
}

/// What the checked run of a step found.
struct StepOutcome {
    /// Per call: its layer, real rows and misses.
    calls: Vec<(u32, usize, u64)>,
    /// Rows whose misses were compared with a recorded outcome.
    checked: u64,
    /// Every layer's page tables after the step (`[layer][bucket][entries]`).
    out: Vec<i32>,
}

impl<'b> Replay<'b> {
    fn run(
        b: &'b Bench<'b>,
        source: &Source,
        sglang: Option<&SglangKernels>,
    ) -> kvtier::Result<Vec<Measurement>> {
        let (header, shape, requests) = source.shape()?;
        let mut r = Replay::new(b, source, header, &shape, requests)?;
        let mut measured: Vec<Measurement> = Vec::new();
        let warm = r.header.warmup_steps as usize;
        let mut misses_by_step: Vec<Vec<u64>> = Vec::new();
        let mut checked = 0u64;
        let steps = source.each_step(|s, calls| {
            let outcome = r.check_step(s, calls)?;
            checked += outcome.checked;
            let mut per_layer = vec![0u64; r.layers];
            for &(layer, _, m) in &outcome.calls {
                per_layer[layer as usize] += m;
            }
            if let Some(rec) = &r.recorded
                && let Some(want) = rec.get(s)
                && *want != per_layer
            {
                let l = (0..r.layers).find(|&l| want.get(l) != per_layer.get(l)).unwrap_or(0);
                return Err(kvtier::Error::Pool(format!(
                    "decode-step replay of {}: step {s}, layer {l}: {} misses, the recipe records {}",
                    r.name,
                    per_layer[l],
                    want.get(l).copied().unwrap_or(0)
                )));
            }
            misses_by_step.push(per_layer);
            if s >= warm && !b.args.replay_only {
                measured.extend(r.measure(s, calls, &outcome, sglang)?);
            }
            r.keep_end_state()
        })?;
        if steps <= warm {
            return Err(invalid(
                "--trace",
                format!("{} has {steps} steps, all of them warm-up ({warm})", r.name),
            ));
        }
        let total: u64 = misses_by_step.iter().flatten().sum();
        let checked_words = match (checked, r.recorded.is_some()) {
            (0, false) => "the trace records no outcome: the replay is not checked".to_string(),
            (rows, recipe) => format!(
                "every row's misses as the trace records them ({rows} rows{})",
                if recipe {
                    ", and each layer's total as the recipe records it"
                } else {
                    ""
                }
            ),
        };
        let shared = r.anchor_of.iter().filter(|a| a.is_some()).count();
        let shared_words = if shared == 0 {
            String::new()
        } else {
            format!(
                "; {shared} shared-index layers of {} (SGLang's index_topk_freq {}) replay their anchors' miss plans, \
                 their bytes checked",
                r.layers, r.header.index_topk_freq
            )
        };
        // SGLang's kernel is given but has no line here: say why
        let sglang_words = match sglang {
            Some(_) if shared > 0 => {
                "; SGLang's kernel: no harness replays shared-index layers".to_string()
            }
            Some(_) if !r.sglang_serves() => format!(
                "; SGLang's {} kernel is built for {} only: no line of its own",
                r.path.name(),
                SglangKernels::swap_in_shapes(r.path)
            ),
            _ => String::new(),
        };
        let said = format!(
            "\ndecode-step {}: path {}, laid out as {}{sglang_words}; replayed {} ({} warm-up), {total} misses in all; \
             {checked_words}{shared_words}; bucket {} for {}; {} distinct device buffer(s) for {} layers; {} host rows{}",
            r.name,
            r.path.name(),
            r.layout_words(),
            count(steps as u64, "step", "steps"),
            warm,
            r.bucket,
            count(requests as u64, "request", "requests"),
            r.device_buffers,
            r.layers,
            r.host_rows,
            if r.host_rows < r.rows * r.max_seq {
                format!(
                    " (aliased: {} rows × {} positions share them, and every layer reads the same rows, which changes \
                     address translation)",
                    r.rows, r.max_seq
                )
            } else {
                " (every layer reads the same rows, which changes address translation)".to_string()
            }
        );
        b.progress.suspend(|| println!("{said}"));
        Ok(with_totals(measured))
    }

    fn new(
        b: &'b Bench<'b>,
        source: &Source,
        header: TraceHeader,
        shape: &TraceShape,
        requests: u32,
    ) -> kvtier::Result<Self> {
        let exec = &b.exec;
        let layers = (shape.layers().max(header.layers)).max(1) as usize;
        let hot = header.hot as usize;
        let cols = shape.max_cols.max(1) as usize;
        let entries = cols * header.block_tokens.max(1) as usize;
        // the trace's own item size; --entry only for a trace that names none
        let item = match (header.item_bytes, b.args.entry.as_slice()) {
            (0, []) => 656,
            (0, [e]) => e.parse::<kvtier::EntryFormat>()?.bytes() as usize,
            (0, _) => return Err(invalid("--entry", "a trace runs at one item size")),
            (bytes, _) => bytes as usize,
        };
        if item % 8 != 0 {
            return Err(invalid(
                "--trace",
                format!("the trace's items are {item} B: the swap-in moves multiples of 8 B"),
            ));
        }
        let path = SwapPath::of_trace(header.block_tokens, item as u64);
        let planes = path.planes();
        let row_bytes = item / planes;
        if !row_bytes.is_multiple_of(8) {
            return Err(invalid(
                "--trace",
                format!(
                    "the trace's items are {item} B of K and V: each plane's {row_bytes} B is not a multiple of 8 B"
                ),
            ));
        }
        let layout = path.layout(row_bytes as u32)?;
        debug_assert_eq!(layout.item_bytes() as usize * planes, item);
        let (per_page, page_bytes) = (
            layout.rows_per_page() as usize,
            layout.page_bytes() as usize,
        );
        let rows = requests.max(1) as usize;
        let bucket = bucket_of(rows as u32)? as usize;
        let max_seq = shape.max_seq.max(1) as usize;
        // host rows: the pool budget in whole pages of every plane, at most
        // every (row, position)
        let budget = b.pool_budget()?;
        let budget_pages = ((budget / (page_bytes * planes) as u64) as usize).max(1);
        let host_rows = (budget_pages * per_page).min(rows * max_seq);
        let host_pages = host_rows.div_ceil(per_page);
        let host_plane_bytes = host_pages * page_bytes;
        let device_plane_bytes = (rows * (hot + 1)).div_ceil(per_page) * page_bytes;
        let per_device = planes * device_plane_bytes;
        let device_budget: u64 = match exec {
            Executor::Cpu => 1 << 30,
            Executor::Cuda(dev) => dev
                .memory_info()
                .map(|(free, _)| free / 2)
                .unwrap_or(8 << 30),
        };
        let device_buffers = ((device_budget / per_device.max(1) as u64) as usize).clamp(1, layers);
        let locs: Vec<i32> = (0..(rows * (hot + 1)) as i32).collect();
        let host_locs: Vec<i64> = (0..rows * max_seq)
            .map(|i| (i % host_rows) as i64)
            .collect();
        // The host rows in the pool: a layer a plane, an entry a page (a
        // linear layout's page is one row), as SGLang's host pools lay them
        // out, each row's pieces filled with its plane's pattern.
        let page_bytes_u32 = u32::try_from(page_bytes)
            .map_err(|_| invalid("--trace", format!("{item} B items are too large")))?;
        let (pool, region) =
            super::patterned_host_pool(b, &layout, page_bytes_u32, planes, host_pages)?;
        let mut tier = Tier::new(pool.clone(), exec.clone(), 1)?;
        tier.enable_swap_in(bucket as u32, entries as u32)?;
        let zeroed_i32 = |n: usize| ExecVec::<i32>::zeroed(exec, n);
        let anchor_of: Vec<Option<usize>> = (0..layers as u32)
            .map(|l| {
                kvtier::trace::shared_index_anchor(l, header.index_topk_freq).map(|a| a as usize)
            })
            .collect();
        let state_tokens = vec![-1i32; layers * rows * (hot + 1)];
        let state_lru: Vec<i16> = (0..layers * rows).flat_map(|_| 0..hot as i16).collect();
        let (name, model, recorded) = match source {
            Source::Recipe(r) => (r.name.clone(), r.model.clone(), Some(r.misses.clone())),
            Source::File(_) => (source.name(), "a trace file".to_string(), None),
        };
        Ok(Replay {
            b,
            name,
            model,
            selections: match source {
                Source::Recipe(r) if r.calibration.is_some() => {
                    "synthetic, calibrated to a published miss rate"
                }
                _ if header.synthetic => "synthetic",
                _ => "recorded",
            },
            header,
            rows,
            row_of: Default::default(),
            layers,
            hot,
            cols,
            entries,
            item,
            path,
            layout,
            row_bytes,
            host_plane_bytes,
            device_plane_bytes,
            max_seq,
            context: match source {
                Source::Recipe(r) => r.spec.context as usize,
                Source::File(_) => max_seq,
            },
            bucket,
            device_buffers,
            host_rows,
            tokens: ExecVec::from_host(exec, &state_tokens)?,
            lru: ExecVec::from_host(exec, &state_lru)?,
            start_tokens: ExecVec::from_host(exec, &state_tokens)?,
            start_lru: ExecVec::from_host(exec, &state_lru)?,
            end_tokens: ExecVec::from_host(exec, &state_tokens)?,
            end_lru: ExecVec::from_host(exec, &state_lru)?,
            locs: ExecVec::from_host(exec, &locs)?,
            host_locs: ExecVec::from_host(exec, &host_locs)?,
            device: (0..device_buffers)
                .map(|_| ExecVec::<u8>::zeroed(exec, per_device))
                .collect::<kvtier::Result<_>>()?,
            topk: zeroed_i32(layers * bucket * cols)?,
            req: zeroed_i32(layers * bucket)?,
            seq: zeroed_i32(layers * bucket)?,
            out: zeroed_i32(layers * bucket * entries)?,
            num_real: zeroed_i32(layers)?,
            plan_src: ExecVec::zeroed(exec, layers * bucket * entries)?,
            plan_dst: zeroed_i32(layers * bucket * entries)?,
            plan_count: zeroed_i32(layers * bucket)?,
            anchor_of,
            planned: kvtier::SwapInEngine::new(exec.clone())?,
            stand_in: None,
            pool,
            region,
            tier,
            recorded,
        })
    }

    /// The state row of request `req` (the next free one for a new request).
    fn state_row(&mut self, req: u32) -> kvtier::Result<usize> {
        let next = self.row_of.len();
        let rows = self.rows;
        let r = *self.row_of.entry(req).or_insert(next);
        if r >= rows {
            return Err(kvtier::Error::Pool(format!(
                "decode-step replay of {}: more request rows than the first pass counted",
                self.name
            )));
        }
        Ok(r)
    }

    /// Writes the step's queries, rows and lengths per layer (padding rows:
    /// request row 0, length 1, queries -1; `num_real_reqs` the real ones).
    fn upload(&mut self, calls: &[TraceCall]) -> kvtier::Result<()> {
        let (p, k) = (self.bucket, self.cols);
        for c in calls {
            let l = c.layer as usize;
            if l >= self.layers {
                return Err(invalid(
                    "--trace",
                    format!("layer {l} is past the trace's {} layers", self.layers),
                ));
            }
            if c.rows.len() > p {
                return Err(kvtier::Error::Pool(format!(
                    "decode-step replay of {}: a call of {} rows in a bucket of {p}",
                    self.name,
                    c.rows.len()
                )));
            }
            let mut topk = vec![-1i32; p * k];
            let mut req = vec![0i32; p];
            let mut seq = vec![1i32; p];
            for (i, row) in c.rows.iter().enumerate() {
                topk[i * k..][..row.topk.len()].copy_from_slice(&row.topk);
                req[i] = self.state_row(row.req)? as i32;
                seq[i] = row.seq as i32;
                if row.state.is_some() {
                    self.write_row_state(l, req[i] as usize, row)?;
                }
            }
            // SAFETY (all four): no call is running; the ranges are the layer's.
            unsafe {
                self.topk.write_at(l * p * k, &topk)?;
                self.req.write_at(l * p, &req)?;
                self.seq.write_at(l * p, &seq)?;
                self.num_real.write_at(l, &[c.rows.len() as i32])?;
            }
        }
        Ok(())
    }

    /// A recorded hot-buffer state, where the trace gives one.
    fn write_row_state(
        &self,
        layer: usize,
        row: usize,
        r: &kvtier::trace::TraceRow,
    ) -> kvtier::Result<()> {
        let st = r.state.as_ref().expect("a state");
        let h = self.hot;
        // SAFETY: no call is running; the ranges are the row's.
        unsafe {
            self.tokens
                .write_at((layer * self.rows + row) * (h + 1), &st.tokens)?;
            self.lru.write_at((layer * self.rows + row) * h, &st.lru)?;
        }
        Ok(())
    }

    /// The swap-in arguments of layer `l`, with or without the miss plan.
    ///
    /// # Safety
    /// The buffers hold the state as the executor addresses them, for as
    /// long as the arguments are used.
    unsafe fn args(&self, l: usize, host_cache: u64, plan: bool) -> SwapInArgs<'_> {
        let (p, k, e, h) = (self.bucket, self.cols, self.entries, self.hot);
        let loc = self.b.exec.location();
        // SAFETY: per this function's contract; every range is inside its buffer.
        unsafe {
            SwapInArgs {
                layer: None,
                top_k_tokens: Buf::from_raw(self.topk.addr() + (l * p * k * 4) as u64, p * k, loc),
                top_k_stride: k,
                query: match self.header.block_tokens {
                    0 => QueryKind::Tokens,
                    s => QueryKind::Blocks { block_tokens: s },
                },
                device_buffer_tokens: BufMut::from_raw(
                    self.tokens.addr() + (l * self.rows * (h + 1) * 4) as u64,
                    self.rows * (h + 1),
                    loc,
                ),
                tokens_stride: h + 1,
                device_buffer_locs: Buf::from_raw(self.locs.addr(), self.locs.len(), loc),
                locs_stride: h + 1,
                lru_slots: BufMut::from_raw(
                    self.lru.addr() + (l * self.rows * h * 2) as u64,
                    self.rows * h,
                    loc,
                ),
                lru_stride: h,
                host_cache_locs: Buf::from_raw(self.host_locs.addr(), self.host_locs.len(), loc),
                host_stride: self.max_seq,
                max_tokens: self.max_seq as u32,
                kv: self.kv(l, host_cache),
                top_k_device_locs: BufMut::from_raw(
                    self.out.addr() + (l * p * e * 4) as u64,
                    p * e,
                    loc,
                ),
                out_stride: e,
                req_pool_indices: IndexBuf::I32(Buf::from_raw(
                    self.req.addr() + (l * p * 4) as u64,
                    p,
                    loc,
                )),
                seq_lens: IndexBuf::I32(Buf::from_raw(
                    self.seq.addr() + (l * p * 4) as u64,
                    p,
                    loc,
                )),
                num_real_reqs: Some(Buf::from_raw(self.num_real.addr() + (l * 4) as u64, 1, loc)),
                num_requests: self.rows as u32,
                num_top_k: k as u32,
                hot_buffer_size: h as u32,
                skip_io: false,
                miss_plan: plan.then(|| MissPlan {
                    src: BufMut::from_raw(
                        self.plan_src.addr() + (l * p * e * 8) as u64,
                        p * e,
                        loc,
                    ),
                    dst: BufMut::from_raw(
                        self.plan_dst.addr() + (l * p * e * 4) as u64,
                        p * e,
                        loc,
                    ),
                    stride: e,
                    capacity: e,
                    count: BufMut::from_raw(self.plan_count.addr() + (l * p * 4) as u64, p, loc),
                }),
            }
        }
    }

    /// Layer `l`'s KV rows as the trace's path lays them out: the pool's
    /// planes on the host, the planes of the layer's device buffer.
    ///
    /// # Safety
    /// As for [`Replay::args`].
    unsafe fn kv(&self, l: usize, host_cache: u64) -> KvBuffers<'_> {
        let loc = self.b.exec.location();
        let dev = &self.device[l % self.device_buffers];
        // SAFETY: per this function's contract; each plane is inside its buffer.
        let plane = |p: usize| unsafe {
            KvPlane {
                host: Buf::from_raw(
                    host_cache + (p * self.host_plane_bytes) as u64,
                    self.host_plane_bytes,
                    loc,
                ),
                device: BufMut::from_raw(
                    dev.addr() + (p * self.device_plane_bytes) as u64,
                    self.device_plane_bytes,
                    loc,
                ),
            }
        };
        KvBuffers {
            layout: self.layout,
            k: plane(0),
            v: (self.path.planes() == 2).then(|| plane(1)),
        }
    }

    fn host_cache(&self) -> kvtier::Result<u64> {
        match &self.b.exec {
            Executor::Cpu => self.pool.region_host_addr(&self.region),
            Executor::Cuda(dev) => self.pool.region_device_addr(&self.region, dev),
        }
    }

    /// Uploads the step, keeps its start state, runs every call once with a
    /// miss plan and compares each row's misses with the trace's outcome and
    /// the first and last missed rows' bytes with their host rows; keeps the
    /// end state.
    fn check_step(&mut self, s: usize, calls: &[TraceCall]) -> kvtier::Result<StepOutcome> {
        self.upload(calls)?;
        let stream = Stream::null();
        self.copy_state(StateCopy::ToStart, stream)?;
        let host_cache = self.host_cache()?;
        let mut out_calls = Vec::new();
        let mut checked = 0u64;
        for c in calls {
            let l = c.layer as usize;
            if self.anchor_of[l].is_some() {
                return Err(invalid(
                    "--trace",
                    format!(
                        "a call of layer {l}, which the header's index_topk_freq makes a shared-index layer"
                    ),
                ));
            }
            // SAFETY: the replay's buffers, alive for the call.
            let a = unsafe { self.args(l, host_cache, true) };
            self.tier.swap_in(&a, stream)?;
            self.tier.check(stream)?;
            let (p, e) = (self.bucket, self.entries);
            let counts = self.plan_count.read(l * p, c.rows.len())?;
            let mut total = 0u64;
            for (i, (row, &got)) in c.rows.iter().zip(&counts).enumerate() {
                total += got.max(0) as u64;
                checked += u64::from(row.misses.is_some());
                if let Some(want) = row.misses
                    && want as i32 != got
                {
                    return Err(kvtier::Error::Pool(format!(
                        "decode-step replay of {}: step {s}, layer {l}, row {i} (request {}): {got} misses, the \
                         trace records {want}",
                        self.name, row.req
                    )));
                }
            }
            // the bytes of the first and last miss of the call's first row
            // that missed, against its host row
            let first_miss = match counts.iter().position(|&n| n > 0) {
                Some(i) => {
                    let n = counts[i] as usize;
                    let src = self.plan_src.read((l * p + i) * e, n)?;
                    let dst = self.plan_dst.read((l * p + i) * e, n)?;
                    Some([(src[0], dst[0]), (src[n - 1], dst[n - 1])])
                }
                None => None,
            };
            self.verify(s, l, first_miss)?;
            out_calls.push((c.layer, c.rows.len(), total));
            // the shared-index layers after it replay its plan
            for shared in self.shared_after(l) {
                // SAFETY: the replay's buffers, alive for the call.
                let a = unsafe { self.planned_args(shared, l, host_cache) };
                self.planned.copy_planned(&a, None, stream)?;
                self.planned.check()?;
                self.verify(s, shared, first_miss)?;
            }
        }
        self.copy_state(StateCopy::ToEnd, stream)?;
        Ok(StepOutcome {
            checked,
            calls: out_calls,
            out: self.out.to_vec()?,
        })
    }

    /// The layers whose anchor is `anchor`, in order.
    fn shared_after(&self, anchor: usize) -> Vec<usize> {
        (0..self.layers)
            .filter(|&l| self.anchor_of[l] == Some(anchor))
            .collect()
    }

    /// Checks that layer `l`'s device rows of `misses` (host row, device
    /// row) hold their host rows' bytes, every piece on every plane (where
    /// the layout the host was filled in is not the one the kernels were
    /// given, the pieces land elsewhere and this fails).
    fn verify(&self, s: usize, l: usize, misses: Option<[(i64, i32); 2]>) -> kvtier::Result<()> {
        let dev = &self.device[l % self.device_buffers];
        for (from, to) in misses.into_iter().flatten() {
            for plane in 0..self.path.planes() {
                let want = host_pattern(plane, from as usize);
                for (at, len) in self.layout.pieces(to as u64) {
                    let at = plane * self.device_plane_bytes + at as usize;
                    if len > 0 && dev.read(at, len)?.iter().any(|&x| x != want) {
                        let which = match self.path.planes() {
                            1 => String::new(),
                            _ => format!(" of plane {}", ["K", "V"][plane]),
                        };
                        return Err(kvtier::Error::Pool(format!(
                            "benchmark self-check failed: decode-step {} step {s} layer {l}: device row {to}{which} \
                             does not hold host row {from}",
                            self.name
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The replay of `anchor`'s miss plan into shared-index layer `shared`'s
    /// device buffer (SGLang's `copy_cache_planned_mla`).
    ///
    /// # Safety
    /// As for [`Replay::args`].
    unsafe fn planned_args(
        &self,
        shared: usize,
        anchor: usize,
        host_cache: u64,
    ) -> kvtier::PlannedCopyArgs<'_> {
        let (p, e) = (self.bucket, self.entries);
        let loc = self.b.exec.location();
        // SAFETY: per this function's contract; every range is inside its buffer.
        unsafe {
            kvtier::PlannedCopyArgs {
                src: Buf::from_raw(
                    self.plan_src.addr() + (anchor * p * e * 8) as u64,
                    p * e,
                    loc,
                ),
                dst: Buf::from_raw(
                    self.plan_dst.addr() + (anchor * p * e * 4) as u64,
                    p * e,
                    loc,
                ),
                count: Buf::from_raw(self.plan_count.addr() + (anchor * p * 4) as u64, p, loc),
                stride: e,
                capacity: e,
                num_real_reqs: Some(Buf::from_raw(
                    self.num_real.addr() + (anchor * 4) as u64,
                    1,
                    loc,
                )),
                kv: self.kv(shared, host_cache),
                skip_io: false,
            }
        }
    }

    fn copy_state(&self, which: StateCopy, stream: Stream) -> kvtier::Result<()> {
        let exec = &self.b.exec;
        let (t, l) = (4 * self.tokens.len(), 2 * self.lru.len());
        let pairs = match which {
            StateCopy::ToStart => [
                (self.start_tokens.addr(), self.tokens.addr(), t),
                (self.start_lru.addr(), self.lru.addr(), l),
            ],
            StateCopy::ToEnd => [
                (self.end_tokens.addr(), self.tokens.addr(), t),
                (self.end_lru.addr(), self.lru.addr(), l),
            ],
            StateCopy::FromEnd => [
                (self.tokens.addr(), self.end_tokens.addr(), t),
                (self.lru.addr(), self.end_lru.addr(), l),
            ],
        };
        for (dst, src, bytes) in pairs {
            // SAFETY: buffers of equal length, in stream order.
            unsafe { transfer::copy_within(exec, dst, src, bytes, stream)? };
        }
        if let Executor::Cuda(dev) = exec {
            dev.synchronize(stream)?;
        }
        Ok(())
    }

    /// The next step starts where this one's checked run ended.
    fn keep_end_state(&mut self) -> kvtier::Result<()> {
        self.copy_state(StateCopy::FromEnd, Stream::null())
    }

    /// Times the step three ways (see the module's doc) from its start state.
    fn measure(
        &mut self,
        s: usize,
        calls: &[TraceCall],
        outcome: &StepOutcome,
        sglang: Option<&SglangKernels>,
    ) -> kvtier::Result<Vec<Measurement>> {
        let b = self.b;
        let exec = &b.exec;
        let clock = Clock::new(exec)?;
        let host_cache = self.host_cache()?;
        let shared_index = self.anchor_of.iter().any(Option::is_some);
        if shared_index && self.stand_in.is_none() {
            self.stand_in = Some(self.calibrate_stand_in(&clock)?);
        }
        let this = &*self;
        let reset = |st: Stream| -> kvtier::Result<()> {
            let (t, l) = (4 * this.tokens.len(), 2 * this.lru.len());
            // SAFETY: buffers of equal length, in stream order.
            unsafe {
                transfer::copy_within(exec, this.tokens.addr(), this.start_tokens.addr(), t, st)?;
                transfer::copy_within(exec, this.lru.addr(), this.start_lru.addr(), l, st)
            }
        };
        // each call's swap-in, and the replays of its plan by the
        // shared-index layers after it, one after the other
        // (None: the default, Tier::swap_in)
        let calls_with = |strategy: Option<SwapInStrategy>, st: Stream| -> kvtier::Result<()> {
            for c in calls {
                let l = c.layer as usize;
                let shared = this.shared_after(l);
                // SAFETY: the replay's buffers, alive until after the timing.
                let a = unsafe { this.args(l, host_cache, !shared.is_empty()) };
                match strategy {
                    Some(strategy) => this.tier.swap_in_with(&a, strategy, st)?,
                    None => this.tier.swap_in(&a, st)?,
                }
                for sh in shared {
                    // SAFETY: as above.
                    let a = unsafe { this.planned_args(sh, l, host_cache) };
                    this.planned.copy_planned(&a, None, st)?;
                }
            }
            Ok(())
        };
        let same_tables = |what: &str| -> kvtier::Result<()> {
            if this.out.to_vec()? != outcome.out {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: decode-step {} step {s}: {what} gave other page tables than the \
                     checked run",
                    this.name
                )));
            }
            Ok(())
        };
        // a strategy's swap-ins of the step, captured once and replayed
        let time_graph = |dev: &Arc<kvtier::CudaDevice>,
                          strategy: Option<SwapInStrategy>,
                          what: &str|
         -> kvtier::Result<Stats> {
            let graph = kvtier::cuda::CudaGraph::capture(dev, graph_stream(&clock), |st| {
                calls_with(strategy, st)
            })?;
            let t = b.time(&clock, Timing::Device, reset, |st| graph.launch(st))?;
            this.tier.check(clock.stream())?;
            same_tables(what)?;
            Ok(t)
        };
        // what Tier::swap_in runs for these calls (one batch size and shape
        // for every layer of the trace)
        let chosen = {
            let first = calls.first().map_or(0, |c| c.layer as usize);
            // SAFETY: the replay's buffers, alive for the call.
            let a = unsafe { this.args(first, host_cache, false) };
            this.tier.default_swap_in_choice(&a)?
        };
        let (kv, kv_method, plain) = match exec {
            Executor::Cuda(dev) => {
                let mut plain = Vec::new();
                for (strategy, label) in [
                    (SwapInStrategy::FewMiss, KVTIER_FEW_MISS),
                    (SwapInStrategy::FewMissOneLaunch, KVTIER_ONE_LAUNCH),
                ] {
                    plain.push((time_graph(dev, Some(strategy), label)?, label));
                }
                (
                    time_graph(dev, None, "kvtier's graph")?,
                    KVTIER_GRAPH,
                    plain,
                )
            }
            Executor::Cpu => {
                let calls = |st| calls_with(None, st);
                let t = b.time(&clock, Timing::Device, reset, calls)?;
                this.tier.check(clock.stream())?;
                same_tables("kvtier's graph")?;
                (t, KVTIER_CPU, Vec::new())
            }
        };
        // SGLang's kernel, where its harness takes the shape
        let theirs = match (sglang, exec) {
            // (a shared-index trace's replays have no SGLang harness here)
            (Some(k), Executor::Cuda(dev)) if !shared_index && this.sglang_serves() => {
                let mut engine = kvtier::SwapInEngine::new(exec.clone())?;
                engine.reserve(this.bucket as u32, this.entries as u32)?;
                let params = calls
                    .iter()
                    .map(|c| {
                        // SAFETY: the replay's buffers, alive until after the timing.
                        let a = unsafe { this.args(c.layer as usize, host_cache, false) };
                        engine.swap_in_params(&a, SwapInStrategy::PlanThenCopy)
                    })
                    .collect::<kvtier::Result<Vec<_>>>()?;
                let launch_all = |st: Stream| -> kvtier::Result<()> {
                    for p in &params {
                        // SAFETY: parameters checked for device buffers alive until after the timing.
                        unsafe { k.swap_in(this.path, p, st)? };
                    }
                    Ok(())
                };
                // once outside a graph (a lazy first launch is no graph's)
                reset(clock.stream())?;
                launch_all(clock.stream())?;
                clock.sync()?;
                same_tables("SGLang's kernel")?;
                // its launcher is the CUDA runtime's: where it cannot be
                // captured, its launches one after the other, said so
                match kvtier::cuda::CudaGraph::capture(dev, graph_stream(&clock), launch_all) {
                    Ok(graph) => {
                        let t = b.time(&clock, Timing::Device, reset, |st| graph.launch(st))?;
                        same_tables("SGLang's kernel in a graph")?;
                        Some((t, SGLANG_METHOD))
                    }
                    Err(e) => {
                        eprintln!(
                            "note: decode-step {}: SGLang's kernel could not be captured in a CUDA graph ({e}); \
                             its launches are timed one after the other",
                            this.name
                        );
                        let t = b.time(&clock, Timing::Device, reset, launch_all)?;
                        same_tables("SGLang's kernel")?;
                        Some((t, SGLANG_LAUNCHES))
                    }
                }
            }
            _ => None,
        };
        // the floor: each call's missed bytes in one contiguous copy a plane
        // (a C4 row's value and scale together: a plane's host and device
        // rows hold the misses' bytes, whatever their layout, in whole pages)
        let host_base = this.pool.region_host_addr(&this.region)?;
        // (a shared-index layer moves its anchor's misses again)
        let copies: Vec<(u64, u64, usize)> = outcome
            .calls
            .iter()
            .flat_map(|&(layer, _, m)| {
                let l = layer as usize;
                std::iter::once(l)
                    .chain(this.shared_after(l))
                    .map(move |x| (x, m))
            })
            .flat_map(|(l, m)| {
                let dev = this.device[l % this.device_buffers].addr();
                (0..this.path.planes()).map(move |p| {
                    (
                        host_base + (p * this.host_plane_bytes) as u64,
                        dev + (p * this.device_plane_bytes) as u64,
                        (m as usize * this.row_bytes)
                            .min(this.device_plane_bytes)
                            .min(this.host_plane_bytes),
                    )
                })
            })
            .filter(|&(_, _, bytes)| bytes > 0)
            .collect();
        let floor_calls = |st: Stream| -> kvtier::Result<()> {
            for &(src, dst, bytes) in &copies {
                // SAFETY: a plane of the pool's registered rows and of a device buffer, each at least `bytes` long.
                unsafe { transfer::contiguous(exec, Dir::HostToDevice, src, dst, bytes, st)? };
            }
            Ok(())
        };
        let none = |_: Stream| Ok(());
        let floor = match exec {
            Executor::Cuda(dev) if !copies.is_empty() => {
                let graph =
                    kvtier::cuda::CudaGraph::capture(dev, graph_stream(&clock), floor_calls)?;
                Some(b.time(&clock, Timing::Device, none, |st| graph.launch(st))?)
            }
            _ if !copies.is_empty() => Some(b.time(&clock, Timing::Device, none, floor_calls)?),
            _ => None,
        };
        let overlap = match &this.stand_in {
            Some(stand_in) => {
                Some(this.overlap(&clock, calls, host_cache, stand_in, reset, same_tables)?)
            }
            None => None,
        };
        let misses: u64 = outcome.calls.iter().map(|c| c.2).sum();
        let rows: usize = outcome.calls.iter().map(|c| c.1).sum();
        let batch = outcome.calls.iter().map(|c| c.1).max().unwrap_or(0);
        let mut params = self.params(json!(s), 1, calls.len(), batch, rows, misses);
        // what kvtier's row ran: the default for this batch and GPU (the
        // build the choice names; the launcher runs the plain build where
        // the rows have none, as at a shape without a fixed-shape build)
        params.push(("strategy", json!(format!("{:?}", chosen.strategy))));
        params.push(("build", json!(format!("{:?}", chosen.build))));
        params.push(("copy", json!(kvtier::copy_choice::method_name(chosen.copy))));
        // the bytes moved: every call's misses (every plane's piece of each),
        // and its shared layers' again
        let moved: u64 = outcome
            .calls
            .iter()
            .map(|&(l, _, m)| m * (1 + self.shared_after(l as usize).len() as u64))
            .sum();
        let bytes = moved as usize * self.item;
        let row = |method, t, limit| Measurement::new(SCENARIO, method, &params, bytes, t, limit);
        let mut out = vec![row(kv_method, kv, false)];
        for (t, method) in plain {
            out.push(row(method, t, false));
        }
        if let Some((t, method)) = theirs {
            out.push(row(method, t, false));
        }
        if let Some(t) = floor {
            out.push(row(FLOOR_METHOD, t, true));
        }
        if let Some([alone, in_order, side]) = overlap {
            // a point of its own: the stand-in's length is part of it
            let (_, set, us) = self.stand_in.as_ref().expect("measured");
            let mut p = params.clone();
            p.push(("compute_stand_in_us", json!((us * 10.0).round() / 10.0)));
            p.push(("compute_stand_in_bytes", json!(set)));
            out.push(Measurement::new(
                SCENARIO,
                STAND_IN_ALONE,
                &p,
                0,
                alone,
                false,
            ));
            out.push(Measurement::new(
                SCENARIO,
                OVERLAP_IN_ORDER,
                &p,
                bytes,
                in_order,
                false,
            ));
            out.push(Measurement::new(
                SCENARIO,
                OVERLAP_SIDE,
                &p,
                bytes,
                side,
                false,
            ));
        }
        Ok(out)
    }

    /// The compute stand-in of the overlap measurement: a device memset of
    /// about `--compute-us` µs (its rate measured on 64 MiB first), and the
    /// median it then takes alone: (scratch, bytes, µs).
    fn calibrate_stand_in(&self, clock: &Clock) -> kvtier::Result<(ExecVec<u8>, usize, f64)> {
        let b = self.b;
        let max = match b.exec {
            Executor::Cuda(_) => 512usize << 20,
            Executor::Cpu => 64 << 20,
        };
        let scratch = ExecVec::<u8>::zeroed(&b.exec, max)?;
        let set = |bytes: usize| {
            let addr = scratch.addr();
            move |st: Stream| -> kvtier::Result<()> {
                // SAFETY: inside the scratch, alive for the timing.
                unsafe { stand_in(&b.exec, addr, bytes, st) }
            }
        };
        let none = |_: Stream| Ok(());
        let probe = max / 8;
        let t = b.time(clock, Timing::Device, none, set(probe))?;
        let want = b.args.compute_us.max(1.0);
        let bytes = ((probe as f64 * want / t.median_us) as usize).clamp(1 << 20, max) & !4095;
        let alone = b.time(clock, Timing::Device, none, set(bytes))?;
        Ok((scratch, bytes, alone.median_us))
    }

    /// SGLang's shared-index overlap, kvtier's kernels: every layer of the
    /// step followed by the compute stand-in, the shared-index layers'
    /// replays (a fixed grid of 128 warps, as SGLang's side-stream replay
    /// takes) in order on the one stream, against on a second stream forked
    /// after each anchor's swap-in (each shared layer's stand-in waits for
    /// its replay), both captured in CUDA graphs from the same start state:
    /// [the stand-ins alone, in order, overlapped].
    fn overlap(
        &self,
        clock: &Clock,
        calls: &[TraceCall],
        host_cache: u64,
        stand_in: &(ExecVec<u8>, usize, f64),
        reset: impl FnMut(Stream) -> kvtier::Result<()> + Copy,
        same_tables: impl Fn(&str) -> kvtier::Result<()>,
    ) -> kvtier::Result<[Stats; 3]> {
        let b = self.b;
        let (scratch, set, _) = stand_in;
        let compute = |st: Stream| -> kvtier::Result<()> {
            // SAFETY: inside the scratch, alive for the timing.
            unsafe { self::stand_in(&b.exec, scratch.addr(), *set, st) }
        };
        const SIDE_WARPS: u32 = 4 * 1024 / 32;
        let layers: Vec<(usize, Vec<usize>)> = calls
            .iter()
            .map(|c| (c.layer as usize, self.shared_after(c.layer as usize)))
            .collect();
        let swap_in = |l: usize, plan: bool, st: Stream| -> kvtier::Result<()> {
            // SAFETY: the replay's buffers, alive until after the timing.
            let a = unsafe { self.args(l, host_cache, plan) };
            self.tier.swap_in(&a, st)
        };
        let replay = |sh: usize, l: usize, st: Stream| -> kvtier::Result<()> {
            // SAFETY: as above.
            let a = unsafe { self.planned_args(sh, l, host_cache) };
            self.planned.copy_planned(&a, Some(SIDE_WARPS), st)
        };
        let alone_calls = |st: Stream| -> kvtier::Result<()> {
            for (_, shared) in &layers {
                for _ in 0..1 + shared.len() {
                    compute(st)?;
                }
            }
            Ok(())
        };
        let in_order = |st: Stream| -> kvtier::Result<()> {
            for (l, shared) in &layers {
                swap_in(*l, !shared.is_empty(), st)?;
                compute(st)?;
                for &sh in shared {
                    replay(sh, *l, st)?;
                    compute(st)?;
                }
            }
            Ok(())
        };
        // the side stream and its events (the CPU executor runs the same
        // calls in order: there is nothing to fork)
        let fork = match &b.exec {
            Executor::Cuda(dev) => Some((
                dev.create_stream()?,
                (0..self.layers)
                    .map(|_| kvtier::cuda::StreamEvent::new(dev))
                    .collect::<kvtier::Result<Vec<_>>>()?,
            )),
            Executor::Cpu => None,
        };
        let overlapped = |st: Stream| -> kvtier::Result<()> {
            for (l, shared) in &layers {
                swap_in(*l, !shared.is_empty(), st)?;
                let side = match &fork {
                    Some((side, events)) if !shared.is_empty() => {
                        // the side stream starts once the anchor's plan is made
                        events[*l].record(st)?;
                        events[*l].wait(side.stream())?;
                        side.stream()
                    }
                    _ => st,
                };
                for &sh in shared {
                    replay(sh, *l, side)?;
                    if let Some((_, events)) = &fork {
                        events[sh].record(side)?;
                    }
                }
                compute(st)?;
                for &sh in shared {
                    if let Some((_, events)) = &fork {
                        events[sh].wait(st)?;
                    }
                    compute(st)?;
                }
            }
            Ok(())
        };
        let none = |_: Stream| Ok(());
        let time_graph = |record: &dyn Fn(Stream) -> kvtier::Result<()>,
                          reset: &mut dyn FnMut(Stream) -> kvtier::Result<()>|
         -> kvtier::Result<Stats> {
            match &b.exec {
                Executor::Cuda(dev) => {
                    let graph = kvtier::cuda::CudaGraph::capture(dev, graph_stream(clock), record)?;
                    b.time(clock, Timing::Device, &mut *reset, |st| graph.launch(st))
                }
                Executor::Cpu => b.time(clock, Timing::Device, &mut *reset, record),
            }
        };
        let mut reset = reset;
        let mut nothing = none;
        let alone = time_graph(&alone_calls, &mut nothing)?;
        let ordered = time_graph(&in_order, &mut reset)?;
        same_tables("the replays in order")?;
        let forked = time_graph(&overlapped, &mut reset)?;
        same_tables("the replays on a second stream")?;
        self.tier.check(clock.stream())?;
        self.planned.check()?;
        Ok([alone, ordered, forked])
    }

    /// Whether SGLang's kernel for the trace's path is built for its shape
    /// (its M3 entry point also fixes the block at MiniMax-M3's 128 tokens).
    fn sglang_serves(&self) -> bool {
        (self.path != SwapPath::M3Kv || self.header.block_tokens == M3_BLOCK_TOKENS)
            && SglangKernels::serves_swap_in(self.path, self.cols as u32, self.hot as u32)
    }

    /// How the rows lie, in words for the run's summary.
    fn layout_words(&self) -> String {
        match self.path {
            SwapPath::Mla => format!("linear rows of {} B", self.row_bytes),
            SwapPath::Dsv4C4 => format!(
                "DeepSeek-V4's C4 pages ({} rows of {} B values and {} B scales in separate runs, {} B a page)",
                self.layout.rows_per_page(),
                ItemLayout::DSV4_VALUE_BYTES,
                ItemLayout::DSV4_SCALE_BYTES,
                self.layout.page_bytes()
            ),
            SwapPath::M3Kv => format!("two planes, K and V, of {} B rows", self.row_bytes),
        }
    }

    fn params(
        &self,
        step: serde_json::Value,
        steps: usize,
        calls: usize,
        batch: usize,
        rows: usize,
        misses: u64,
    ) -> Vec<(&'static str, serde_json::Value)> {
        // `entry` is the bytes a miss moves over every plane (the trace's
        // item_bytes, as in earlier results); `path`, `planes` and
        // `page_rows` say how the rows lie
        vec![
            ("model", json!(self.model)),
            ("selections", json!(self.selections)),
            ("source", json!(self.name)),
            ("path", json!(self.path.name())),
            ("context", json!(self.context)),
            ("hot", json!(self.hot)),
            ("k", json!(self.entries)),
            ("entry", json!(self.item)),
            ("planes", json!(self.path.planes())),
            ("page_rows", json!(self.layout.rows_per_page())),
            ("batch", json!(batch)),
            ("bucket", json!(self.bucket)),
            ("step", step),
            ("measured_steps", json!(steps)),
            ("calls", json!(calls)),
            ("rows_total", json!(rows)),
            ("misses_total", json!(misses)),
            ("entries_total", json!(rows * self.entries)),
            ("host_rows", json!(self.host_rows)),
            ("device_buffers", json!(self.device_buffers)),
        ]
    }
}

/// The compute stand-in: `bytes` bytes at `addr` set (a device memset on
/// `stream`; on the CPU executor, at once).
///
/// # Safety
/// `addr..addr + bytes` is the executor's memory, alive until the set ends.
unsafe fn stand_in(exec: &Executor, addr: u64, bytes: usize, stream: Stream) -> kvtier::Result<()> {
    match exec {
        // SAFETY: per this function's contract.
        Executor::Cuda(dev) => unsafe { dev.memset_async(addr, 0x5a, bytes, stream) },
        Executor::Cpu => {
            // SAFETY: per this function's contract.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0x5a, bytes) };
            Ok(())
        }
    }
}

#[derive(Clone, Copy)]
enum StateCopy {
    ToStart,
    ToEnd,
    FromEnd,
}

/// The stream a graph is captured on: the clock's own.
fn graph_stream(clock: &Clock) -> &kvtier::cuda::OwnedStream {
    match clock {
        Clock::Cuda { stream, .. } => stream,
        Clock::Wall => unreachable!("graphs are captured on the CUDA executor only"),
    }
}

/// Each method's line for all measured steps of a trace: the sum of its
/// steps' medians (and quartiles), the fewest samples of any step.
fn with_totals(rows: Vec<Measurement>) -> Vec<Measurement> {
    let mut out = rows.clone();
    let mut keys: Vec<(String, &'static str)> = Vec::new();
    for m in &rows {
        let k = (source_of(m), m.method);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (source, method) in keys {
        let mine: Vec<&Measurement> = rows
            .iter()
            .filter(|m| source_of(m) == source && m.method == method)
            .collect();
        let first = mine[0];
        let sum = |f: &dyn Fn(&Stats) -> f64| mine.iter().map(|m| f(&m.time)).sum::<f64>();
        let time = Stats {
            median_us: sum(&|t| t.median_us),
            q1_us: sum(&|t| t.q1_us),
            q3_us: sum(&|t| t.q3_us),
            p99_us: None,
            max_us: sum(&|t| t.max_us),
            samples: mine.iter().map(|m| m.time.samples).min().unwrap_or(0),
        };
        let total = |k: &str| {
            mine.iter()
                .map(|m| {
                    m.params
                        .iter()
                        .find(|(x, _)| *x == k)
                        .and_then(|(_, v)| v.as_u64())
                        .unwrap_or(0)
                })
                .sum::<u64>()
        };
        let params: Vec<(&'static str, serde_json::Value)> = first
            .params
            .iter()
            .map(|(k, v)| {
                let v = match *k {
                    "step" => json!("all"),
                    "measured_steps" => json!(mine.len()),
                    "calls" | "rows_total" | "misses_total" | "entries_total" => json!(total(k)),
                    _ => v.clone(),
                };
                (*k, v)
            })
            .collect();
        out.push(Measurement {
            scenario: SCENARIO,
            method,
            params,
            bytes: mine.iter().map(|m| m.bytes).sum(),
            time,
            limit: first.limit,
        });
    }
    out
}

fn source_of(m: &Measurement) -> String {
    m.params
        .iter()
        .find(|(k, _)| *k == "source")
        .map(|(_, v)| v.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SGLang 0.5.23's decode buckets: a batch replays the smallest that
    /// holds it.
    #[test]
    fn a_batch_replays_in_sglangs_smallest_bucket_that_holds_it() {
        let b = decode_buckets(512);
        assert_eq!(&b[..7], &[1, 2, 4, 8, 12, 16, 24]);
        assert!(
            b.contains(&256) && b.contains(&272) && !b.contains(&264) && b.last() == Some(&512)
        );
        let of = |n| bucket_of(n).unwrap();
        assert_eq!(
            [
                of(1),
                of(3),
                of(5),
                of(8),
                of(13),
                of(100),
                of(128),
                of(257),
                of(300)
            ],
            [1, 4, 8, 8, 16, 104, 128, 272, 304]
        );
        assert!(bucket_of(513).is_err());
        assert_eq!(decode_buckets(100).last(), Some(&100));
    }

    /// Each committed recipe's header picks the path of the model it names
    /// (the header itself names none).
    #[test]
    fn each_committed_recipe_takes_its_models_path() {
        for (name, text) in RECIPES {
            let r = TraceRecipe::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let h = kvtier::trace::synth_header(&r.spec).unwrap();
            let want = match r.model.as_str() {
                "deepseek-v3.2" => SwapPath::Mla,
                "deepseek-v4-flash" => SwapPath::Dsv4C4,
                "minimax-m3" => SwapPath::M3Kv,
                m => panic!("{name}: a model this test does not know: {m}"),
            };
            assert_eq!(
                SwapPath::of_trace(h.block_tokens, h.item_bytes),
                want,
                "{name}"
            );
        }
    }

    /// Every committed recipe parses, names its model and calibration, and
    /// records a total for every step and layer.
    #[test]
    fn the_committed_recipes_read_and_say_where_their_numbers_come_from() {
        assert_eq!(
            RECIPES.len(),
            24,
            "three models × batch 8, 32, 64, 128 × 32K and 128K"
        );
        for (name, text) in RECIPES {
            let r = TraceRecipe::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(&r.name, name);
            let c = r.calibration.as_ref().expect("calibrated");
            assert!(c.source.contains("published"), "{name}");
            assert!(
                (c.pilot_miss_rate - c.target_miss_rate).abs() < 0.01,
                "{name}"
            );
            assert!(r.spec.provenance.contains("assumption"), "{name}");
            assert_eq!(
                r.misses.len(),
                (r.spec.steps + r.spec.warmup_steps) as usize
            );
        }
        for q in QUICK {
            assert!(RECIPES.iter().any(|(n, _)| *n == q), "{q}");
        }
    }
}
