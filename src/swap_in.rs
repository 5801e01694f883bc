//! LRU device-buffer swap-in with page-table update, exactly compatible with
//! SGLang HiSparse's `load_cache_to_device_buffer_mla` on valid input
//! (DESIGN.md §4) and strictly safer on bad input.
//!
//! Per batch row `b` with request `req = req_pool_indices[b]`, `seq_lens[b]`
//! tokens (including the one being decoded) and top-k query `q`:
//!
//! * Rows at or past `num_real_reqs[0]` (CUDA-graph padding): all outputs -1,
//!   no state change.
//! * Short sequence (`seq_len <= hot`): token `t` lives in slot `t`; output
//!   `device_buffer_locs[req][t]`, -1 for padding; no copies, no state change.
//! * Long sequence: the newest token (`seq_len - 1`) maps to the reserved slot
//!   `hot` and takes no part in the LRU. Walking `lru_slots[req]` from LRU to
//!   MRU, a slot whose token is in the query is a hit (output its location);
//!   every other slot is evictable. The m-th miss (in query order) takes the
//!   m-th evictable slot: output its location, set its token, copy host row
//!   `host_cache_locs[req][token]` into device row `device_buffer_locs[req][slot]`.
//!   New LRU order: unused evictables (old order), the slots just loaded (miss
//!   order), the hits (old order).
//!
//! Safer than SGLang on bad input, never following an unchecked index and
//! reporting through the error word: -1 inside a long query is padding (output
//! -1, no copy; SGLang counts it as a miss and copies from row -1); a
//! duplicated token resolves to one slot (all its outputs point there, one
//! copy); tokens outside `[-1, seq_len)`, host rows outside the host cache,
//! device rows outside the device buffer, a request index or length out of
//! range, and an `lru_slots` row that is not a permutation are refused (output
//! -1; a refused request keeps its state). An evictable slot whose device row
//! is out of range is never loaded into.
//!
//! Two kernels: `kvt_swap_in_plan` (one block per row: hits, slot assignment,
//! outputs, state, and a per-row miss list) and `kvt_swap_in_copy` (every miss
//! of the batch over one wide grid, so a step with few rows or few misses is
//! not limited to one block's warps waiting on PCIe latency).
//! [`SwapInStrategy::OneBlockPerRequest`] runs the plan kernel with the copies
//! inside each row's block, SGLang's design, for comparison.
//!
//! The plan the copy kernel reads is SGLang's miss-plan format (host row and
//! device row per miss, a count per row), so a caller may pass its own
//! ([`MissPlan`], SGLang's `miss_src`/`miss_dst`/`miss_count`) to replay the
//! copies for other layers; `skip_io` moves no KV bytes at all (SGLang's
//! timing probe). [`SwapInEngine`] owns the scratch and the error word.

use std::collections::HashMap;
use std::sync::Arc;

use crate::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_LRU, KVT_ERR_SWAP_NUM_REAL,
    KVT_ERR_SWAP_REQ, KVT_ERR_SWAP_SEQ_LEN, KVT_ERR_SWAP_SLOT_LOC, KVT_ERR_SWAP_TOKEN,
    KVT_SWAP_COPY_IN_PLAN, KVT_SWAP_MAX_HOT, KVT_SWAP_MAX_TOP_K, KVT_SWAP_REQ_INDICES_I64,
    KVT_SWAP_SEQ_LENS_I64, KVT_SWAP_SKIP_IO, kvt_swap_in_params,
};
use crate::cuda::{BLOCK_THREADS, CudaDevice, DeviceBuffer, Kernel, Stream, copy_to_device_async};
use crate::error::{Result, invalid};
use crate::error_word::ErrorWord;
use crate::executor::Executor;
use crate::mem::{Buf, BufMut, Location, check_buf};

/// Threads per planning block (`KVT_SWAP_PLAN_THREADS` in kernels/swap_in.cu).
pub const SWAP_PLAN_THREADS: u32 = 512;
/// Largest top-k a swap-in accepts.
pub const MAX_TOP_K: u32 = KVT_SWAP_MAX_TOP_K;
/// Largest hot buffer (LRU slots per request) a swap-in accepts.
pub const MAX_HOT: u32 = KVT_SWAP_MAX_HOT;
/// Largest batch a swap-in accepts: the copy kernel keeps a prefix sum per
/// row in shared memory (64 KiB at this size).
pub const MAX_BATCH: u32 = 16_384;

