//! Swap-in test support: random HiSparse states and queries (valid, or with
//! bad input mixed in) over every single-step path — token and block queries,
//! linear and page-padded item layouts, one or two KV planes, narrow
//! `device_buffer_tokens` rows — a model written from the contract in
//! src/swap_in/mod.rs, a transliteration of SGLang's kernel for valid input,
//! a model of the miss-plan replay, and a runner for both executors.

use std::collections::{HashMap, HashSet};

use kvtier::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_DUP_REQ, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_LRU,
    KVT_ERR_SWAP_NUM_REAL, KVT_ERR_SWAP_PLAN_COUNT, KVT_ERR_SWAP_REQ, KVT_ERR_SWAP_SEQ_LEN,
    KVT_ERR_SWAP_SLOT_LOC, KVT_ERR_SWAP_TOKEN,
};
use kvtier::{
    BadIndexReport, Buf, BufMut, DeviceBuffer, DeviceSpec, ErrorWord, Executor, IndexBuf,
    ItemLayout, KvBuffers, KvPlane, LayerFirstLayout, MissPlan, PlannedCopyArgs, Pool, QueryKind,
    Stream, SwapInArgs, SwapInCounters, SwapInEngine, SwapInStrategy,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, RngCore, SeedableRng};

use super::{Hostility, reported};

/// What a random swap-in case may look like.
#[derive(Clone, Copy, Debug)]
pub struct SwapLimits {
    pub max_hot: usize,
    /// Most entries per row (query columns × block tokens).
    pub max_k: usize,
    pub max_requests: usize,
    pub max_batch: usize,
}

/// The exact shape of a generated case.
#[derive(Clone, Copy, Debug)]
pub struct SwapShape {
    pub hot: usize,
    /// Query columns.
    pub k: usize,
    pub query: QueryKind,
    pub layout: ItemLayout,
    /// KV planes: 1 (MLA) or 2 (MHA's K and V).
    pub planes: usize,
    pub requests: usize,
    /// Batch rows (each a distinct request); None draws up to 5.
    pub batch: Option<usize>,
    pub max_tokens: usize,
    /// Share of requests with a short sequence (seq_len <= hot).
    pub short_share: f64,
}

