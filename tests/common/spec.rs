//! Speculative swap-in cases in SGLang's layout (as its spec test builds
//! them): request r owns device rows [r × (hot + page + scratch), …) for its
//! hot slots, extra page and scratch, the hot buffer starts holding tokens
//! 0..hot, and token t's host row holds `words` u64 `t × SCALE + w`.

use kvtier::{
    BadIndexReport, Buf, BufMut, Executor, IndexBuf, KvBuffers, MissPlan, SpecState,
    SpecSwapInArgs, Stream, SwapInEngine,
};

use super::reported;

pub const SCALE: u64 = 1_000_003;
const KNUTH: u64 = 2_654_435_761;

/// One layer's state and buffers.
#[derive(Clone)]
pub struct SpecCase {
    pub reqs: usize,
    pub hot: usize,
    pub page: usize,
    pub scratch: usize,
    pub seq_len: usize,
    pub words: usize,
    pub steps: usize,
    pub k: usize,
    pub hash_size: usize,
    pub state_width: usize,
    pub tokens: Vec<i32>,
    pub locs: Vec<i32>,
    pub host_locs: Vec<i64>,
    pub host: Vec<u64>,
    pub device: Vec<u64>,
    pub cache_index: Vec<i64>,
    pub cache_policy: Vec<i32>,
    pub scratch_locs: Vec<i32>,
    pub scratch_state: Vec<i32>,
}

/// A case's and a call's arrays as one call reads and writes them.
struct SpecBuffers<'a> {
    host: Buf<'a, u8>,
    device: BufMut<'a, u8>,
    tokens: BufMut<'a, i32>,
    locs: BufMut<'a, i32>,
    host_locs: Buf<'a, i64>,
    index: BufMut<'a, i64>,
    policy: BufMut<'a, i32>,
    scratch: BufMut<'a, i32>,
    state: BufMut<'a, i32>,
    topk: Buf<'a, i32>,
    seq: Buf<'a, i32>,
    req: Buf<'a, i64>,
    num_real: Buf<'a, i32>,
    out: BufMut<'a, i32>,
    plan: Option<(BufMut<'a, i64>, BufMut<'a, i32>, BufMut<'a, i32>)>,
}

/// A case's sizes, apart from its arrays (so that a call's arguments can be
/// built while the arrays are borrowed).
#[derive(Clone, Copy)]
struct SpecShape {
    reqs: usize,
    hot: usize,
    page: usize,
    scratch: usize,
    seq_len: usize,
    words: usize,
    steps: usize,
    k: usize,
    hash_size: usize,
    state_width: usize,
}

