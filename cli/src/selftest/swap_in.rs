//! The single-step swap-in on every path kvtier serves for SGLang, and the
//! replay of a recorded miss plan, on each executor from identical state.
//!
//! A case is SGLang's per-request state (slot tokens, device rows, LRU
//! order, host rows), a batch (request rows, lengths, queries) and the KV
//! rows (host cache in registered host memory, device buffer), with random
//! bytes everywhere so that every byte a call writes, or must not write, is
//! compared. Half the cases are hostile: requests and lengths out of range,
//! a request named twice, an LRU row that is not a permutation, device and
//! host rows out of range, tokens and block ids out of range, duplicates.

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};

use kvtier::{
    Buf, CopyMethod, Executor, IndexBuf, ItemLayout, KvBuffers, KvPlane, MissPlan, PlannedCopyArgs,
    QueryKind, Stream, SwapInArgs, SwapInEngine, SwapInStrategy,
};

use super::snapshot::{Snapshot, Verdict, settle};
use super::{Row, run_cases};
use crate::transfer::{ExecVec, Staging};

/// SGLang's swap-in paths kvtier serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    /// DeepSeek-V3.2 / GLM DSA decode: token queries, linear MLA rows.
    Dsa,
    /// DeepSeek-V4: token queries, page-padded C4 rows.
    Dsv4,
    /// MiniMax-M3: block queries, K and V planes.
    BlocksKv,
}

impl Path {
    pub const ALL: [Path; 3] = [Path::Dsa, Path::Dsv4, Path::BlocksKv];

    fn name(self) -> &'static str {
        match self {
            Path::Dsa => "swap-in, DSA tokens, linear rows",
            Path::Dsv4 => "swap-in, DeepSeek-V4 page-padded C4 rows",
            Path::BlocksKv => "swap-in, MiniMax-M3 blocks, K and V",
        }
    }
}

/// One swap-in: state, batch and KV rows, as host vectors.
#[derive(Clone, Debug)]
pub(super) struct SwapCase {
    layout: ItemLayout,
    query: QueryKind,
    planes: usize,
    requests: usize,
    hot: usize,
    context: usize,
    num_top_k: usize,
    strides: Strides,
    tokens: Vec<i32>,
    locs: Vec<i32>,
    lru: Vec<i16>,
    host_locs: Vec<i64>,
    host_rows: usize,
    device_rows: usize,
    req: Vec<i64>,
    seq: Vec<i64>,
    index_i64: bool,
    topk: Vec<i32>,
    num_real: Option<i32>,
    skip_io: bool,
    /// Record the misses into a caller's plan (initial counts given).
    plan_counts: Option<Vec<i32>>,
    fill_seed: u64,
}

#[derive(Clone, Copy, Debug)]
struct Strides {
    topk: usize,
    tokens: usize,
    locs: usize,
    lru: usize,
    host: usize,
    out: usize,
    plan: usize,
}

/// Rows of whole pages.
fn whole_pages(rows: usize, layout: &ItemLayout) -> usize {
    rows.div_ceil(layout.rows_per_page() as usize) * layout.rows_per_page() as usize
}

fn plane_bytes(rows: usize, layout: &ItemLayout) -> usize {
    rows / layout.rows_per_page() as usize * layout.page_bytes() as usize
}

