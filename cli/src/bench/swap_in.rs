//! The `swap-in` scenario: the HiSparse grid (batch × hot buffer × misses per
//! request; K = `--swap-k`, items of `--entry` bytes, every request a long
//! sequence). Per point, from the same state restored untimed before every
//! call:
//!
//! 1. kvtier's swap-in (plan per request, one copy over every miss); on a
//!    GPU also the few-miss planner (SwapInStrategy::FewMiss), in blocks of
//!    512 threads too (FewMiss512), and the compact planner, with the copy kernel after it and alone
//!    (SwapInStrategy::Compact, CompactOneLaunch), both few-miss planners
//!    copying every miss themselves (FewMissOneLaunch, FewMiss512OneLaunch),
//!    and where rows miss more
//!    than the few-miss planner copies itself, its copy kernel with the
//!    line-aligned copy method (CopyMethod::LineAligned), and at every point
//!    the one-launch planner copying with that method; where rows miss
//!    more than the planner copies itself on sm_90, its copy kernel with
//!    the bulk-copy method (CopyMethod::BulkRuns); on sm_90
//!    also the same two kernels with the copy launched the
//!    ordinary way, after the plan kernel, instead of as its programmatic
//!    dependent (what the dependent launch gains);
//! 2. the one-block-per-request design SGLang uses (same planning, each
//!    request's copies inside its block; CUDA executor only), and SGLang's
//!    own kernel (CUDA executor, when `KVTIER_SGLANG_KERNELS` names the
//!    library scripts/sglang-kernels.sh builds; its page table is compared
//!    with kvtier's);
//! 3. the limit: the missed bytes in one contiguous copy; on a GPU also the
//!    copy kernel alone replaying the swap-in's recorded plan, with each
//!    copy method (`SwapInEngine::copy_planned_with_copy`): the miss copy
//!    without the planning;
//! 4. one `cudaMemcpyAsync` per missed row (host row → its device row);
//! 5. a host gather of the missed rows into pinned staging, then one copy to
//!    a contiguous device area.
//!
//! 3 to 5 only move bytes: they are given the misses kvtier's plan found
//! (recorded once with a miss plan), so they are lower bounds for designs
//! that would also have to find them.
//!
//! With `--trace` the points are calls of a top-k trace instead: each
//! call's rows, queries and sequence lengths as recorded, from the state the
//! trace's replay (`kvtier::trace::states_before`) reaches before the call.
//!
//! `--swap-path` picks the SGLang entry point whose rows and queries a run
//! has ([`SwapPath`]): DSA's linear rows (the default), DeepSeek-V4's
//! page-padded C4 rows, or MiniMax-M3's K and V planes under block queries.
//! Every method above runs on each; 3 to 5 move every piece of a miss (a C4
//! row's value and scale, an M3 row's K and V), and the limit is one
//! contiguous copy a plane.

use std::collections::HashSet;
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde_json::json;

use kvtier::swap_in::FEW_MISS_INLINE;
use kvtier::trace::{RowState, Trace, TraceCall};
use kvtier::{
    Buf, BufMut, CopyMethod, Executor, IndexBuf, ItemLayout, KvBuffers, KvPlane, MissPlan, Pool,
    QueryKind, Region, Stream, SwapInArgs, SwapInStrategy, Tier,
};

use super::sglang::SglangKernels;
use super::{Bench, Clock, Measurement, Stats, Timing, count, host_pattern, invalid, named};
use crate::transfer::{self, Dir, ExecVec, Staging};

use super::swap_path::SwapPath;

const SCENARIO: &str = "swap-in";

/// Rows the swap-in report reads (`swap_in_report`): the few-miss planner
/// and its one-launch build (the plain builds of the default's strategies,
/// `SwapInChoice::default_for`), SGLang's own kernel and the limit.
pub(super) const FEW_MISS_ROW: &str = "kvtier swap-in, few-miss planner";
pub(super) const ONE_LAUNCH_ROW: &str = "kvtier swap-in, few-miss planner, one launch";
/// The rows of the builds and copy methods a default may take
/// (`SwapInChoice::default_for`): the split planner, and the one-launch
/// planner's line-aligned copies in its plain and fixed-shape builds (and
/// the fixed-shape build's warp-vector copies, a default of no release).
pub(super) const SPLIT_ROW: &str = "kvtier swap-in, split planner (a cluster a row, one launch)";
pub(super) const ONE_LAUNCH_LINES_ROW: &str =
    "kvtier swap-in, few-miss planner, one launch, line-aligned copy";
pub(super) const ONE_LAUNCH_FIXED_ROW: &str =
    "kvtier swap-in, few-miss planner, one launch, fixed-shape build";
pub(super) const ONE_LAUNCH_FIXED_LINES_ROW: &str =
    "kvtier swap-in, few-miss planner, one launch, fixed-shape build, line-aligned copy";
pub(super) const SGLANG_ROW: &str = "SGLang 0.5.23's swap-in kernel";
pub(super) const LIMIT_ROW: &str = "contiguous H2D copy of the misses (limit)";

/// Every miss of a call in row order (host row, device row), and each row's
/// count of them.
type RecordedMisses = (Vec<(i64, i32)>, Vec<i32>);

fn grid(b: &Bench) -> kvtier::Result<(Vec<u32>, Vec<u32>)> {
    let path = b.args.swap_path;
    let k = b.args.swap_k();
    let entries = k as u64 * path.query().block_tokens() as u64;
    let what = match path.query() {
        QueryKind::Tokens => format!("{k}"),
        QueryKind::Blocks { block_tokens } => {
            format!("{k} blocks of {block_tokens} tokens ({entries} entries)")
        }
    };
    for &hot in b.hot() {
        if k == 0 || entries > hot as u64 {
            return Err(invalid(
                "--swap-k",
                format!("{what} must be at least 1 and at most hot ({hot}) entries"),
            ));
        }
    }
    if let Some(&m) = b.args.misses.iter().find(|&&m| m as u64 > entries) {
        return Err(invalid(
            "--misses",
            format!("{m} exceeds the {entries} entries a request's query resolves"),
        ));
    }
    Ok((path.entries(b)?, b.batches(&[1, 10, 100, 256])))
}

pub(super) fn points(b: &Bench) -> kvtier::Result<u64> {
    if b.args.trace.is_some() {
        return Ok(TracePlan::read(b)?.chosen.len() as u64);
    }
    let (entries, batches) = grid(b)?;
    Ok((entries.len() * b.hot().len() * batches.len() * b.args.misses.len()) as u64)
}