/// An index tensor that may be int32 or int64 (SGLang passes either for
/// `req_pool_indices` and `seq_lens`).
#[derive(Clone, Copy, Debug)]
pub enum IndexBuf<'a> {
    I32(Buf<'a, i32>),
    I64(Buf<'a, i64>),
}

impl IndexBuf<'_> {
    fn parts(&self) -> (u64, usize, Location, u64, bool) {
        match self {
            IndexBuf::I32(b) => (b.addr(), b.len(), b.location(), 4, false),
            IndexBuf::I64(b) => (b.addr(), b.len(), b.location(), 8, true),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.parts().1
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> From<Buf<'a, i32>> for IndexBuf<'a> {
    fn from(b: Buf<'a, i32>) -> Self {
        IndexBuf::I32(b)
    }
}

impl<'a> From<Buf<'a, i64>> for IndexBuf<'a> {
    fn from(b: Buf<'a, i64>) -> Self {
        IndexBuf::I64(b)
    }
}

/// The arguments of one swap-in, in SGLang's formats (strides in elements;
/// the batch size is `req_pool_indices.len()`).
#[derive(Debug)]
pub struct SwapInArgs<'a> {
    /// `[batch][top_k_stride]` int32 token positions, -1 padding.
    pub top_k_tokens: Buf<'a, i32>,
    pub top_k_stride: usize,
    /// `[num_requests][buffer_stride]` int32, slots `0..=hot`: token per slot, -1 empty.
    pub device_buffer_tokens: BufMut<'a, i32>,
    /// `[num_requests][buffer_stride]` int32, slots `0..=hot`: device row per slot.
    pub device_buffer_locs: Buf<'a, i32>,
    pub buffer_stride: usize,
    /// `[num_requests][lru_stride]` int16, `hot` entries: LRU permutation, 0 = LRU.
    pub lru_slots: BufMut<'a, i16>,
    pub lru_stride: usize,
    /// `[num_requests][host_stride]` int64, `max_tokens` entries: host row per token.
    pub host_cache_locs: Buf<'a, i64>,
    pub host_stride: usize,
    pub max_tokens: u32,
    /// Host cache rows of `item_size_bytes` (host-mapped for the CUDA executor).
    pub host_cache: Buf<'a, u8>,
    /// Device buffer rows of `item_size_bytes`.
    pub device_buffer: BufMut<'a, u8>,
    /// `[batch][out_stride]` int32 output: device row per top-k entry.
    pub top_k_device_locs: BufMut<'a, i32>,
    pub out_stride: usize,
    /// `[batch]` int32 or int64: request row of each batch row.
    pub req_pool_indices: IndexBuf<'a>,
    /// `[batch]` int32 or int64: tokens of each request, including the one being decoded.
    pub seq_lens: IndexBuf<'a>,
    /// `[1]` int32 on the device: rows at or past it are padding. None: all rows are real.
    pub num_real_reqs: Option<Buf<'a, i32>>,
    /// Rows of the per-request state arrays.
    pub num_requests: u32,
    pub num_top_k: u32,
    pub hot_buffer_size: u32,
    pub item_size_bytes: u32,
    /// Move no KV bytes (SGLang's `skip_io` timing probe): outputs, state and
    /// the miss plan as usual, the device buffer untouched.
    pub skip_io: bool,
    /// Record the misses here (SGLang's `miss_src`/`miss_dst`/`miss_count`)
    /// instead of in the engine's scratch, e.g. for shared-index layers that
    /// replay them. None: the engine's scratch (CUDA), nothing (CPU).
    pub miss_plan: Option<MissPlan<'a>>,
}

/// Where a swap-in records each row's misses, in SGLang's format: row `b`
/// holds `count[b]` misses, the m-th copying host row `src[b][m]` to device row
/// `dst[b][m]`. Refused, padding and short-sequence rows record 0 misses.
#[derive(Debug)]
pub struct MissPlan<'a> {
    /// `[batch][stride]` int64: host row per miss.
    pub src: BufMut<'a, i64>,
    /// `[batch][stride]` int32: device row per miss.
    pub dst: BufMut<'a, i32>,
    /// Elements between rows of `src` and `dst`; at least `num_top_k`.
    pub stride: usize,
    /// `[batch]` int32: misses per row.
    pub count: BufMut<'a, i32>,
}

/// How the CUDA executor runs a swap-in (the CPU executor has one way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapInStrategy {
    /// Plan per request, then one copy kernel over every miss of the batch.
    PlanThenCopy,
    /// Plan and copy inside one block per request (SGLang's design): the
    /// baseline the benchmark compares against.
    OneBlockPerRequest,
}

/// Where the plan scratch and error word are, as the executor addresses them
/// (plan addresses 0: no scratch, as for the CPU executor).
pub(crate) struct SwapInTarget {
    pub location: Location,
    pub max_batch: u32,
    pub max_top_k: u32,
    pub plan_src: u64,
    pub plan_dst: u64,
    pub plan_count: u64,
    pub error: u64,
}