impl SpecShape {
    /// The arguments of a call over `b`, the case's arrays wherever they
    /// are (host vectors, or their copies on a GPU).
    fn args(self, b: SpecBuffers<'_>) -> SpecSwapInArgs<'_> {
        let (slots, t) = (self.hot + self.page, self.steps * self.k);
        SpecSwapInArgs {
            top_k_tokens: b.topk,
            top_k_stride: t,
            num_steps: self.steps as u32,
            num_top_k: self.k as u32,
            device_buffer_tokens: b.tokens,
            tokens_stride: slots,
            device_buffer_locs: b.locs,
            locs_stride: slots,
            host_cache_locs: b.host_locs,
            host_stride: self.seq_len,
            max_tokens: self.seq_len as u32,
            kv: KvBuffers::linear((8 * self.words) as u32, b.host, b.device)
                .expect("items of whole u64s"),
            top_k_device_locs: b.out,
            out_stride: t,
            req_pool_indices: IndexBuf::I64(b.req),
            seq_lens: IndexBuf::I32(b.seq),
            num_real_reqs: b.num_real,
            state: SpecState {
                cache_index: b.index,
                index_rows: self.reqs,
                index_stride: 2 * self.hash_size,
                bank_stride: self.hash_size,
                hash_size: self.hash_size,
                cache_policy: b.policy,
                policy_rows: self.reqs + 1,
                policy_stride: self.hot,
                policy_width: self.hot,
                scratch_locs: b.scratch,
                scratch_stride: self.scratch,
                scratch_capacity: self.scratch,
                scratch_state: b.state,
                state_rows: self.reqs + 1,
                state_stride: self.state_width,
                state_width: self.state_width,
            },
            num_requests: self.reqs as u32,
            hot_buffer_size: self.hot as u32,
            page_size: self.page as u32,
            miss_plan: b.plan.map(|(src, dst, count)| MissPlan {
                src,
                dst,
                stride: t,
                capacity: t,
                count,
            }),
        }
    }
}

/// A call's per-row inputs and outputs.
#[derive(Clone)]
pub struct SpecCall {
    pub topk: Vec<i32>,
    pub seq: Vec<i32>,
    pub req: Vec<i64>,
    pub num_real: [i32; 1],
    pub out: Vec<i32>,
    pub plan: Option<(Vec<i64>, Vec<i32>, Vec<i32>)>,
}

impl SpecCall {
    /// `topk` holds `batch × steps × k` tokens; every step sees `seq` tokens.
    pub fn new(topk: Vec<i32>, batch: usize, steps: usize, seq: i32, record: bool) -> Self {
        let t = topk.len() / batch;
        SpecCall {
            topk,
            seq: vec![seq; batch * steps],
            req: (0..batch as i64).collect(),
            num_real: [batch as i32],
            out: vec![-7; batch * t],
            plan: record.then(|| (vec![-1; batch * t], vec![-1; batch * t], vec![-1; batch])),
        }
    }
}

impl SpecCase {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        reqs: usize,
        hot: usize,
        page: usize,
        scratch: usize,
        seq_len: usize,
        words: usize,
        steps: usize,
        k: usize,
    ) -> Self {
        let slots = hot + page;
        let per_req = slots + scratch;
        let mut tokens = vec![-1i32; reqs * slots];
        let mut locs = vec![0i32; reqs * slots];
        let mut scratch_locs = vec![0i32; reqs * scratch];
        let mut device = vec![u64::MAX; reqs * per_req * words];
        let host: Vec<u64> = (0..seq_len as u64)
            .flat_map(|t| (0..words as u64).map(move |w| t * SCALE + w))
            .collect();
        for r in 0..reqs {
            for s in 0..slots {
                locs[r * slots + s] = (r * per_req + s) as i32;
                if s < hot {
                    tokens[r * slots + s] = s as i32;
                    let row = r * per_req + s;
                    device[row * words..][..words].copy_from_slice(&host[s * words..][..words]);
                }
            }
            for s in 0..scratch {
                scratch_locs[r * scratch + s] = (r * per_req + slots + s) as i32;
            }
        }
        let hash_size = (2 * hot - 1).next_power_of_two();
        let mut cache_index = vec![-1i64; reqs * 2 * hash_size];
        for r in 0..reqs {
            for t in 0..hot as u64 {
                cache_index[r * 2 * hash_size + ((t * KNUTH) & (hash_size as u64 - 1)) as usize] =
                    ((t << 32) | t) as i64;
            }
        }
        let state_width = (4 * reqs).max(5 * steps * k);
        let mut scratch_state = vec![-1i32; (reqs + 1) * state_width];
        scratch_state[..state_width].fill(0);
        SpecCase {
            reqs,
            hot,
            page,
            scratch,
            seq_len,
            words,
            steps,
            k,
            hash_size,
            state_width,
            tokens,
            locs,
            host_locs: (0..reqs).flat_map(|_| 0..seq_len as i64).collect(),
            host,
            device,
            cache_index,
            cache_policy: vec![0; (reqs + 1) * hot],
            scratch_locs,
            scratch_state,
        }
    }

    /// SGLang's unique-miss counter of request `rid`'s last call.
    pub fn misses(&self, rid: usize) -> i32 {
        self.scratch_state[rid]
    }

    /// The arguments of `call` over this case.
    pub fn args<'a>(&'a mut self, call: &'a mut SpecCall) -> SpecSwapInArgs<'a> {
        let bytes = 8 * self.host.len();
        let device_bytes = 8 * self.device.len();
        self.shape().args(SpecBuffers {
            host: Buf::host(super::swap::as_bytes(&self.host, bytes)),
            device: BufMut::host(super::swap::as_bytes_mut(&mut self.device, device_bytes)),
            tokens: BufMut::host(&mut self.tokens),
            locs: BufMut::host(&mut self.locs),
            host_locs: Buf::host(&self.host_locs),
            index: BufMut::host(&mut self.cache_index),
            policy: BufMut::host(&mut self.cache_policy),
            scratch: BufMut::host(&mut self.scratch_locs),
            state: BufMut::host(&mut self.scratch_state),
            topk: Buf::host(&call.topk),
            seq: Buf::host(&call.seq),
            req: Buf::host(&call.req),
            num_real: Buf::host(&call.num_real),
            out: BufMut::host(&mut call.out),
            plan: call.plan.as_mut().map(|(src, dst, count)| {
                (BufMut::host(src), BufMut::host(dst), BufMut::host(count))
            }),
        })
    }