pub(super) fn run(b: &Bench) -> kvtier::Result<Vec<Measurement>> {
    let sglang = match b.exec {
        Executor::Cuda(_) => SglangKernels::from_env()?,
        Executor::Cpu => None,
    };
    if b.args.trace.is_some() {
        return run_trace(b, sglang.as_ref());
    }
    let (entries, batches) = grid(b)?;
    let max_batch = *batches.iter().max().expect("non-empty");
    let path = b.args.swap_path;
    let mut rows = Vec::new();
    for &item in &entries {
        for &hot in b.hot() {
            let sglang = serving(b, sglang.as_ref(), path, b.args.swap_k(), hot);
            let mut state = State::build(b, path, max_batch, hot, item)?;
            for &batch in &batches {
                for &misses in &b.args.misses {
                    b.progress.set_message(format!(
                        "swap-in: {}{item} B, hot {hot}, batch {batch}, {}",
                        match path {
                            SwapPath::Mla => String::new(),
                            p => format!("{}, ", p.name()),
                        },
                        count(misses, "miss", "misses")
                    ));
                    let q = state.queries(batch, misses, b.args.seed);
                    let point = state.measure(b, &q, sglang)?;
                    b.point_done(&point)?;
                    rows.extend(point);
                }
            }
        }
    }
    Ok(rows)
}

/// `--trace`: the trace, its item size and the calls to time.
struct TracePlan {
    name: String,
    trace: Trace,
    item: u32,
    /// Every row's query padded to this (the widest of the trace).
    k: u32,
    /// Indices into `trace.calls`.
    chosen: Vec<usize>,
}

impl TracePlan {
    fn read(b: &Bench) -> kvtier::Result<Self> {
        let path = b.args.trace.as_ref().expect("--trace given");
        let file = std::fs::File::open(path)
            .map_err(|e| invalid("--trace", format!("cannot read {}: {e}", path.display())))?;
        let trace = Trace::read(std::io::BufReader::new(file))?;
        let h = &trace.header;
        if h.block_tokens != 0 {
            return Err(invalid(
                "--trace",
                format!(
                    "{} holds block queries ({} tokens a block); the bench times token queries \
                     only (kvtier plan --trace replays both)",
                    path.display(),
                    h.block_tokens
                ),
            ));
        }
        let item = if !b.args.entry.is_empty() {
            let e = b.entries(&[])?;
            if e.len() != 1 {
                return Err(invalid("--entry", "a trace runs at one item size"));
            }
            e[0]
        } else if h.item_bytes > 0 && h.item_bytes % 8 == 0 && h.item_bytes <= u32::MAX as u64 {
            h.item_bytes as u32
        } else {
            b.entries(&["fp8-dsa"])?[0]
        };
        if b.args.trace_calls == 0 {
            return Err(invalid("--trace-calls", "needs at least 1"));
        }
        // Calls that move bytes: a request longer than the HOT buffer.
        let long: Vec<usize> = (0..trace.calls.len())
            .filter(|&i| trace.calls[i].rows.iter().any(|r| r.seq > h.hot))
            .collect();
        if long.is_empty() {
            return Err(invalid(
                "--trace",
                format!(
                    "no call of {} has a request longer than its HOT buffer ({} slots): nothing \
                     would be swapped in",
                    path.display(),
                    h.hot
                ),
            ));
        }
        let n = (b.args.trace_calls as usize).min(long.len());
        let chosen = (0..n).map(|i| long[i * long.len() / n]).collect();
        Ok(TracePlan {
            name: path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            k: trace.widest_query().max(1),
            trace,
            item,
            chosen,
        })
    }
}

/// SGLang's kernel where its build serves top-k `k` at `hot` on `path`;
/// elsewhere none, and the output says why its line is missing.
fn serving<'a>(
    b: &Bench,
    sglang: Option<&'a SglangKernels>,
    path: SwapPath,
    k: u32,
    hot: u32,
) -> Option<&'a SglangKernels> {
    if sglang.is_some() && !SglangKernels::serves_swap_in(path, k, hot) {
        b.progress.suspend(|| {
            println!(
                "swap-in: SGLang's {} kernel is built for {} only: not timed at top-k {k}, hot {hot}",
                path.name(),
                SglangKernels::swap_in_shapes(path)
            )
        });
        return None;
    }
    sglang
}

/// Each chosen call of the trace, from the state its replay reaches before
/// it: the same methods as a grid point.
fn run_trace(b: &Bench, sglang: Option<&SglangKernels>) -> kvtier::Result<Vec<Measurement>> {
    let plan = TracePlan::read(b)?;
    let hot = plan.trace.header.hot;
    let states = kvtier::trace::states_before(&plan.trace, hot, &plan.chosen)?;
    let sglang = serving(b, sglang, SwapPath::Mla, plan.k, hot);
    let mut rows = Vec::new();
    for (&index, before) in plan.chosen.iter().zip(&states) {
        let call = &plan.trace.calls[index];
        b.progress.set_message(format!(
            "swap-in: {}, call {index} (layer {}, {})",
            plan.name,
            call.layer,
            count(call.rows.len() as u64, "request", "requests")
        ));
        let state = State::from_trace(b, &plan, call, before)?;
        let q = state.trace_queries(&plan, index, call)?;
        // A row narrower than the widest is padded with -1, which SGLang's
        // kernel leaves unwritten where kvtier writes -1 (the page tables
        // would differ): its kernel is timed on unpadded calls only.
        let padded = call.rows.iter().any(|r| r.topk.len() < plan.k as usize);
        let point = state.measure(b, &q, if padded { None } else { sglang })?;
        b.point_done(&point)?;
        rows.extend(point);
    }
    Ok(rows)
}

/// Per-request HiSparse state for `requests` long requests, the host cache
/// rows in a pool (registered for the GPU by the tier), the swap-in engine.
struct State {
    path: SwapPath,
    requests: u32,
    hot: u32,
    /// Query columns: tokens, or blocks for a block query.
    k: u32,
    /// Bytes a row has on one plane (a C4 row's value and scale together).
    item: u32,
    layout: ItemLayout,
    context: u32,
    tokens: Vec<i32>,    // [requests][hot + 1]
    locs: Vec<i32>,      // [requests][hot + 1]
    lru: Vec<i16>,       // [requests][hot]
    host_locs: Vec<i64>, // [requests][context]
    pool: Arc<Pool>,
    /// One layer of the region a plane, whole pages of rows.
    host_region: Region,
    /// Bytes from one plane's host rows to the next's.
    host_plane_bytes: u64,
    tier: Tier,
}