impl SwapShape {
    /// A token query over linear rows of `item` bytes, one plane.
    pub fn tokens(hot: usize, k: usize, item: u32, requests: usize, max_tokens: usize) -> Self {
        SwapShape {
            hot,
            k,
            query: QueryKind::Tokens,
            layout: ItemLayout::linear(item).unwrap(),
            planes: 1,
            requests,
            batch: None,
            max_tokens,
            short_share: 0.35,
        }
    }
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

/// A small page-padded layout (4 rows per page, 16 B values, 8 B scales, 8
/// bytes of padding) that exercises the same addressing as DeepSeek-V4's C4
/// pages at a fraction of their size.
pub fn small_pages() -> ItemLayout {
    ItemLayout::paged(4, 16, 8, 4 * 24 + 8).unwrap()
}

/// One swap-in: the per-request state, the host cache and device buffer
/// (plane 0; plane 1 for MHA's V), and the batch's queries, all as plain host
/// vectors in SGLang's layouts.
#[derive(Clone)]
pub struct SwapCase {
    pub hot: usize,
    /// Query columns.
    pub k: usize,
    pub query: QueryKind,
    pub layout: ItemLayout,
    pub requests: usize,
    pub max_tokens: usize,
    pub tokens_stride: usize,
    pub locs_stride: usize,
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
    pub host_cache_v: Option<Vec<u8>>,
    pub device_buffer_v: Option<Vec<u8>>,
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
            .field("query", &self.query)
            .field("layout", &self.layout)
            .field("planes", &self.planes())
            .field("requests", &self.requests)
            .field("max_tokens", &self.max_tokens)
            .field(
                "strides(tokens,locs,lru,host,topk,out)",
                &(
                    self.tokens_stride,
                    self.locs_stride,
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

/// A recorded miss plan: per batch row, the (host row, device row) of each
/// miss loaded, in miss order; None for a row whose count was left as it was
/// (padding rows).
pub type PlanRows = Vec<Option<Vec<(i64, i32)>>>;

/// What a swap-in leaves behind.
#[derive(Clone, Debug)]
pub struct SwapOutcome {
    pub out: Vec<i32>,
    pub tokens: Vec<i32>,
    pub lru: Vec<i16>,
    pub device_buffer: Vec<u8>,
    pub device_buffer_v: Option<Vec<u8>>,
    pub report: Option<BadIndexReport>,
    /// With [`SwapOptions::record_plan`]: the recorded plan.
    pub plan: Option<PlanRows>,
    /// The call's counters (layer 0 of a one-layer table): kvtier's
    /// executors and the model count; SGLang's kernel counts nothing (None).
    pub counters: Option<SwapInCounters>,
}

/// Outcomes are equal when everything they hold is, counters included where
/// both sides counted (SGLang's kernel has none to compare).
impl PartialEq for SwapOutcome {
    fn eq(&self, o: &Self) -> bool {
        let counters_agree = match (&self.counters, &o.counters) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        self.out == o.out
            && self.tokens == o.tokens
            && self.lru == o.lru
            && self.device_buffer == o.device_buffer
            && self.device_buffer_v == o.device_buffer_v
            && self.report == o.report
            && self.plan == o.plan
            && counters_agree
    }
}

/// SGLang's optional swap-in arguments: `skip_io`, and a caller's miss plan.
#[derive(Clone, Copy, Debug, Default)]
pub struct SwapOptions {
    pub skip_io: bool,
    pub record_plan: bool,
    /// How the copy kernel moves the misses (`SwapInEngine::run_with_copy`).
    pub copy: kvtier::CopyMethod,
    /// The few-miss planner's fixed-shape builds (`SwapInEngine::run_fixed_shape`).
    pub fixed_shape: bool,
    /// The few-miss planner's cluster build (`SwapInEngine::run_cluster_copy`:
    /// `FewMiss` whatever the strategy named, its misses as `WarpVectors`).
    pub cluster_copy: bool,
    /// The split planner in clusters (`SwapInEngine::run_cluster_plan`:
    /// `FewMiss` whatever the strategy named, its misses as `WarpVectors`).
    pub cluster_plan: bool,
}

/// Value the miss-plan buffers hold before a run.
pub const PLAN_BEFORE: i32 = -11;

/// The value top_k_device_locs holds before a call.
pub const OUT_BEFORE: i32 = -7;

/// The miss plan a run recorded, as [`SwapOutcome::plan`] holds it: rows
/// whose count is still [`PLAN_BEFORE`] were not written (panics on any other
/// count outside `0..=capacity`).
pub fn plan_rows(
    src: &[i64],
    dst: &[i32],
    count: &[i32],
    stride: usize,
    capacity: usize,
) -> PlanRows {
    count
        .iter()
        .enumerate()
        .map(|(b, &c)| {
            if c == PLAN_BEFORE {
                return None;
            }
            assert!(
                (0..=capacity as i32).contains(&c),
                "miss_count[{b}] = {c} is outside 0..={capacity}"
            );
            Some(
                (0..c as usize)
                    .map(|m| (src[b * stride + m], dst[b * stride + m]))
                    .collect(),
            )
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

/// Row stride of the miss plans the tests record (wider than the entries, so
/// that a kernel that ignored the stride would be caught).
pub fn plan_stride(entries: usize) -> usize {
    entries + 3
}

/// `bytes` in 8-byte-aligned storage (KV buffers must be 8-byte aligned).
pub fn words(bytes: &[u8]) -> Vec<u64> {
    let mut w = vec![0u64; bytes.len().div_ceil(8)];
    as_bytes_mut(&mut w, bytes.len()).copy_from_slice(bytes);
    w
}

/// The first `n` bytes of `w`.
pub fn as_bytes(w: &[u64], n: usize) -> &[u8] {
    assert!(n <= w.len() * 8);
    // SAFETY: within the vector's storage.
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, n) }
}

/// The first `n` bytes of `w`, writable.
pub fn as_bytes_mut(w: &mut [u64], n: usize) -> &mut [u8] {
    assert!(n <= w.len() * 8);
    // SAFETY: within the vector's storage.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, n) }
}

/// Copies row `src` of `host` to row `dst` of `device`, both of `layout`.
pub fn copy_item(layout: &ItemLayout, host: &[u8], device: &mut [u8], src: u64, dst: u64) {
    for ((from, len), (to, _)) in layout.pieces(src).into_iter().zip(layout.pieces(dst)) {
        device[to as usize..][..len].copy_from_slice(&host[from as usize..][..len]);
    }
}

/// The bytes of row `row` of a buffer of `layout`, pieces concatenated.
pub fn item_bytes(layout: &ItemLayout, buffer: &[u8], row: u64) -> Vec<u8> {
    layout
        .pieces(row)
        .iter()
        .flat_map(|&(at, len)| buffer[at as usize..][..len].to_vec())
        .collect()
}

/// Bytes a buffer of `rows` rows (rounded up to whole pages) of `layout` spans.
pub fn buffer_bytes(layout: &ItemLayout, rows: usize) -> usize {
    let per = layout.rows_per_page() as usize;
    rows.div_ceil(per) * layout.page_bytes() as usize
}

/// Host KV planes of `bytes` each in one pool region, plane `p` at `p ×
/// stride` (the stride returned; 8-byte aligned), as the SGLang shim places
/// host KV pools: the pool (keep it alive), the region, and the region's
/// device address on `dev`.
pub fn planes_in_pool(
    dev: &std::sync::Arc<kvtier::CudaDevice>,
    planes: &[&[u8]],
) -> (std::sync::Arc<Pool>, kvtier::Region, u64, usize) {
    let stride = planes[0].len().next_multiple_of(8).max(8);
    let layout = LayerFirstLayout::new(8, 1, (stride * planes.len() / 8) as u32).unwrap();
    let pool = Pool::create(
        layout,
        DeviceSpec::Anon {
            bytes: Pool::device_bytes_for(&layout, 1).unwrap(),
        },
    )
    .unwrap();
    let region = pool.alloc_region().unwrap();
    for (p, h) in planes.iter().enumerate() {
        let mut bytes = h.to_vec();
        bytes.resize(stride, 0);
        pool.write_tokens(&region, 0, (p * stride / 8) as u32, &bytes)
            .unwrap();
    }
    let base = pool.region_device_addr(&region, dev).unwrap();
    (pool, region, base, stride)
}

/// The host-side state of one run: outputs, state, KV planes (aligned), plan.
pub struct HostState {
    pub out: Vec<i32>,
    pub tokens: Vec<i32>,
    pub lru: Vec<i16>,
    pub host: Vec<Vec<u64>>,
    pub device: Vec<Vec<u64>>,
    pub plan_src: Vec<i64>,
    pub plan_dst: Vec<i32>,
    pub plan_count: Vec<i32>,
    pub req32: Vec<i32>,
    pub seq32: Vec<i32>,
    pub num_real: Vec<i32>,
}

impl SwapCase {
    pub fn batch(&self) -> usize {
        self.req.len()
    }

    /// Entries a row resolves (query columns × block tokens).
    pub fn entries(&self) -> usize {
        self.k * self.query.block_tokens() as usize
    }

    pub fn planes(&self) -> usize {
        1 + self.host_cache_v.is_some() as usize
    }

    pub fn host_rows(&self) -> usize {
        self.layout.rows_in(self.host_cache.len() as u64) as usize
    }

    pub fn device_rows(&self) -> usize {
        self.layout.rows_in(self.device_buffer.len() as u64) as usize
    }

    fn out_len(&self) -> usize {
        if self.batch() == 0 {
            0
        } else {
            (self.batch() - 1) * self.out_stride + self.entries()
        }
    }

    /// A random case: valid HiSparse state and queries over a random path,
    /// then bad input mixed in with the probabilities of `h`. With `misses`
    /// set, every long row of a valid token-query case misses exactly that
    /// many tokens (or as many as it can).
    pub fn random(seed: u64, lim: SwapLimits, h: Hostility, misses: Option<usize>) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let hot = rng.random_range(1..=lim.max_hot);
        let cap = hot.min(lim.max_k);
        let block_tokens = if misses.is_none() && rng.random_bool(0.3) {
            [1usize, 2, 3, 4][rng.random_range(0..4)].min(cap)
        } else {
            0
        };
        let (query, k) = if block_tokens == 0 {
            (QueryKind::Tokens, rng.random_range(1..=cap))
        } else {
            (
                QueryKind::Blocks {
                    block_tokens: block_tokens as u32,
                },
                rng.random_range(1..=cap / block_tokens),
            )
        };
        let layout = match rng.random_range(0..20) {
            0..=14 => ItemLayout::linear([8, 16, 24, 584, 656][rng.random_range(0..5)]).unwrap(),
            15..=17 => small_pages(),
            _ => ItemLayout::dsv4_c4(),
        };
        let requests = rng.random_range(1..=lim.max_requests);
        let entries = k * block_tokens.max(1);
        let shape = SwapShape {
            hot,
            k,
            query,
            layout,
            planes: if rng.random_bool(0.25) { 2 } else { 1 },
            requests,
            batch: Some(rng.random_range(0..=lim.max_batch.min(requests))),
            max_tokens: hot + rng.random_range(1..=2 * entries + 8),
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
            query,
            layout,
            requests,
            max_tokens,
            ..
        } = shape;
        let s = query.block_tokens() as usize;
        let entries = k * s;
        let pad = |rng: &mut StdRng| rng.random_range(0..=2usize);
        // SGLang's rows carry the newest token's column (and a page); a
        // `[.., hot]` tokens row is valid too (only the LRU slots are read).
        let tokens_width = if rng.random_bool(0.3) { hot } else { hot + 1 };
        let (tokens_stride, locs_stride, lru_stride, host_stride) = (
            tokens_width + pad(rng),
            hot + 1 + pad(rng),
            hot + pad(rng),
            max_tokens + pad(rng),
        );
        let (top_k_stride, out_stride) = (k + pad(rng), entries + pad(rng));

        // Every request owns hot + 1 distinct device rows and max_tokens
        // distinct host rows, shuffled over buffers of whole pages.
        let page = layout.rows_per_page() as usize;
        let device_rows = (requests * (hot + 1) + rng.random_range(0..4)).div_ceil(page) * page;
        let mut dev_rows: Vec<i32> = (0..device_rows as i32).collect();
        dev_rows.shuffle(rng);
        let host_rows = (requests * max_tokens + rng.random_range(0..4)).div_ceil(page) * page;
        let mut host_rows_perm: Vec<i64> = (0..host_rows as i64).collect();
        host_rows_perm.shuffle(rng);

        let mut tokens = vec![-9; requests * tokens_stride];
        let mut locs = vec![-9; requests * locs_stride];
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
            for sl in 0..=hot {
                locs[r * locs_stride + sl] = dev_rows[r * (hot + 1) + sl];
            }
            for t in 0..max_tokens {
                host_locs[r * host_stride + t] = host_rows_perm[r * max_tokens + t];
            }
            let mut perm: Vec<i16> = (0..hot as i16).collect();
            perm.shuffle(rng);
            lru[r * lru_stride..][..hot].copy_from_slice(&perm);
            if seq <= hot {
                for sl in 0..hot {
                    tokens[r * tokens_stride + sl] = if sl < seq { sl as i32 } else { -1 };
                }
            } else {
                // distinct resident tokens from [0, seq - 1), some slots empty
                let mut pool: Vec<i32> = (0..seq as i32 - 1).collect();
                pool.shuffle(rng);
                for sl in 0..hot {
                    tokens[r * tokens_stride + sl] =
                        if rng.random_bool(0.1) { -1 } else { pool[sl] };
                }
                if tokens_width > hot {
                    tokens[r * tokens_stride + hot] = seq as i32 - 1;
                }
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
            let sq = seq[b] as usize;
            let row = &mut topk[b * top_k_stride..][..k];
            if let QueryKind::Blocks { .. } = query {
                // distinct blocks of the sequence (the last one may run past
                // it), -1 where the sequence has too few
                let mut blocks: Vec<i32> = (0..sq.div_ceil(s) as i32).collect();
                blocks.shuffle(rng);
                for (i, e) in row.iter_mut().enumerate() {
                    *e = blocks.get(i).copied().unwrap_or(-1);
                }
                row.shuffle(rng);
            } else if sq <= hot {
                let mut valid: Vec<i32> = (0..sq as i32).collect();
                valid.shuffle(rng);
                for (i, e) in row.iter_mut().enumerate() {
                    *e = valid.get(i).copied().unwrap_or(-1);
                }
            } else {
                let resident: Vec<i32> = tokens[r * tokens_stride..][..hot]
                    .iter()
                    .copied()
                    .filter(|&t| t >= 0)
                    .collect();
                let resident_set: HashSet<i32> = resident.iter().copied().collect();
                let mut absent: Vec<i32> = (0..sq as i32 - 1)
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
                    q.push(sq as i32 - 1);
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
        let mut bytes = |rows: usize| {
            let mut v = vec![0u8; buffer_bytes(&layout, rows)];
            rng.fill_bytes(&mut v);
            v
        };
        let (host_cache, device_buffer) = (bytes(host_rows), bytes(device_rows));
        let (host_cache_v, device_buffer_v) = if shape.planes == 2 {
            (Some(bytes(host_rows)), Some(bytes(device_rows)))
        } else {
            (None, None)
        };
        SwapCase {
            hot,
            k,
            query,
            layout,
            requests,
            max_tokens,
            tokens_stride,
            locs_stride,
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
            host_cache_v,
            device_buffer_v,
            topk,
            req,
            seq,
            req_i64: rng.random_bool(0.5),
            seq_i64: rng.random_bool(0.5),
            num_real,
        }
    }

    /// `self` with bad input mixed in as [`SwapCase::random`] mixes it.
    pub fn spoiled(mut self, seed: u64, h: Hostility) -> Self {
        self.spoil(&mut StdRng::seed_from_u64(seed), h);
        self
    }

    /// Mixes bad input into a valid case.
    fn spoil(&mut self, rng: &mut StdRng, h: Hostility) {
        let (batch, k, hot) = (self.batch(), self.k, self.hot);
        let s = self.query.block_tokens() as i64;
        for b in 0..batch {
            let sq = self.seq[b];
            for i in 0..k {
                let at = b * self.top_k_stride + i;
                if rng.random_bool(h.padding) {
                    self.topk[at] = -1;
                } else if rng.random_bool(h.bad) {
                    self.topk[at] = match rng.random_range(0..4) {
                        0 => self.topk[b * self.top_k_stride + rng.random_range(0..k)], // duplicate
                        1 => {
                            ((sq.max(0) as u64).div_ceil(s as u64) as i64 + rng.random_range(0..3))
                                as i32
                        }
                        2 => -2 - rng.random_range(0..3),
                        _ => i32::MIN,
                    };
                }
            }
            if rng.random_bool(h.bad / 2.0) {
                self.req[b] = [self.requests as i64, -1, i64::MAX][rng.random_range(0..3)];
            } else if b > 0 && rng.random_bool(h.bad) {
                // a request an earlier row names
                self.req[b] = self.req[rng.random_range(0..b)];
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
            for sl in 0..=hot {
                if rng.random_bool(h.bad / 3.0) {
                    self.locs[r * self.locs_stride + sl] =
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

    /// The state a run starts from, on the host.
    pub fn host_state(&self) -> HostState {
        let stride = plan_stride(self.entries());
        let mut host = vec![words(&self.host_cache)];
        let mut device = vec![words(&self.device_buffer)];
        if let (Some(h), Some(d)) = (&self.host_cache_v, &self.device_buffer_v) {
            host.push(words(h));
            device.push(words(d));
        }
        HostState {
            out: vec![OUT_BEFORE; self.out_len()],
            tokens: self.tokens.clone(),
            lru: self.lru.clone(),
            host,
            device,
            plan_src: vec![PLAN_BEFORE as i64; self.batch() * stride],
            plan_dst: vec![PLAN_BEFORE; self.batch() * stride],
            plan_count: vec![PLAN_BEFORE; self.batch()],
            req32: clamp32(&self.req),
            seq32: clamp32(&self.seq),
            num_real: self.num_real.into_iter().collect(),
        }
    }

    /// The swap-in's arguments over host state `s`.
    pub fn host_args<'a>(&'a self, s: &'a mut HostState, opts: SwapOptions) -> SwapInArgs<'a> {
        let stride = plan_stride(self.entries());
        let (hn, dn) = (self.host_cache.len(), self.device_buffer.len());
        let mut device = s.device.iter_mut();
        let mut host = s.host.iter();
        let k_plane = KvPlane {
            host: Buf::host(as_bytes(host.next().unwrap(), hn)),
            device: BufMut::host(as_bytes_mut(device.next().unwrap(), dn)),
        };
        let v = host.next().map(|h| KvPlane {
            host: Buf::host(as_bytes(h, hn)),
            device: BufMut::host(as_bytes_mut(device.next().unwrap(), dn)),
        });
        SwapInArgs {
            layer: None,
            top_k_tokens: Buf::host(&self.topk),
            top_k_stride: self.top_k_stride,
            query: self.query,
            device_buffer_tokens: BufMut::host(&mut s.tokens),
            tokens_stride: self.tokens_stride,
            device_buffer_locs: Buf::host(&self.locs),
            locs_stride: self.locs_stride,
            lru_slots: BufMut::host(&mut s.lru),
            lru_stride: self.lru_stride,
            host_cache_locs: Buf::host(&self.host_locs),
            host_stride: self.host_stride,
            max_tokens: self.max_tokens as u32,
            kv: KvBuffers {
                layout: self.layout,
                k: k_plane,
                v,
            },
            top_k_device_locs: BufMut::host(&mut s.out),
            out_stride: self.out_stride,
            req_pool_indices: if self.req_i64 {
                IndexBuf::I64(Buf::host(&self.req))
            } else {
                IndexBuf::I32(Buf::host(&s.req32))
            },
            seq_lens: if self.seq_i64 {
                IndexBuf::I64(Buf::host(&self.seq))
            } else {
                IndexBuf::I32(Buf::host(&s.seq32))
            },
            num_real_reqs: (!s.num_real.is_empty()).then(|| Buf::host(&s.num_real)),
            num_requests: self.requests as u32,
            num_top_k: self.k as u32,
            hot_buffer_size: self.hot as u32,
            skip_io: opts.skip_io,
            miss_plan: opts.record_plan.then(|| MissPlan {
                src: BufMut::host(&mut s.plan_src),
                dst: BufMut::host(&mut s.plan_dst),
                stride,
                capacity: self.entries(),
                count: BufMut::host(&mut s.plan_count),
            }),
        }
    }

    /// What host state `s` holds after a run that reported `report`.
    pub fn outcome(
        &self,
        s: &HostState,
        report: Option<BadIndexReport>,
        opts: SwapOptions,
        counters: Option<SwapInCounters>,
    ) -> SwapOutcome {
        let dn = self.device_buffer.len();
        SwapOutcome {
            counters,
            out: s.out.clone(),
            tokens: s.tokens.clone(),
            lru: s.lru.clone(),
            device_buffer: as_bytes(&s.device[0], dn).to_vec(),
            device_buffer_v: s.device.get(1).map(|d| as_bytes(d, dn).to_vec()),
            report,
            plan: opts.record_plan.then(|| {
                plan_rows(
                    &s.plan_src,
                    &s.plan_dst,
                    &s.plan_count,
                    plan_stride(self.entries()),
                    self.entries(),
                )
            }),
        }
    }

    /// Runs the case on `exec`. For the CUDA executor the host cache lives in
    /// a pool region, as the SGLang shim places the host KV pool.
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
        let mut engine = SwapInEngine::new(exec.clone()).unwrap();
        engine
            .reserve(self.batch().max(1) as u32, self.entries() as u32)
            .unwrap();
        engine.enable_counters(1).unwrap();
        match exec {
            Executor::Cpu => {
                let mut s = self.host_state();
                let res = {
                    let mut args = self.host_args(&mut s, opts);
                    args.layer = Some(0);
                    if opts.cluster_plan {
                        engine.run_cluster_plan(&args, Stream::null())
                    } else if opts.cluster_copy {
                        engine.run_cluster_copy(&args, Stream::null())
                    } else if opts.fixed_shape {
                        engine.run_fixed_shape(&args, strategy, opts.copy, Stream::null())
                    } else {
                        engine.run_with_copy(&args, strategy, opts.copy, Stream::null())
                    }
                };
                let counters = engine.counters().unwrap().map(|c| c[0]);
                self.outcome(&s, reported(&res), opts, counters)
            }
            Executor::Cuda(_) => self.run_cuda_then(&mut engine, strategy, opts, |e| e.check()),
        }
    }

    /// The case on a CUDA engine; `finish` runs after the swap-in is
    /// enqueued, before the results are read back (its error is the report).
    pub fn run_cuda_then(
        &self,
        engine: &mut SwapInEngine,
        strategy: SwapInStrategy,
        opts: SwapOptions,
        finish: impl FnOnce(&mut SwapInEngine) -> kvtier::Result<()>,
    ) -> SwapOutcome {
        let mut s = self.host_state();
        let Executor::Cuda(dev) = engine.executor().clone() else {
            unreachable!()
        };
        let dev = &dev;
        let (hn, dn) = (self.host_cache.len(), self.device_buffer.len());
        let hosts: Vec<&[u8]> = s.host.iter().map(|h| as_bytes(h, hn)).collect();
        let (_pool, _region, base, plane) = planes_in_pool(dev, &hosts);
        let stream = dev.create_stream().unwrap();
        let d_topk = DeviceBuffer::from_host(dev, &self.topk).unwrap();
        let mut d_tokens = DeviceBuffer::from_host(dev, &s.tokens).unwrap();
        let d_locs = DeviceBuffer::from_host(dev, &self.locs).unwrap();
        let mut d_lru = DeviceBuffer::from_host(dev, &s.lru).unwrap();
        let d_host_locs = DeviceBuffer::from_host(dev, &self.host_locs).unwrap();
        let mut d_dev: Vec<DeviceBuffer<u8>> = s
            .device
            .iter()
            .map(|d| DeviceBuffer::from_host(dev, as_bytes(d, dn)).unwrap())
            .collect();
        let mut d_out = DeviceBuffer::from_host(dev, &s.out).unwrap();
        let d_req64 = DeviceBuffer::from_host(dev, &self.req).unwrap();
        let d_req32 = DeviceBuffer::from_host(dev, &s.req32).unwrap();
        let d_seq64 = DeviceBuffer::from_host(dev, &self.seq).unwrap();
        let d_seq32 = DeviceBuffer::from_host(dev, &s.seq32).unwrap();
        let d_num_real =
            (!s.num_real.is_empty()).then(|| DeviceBuffer::from_host(dev, &s.num_real).unwrap());
        let mut d_plan_src = DeviceBuffer::from_host(dev, &s.plan_src).unwrap();
        let mut d_plan_dst = DeviceBuffer::from_host(dev, &s.plan_dst).unwrap();
        let mut d_plan_count = DeviceBuffer::from_host(dev, &s.plan_count).unwrap();
        let res = {
            let mut planes = d_dev.iter_mut();
            // SAFETY: the region is registered and mapped; it holds the planes.
            let host_plane = |p: usize| unsafe { Buf::device(base + (p * plane) as u64, hn) };
            let k_plane = KvPlane {
                host: host_plane(0),
                device: planes.next().unwrap().as_buf_mut(),
            };
            let v = planes.next().map(|d| KvPlane {
                host: host_plane(1),
                device: d.as_buf_mut(),
            });
            let args = SwapInArgs {
                layer: Some(0),
                top_k_tokens: d_topk.as_buf(),
                top_k_stride: self.top_k_stride,
                query: self.query,
                device_buffer_tokens: d_tokens.as_buf_mut(),
                tokens_stride: self.tokens_stride,
                device_buffer_locs: d_locs.as_buf(),
                locs_stride: self.locs_stride,
                lru_slots: d_lru.as_buf_mut(),
                lru_stride: self.lru_stride,
                host_cache_locs: d_host_locs.as_buf(),
                host_stride: self.host_stride,
                max_tokens: self.max_tokens as u32,
                kv: KvBuffers {
                    layout: self.layout,
                    k: k_plane,
                    v,
                },
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
                skip_io: opts.skip_io,
                miss_plan: opts.record_plan.then(|| MissPlan {
                    src: d_plan_src.as_buf_mut(),
                    dst: d_plan_dst.as_buf_mut(),
                    stride: plan_stride(self.entries()),
                    capacity: self.entries(),
                    count: d_plan_count.as_buf_mut(),
                }),
            };
            if opts.cluster_plan {
                engine.run_cluster_plan(&args, stream.stream())
            } else if opts.cluster_copy {
                engine.run_cluster_copy(&args, stream.stream())
            } else if opts.fixed_shape {
                engine.run_fixed_shape(&args, strategy, opts.copy, stream.stream())
            } else {
                engine.run_with_copy(&args, strategy, opts.copy, stream.stream())
            }
        };
        let res = res.and_then(|_| finish(engine));
        s.out = d_out.to_vec().unwrap();
        s.tokens = d_tokens.to_vec().unwrap();
        s.lru = d_lru.to_vec().unwrap();
        for (w, d) in s.device.iter_mut().zip(&d_dev) {
            as_bytes_mut(w, dn).copy_from_slice(&d.to_vec().unwrap());
        }
        s.plan_src = d_plan_src.to_vec().unwrap();
        s.plan_dst = d_plan_dst.to_vec().unwrap();
        s.plan_count = d_plan_count.to_vec().unwrap();
        let counters = engine.counters().unwrap().map(|c| c[0]);
        self.outcome(&s, reported(&res), opts, counters)
    }

    /// The entry `i` of row `b` names: `Some(t)` with `t` in `[0, seq)`, or
    /// None (padding, tokens of a block past the sequence, or refused and
    /// reported).
    fn entry(&self, b: usize, i: usize, seq: i64, err: &mut ErrorWord) -> Option<i32> {
        let pos = (b as u32) << 16;
        let row = &self.topk[b * self.top_k_stride..][..self.k];
        match self.query {
            QueryKind::Tokens => {
                let t = row[i];
                if t != -1 && (t < -1 || t as i64 >= seq) {
                    err.report(KVT_ERR_SWAP_TOKEN, pos | i as u32, t as i64);
                }
                (t >= 0 && (t as i64) < seq).then_some(t)
            }
            QueryKind::Blocks { block_tokens } => {
                let s = block_tokens as usize;
                let block = row[i / s];
                if block < -1 && i.is_multiple_of(s) {
                    err.report(KVT_ERR_SWAP_TOKEN, pos | (i / s) as u32, block as i64);
                }
                let t = block as i64 * s as i64 + (i % s) as i64;
                (block >= 0 && t < seq).then_some(t as i32)
            }
        }
    }

    /// Copies host row `h` to device row `d` of every plane.
    fn model_copy(&self, dev: &mut [Vec<u8>], h: i64, d: i32) {
        let hosts = std::iter::once(&self.host_cache).chain(self.host_cache_v.as_ref());
        for (host, device) in hosts.zip(dev.iter_mut()) {
            copy_item(&self.layout, host, device, h as u64, d as u64);
        }
    }

    fn device_planes(&self) -> Vec<Vec<u8>> {
        std::iter::once(self.device_buffer.clone())
            .chain(self.device_buffer_v.clone())
            .collect()
    }

    /// The model: the contract of src/swap_in/mod.rs, for valid and bad
    /// input, written as the lists the contract speaks of.
    pub fn expected(&self) -> SwapOutcome {
        self.expected_with(SwapOptions::default())
    }

    /// [`SwapCase::expected`] with SGLang's optional arguments.
    pub fn expected_with(&self, opts: SwapOptions) -> SwapOutcome {
        let (e, hot) = (self.entries(), self.hot);
        let mut plan: PlanRows = vec![None; self.batch()];
        let mut out = vec![OUT_BEFORE; self.out_len()];
        let mut tokens = self.tokens.clone();
        let mut lru = self.lru.clone();
        let mut dev = self.device_planes();
        let mut err = ErrorWord::clear();
        let dev_rows = self.device_rows() as i64;
        let host_rows = self.host_rows() as i64;
        let batch = self.batch() as i64;
        let mut counted = SwapInCounters {
            calls: (batch > 0) as u64,
            ..Default::default()
        };
        let real = match self.num_real {
            None => batch,
            Some(n) => {
                let clamped = (n as i64).clamp(0, batch);
                if n < 0 && batch > 0 {
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
            let mut result = vec![-1i32; e];
            let (rid, seq) = (
                idx(self.req[b], self.req_i64),
                idx(self.seq[b], self.seq_i64),
            );
            if b as i64 >= real {
                // padding: outputs -1, plan count untouched
                out[b * self.out_stride..][..e].copy_from_slice(&result);
                continue;
            }
            plan[b] = Some(Vec::new());
            let named_before = (0..b).any(|e| idx(self.req[e], self.req_i64) == rid);
            let refused = if rid < 0 || rid >= self.requests as i64 {
                err.report(KVT_ERR_SWAP_REQ, pos, rid);
                true
            } else if named_before {
                err.report(KVT_ERR_SWAP_DUP_REQ, pos, rid);
                true
            } else if seq < 0 || seq > self.max_tokens as i64 {
                err.report(KVT_ERR_SWAP_SEQ_LEN, pos, seq);
                true
            } else {
                false
            };
            if !refused {
                let r = rid as usize;
                let ts = r * self.tokens_stride;
                let ls = r * self.locs_stride;
                let loc_of = |slot: usize, i: usize, err: &mut ErrorWord| -> i32 {
                    let loc = self.locs[ls + slot];
                    if loc >= 0 && (loc as i64) < dev_rows {
                        loc
                    } else {
                        err.report(KVT_ERR_SWAP_DEVICE_LOC, pos | i as u32, loc as i64);
                        -1
                    }
                };
                if seq <= hot as i64 {
                    // short: token t in slot t; a token query resolves only
                    // its first min(seq_len, K) entries
                    let count = match self.query {
                        QueryKind::Tokens => (seq as usize).min(e),
                        QueryKind::Blocks { .. } => e,
                    };
                    for (i, o) in result.iter_mut().enumerate().take(count) {
                        if let Some(t) = self.entry(b, i, seq, &mut err) {
                            *o = loc_of(t as usize, i, &mut err);
                        }
                    }
                } else {
                    let named: Vec<Option<i32>> =
                        (0..e).map(|i| self.entry(b, i, seq, &mut err)).collect();
                    let order: Vec<i16> = lru[r * self.lru_stride..][..hot].to_vec();
                    let mut sorted: Vec<i16> = order.clone();
                    sorted.sort();
                    if sorted != (0..hot as i16).collect::<Vec<_>>() {
                        err.report(KVT_ERR_SWAP_LRU, pos, 0);
                        out[b * self.out_stride..][..e].copy_from_slice(&result);
                        continue;
                    }
                    let newest = (seq - 1) as i32;
                    // the query's LRU-part tokens, first occurrence
                    let mut wanted: Vec<(usize, i32)> = Vec::new();
                    let mut seen = HashSet::new();
                    for (i, t) in named.iter().enumerate() {
                        if let Some(t) = *t
                            && t != newest
                            && seen.insert(t)
                        {
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
                        let t = tokens[ts + slot];
                        if t >= 0 && wanted_set.contains(&t) {
                            hits.push(slot);
                            hit_slot.entry(t).or_insert(slot);
                        } else {
                            evictables.push(slot);
                        }
                    }
                    let mut usable: Vec<usize> = Vec::new();
                    for &sl in &evictables {
                        let loc = self.locs[ls + sl];
                        if loc >= 0 && (loc as i64) < dev_rows {
                            usable.push(sl);
                        } else {
                            err.report(KVT_ERR_SWAP_SLOT_LOC, pos | sl as u32, loc as i64);
                        }
                    }
                    let mut by_token: HashMap<i32, i32> = HashMap::new();
                    for (i, t) in named.iter().enumerate() {
                        if *t == Some(newest) {
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
                    counted.hits += hits.len() as u64;
                    for (m, &(i, t, h)) in misses.iter().enumerate() {
                        match usable.get(m) {
                            Some(&slot) => {
                                let loc = self.locs[ls + slot];
                                tokens[ts + slot] = t;
                                if !opts.skip_io {
                                    self.model_copy(&mut dev, h, loc);
                                }
                                plan[b].as_mut().unwrap().push((h, loc));
                                by_token.insert(t, loc);
                                loaded.push(slot);
                                counted.misses += 1;
                                if !opts.skip_io {
                                    counted.bytes +=
                                        (self.layout.item_bytes() as usize * self.planes()) as u64;
                                }
                            }
                            None => {
                                err.report(KVT_ERR_SWAP_DEVICE_LOC, pos | i as u32, -1);
                                by_token.insert(t, -1);
                            }
                        }
                    }
                    for (i, t) in named.iter().enumerate() {
                        if let Some(t) = *t
                            && t != newest
                        {
                            result[i] = by_token[&t];
                        }
                    }
                    let new_order: Vec<i16> = evictables
                        .iter()
                        .filter(|sl| !loaded.contains(sl))
                        .chain(loaded.iter())
                        .chain(hits.iter())
                        .map(|&sl| sl as i16)
                        .collect();
                    lru[r * self.lru_stride..][..hot].copy_from_slice(&new_order);
                }
            }
            out[b * self.out_stride..][..e].copy_from_slice(&result);
        }
        counted.rows = real as u64;
        counted.bad_indices = err.0.count as u64;
        let mut dev = dev.into_iter();
        SwapOutcome {
            counters: Some(counted),
            out,
            tokens,
            lru,
            device_buffer: dev.next().unwrap(),
            device_buffer_v: dev.next(),
            report: (!err.is_clear()).then(|| BadIndexReport::decode(&err)),
            plan: opts.record_plan.then_some(plan),
        }
    }

    /// SGLang's `load_cache_to_device_buffer_kernel` (0.5.21-0.5.23),
    /// transliterated for the host: a TOKEN_HIT sentinel that equals -1,
    /// block ids resolved to tokens (invalid ones hits with output -1), hits
    /// and evictables compacted in LRU order, the m-th miss taking the m-th
    /// evictable, the same LRU write-back, copies and miss plan. Valid input
    /// only (its behaviour on duplicates depends on thread timing and it
    /// follows unchecked indices). Entries it never writes (-1 inside a long
    /// token query) keep `prefill`.
    pub fn sglang(&self, prefill: i32) -> SwapOutcome {
        self.sglang_with(prefill, SwapOptions::default())
    }

    /// [`SwapCase::sglang`] with SGLang's optional arguments.
    pub fn sglang_with(&self, prefill: i32, opts: SwapOptions) -> SwapOutcome {
        const TOKEN_HIT: i32 = -1;
        let (e, hot) = (self.entries(), self.hot);
        let mut out = vec![OUT_BEFORE; self.out_len()];
        for b in 0..self.batch() {
            out[b * self.out_stride..][..e].fill(prefill);
        }
        let mut tokens = self.tokens.clone();
        let mut lru = self.lru.clone();
        let mut dev = self.device_planes();
        let mut plan: PlanRows = vec![None; self.batch()];
        let real = self.num_real.map(|n| n as usize).unwrap_or(self.batch());
        let blocks = matches!(self.query, QueryKind::Blocks { .. });
        let mut scratch = ErrorWord::clear(); // valid input: never written
        for b in 0..self.batch() {
            let o = &mut out[b * self.out_stride..][..e];
            if b >= real {
                o.fill(-1);
                continue;
            }
            let rid = self.req[b] as usize;
            let seq = self.seq[b];
            // the resolved token of each entry (-1 for a padding block)
            let q: Vec<i32> = (0..e)
                .map(|i| match self.query {
                    QueryKind::Tokens => self.topk[b * self.top_k_stride + i],
                    QueryKind::Blocks { .. } => {
                        self.entry(b, i, i64::MAX, &mut scratch).unwrap_or(-1)
                    }
                })
                .collect();
            let ts = rid * self.tokens_stride;
            let ls = rid * self.locs_stride;
            if seq <= hot as i64 {
                let count = if blocks { e } else { (seq as usize).min(e) };
                for i in 0..e {
                    let t = q[i];
                    let valid = if blocks {
                        t >= 0 && (t as i64) < seq
                    } else {
                        i < count && t >= 0
                    };
                    o[i] = if valid {
                        self.locs[ls + t as usize]
                    } else {
                        -1
                    };
                }
                plan[b] = Some(Vec::new());
                continue;
            }
            let newest = (seq - 1) as i32;
            let mut s_top_k: Vec<i32> = q.clone();
            let mut index_of: HashMap<i32, usize> = HashMap::new();
            for i in 0..e {
                if blocks && (q[i] < 0 || q[i] as i64 >= seq) {
                    s_top_k[i] = TOKEN_HIT;
                    o[i] = -1;
                } else if q[i] == newest {
                    s_top_k[i] = TOKEN_HIT;
                    o[i] = self.locs[ls + hot];
                } else {
                    index_of.insert(q[i], i);
                }
            }
            let order: Vec<usize> = lru[rid * self.lru_stride..][..hot]
                .iter()
                .map(|&sl| sl as usize)
                .collect();
            let (mut hits, mut evictables) = (Vec::new(), Vec::new());
            for &slot in &order {
                let t = tokens[ts + slot];
                match index_of.get(&t).filter(|_| t >= 0) {
                    Some(&i) => {
                        s_top_k[i] = TOKEN_HIT;
                        o[i] = self.locs[ls + slot];
                        hits.push(slot);
                    }
                    None => evictables.push(slot),
                }
            }
            let mut miss_tokens = Vec::new();
            for i in 0..e {
                if s_top_k[i] != TOKEN_HIT {
                    let slot = evictables[miss_tokens.len()];
                    o[i] = self.locs[ls + slot];
                    tokens[ts + slot] = s_top_k[i];
                    miss_tokens.push(s_top_k[i]);
                }
            }
            let total_misses = miss_tokens.len();
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
            let mut row_plan = Vec::new();
            for (m, &t) in miss_tokens.iter().enumerate() {
                let src = self.host_locs[rid * self.host_stride + t as usize];
                let dst = self.locs[ls + evictables[m]];
                row_plan.push((src, dst));
                if !opts.skip_io {
                    self.model_copy(&mut dev, src, dst);
                }
            }
            plan[b] = Some(row_plan);
        }
        let mut dev = dev.into_iter();
        SwapOutcome {
            out,
            tokens,
            lru,
            device_buffer: dev.next().unwrap(),
            device_buffer_v: dev.next(),
            report: None,
            plan: opts.record_plan.then_some(plan),
            counters: None,
        }
    }
}

/// A miss plan to replay (SGLang's `copy_cache_planned_mla`), on random KV
/// planes; with bad counts and rows when hostile.
#[derive(Clone)]
pub struct ReplayCase {
    pub layout: ItemLayout,
    pub host: Vec<Vec<u8>>,
    pub device: Vec<Vec<u8>>,
    pub src: Vec<i64>,
    pub dst: Vec<i32>,
    pub count: Vec<i32>,
    pub stride: usize,
    pub capacity: usize,
    pub num_real: Option<i32>,
    pub skip_io: bool,
}

impl std::fmt::Debug for ReplayCase {
    /// The plan and the shapes; the byte buffers are random and long.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCase")
            .field("layout", &self.layout)
            .field("planes", &self.host.len())
            .field("host_bytes", &self.host[0].len())
            .field("device_bytes", &self.device[0].len())
            .field("count", &self.count)
            .field("stride", &self.stride)
            .field("capacity", &self.capacity)
            .field("src", &self.src)
            .field("dst", &self.dst)
            .field("num_real", &self.num_real)
            .field("skip_io", &self.skip_io)
            .finish()
    }
}

/// What a replay leaves behind: the device planes and the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayOutcome {
    pub device: Vec<Vec<u8>>,
    pub report: Option<BadIndexReport>,
}

impl ReplayCase {
    pub fn random(seed: u64, hostile: bool) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let layout = match rng.random_range(0..6) {
            0..=3 => ItemLayout::linear([8, 16, 512, 656, 1152][rng.random_range(0..5)]).unwrap(),
            4 => small_pages(),
            _ => ItemLayout::dsv4_c4(),
        };
        let page = layout.rows_per_page() as usize;
        let rows = rng.random_range(0..7usize);
        let capacity = rng.random_range(1..9usize);
        let stride = capacity + rng.random_range(0..3);
        let host_rows = (rng.random_range(1..64usize)).div_ceil(page) * page;
        let device_rows = (rows * capacity + 1).div_ceil(page) * page;
        let planes = 1 + rng.random_bool(0.3) as usize;
        let mut bytes = |rows: usize| {
            let mut v = vec![0u8; buffer_bytes(&layout, rows)];
            rng.fill_bytes(&mut v);
            v
        };
        let host: Vec<Vec<u8>> = (0..planes).map(|_| bytes(host_rows)).collect();
        let device: Vec<Vec<u8>> = (0..planes).map(|_| bytes(device_rows)).collect();
        // unique destinations per entry, random sources
        let mut dst_pool: Vec<i32> = (0..device_rows as i32).collect();
        dst_pool.shuffle(&mut rng);
        let mut src = vec![-3i64; rows * stride];
        let mut dst = vec![-3i32; rows * stride];
        let count: Vec<i32> = (0..rows)
            .map(|_| rng.random_range(0..=capacity) as i32)
            .collect();
        for r in 0..rows {
            for m in 0..capacity {
                src[r * stride + m] = rng.random_range(0..host_rows as i64);
                dst[r * stride + m] = dst_pool[r * capacity + m];
            }
        }
        let mut c = ReplayCase {
            layout,
            host,
            device,
            src,
            dst,
            count,
            stride,
            capacity,
            num_real: rng
                .random_bool(0.5)
                .then(|| rng.random_range(0..=rows as i32)),
            skip_io: rng.random_bool(0.15),
        };
        if hostile {
            for r in 0..rows {
                if rng.random_bool(0.2) {
                    c.count[r] = [-1, capacity as i32 + 1, i32::MAX][rng.random_range(0..3)];
                }
                for m in 0..capacity {
                    if rng.random_bool(0.1) {
                        c.src[r * stride + m] =
                            [-1, host_rows as i64, i64::MIN][rng.random_range(0..3)];
                    }
                    if rng.random_bool(0.1) {
                        c.dst[r * stride + m] =
                            [-1, device_rows as i32, i32::MAX][rng.random_range(0..3)];
                    }
                }
            }
            if rng.random_bool(0.2) {
                c.num_real = Some([-1, rows as i32 + 1][rng.random_range(0..2)]);
            }
        }
        c
    }

    /// The model: rows below num_real copy their counted entries in order
    /// (later entries win where two share a destination); bad counts and
    /// rows are refused and reported.
    pub fn expected(&self) -> ReplayOutcome {
        let mut err = ErrorWord::clear();
        let mut device = self.device.clone();
        let rows = self.count.len();
        let real = match self.num_real {
            None => rows,
            Some(n) => {
                let c = (n as i64).clamp(0, rows as i64);
                if n < 0 && rows > 0 {
                    err.report(KVT_ERR_SWAP_NUM_REAL, 0, n as i64);
                }
                c as usize
            }
        };
        let host_rows = self.layout.rows_in(self.host[0].len() as u64) as i64;
        let device_rows = self.layout.rows_in(self.device[0].len() as u64) as i64;
        if !self.skip_io {
            for r in 0..real {
                let pos = (r as u32) << 16;
                let c = self.count[r];
                if c < 0 || c as usize > self.capacity {
                    err.report(KVT_ERR_SWAP_PLAN_COUNT, pos, c as i64);
                    continue;
                }
                for m in 0..c as usize {
                    let (h, d) = (self.src[r * self.stride + m], self.dst[r * self.stride + m]);
                    if h < 0 || h >= host_rows {
                        err.report(KVT_ERR_SWAP_HOST_LOC, pos | m as u32, h);
                    } else if d < 0 || d as i64 >= device_rows {
                        err.report(KVT_ERR_SWAP_DEVICE_LOC, pos | m as u32, d as i64);
                    } else {
                        for (host, dev) in self.host.iter().zip(device.iter_mut()) {
                            copy_item(&self.layout, host, dev, h as u64, d as u64);
                        }
                    }
                }
            }
        }
        ReplayOutcome {
            device,
            report: (!err.is_clear()).then(|| BadIndexReport::decode(&err)),
        }
    }

    /// The replay's arguments over host planes `host`/`device` (aligned).
    pub fn host_args<'a>(
        &'a self,
        host: &'a [Vec<u64>],
        device: &'a mut [Vec<u64>],
        num_real: &'a [i32],
    ) -> PlannedCopyArgs<'a> {
        let (hn, dn) = (self.host[0].len(), self.device[0].len());
        let mut planes = host.iter().zip(device.iter_mut()).map(|(h, d)| KvPlane {
            host: Buf::host(as_bytes(h, hn)),
            device: BufMut::host(as_bytes_mut(d, dn)),
        });
        PlannedCopyArgs {
            src: Buf::host(&self.src),
            dst: Buf::host(&self.dst),
            count: Buf::host(&self.count),
            stride: self.stride,
            capacity: self.capacity,
            num_real_reqs: (!num_real.is_empty()).then(|| Buf::host(num_real)),
            kv: KvBuffers {
                layout: self.layout,
                k: planes.next().unwrap(),
                v: planes.next(),
            },
            skip_io: self.skip_io,
        }
    }

    /// Runs the replay on `exec` with the copy kernel of `copy`'s method (for
    /// the CUDA executor the host planes live in a registered pool region,
    /// every other buffer in device memory).
    pub fn run(&self, exec: &Executor, copy: kvtier::CopyMethod) -> ReplayOutcome {
        let Executor::Cuda(dev) = exec else {
            return self.run_cpu();
        };
        let engine = SwapInEngine::new(exec.clone()).unwrap();
        let (hn, dn) = (self.host[0].len(), self.device[0].len());
        let hosts: Vec<&[u8]> = self.host.iter().map(|h| h.as_slice()).collect();
        let (_pool, _region, base, plane) = planes_in_pool(dev, &hosts);
        let d_src = DeviceBuffer::from_host(dev, &self.src).unwrap();
        let d_dst = DeviceBuffer::from_host(dev, &self.dst).unwrap();
        let d_count = DeviceBuffer::from_host(dev, &self.count).unwrap();
        let num_real: Vec<i32> = self.num_real.into_iter().collect();
        let d_num_real =
            (!num_real.is_empty()).then(|| DeviceBuffer::from_host(dev, &num_real).unwrap());
        let mut d_dev: Vec<DeviceBuffer<u8>> = self
            .device
            .iter()
            .map(|d| DeviceBuffer::from_host(dev, d).unwrap())
            .collect();
        let res = {
            let mut planes = d_dev.iter_mut().enumerate().map(|(p, d)| KvPlane {
                // SAFETY: the region is registered and mapped; it holds the planes.
                host: unsafe { Buf::device(base + (p * plane) as u64, hn) },
                device: d.as_buf_mut(),
            });
            let args = PlannedCopyArgs {
                src: d_src.as_buf(),
                dst: d_dst.as_buf(),
                count: d_count.as_buf(),
                stride: self.stride,
                capacity: self.capacity,
                num_real_reqs: d_num_real.as_ref().map(|n| n.as_buf()),
                kv: KvBuffers {
                    layout: self.layout,
                    k: planes.next().unwrap(),
                    v: planes.next(),
                },
                skip_io: self.skip_io,
            };
            engine
                .copy_planned_with_copy(&args, Some(4 * 1024 / 32), copy, Stream::null())
                .and_then(|_| engine.check())
        };
        ReplayOutcome {
            device: d_dev
                .iter()
                .map(|d| d.to_vec().unwrap()[..dn].to_vec())
                .collect(),
            report: reported(&res),
        }
    }

    /// Runs the replay on the CPU executor.
    pub fn run_cpu(&self) -> ReplayOutcome {
        let engine = SwapInEngine::new(Executor::cpu()).unwrap();
        let host: Vec<Vec<u64>> = self.host.iter().map(|h| words(h)).collect();
        let mut device: Vec<Vec<u64>> = self.device.iter().map(|d| words(d)).collect();
        let num_real: Vec<i32> = self.num_real.into_iter().collect();
        let res = engine.copy_planned(
            &self.host_args(&host, &mut device, &num_real),
            None,
            Stream::null(),
        );
        let dn = self.device[0].len();
        ReplayOutcome {
            device: device.iter().map(|d| as_bytes(d, dn).to_vec()).collect(),
            report: reported(&res),
        }
    }
}