/// Bytes of dynamic shared memory `kvt_swap_in_plan` uses (the carve-up of
/// `PlanSmem` in kernels/swap_in.cu).
pub fn plan_smem_bytes(top_k: u32, hot: u32) -> usize {
    let hash = (2 * top_k as usize).next_power_of_two();
    let words = 4
        + 3 * SWAP_PLAN_THREADS as usize
        + 2 * hash
        + 2 * top_k as usize
        + hot.div_ceil(32) as usize;
    words * 4 + 2 * (hot as usize + top_k as usize)
}

/// Bytes of dynamic shared memory `kvt_swap_in_copy` uses.
pub fn copy_smem_bytes(batch: u32) -> usize {
    4 * (batch as usize + 1 + BLOCK_THREADS as usize)
}

/// Elements a buffer of `rows` rows `stride` apart, `width` used per row, spans.
fn span(rows: usize, stride: usize, width: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * stride + width
    }
}

/// Checks every argument and builds the kernel parameters.
pub(crate) fn plan(
    t: &SwapInTarget,
    a: &SwapInArgs<'_>,
    strategy: SwapInStrategy,
) -> Result<kvt_swap_in_params> {
    let (k, hot, item) = (a.num_top_k, a.hot_buffer_size, a.item_size_bytes);
    let batch = a.req_pool_indices.len();
    if k == 0 || k > MAX_TOP_K {
        return Err(invalid(
            "num_top_k",
            format!("{k} is outside 1..={MAX_TOP_K}"),
        ));
    }
    if hot < k || hot > MAX_HOT {
        return Err(invalid(
            "hot_buffer_size",
            format!("{hot} must be at least num_top_k ({k}) and at most {MAX_HOT}"),
        ));
    }
    if item == 0 || item % 8 != 0 {
        return Err(invalid(
            "item_size_bytes",
            format!("{item} is not a positive multiple of 8"),
        ));
    }
    if batch > MAX_BATCH as usize {
        return Err(invalid(
            "req_pool_indices",
            format!("batch of {batch} rows exceeds {MAX_BATCH}; split it"),
        ));
    }
    // A caller's miss plan needs no scratch, so no capacity either.
    if a.miss_plan.is_none() && (batch > t.max_batch as usize || k > t.max_top_k) {
        return Err(invalid(
            "top_k_tokens",
            format!(
                "batch {batch} × top-k {k} exceeds the swap-in capacity {} × {} reserved \
                 (SwapInEngine::reserve, Tier::enable_swap_in)",
                t.max_batch, t.max_top_k
            ),
        ));
    }
    if a.max_tokens > i32::MAX as u32 {
        return Err(invalid(
            "max_tokens",
            format!("{} exceeds the int32 token range", a.max_tokens),
        ));
    }
    let (k_us, hot_us, r) = (k as usize, hot as usize, a.num_requests as usize);
    for (arg, stride, width) in [
        ("top_k_stride", a.top_k_stride, k_us),
        ("out_stride", a.out_stride, k_us),
        ("buffer_stride", a.buffer_stride, hot_us + 1),
        ("lru_stride", a.lru_stride, hot_us),
        ("host_stride", a.host_stride, a.max_tokens as usize),
    ] {
        if stride < width {
            return Err(invalid(
                arg,
                format!("{stride} is less than the row width {width}"),
            ));
        }
    }
    let want = t.location;
    check_buf(
        "top_k_tokens",
        a.top_k_tokens.addr(),
        a.top_k_tokens.len(),
        a.top_k_tokens.location(),
        want,
        4,
        span(batch, a.top_k_stride, k_us),
    )?;
    check_buf(
        "top_k_device_locs",
        a.top_k_device_locs.addr(),
        a.top_k_device_locs.len(),
        a.top_k_device_locs.location(),
        want,
        4,
        span(batch, a.out_stride, k_us),
    )?;
    let state_rows = span(r, a.buffer_stride, hot_us + 1);
    check_buf(
        "device_buffer_tokens",
        a.device_buffer_tokens.addr(),
        a.device_buffer_tokens.len(),
        a.device_buffer_tokens.location(),
        want,
        4,
        state_rows,
    )?;
    check_buf(
        "device_buffer_locs",
        a.device_buffer_locs.addr(),
        a.device_buffer_locs.len(),
        a.device_buffer_locs.location(),
        want,
        4,
        state_rows,
    )?;
    check_buf(
        "lru_slots",
        a.lru_slots.addr(),
        a.lru_slots.len(),
        a.lru_slots.location(),
        want,
        2,
        span(r, a.lru_stride, hot_us),
    )?;
    check_buf(
        "host_cache_locs",
        a.host_cache_locs.addr(),
        a.host_cache_locs.len(),
        a.host_cache_locs.location(),
        want,
        8,
        span(r, a.host_stride, a.max_tokens as usize),
    )?;
    let (addr, len, loc, align, req_i64) = a.req_pool_indices.parts();
    check_buf("req_pool_indices", addr, len, loc, want, align, batch)?;
    let (seq_addr, len, loc, align, seq_i64) = a.seq_lens.parts();
    check_buf("seq_lens", seq_addr, len, loc, want, align, batch)?;
    let num_real = match &a.num_real_reqs {
        Some(n) => {
            check_buf("num_real_reqs", n.addr(), n.len(), n.location(), want, 4, 1)?;
            n.addr()
        }
        None => 0,
    };
    let host_rows = (a.host_cache.len() / item as usize) as u64;
    let device_rows = (a.device_buffer.len() / item as usize) as u64;
    check_buf(
        "host_cache",
        a.host_cache.addr(),
        a.host_cache.len(),
        a.host_cache.location(),
        want,
        8,
        0,
    )?;
    check_buf(
        "device_buffer",
        a.device_buffer.addr(),
        a.device_buffer.len(),
        a.device_buffer.location(),
        want,
        8,
        0,
    )?;
    for (arg, addr) in [
        ("host_cache", a.host_cache.addr()),
        ("device_buffer", a.device_buffer.addr()),
    ] {
        if addr % 8 != 0 {
            return Err(invalid(
                arg,
                format!("address {addr:#x} is not 8-byte aligned"),
            ));
        }
    }
    let (plan_src, plan_dst, plan_count, plan_stride) = match &a.miss_plan {
        Some(m) => {
            if m.stride < k_us {
                return Err(invalid(
                    "miss_plan",
                    format!(
                        "row stride {} is less than num_top_k ({k}), the most misses a row can have",
                        m.stride
                    ),
                ));
            }
            let rows = span(batch, m.stride, k_us);
            check_buf(
                "miss_src",
                m.src.addr(),
                m.src.len(),
                m.src.location(),
                want,
                8,
                rows,
            )?;
            check_buf(
                "miss_dst",
                m.dst.addr(),
                m.dst.len(),
                m.dst.location(),
                want,
                4,
                rows,
            )?;
            check_buf(
                "miss_count",
                m.count.addr(),
                m.count.len(),
                m.count.location(),
                want,
                4,
                batch,
            )?;
            (m.src.addr(), m.dst.addr(), m.count.addr(), m.stride as u64)
        }
        None => (t.plan_src, t.plan_dst, t.plan_count, t.max_top_k as u64),
    };
    let mut flags = 0;
    if a.skip_io {
        flags |= KVT_SWAP_SKIP_IO;
    }
    if seq_i64 {
        flags |= KVT_SWAP_SEQ_LENS_I64;
    }
    if req_i64 {
        flags |= KVT_SWAP_REQ_INDICES_I64;
    }
    if strategy == SwapInStrategy::OneBlockPerRequest {
        flags |= KVT_SWAP_COPY_IN_PLAN;
    }
    Ok(kvt_swap_in_params {
        top_k_tokens: a.top_k_tokens.addr(),
        device_buffer_tokens: a.device_buffer_tokens.addr(),
        device_buffer_locs: a.device_buffer_locs.addr(),
        lru_slots: a.lru_slots.addr(),
        host_cache_locs: a.host_cache_locs.addr(),
        top_k_device_locs: a.top_k_device_locs.addr(),
        req_pool_indices: addr,
        seq_lens: seq_addr,
        num_real_reqs: num_real,
        host_cache: a.host_cache.addr(),
        device_buffer: a.device_buffer.addr(),
        plan_src,
        plan_dst,
        plan_count,
        error: t.error,
        host_rows,
        device_rows,
        top_k_stride: a.top_k_stride as u64,
        buffer_stride: a.buffer_stride as u64,
        lru_stride: a.lru_stride as u64,
        host_stride: a.host_stride as u64,
        out_stride: a.out_stride as u64,
        plan_stride,
        batch: batch as u32,
        top_k: k,
        hot,
        item_bytes: item,
        num_requests: a.num_requests,
        max_tokens: a.max_tokens,
        flags,
        _reserved: 0,
    })
}