/// How a timed swap-in runs beside its strategy: with a copy method, or one
/// of the few-miss planner's builds the benchmark times (hidden from the
/// API docs: `SwapInEngine::run_fixed_shape`, `run_cluster_copy`,
/// `run_cluster_plan`).
#[derive(Clone, Copy)]
enum Build {
    Copy(CopyMethod),
    FixedShape(CopyMethod),
    Cluster,
    Split,
}

/// One batch's queries and its row metadata.
struct Queries {
    batch: u32,
    /// Misses drawn per request (a trace's calls have theirs: None).
    misses: Option<u32>,
    topk: Vec<i32>,
    req: Vec<i32>,
    seq: Vec<i32>,
    /// A trace call's identity (file, call, layer) for the JSON.
    trace: Option<(String, usize, u32)>,
}

/// The swap-in's arrays where an executor reads them: what a call changes
/// (slot tokens, LRU order, device buffer, output), then what it only reads.
struct Buffers {
    tokens: ExecVec<i32>,
    lru: ExecVec<i16>,
    /// The device planes (K, and MHA's V).
    device_buffer: Vec<ExecVec<u8>>,
    out: ExecVec<i32>,
    topk: ExecVec<i32>,
    locs: ExecVec<i32>,
    host_locs: ExecVec<i64>,
    req: ExecVec<i32>,
    seq: ExecVec<i32>,
}

impl Buffers {
    fn new(exec: &Executor, s: &State, q: &Queries) -> kvtier::Result<Self> {
        Ok(Buffers {
            tokens: ExecVec::from_host(exec, &s.tokens)?,
            lru: ExecVec::from_host(exec, &s.lru)?,
            device_buffer: (0..s.path.planes())
                .map(|_| ExecVec::zeroed(exec, s.device_bytes()))
                .collect::<kvtier::Result<_>>()?,
            out: ExecVec::zeroed(exec, q.batch as usize * s.entries())?,
            topk: ExecVec::from_host(exec, &q.topk)?,
            locs: ExecVec::from_host(exec, &s.locs)?,
            host_locs: ExecVec::from_host(exec, &s.host_locs)?,
            req: ExecVec::from_host(exec, &q.req)?,
            seq: ExecVec::from_host(exec, &q.seq)?,
        })
    }

    /// The addresses, in [`State::args`] order (the second device plane's
    /// 0 where there is none).
    fn addrs(&self) -> [u64; 10] {
        let plane = |p: usize| self.device_buffer.get(p).map_or(0, ExecVec::addr);
        [
            self.tokens.addr(),
            self.lru.addr(),
            plane(0),
            plane(1),
            self.out.addr(),
            self.topk.addr(),
            self.locs.addr(),
            self.host_locs.addr(),
            self.req.addr(),
            self.seq.addr(),
        ]
    }
}

impl State {
    fn build(
        b: &Bench,
        path: SwapPath,
        requests: u32,
        hot: u32,
        item: u32,
    ) -> kvtier::Result<Self> {
        let k = b.args.swap_k();
        let mut rng = StdRng::seed_from_u64(b.args.seed ^ hot as u64 ^ ((item as u64) << 32));
        let context = hot + 2 * k * path.query().block_tokens();
        let (r, h) = (requests as usize, hot as usize);
        let mut tokens = vec![-1i32; r * (h + 1)];
        let mut lru = vec![0i16; r * h];
        let mut resident: Vec<i32> = (0..context as i32 - 1).collect();
        for req in 0..r {
            resident.shuffle(&mut rng);
            tokens[req * (h + 1)..][..h].copy_from_slice(&resident[..h]);
            tokens[req * (h + 1) + h] = context as i32 - 1;
            let mut order: Vec<i16> = (0..hot as i16).collect();
            order.shuffle(&mut rng);
            lru[req * h..][..h].copy_from_slice(&order);
        }
        Self::with_state(b, path, requests, hot, k, item, context, tokens, lru)
    }

    /// A state of `requests` rows with these slot tokens (`hot + 1` per
    /// row) and LRU orders, host rows for `context` positions each on every
    /// plane of `path`, filled with [`host_pattern`] in a pool.
    #[allow(clippy::too_many_arguments)]
    fn with_state(
        b: &Bench,
        path: SwapPath,
        requests: u32,
        hot: u32,
        k: u32,
        item: u32,
        context: u32,
        tokens: Vec<i32>,
        lru: Vec<i16>,
    ) -> kvtier::Result<Self> {
        let (r, h, c) = (requests as usize, hot as usize, context as usize);
        let locs: Vec<i32> = (0..(r * (h + 1)) as i32).collect();
        let host_locs: Vec<i64> = (0..(r * c) as i64).collect();

        // The host cache in the pool: a layer a plane, an entry a page (a
        // linear layout's page is one row), so that the rows lie as SGLang's
        // host pools lay them out; only whole pages count as rows.
        let layout = path.layout(item)?;
        let per_page = layout.rows_per_page() as usize;
        let pages = (r * c).div_ceil(per_page);
        let page_bytes = u32::try_from(layout.page_bytes())
            .map_err(|_| invalid("--entry", format!("{item} B rows are too large")))?;
        let (pool, host_region) =
            super::patterned_host_pool(b, &layout, page_bytes, path.planes(), pages)?;
        let mut tier = Tier::new(pool.clone(), b.exec.clone(), 1)?;
        tier.enable_swap_in(requests, k * path.query().block_tokens())?;
        Ok(State {
            path,
            requests,
            hot,
            k,
            item,
            layout,
            context,
            tokens,
            locs,
            lru,
            host_locs,
            pool,
            host_region,
            host_plane_bytes: pages as u64 * page_bytes as u64,
            tier,
        })
    }

    fn device_rows(&self) -> usize {
        self.requests as usize * (self.hot as usize + 1)
    }

    /// Bytes of a device plane: its rows in whole pages.
    fn device_bytes(&self) -> usize {
        let pages = self
            .device_rows()
            .div_ceil(self.layout.rows_per_page() as usize);
        pages * self.layout.page_bytes() as usize
    }