impl SwapCase {
    /// A random case of `path`; odd seeds are hostile.
    pub fn random(path: Path, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ ((path as u64) << 56));
        let hostile = seed % 2 == 1;
        let (layout, query, planes) = match path {
            Path::Dsa => {
                let item = if rng.random_bool(0.5) {
                    656
                } else {
                    8 * rng.random_range(1..=80)
                };
                (
                    ItemLayout::linear(item).expect("a multiple of 8"),
                    QueryKind::Tokens,
                    1,
                )
            }
            Path::Dsv4 => (ItemLayout::dsv4_c4(), QueryKind::Tokens, 1),
            Path::BlocksKv => {
                let item = 8 * rng.random_range(1..=32);
                let block_tokens = [1, 2, 4, 16][rng.random_range(0..4)];
                (
                    ItemLayout::linear(item).expect("a multiple of 8"),
                    QueryKind::Blocks { block_tokens },
                    2,
                )
            }
        };
        let s = query.block_tokens() as usize;
        let hot = rng.random_range(16..=320usize);
        let num_top_k = rng.random_range(1..=hot / s);
        let requests = rng.random_range(1..=6usize);
        let context = hot + 1 + rng.random_range(0..=3 * hot);
        // Hostile batches may name more rows than there are requests.
        let batch = rng.random_range(1..=requests + if hostile { 2 } else { 0 });
        let mut case = Self::empty(layout, query, planes, requests, hot, context, num_top_k);
        case.strides = Strides {
            topk: num_top_k + rng.random_range(0..3),
            tokens: hot + [0, 1, s][rng.random_range(0..3)],
            locs: hot + 1 + rng.random_range(0..3),
            lru: hot + rng.random_range(0..3),
            host: context + rng.random_range(0..3),
            out: num_top_k * s + rng.random_range(0..3),
            plan: num_top_k * s + rng.random_range(0..3),
        };
        case.fill_state(&mut rng, hostile);
        // Batch rows: distinct requests (a hostile case may name one twice or
        // one out of range), long and short sequences.
        let mut rows: Vec<i64> = (0..requests as i64).collect();
        rows.shuffle(&mut rng);
        for b in 0..batch {
            let r = match rng.random_range(0..12) {
                0 if hostile => rng.random_range(0..requests as i64),
                1 if hostile => requests as i64 + rng.random_range(0..3),
                2 if hostile => -1 - rng.random_range(0..3),
                _ => rows.get(b).copied().unwrap_or(0),
            };
            let seq = match rng.random_range(0..12) {
                0 if hostile => context as i64 + rng.random_range(1..4),
                1 if hostile => -rng.random_range(0..3),
                2..=4 => rng.random_range(1..=hot as i64),
                _ => rng.random_range(hot as i64 + 1..=context as i64),
            };
            case.req.push(r);
            case.seq.push(seq);
        }
        case.index_i64 = rng.random_bool(0.5);
        case.topk = vec![0; batch * case.strides.topk];
        for b in 0..batch {
            let q = case.draw_query(&mut rng, b, hostile, None);
            case.topk[b * case.strides.topk..][..num_top_k].copy_from_slice(&q);
        }
        case.num_real = match rng.random_range(0..4) {
            0 => Some(rng.random_range(0..=batch as i32 + 1)),
            1 if hostile => Some(-1),
            _ => None,
        };
        case.skip_io = rng.random_range(0..8) == 0;
        case.plan_counts = rng
            .random_bool(0.5)
            .then(|| (0..batch).map(|_| rng.random_range(0..5)).collect());
        case
    }

    /// The production shape: HOT 4096, K 2048, 656-byte rows, every request
    /// a long sequence with `misses` misses of its K.
    pub fn production(seed: u64, batch: usize, misses: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let (hot, k) = (4096usize, 2048usize);
        let context = hot + 4096;
        let layout = ItemLayout::linear(656).expect("a multiple of 8");
        let mut case = Self::empty(layout, QueryKind::Tokens, 1, batch, hot, context, k);
        case.fill_state(&mut rng, false);
        for b in 0..batch {
            case.req.push(b as i64);
            case.seq.push(context as i64);
            let q = case.draw_query(&mut rng, b, false, Some(misses));
            case.topk.extend(q);
        }
        case
    }

    fn empty(
        layout: ItemLayout,
        query: QueryKind,
        planes: usize,
        requests: usize,
        hot: usize,
        context: usize,
        num_top_k: usize,
    ) -> Self {
        let entries = num_top_k * query.block_tokens() as usize;
        SwapCase {
            layout,
            query,
            planes,
            requests,
            hot,
            context,
            num_top_k,
            strides: Strides {
                topk: num_top_k,
                tokens: hot + 1,
                locs: hot + 1,
                lru: hot,
                host: context,
                out: entries,
                plan: entries,
            },
            tokens: vec![],
            locs: vec![],
            lru: vec![],
            host_locs: vec![],
            host_rows: whole_pages(requests * context, &layout),
            device_rows: whole_pages(requests * (hot + 1), &layout),
            req: vec![],
            seq: vec![],
            index_i64: false,
            topk: vec![],
            num_real: None,
            skip_io: false,
            plan_counts: None,
            fill_seed: 0,
        }
    }

    /// Per request: distinct resident tokens in the slots (some empty), its
    /// device rows, a random LRU order, host rows; hostile cases break one
    /// of each now and then.
    fn fill_state(&mut self, rng: &mut StdRng, hostile: bool) {
        let (r, h, st) = (self.requests, self.hot, self.strides);
        self.tokens = vec![-7; r * st.tokens];
        self.locs = vec![-7; r * st.locs];
        self.lru = vec![-7; r * st.lru];
        self.host_locs = vec![-7; r * st.host];
        let mut candidates: Vec<i32> = (0..self.context as i32 - 1).collect();
        for req in 0..r {
            candidates.shuffle(rng);
            let slots = &mut self.tokens[req * st.tokens..][..h];
            for (slot, &t) in slots.iter_mut().zip(&candidates) {
                *slot = if rng.random_range(0..10) == 0 { -1 } else { t };
            }
            for s in 0..=h {
                self.locs[req * st.locs + s] = (req * (h + 1) + s) as i32;
            }
            let mut order: Vec<i16> = (0..h as i16).collect();
            order.shuffle(rng);
            self.lru[req * st.lru..][..h].copy_from_slice(&order);
            for t in 0..self.context {
                self.host_locs[req * st.host + t] = (req * self.context + t) as i64;
            }
            if hostile {
                match rng.random_range(0..4) {
                    0 => self.lru[req * st.lru + rng.random_range(0..h)] = 0,
                    1 => {
                        self.locs[req * st.locs + rng.random_range(0..=h)] =
                            self.device_rows as i32 + rng.random_range(0..3)
                    }
                    2 => {
                        self.host_locs[req * st.host + rng.random_range(0..self.context)] =
                            [-1, self.host_rows as i64][rng.random_range(0..2)]
                    }
                    _ => {}
                }
            }
        }
        self.fill_seed = rng.next_u64();
    }

    /// A row's query: for a long request mostly tokens it holds (hits) and
    /// others (misses), exactly `misses` of them when given; -1 padding now
    /// and then; hostile rows add tokens out of range and duplicates.
    fn draw_query(
        &self,
        rng: &mut StdRng,
        b: usize,
        hostile: bool,
        misses: Option<usize>,
    ) -> Vec<i32> {
        let s = self.query.block_tokens() as i64;
        let k = self.num_top_k;
        let seq = self.seq[b].max(1);
        let units = (seq + s - 1) / s; // tokens, or blocks
        let req = self.req[b];
        let resident: Vec<i32> = if (0..self.requests as i64).contains(&req) {
            let row = &self.tokens[req as usize * self.strides.tokens..][..self.hot];
            row.iter()
                .map(|&t| (t as i64 / s) as i32)
                .filter(|&u| u >= 0 && (u as i64) < units)
                .collect::<HashSet<_>>()
                .into_iter()
                .collect()
        } else {
            vec![]
        };
        let mut q = Vec::with_capacity(k);
        if let Some(m) = misses {
            // Exactly k - m hits, and m tokens no slot holds (not the newest,
            // which has its own slot).
            let mut hits = resident.clone();
            hits.sort_unstable();
            hits.shuffle(rng);
            q.extend(hits.iter().take(k - m));
            let mut taken: HashSet<i32> = resident.iter().copied().collect();
            while q.len() < k {
                let u = rng.random_range(0..units as i32 - 1);
                if taken.insert(u) {
                    q.push(u);
                }
            }
            q.shuffle(rng);
            return q;
        }
        let mut picked = HashSet::new();
        let mut tries = 0;
        while q.len() < k {
            tries += 1;
            match rng.random_range(0..40) {
                0 => q.push(-1),
                1 if hostile => q.push(units as i32 + rng.random_range(0..3)),
                2 if hostile => q.push(-2 - rng.random_range(0..3)),
                3 if hostile && !q.is_empty() => q.push(q[rng.random_range(0..q.len())]),
                draw => {
                    let u = if draw < 20 && !resident.is_empty() {
                        resident[rng.random_range(0..resident.len())]
                    } else {
                        rng.random_range(0..units as i32)
                    };
                    // Distinct entries; -1 padding once a short row has run
                    // out of them.
                    if picked.insert(u) {
                        q.push(u);
                    } else if tries > 16 * k {
                        q.push(-1);
                    }
                }
            }
        }
        q
    }

    pub fn batch(&self) -> usize {
        self.req.len()
    }

    /// A case for the graph replays: every row real and copying, misses
    /// recorded into a caller's plan or into the engine's scratch.
    pub fn for_graph(&mut self, caller_plan: bool) {
        self.skip_io = false;
        self.num_real = None;
        self.plan_counts = caller_plan.then(|| vec![0; self.batch()]);
    }

    /// New queries for every row, drawn from `seed` as a clean case's.
    pub fn redraw_queries(&self, seed: u64) -> Vec<i32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut topk = self.topk.clone();
        for b in 0..self.batch() {
            let q = self.draw_query(&mut rng, b, false, None);
            topk[b * self.strides.topk..][..self.num_top_k].copy_from_slice(&q);
        }
        topk
    }

    pub fn entries(&self) -> usize {
        self.num_top_k * self.query.block_tokens() as usize
    }

    /// Random host cache and device buffer bytes, per plane.
    fn kv_bytes(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let mut rng = StdRng::seed_from_u64(self.fill_seed);
        let mut planes = |rows| {
            (0..self.planes)
                .map(|_| {
                    let mut v = vec![0u8; plane_bytes(rows, &self.layout)];
                    rng.fill_bytes(&mut v);
                    v
                })
                .collect::<Vec<_>>()
        };
        let host = planes(self.host_rows);
        let device = planes(self.device_rows);
        (host, device)
    }
}