/// What a top-k entry of a long-sequence row turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Output decided: a device row, or -1.
    Done(i32),
    /// The token being decoded: the reserved slot `hot`.
    Newest,
    /// A token of the LRU part, canonical (first occurrence).
    Candidate(i32),
    /// Same token as the canonical entry at this index.
    Duplicate(usize),
    /// To be loaded from this host row.
    Miss { token: i32, host_row: i64 },
}

/// The CPU reference of `kvt_swap_in_plan` + `kvt_swap_in_copy`: same
/// outputs, same state, same device buffer, same error word.
///
/// # Safety
/// Every address in `p` must be host memory matching the shapes in `p`, as
/// [`plan`] checks for host buffers.
pub(crate) unsafe fn run_cpu(p: &kvt_swap_in_params) -> ErrorWord {
    use std::slice::{from_raw_parts, from_raw_parts_mut};
    let mut err = ErrorWord::clear();
    let (batch, k, hot) = (p.batch as usize, p.top_k as usize, p.hot as usize);
    let r = p.num_requests as usize;
    let item = p.item_bytes as usize;
    if batch == 0 {
        return err;
    }
    // SAFETY: shapes checked by `plan`, per this function's contract.
    let (topk, out, btok, bloc, lru, hloc) = unsafe {
        (
            from_raw_parts(
                p.top_k_tokens as *const i32,
                span(batch, p.top_k_stride as usize, k),
            ),
            from_raw_parts_mut(
                p.top_k_device_locs as *mut i32,
                span(batch, p.out_stride as usize, k),
            ),
            from_raw_parts_mut(
                p.device_buffer_tokens as *mut i32,
                span(r, p.buffer_stride as usize, hot + 1),
            ),
            from_raw_parts(
                p.device_buffer_locs as *const i32,
                span(r, p.buffer_stride as usize, hot + 1),
            ),
            from_raw_parts_mut(p.lru_slots as *mut i16, span(r, p.lru_stride as usize, hot)),
            from_raw_parts(
                p.host_cache_locs as *const i64,
                span(r, p.host_stride as usize, p.max_tokens as usize),
            ),
        )
    };
    let index = |base: u64, row: usize, is_i64: bool| -> i64 {
        // SAFETY: `row` < batch, the checked length of these arrays.
        unsafe {
            if is_i64 {
                *(base as *const i64).add(row)
            } else {
                *(base as *const i32).add(row) as i64
            }
        }
    };
    let in_rows = |row: i64, rows: u64| row >= 0 && (row as u64) < rows;
    let skip_io = p.flags & KVT_SWAP_SKIP_IO != 0;
    // The miss plan, where one is recorded (the caller's; the CPU executor
    // has no scratch): every row's count is set, refused rows to 0.
    let plan_stride = p.plan_stride as usize;
    // SAFETY: `plan` checked the caller's plan buffers against the batch.
    let mut miss_plan = (p.plan_count != 0).then(|| unsafe {
        (
            from_raw_parts_mut(p.plan_src as *mut i64, span(batch, plan_stride, k)),
            from_raw_parts_mut(p.plan_dst as *mut i32, span(batch, plan_stride, k)),
            from_raw_parts_mut(p.plan_count as *mut i32, batch),
        )
    });
    if let Some((_, _, count)) = miss_plan.as_mut() {
        count.fill(0);
    }

    let mut num_real = batch as i64;
    if p.num_real_reqs != 0 {
        // SAFETY: checked to hold one element.
        let given = unsafe { *(p.num_real_reqs as *const i32) } as i64;
        num_real = given.clamp(0, batch as i64);
        if given != num_real {
            err.report(KVT_ERR_SWAP_NUM_REAL, 0, given);
        }
    }

    for b in 0..batch {
        let row_pos = (b as u32) << 16;
        let out_row = &mut out[b * p.out_stride as usize..][..k];
        if b as i64 >= num_real {
            out_row.fill(-1);
            continue;
        }
        let rid = index(
            p.req_pool_indices,
            b,
            p.flags & KVT_SWAP_REQ_INDICES_I64 != 0,
        );
        if rid < 0 || rid >= r as i64 {
            err.report(KVT_ERR_SWAP_REQ, row_pos, rid);
            out_row.fill(-1);
            continue;
        }
        let seq = index(p.seq_lens, b, p.flags & KVT_SWAP_SEQ_LENS_I64 != 0);
        if seq < 0 || seq > p.max_tokens as i64 {
            err.report(KVT_ERR_SWAP_SEQ_LEN, row_pos, seq);
            out_row.fill(-1);
            continue;
        }
        let rid = rid as usize;
        let q = &topk[b * p.top_k_stride as usize..][..k];
        let tokens = &mut btok[rid * p.buffer_stride as usize..][..hot + 1];
        let locs = &bloc[rid * p.buffer_stride as usize..][..hot + 1];
        let lru_row = &mut lru[rid * p.lru_stride as usize..][..hot];
        let host_row = &hloc[rid * p.host_stride as usize..][..p.max_tokens as usize];
        let loc_or_report = |err: &mut ErrorWord, slot: usize, i: usize| -> i32 {
            let loc = locs[slot];
            if in_rows(loc as i64, p.device_rows) {
                loc
            } else {
                err.report(KVT_ERR_SWAP_DEVICE_LOC, row_pos | i as u32, loc as i64);
                -1
            }
        };

        if seq <= hot as i64 {
            for (i, &t) in q.iter().enumerate() {
                out_row[i] = if t == -1 {
                    -1
                } else if t < -1 || t as i64 >= seq {
                    err.report(KVT_ERR_SWAP_TOKEN, row_pos | i as u32, t as i64);
                    -1
                } else {
                    loc_or_report(&mut err, t as usize, i)
                };
            }
            continue;
        }

        // Classify the query; canonical = first occurrence of a token.
        let newest = (seq - 1) as i32;
        let mut first: HashMap<i32, usize> = HashMap::new();
        let mut entries: Vec<Entry> = Vec::with_capacity(k);
        for (i, &t) in q.iter().enumerate() {
            entries.push(if t == -1 {
                Entry::Done(-1)
            } else if t < -1 || t as i64 >= seq {
                err.report(KVT_ERR_SWAP_TOKEN, row_pos | i as u32, t as i64);
                Entry::Done(-1)
            } else if t == newest {
                Entry::Newest
            } else {
                match first.get(&t) {
                    Some(&c) => Entry::Duplicate(c),
                    None => {
                        first.insert(t, i);
                        Entry::Candidate(t)
                    }
                }
            });
        }
        let mut seen = vec![false; hot];
        let lru_ok = lru_row.iter().all(|&s| {
            let ok = s >= 0 && (s as usize) < hot && !seen[s as usize];
            if ok {
                seen[s as usize] = true;
            }
            ok
        });
        if !lru_ok {
            err.report(KVT_ERR_SWAP_LRU, row_pos, 0);
            out_row.fill(-1);
            continue;
        }

        // Hits (lowest LRU position per token) and usable evictables.
        let old: Vec<usize> = lru_row.iter().map(|&s| s as usize).collect();
        let mut hit_pos: HashMap<usize, usize> = HashMap::new(); // canonical entry -> LRU position
        let mut is_hit = vec![false; hot];
        let mut usable = vec![false; hot];
        for (pos, &slot) in old.iter().enumerate() {
            let token = tokens[slot];
            match first.get(&token).filter(|_| token >= 0) {
                Some(&c) => {
                    is_hit[pos] = true;
                    hit_pos.entry(c).or_insert(pos);
                }
                None => {
                    usable[pos] = in_rows(locs[slot] as i64, p.device_rows);
                    if !usable[pos] {
                        err.report(
                            KVT_ERR_SWAP_SLOT_LOC,
                            row_pos | slot as u32,
                            locs[slot] as i64,
                        );
                    }
                }
            }
        }
        for (i, entry) in entries.iter_mut().enumerate() {
            *entry = match *entry {
                Entry::Newest => Entry::Done(loc_or_report(&mut err, hot, i)),
                Entry::Candidate(t) => match hit_pos.get(&i) {
                    Some(&pos) => Entry::Done(loc_or_report(&mut err, old[pos], i)),
                    None => {
                        let h = host_row[t as usize];
                        if in_rows(h, p.host_rows) {
                            Entry::Miss {
                                token: t,
                                host_row: h,
                            }
                        } else {
                            err.report(KVT_ERR_SWAP_HOST_LOC, row_pos | i as u32, h);
                            Entry::Done(-1)
                        }
                    }
                },
                e => e,
            };
        }

        // The m-th miss takes the m-th usable evictable slot.
        let usable_slots: Vec<usize> = (0..hot)
            .filter(|&pos| !is_hit[pos] && usable[pos])
            .map(|pos| old[pos])
            .collect();
        let n_miss = entries
            .iter()
            .filter(|e| matches!(e, Entry::Miss { .. }))
            .count();
        let n_load = n_miss.min(usable_slots.len());
        let mut m = 0;
        for (i, entry) in entries.iter_mut().enumerate() {
            if let Entry::Miss { token, host_row } = *entry {
                *entry = if m < n_load {
                    let slot = usable_slots[m];
                    let loc = locs[slot];
                    tokens[slot] = token;
                    if let Some((src, dst, _)) = miss_plan.as_mut() {
                        src[b * plan_stride + m] = host_row;
                        dst[b * plan_stride + m] = loc;
                    }
                    if !skip_io {
                        // SAFETY: host_row < host_rows and loc < device_rows
                        // were checked; distinct slots of a request have
                        // distinct rows or the caller accepts the race the
                        // kernel leaves.
                        unsafe {
                            std::ptr::copy(
                                (p.host_cache as *const u8).add(host_row as usize * item),
                                (p.device_buffer as *mut u8).add(loc as usize * item),
                                item,
                            );
                        }
                    }
                    Entry::Done(loc)
                } else {
                    err.report(KVT_ERR_SWAP_DEVICE_LOC, row_pos | i as u32, -1);
                    Entry::Done(-1)
                };
                m += 1;
            }
        }
        if let Some((_, _, count)) = miss_plan.as_mut() {
            count[b] = n_load as i32;
        }
        let output = |e: Entry| match e {
            Entry::Done(o) => o,
            _ => unreachable!("every entry is resolved"),
        };
        for i in 0..k {
            out_row[i] = match entries[i] {
                Entry::Duplicate(c) => output(entries[c]),
                e => output(e),
            };
        }

        // New LRU order.
        let mut loaded = vec![false; hot];
        usable_slots[..n_load]
            .iter()
            .for_each(|&s| loaded[s] = true);
        let mut new_order: Vec<i16> = Vec::with_capacity(hot);
        new_order.extend(
            (0..hot)
                .filter(|&pos| !is_hit[pos] && !loaded[old[pos]])
                .map(|pos| old[pos] as i16),
        );
        new_order.extend(usable_slots[..n_load].iter().map(|&s| s as i16));
        new_order.extend(
            (0..hot)
                .filter(|&pos| is_hit[pos])
                .map(|pos| old[pos] as i16),
        );
        lru_row.copy_from_slice(&new_order);
    }
    err
}

