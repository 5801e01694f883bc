//! The `spec-swap-in` scenario: the speculative swap-in (MTP/EAGLE verify)
//! on SGLang's `HiSparseSpecState`, over batch × draft steps × misses per
//! step (K = `--swap-k`, the first `--hot`, items of `--entry` bytes). Each
//! step asks for K - m tokens the hot buffer holds (a different rotation per
//! step) and m it does not, half of them shared by every step, so the union
//! of misses is smaller than their sum, as in verify. From the same state
//! restored untimed before every call:
//!
//! 1. kvtier's speculative swap-in;
//! 2. SGLang's own speculative kernels (CUDA executor, when
//!    `KVTIER_SGLANG_KERNELS` names the library scripts/sglang-kernels.sh
//!    builds), on the same parameters;
//! 3. the limit: the unique missed rows in one contiguous copy.
//!
//! The host cache lives in a pool region (registered for the GPU by the
//! CUDA executor), as the SGLang shim places it.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde_json::json;

use std::sync::Arc;

use kvtier::{
    Buf, BufMut, Executor, IndexBuf, KvBuffers, LayerFirstLayout, Pool, Region, SpecState,
    SpecSwapInArgs, Stream, SwapInEngine,
};

use super::sglang::SglangKernels;
use super::{Bench, Clock, Measurement, Timing, count, invalid, named, row_pattern};
use crate::transfer::{self, Dir, ExecVec};

pub(super) const SCENARIO: &str = "spec-swap-in";
const STEPS: [u32; 2] = [2, 4];
/// SGLang's extra page (the verify tokens), as in its tests.
const PAGE: u32 = 64;
const KNUTH: u64 = 2_654_435_761;

fn grid(b: &Bench) -> kvtier::Result<(Vec<u32>, Vec<u32>, u32)> {
    use kvtier::swap_in::{SPEC_MAX_HOT, SPEC_MAX_OCCURRENCES, SPEC_MIN_TOP_K};
    let (k, hot) = (b.args.swap_k(), b.hot()[0]);
    if !(SPEC_MIN_TOP_K..=SPEC_MAX_OCCURRENCES / 4).contains(&k) {
        return Err(invalid(
            "--swap-k",
            format!(
                "{k}: the speculative swap-in takes 1024..=2048 (4 steps of at most 8192 in all)"
            ),
        ));
    }
    if !(k..=SPEC_MAX_HOT).contains(&hot) {
        return Err(invalid(
            "--hot",
            format!("{hot}: the speculative swap-in takes K = {k} to {SPEC_MAX_HOT}"),
        ));
    }
    if let Some(&m) = b.args.misses.iter().find(|&&m| m > k) {
        return Err(invalid("--misses", format!("{m} exceeds K = {k}")));
    }
    Ok((b.entries(&["576"])?, b.batches(&[1, 8, 32, 64]), hot))
}

pub(super) fn points(b: &Bench) -> kvtier::Result<u64> {
    let (entries, batches, _) = grid(b)?;
    Ok((entries.len() * batches.len() * STEPS.len() * b.args.misses.len()) as u64)
}

pub(super) fn run(b: &Bench) -> kvtier::Result<Vec<Measurement>> {
    let (entries, batches, hot) = grid(b)?;
    // Loaded whatever the executor, so that a wrong path fails at once.
    let mut sglang = SglangKernels::from_env()?;
    if let Some(s) = &sglang {
        let note = match b.exec {
            Executor::Cuda(_) => format!("SGLang's kernels from {}", s.path),
            Executor::Cpu => format!(
                "SGLang's kernels ({}) run on the CUDA executor only",
                s.path
            ),
        };
        b.progress.suspend(|| println!("spec-swap-in: {note}"));
    }
    if matches!(b.exec, Executor::Cpu) {
        sglang = None;
    }
    let mut rows = Vec::new();
    for &item in &entries {
        for &steps in &STEPS {
            for &batch in &batches {
                let state = State::build(b, batch, steps, hot, item)?;
                for &misses in &b.args.misses {
                    b.progress.set_message(format!(
                        "spec-swap-in: {item} B, {}, batch {batch}, {} per step",
                        count(steps, "step", "steps"),
                        count(misses, "miss", "misses")
                    ));
                    let q = state.query(misses, b.args.seed);
                    let point = state.measure(b, &q, sglang.as_ref())?;
                    b.point_done(&point)?;
                    rows.extend(point);
                }
            }
        }
    }
    Ok(rows)
}