    fn shape(&self) -> SpecShape {
        SpecShape {
            reqs: self.reqs,
            hot: self.hot,
            page: self.page,
            scratch: self.scratch,
            seq_len: self.seq_len,
            words: self.words,
            steps: self.steps,
            k: self.k,
            hash_size: self.hash_size,
            state_width: self.state_width,
        }
    }

    /// The device rows of the hot slots and the scratch, sorted: a call
    /// rotates rows between them, never losing or doubling one.
    pub fn owned_rows(&self) -> Vec<i32> {
        let slots = self.hot + self.page;
        let mut rows: Vec<i32> = (0..self.reqs)
            .flat_map(|r| self.locs[r * slots..][..self.hot].to_vec())
            .chain(self.scratch_locs.iter().copied())
            .collect();
        rows.sort();
        rows
    }

    /// The hot slot of request `rid` holding `token`, by SGLang's lookup (the
    /// identity slot, the two hash banks, then a scan once degraded), written
    /// here from SGLang's kernel independently of the executors.
    pub fn lookup(&self, rid: usize, token: i32) -> Option<usize> {
        let slots = self.hot + self.page;
        let tokens = &self.tokens[rid * slots..][..self.hot];
        if token >= 0 && (token as usize) < self.hot && tokens[token as usize] == token {
            return Some(token as usize);
        }
        let banks = &self.cache_index[rid * 2 * self.hash_size..][..2 * self.hash_size];
        let mask = self.hash_size as u32 - 1;
        let mut h = token as u32;
        h ^= h >> 16;
        h = h.wrapping_mul(0x7FEB_352D);
        h ^= h >> 15;
        h = h.wrapping_mul(0x846C_A68B);
        h ^= h >> 16;
        let primary = ((token as u32).wrapping_mul(KNUTH as u32) & mask) as usize;
        for e in [banks[primary], banks[self.hash_size + (h & mask) as usize]] {
            let (t, slot) = (e as u32 as i32, (e as u64 >> 32) as usize);
            if e >= 0 && t == token && slot < self.hot && tokens[slot] == token {
                return Some(slot);
            }
        }
        let degraded = self.degraded(rid);
        degraded
            .then(|| tokens.iter().position(|&x| x == token))
            .flatten()
    }

    /// Panics unless the state is one SGLang's next call works on: every hot
    /// token held once and found by SGLang's lookup at its slot, the per-call
    /// counters back at 0.
    pub fn assert_consistent(&self) {
        let slots = self.hot + self.page;
        for rid in 0..self.reqs {
            let held = &self.tokens[rid * slots..][..self.hot];
            let mut seen: Vec<i32> = held.iter().copied().filter(|&t| t >= 0).collect();
            let n = seen.len();
            seen.sort();
            seen.dedup();
            assert_eq!(
                seen.len(),
                n,
                "request {rid}: a token held by two hot slots"
            );
            for (slot, &t) in held.iter().enumerate().filter(|(_, t)| **t >= 0) {
                assert_eq!(self.lookup(rid, t), Some(slot), "request {rid}: token {t}");
            }
        }
        assert!(
            self.scratch_state[self.reqs..3 * self.reqs]
                .iter()
                .all(|&c| c == 0),
            "work and union-hit counters are reset"
        );
    }

    /// Panics unless every non-negative token's output row holds its bytes
    /// (padding and refused entries are skipped: `skip(i)`).
    pub fn assert_outputs_hold(&self, call: &SpecCall, skip: impl Fn(usize) -> bool) {
        let t = self.steps * self.k;
        for (i, (&tok, &row)) in call.topk.iter().zip(&call.out).enumerate() {
            if tok < 0 || skip(i) {
                continue;
            }
            assert!(row >= 0, "occurrence {i} (token {tok}) has no row");
            let got = &self.device[row as usize * self.words..][..self.words];
            let want: Vec<u64> = (0..self.words as u64)
                .map(|w| tok as u64 * SCALE + w)
                .collect();
            assert_eq!(got, want, "occurrence {i} of row {} (token {tok})", i / t);
        }
    }
}

/// SGLang's 782-miss query: step s rolls the hot tokens by 137 s and ends
/// with its own fresh misses (196, 196, 195, 195).
pub fn cross_step_misses(hot: usize, k: usize) -> Vec<i32> {
    let mut out = Vec::new();
    let mut next = hot as i32;
    for (step, n) in [196usize, 196, 195, 195].into_iter().enumerate() {
        out.extend((0..k - n).map(|i| ((i + step * 137) % hot) as i32));
        out.extend(next..next + n as i32);
        next += n as i32;
    }
    out
}