/// Enqueues the swap-in on `stream`: the plan kernel, then (for
/// [`SwapInStrategy::PlanThenCopy`]) the copy kernel.
///
/// # Safety
/// `p` must come from [`plan`] for device buffers and plan scratch of `dev`
/// sized for its batch and top-k, valid until the kernels complete.
pub(crate) unsafe fn launch(
    dev: &CudaDevice,
    p: &kvt_swap_in_params,
    stream: Stream,
) -> Result<()> {
    if p.batch == 0 {
        return Ok(());
    }
    let smem = plan_smem_bytes(p.top_k, p.hot);
    let max = dev.max_dynamic_smem();
    if smem.max(copy_smem_bytes(p.batch)) > max {
        return Err(invalid(
            "num_top_k",
            format!(
                "top-k {} with a hot buffer of {} needs {smem} B of shared memory per block; this GPU \
                 offers {max} B",
                p.top_k, p.hot
            ),
        ));
    }
    // SAFETY: per this function's contract; grid = one block per row.
    unsafe {
        dev.launch(
            Kernel::SwapInPlan,
            p.batch,
            SWAP_PLAN_THREADS,
            smem as u32,
            p,
            stream,
        )?
    };
    if p.flags & (KVT_SWAP_COPY_IN_PLAN | KVT_SWAP_SKIP_IO) == 0 {
        let grid = dev.grid_for_rows(Kernel::SwapInCopy, p.batch as u64 * p.top_k as u64);
        let smem = copy_smem_bytes(p.batch) as u32;
        // SAFETY: the plan kernel ran first on the same stream.
        unsafe { dev.launch(Kernel::SwapInCopy, grid, BLOCK_THREADS, smem, p, stream)? };
    }
    Ok(())
}