    /// The byte ranges (offset, length) of device row `row` on a plane:
    /// its value, and its scale where the layout has one.
    fn pieces(&self, row: i32) -> impl Iterator<Item = (usize, usize)> {
        let pieces = self.layout.pieces(row as u64);
        pieces
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(at, len)| (at as usize, len))
    }

    /// Entries a row's query resolves (and output columns).
    fn entries(&self) -> usize {
        self.k as usize * self.path.query().block_tokens() as usize
    }

    /// Per request: K - misses resident tokens and `misses` absent ones (a
    /// block query: [`State::block_queries`]).
    fn queries(&mut self, batch: u32, misses: u32, seed: u64) -> Queries {
        let mut rng = StdRng::seed_from_u64(seed ^ ((batch as u64) << 32) ^ misses as u64);
        let (h, k) = (self.hot as usize, self.k as usize);
        let topk = match self.path.query() {
            QueryKind::Blocks { block_tokens } => {
                self.block_queries(&mut rng, batch, misses, block_tokens)
            }
            QueryKind::Tokens => {
                let mut topk = Vec::with_capacity(batch as usize * k);
                for req in 0..batch as usize {
                    let mut resident: Vec<i32> = self.tokens[req * (h + 1)..][..h].to_vec();
                    resident.shuffle(&mut rng);
                    let present: HashSet<i32> = resident.iter().copied().collect();
                    let mut absent: Vec<i32> = (0..self.context as i32 - 1)
                        .filter(|t| !present.contains(t))
                        .collect();
                    absent.shuffle(&mut rng);
                    let mut q: Vec<i32> = resident[..k - misses as usize].to_vec();
                    q.extend(&absent[..misses as usize]);
                    q.shuffle(&mut rng);
                    topk.extend(q);
                }
                topk
            }
        };
        Queries {
            batch,
            misses: Some(misses),
            topk,
            req: (0..batch as i32).collect(),
            seq: vec![self.context as i32; batch as usize],
            trace: None,
        }
    }

    /// K blocks of `s` tokens per request, with the residency drawn with
    /// them (a block's tokens are not resident or absent as one): `misses`
    /// of the selected tokens absent, the others resident, the rest of the
    /// slots tokens outside the selection; each request's slots are
    /// rewritten so.
    fn block_queries(&mut self, rng: &mut StdRng, batch: u32, misses: u32, s: u32) -> Vec<i32> {
        let (h, k, s) = (self.hot as usize, self.k as usize, s as i32);
        // Blocks wholly before the newest token, which a query may name
        // without a copy (its reserved slot): the context leaves more than K.
        let whole = (self.context as i32 - 1) / s;
        let mut blocks: Vec<i32> = (0..whole).collect();
        let mut topk = Vec::with_capacity(batch as usize * k);
        for req in 0..batch as usize {
            blocks.shuffle(rng);
            let chosen = &blocks[..k];
            let mut selected: Vec<i32> = chosen.iter().flat_map(|&b| b * s..(b + 1) * s).collect();
            selected.shuffle(rng);
            let named: HashSet<i32> = selected.iter().copied().collect();
            let mut others: Vec<i32> = (0..self.context as i32 - 1)
                .filter(|t| !named.contains(t))
                .collect();
            others.shuffle(rng);
            let mut slots: Vec<i32> = selected[misses as usize..].to_vec();
            slots.extend(&others[..h - slots.len()]);
            slots.shuffle(rng);
            self.tokens[req * (h + 1)..][..h].copy_from_slice(&slots);
            topk.extend(chosen);
        }
        topk
    }

    /// A trace call's state: each row's slots and LRU order as the replay
    /// has them before the call (the reserved slot holds the newest token),
    /// host rows for every position up to the longest sequence.
    fn from_trace(
        b: &Bench,
        plan: &TracePlan,
        call: &TraceCall,
        before: &[RowState],
    ) -> kvtier::Result<Self> {
        let hot = plan.trace.header.hot;
        let (r, h) = (call.rows.len(), hot as usize);
        let context = call
            .rows
            .iter()
            .map(|row| row.seq)
            .max()
            .unwrap_or(1)
            .max(1);
        let mut tokens = vec![-1i32; r * (h + 1)];
        let mut lru = vec![0i16; r * h];
        for (i, (row, st)) in call.rows.iter().zip(before).enumerate() {
            tokens[i * (h + 1)..][..h].copy_from_slice(&st.tokens);
            tokens[i * (h + 1) + h] = row.seq as i32 - 1;
            lru[i * h..][..h].copy_from_slice(&st.lru);
        }
        Self::with_state(
            b,
            SwapPath::Mla,
            r as u32,
            hot,
            plan.k,
            plan.item,
            context,
            tokens,
            lru,
        )
    }

    /// The call's queries, each padded to the trace's widest with -1.
    fn trace_queries(
        &self,
        plan: &TracePlan,
        index: usize,
        call: &TraceCall,
    ) -> kvtier::Result<Queries> {
        let k = self.k as usize;
        let mut topk = vec![-1i32; call.rows.len() * k];
        for (i, row) in call.rows.iter().enumerate() {
            topk[i * k..][..row.topk.len()].copy_from_slice(&row.topk);
        }
        Ok(Queries {
            batch: call.rows.len() as u32,
            misses: None,
            topk,
            req: (0..call.rows.len() as i32).collect(),
            seq: call.rows.iter().map(|row| row.seq as i32).collect(),
            trace: Some((plan.name.clone(), index, call.layer)),
        })
    }

    fn params(&self, q: &Queries, misses: usize) -> Vec<(&'static str, serde_json::Value)> {
        match &q.trace {
            // the DSA path's points as they were before there were others
            None if self.path == SwapPath::Mla => vec![
                ("batch", json!(q.batch)),
                ("hot", json!(self.hot)),
                ("misses", json!(q.misses)),
                ("k", json!(self.k)),
                ("entry", json!(self.item)),
            ],
            // `k` counts query columns (blocks for M3), `misses` entries,
            // `entry` a row's bytes on one plane
            None => {
                let mut p = vec![
                    ("path", json!(self.path.name())),
                    ("batch", json!(q.batch)),
                    ("hot", json!(self.hot)),
                    ("misses", json!(q.misses)),
                    ("k", json!(self.k)),
                ];
                if let QueryKind::Blocks { block_tokens } = self.path.query() {
                    p.push(("block_tokens", json!(block_tokens)));
                }
                p.push(("entry", json!(self.item)));
                p
            }
            Some((file, call, layer)) => vec![
                ("trace", json!(file)),
                ("call", json!(call)),
                ("layer", json!(layer)),
                ("requests", json!(q.batch)),
                ("misses_total", json!(misses)),
                ("hot", json!(self.hot)),
                ("k", json!(self.k)),
                ("entry", json!(self.item)),
            ],
        }
    }

    /// The swap-in's arguments over buffers at `loc` addresses.
    ///
    /// # Safety
    /// The raw addresses hold the state's arrays as the executor addresses
    /// them, for as long as the arguments are used.
    #[allow(clippy::too_many_arguments)]
    unsafe fn args<'a>(
        &'a self,
        q: &'a Queries,
        loc: kvtier::Location,
        [
            tokens,
            lru,
            device_k,
            device_v,
            out,
            topk,
            locs,
            host_locs,
            req,
            seq,
        ]: [u64; 10],
        host_cache: u64,
        miss_plan: Option<MissPlan<'a>>,
    ) -> SwapInArgs<'a> {
        let (h, k, e) = (self.hot as usize, self.k as usize, self.entries());
        // SAFETY: per this function's contract.
        let plane = |p: usize, device: u64| unsafe {
            KvPlane {
                host: Buf::from_raw(
                    host_cache + p as u64 * self.host_plane_bytes,
                    self.host_plane_bytes as usize,
                    loc,
                ),
                device: BufMut::from_raw(device, self.device_bytes(), loc),
            }
        };
        // SAFETY: per this function's contract.
        unsafe {
            SwapInArgs {
                layer: None,
                top_k_tokens: Buf::from_raw(topk, q.topk.len(), loc),
                top_k_stride: k,
                query: self.path.query(),
                device_buffer_tokens: BufMut::from_raw(tokens, self.tokens.len(), loc),
                tokens_stride: h + 1,
                device_buffer_locs: Buf::from_raw(locs, self.locs.len(), loc),
                locs_stride: h + 1,
                lru_slots: BufMut::from_raw(lru, self.lru.len(), loc),
                lru_stride: h,
                host_cache_locs: Buf::from_raw(host_locs, self.host_locs.len(), loc),
                host_stride: self.context as usize,
                max_tokens: self.context,
                kv: KvBuffers {
                    layout: self.layout,
                    k: plane(0, device_k),
                    v: (self.path.planes() == 2).then(|| plane(1, device_v)),
                },
                top_k_device_locs: BufMut::from_raw(out, q.batch as usize * e, loc),
                out_stride: e,
                req_pool_indices: IndexBuf::I32(Buf::from_raw(req, q.req.len(), loc)),
                seq_lens: IndexBuf::I32(Buf::from_raw(seq, q.seq.len(), loc)),
                num_real_reqs: None,
                num_requests: self.requests,
                num_top_k: self.k,
                hot_buffer_size: self.hot,
                skip_io: false,
                miss_plan,
            }
        }
    }

    /// The (host row, device row) of every miss of `q`, and each row's count
    /// of them, from a swap-in on the CPU executor from the pristine state,
    /// recording its miss plan.
    fn misses_of(&self, q: &Queries) -> kvtier::Result<RecordedMisses> {
        let k = self.entries();
        let engine = kvtier::SwapInEngine::new(Executor::cpu())?;
        let m = Buffers::new(&Executor::cpu(), self, q)?;
        let (mut src, mut dst, mut count) = (
            vec![0i64; q.batch as usize * k],
            vec![0i32; q.batch as usize * k],
            vec![0i32; q.batch as usize],
        );
        let host_cache = self.pool.region_host_addr(&self.host_region)?;
        let plan = MissPlan {
            src: BufMut::host(&mut src),
            dst: BufMut::host(&mut dst),
            stride: k,
            capacity: k,
            count: BufMut::host(&mut count),
        };
        // SAFETY: host vectors of the state's shapes, alive for the call.
        let a = unsafe { self.args(q, kvtier::Location::Host, m.addrs(), host_cache, Some(plan)) };
        engine.run(&a, Stream::null())?;
        let misses = (0..q.batch as usize)
            .flat_map(|b| (0..count[b] as usize).map(move |i| (b, i)))
            .map(|(b, i)| (src[b * k + i], dst[b * k + i]))
            .collect();
        Ok((misses, count))
    }

    fn measure(
        &self,
        b: &Bench,
        q: &Queries,
        sglang: Option<&SglangKernels>,
    ) -> kvtier::Result<Vec<Measurement>> {
        let item = self.item as usize;
        let (misses, per_row) = self.misses_of(q)?;
        if let Some(drawn) = q.misses
            && misses.len() != (q.batch * drawn) as usize
        {
            return Err(kvtier::Error::Pool(format!(
                "benchmark self-check failed: {} planned, {} drawn",
                count(misses.len() as u64, "miss", "misses"),
                q.batch * drawn
            )));
        }
        let planes = self.path.planes();
        let bytes = misses.len() * item * planes;
        let host_base = self.pool.region_host_addr(&self.host_region)?;
        let host_plane = |p: usize| host_base + p as u64 * self.host_plane_bytes;
        // a plane's misses staged apart from the other's: its copy may still
        // read them while the host gathers the next plane's
        let mut staging = (0..planes)
            .map(|_| Staging::new(&b.exec, misses.len() * item))
            .collect::<kvtier::Result<Vec<_>>>()?;
        let params = self.params(q, misses.len());
        let groups = self.piece_groups(&misses);
        let sources: Vec<(Vec<u64>, usize)> = groups
            .iter()
            .map(|(p, len, at)| (at.iter().map(|&(h, _)| host_plane(*p) + h).collect(), *len))
            .collect();
        let exec = &b.exec;
        let clock = Clock::new(exec)?;
        // The pristine state, copied back untimed before every call.
        let pristine_tokens = ExecVec::from_host(exec, &self.tokens)?;
        let pristine_lru = ExecVec::from_host(exec, &self.lru)?;
        let m = Buffers::new(exec, self, q)?;
        let (tokens, lru, device_buffer, out) = (&m.tokens, &m.lru, &m.device_buffer, &m.out);
        let host_cache = match exec {
            Executor::Cpu => host_base,
            Executor::Cuda(dev) => self.pool.region_device_addr(&self.host_region, dev)?,
        };
        let addrs = m.addrs();
        let reset = |s: Stream| -> kvtier::Result<()> {
            // SAFETY: copies between buffers of equal length, in stream order.
            unsafe {
                transfer::copy_within(
                    exec,
                    tokens.addr(),
                    pristine_tokens.addr(),
                    4 * self.tokens.len(),
                    s,
                )?;
                transfer::copy_within(exec, lru.addr(), pristine_lru.addr(), 2 * self.lru.len(), s)
            }
        };
        // Before each method, untimed: no output, and the rows the check
        // reads holding other bytes, so that the check after it sees what it
        // wrote, not what the method before it left.
        let unwritten = vec![-7i32; out.len()];
        let spoil = || -> kvtier::Result<()> {
            // SAFETY: no call is running; lengths are the buffers'.
            unsafe { out.write(&unwritten)? };
            for &(src, dst) in [misses.first(), misses.last()].into_iter().flatten() {
                for (plane, buf) in device_buffer.iter().enumerate() {
                    for (at, len) in self.pieces(dst) {
                        let other = vec![!host_pattern(plane, src as usize); len];
                        // SAFETY: as above; `dst` is a row of the device planes.
                        unsafe { buf.write_at(at, &other)? };
                    }
                }
            }
            Ok(())
        };
        let loc = exec.location();
        let time_strategy = |strategy: SwapInStrategy,
                             copy: Build|
         -> kvtier::Result<(Stats, Vec<i32>)> {
            spoil()?;
            let t = b.time(&clock, Timing::Device, reset, |s| {
                // SAFETY: the buffers above live until after the timing.
                let a = unsafe { self.args(q, loc, addrs, host_cache, None) };
                match copy {
                    Build::Copy(copy) => self.tier.swap_in_with_copy(&a, strategy, copy, s),
                    Build::FixedShape(copy) => self.tier.swap_in_fixed_shape(&a, strategy, copy, s),
                    Build::Cluster => self.tier.swap_in_cluster_copy(&a, s),
                    Build::Split => self.tier.swap_in_cluster_plan(&a, s),
                }
            })?;
            self.tier.check(clock.stream())?;
            Ok((t, out.to_vec()?))
        };
        let (kv, out_kvtier) = time_strategy(
            SwapInStrategy::PlanThenCopy,
            Build::Copy(CopyMethod::WarpVectors),
        )?;
        self.verify("the kvtier swap-in", &misses, device_buffer)?;
        // Another strategy or copy method on the same state: its bytes
        // checked and its page table the same as the first's.
        let other_build = |strategy: SwapInStrategy,
                           copy: Build,
                           what: &str|
         -> kvtier::Result<Stats> {
            let (t, out_other) = time_strategy(strategy, copy)?;
            self.verify(
                &format!("the kvtier swap-in, {what}"),
                &misses,
                device_buffer,
            )?;
            if out_other != out_kvtier {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: the kvtier swap-in, {what}, gave a different page table"
                )));
            }
            Ok(t)
        };
        let other_with = |strategy: SwapInStrategy, copy: CopyMethod, what: &str| {
            other_build(strategy, Build::Copy(copy), what)
        };
        let other = |strategy: SwapInStrategy, what: &str| {
            other_with(strategy, CopyMethod::WarpVectors, what)
        };
        // The CPU executor has one way; on a GPU, SGLang's design and the
        // few-miss and compact planners next to the first planner.
        let (one_block, few_miss, few_miss_512, compact) = match exec {
            Executor::Cpu => (None, None, None, None),
            Executor::Cuda(_) => (
                Some(other(
                    SwapInStrategy::OneBlockPerRequest,
                    "one block per request",
                )?),
                Some(other(SwapInStrategy::FewMiss, "few-miss planner")?),
                Some(other(
                    SwapInStrategy::FewMiss512,
                    "few-miss planner, 512 threads",
                )?),
                Some((
                    other(SwapInStrategy::Compact, "compact planner")?,
                    other(
                        SwapInStrategy::CompactOneLaunch,
                        "compact planner, one launch",
                    )?,
                )),
            ),
        };
        // The few-miss planners copying every miss themselves (one launch,
        // no copy kernel).
        let one_launch = match exec {
            Executor::Cpu => None,
            Executor::Cuda(_) => Some((
                other(
                    SwapInStrategy::FewMissOneLaunch,
                    "few-miss planner, one launch",
                )?,
                other(
                    SwapInStrategy::FewMiss512OneLaunch,
                    "few-miss planner, 512 threads, one launch",
                )?,
            )),
        };
        // The few-miss planner's copy kernel with its rows' passes aligned to
        // 128-byte host lines, where it moves anything: a point whose rows
        // miss more than the planner copies itself.
        let few_miss_lines = match exec {
            Executor::Cuda(_) if misses.len() > FEW_MISS_INLINE as usize * q.batch as usize => {
                Some(other_with(
                    SwapInStrategy::FewMiss,
                    CopyMethod::LineAligned,
                    "few-miss planner, line-aligned copy",
                )?)
            }
            _ => None,
        };
        // The same planner's copy kernel moving each miss with the bulk-copy
        // engine (CopyMethod::BulkRuns, sm_90; elsewhere, and for rows with
        // a scale piece, the line-aligned kernel runs under that name).
        let few_miss_bulk = match exec {
            Executor::Cuda(dev)
                if dev.bulk_copy()
                    && misses.len() > FEW_MISS_INLINE as usize * q.batch as usize =>
            {
                Some(other_with(
                    SwapInStrategy::FewMiss,
                    CopyMethod::BulkRuns,
                    "few-miss planner, bulk copy",
                )?)
            }
            _ => None,
        };
        // The one-launch planner copying every miss with its rows' passes
        // aligned the same way, at every point: its copies are the planning
        // blocks' own, with 2 misses too.
        let one_launch_lines = match exec {
            Executor::Cuda(_) => Some(other_with(
                SwapInStrategy::FewMissOneLaunch,
                CopyMethod::LineAligned,
                "few-miss planner, one launch, line-aligned copy",
            )?),
            _ => None,
        };
        // Builds few GPU runs have timed (the fixed-shape builds, the
        // cluster build, the split planner) go through Bench::untried: a
        // failure leaves the build out of the point and a hang ends the run
        // with the points before it written, so that a new GPU or driver
        // does not cost the grid.
        // The few-miss planner's fixed-shape build (top-k and hot buffer
        // constants of the build), with its copy kernel and in one launch
        // (warp-vector and line-aligned copies: the default's above batch 10
        // on sm_90), at the shapes it has builds of.
        let fixed_shape = (self.entries() as u32, self.hot);
        let fixed = match exec {
            Executor::Cuda(_) if kvtier::swap_in::FIXED_SHAPES.contains(&fixed_shape) => {
                let what = [
                    "few-miss planner, fixed-shape build",
                    "few-miss planner, one launch, fixed-shape build",
                    "few-miss planner, one launch, fixed-shape build, line-aligned copy",
                ];
                let warp = Build::FixedShape(CopyMethod::WarpVectors);
                let lines = Build::FixedShape(CopyMethod::LineAligned);
                (
                    b.untried(what[0], || {
                        other_build(SwapInStrategy::FewMiss, warp, what[0])
                    })?,
                    b.untried(what[1], || {
                        other_build(SwapInStrategy::FewMissOneLaunch, warp, what[1])
                    })?,
                    b.untried(what[2], || {
                        other_build(SwapInStrategy::FewMissOneLaunch, lines, what[2])
                    })?,
                )
            }
            _ => (None, None, None),
        };
        // The few-miss planner's cluster build (one launch, a cluster of
        // blocks a row copying its misses), where the GPU launches clusters.
        let cluster = match exec {
            Executor::Cuda(dev) if dev.cluster_launch() => {
                let what = "few-miss planner, cluster build";
                b.untried(what, || {
                    other_build(SwapInStrategy::FewMiss, Build::Cluster, what)
                })?
            }
            _ => None,
        };
        // The split planner (a cluster of blocks plans each row, each block
        // copying its share of the misses), where the GPU launches clusters
        // and a block's state fits.
        let split = match exec {
            Executor::Cuda(dev)
                if dev.cluster_launch()
                    && kvtier::swap_in::split_smem_bytes(self.entries() as u32, self.hot)
                        <= dev.max_dynamic_smem() =>
            {
                let what = "split planner";
                b.untried(what, || {
                    other_build(SwapInStrategy::FewMiss, Build::Split, what)
                })?
            }
            _ => None,
        };
        // Where the copy kernel is a programmatic dependent of the plan
        // kernel (sm_90), the same two kernels launched one after the other:
        // what the dependent launch gains.
        let ordinary = match exec {
            Executor::Cuda(dev) if dev.dependent_launch() => {
                Some(other(SwapInStrategy::PlanThenCopyInOrder, "no PDL")?)
            }
            _ => None,
        };
        // SGLang's own kernel from the same state, with the same page table
        // expected (kvtier's is SGLang's on valid input).
        let theirs = match sglang {
            Some(k) => {
                let mut engine = kvtier::SwapInEngine::new(exec.clone())?;
                // Only for the checked parameters: SGLang's kernel uses none
                // of the engine's plan scratch, but the check sizes it.
                engine.reserve(q.batch, self.entries() as u32)?;
                let num_real = ExecVec::from_host(exec, &[q.batch as i32])?;
                // SAFETY: the buffers above live until after the timing.
                let mut a = unsafe { self.args(q, loc, addrs, host_cache, None) };
                a.num_real_reqs = Some(num_real.buf());
                let p = engine.swap_in_params(&a, SwapInStrategy::PlanThenCopy)?;
                spoil()?;
                // SAFETY: parameters checked for device buffers that live
                // until after the timing.
                let t = b.time(&clock, Timing::Device, reset, |s| unsafe {
                    k.swap_in(self.path, &p, s)
                })?;
                self.tier.check(clock.stream())?;
                self.verify("SGLang's swap-in kernel", &misses, device_buffer)?;
                if out.to_vec()? != out_kvtier {
                    return Err(kvtier::Error::Pool(
                        "benchmark self-check failed: SGLang's kernel gave a different page table \
                         from kvtier's"
                            .into(),
                    ));
                }
                Some(t)
            }
            None => None,
        };
        let dev_base = |p: usize| device_buffer[p].addr();
        let pairs: Vec<(Vec<(u64, u64)>, usize)> = groups
            .iter()
            .map(|(p, len, at)| {
                let pairs = at
                    .iter()
                    .map(|&(h, d)| (host_plane(*p) + h, dev_base(*p) + d))
                    .collect();
                (pairs, *len)
            })
            .collect();
        let none = |_: Stream| Ok(());
        // SAFETY (all three): sources are host-cache rows (registered for the
        // CUDA executor), destinations rows of the device planes (or their
        // first bytes: a plane's host and device rows hold the misses'
        // bytes, whatever their layout, in whole pages).
        let limit = b.time(&clock, Timing::Device, none, |s| unsafe {
            for p in 0..planes {
                let n = misses.len() * item;
                transfer::contiguous(exec, Dir::HostToDevice, host_plane(p), dev_base(p), n, s)?;
            }
            Ok(())
        })?;
        let each = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            for (pairs, len) in &pairs {
                transfer::per_entry(exec, Dir::HostToDevice, pairs, *len, s)?;
            }
            Ok(())
        })?;
        // The latency floor a swap-in with few misses is judged against, on a
        // GPU: kvtier's copy kernel launched over an empty plan (one launch
        // and a few device reads), and over a plan of two of the misses (one
        // more round trip over the link).
        let floors = match exec {
            Executor::Cuda(_) => {
                let two: Vec<(i64, i32)> = misses.iter().take(2).copied().collect();
                let src = ExecVec::from_host(exec, &two.iter().map(|m| m.0).collect::<Vec<_>>())?;
                let dst = ExecVec::from_host(exec, &two.iter().map(|m| m.1).collect::<Vec<_>>())?;
                let engine = kvtier::SwapInEngine::new(exec.clone())?;
                let floor = |n: i32| -> kvtier::Result<Stats> {
                    let count = ExecVec::from_host(exec, &[n])?;
                    // SAFETY: the state's buffers, alive until after the timing.
                    let a = unsafe { self.args(q, loc, addrs, host_cache, None) };
                    let planned = kvtier::PlannedCopyArgs {
                        src: src.buf(),
                        dst: dst.buf(),
                        count: count.buf(),
                        stride: two.len().max(1),
                        capacity: two.len().max(1),
                        num_real_reqs: None,
                        kv: a.kv,
                        skip_io: false,
                    };
                    b.time(&clock, Timing::Device, none, |s| {
                        engine.copy_planned(&planned, None, s)
                    })
                };
                Some((floor(0)?, floor(two.len() as i32)?, two.len()))
            }
            Executor::Cpu => None,
        };
        self.verify("a copy per miss", &misses, device_buffer)?;
        // On a GPU, the copy kernel alone over the swap-in's recorded plan
        // (a plan replay, as SGLang's shared-index layers make), with each
        // copy method: the miss copy's own time, without the planning.
        let replays = match exec {
            Executor::Cuda(_) if !misses.is_empty() => {
                let width = per_row.iter().copied().max().unwrap_or(1).max(1) as usize;
                let (mut src, mut dst) = (
                    vec![0i64; per_row.len() * width],
                    vec![0i32; per_row.len() * width],
                );
                let mut next = misses.iter();
                for (r, &n) in per_row.iter().enumerate() {
                    for i in 0..n as usize {
                        (src[r * width + i], dst[r * width + i]) =
                            *next.next().expect("a miss per count");
                    }
                }
                let (src, dst, count) = (
                    ExecVec::from_host(exec, &src)?,
                    ExecVec::from_host(exec, &dst)?,
                    ExecVec::from_host(exec, &per_row)?,
                );
                let engine = kvtier::SwapInEngine::new(exec.clone())?;
                let mut times = Vec::new();
                for (copy, what) in [
                    (
                        CopyMethod::WarpVectors,
                        "kvtier plan replay (the copy kernel alone)",
                    ),
                    (
                        CopyMethod::LineAligned,
                        "kvtier plan replay (the copy kernel alone), line-aligned copy",
                    ),
                    (
                        CopyMethod::BulkRuns,
                        "kvtier plan replay (the copy kernel alone), bulk copy",
                    ),
                ] {
                    // SAFETY: the state's buffers, alive until after the timing.
                    let a = unsafe { self.args(q, loc, addrs, host_cache, None) };
                    let planned = kvtier::PlannedCopyArgs {
                        src: src.buf(),
                        dst: dst.buf(),
                        count: count.buf(),
                        stride: width,
                        capacity: width,
                        num_real_reqs: None,
                        kv: a.kv,
                        skip_io: false,
                    };
                    spoil()?;
                    let t = b.time(&clock, Timing::Device, none, |s| {
                        engine.copy_planned_with_copy(&planned, None, copy, s)
                    })?;
                    engine.check()?;
                    self.verify(&format!("a plan replay ({copy:?})"), &misses, device_buffer)?;
                    times.push((what, t));
                }
                times
            }
            _ => Vec::new(),
        };
        let runs: Vec<Vec<(&[u64], usize)>> = (0..planes)
            .map(|p| {
                groups
                    .iter()
                    .zip(&sources)
                    .filter(|((plane, ..), _)| *plane == p)
                    .map(|(_, (v, len))| (&v[..], *len))
                    .collect()
            })
            .collect();
        let staged = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            for (p, (runs, staging)) in runs.iter().zip(&mut staging).enumerate() {
                transfer::staged_gather_runs(exec, runs, staging, dev_base(p), s)?;
            }
            Ok(())
        })?;
        let row = |cpu, cuda, t, limit| {
            Measurement::new(SCENARIO, named(exec, cpu, cuda), &params, bytes, t, limit)
        };
        let mut rows = vec![row(
            "kvtier swap-in (CPU executor)",
            "kvtier swap-in (plan + wide copy)",
            kv,
            false,
        )];
        if let Some(t) = few_miss {
            rows.push(row("", FEW_MISS_ROW, t, false));
        }
        if let Some(t) = few_miss_lines {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, line-aligned copy",
                t,
                false,
            ));
        }
        if let Some(t) = few_miss_bulk {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, bulk copy",
                t,
                false,
            ));
        }
        if let Some(t) = one_launch_lines {
            rows.push(row("", ONE_LAUNCH_LINES_ROW, t, false));
        }
        if let Some((one, one_512)) = one_launch {
            rows.push(row("", ONE_LAUNCH_ROW, one, false));
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, blocks of 512 threads, one launch",
                one_512,
                false,
            ));
        }
        if let Some(t) = cluster {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, cluster build (one launch)",
                t,
                false,
            ));
        }
        if let Some(t) = split {
            rows.push(row("", SPLIT_ROW, t, false));
        }
        if let Some(t) = fixed.0 {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, fixed-shape build",
                t,
                false,
            ));
        }
        if let Some(t) = fixed.1 {
            rows.push(row("", ONE_LAUNCH_FIXED_ROW, t, false));
        }
        if let Some(t) = fixed.2 {
            rows.push(row("", ONE_LAUNCH_FIXED_LINES_ROW, t, false));
        }
        if let Some(t) = few_miss_512 {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, blocks of 512 threads",
                t,
                false,
            ));
        }
        if let Some((two, one)) = compact {
            rows.push(row("", "kvtier swap-in, compact planner", two, false));
            rows.push(row(
                "",
                "kvtier swap-in, compact planner, one launch",
                one,
                false,
            ));
        }
        if let Some(t) = ordinary {
            rows.push(row(
                "",
                "kvtier swap-in, copy launched after the plan (no PDL)",
                t,
                false,
            ));
        }
        if let Some(t) = one_block {
            rows.push(row("", "one block per request (SGLang's design)", t, false));
        }
        if let Some(t) = theirs {
            rows.push(row("", SGLANG_ROW, t, false));
        }
        rows.extend([
            row(
                "contiguous memcpy of the misses (limit)",
                LIMIT_ROW,
                limit,
                true,
            ),
            row("per-miss memcpy", "cudaMemcpyAsync per miss", each, false),
        ]);
        if let Some((empty, two, n)) = floors {
            let floor = |what, bytes, t| Measurement::new(SCENARIO, what, &params, bytes, t, false);
            rows.push(floor(
                "floor: copy kernel over an empty plan (one launch)",
                0,
                empty,
            ));
            rows.push(floor(
                "floor: copy kernel over two of the misses (a launch and one round trip)",
                n * item * planes,
                two,
            ));
        }
        for (what, t) in replays {
            rows.push(row("", what, t, false));
        }
        rows.extend([row(
            "host gather of the misses + one memcpy",
            "host gather of the misses + one H2D copy",
            staged,
            false,
        )]);
        Ok(rows)
    }

    /// Checks the first and last loaded rows, every piece on every plane,
    /// against their host rows.
    fn verify(
        &self,
        method: &str,
        misses: &[(i64, i32)],
        device: &[ExecVec<u8>],
    ) -> kvtier::Result<()> {
        for &(src, dst) in [misses.first(), misses.last()].into_iter().flatten() {
            for (plane, buf) in device.iter().enumerate() {
                let want = host_pattern(plane, src as usize);
                for (at, len) in self.pieces(dst) {
                    if buf.read(at, len)?.iter().any(|&b| b != want) {
                        let which = match device.len() {
                            1 => String::new(),
                            _ => format!(" of plane {}", ["K", "V"][plane]),
                        };
                        return Err(kvtier::Error::Pool(format!(
                            "benchmark self-check failed: {method} loaded the wrong bytes into \
                             device row {dst}{which}"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// What the misses move, a group for each plane and piece of a row (a
    /// C4 row's value and its scale), so that a group's pieces are of one
    /// length: (plane, length, each miss's (host, device) byte offsets in
    /// the plane).
    #[allow(clippy::type_complexity)]
    fn piece_groups(&self, misses: &[(i64, i32)]) -> Vec<(usize, usize, Vec<(u64, u64)>)> {
        let mut groups = Vec::new();
        for plane in 0..self.path.planes() {
            for piece in 0..2 {
                let len = self.layout.pieces(0)[piece].1;
                if len == 0 {
                    continue;
                }
                let at = misses
                    .iter()
                    .map(|&(src, dst)| {
                        let (h, d) = (
                            self.layout.pieces(src as u64),
                            self.layout.pieces(dst as u64),
                        );
                        (h[piece].0, d[piece].0)
                    })
                    .collect();
                groups.push((plane, len, at));
            }
        }
        groups
    }
}