/// A case's buffers where one executor addresses them.
pub(super) struct Loaded {
    pub tokens: ExecVec<i32>,
    lru: ExecVec<i16>,
    locs: ExecVec<i32>,
    host_locs: ExecVec<i64>,
    pub topk: ExecVec<i32>,
    req: ExecVec<i64>,
    seq: ExecVec<i64>,
    req32: ExecVec<i32>,
    seq32: ExecVec<i32>,
    pub out: ExecVec<i32>,
    num_real: ExecVec<i32>,
    plan_src: ExecVec<i64>,
    plan_dst: ExecVec<i32>,
    plan_count: ExecVec<i32>,
    host: Vec<Staging>,
    pub device: Vec<ExecVec<u8>>,
}

impl Loaded {
    pub fn new(exec: &Executor, c: &SwapCase) -> kvtier::Result<Self> {
        let (host_bytes, device_bytes) = c.kv_bytes();
        let host = host_bytes
            .iter()
            .map(|bytes| {
                let mut s = Staging::new(exec, bytes.len())?;
                s.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
                Ok(s)
            })
            .collect::<kvtier::Result<Vec<_>>>()?;
        let batch = c.batch();
        let plan_cells = batch * c.strides.plan;
        let counts = c.plan_counts.clone().unwrap_or_else(|| vec![0; batch]);
        Ok(Loaded {
            tokens: ExecVec::from_host(exec, &c.tokens)?,
            lru: ExecVec::from_host(exec, &c.lru)?,
            locs: ExecVec::from_host(exec, &c.locs)?,
            host_locs: ExecVec::from_host(exec, &c.host_locs)?,
            topk: ExecVec::from_host(exec, &c.topk)?,
            req: ExecVec::from_host(exec, &c.req)?,
            seq: ExecVec::from_host(exec, &c.seq)?,
            req32: ExecVec::from_host(exec, &narrow(&c.req))?,
            seq32: ExecVec::from_host(exec, &narrow(&c.seq))?,
            out: ExecVec::from_host(exec, &vec![0x5a5a_5a5a; batch * c.strides.out])?,
            num_real: ExecVec::from_host(exec, &[c.num_real.unwrap_or(0)])?,
            plan_src: ExecVec::from_host(exec, &vec![-3i64; plan_cells])?,
            plan_dst: ExecVec::from_host(exec, &vec![-3i32; plan_cells])?,
            plan_count: ExecVec::from_host(exec, &counts)?,
            host,
            device: device_bytes
                .iter()
                .map(|b| ExecVec::from_host(exec, b))
                .collect::<kvtier::Result<_>>()?,
        })
    }