/// The plan scratch of the CUDA executor: a host row and a device row per
/// top-k entry of each batch row, and a miss count per batch row.
struct PlanScratch {
    src: DeviceBuffer<i64>,
    dst: DeviceBuffer<i32>,
    count: DeviceBuffer<i32>,
}

/// Runs swap-ins on one executor: owns the plan scratch and the error word
/// they report into. A [`crate::Tier`] holds one; engines that keep their KV
/// elsewhere (the SGLang shim) use one directly.
///
/// Swap-ins of one engine must run one after the other (one stream, or
/// ordered with events), as layers do: they share the scratch.
pub struct SwapInEngine {
    exec: Executor,
    /// The CUDA executor's error word (the CPU executor reports at once).
    error: Option<DeviceBuffer<ErrorWord>>,
    max_batch: u32,
    max_top_k: u32,
    scratch: Option<PlanScratch>,
    /// Scratch replaced by a larger [`SwapInEngine::reserve`]: a CUDA graph
    /// captured earlier still addresses it, so it lives as long as the engine.
    retired: Vec<PlanScratch>,
}

impl SwapInEngine {
    /// An engine on `exec` with no capacity yet: reserve some, or pass a
    /// [`MissPlan`] with every swap-in. For the CUDA executor this allocates
    /// the error word.
    pub fn new(exec: Executor) -> Result<Self> {
        let error = match &exec {
            Executor::Cpu => None,
            Executor::Cuda(dev) => Some(DeviceBuffer::from_host(dev, &[ErrorWord::clear()])?),
        };
        Ok(SwapInEngine {
            exec,
            error,
            max_batch: 0,
            max_top_k: 0,
            scratch: None,
            retired: Vec::new(),
        })
    }