/// SGLang's state for `batch` requests, built as its spec test builds it:
/// request r owns device rows [r × (hot + page + scratch), …) for its hot
/// slots, extra page and scratch; the hot buffer holds tokens 0..hot.
struct State {
    batch: u32,
    steps: u32,
    k: u32,
    hot: u32,
    item: u32,
    context: u32,
    scratch: u32,
    tokens: Vec<i32>,
    locs: Vec<i32>,
    host_locs: Vec<i64>,
    /// The host cache, row j filled with `row_pattern(j)`, in a pool region.
    pool: Arc<Pool>,
    host_region: Region,
    cache_index: Vec<i64>,
    hash_size: usize,
    cache_policy: Vec<i32>,
    scratch_locs: Vec<i32>,
    scratch_state: Vec<i32>,
    state_width: usize,
}

/// One batch's query and its unique misses (host rows).
struct Query {
    misses: u32,
    topk: Vec<i32>,
    unique_misses: Vec<i64>,
}

impl State {
    fn build(b: &Bench, batch: u32, steps: u32, hot: u32, item: u32) -> kvtier::Result<Self> {
        let k = b.args.swap_k();
        let (r, h, slots) = (batch as usize, hot as usize, (hot + PAGE) as usize);
        let t = (steps * k) as usize;
        // SGLang's sizing: every miss finds a row
        let scratch = (t as u32).min(1024u32.max((t as u32).saturating_sub(hot)));
        let per_req = slots + scratch as usize;
        let context = hot + 4 * k;
        let mut tokens = vec![-1i32; r * slots];
        let mut locs = vec![0i32; r * slots];
        let mut scratch_locs = vec![0i32; r * scratch as usize];
        for req in 0..r {
            for s in 0..slots {
                tokens[req * slots + s] = if s < h { s as i32 } else { -1 };
                locs[req * slots + s] = (req * per_req + s) as i32;
            }
            for s in 0..scratch as usize {
                scratch_locs[req * scratch as usize + s] = (req * per_req + slots + s) as i32;
            }
        }
        let host_locs: Vec<i64> = (0..r)
            .flat_map(|req| (0..context as i64).map(move |c| (req * context as usize) as i64 + c))
            .collect();
        let host_rows = host_locs.len();
        let layout = LayerFirstLayout::new(item, 1, host_rows as u32)?;
        let pool = Pool::create(layout, b.pool_device(Pool::device_bytes_for(&layout, 1)?))?;
        let host_region = pool.alloc_region()?;
        let mut bytes = vec![0u8; host_rows * item as usize];
        for (row, chunk) in bytes.chunks_mut(item as usize).enumerate() {
            chunk.fill(row_pattern(row));
        }
        pool.write_tokens(&host_region, 0, 0, &bytes)?;
        let hash_size = (2 * h - 1).next_power_of_two();
        let mut cache_index = vec![-1i64; r * 2 * hash_size];
        for req in 0..r {
            for tok in 0..h as u64 {
                let at = ((tok * KNUTH) & (hash_size as u64 - 1)) as usize;
                cache_index[req * 2 * hash_size + at] = ((tok << 32) | tok) as i64;
            }
        }
        let cache_policy = vec![0i32; (r + 1) * h];
        let state_width = (4 * r).max(5 * t);
        let mut scratch_state = vec![-1i32; (r + 1) * state_width];
        scratch_state[..state_width].fill(0);
        Ok(State {
            batch,
            steps,
            k,
            hot,
            item,
            context,
            scratch,
            tokens,
            locs,
            host_locs,
            pool,
            host_region,
            cache_index,
            hash_size,
            cache_policy,
            scratch_locs,
            scratch_state,
            state_width,
        })
    }