    fn kv(&self, c: &SwapCase) -> KvBuffers<'_> {
        let plane = |i: usize| {
            let h = &self.host[i];
            let bytes = plane_bytes(c.host_rows, &c.layout);
            KvPlane {
                // SAFETY: the staging holds `bytes` bytes where the executor
                // addresses them, alive as long as `self`.
                host: unsafe {
                    Buf::from_raw(h.exec_addr(), bytes, self.device[i].buf().location())
                },
                // SAFETY: nothing else uses the device buffer during a call.
                device: unsafe { self.device[i].buf_mut() },
            }
        };
        KvBuffers {
            layout: c.layout,
            k: plane(0),
            v: (c.planes == 2).then(|| plane(1)),
        }
    }

    /// The swap-in's arguments over these buffers.
    pub fn args<'a>(&'a self, c: &'a SwapCase) -> SwapInArgs<'a> {
        let (req, seq) = if c.index_i64 {
            (IndexBuf::I64(self.req.buf()), IndexBuf::I64(self.seq.buf()))
        } else {
            (
                IndexBuf::I32(self.req32.buf()),
                IndexBuf::I32(self.seq32.buf()),
            )
        };
        // SAFETY (every buf_mut): one call at a time uses these buffers.
        let miss_plan = c.plan_counts.as_ref().map(|_| MissPlan {
            src: unsafe { self.plan_src.buf_mut() },
            dst: unsafe { self.plan_dst.buf_mut() },
            stride: c.strides.plan,
            capacity: c.entries(),
            count: unsafe { self.plan_count.buf_mut() },
        });
        SwapInArgs {
            layer: None,
            top_k_tokens: self.topk.buf(),
            top_k_stride: c.strides.topk,
            query: c.query,
            device_buffer_tokens: unsafe { self.tokens.buf_mut() },
            tokens_stride: c.strides.tokens,
            device_buffer_locs: self.locs.buf(),
            locs_stride: c.strides.locs,
            lru_slots: unsafe { self.lru.buf_mut() },
            lru_stride: c.strides.lru,
            host_cache_locs: self.host_locs.buf(),
            host_stride: c.strides.host,
            max_tokens: c.context as u32,
            kv: self.kv(c),
            top_k_device_locs: unsafe { self.out.buf_mut() },
            out_stride: c.strides.out,
            req_pool_indices: req,
            seq_lens: seq,
            num_real_reqs: c.num_real.map(|_| self.num_real.buf()),
            num_requests: c.requests as u32,
            num_top_k: c.num_top_k as u32,
            hot_buffer_size: c.hot as u32,
            skip_io: c.skip_io,
            miss_plan,
        }
    }

    /// Everything a swap-in may write.
    pub fn snapshot(&self, report: Option<kvtier::BadIndexReport>) -> kvtier::Result<Snapshot> {
        let mut s = Snapshot::with_report(report);
        s.add("top_k_device_locs", &self.out.to_vec()?);
        s.add("device_buffer_tokens", &self.tokens.to_vec()?);
        s.add("lru_slots", &self.lru.to_vec()?);
        for (i, d) in self.device.iter().enumerate() {
            s.add(format!("device buffer plane {i}"), &d.to_vec()?);
        }
        s.add("miss_src", &self.plan_src.to_vec()?);
        s.add("miss_dst", &self.plan_dst.to_vec()?);
        s.add("miss_count", &self.plan_count.to_vec()?);
        Ok(s)
    }
}

