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
//!    line-aligned copy method (CopyMethod::LineAligned); on sm_90
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

use std::collections::HashSet;
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde_json::json;

use kvtier::swap_in::FEW_MISS_INLINE;
use kvtier::trace::{RowState, Trace, TraceCall};
use kvtier::{
    Buf, BufMut, CopyMethod, Executor, IndexBuf, KvBuffers, LayerFirstLayout, MissPlan, Pool,
    QueryKind, Region, Stream, SwapInArgs, SwapInStrategy, Tier,
};

use super::sglang::SglangKernels;
use super::{Bench, Clock, Measurement, Stats, Timing, count, invalid, named, row_pattern};
use crate::transfer::{self, Dir, ExecVec, Staging};

const SCENARIO: &str = "swap-in";

/// Every miss of a call in row order (host row, device row), and each row's
/// count of them.
type RecordedMisses = (Vec<(i64, i32)>, Vec<i32>);

fn grid(b: &Bench) -> kvtier::Result<(Vec<u32>, Vec<u32>)> {
    let k = b.args.swap_k;
    for &hot in b.hot() {
        if k == 0 || k > hot {
            return Err(invalid(
                "--swap-k",
                format!("{k} must be in 1..=hot ({hot})"),
            ));
        }
    }
    if let Some(&m) = b.args.misses.iter().find(|&&m| m > k) {
        return Err(invalid("--misses", format!("{m} exceeds K = {k}")));
    }
    Ok((b.entries(&["fp8-dsa"])?, b.batches(&[1, 10, 100, 256])))
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
    let mut rows = Vec::new();
    for &item in &entries {
        for &hot in b.hot() {
            let sglang = serving(b, sglang.as_ref(), b.args.swap_k, hot);
            let state = State::build(b, max_batch, hot, item)?;
            for &batch in &batches {
                for &misses in &b.args.misses {
                    b.progress.set_message(format!(
                        "swap-in: {item} B, hot {hot}, batch {batch}, {}",
                        count(misses, "miss", "misses")
                    ));
                    let q = state.queries(batch, misses, b.args.seed);
                    rows.extend(state.measure(b, &q, sglang)?);
                    b.progress.inc(1);
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

/// SGLang's kernel where its build serves top-k `k` at `hot`; elsewhere
/// none, and the output says why its line is missing.
fn serving<'a>(
    b: &Bench,
    sglang: Option<&'a SglangKernels>,
    k: u32,
    hot: u32,
) -> Option<&'a SglangKernels> {
    if sglang.is_some() && !SglangKernels::serves_swap_in(k, hot) {
        b.progress.suspend(|| {
            println!(
                "swap-in: SGLang's kernel is built for top-k 2048 and hot 4096 or 8192 only: \
                 not timed at top-k {k}, hot {hot}"
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
    let sglang = serving(b, sglang, plan.k, hot);
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
        rows.extend(state.measure(b, &q, if padded { None } else { sglang })?);
        b.progress.inc(1);
    }
    Ok(rows)
}

/// Per-request HiSparse state for `requests` long requests, the host cache
/// rows in a pool (registered for the GPU by the tier), the swap-in engine.
struct State {
    requests: u32,
    hot: u32,
    k: u32,
    item: u32,
    context: u32,
    tokens: Vec<i32>,    // [requests][hot + 1]
    locs: Vec<i32>,      // [requests][hot + 1]
    lru: Vec<i16>,       // [requests][hot]
    host_locs: Vec<i64>, // [requests][context]
    pool: Arc<Pool>,
    host_region: Region,
    tier: Tier,
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
    device_buffer: ExecVec<u8>,
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
            device_buffer: ExecVec::zeroed(exec, s.device_rows() * s.item as usize)?,
            out: ExecVec::zeroed(exec, q.batch as usize * s.k as usize)?,
            topk: ExecVec::from_host(exec, &q.topk)?,
            locs: ExecVec::from_host(exec, &s.locs)?,
            host_locs: ExecVec::from_host(exec, &s.host_locs)?,
            req: ExecVec::from_host(exec, &q.req)?,
            seq: ExecVec::from_host(exec, &q.seq)?,
        })
    }

    /// The addresses, in [`State::args`] order.
    fn addrs(&self) -> [u64; 9] {
        [
            self.tokens.addr(),
            self.lru.addr(),
            self.device_buffer.addr(),
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
    fn build(b: &Bench, requests: u32, hot: u32, item: u32) -> kvtier::Result<Self> {
        let k = b.args.swap_k;
        let mut rng = StdRng::seed_from_u64(b.args.seed ^ hot as u64 ^ ((item as u64) << 32));
        let context = hot + 2 * k;
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
        Self::with_state(b, requests, hot, k, item, context, tokens, lru)
    }

    /// A state of `requests` rows with these slot tokens (`hot + 1` per
    /// row) and LRU orders, host rows for `context` positions each, filled
    /// with [`row_pattern`] in a pool.
    #[allow(clippy::too_many_arguments)]
    fn with_state(
        b: &Bench,
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

        // The host cache, row j filled with a byte pattern of j, in the pool.
        let host_rows = r * c;
        let layout = LayerFirstLayout::new(item, 1, host_rows as u32)?;
        let pool = Pool::create(layout, b.pool_device(Pool::device_bytes_for(&layout, 1)?))?;
        let host_region = pool.alloc_region()?;
        let chunk = 4096usize;
        let mut bytes = vec![0u8; chunk * item as usize];
        for first in (0..host_rows).step_by(chunk) {
            let n = chunk.min(host_rows - first);
            for (i, row) in bytes.chunks_mut(item as usize).take(n).enumerate() {
                row.fill(row_pattern(first + i));
            }
            pool.write_tokens(&host_region, 0, first as u32, &bytes[..n * item as usize])?;
        }
        let mut tier = Tier::new(pool.clone(), b.exec.clone(), 1)?;
        tier.enable_swap_in(requests, k)?;
        Ok(State {
            requests,
            hot,
            k,
            item,
            context,
            tokens,
            locs,
            lru,
            host_locs,
            pool,
            host_region,
            tier,
        })
    }

    fn device_rows(&self) -> usize {
        self.requests as usize * (self.hot as usize + 1)
    }

    /// Per request: K - misses resident tokens and `misses` absent ones.
    fn queries(&self, batch: u32, misses: u32, seed: u64) -> Queries {
        let mut rng = StdRng::seed_from_u64(seed ^ ((batch as u64) << 32) ^ misses as u64);
        let (h, k) = (self.hot as usize, self.k as usize);
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
        Queries {
            batch,
            misses: Some(misses),
            topk,
            req: (0..batch as i32).collect(),
            seq: vec![self.context as i32; batch as usize],
            trace: None,
        }
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
        Self::with_state(b, r as u32, hot, plan.k, plan.item, context, tokens, lru)
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
            None => vec![
                ("batch", json!(q.batch)),
                ("hot", json!(self.hot)),
                ("misses", json!(q.misses)),
                ("k", json!(self.k)),
                ("entry", json!(self.item)),
            ],
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
            device_buffer,
            out,
            topk,
            locs,
            host_locs,
            req,
            seq,
        ]: [u64; 9],
        host_cache: u64,
        miss_plan: Option<MissPlan<'a>>,
    ) -> SwapInArgs<'a> {
        let (h, k) = (self.hot as usize, self.k as usize);
        // SAFETY: per this function's contract.
        unsafe {
            SwapInArgs {
                layer: None,
                top_k_tokens: Buf::from_raw(topk, q.topk.len(), loc),
                top_k_stride: k,
                query: QueryKind::Tokens,
                device_buffer_tokens: BufMut::from_raw(tokens, self.tokens.len(), loc),
                tokens_stride: h + 1,
                device_buffer_locs: Buf::from_raw(locs, self.locs.len(), loc),
                locs_stride: h + 1,
                lru_slots: BufMut::from_raw(lru, self.lru.len(), loc),
                lru_stride: h,
                host_cache_locs: Buf::from_raw(host_locs, self.host_locs.len(), loc),
                host_stride: self.context as usize,
                max_tokens: self.context,
                kv: KvBuffers::linear(
                    self.item,
                    Buf::from_raw(host_cache, self.host_locs.len() * self.item as usize, loc),
                    BufMut::from_raw(device_buffer, self.device_rows() * self.item as usize, loc),
                )
                .expect("the bench's items are multiples of 8"),
                top_k_device_locs: BufMut::from_raw(out, q.batch as usize * k, loc),
                out_stride: k,
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
        let k = self.k as usize;
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
        let bytes = misses.len() * item;
        let host_base = self.pool.region_host_addr(&self.host_region)?;
        let mut staging = Staging::new(&b.exec, bytes)?;
        let params = self.params(q, misses.len());
        let sources: Vec<u64> = misses
            .iter()
            .map(|&(src, _)| host_base + src as u64 * item as u64)
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
                let other = vec![!row_pattern(src as usize); item];
                // SAFETY: as above; `dst` is a row of the device buffer.
                unsafe { device_buffer.write_at(dst as usize * item, &other)? };
            }
            Ok(())
        };
        let loc = exec.location();
        let time_strategy =
            |strategy: SwapInStrategy, copy: CopyMethod| -> kvtier::Result<(Stats, Vec<i32>)> {
                spoil()?;
                let t = b.time(&clock, Timing::Device, reset, |s| {
                    // SAFETY: the buffers above live until after the timing.
                    let a = unsafe { self.args(q, loc, addrs, host_cache, None) };
                    self.tier.swap_in_with_copy(&a, strategy, copy, s)
                })?;
                self.tier.check(clock.stream())?;
                Ok((t, out.to_vec()?))
            };
        let row_of = |r: usize| device_buffer.read(r * item, item);
        let (kv, out_kvtier) =
            time_strategy(SwapInStrategy::PlanThenCopy, CopyMethod::WarpVectors)?;
        self.verify("the kvtier swap-in", &misses, row_of)?;
        // Another strategy or copy method on the same state: its bytes
        // checked and its page table the same as the first's.
        let other_with = |strategy: SwapInStrategy,
                          copy: CopyMethod,
                          what: &str|
         -> kvtier::Result<Stats> {
            let (t, out_other) = time_strategy(strategy, copy)?;
            self.verify(&format!("the kvtier swap-in, {what}"), &misses, row_of)?;
            if out_other != out_kvtier {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: the kvtier swap-in, {what}, gave a different page table"
                )));
            }
            Ok(t)
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
                engine.reserve(q.batch, self.k)?;
                let num_real = ExecVec::from_host(exec, &[q.batch as i32])?;
                // SAFETY: the buffers above live until after the timing.
                let mut a = unsafe { self.args(q, loc, addrs, host_cache, None) };
                a.num_real_reqs = Some(num_real.buf());
                let p = engine.swap_in_params(&a, SwapInStrategy::PlanThenCopy)?;
                spoil()?;
                // SAFETY: parameters checked for device buffers that live
                // until after the timing.
                let t = b.time(&clock, Timing::Device, reset, |s| unsafe {
                    k.swap_in(&p, s)
                })?;
                self.tier.check(clock.stream())?;
                self.verify("SGLang's swap-in kernel", &misses, row_of)?;
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
        let dev_base = device_buffer.addr();
        let pairs: Vec<(u64, u64)> = misses
            .iter()
            .zip(&sources)
            .map(|(&(_, dst), &src)| (src, dev_base + dst as u64 * item as u64))
            .collect();
        let none = |_: Stream| Ok(());
        // SAFETY (all three): sources are host-cache rows (registered for the
        // CUDA executor), destinations rows of the device buffer (or its
        // first `bytes`).
        let limit = b.time(&clock, Timing::Device, none, |s| unsafe {
            transfer::contiguous(exec, Dir::HostToDevice, host_base, dev_base, bytes, s)
        })?;
        let each = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            transfer::per_entry(exec, Dir::HostToDevice, &pairs, item, s)
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
                    self.verify(&format!("a plan replay ({copy:?})"), &misses, row_of)?;
                    times.push((what, t));
                }
                times
            }
            _ => Vec::new(),
        };
        self.verify("a copy per miss", &misses, row_of)?;
        let staged = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            transfer::staged_gather(exec, &sources, &mut staging, dev_base, item, s)
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
            rows.push(row("", "kvtier swap-in, few-miss planner", t, false));
        }
        if let Some(t) = few_miss_lines {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, line-aligned copy",
                t,
                false,
            ));
        }
        if let Some((one, one_512)) = one_launch {
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, one launch",
                one,
                false,
            ));
            rows.push(row(
                "",
                "kvtier swap-in, few-miss planner, blocks of 512 threads, one launch",
                one_512,
                false,
            ));
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
            rows.push(row("", "SGLang 0.5.23's swap-in kernel", t, false));
        }
        rows.extend([
            row(
                "contiguous memcpy of the misses (limit)",
                "contiguous H2D copy of the misses (limit)",
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
                n * item,
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

    /// Checks the first and last loaded rows against their host rows.
    fn verify(
        &self,
        method: &str,
        misses: &[(i64, i32)],
        row_of: impl Fn(usize) -> kvtier::Result<Vec<u8>>,
    ) -> kvtier::Result<()> {
        for &(src, dst) in [misses.first(), misses.last()].into_iter().flatten() {
            let want = row_pattern(src as usize);
            if row_of(dst as usize)?.iter().any(|&b| b != want) {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: {method} loaded the wrong bytes into device row {dst}"
                )));
            }
        }
        Ok(())
    }
}