    fn device_rows(&self) -> usize {
        self.batch as usize * (self.hot + PAGE + self.scratch) as usize
    }

    /// Per request and step: K - m hot tokens (rotated by 137 per step) and
    /// m misses, the first m / 2 shared by every step of the request.
    fn query(&self, misses: u32, seed: u64) -> Query {
        let mut rng = StdRng::seed_from_u64(seed ^ ((self.batch as u64) << 32) ^ misses as u64);
        let (h, k, m) = (self.hot as usize, self.k as usize, misses as usize);
        let mut topk = Vec::new();
        let mut unique_misses = Vec::new();
        for req in 0..self.batch as usize {
            let mut absent: Vec<i32> = (self.hot as i32..self.context as i32).collect();
            absent.shuffle(&mut rng);
            let (shared, mut fresh) = (&absent[..m / 2], absent[m / 2..].iter());
            let mut seen = std::collections::HashSet::new();
            for step in 0..self.steps as usize {
                let mut q: Vec<i32> = (0..k - m).map(|i| ((i + step * 137) % h) as i32).collect();
                q.extend(shared);
                q.extend(fresh.by_ref().take(m - m / 2));
                for &tok in &q[k - m..] {
                    if seen.insert(tok) {
                        unique_misses
                            .push(self.host_locs[req * self.context as usize + tok as usize]);
                    }
                }
                q.shuffle(&mut rng);
                topk.extend(q);
            }
        }
        Query {
            misses,
            topk,
            unique_misses,
        }
    }