fn narrow(v: &[i64]) -> Vec<i32> {
    v.iter()
        .map(|&x| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
        .collect()
}

/// One swap-in of `c` on `exec` with `strategy` and `copy`, from the case's
/// state.
fn run_once(
    exec: &Executor,
    c: &SwapCase,
    strategy: SwapInStrategy,
    copy: CopyMethod,
) -> kvtier::Result<Snapshot> {
    let mut engine = SwapInEngine::new(exec.clone())?;
    engine.reserve(c.batch() as u32, c.entries() as u32)?;
    let m = Loaded::new(exec, c)?;
    // On a stream of its own, as engines call it: there (sm_90) the copy
    // kernel is the plan kernel's programmatic dependent.
    let stream = match exec {
        Executor::Cuda(dev) => Some(dev.create_stream()?),
        Executor::Cpu => None,
    };
    let s = stream.as_ref().map_or(Stream::null(), |o| o.stream());
    let call = engine.run_with_copy(&m.args(c), strategy, copy, s);
    if let Some(o) = &stream {
        o.synchronize()?;
    }
    m.snapshot(settle(call, || engine.check())?)
}

/// The CPU executor's result, then the executor under test's with each of
/// its strategies (the CUDA executor every one of `SwapInStrategy::ALL`, the
/// copy kernel launched in order only where it is otherwise a dependent,
/// and the line-aligned copy kernel after the first and the few-miss
/// planners).
fn agree(dut: &Executor, c: &SwapCase) -> kvtier::Result<Verdict> {
    let vectors = CopyMethod::WarpVectors;
    let want = run_once(&Executor::cpu(), c, SwapInStrategy::PlanThenCopy, vectors)?;
    // Where the copy kernel is never a dependent launch, the in-order
    // strategy is PlanThenCopy itself.
    let runs: Vec<(SwapInStrategy, CopyMethod)> = match dut {
        Executor::Cpu => vec![(SwapInStrategy::PlanThenCopy, vectors)],
        Executor::Cuda(dev) => SwapInStrategy::ALL
            .into_iter()
            .filter(|&s| dev.dependent_launch() || s != SwapInStrategy::PlanThenCopyInOrder)
            .map(|s| (s, vectors))
            .chain(
                [SwapInStrategy::PlanThenCopy, SwapInStrategy::FewMiss]
                    .map(|s| (s, CopyMethod::LineAligned)),
            )
            .collect(),
    };
    let mut note = None;
    for (strategy, copy) in runs {
        match Snapshot::compare(&want, &run_once(dut, c, strategy, copy)?) {
            Verdict::Same { note: n } => note = note.or(n),
            Verdict::Differ(what) => {
                return Ok(Verdict::Differ(format!("{strategy:?}, {copy:?}: {what}")));
            }
        }
    }
    Ok(Verdict::Same { note })
}

/// Random cases of one path.
pub(super) fn check(dut: &Executor, path: Path, seed: u64, n: u64) -> Row {
    run_cases(path.name(), seed, n, |s| {
        agree(dut, &SwapCase::random(path, s))
    })
}

/// The production shape, with 2 and 410 misses per request.
pub(super) fn production_shape(dut: &Executor, seed: u64) -> Row {
    run_cases(
        "swap-in, HOT 4096, K 2048, 2 and 410 misses",
        seed,
        2,
        |s| {
            let (batch, misses) = if s % 2 == 0 { (8, 410) } else { (16, 2) };
            agree(dut, &SwapCase::production(s, batch, misses))
        },
    )
}

/// Replays of a recorded miss plan (SGLang's `copy_cache_planned_mla`),
/// corrupted in hostile cases, into a device buffer of random bytes.
pub(super) fn replay(dut: &Executor, seed: u64, n: u64) -> Row {
    run_cases("miss-plan replay (random, half hostile)", seed, n, |s| {
        let mut rng = StdRng::seed_from_u64(s);
        let path = Path::ALL[rng.random_range(0..3)];
        let mut c = SwapCase::random(path, s);
        c.skip_io = false;
        let batch = c.batch();
        c.plan_counts = Some(vec![0; batch]);
        // The plan, as the CPU executor records it.
        let cpu = Executor::cpu();
        let recorded = {
            let engine = SwapInEngine::new(cpu.clone())?;
            let m = Loaded::new(&cpu, &c)?;
            // Hostile swap-ins refuse some entries; the plan is still made.
            settle(engine.run(&m.args(&c), Stream::null()), || engine.check())?;
            (
                m.plan_src.to_vec()?,
                m.plan_dst.to_vec()?,
                m.plan_count.to_vec()?,
            )
        };
        let (mut src, mut dst, mut count) = recorded;
        if s % 2 == 1 {
            for _ in 0..3 {
                let b = rng.random_range(0..batch);
                let cell = b * c.strides.plan + rng.random_range(0..c.entries());
                match rng.random_range(0..4) {
                    0 => count[b] = c.entries() as i32 + 1,
                    1 => count[b] = -1,
                    2 => src[cell] = [-1, c.host_rows as i64][rng.random_range(0..2)],
                    _ => dst[cell] = [-1, c.device_rows as i32][rng.random_range(0..2)],
                }
            }
        }
        let warps = rng.random_bool(0.5).then(|| rng.random_range(1..=64u32));
        // The device under test replays with a copy kernel drawn per case
        // (the CPU executor has one way).
        let copy = CopyMethod::ALL[rng.random_range(0..CopyMethod::ALL.len())];
        let run = |exec: &Executor| -> kvtier::Result<Snapshot> {
            let engine = SwapInEngine::new(exec.clone())?;
            // Fresh device bytes: the replay writes into another layer's buffer.
            let mut fresh = c.clone();
            fresh.fill_seed ^= 0x5eed;
            let m = Loaded::new(exec, &fresh)?;
            let (src, dst, count) = (
                ExecVec::from_host(exec, &src)?,
                ExecVec::from_host(exec, &dst)?,
                ExecVec::from_host(exec, &count)?,
            );
            let args = PlannedCopyArgs {
                src: src.buf(),
                dst: dst.buf(),
                count: count.buf(),
                stride: c.strides.plan,
                capacity: c.entries(),
                num_real_reqs: c.num_real.map(|_| m.num_real.buf()),
                kv: m.kv(&fresh),
                skip_io: false,
            };
            let call = engine.copy_planned_with_copy(&args, warps, copy, Stream::null());
            let mut snap = Snapshot::with_report(settle(call, || engine.check())?);
            for (i, d) in m.device.iter().enumerate() {
                snap.add(format!("device buffer plane {i}"), &d.to_vec()?);
            }
            Ok(snap)
        };
        Ok(Snapshot::compare(&run(&cpu)?, &run(dut)?))
    })
}

#[cfg(test)]
mod tests {
    //! The generator makes the cases it claims to: clean ones are valid and
    //! move rows, hostile ones are refused in part, production ones miss
    //! exactly as drawn. (A selftest of cases that all refuse everything, or
    //! never miss, would compare nothing worth comparing.)
    use super::*;

    struct CpuRun {
        report: Option<kvtier::BadIndexReport>,
        device_changed: bool,
        counts: Vec<i32>,
    }

    fn cpu_run(c: &SwapCase) -> CpuRun {
        let cpu = Executor::cpu();
        let mut engine = SwapInEngine::new(cpu.clone()).unwrap();
        engine
            .reserve(c.batch() as u32, c.entries() as u32)
            .unwrap();
        let m = Loaded::new(&cpu, c).unwrap();
        let before: Vec<Vec<u8>> = m.device.iter().map(|d| d.to_vec().unwrap()).collect();
        let report = settle(engine.run(&m.args(c), Stream::null()), || engine.check()).unwrap();
        let after: Vec<Vec<u8>> = m.device.iter().map(|d| d.to_vec().unwrap()).collect();
        CpuRun {
            report,
            device_changed: before != after,
            counts: m.plan_count.to_vec().unwrap(),
        }
    }

    #[test]
    fn clean_cases_are_valid_and_move_rows() {
        for path in Path::ALL {
            let mut moved = 0;
            for seed in (0..40).step_by(2) {
                let run = cpu_run(&SwapCase::random(path, seed));
                assert!(
                    run.report.is_none(),
                    "{path:?} seed {seed}: {:?}",
                    run.report
                );
                moved += run.device_changed as u32;
            }
            assert!(
                moved >= 10,
                "{path:?}: only {moved} of 20 clean cases copied rows"
            );
        }
    }

    #[test]
    fn hostile_cases_are_refused_in_part() {
        for path in Path::ALL {
            let refused = (1..40)
                .step_by(2)
                .filter(|&seed| cpu_run(&SwapCase::random(path, seed)).report.is_some())
                .count();
            assert!(
                refused >= 14,
                "{path:?}: only {refused} of 20 hostile cases refused anything"
            );
        }
    }

    #[test]
    fn production_cases_miss_as_drawn() {
        for (batch, misses) in [(3, 410), (4, 2)] {
            let mut c = SwapCase::production(7, batch, misses);
            c.plan_counts = Some(vec![0; batch]);
            let run = cpu_run(&c);
            assert!(run.report.is_none());
            assert_eq!(run.counts, vec![misses as i32; batch]);
        }
    }
}
