//! Swap-in test support: random HiSparse states and queries (valid, or with
//! bad input mixed in), a model written from DESIGN.md §4 and the safety rules
//! in src/swap_in.rs, a transliteration of SGLang's kernel for valid input,
//! and a runner for both executors.

use std::collections::{HashMap, HashSet};

use kvtier::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_LRU, KVT_ERR_SWAP_NUM_REAL,
    KVT_ERR_SWAP_REQ, KVT_ERR_SWAP_SEQ_LEN, KVT_ERR_SWAP_SLOT_LOC, KVT_ERR_SWAP_TOKEN,
};
use kvtier::{
    BadIndexReport, Buf, BufMut, DeviceBuffer, DeviceSpec, ErrorWord, Executor, IndexBuf,
    LayerFirstLayout, MissPlan, Pool, Stream, SwapInArgs, SwapInStrategy, Tier,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};

use super::{Hostility, reported};

/// What a random swap-in case may look like.
#[derive(Clone, Copy, Debug)]
pub struct SwapLimits {
    pub max_hot: usize,
    pub max_k: usize,
    pub max_requests: usize,
    pub max_batch: usize,
}

/// The exact shape of a generated case.
#[derive(Clone, Copy, Debug)]
pub struct SwapShape {
    pub hot: usize,
    pub k: usize,
    pub item: usize,
    pub requests: usize,
    /// Batch rows (each a distinct request); None draws up to 5.
    pub batch: Option<usize>,
    pub max_tokens: usize,
    /// Share of requests with a short sequence (seq_len <= hot).
    pub short_share: f64,
}

pub const SWAP_SMALL: SwapLimits = SwapLimits {
    max_hot: 24,
    max_k: 12,
    max_requests: 5,
    max_batch: 5,
};
pub const SWAP_MEDIUM: SwapLimits = SwapLimits {
    max_hot: 700,
    max_k: 300,
    max_requests: 6,
    max_batch: 6,
};

/// One swap-in: the per-request state, the host cache and device buffer, and
/// the batch's queries, all as plain host vectors in SGLang's layouts.
#[derive(Clone)]
pub struct SwapCase {
    pub hot: usize,
    pub k: usize,
    pub item: usize,
    pub requests: usize,
    pub max_tokens: usize,
    pub buffer_stride: usize,
    pub lru_stride: usize,
    pub host_stride: usize,
    pub top_k_stride: usize,
    pub out_stride: usize,
    pub tokens: Vec<i32>,
    pub locs: Vec<i32>,
    pub lru: Vec<i16>,
    pub host_locs: Vec<i64>,
    pub host_cache: Vec<u8>,
    pub device_buffer: Vec<u8>,
    pub topk: Vec<i32>,
    pub req: Vec<i64>,
    pub seq: Vec<i64>,
    pub req_i64: bool,
    pub seq_i64: bool,
    pub num_real: Option<i32>,
}

impl std::fmt::Debug for SwapCase {
    /// The shape and the small arrays; the byte buffers are random and long.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapCase")
            .field("hot", &self.hot)
            .field("k", &self.k)
            .field("item", &self.item)
            .field("requests", &self.requests)
            .field("max_tokens", &self.max_tokens)
            .field(
                "strides(buffer,lru,host,topk,out)",
                &(
                    self.buffer_stride,
                    self.lru_stride,
                    self.host_stride,
                    self.top_k_stride,
                    self.out_stride,
                ),
            )
            .field("req", &self.req)
            .field("seq", &self.seq)
            .field("num_real", &self.num_real)
            .field("topk", &self.topk)
            .field("lru", &self.lru)
            .field("tokens", &self.tokens)
            .field("locs", &self.locs)
            .finish()
    }
}

/// What a swap-in leaves behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwapOutcome {
    pub out: Vec<i32>,
    pub tokens: Vec<i32>,
    pub lru: Vec<i16>,
    pub device_buffer: Vec<u8>,
    pub report: Option<BadIndexReport>,
    /// With [`SwapOptions::record_plan`]: per batch row, the (host row,
    /// device row) of each miss loaded, in miss order.
    pub plan: Option<Vec<Vec<(i64, i32)>>>,
}

/// SGLang's optional swap-in arguments: `skip_io`, and a caller's miss plan.
#[derive(Clone, Copy, Debug, Default)]
pub struct SwapOptions {
    pub skip_io: bool,
    pub record_plan: bool,
}