    fn measure(
        &self,
        b: &Bench,
        q: &Query,
        sglang: Option<&SglangKernels>,
    ) -> kvtier::Result<Vec<Measurement>> {
        let exec = &b.exec;
        let engine = SwapInEngine::new(exec.clone())?;
        let clock = Clock::new(exec)?;
        let item = self.item as usize;
        let t = (self.steps * self.k) as usize;
        let (r, slots) = (self.batch as usize, (self.hot + PAGE) as usize);
        // What a call changes, restored from the pristine copies untimed.
        let live = [
            ExecVec::from_host(exec, &self.tokens)?,
            ExecVec::from_host(exec, &self.locs)?,
            ExecVec::from_host(exec, &self.cache_policy)?,
            ExecVec::from_host(exec, &self.scratch_locs)?,
            ExecVec::from_host(exec, &self.scratch_state)?,
        ];
        let pristine = [
            ExecVec::from_host(exec, &self.tokens)?,
            ExecVec::from_host(exec, &self.locs)?,
            ExecVec::from_host(exec, &self.cache_policy)?,
            ExecVec::from_host(exec, &self.scratch_locs)?,
            ExecVec::from_host(exec, &self.scratch_state)?,
        ];
        let index = ExecVec::from_host(exec, &self.cache_index)?;
        let index_pristine = ExecVec::from_host(exec, &self.cache_index)?;
        // Misses go to scratch rows and rotate with slots; only misses past
        // the scratch would overwrite hot rows, which the reset does not
        // restore.
        if q.unique_misses.len() > r * self.scratch as usize {
            return Err(invalid(
                "--misses",
                format!(
                    "{} per step overflow the {}",
                    count(q.misses, "miss", "misses"),
                    count(self.scratch, "scratch row", "scratch rows")
                ),
            ));
        }
        // The hot slots' rows hold their tokens (0..hot of each request).
        let mut device = vec![0u8; self.device_rows() * item];
        let per_req = (self.hot + PAGE + self.scratch) as usize;
        for req in 0..r {
            for slot in 0..self.hot as usize {
                let host_row = self.host_locs[req * self.context as usize + slot] as usize;
                device[(req * per_req + slot) * item..][..item].fill(row_pattern(host_row));
            }
        }
        let device_buffer = ExecVec::from_host(exec, &device)?;
        let out = ExecVec::<i32>::zeroed(exec, r * t)?;
        let topk = ExecVec::from_host(exec, &q.topk)?;
        let host_locs = ExecVec::from_host(exec, &self.host_locs)?;
        let host_base = self.pool.region_host_addr(&self.host_region)?;
        let host_bytes = self.host_locs.len() * item;
        let host_cache = match exec {
            Executor::Cpu => host_base,
            Executor::Cuda(dev) => self.pool.region_device_addr(&self.host_region, dev)?,
        };
        let req = ExecVec::from_host(exec, &(0..r as i64).collect::<Vec<_>>())?;
        let seq = ExecVec::from_host(exec, &vec![self.context as i32; r * self.steps as usize])?;
        let num_real = ExecVec::from_host(exec, &[self.batch as i32])?;
        let reset = |s: Stream| -> kvtier::Result<()> {
            // SAFETY: copies between buffers of equal length, in stream order.
            unsafe {
                for (to, from) in live.iter().zip(&pristine) {
                    transfer::copy_within(exec, to.addr(), from.addr(), 4 * to.len(), s)?;
                }
                transfer::copy_within(
                    exec,
                    index.addr(),
                    index_pristine.addr(),
                    8 * index.len(),
                    s,
                )
            }
        };
        let loc = exec.location();
        let [tokens, locs, policy, scratch, state] = &live;
        let args = || -> kvtier::Result<SpecSwapInArgs<'_>> {
            // SAFETY: the buffers above, of these lengths, live until after
            // the timing.
            Ok(unsafe {
                SpecSwapInArgs {
                    top_k_tokens: Buf::from_raw(topk.addr(), topk.len(), loc),
                    top_k_stride: t,
                    num_steps: self.steps,
                    num_top_k: self.k,
                    device_buffer_tokens: BufMut::from_raw(tokens.addr(), tokens.len(), loc),
                    tokens_stride: slots,
                    device_buffer_locs: BufMut::from_raw(locs.addr(), locs.len(), loc),
                    locs_stride: slots,
                    host_cache_locs: Buf::from_raw(host_locs.addr(), host_locs.len(), loc),
                    host_stride: self.context as usize,
                    max_tokens: self.context,
                    kv: KvBuffers::linear(
                        self.item,
                        Buf::from_raw(host_cache, host_bytes, loc),
                        BufMut::from_raw(device_buffer.addr(), device_buffer.len(), loc),
                    )?,
                    top_k_device_locs: BufMut::from_raw(out.addr(), out.len(), loc),
                    out_stride: t,
                    req_pool_indices: IndexBuf::I64(Buf::from_raw(req.addr(), r, loc)),
                    seq_lens: IndexBuf::I32(Buf::from_raw(seq.addr(), seq.len(), loc)),
                    num_real_reqs: Buf::from_raw(num_real.addr(), 1, loc),
                    state: SpecState {
                        cache_index: BufMut::from_raw(index.addr(), index.len(), loc),
                        index_rows: r,
                        index_stride: 2 * self.hash_size,
                        bank_stride: self.hash_size,
                        hash_size: self.hash_size,
                        cache_policy: BufMut::from_raw(policy.addr(), policy.len(), loc),
                        policy_rows: r + 1,
                        policy_stride: self.hot as usize,
                        policy_width: self.hot as usize,
                        scratch_locs: BufMut::from_raw(scratch.addr(), scratch.len(), loc),
                        scratch_stride: self.scratch as usize,
                        scratch_capacity: self.scratch as usize,
                        scratch_state: BufMut::from_raw(state.addr(), state.len(), loc),
                        state_rows: r + 1,
                        state_stride: self.state_width,
                        state_width: self.state_width,
                    },
                    num_requests: self.batch,
                    hot_buffer_size: self.hot,
                    page_size: PAGE,
                    miss_plan: None,
                }
            })
        };
        // Before each method, untimed: the device rows as they started and
        // no output, so that the check after it sees what it wrote, not what
        // the method before it left.
        let unwritten = vec![-7i32; out.len()];
        let spoil = || {
            // SAFETY: no call is running; lengths are the buffers'.
            unsafe {
                device_buffer.write(&device)?;
                out.write(&unwritten)
            }
        };
        let call = |s: Stream| engine.run_spec(&args()?, s);
        spoil()?;
        let kv = b.time(&clock, Timing::Device, reset, call)?;
        engine.check()?;
        self.verify(q, &out.to_vec()?, &device_buffer.to_vec()?)?;
        // SGLang's kernels on the same parameters, from the same state.
        let theirs = match sglang {
            Some(k) => {
                let p = engine.spec_params(&args()?)?;
                spoil()?;
                // SAFETY: parameters checked for this engine's device buffers,
                // which live until after the timing.
                let t = b.time(&clock, Timing::Device, reset, |s| unsafe { k.spec(&p, s) })?;
                engine.check()?; // waits for the device
                self.verify(q, &out.to_vec()?, &device_buffer.to_vec()?)?;
                Some(t)
            }
            None => None,
        };
        let bytes = q.unique_misses.len() * item;
        let none = |_: Stream| Ok(());
        // SAFETY: the first `bytes` of the host cache (registered for the CUDA
        // executor) and of the device buffer.
        let limit = b.time(&clock, Timing::Device, none, |s| unsafe {
            transfer::contiguous(
                exec,
                Dir::HostToDevice,
                host_base,
                device_buffer.addr(),
                bytes,
                s,
            )
        })?;
        let params = [
            ("batch", json!(self.batch)),
            ("steps", json!(self.steps)),
            ("misses", json!(q.misses)),
            (
                "unique_misses_per_request",
                json!(q.unique_misses.len() / self.batch as usize),
            ),
            ("k", json!(self.k)),
            ("hot", json!(self.hot)),
            ("entry", json!(self.item)),
        ];
        let row = |cpu, cuda, t, limit| {
            Measurement::new(SCENARIO, named(exec, cpu, cuda), &params, bytes, t, limit)
        };
        let mut rows = vec![row(
            "kvtier speculative swap-in (CPU executor)",
            "kvtier speculative swap-in",
            kv,
            false,
        )];
        if let Some(t) = theirs {
            rows.push(row("", "SGLang 0.5.23's speculative kernels", t, false));
        }
        rows.extend([row(
            "contiguous memcpy of the unique misses (limit)",
            "contiguous H2D copy of the unique misses (limit)",
            limit,
            true,
        )]);
        Ok(rows)
    }

    /// Every output row of the last timed call holds its token's host bytes
    /// (`device`: the device buffer's bytes).
    fn verify(&self, q: &Query, out: &[i32], device: &[u8]) -> kvtier::Result<()> {
        let t = (self.steps * self.k) as usize;
        let item = self.item as usize;
        for (i, (&tok, &row)) in q.topk.iter().zip(out).enumerate() {
            let req = i / t;
            let host_row = self.host_locs[req * self.context as usize + tok as usize] as usize;
            let bytes = usize::try_from(row)
                .ok()
                .and_then(|row| device.get(row * item..)?.get(..item));
            if bytes.is_none_or(|b| b.iter().any(|&x| x != row_pattern(host_row))) {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: occurrence {i} (token {tok}) points at device row {row}, \
                     which does not hold the token"
                )));
            }
        }
        Ok(())
    }
}