    /// The executor.
    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// The largest batch and top-k a swap-in without a caller's miss plan
    /// may have.
    pub fn capacity(&self) -> (u32, u32) {
        (self.max_batch, self.max_top_k)
    }

    /// Makes room for swap-ins of up to `max_batch` rows and a top-k of up to
    /// `max_top_k` (never shrinks): for the CUDA executor, allocates plan
    /// scratch of 12 B per row and top-k entry. Set-up work, not for the
    /// per-layer path or inside a CUDA graph capture. Scratch it replaces is
    /// kept until the engine drops, so graphs captured before stay valid.
    pub fn reserve(&mut self, max_batch: u32, max_top_k: u32) -> Result<()> {
        if max_batch == 0 || max_batch > MAX_BATCH {
            return Err(invalid(
                "max_batch",
                format!("{max_batch} is outside 1..={MAX_BATCH}"),
            ));
        }
        if max_top_k == 0 || max_top_k > MAX_TOP_K {
            return Err(invalid(
                "max_top_k",
                format!("{max_top_k} is outside 1..={MAX_TOP_K}"),
            ));
        }
        let (batch, top_k) = (max_batch.max(self.max_batch), max_top_k.max(self.max_top_k));
        if (batch, top_k) == (self.max_batch, self.max_top_k) {
            return Ok(());
        }
        if let Executor::Cuda(dev) = &self.exec {
            let entries = batch as usize * top_k as usize;
            let fresh = PlanScratch {
                src: DeviceBuffer::zeroed(dev, entries)?,
                dst: DeviceBuffer::zeroed(dev, entries)?,
                count: DeviceBuffer::zeroed(dev, batch as usize)?,
            };
            if let Some(old) = self.scratch.replace(fresh) {
                self.retired.push(old);
            }
        }
        (self.max_batch, self.max_top_k) = (batch, top_k);
        Ok(())
    }