/// Fills request 0's miss table with cells of the epoch the next call takes,
/// naming `tokens` with wild ordinals and positions (a hostile or wrapped
/// state: neither executor may trust them).
pub fn plant_foreign_cells(c: &mut SpecCase, tokens: &[i32]) {
    let t = c.steps * c.k;
    let epoch = (c.scratch_state[3 * c.reqs] as u32 & 0x7fff_ffff) + 1;
    let row = c.state_width;
    for (pos, &tok) in tokens.iter().cycle().take(t).enumerate() {
        let cell = ((epoch as u64) << 32) | tok as u32 as u64;
        let value = ((epoch as u64) << 32) | 0xffff_fffb;
        c.scratch_state[row + 2 * pos] = cell as u32 as i32;
        c.scratch_state[row + 2 * pos + 1] = (cell >> 32) as i32;
        c.scratch_state[row + 2 * (t + pos)] = value as u32 as i32;
        c.scratch_state[row + 2 * (t + pos) + 1] = (value >> 32) as i32;
        c.scratch_state[row + 4 * t + pos] = 0x1fff;
    }
}

/// Runs `calls` one after the other on the CPU executor and with `kernel`
/// (which runs one call on a case and returns what it reported), and after
/// each call checks what holds whatever order the kernel's threads take: the
/// same outputs where the CPU executor has -1 or 0, every other output naming
/// a row that holds its token, the same unique-miss counts and plan counts,
/// no host row copied twice (and, from the same state, the same ones), the
/// same report, the same CLOCK words and epochs, no device row lost or
/// doubled, and a state SGLang's lookup finds every hot token in.
pub fn kernel_agrees(
    case: &SpecCase,
    calls: &[SpecCall],
    label: &str,
    mut kernel: impl FnMut(&mut SpecCase, &mut SpecCall) -> Option<BadIndexReport>,
) {
    let engine = SwapInEngine::new(Executor::cpu()).unwrap();
    let rows = case.owned_rows();
    let mut gpu = case.clone();
    let mut cpu = case.clone();
    for (i, call) in calls.iter().enumerate() {
        let mut k = call.clone();
        let got = kernel(&mut gpu, &mut k);
        let mut want = call.clone();
        let cpu_err = reported(&engine.run_spec(&cpu.args(&mut want), Stream::null()));
        assert_eq!(got, cpu_err, "{label}, call {i}");
        for (o, (&g, &w)) in k.out.iter().zip(&want.out).enumerate() {
            assert_eq!(
                g < 0,
                w < 0,
                "{label}, call {i}, occurrence {o}: {g} vs {w}"
            );
            if w < 0 {
                assert_eq!(g, w, "{label}, call {i}, occurrence {o}");
            }
        }
        let t = gpu.steps * gpu.k;
        let padding = |o: usize| (o / t) as i32 >= want.num_real[0];
        gpu.assert_outputs_hold(&k, |o| want.out[o] < 0 || padding(o));
        assert!(
            k.out
                .iter()
                .enumerate()
                .all(|(o, &v)| !padding(o) || v == 0),
            "padding rows output 0"
        );
        for rid in 0..gpu.reqs {
            assert_eq!(gpu.misses(rid), cpu.misses(rid), "{label}, call {i}");
            assert_eq!(
                gpu.cache_policy[rid], cpu.cache_policy[rid],
                "the CLOCK word"
            );
            assert_eq!(
                gpu.scratch_state[3 * gpu.reqs + rid],
                cpu.scratch_state[3 * gpu.reqs + rid],
                "the scratch epoch"
            );
        }
        if let (Some((gs, gd, gc)), Some((ws, _, wc))) = (&k.plan, &want.plan) {
            assert_eq!(gc, wc, "{label}, call {i}: plan counts");
            for b in 0..gc.len() {
                let n = gc[b].max(0) as usize;
                let mut g: Vec<i64> = gs[b * t..][..n].to_vec();
                let mut w: Vec<i64> = ws[b * t..][..n].to_vec();
                g.sort();
                w.sort();
                g.dedup();
                assert_eq!(g.len(), n, "{label}, call {i}: a host row copied twice");
                // From the same state the same misses; after that the two
                // executors' hot buffers may hold different tokens (their
                // orders differ), so only the counts must agree.
                if i == 0 {
                    let first = g.iter().zip(&w).position(|(a, b)| a != b);
                    assert!(
                        first.is_none(),
                        "{label}: the host rows copied differ at {first:?}"
                    );
                }
                for m in 0..n {
                    let (src, dst) = (gs[b * t + m] as usize, gd[b * t + m] as usize);
                    assert_eq!(
                        gpu.device[dst * gpu.words..][..gpu.words],
                        gpu.host[src * gpu.words..][..gpu.words]
                    );
                }
            }
        }
        assert_eq!(
            gpu.owned_rows(),
            rows,
            "{label}: no device row lost or doubled"
        );
        gpu.assert_consistent();
    }
    cpu.assert_consistent();
}

