//! Speculative swap-in cases in SGLang's layout (as its spec test builds
//! them): request r owns device rows [r × (hot + page + scratch), …) for its
//! hot slots, extra page and scratch, the hot buffer starts holding tokens
//! 0..hot, and token t's host row holds `words` u64 `t × SCALE + w`.

use kvtier::{Buf, BufMut, IndexBuf, KvBuffers, MissPlan, SpecState, SpecSwapInArgs};

pub const SCALE: u64 = 1_000_003;
const KNUTH: u64 = 2_654_435_761;

/// One layer's state and buffers.
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

/// A call's per-row inputs and outputs.
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
        let (slots, t) = (self.hot + self.page, self.steps * self.k);
        let item = (8 * self.words) as u32;
        let as_bytes = |v: &'a [u64]| {
            // SAFETY: u64s viewed as bytes, same lifetime.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
        };
        let device = {
            let d = &mut self.device;
            // SAFETY: as above, mutably.
            unsafe { std::slice::from_raw_parts_mut(d.as_mut_ptr() as *mut u8, d.len() * 8) }
        };
        let miss_plan = call.plan.as_mut().map(|(src, dst, count)| MissPlan {
            src: BufMut::host(src),
            dst: BufMut::host(dst),
            stride: t,
            capacity: t,
            count: BufMut::host(count),
        });
        SpecSwapInArgs {
            top_k_tokens: Buf::host(&call.topk),
            top_k_stride: t,
            num_steps: self.steps as u32,
            num_top_k: self.k as u32,
            device_buffer_tokens: BufMut::host(&mut self.tokens),
            tokens_stride: slots,
            device_buffer_locs: BufMut::host(&mut self.locs),
            locs_stride: slots,
            host_cache_locs: Buf::host(&self.host_locs),
            host_stride: self.seq_len,
            max_tokens: self.seq_len as u32,
            kv: KvBuffers::linear(item, Buf::host(as_bytes(&self.host)), BufMut::host(device))
                .expect("items of whole u64s"),
            top_k_device_locs: BufMut::host(&mut call.out),
            out_stride: t,
            req_pool_indices: IndexBuf::I64(Buf::host(&call.req)),
            seq_lens: IndexBuf::I32(Buf::host(&call.seq)),
            num_real_reqs: Buf::host(&call.num_real),
            state: SpecState {
                cache_index: BufMut::host(&mut self.cache_index),
                index_rows: self.reqs,
                index_stride: 2 * self.hash_size,
                bank_stride: self.hash_size,
                hash_size: self.hash_size,
                cache_policy: BufMut::host(&mut self.cache_policy),
                policy_rows: self.reqs + 1,
                policy_stride: self.hot,
                policy_width: self.hot,
                scratch_locs: BufMut::host(&mut self.scratch_locs),
                scratch_stride: self.scratch,
                scratch_capacity: self.scratch,
                scratch_state: BufMut::host(&mut self.scratch_state),
                state_rows: self.reqs + 1,
                state_stride: self.state_width,
                state_width: self.state_width,
            },
            num_requests: self.reqs as u32,
            hot_buffer_size: self.hot as u32,
            page_size: self.page as u32,
            miss_plan,
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