/// The miss plan a run recorded, as [`SwapOutcome::plan`] holds it (panics
/// on a count outside `0..=k`).
pub fn plan_rows(
    src: &[i64],
    dst: &[i32],
    count: &[i32],
    stride: usize,
    k: usize,
) -> Vec<Vec<(i64, i32)>> {
    count
        .iter()
        .enumerate()
        .map(|(b, &c)| {
            assert!(
                (0..=k as i32).contains(&c),
                "miss_count[{b}] = {c} is outside 0..={k}"
            );
            (0..c as usize)
                .map(|m| (src[b * stride + m], dst[b * stride + m]))
                .collect()
        })
        .collect()
}

/// Index values as an int32 tensor carries them (clamped).
pub fn clamp32(values: &[i64]) -> Vec<i32> {
    values
        .iter()
        .map(|&v| v.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
        .collect()
}

/// Row stride of the miss plans the tests record (wider than k, so that a
/// kernel that ignored the stride would be caught).
pub fn plan_stride(k: usize) -> usize {
    k + 3
}

/// Value the miss-plan buffers hold before a run.
const PLAN_BEFORE: i32 = -11;

/// The value top_k_device_locs holds before a call (a swap-in overwrites
/// every entry of every row of the batch).
pub const OUT_BEFORE: i32 = -7;

impl SwapCase {
    pub fn batch(&self) -> usize {
        self.req.len()
    }

    pub fn host_rows(&self) -> usize {
        self.host_cache.len() / self.item
    }

    pub fn device_rows(&self) -> usize {
        self.device_buffer.len() / self.item
    }

    /// A random case: valid HiSparse state and queries, then bad input mixed
    /// in with the probabilities of `h`. With `misses` set, every long row of
    /// a valid case misses exactly that many tokens (or as many as it can).
    pub fn random(seed: u64, lim: SwapLimits, h: Hostility, misses: Option<usize>) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let hot = rng.random_range(1..=lim.max_hot);
        let k = rng.random_range(1..=hot.min(lim.max_k));
        let requests = rng.random_range(1..=lim.max_requests);
        let shape = SwapShape {
            hot,
            k,
            item: [8, 16, 24, 584, 656][rng.random_range(0..5)],
            requests,
            batch: Some(rng.random_range(0..=lim.max_batch.min(requests))),
            max_tokens: hot + rng.random_range(1..=2 * k + 8),
            short_share: 0.35,
        };
        let mut case = Self::valid(&mut rng, shape, misses);
        if h.bad > 0.0 || h.padding > 0.0 {
            case.spoil(&mut rng, h);
        }
        case
    }

    /// A valid case of exactly `shape` (the batch drawn when it is None).
    pub fn shaped(seed: u64, shape: SwapShape, misses: Option<usize>) -> Self {
        Self::valid(&mut StdRng::seed_from_u64(seed), shape, misses)
    }

    fn valid(rng: &mut StdRng, shape: SwapShape, misses: Option<usize>) -> Self {
        let rng = &mut *rng;
        let SwapShape {
            hot,
            k,
            item,
            requests,
            max_tokens,
            ..
        } = shape;
        let pad = |rng: &mut StdRng| rng.random_range(0..=2usize);
        let (buffer_stride, lru_stride, host_stride) =
            (hot + 1 + pad(rng), hot + pad(rng), max_tokens + pad(rng));
        let (top_k_stride, out_stride) = (k + pad(rng), k + pad(rng));

        // Every request owns hot + 1 distinct device rows and max_tokens
        // distinct host rows, shuffled.
        let device_rows = requests * (hot + 1) + rng.random_range(0..4);
        let mut dev_rows: Vec<i32> = (0..device_rows as i32).collect();
        dev_rows.shuffle(rng);
        let host_rows = requests * max_tokens + rng.random_range(0..4);
        let mut host_rows_perm: Vec<i64> = (0..host_rows as i64).collect();
        host_rows_perm.shuffle(rng);

        let mut tokens = vec![-9; requests * buffer_stride];
        let mut locs = vec![-9; requests * buffer_stride];
        let mut lru = vec![-9i16; requests * lru_stride];
        let mut host_locs = vec![-9i64; requests * host_stride];
        let mut seq_of = Vec::with_capacity(requests);
        for r in 0..requests {
            let seq = if rng.random_bool(shape.short_share) {
                rng.random_range(0..=hot)
            } else {
                rng.random_range(hot + 1..=max_tokens)
            };
            seq_of.push(seq);
            for s in 0..=hot {
                locs[r * buffer_stride + s] = dev_rows[r * (hot + 1) + s];
            }
            for t in 0..max_tokens {
                host_locs[r * host_stride + t] = host_rows_perm[r * max_tokens + t];
            }
            let mut perm: Vec<i16> = (0..hot as i16).collect();
            perm.shuffle(rng);
            lru[r * lru_stride..][..hot].copy_from_slice(&perm);
            if seq <= hot {
                for s in 0..hot {
                    tokens[r * buffer_stride + s] = if s < seq { s as i32 } else { -1 };
                }
            } else {
                // distinct resident tokens from [0, seq - 1), some slots empty
                let mut pool: Vec<i32> = (0..seq as i32 - 1).collect();
                pool.shuffle(rng);
                for s in 0..hot {
                    tokens[r * buffer_stride + s] = if rng.random_bool(0.1) { -1 } else { pool[s] };
                }
                tokens[r * buffer_stride + hot] = seq as i32 - 1;
            }
        }

        let batch = shape
            .batch
            .unwrap_or_else(|| rng.random_range(0..=requests.min(5)));
        assert!(batch <= requests, "a valid batch names each request once");
        let mut rows: Vec<usize> = (0..requests).collect();
        rows.shuffle(rng);
        let req: Vec<i64> = rows[..batch].iter().map(|&r| r as i64).collect();
        let seq: Vec<i64> = req.iter().map(|&r| seq_of[r as usize] as i64).collect();
        let mut topk = vec![i32::MIN + 5; batch * top_k_stride];
        for b in 0..batch {
            let r = req[b] as usize;
            let s = seq[b] as usize;
            let row = &mut topk[b * top_k_stride..][..k];
            if s <= hot {
                let mut valid: Vec<i32> = (0..s as i32).collect();
                valid.shuffle(rng);
                for (i, e) in row.iter_mut().enumerate() {
                    *e = valid.get(i).copied().unwrap_or(-1);
                }
            } else {
                let resident: Vec<i32> = tokens[r * buffer_stride..][..hot]
                    .iter()
                    .copied()
                    .filter(|&t| t >= 0)
                    .collect();
                let resident_set: HashSet<i32> = resident.iter().copied().collect();
                let mut absent: Vec<i32> = (0..s as i32 - 1)
                    .filter(|t| !resident_set.contains(t))
                    .collect();
                absent.shuffle(rng);
                let newest = rng.random_bool(0.5) as usize;
                let want_miss = misses.unwrap_or_else(|| rng.random_range(0..=k - newest));
                let n_miss = want_miss.min(k - newest).min(absent.len());
                let n_hit = (k - newest - n_miss).min(resident.len());
                let n_miss = k - newest - n_hit; // fill up with misses if residents run out
                let mut q: Vec<i32> = Vec::with_capacity(k);
                let mut res = resident.clone();
                res.shuffle(rng);
                q.extend(&res[..n_hit]);
                q.extend(&absent[..n_miss.min(absent.len())]);
                if newest == 1 {
                    q.push(s as i32 - 1);
                }
                while q.len() < k {
                    q.push(-1); // only when the request is too short for k distinct tokens
                }
                q.shuffle(rng);
                row.copy_from_slice(&q);
            }
        }
        let num_real = if rng.random_bool(0.5) {
            Some(rng.random_range(0..=batch as i32))
        } else {
            None
        };
        let mut host_cache = vec![0u8; host_rows * item];
        rng.fill_bytes(&mut host_cache);
        let mut device_buffer = vec![0u8; device_rows * item];
        rng.fill_bytes(&mut device_buffer);
        SwapCase {
            hot,
            k,
            item,
            requests,
            max_tokens,
            buffer_stride,
            lru_stride,
            host_stride,
            top_k_stride,
            out_stride,
            tokens,
            locs,
            lru,
            host_locs,
            host_cache,
            device_buffer,
            topk,
            req,
            seq,
            req_i64: rng.random_bool(0.5),
            seq_i64: rng.random_bool(0.5),
            num_real,
        }
    }

    /// Mixes bad input into a valid case.
    fn spoil(&mut self, rng: &mut StdRng, h: Hostility) {
        let (batch, k, hot) = (self.batch(), self.k, self.hot);
        for b in 0..batch {
            let s = self.seq[b];
            for i in 0..k {
                let at = b * self.top_k_stride + i;
                if rng.random_bool(h.padding) {
                    self.topk[at] = -1;
                } else if rng.random_bool(h.bad) {
                    self.topk[at] = match rng.random_range(0..4) {
                        0 => self.topk[b * self.top_k_stride + rng.random_range(0..k)], // duplicate
                        1 => s as i32 + rng.random_range(0..3),
                        2 => -2 - rng.random_range(0..3),
                        _ => i32::MIN,
                    };
                }
            }
            if rng.random_bool(h.bad / 2.0) {
                self.req[b] = [self.requests as i64, -1, i64::MAX][rng.random_range(0..3)];
            }
            if rng.random_bool(h.bad / 2.0) {
                self.seq[b] = [-1, self.max_tokens as i64 + 1, i64::MIN][rng.random_range(0..3)];
            }
        }
        for r in 0..self.requests {
            if rng.random_bool(h.bad) {
                let at = r * self.lru_stride + rng.random_range(0..hot);
                self.lru[at] =
                    [hot as i16, -1, self.lru[r * self.lru_stride]][rng.random_range(0..3)];
            }
            for s in 0..=hot {
                if rng.random_bool(h.bad / 3.0) {
                    self.locs[r * self.buffer_stride + s] =
                        [-1, self.device_rows() as i32, i32::MAX][rng.random_range(0..3)];
                }
            }
            for t in 0..self.max_tokens {
                if rng.random_bool(h.bad / 3.0) {
                    self.host_locs[r * self.host_stride + t] =
                        [-1, self.host_rows() as i64, i64::MIN][rng.random_range(0..3)];
                }
            }
        }
        if rng.random_bool(h.bad) {
            self.num_real = Some([batch as i32 + 1, -1, i32::MAX][rng.random_range(0..3)]);
        }
    }

    /// Runs the case on `exec` (the tier's pool holds the host cache, as the
    /// SGLang shim places the host KV pool).
    pub fn run(&self, exec: &Executor, strategy: SwapInStrategy) -> SwapOutcome {
        self.run_with(exec, strategy, SwapOptions::default())
    }

    /// [`SwapCase::run`] with SGLang's optional arguments.
    pub fn run_with(
        &self,
        exec: &Executor,
        strategy: SwapInStrategy,
        opts: SwapOptions,
    ) -> SwapOutcome {
        let stride = plan_stride(self.k);
        let plan_len = self.batch() * stride;
        let mut plan_src = vec![PLAN_BEFORE as i64; plan_len];
        let mut plan_dst = vec![PLAN_BEFORE; plan_len];
        let mut plan_count = vec![PLAN_BEFORE; self.batch()];
        let host_bytes = self.host_cache.len().max(8);
        let layout = LayerFirstLayout::new(8, 1, (host_bytes.div_ceil(8)) as u32).unwrap();
        let pool = Pool::create(
            layout,
            DeviceSpec::Anon {
                bytes: Pool::device_bytes_for(&layout, 1),
            },
        )
        .unwrap();
        let region = pool.alloc_region().unwrap();
        let mut bytes = self.host_cache.clone();
        bytes.resize(host_bytes.next_multiple_of(8), 0);
        pool.write_tokens(&region, 0, 0, &bytes).unwrap();
        let mut tier = Tier::new(pool.clone(), exec.clone(), 1).unwrap();
        tier.enable_swap_in(self.batch().max(1) as u32, self.k as u32)
            .unwrap();

        let (req32, seq32) = (clamp32(&self.req), clamp32(&self.seq));
        let num_real = self.num_real.map(|n| vec![n]);
        let out_len = if self.batch() == 0 {
            0
        } else {
            (self.batch() - 1) * self.out_stride + self.k
        };
        let mut out = vec![OUT_BEFORE; out_len];
        let (mut tokens, mut lru, mut device_buffer) = (
            self.tokens.clone(),
            self.lru.clone(),
            self.device_buffer.clone(),
        );

        let res = match exec {
            Executor::Cpu => {
                let args = SwapInArgs {
                    top_k_tokens: Buf::host(&self.topk),
                    top_k_stride: self.top_k_stride,
                    device_buffer_tokens: BufMut::host(&mut tokens),
                    device_buffer_locs: Buf::host(&self.locs),
                    buffer_stride: self.buffer_stride,
                    lru_slots: BufMut::host(&mut lru),
                    lru_stride: self.lru_stride,
                    host_cache_locs: Buf::host(&self.host_locs),
                    host_stride: self.host_stride,
                    max_tokens: self.max_tokens as u32,
                    host_cache: Buf::host(&self.host_cache),
                    device_buffer: BufMut::host(&mut device_buffer),
                    top_k_device_locs: BufMut::host(&mut out),
                    out_stride: self.out_stride,
                    req_pool_indices: if self.req_i64 {
                        IndexBuf::I64(Buf::host(&self.req))
                    } else {
                        IndexBuf::I32(Buf::host(&req32))
                    },
                    seq_lens: if self.seq_i64 {
                        IndexBuf::I64(Buf::host(&self.seq))
                    } else {
                        IndexBuf::I32(Buf::host(&seq32))
                    },
                    num_real_reqs: num_real.as_ref().map(|n| Buf::host(n)),
                    num_requests: self.requests as u32,
                    num_top_k: self.k as u32,
                    hot_buffer_size: self.hot as u32,
                    item_size_bytes: self.item as u32,
                    skip_io: opts.skip_io,
                    miss_plan: opts.record_plan.then(|| MissPlan {
                        src: BufMut::host(&mut plan_src),
                        dst: BufMut::host(&mut plan_dst),
                        stride,
                        count: BufMut::host(&mut plan_count),
                    }),
                };
                tier.swap_in_with(&args, strategy, Stream::null())
            }
            Executor::Cuda(dev) => {
                let stream = dev.create_stream().unwrap();
                let d_topk = DeviceBuffer::from_host(dev, &self.topk).unwrap();
                let mut d_tokens = DeviceBuffer::from_host(dev, &tokens).unwrap();
                let d_locs = DeviceBuffer::from_host(dev, &self.locs).unwrap();
                let mut d_lru = DeviceBuffer::from_host(dev, &lru).unwrap();
                let d_host_locs = DeviceBuffer::from_host(dev, &self.host_locs).unwrap();
                let mut d_dev_buf = DeviceBuffer::from_host(dev, &device_buffer).unwrap();
                let mut d_out = DeviceBuffer::from_host(dev, &out).unwrap();
                let d_req64 = DeviceBuffer::from_host(dev, &self.req).unwrap();
                let d_req32 = DeviceBuffer::from_host(dev, &req32).unwrap();
                let d_seq64 = DeviceBuffer::from_host(dev, &self.seq).unwrap();
                let d_seq32 = DeviceBuffer::from_host(dev, &seq32).unwrap();
                let d_num_real = num_real
                    .as_ref()
                    .map(|n| DeviceBuffer::from_host(dev, n).unwrap());
                let base = pool.region_device_addr(&region, dev).unwrap();
                let mut d_plan_src = DeviceBuffer::from_host(dev, &plan_src).unwrap();
                let mut d_plan_dst = DeviceBuffer::from_host(dev, &plan_dst).unwrap();
                let mut d_plan_count = DeviceBuffer::from_host(dev, &plan_count).unwrap();
                let args = SwapInArgs {
                    top_k_tokens: d_topk.as_buf(),
                    top_k_stride: self.top_k_stride,
                    device_buffer_tokens: d_tokens.as_buf_mut(),
                    device_buffer_locs: d_locs.as_buf(),
                    buffer_stride: self.buffer_stride,
                    lru_slots: d_lru.as_buf_mut(),
                    lru_stride: self.lru_stride,
                    host_cache_locs: d_host_locs.as_buf(),
                    host_stride: self.host_stride,
                    max_tokens: self.max_tokens as u32,
                    // SAFETY: the pool region holds the host cache and lives as long as `pool`.
                    host_cache: unsafe { Buf::device(base, self.host_cache.len()) },
                    device_buffer: d_dev_buf.as_buf_mut(),
                    top_k_device_locs: d_out.as_buf_mut(),
                    out_stride: self.out_stride,
                    req_pool_indices: if self.req_i64 {
                        IndexBuf::I64(d_req64.as_buf())
                    } else {
                        IndexBuf::I32(d_req32.as_buf())
                    },
                    seq_lens: if self.seq_i64 {
                        IndexBuf::I64(d_seq64.as_buf())
                    } else {
                        IndexBuf::I32(d_seq32.as_buf())
                    },
                    num_real_reqs: d_num_real.as_ref().map(|n| n.as_buf()),
                    num_requests: self.requests as u32,
                    num_top_k: self.k as u32,
                    hot_buffer_size: self.hot as u32,
                    item_size_bytes: self.item as u32,
                    skip_io: opts.skip_io,
                    miss_plan: opts.record_plan.then(|| MissPlan {
                        src: d_plan_src.as_buf_mut(),
                        dst: d_plan_dst.as_buf_mut(),
                        stride,
                        count: d_plan_count.as_buf_mut(),
                    }),
                };
                let res = tier
                    .swap_in_with(&args, strategy, stream.stream())
                    .and_then(|_| tier.check(stream.stream()));
                out = d_out.to_vec().unwrap();
                tokens = d_tokens.to_vec().unwrap();
                lru = d_lru.to_vec().unwrap();
                device_buffer = d_dev_buf.to_vec().unwrap();
                plan_src = d_plan_src.to_vec().unwrap();
                plan_dst = d_plan_dst.to_vec().unwrap();
                plan_count = d_plan_count.to_vec().unwrap();
                res
            }
        };
        SwapOutcome {
            out,
            tokens,
            lru,
            device_buffer,
            report: reported(&res),
            plan: opts
                .record_plan
                .then(|| plan_rows(&plan_src, &plan_dst, &plan_count, stride, self.k)),
        }
    }

    /// The model: DESIGN.md §4 for valid input, the rules of src/swap_in.rs
    /// for bad input, written as the lists the design speaks of.
    pub fn expected(&self) -> SwapOutcome {
        self.expected_with(SwapOptions::default())
    }

    /// [`SwapCase::expected`] with SGLang's optional arguments.
    pub fn expected_with(&self, opts: SwapOptions) -> SwapOutcome {
        let (k, hot, item) = (self.k, self.hot, self.item);
        let mut plan: Vec<Vec<(i64, i32)>> = vec![Vec::new(); self.batch()];
        let out_len = if self.batch() == 0 {
            0
        } else {
            (self.batch() - 1) * self.out_stride + k
        };
        let mut out = vec![OUT_BEFORE; out_len];
        let mut tokens = self.tokens.clone();
        let mut lru = self.lru.clone();
        let mut device_buffer = self.device_buffer.clone();
        let mut err = ErrorWord::clear();
        let dev_rows = self.device_rows() as i64;
        let host_rows = self.host_rows() as i64;
        let batch = self.batch() as i64;
        let real = match self.num_real {
            None => batch,
            Some(_) if batch == 0 => 0, // nothing runs
            Some(n) => {
                let clamped = (n as i64).clamp(0, batch);
                if clamped != n as i64 {
                    err.report(KVT_ERR_SWAP_NUM_REAL, 0, n as i64);
                }
                clamped
            }
        };
        // int32 index tensors carry the clamped values
        let idx = |v: i64, wide: bool| {
            if wide {
                v
            } else {
                v.clamp(i32::MIN as i64, i32::MAX as i64)
            }
        };
        for b in 0..self.batch() {
            let pos = (b as u32) << 16;
            let row: Vec<i32> = self.topk[b * self.top_k_stride..][..k].to_vec();
            let mut result = vec![-1i32; k];
            let (rid, seq) = (
                idx(self.req[b], self.req_i64),
                idx(self.seq[b], self.seq_i64),
            );
            let refused = if b as i64 >= real {
                true
            } else if rid < 0 || rid >= self.requests as i64 {
                err.report(KVT_ERR_SWAP_REQ, pos, rid);
                true
            } else if seq < 0 || seq > self.max_tokens as i64 {
                err.report(KVT_ERR_SWAP_SEQ_LEN, pos, seq);
                true
            } else {
                false
            };
            if !refused {
                let r = rid as usize;
                let state = r * self.buffer_stride;
                let loc_of = |slot: usize, i: usize, err: &mut ErrorWord| -> i32 {
                    let loc = self.locs[state + slot];
                    if loc >= 0 && (loc as i64) < dev_rows {
                        loc
                    } else {
                        err.report(KVT_ERR_SWAP_DEVICE_LOC, pos | i as u32, loc as i64);
                        -1
                    }
                };
                let token_ok = |t: i32| t >= 0 && (t as i64) < seq;
                let bad_token = |t: i32, i: usize, err: &mut ErrorWord| {
                    if t != -1 && !token_ok(t) {
                        err.report(KVT_ERR_SWAP_TOKEN, pos | i as u32, t as i64);
                    }
                };
                if seq <= hot as i64 {
                    // short: token t in slot t
                    for (i, &t) in row.iter().enumerate() {
                        bad_token(t, i, &mut err);
                        if token_ok(t) {
                            result[i] = loc_of(t as usize, i, &mut err);
                        }
                    }
                } else {
                    for (i, &t) in row.iter().enumerate() {
                        bad_token(t, i, &mut err);
                    }
                    let order: Vec<i16> = lru[r * self.lru_stride..][..hot].to_vec();
                    let mut sorted: Vec<i16> = order.clone();
                    sorted.sort();
                    if sorted != (0..hot as i16).collect::<Vec<_>>() {
                        err.report(KVT_ERR_SWAP_LRU, pos, 0);
                        out[b * self.out_stride..][..k].copy_from_slice(&result);
                        continue;
                    }
                    let newest = (seq - 1) as i32;
                    // the query's LRU-part tokens, first occurrence
                    let mut wanted: Vec<(usize, i32)> = Vec::new();
                    let mut seen = HashSet::new();
                    for (i, &t) in row.iter().enumerate() {
                        if token_ok(t) && t != newest && seen.insert(t) {
                            wanted.push((i, t));
                        }
                    }
                    let wanted_set: HashSet<i32> = wanted.iter().map(|&(_, t)| t).collect();
                    // walk the LRU: hits and evictables
                    let mut hits: Vec<usize> = Vec::new();
                    let mut evictables: Vec<usize> = Vec::new();
                    let mut hit_slot: HashMap<i32, usize> = HashMap::new();
                    for &slot in &order {
                        let slot = slot as usize;
                        let t = tokens[state + slot];
                        if t >= 0 && wanted_set.contains(&t) {
                            hits.push(slot);
                            hit_slot.entry(t).or_insert(slot);
                        } else {
                            evictables.push(slot);
                        }
                    }
                    let mut usable: Vec<usize> = Vec::new();
                    for &s in &evictables {
                        let loc = self.locs[state + s];
                        if loc >= 0 && (loc as i64) < dev_rows {
                            usable.push(s);
                        } else {
                            err.report(KVT_ERR_SWAP_SLOT_LOC, pos | s as u32, loc as i64);
                        }
                    }
                    let mut by_token: HashMap<i32, i32> = HashMap::new();
                    // the newest token and hits
                    for (i, &t) in row.iter().enumerate() {
                        if t == newest {
                            result[i] = loc_of(hot, i, &mut err);
                        }
                    }
                    let mut misses: Vec<(usize, i32, i64)> = Vec::new();
                    for &(i, t) in &wanted {
                        if let Some(&slot) = hit_slot.get(&t) {
                            by_token.insert(t, loc_of(slot, i, &mut err));
                        } else {
                            let h = self.host_locs[r * self.host_stride + t as usize];
                            if h >= 0 && h < host_rows {
                                misses.push((i, t, h));
                            } else {
                                err.report(KVT_ERR_SWAP_HOST_LOC, pos | i as u32, h);
                                by_token.insert(t, -1);
                            }
                        }
                    }
                    let mut loaded: Vec<usize> = Vec::new();
                    for (m, &(i, t, h)) in misses.iter().enumerate() {
                        match usable.get(m) {
                            Some(&slot) => {
                                let loc = self.locs[state + slot];
                                tokens[state + slot] = t;
                                if !opts.skip_io {
                                    device_buffer[loc as usize * item..][..item].copy_from_slice(
                                        &self.host_cache[h as usize * item..][..item],
                                    );
                                }
                                plan[b].push((h, loc));
                                by_token.insert(t, loc);
                                loaded.push(slot);
                            }
                            None => {
                                err.report(KVT_ERR_SWAP_DEVICE_LOC, pos | i as u32, -1);
                                by_token.insert(t, -1);
                            }
                        }
                    }
                    for (i, &t) in row.iter().enumerate() {
                        if token_ok(t) && t != newest {
                            result[i] = by_token[&t];
                        }
                    }
                    let new_order: Vec<i16> = evictables
                        .iter()
                        .filter(|s| !loaded.contains(s))
                        .chain(loaded.iter())
                        .chain(hits.iter())
                        .map(|&s| s as i16)
                        .collect();
                    lru[r * self.lru_stride..][..hot].copy_from_slice(&new_order);
                }
            }
            out[b * self.out_stride..][..k].copy_from_slice(&result);
        }
        SwapOutcome {
            out,
            tokens,
            lru,
            device_buffer,
            report: (!err.is_clear()).then(|| BadIndexReport::decode(&err)),
            plan: opts.record_plan.then_some(plan),
        }
    }

    /// SGLang's `load_cache_to_device_buffer_kernel`, transliterated for the
    /// host: a TOKEN_HIT sentinel that equals -1, hits and evictables
    /// compacted in LRU order, the m-th miss taking the m-th evictable, the
    /// same LRU write-back and copies. Valid input only (its behaviour on -1
    /// inside a long query or on duplicates reads out of bounds). Padding rows
    /// and entries past min(seq_len, K) of a short row are left as they were,
    /// as SGLang leaves them; callers pre-fill -1.
    pub fn sglang(&self, prefill: i32) -> SwapOutcome {
        const TOKEN_HIT: i32 = -1;
        let (k, hot, item) = (self.k, self.hot, self.item);
        let out_len = if self.batch() == 0 {
            0
        } else {
            (self.batch() - 1) * self.out_stride + k
        };
        let mut out = vec![OUT_BEFORE; out_len];
        for b in 0..self.batch() {
            out[b * self.out_stride..][..k].fill(prefill);
        }
        let mut tokens = self.tokens.clone();
        let mut lru = self.lru.clone();
        let mut device_buffer = self.device_buffer.clone();
        let real = self.num_real.map(|n| n as usize).unwrap_or(self.batch());
        for b in 0..real.min(self.batch()) {
            let rid = self.req[b] as usize;
            let seq = self.seq[b];
            let q = &self.topk[b * self.top_k_stride..][..k];
            let o = &mut out[b * self.out_stride..][..k];
            let state = rid * self.buffer_stride;
            if seq <= hot as i64 {
                let count = (seq as usize).min(k);
                for i in 0..count {
                    if q[i] >= 0 {
                        o[i] = self.locs[state + q[i] as usize];
                    }
                }
                continue;
            }
            let newest = (seq - 1) as i32;
            let mut s_top_k: Vec<i32> = q.to_vec();
            let mut newest_hit = 0;
            let mut index_of: HashMap<i32, usize> = HashMap::new();
            for i in 0..k {
                if q[i] == newest {
                    s_top_k[i] = TOKEN_HIT;
                    o[i] = self.locs[state + hot];
                    newest_hit = 1;
                } else {
                    index_of.insert(q[i], i);
                }
            }
            let order: Vec<usize> = lru[rid * self.lru_stride..][..hot]
                .iter()
                .map(|&s| s as usize)
                .collect();
            let (mut hits, mut evictables) = (Vec::new(), Vec::new());
            for &slot in &order {
                let t = tokens[state + slot];
                match index_of.get(&t).filter(|_| t >= 0) {
                    Some(&i) => {
                        s_top_k[i] = TOKEN_HIT;
                        o[i] = self.locs[state + slot];
                        hits.push(slot);
                    }
                    None => evictables.push(slot),
                }
            }
            let mut miss_tokens = Vec::new();
            for i in 0..k {
                if s_top_k[i] != TOKEN_HIT {
                    let slot = evictables[miss_tokens.len()];
                    o[i] = self.locs[state + slot];
                    tokens[state + slot] = s_top_k[i];
                    miss_tokens.push(s_top_k[i]);
                }
            }
            let total_misses = k - hits.len() - newest_hit;
            let total_evictable = hot - hits.len();
            let mut new_lru = vec![0i16; hot];
            for i in 0..hot {
                if i < total_misses {
                    new_lru[total_evictable - total_misses + i] = evictables[i] as i16;
                } else if i < total_evictable {
                    new_lru[i - total_misses] = evictables[i] as i16;
                } else {
                    new_lru[i] = hits[i - total_evictable] as i16;
                }
            }
            lru[rid * self.lru_stride..][..hot].copy_from_slice(&new_lru);
            for (m, &t) in miss_tokens.iter().enumerate().take(total_misses) {
                let src = self.host_locs[rid * self.host_stride + t as usize] as usize;
                let dst = self.locs[state + evictables[m]] as usize;
                device_buffer[dst * item..][..item]
                    .copy_from_slice(&self.host_cache[src * item..][..item]);
            }
        }
        SwapOutcome {
            out,
            tokens,
            lru,
            device_buffer,
            report: None,
            plan: None,
        }
    }
}