    /// One layer's swap-in for a whole batch (see the module docs): plan per
    /// row, then one copy over every miss of the batch. On `stream`, no
    /// allocation, no host synchronisation; bad indices are refused and
    /// reported (CPU: now; CUDA: at the next [`SwapInEngine::check`]).
    pub fn run(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        self.run_with(args, SwapInStrategy::PlanThenCopy, stream)
    }

    /// [`SwapInEngine::run`] with an explicit strategy for the CUDA executor
    /// (the CPU executor has one); the benchmark runs the
    /// one-block-per-request baseline on identical inputs with it.
    pub fn run_with(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        stream: Stream,
    ) -> Result<()> {
        let (plan_src, plan_dst, plan_count) = match &self.scratch {
            Some(s) => (s.src.device_ptr(), s.dst.device_ptr(), s.count.device_ptr()),
            None => (0, 0, 0),
        };
        let target = SwapInTarget {
            location: self.exec.location(),
            max_batch: self.max_batch,
            max_top_k: self.max_top_k,
            plan_src,
            plan_dst,
            plan_count,
            error: self.error.as_ref().map_or(0, |e| e.device_ptr()),
        };
        let p = plan(&target, args, strategy)?;
        match &self.exec {
            // SAFETY: `plan` checked every host buffer against its shape.
            Executor::Cpu => unsafe { run_cpu(&p) }.into_result(),
            // SAFETY: `plan` checked every buffer is device memory of the right
            // size; the scratch is this engine's and fits batch × top-k (or the
            // caller's plan was checked instead).
            Executor::Cuda(dev) => unsafe { launch(dev, &p, stream) },
        }
    }

    /// The address this engine's kernels use for host memory at `host`: the
    /// same address for the CPU executor; for the CUDA executor the mapped
    /// device address, when the memory is pinned or registered (else an
    /// error naming `host_cache`).
    pub fn host_address_for_executor(&self, host: u64) -> Result<u64> {
        match &self.exec {
            Executor::Cpu => Ok(host),
            Executor::Cuda(dev) => dev.mapped_host_address(host),
        }
    }

    /// The sync point: waits for the device, then reports (and clears) the
    /// bad indices that swap-ins recorded since the last check. A no-op for
    /// the CPU executor. Not for the per-layer path.
    pub fn check(&self) -> Result<()> {
        self.take_word()?.into_result()
    }

    /// Reads and clears the error word (waits for the whole context).
    pub(crate) fn take_word(&self) -> Result<ErrorWord> {
        match (&self.exec, &self.error) {
            (Executor::Cuda(dev), Some(error)) => take_error_word(dev, error),
            _ => Ok(ErrorWord::clear()),
        }
    }
}

/// Reads a device error word and, when something was recorded, clears it and
/// waits for the reset to land (so no later kernel on any stream reports into
/// the old contents).
pub(crate) fn take_error_word(
    dev: &Arc<CudaDevice>,
    error: &DeviceBuffer<ErrorWord>,
) -> Result<ErrorWord> {
    // to_vec waits for the whole context, so work on every stream that may
    // report into the word has finished.
    let word = error.to_vec()?[0];
    if !word.is_clear() {
        copy_to_device_async(
            dev,
            error.device_ptr(),
            &[ErrorWord::clear()],
            Stream::null(),
        )?;
        dev.synchronize_all()?;
    }
    Ok(word)
}

impl Drop for SwapInEngine {
    fn drop(&mut self) {
        // Kernels still running may use the scratch and the error word.
        if let Executor::Cuda(dev) = &self.exec {
            let _ = dev.synchronize_all();
        }
    }
}

impl std::fmt::Debug for SwapInEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapInEngine")
            .field("executor", &self.exec)
            .field("capacity", &self.capacity())
            .finish()
    }
}