impl SpecCase {
    /// Runs `call` on this case with a CUDA engine: every array copied to
    /// the GPU (the host cache into a pool region registered for it), the
    /// call, then everything copied back; returns what the engine reported
    /// at its next check.
    pub fn run_cuda(
        &mut self,
        engine: &SwapInEngine,
        call: &mut SpecCall,
    ) -> Option<BadIndexReport> {
        use kvtier::DeviceBuffer;
        let Executor::Cuda(dev) = engine.executor().clone() else {
            panic!("a CUDA engine")
        };
        let dev = &dev;
        let host_bytes = super::swap::as_bytes(&self.host, 8 * self.host.len()).to_vec();
        let (_pool, _region, host_base, _) = super::swap::planes_in_pool(dev, &[&host_bytes]);
        let up = |v: &[i32]| DeviceBuffer::from_host(dev, v).unwrap();
        let (mut tokens, mut locs) = (up(&self.tokens), up(&self.locs));
        let (mut policy, mut scratch) = (up(&self.cache_policy), up(&self.scratch_locs));
        let mut state = up(&self.scratch_state);
        let mut index = DeviceBuffer::from_host(dev, &self.cache_index).unwrap();
        let host_locs = DeviceBuffer::from_host(dev, &self.host_locs).unwrap();
        let device_bytes = super::swap::as_bytes(&self.device, 8 * self.device.len());
        let mut device = DeviceBuffer::from_host(dev, device_bytes).unwrap();
        let (topk, seq) = (up(&call.topk), up(&call.seq));
        let req = DeviceBuffer::from_host(dev, &call.req).unwrap();
        let num_real = up(&call.num_real);
        let mut out = up(&call.out);
        let mut plan = call
            .plan
            .as_ref()
            .map(|(s, d, c)| (DeviceBuffer::from_host(dev, s).unwrap(), up(d), up(c)));
        let res = {
            let args = self.shape().args(SpecBuffers {
                // SAFETY: the region is registered and mapped; it holds the host cache.
                host: unsafe { Buf::device(host_base, host_bytes.len()) },
                device: device.as_buf_mut(),
                tokens: tokens.as_buf_mut(),
                locs: locs.as_buf_mut(),
                host_locs: host_locs.as_buf(),
                index: index.as_buf_mut(),
                policy: policy.as_buf_mut(),
                scratch: scratch.as_buf_mut(),
                state: state.as_buf_mut(),
                topk: topk.as_buf(),
                seq: seq.as_buf(),
                req: req.as_buf(),
                num_real: num_real.as_buf(),
                out: out.as_buf_mut(),
                plan: plan
                    .as_mut()
                    .map(|(s, d, c)| (s.as_buf_mut(), d.as_buf_mut(), c.as_buf_mut())),
            });
            engine.run_spec(&args, Stream::null()).unwrap();
            reported(&engine.check())
        };
        self.tokens = tokens.to_vec().unwrap();
        self.locs = locs.to_vec().unwrap();
        self.cache_policy = policy.to_vec().unwrap();
        self.scratch_locs = scratch.to_vec().unwrap();
        self.scratch_state = state.to_vec().unwrap();
        self.cache_index = index.to_vec().unwrap();
        self.device = super::swap::words(&device.to_vec().unwrap());
        call.out = out.to_vec().unwrap();
        if let (Some((s, d, c)), Some((hs, hd, hc))) = (&plan, &mut call.plan) {
            *hs = s.to_vec().unwrap();
            *hd = d.to_vec().unwrap();
            *hc = c.to_vec().unwrap();
        }
        res
    }
}

/// Fills every empty cell of request 0's hash banks with a stale entry (a
/// token no slot holds): insertions must take such cells over, not carry
/// them around until the hash gives up.
pub fn plant_stale_entries(c: &mut SpecCase) {
    let hot = c.hot as i64;
    for (i, e) in c.cache_index[..2 * c.hash_size].iter_mut().enumerate() {
        if *e < 0 {
            *e = ((i as i64 % hot) << 32) | (1_000_000 + i as i64);
        }
    }
}

impl SpecCase {
    /// Whether request `rid`'s hash has given up an insertion.
    pub fn degraded(&self, rid: usize) -> bool {
        self.scratch_state[3 * self.reqs + rid] as u32 & (1 << 31) != 0
    }
}
