//! The speculative swap-in (MTP/EAGLE verify): SGLang HiSparse's
//! `load_cache_to_device_buffer_spec_mla`, on SGLang's own per-layer state
//! (`HiSparseSpecState`), read and written as SGLang lays it out, so that
//! SGLang's kernel and kvtier's may take turns on one state.
//!
//! # The contract
//!
//! A batch row `b` names request `rid = req_pool_indices[b]` and `S` (2 to
//! 4) draft steps of `K` (at least 1024) token positions each, `S × K` at
//! most 8192: the row's `S × K` *occurrences*, step-major. Step `s` sees
//! `seq_lens[b × S + s]` tokens. The request's hot buffer is
//! `device_buffer_tokens[rid][0..hot]` / `device_buffer_locs[rid][0..hot]`;
//! the `page_size` slots after it (the *extra page*) hold the verify-step
//! tokens SGLang has just written on the device.
//!
//! For every occurrence of a real row (`b < num_real_reqs[0]`):
//!
//! * -1 outputs -1. A token outside `[-1, seq_len)` of its step, or at or
//!   past `max_tokens`, outputs -1 and is reported (never read).
//! * A token in the last `page_size` positions of its step that an extra-page
//!   slot holds outputs that slot's row: a draft token, no host I/O, no state
//!   change.
//! * A token the hot buffer holds (slot `t` for `t < hot` when slot `t`
//!   holds it, else the two hash banks of `cache_index`, else — once the hash
//!   has degraded — a scan) is a *hit*: it outputs the slot's row and marks
//!   the slot with this call's CLOCK epoch.
//! * Every other token with a host row is a *miss*. Misses are deduplicated
//!   across steps: the m-th unique miss (in occurrence order) copies its host
//!   row once into scratch row `scratch_locs[rid][m]` (when `m` is below the
//!   scratch capacity) and every occurrence of it outputs that row. A token
//!   with host row -1 outputs -1.
//!
//! Then the request's CLOCK admits misses into the hot buffer, SGLang's way:
//! when hits and misses fit the hot buffer, each miss rotates its scratch row
//! with a victim slot not hit in this call, chosen among up to six samples of
//! its partition of the ring (oldest epoch first) and, failing that, by a
//! probe of the whole ring; otherwise the CLOCK is approximate — only the
//! last step's misses are admitted, up to a budget — and misses beyond the
//! scratch capacity are copied straight into a victim's row. Victims leave
//! the hash, admitted tokens enter it (a failed insertion marks the hash
//! degraded), and the counters are set as SGLang sets them: the unique-miss
//! count in `scratch_state[0][rid]`, a new scratch epoch, the ring's epoch
//! and cursor advanced.
//!
//! Padding rows (`b >= num_real_reqs[0]`) output 0 in every occurrence (as
//! SGLang's kernel writes them) and record a miss count of 0; their state is
//! untouched.
//!
//! With a miss plan the row records its copies (host row, device row), which
//! [`super::SwapInEngine::copy_planned`] replays into shared-index layers.
//!
//! # Where kvtier and SGLang differ
//!
//! SGLang's kernel assigns unique-miss order and CLOCK victims with atomics,
//! so its state after a call depends on thread timing; kvtier's is one of the
//! orders SGLang's could take (occurrence order), and is deterministic. What
//! SGLang's tests check holds for both: every output names a row holding the
//! asked token's bytes, each unique miss is copied once, a second identical
//! call is all hits, padding rows are written 0.
//!
//! On bad input kvtier never follows an unchecked index, where SGLang's
//! kernel follows what it is given: tokens at or past `max_tokens` (SGLang
//! reads the host row), request indices out of range, two batch rows naming
//! one request (their state would race), a step's `seq_len` outside
//! `[0, max_tokens]`, and host or device rows outside their buffers are
//! refused and reported (the entry outputs -1; a refused row outputs -1 and
//! keeps its state). The miss plan holds the copies made, so its count is
//! the unique misses except where a miss found no row to go to (a scratch or
//! slot row out of range, or no victim left): SGLang counts those too and
//! leaves their plan entries stale.
//!
//! # How it runs
//!
//! The CUDA executor runs `kvt_spec_swap_in` (kernels/spec_swap_in.cu), one
//! block per batch row: its threads resolve the occurrences and claim misses
//! in the request's miss table with atomics, its warps copy each unique miss
//! once, then the block runs the CLOCK in rounds of its threads. It has run
//! under host emulation (tests/kernel_emulation.rs), not yet on a GPU. The
//! CPU executor (`run`) interprets the same parameters in occurrence order.

use std::slice::{from_raw_parts, from_raw_parts_mut};

use super::args::{ByteRanges, IndexBuf, MissPlan, check_stride};
use super::items::{self, KvBuffers, copy_planes};
use super::{MAX_BATCH, span};
use crate::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_DUP_REQ, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_NUM_REAL,
    KVT_ERR_SWAP_REQ, KVT_ERR_SWAP_SEQ_LEN, KVT_ERR_SWAP_SLOT_LOC, KVT_ERR_SWAP_TOKEN,
    KVT_SWAP_REQ_INDICES_I64, KVT_SWAP_SEQ_LENS_I64, kvt_spec_swap_in_params,
};
use crate::error::{Result, invalid};
use crate::error_word::ErrorWord;
use crate::layout::ItemLayout;
use crate::mem::{Buf, BufMut, Location};

/// Fewest draft steps a speculative swap-in takes.
pub const SPEC_MIN_STEPS: u32 = 2;
/// Most draft steps a speculative swap-in takes.
pub const SPEC_MAX_STEPS: u32 = 4;
/// Smallest top-k per step (SGLang's kernel requires it).
pub const SPEC_MIN_TOP_K: u32 = 1024;
/// Most occurrences (steps × top-k) per row: the scratch hash positions fit
/// 13 bits of SGLang's packed metadata.
pub const SPEC_MAX_OCCURRENCES: u32 = 8192;
/// Largest hot buffer: SGLang packs the CLOCK cursor in 15 bits.
pub const SPEC_MAX_HOT: u32 = 32768;

// SGLang's encodings of the state (its `hisparse_spec.cuh`).
const HASH_DELETED: i64 = -2;
const COMPACT_HASH_MASK: i32 = (1 << 13) - 1;
const COMPACT_CLAIM: i32 = 1 << 29;
const COMPACT_ADMIT: i32 = 1 << 30;
const CLOCK_VICTIM_SAMPLES: i32 = 6;
const HASH_DEGRADED: u32 = 1 << 31;
const SCRATCH_EPOCH_MASK: u32 = HASH_DEGRADED - 1;
const KNUTH: u32 = 2_654_435_761;
const CUCKOO_KICKS: u32 = 64;
/// Threads of SGLang's commit block: victims are chosen in rounds of this many.
const COMMIT_ROUND: usize = 512;
/// Marks an overflowing miss's output until its row is known: `-2 - m`.
const OVERFLOW_TAG: i32 = -2;

/// SGLang's `HiSparseSpecState` for one layer: the request's hot-buffer hash
/// (`cache_index`), its CLOCK (`cache_policy`), its scratch rows
/// (`scratch_locs`) and the counters and per-call miss metadata shared by all
/// layers (`scratch_state`). Strides in elements; `num_requests` is the
/// scratch's rows (SGLang's request slots).
#[derive(Debug)]
pub struct SpecState<'a> {
    /// `[index_rows][2][hash_size]` int64: per request a primary and a
    /// secondary bank of `slot << 32 | token` entries (-1 empty, -2 deleted).
    pub cache_index: BufMut<'a, i64>,
    pub index_rows: usize,
    /// Elements between requests, and between a request's two banks.
    pub index_stride: usize,
    pub bank_stride: usize,
    /// Entries per bank: a power of two.
    pub hash_size: usize,
    /// `[policy_rows][policy_stride]` int32, `policy_width` columns: row 0
    /// the packed CLOCK (epoch, cursor) of each request, row `1 + rid` the
    /// epoch each hot slot was last referenced in.
    pub cache_policy: BufMut<'a, i32>,
    pub policy_rows: usize,
    pub policy_stride: usize,
    pub policy_width: usize,
    /// `[num_requests][scratch_stride]` int32: each request's
    /// `scratch_capacity` scratch device rows (swapped with hot slots as
    /// misses are admitted).
    pub scratch_locs: BufMut<'a, i32>,
    pub scratch_stride: usize,
    pub scratch_capacity: usize,
    /// `[state_rows][state_stride]` int32, `state_width` columns: row 0 four
    /// counters per request (last unique misses, work count, union hits,
    /// scratch epoch), row `1 + rid` the call's miss table (read as int64
    /// pairs, so `state_stride` is even).
    pub scratch_state: BufMut<'a, i32>,
    pub state_rows: usize,
    pub state_stride: usize,
    pub state_width: usize,
}

/// The arguments of one speculative swap-in, in SGLang's formats (strides in
/// elements; the batch size is `req_pool_indices.len()`).
#[derive(Debug)]
pub struct SpecSwapInArgs<'a> {
    /// `[batch][top_k_stride]` int32: a row's `num_steps × num_top_k` token
    /// positions, step-major and contiguous, -1 padding.
    pub top_k_tokens: Buf<'a, i32>,
    pub top_k_stride: usize,
    pub num_steps: u32,
    pub num_top_k: u32,
    /// `[num_requests][tokens_stride]` int32: the token of each hot slot
    /// (`hot_buffer_size` of them) and of each extra-page slot (`page_size`).
    pub device_buffer_tokens: BufMut<'a, i32>,
    pub tokens_stride: usize,
    /// `[num_requests][locs_stride]` int32: the device row of each of those
    /// slots (rotated with scratch rows as misses are admitted).
    pub device_buffer_locs: BufMut<'a, i32>,
    pub locs_stride: usize,
    /// `[num_requests][host_stride]` int64, `max_tokens` entries: host row per token.
    pub host_cache_locs: Buf<'a, i64>,
    pub host_stride: usize,
    pub max_tokens: u32,
    /// The KV rows: one plane (MLA's latent cache).
    pub kv: KvBuffers<'a>,
    /// `[batch][out_stride]` int32 output: device row per occurrence.
    pub top_k_device_locs: BufMut<'a, i32>,
    pub out_stride: usize,
    /// `[batch]` int32 or int64: request row of each batch row.
    pub req_pool_indices: IndexBuf<'a>,
    /// `[batch × num_steps]` int32 or int64: tokens each step sees.
    pub seq_lens: IndexBuf<'a>,
    /// `[1]` int32: rows at or past it are padding.
    pub num_real_reqs: Buf<'a, i32>,
    pub state: SpecState<'a>,
    /// Request rows of the state: SGLang's request slots, the rows of
    /// `scratch_locs`. The counters of `scratch_state`'s row 0 are laid out by
    /// it (four groups of `num_requests`), so it must be exactly that.
    pub num_requests: u32,
    pub hot_buffer_size: u32,
    /// Extra-page slots after the hot buffer.
    pub page_size: u32,
    /// Record each row's copies here (SGLang's `miss_src`/`miss_dst`/`miss_count`).
    pub miss_plan: Option<MissPlan<'a>>,
}

/// The kernel parameters as the CPU executor reads them: sizes as `usize`,
/// the item layout as an [`ItemLayout`].
#[derive(Clone, Copy, Debug)]
struct SpecParams {
    top_k_tokens: u64,
    top_k_stride: usize,
    steps: usize,
    top_k: usize,
    tokens: u64,
    tokens_stride: usize,
    locs: u64,
    locs_stride: usize,
    host_cache_locs: u64,
    host_stride: usize,
    max_tokens: i64,
    host: [u64; 2],
    device: [u64; 2],
    layout: ItemLayout,
    host_rows: u64,
    device_rows: u64,
    out: u64,
    out_stride: usize,
    req_pool_indices: (u64, bool),
    seq_lens: (u64, bool),
    num_real_reqs: u64,
    batch: usize,
    requests: usize,
    hot: usize,
    page: usize,
    cache_index: u64,
    index_stride: usize,
    bank_stride: usize,
    hash_size: usize,
    cache_policy: u64,
    policy_stride: usize,
    scratch_locs: u64,
    scratch_stride: usize,
    scratch_capacity: usize,
    scratch_state: u64,
    state_stride: usize,
    /// The plan: src, dst, count addresses and the row stride.
    plan: Option<(u64, u64, u64, usize)>,
}

impl SpecParams {
    fn of(p: &kvt_spec_swap_in_params) -> Self {
        let n = |v: u64| v as usize;
        SpecParams {
            top_k_tokens: p.top_k_tokens,
            top_k_stride: n(p.top_k_stride),
            steps: p.steps as usize,
            top_k: p.top_k as usize,
            tokens: p.device_buffer_tokens,
            tokens_stride: n(p.tokens_stride),
            locs: p.device_buffer_locs,
            locs_stride: n(p.locs_stride),
            host_cache_locs: p.host_cache_locs,
            host_stride: n(p.host_stride),
            max_tokens: p.max_tokens as i64,
            host: [p.host_cache, 0],
            device: [p.device_buffer, 0],
            layout: items::layout_of(&p.items),
            host_rows: p.host_rows,
            device_rows: p.device_rows,
            out: p.top_k_device_locs,
            out_stride: n(p.out_stride),
            req_pool_indices: (p.req_pool_indices, p.flags & KVT_SWAP_REQ_INDICES_I64 != 0),
            seq_lens: (p.seq_lens, p.flags & KVT_SWAP_SEQ_LENS_I64 != 0),
            num_real_reqs: p.num_real_reqs,
            batch: p.batch as usize,
            requests: p.num_requests as usize,
            hot: p.hot as usize,
            page: p.page as usize,
            cache_index: p.cache_index,
            index_stride: n(p.index_stride),
            bank_stride: n(p.bank_stride),
            hash_size: n(p.hash_size),
            cache_policy: p.cache_policy,
            policy_stride: n(p.policy_stride),
            scratch_locs: p.scratch_locs,
            scratch_stride: n(p.scratch_stride),
            scratch_capacity: n(p.scratch_capacity),
            scratch_state: p.scratch_state,
            state_stride: n(p.state_stride),
            plan: (p.plan_count != 0).then_some((
                p.plan_src,
                p.plan_dst,
                p.plan_count,
                n(p.plan_stride),
            )),
        }
    }
}

fn within(arg: &'static str, v: u32, lo: u32, hi: u32) -> Result<()> {
    if v < lo || v > hi {
        return Err(invalid(arg, format!("{v} is outside {lo}..={hi}")));
    }
    Ok(())
}

fn at_least(arg: &'static str, what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(invalid(
            arg,
            format!("has {have} {what}; it needs at least {need}"),
        ));
    }
    Ok(())
}

/// Checks every argument of a speculative swap-in for `want` memory and
/// returns the kernel parameters (`error`: the error word's address, 0 for
/// the CPU executor, which reports at once).
pub(super) fn check(
    a: &SpecSwapInArgs<'_>,
    want: Location,
    error: u64,
) -> Result<kvt_spec_swap_in_params> {
    let (s, k, hot, page) = (a.num_steps, a.num_top_k, a.hot_buffer_size, a.page_size);
    within("num_steps", s, SPEC_MIN_STEPS, SPEC_MAX_STEPS)?;
    within("num_top_k", k, SPEC_MIN_TOP_K, SPEC_MAX_OCCURRENCES)?;
    let t = (s * k) as usize;
    if t > SPEC_MAX_OCCURRENCES as usize {
        return Err(invalid(
            "top_k_tokens",
            format!(
                "{s} steps of {k} tokens are {t} occurrences per row; at most {SPEC_MAX_OCCURRENCES}"
            ),
        ));
    }
    within("hot_buffer_size", hot, 2, SPEC_MAX_HOT)?;
    within("page_size", page, 0, SPEC_MAX_HOT)?;
    let batch = a.req_pool_indices.len();
    if batch > MAX_BATCH as usize {
        return Err(invalid(
            "req_pool_indices",
            format!("batch of {batch} rows exceeds {MAX_BATCH}; split it"),
        ));
    }
    if a.max_tokens > i32::MAX as u32 {
        return Err(invalid(
            "max_tokens",
            format!("{} exceeds the int32 token range", a.max_tokens),
        ));
    }
    let (r, hot_us, slots) = (a.num_requests as usize, hot as usize, (hot + page) as usize);
    let st = &a.state;
    if !st.hash_size.is_power_of_two() || st.hash_size > 1 << 30 {
        return Err(invalid(
            "cache_index",
            format!(
                "has {} entries per bank; it must be a power of two up to 2^30",
                st.hash_size
            ),
        ));
    }
    at_least("cache_index", "request rows", st.index_rows, r)?;
    at_least(
        "cache_policy",
        "rows (a CLOCK row and one per request)",
        st.policy_rows,
        r + 1,
    )?;
    at_least(
        "cache_policy",
        "columns (the hot slots, and a CLOCK per request)",
        st.policy_width,
        hot_us.max(r),
    )?;
    if st.scratch_capacity == 0 {
        return Err(invalid(
            "scratch_locs",
            "has no columns; it needs at least one",
        ));
    }
    at_least(
        "scratch_state",
        "rows (a counter row and one per request)",
        st.state_rows,
        r + 1,
    )?;
    at_least(
        "scratch_state",
        "columns (4 counters per request and 5 per occurrence)",
        st.state_width,
        (4 * r).max(5 * t),
    )?;
    if !st.state_stride.is_multiple_of(2) {
        return Err(invalid(
            "scratch_state",
            format!(
                "row stride {} is odd; its rows are read as int64 pairs",
                st.state_stride
            ),
        ));
    }
    if st.bank_stride < st.hash_size {
        return Err(invalid(
            "cache_index",
            format!(
                "bank stride {} is less than the bank's {} entries",
                st.bank_stride, st.hash_size
            ),
        ));
    }
    for (arg, stride, width) in [
        ("top_k_stride", a.top_k_stride, t),
        ("out_stride", a.out_stride, t),
        ("tokens_stride", a.tokens_stride, slots),
        ("locs_stride", a.locs_stride, slots),
        ("host_stride", a.host_stride, a.max_tokens as usize),
        (
            "cache_index stride",
            st.index_stride,
            st.bank_stride.saturating_add(st.hash_size),
        ),
        ("cache_policy stride", st.policy_stride, st.policy_width),
        (
            "scratch_locs stride",
            st.scratch_stride,
            st.scratch_capacity,
        ),
        ("scratch_state stride", st.state_stride, st.state_width),
    ] {
        check_stride(arg, stride, width)?;
    }
    if a.kv.v.is_some() {
        return Err(invalid(
            "device_buffer_v",
            "the speculative swap-in moves one plane (MLA's latent cache)",
        ));
    }
    let index_len = span(
        st.index_rows,
        st.index_stride,
        st.bank_stride.saturating_add(st.hash_size),
    );
    let policy_len = span(st.policy_rows, st.policy_stride, st.policy_width);
    let scratch_len = span(r, st.scratch_stride, st.scratch_capacity);
    let state_len = span(st.state_rows, st.state_stride, st.state_width);
    a.top_k_tokens
        .check("top_k_tokens", want, span(batch, a.top_k_stride, t))?;
    a.top_k_device_locs
        .check("top_k_device_locs", want, span(batch, a.out_stride, t))?;
    a.device_buffer_tokens.check(
        "device_buffer_tokens",
        want,
        span(r, a.tokens_stride, slots),
    )?;
    a.device_buffer_locs
        .check("device_buffer_locs", want, span(r, a.locs_stride, slots))?;
    a.host_cache_locs.check(
        "host_cache_locs",
        want,
        span(r, a.host_stride, a.max_tokens as usize),
    )?;
    a.req_pool_indices.check("req_pool_indices", want, batch)?;
    a.seq_lens.check("seq_lens", want, batch * s as usize)?;
    a.num_real_reqs.check("num_real_reqs", want, 1)?;
    st.cache_index.check("cache_index", want, index_len)?;
    st.cache_policy.check("cache_policy", want, policy_len)?;
    st.scratch_locs.check("scratch_locs", want, scratch_len)?;
    st.scratch_state.check("scratch_state", want, state_len)?;
    if state_len > 0 && !st.scratch_state.addr().is_multiple_of(8) {
        return Err(invalid(
            "scratch_state",
            "is not 8-byte aligned; its rows are read as int64 pairs",
        ));
    }
    let kv = items::check(&a.kv, want)?;
    let index_bytes = |b: &IndexBuf<'_>, n: usize| n as u64 * if b.is_i64() { 8 } else { 4 };
    let mut ranges = ByteRanges::new();
    ranges.push(
        "top_k_tokens",
        a.top_k_tokens.addr(),
        4 * span(batch, a.top_k_stride, t) as u64,
        false,
    );
    ranges.push(
        "top_k_device_locs",
        a.top_k_device_locs.addr(),
        4 * span(batch, a.out_stride, t) as u64,
        true,
    );
    ranges.push(
        "device_buffer_tokens",
        a.device_buffer_tokens.addr(),
        4 * span(r, a.tokens_stride, slots) as u64,
        true,
    );
    ranges.push(
        "device_buffer_locs",
        a.device_buffer_locs.addr(),
        4 * span(r, a.locs_stride, slots) as u64,
        true,
    );
    ranges.push(
        "host_cache_locs",
        a.host_cache_locs.addr(),
        8 * span(r, a.host_stride, a.max_tokens as usize) as u64,
        false,
    );
    ranges.push(
        "req_pool_indices",
        a.req_pool_indices.addr(),
        index_bytes(&a.req_pool_indices, batch),
        false,
    );
    ranges.push(
        "seq_lens",
        a.seq_lens.addr(),
        index_bytes(&a.seq_lens, batch * s as usize),
        false,
    );
    ranges.push(
        "cache_index",
        st.cache_index.addr(),
        8 * index_len as u64,
        true,
    );
    ranges.push(
        "cache_policy",
        st.cache_policy.addr(),
        4 * policy_len as u64,
        true,
    );
    ranges.push(
        "scratch_locs",
        st.scratch_locs.addr(),
        4 * scratch_len as u64,
        true,
    );
    ranges.push(
        "scratch_state",
        st.scratch_state.addr(),
        4 * state_len as u64,
        true,
    );
    ranges.push_kv(&a.kv, Some(&a.num_real_reqs));
    let plan = match &a.miss_plan {
        Some(m) => {
            if m.capacity < t {
                return Err(invalid(
                    "miss_src",
                    format!(
                        "holds {} misses per row; a row can have {t} (one per occurrence)",
                        m.capacity
                    ),
                ));
            }
            check_stride("miss_plan stride", m.stride, m.capacity)?;
            let rows = span(batch, m.stride, m.capacity);
            m.src.check("miss_src", want, rows)?;
            m.dst.check("miss_dst", want, rows)?;
            m.count.check("miss_count", want, batch)?;
            ranges.push("miss_src", m.src.addr(), 8 * rows as u64, true);
            ranges.push("miss_dst", m.dst.addr(), 4 * rows as u64, true);
            ranges.push("miss_count", m.count.addr(), 4 * batch as u64, true);
            Some((m.src.addr(), m.dst.addr(), m.count.addr(), m.stride))
        }
        None => None,
    };
    ranges.check_disjoint()?;
    let (plan_src, plan_dst, plan_count, plan_stride) = plan.unwrap_or((0, 0, 0, 0));
    let mut flags = 0;
    if a.seq_lens.is_i64() {
        flags |= KVT_SWAP_SEQ_LENS_I64;
    }
    if a.req_pool_indices.is_i64() {
        flags |= KVT_SWAP_REQ_INDICES_I64;
    }
    Ok(kvt_spec_swap_in_params {
        top_k_tokens: a.top_k_tokens.addr(),
        device_buffer_tokens: a.device_buffer_tokens.addr(),
        device_buffer_locs: a.device_buffer_locs.addr(),
        host_cache_locs: a.host_cache_locs.addr(),
        top_k_device_locs: a.top_k_device_locs.addr(),
        req_pool_indices: a.req_pool_indices.addr(),
        seq_lens: a.seq_lens.addr(),
        num_real_reqs: a.num_real_reqs.addr(),
        cache_index: st.cache_index.addr(),
        cache_policy: st.cache_policy.addr(),
        scratch_locs: st.scratch_locs.addr(),
        scratch_state: st.scratch_state.addr(),
        host_cache: kv.host[0],
        device_buffer: kv.device[0],
        plan_src,
        plan_dst,
        plan_count,
        error,
        items: kv.layout,
        host_rows: kv.host_rows,
        device_rows: kv.device_rows,
        top_k_stride: a.top_k_stride as u64,
        tokens_stride: a.tokens_stride as u64,
        locs_stride: a.locs_stride as u64,
        host_stride: a.host_stride as u64,
        out_stride: a.out_stride as u64,
        plan_stride: plan_stride as u64,
        index_stride: st.index_stride as u64,
        bank_stride: st.bank_stride as u64,
        hash_size: st.hash_size as u64,
        policy_stride: st.policy_stride as u64,
        scratch_stride: st.scratch_stride as u64,
        scratch_capacity: st.scratch_capacity as u64,
        state_stride: st.state_stride as u64,
        batch: batch as u32,
        steps: s,
        top_k: k,
        hot,
        page,
        num_requests: a.num_requests,
        max_tokens: a.max_tokens,
        flags,
    })
}

/// The kernel parameters a speculative swap-in of host buffers launches with,
/// for tests that run the kernel's own source on the host
/// (tests/kernel_emulation.rs): the same checks and parameters as a launch.
#[doc(hidden)]
pub fn emulation_spec_params(
    a: &SpecSwapInArgs<'_>,
    error: u64,
) -> Result<kvt_spec_swap_in_params> {
    check(a, Location::Host, error)
}

// ---- SGLang's hashes and packings ------------------------------------------

/// The scratch union table's home position of `token` (`size` entries).
fn union_slot(token: i32, size: usize) -> usize {
    let h = (token as u32).wrapping_mul(KNUTH);
    if size.is_power_of_two() {
        (h & (size as u32 - 1)) as usize
    } else {
        (h % size as u32) as usize
    }
}

fn ring_primary(token: i32, size: usize) -> usize {
    ((token as u32).wrapping_mul(KNUTH) & (size as u32 - 1)) as usize
}

fn ring_secondary(token: i32, size: usize) -> usize {
    let mut h = token as u32;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7FEB_352D);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846C_A68B);
    h ^= h >> 16;
    (h & (size as u32 - 1)) as usize
}

fn entry(token: i32, slot: i32) -> i64 {
    (((slot as u32 as u64) << 32) | token as u32 as u64) as i64
}

fn entry_token(e: i64) -> i32 {
    e as u32 as i32
}

fn entry_slot(e: i64) -> i32 {
    ((e as u64) >> 32) as i32
}

/// SGLang's packed CLOCK word: an epoch above a cursor of
/// `ceil(log2(hot))` bits.
#[derive(Clone, Copy)]
struct Clock {
    cursor_bits: u32,
    epoch_mask: u32,
    hot: u32,
}

impl Clock {
    fn new(hot: usize) -> Self {
        let cursor_bits = (hot as u32).next_power_of_two().trailing_zeros();
        let epoch_bits = (32 - cursor_bits).min(23);
        Clock {
            cursor_bits,
            epoch_mask: (1u32 << epoch_bits) - 1,
            hot: hot as u32,
        }
    }

    fn next_epoch(&self, packed: i32) -> i32 {
        let e = ((packed as u32 >> self.cursor_bits).wrapping_add(1) & self.epoch_mask) as i32;
        if e == 0 { 1 } else { e }
    }

    fn cursor(&self, packed: i32) -> usize {
        ((packed as u32 & ((1u32 << self.cursor_bits) - 1)) % self.hot) as usize
    }

    fn pack(&self, epoch: i32, cursor: usize) -> i32 {
        ((epoch as u32) << self.cursor_bits | (cursor as u32 & ((1u32 << self.cursor_bits) - 1)))
            as i32
    }
}

/// A request's miss table (its row of `scratch_state`): `t` int64 entries
/// `epoch << 32 | token`, `t` int64 entries `epoch << 32 | value` (the
/// miss's ordinal, then for a miss copied straight into a slot its row), and
/// `t` int32 positions (the m-th miss's table position, and SGLang's
/// admission flags). int64s as pairs of int32, low word first.
struct MissTable<'a> {
    row: &'a mut [i32],
    t: usize,
    epoch: u32,
}

impl MissTable<'_> {
    fn get(&self, at: usize) -> u64 {
        (self.row[2 * at] as u32 as u64) | ((self.row[2 * at + 1] as u32 as u64) << 32)
    }

    fn set(&mut self, at: usize, v: u64) {
        self.row[2 * at] = v as u32 as i32;
        self.row[2 * at + 1] = (v >> 32) as u32 as i32;
    }

    fn tagged(&self, v: u32) -> u64 {
        ((self.epoch as u64) << 32) | v as u64
    }

    fn token_at(&self, pos: usize) -> i32 {
        self.get(pos) as u32 as i32
    }

    fn value(&self, pos: usize) -> u32 {
        self.get(self.t + pos) as u32
    }

    fn set_value(&mut self, pos: usize, v: u32) {
        let tagged = self.tagged(v);
        self.set(self.t + pos, tagged);
    }

    fn compact(&self, m: usize) -> i32 {
        self.row[4 * self.t + m]
    }

    fn compact_mut(&mut self, m: usize) -> &mut i32 {
        &mut self.row[4 * self.t + m]
    }

    /// Empties the cells that already carry this call's epoch: the state may
    /// hold them (a wrapped epoch, or a state written by someone else), and
    /// their values would be trusted as this call's miss ordinals.
    fn clear_foreign(&mut self) {
        for pos in 0..self.t {
            if (self.get(pos) >> 32) as u32 == self.epoch {
                self.set(pos, 0);
            }
        }
    }

    /// The ordinal of `token`'s miss and whether this call claimed it, or
    /// None when the table is full (it never is: a row has `t` occurrences).
    fn claim(&mut self, token: i32, next: &mut usize) -> Option<(usize, bool)> {
        let mut pos = union_slot(token, self.t);
        for _ in 0..self.t {
            let e = self.get(pos);
            if (e >> 32) as u32 != self.epoch {
                self.set(pos, self.tagged(token as u32));
                let m = *next;
                *next += 1;
                self.set_value(pos, m as u32);
                *self.compact_mut(m) = pos as i32;
                return Some((m, true));
            }
            if e as u32 as i32 == token {
                return Some((self.value(pos) as usize, false));
            }
            pos = (pos + 1) % self.t;
        }
        None
    }

    /// The ordinal of `token`'s miss in this call, if it is one.
    fn find(&self, token: i32) -> Option<usize> {
        let mut pos = union_slot(token, self.t);
        for _ in 0..self.t {
            let e = self.get(pos);
            if (e >> 32) as u32 != self.epoch {
                return None;
            }
            if e as u32 as i32 == token {
                return Some(self.value(pos) as usize);
            }
            pos = (pos + 1) % self.t;
        }
        None
    }
}

/// One request's hot buffer: its slots, CLOCK epochs and hash banks.
struct Hot<'a> {
    tokens: &'a mut [i32],
    locs: &'a mut [i32],
    refs: &'a mut [i32],
    primary: &'a mut [i64],
    secondary: &'a mut [i64],
    hot: usize,
    degraded: bool,
}

impl Hot<'_> {
    fn holds(&self, slot: i32, token: i32) -> bool {
        slot >= 0 && (slot as usize) < self.hot && self.tokens[slot as usize] == token
    }

    /// The hot slot holding `token`, SGLang's lookup order.
    fn lookup(&self, token: i32) -> Option<usize> {
        if token < 0 {
            return None;
        }
        if (token as usize) < self.hot && self.tokens[token as usize] == token {
            return Some(token as usize);
        }
        let n = self.primary.len();
        for e in [
            self.primary[ring_primary(token, n)],
            self.secondary[ring_secondary(token, n)],
        ] {
            if e >= 0 && entry_token(e) == token && self.holds(entry_slot(e), token) {
                return Some(entry_slot(e) as usize);
            }
        }
        if self.degraded {
            return self.tokens[..self.hot].iter().position(|&x| x == token);
        }
        None
    }

    fn erase(&mut self, token: i32, slot: usize) {
        if token < 0 {
            return;
        }
        let (e, n) = (entry(token, slot as i32), self.primary.len());
        let p = ring_primary(token, n);
        if self.primary[p] == e {
            self.primary[p] = HASH_DELETED;
            return;
        }
        let s = ring_secondary(token, n);
        if self.secondary[s] == e {
            self.secondary[s] = HASH_DELETED;
        }
    }

    /// Whether entry `e` names a slot that holds its token.
    fn live(&self, e: i64) -> bool {
        e >= 0 && self.holds(entry_slot(e), entry_token(e))
    }

    /// Cuckoo insertion (64 kicks); false when it gave up. A stale entry
    /// (its slot no longer holds its token) is taken over or dropped when
    /// met; a live one is carried on, never lost.
    fn insert(&mut self, token: i32, slot: usize) -> bool {
        let n = self.primary.len();
        let packed = entry(token, slot as i32);
        let (p, s) = (ring_primary(token, n), ring_secondary(token, n));
        for second in [false, true] {
            let old = if second {
                self.secondary[s]
            } else {
                self.primary[p]
            };
            if old < 0 || !self.live(old) {
                if second {
                    self.secondary[s] = packed;
                } else {
                    self.primary[p] = packed;
                }
                return true;
            }
        }
        let (mut current, mut use_secondary) = (packed, false);
        for _ in 0..CUCKOO_KICKS {
            let tok = entry_token(current);
            let (bank, at) = if use_secondary {
                (&mut *self.secondary, ring_secondary(tok, n))
            } else {
                (&mut *self.primary, ring_primary(tok, n))
            };
            let displaced = std::mem::replace(&mut bank[at], current);
            if displaced < 0 || !self.live(displaced) {
                return true;
            }
            current = displaced;
            use_secondary = !use_secondary;
        }
        false
    }
}

fn read_index((addr, is_i64): (u64, bool), i: usize) -> i64 {
    // SAFETY (callers): `addr` holds at least i + 1 elements of its type,
    // as `check` established.
    unsafe {
        if is_i64 {
            *(addr as *const i64).add(i)
        } else {
            *(addr as *const i32).add(i) as i64
        }
    }
}

fn in_rows(row: i64, rows: u64) -> bool {
    row >= 0 && (row as u64) < rows
}

/// What one commit-round thread of SGLang's works on.
#[derive(Clone, Copy, Default)]
struct Admission {
    token: i32,
    miss: usize,
    pos: usize,
    direct: bool,
    rotate: bool,
    victim: Option<usize>,
    /// It took its victim's slot (and enters the hash after the round's erases).
    placed: bool,
}

/// A caller's miss plan: src, dst and count rows, and the row stride.
type Plan<'a> = (&'a mut [i64], &'a mut [i32], &'a mut [i32], usize);

/// One speculative swap-in on the CPU.
///
/// # Safety
/// Every address in `p` is host memory matching the shapes in `p`, as
/// [`check`] establishes for host buffers.
pub(super) unsafe fn run(p: &kvt_spec_swap_in_params) -> ErrorWord {
    let p = &SpecParams::of(p);
    let mut err = ErrorWord::clear();
    let (batch, steps, k, hot) = (p.batch, p.steps, p.top_k, p.hot);
    let t = steps * k;
    if batch == 0 {
        return err;
    }
    let given = unsafe { *(p.num_real_reqs as *const i32) } as i64;
    if given < 0 {
        err.report(KVT_ERR_SWAP_NUM_REAL, 0, given);
    }
    let num_real = given.clamp(0, batch as i64) as usize;
    let clock = Clock::new(hot);
    let r = p.requests;
    // SAFETY: shapes checked, per this function's contract; the buffers are
    // pairwise disjoint where one is written.
    let (topk, out, hloc, counters) = unsafe {
        (
            from_raw_parts(p.top_k_tokens as *const i32, span(batch, p.top_k_stride, t)),
            from_raw_parts_mut(p.out as *mut i32, span(batch, p.out_stride, t)),
            from_raw_parts(
                p.host_cache_locs as *const i64,
                span(r, p.host_stride, p.max_tokens as usize),
            ),
            from_raw_parts_mut(p.scratch_state as *mut i32, 4 * r),
        )
    };
    let mut plan: Option<Plan<'_>> = p.plan.map(|(src, dst, count, stride)| unsafe {
        let rows = span(batch, stride, t);
        (
            from_raw_parts_mut(src as *mut i64, rows),
            from_raw_parts_mut(dst as *mut i32, rows),
            from_raw_parts_mut(count as *mut i32, batch),
            stride,
        )
    });
    for b in 0..batch {
        let position = (b as u32) << 16;
        let out_row = &mut out[b * p.out_stride..][..t];
        if b >= num_real {
            out_row.fill(0);
            if let Some((_, _, count, _)) = plan.as_mut() {
                count[b] = 0;
            }
            continue;
        }
        let refuse = |out_row: &mut [i32], plan: &mut Option<Plan<'_>>| {
            out_row.fill(-1);
            if let Some((_, _, count, _)) = plan {
                count[b] = 0;
            }
        };
        let rid = read_index(p.req_pool_indices, b);
        if rid < 0 || rid >= r as i64 {
            err.report(KVT_ERR_SWAP_REQ, position, rid);
            refuse(out_row, &mut plan);
            continue;
        }
        if (0..b).any(|e| read_index(p.req_pool_indices, e) == rid) {
            err.report(KVT_ERR_SWAP_DUP_REQ, position, rid);
            refuse(out_row, &mut plan);
            continue;
        }
        if let Some(bad) = (0..steps)
            .map(|s| read_index(p.seq_lens, b * steps + s))
            .find(|&n| n < 0 || n > p.max_tokens)
        {
            err.report(KVT_ERR_SWAP_SEQ_LEN, position, bad);
            refuse(out_row, &mut plan);
            continue;
        }
        let rid = rid as usize;
        let slots = hot + p.page;
        // SAFETY: the request's rows, inside the checked spans; distinct
        // buffers (checked disjoint), so no two slices alias.
        let mut h = unsafe {
            let banks = p.cache_index as *mut i64;
            Hot {
                tokens: from_raw_parts_mut(
                    (p.tokens as *mut i32).add(rid * p.tokens_stride),
                    slots,
                ),
                locs: from_raw_parts_mut((p.locs as *mut i32).add(rid * p.locs_stride), slots),
                refs: from_raw_parts_mut(
                    (p.cache_policy as *mut i32).add((1 + rid) * p.policy_stride),
                    hot,
                ),
                primary: from_raw_parts_mut(banks.add(rid * p.index_stride), p.hash_size),
                secondary: from_raw_parts_mut(
                    banks.add(rid * p.index_stride + p.bank_stride),
                    p.hash_size,
                ),
                hot,
                degraded: false,
            }
        };
        let (ring, scratch, meta) = unsafe {
            (
                &mut *(p.cache_policy as *mut i32).add(rid),
                from_raw_parts_mut(
                    (p.scratch_locs as *mut i32).add(rid * p.scratch_stride),
                    p.scratch_capacity,
                ),
                from_raw_parts_mut(
                    (p.scratch_state as *mut i32).add((1 + rid) * p.state_stride),
                    5 * t,
                ),
            )
        };
        let generation = counters[3 * r + rid] as u32;
        h.degraded = generation & HASH_DEGRADED != 0;
        let mut scratch_epoch = (generation & SCRATCH_EPOCH_MASK) + 1;
        if scratch_epoch > SCRATCH_EPOCH_MASK {
            scratch_epoch = 1;
        }
        let epoch = clock.next_epoch(*ring);
        let cursor = clock.cursor(*ring);
        let mut table = MissTable {
            row: meta,
            t,
            epoch: scratch_epoch,
        };
        table.clear_foreign();
        let tokens_row = &topk[b * p.top_k_stride..][..t];
        let hloc_row = &hloc[rid * p.host_stride..][..p.max_tokens as usize];
        let cap = p.scratch_capacity;
        let (mut misses, mut union_hits, mut copies) = (0usize, 0usize, 0usize);
        let record = |plan: &mut Option<Plan<'_>>, src: i64, dst: i32, copies: &mut usize| {
            if let Some((s, d, _, stride)) = plan {
                s[b * *stride + *copies] = src;
                d[b * *stride + *copies] = dst;
            }
            *copies += 1;
        };
        let copy = |src: i64, dst: i32| unsafe {
            // SAFETY: both rows checked in range by the caller.
            copy_planes(p.host, p.device, &p.layout, src as u64, dst as u64)
        };

        // 1. Resolve every occurrence; copy each unique miss once into scratch.
        for (occ, &token) in tokens_row.iter().enumerate() {
            let seq = read_index(p.seq_lens, b * steps + occ / k);
            let col = position | occ as u32;
            out_row[occ] = -1;
            if token == -1 {
                continue;
            }
            if token < -1 || token as i64 >= seq {
                err.report(KVT_ERR_SWAP_TOKEN, col, token as i64);
                continue;
            }
            // a verify-step token on the extra page: no host I/O
            if token as i64 >= seq - p.page as i64
                && let Some(slot) = (hot..slots).find(|&s| h.tokens[s] == token)
                && h.locs[slot] >= 0
            {
                let loc = h.locs[slot];
                if in_rows(loc as i64, p.device_rows) {
                    out_row[occ] = loc;
                } else {
                    err.report(KVT_ERR_SWAP_DEVICE_LOC, col, loc as i64);
                }
                continue;
            }
            if let Some(slot) = h.lookup(token) {
                let loc = h.locs[slot];
                if in_rows(loc as i64, p.device_rows) {
                    out_row[occ] = loc;
                } else {
                    err.report(KVT_ERR_SWAP_DEVICE_LOC, col, loc as i64);
                }
                if h.refs[slot] != epoch {
                    h.refs[slot] = epoch;
                    union_hits += 1;
                }
                continue;
            }
            let src = hloc_row[token as usize];
            if src < 0 {
                continue; // SGLang's "no host copy": nothing to load
            }
            if !in_rows(src, p.host_rows) {
                err.report(KVT_ERR_SWAP_HOST_LOC, col, src);
                continue;
            }
            let Some((m, claimed)) = table.claim(token, &mut misses) else {
                continue;
            };
            if m >= cap {
                out_row[occ] = OVERFLOW_TAG - m as i32;
                continue;
            }
            let loc = scratch[m];
            if !in_rows(loc as i64, p.device_rows) {
                err.report(KVT_ERR_SWAP_DEVICE_LOC, col, loc as i64);
                continue;
            }
            if claimed {
                copy(src, loc);
                record(&mut plan, src, loc, &mut copies);
            }
            out_row[occ] = loc;
        }

        // 2. The CLOCK: admit misses into the hot buffer.
        let overflow = misses > cap;
        let union_clock = misses + union_hits <= hot;
        let budget = if union_clock {
            0
        } else if overflow {
            hot.saturating_sub(union_hits + (misses - cap))
        } else {
            hot
        };
        if !union_clock {
            // Approximate: keep the last step's working set.
            if !overflow {
                h.refs.fill(0);
            }
            let last = (steps - 1) * k;
            let seq = read_index(p.seq_lens, b * steps + steps - 1);
            let mut admitted = 0usize;
            for &token in &tokens_row[last..] {
                if token < 0 || token as i64 >= seq {
                    continue;
                }
                if let Some(slot) = h.lookup(token) {
                    h.refs[slot] = epoch;
                    continue;
                }
                if let Some(m) = table.find(token).filter(|&m| m < cap) {
                    let c = table.compact(m);
                    if c & COMPACT_CLAIM == 0 {
                        *table.compact_mut(m) |= COMPACT_CLAIM;
                        if admitted < budget {
                            *table.compact_mut(m) |= COMPACT_ADMIT;
                        }
                        admitted += 1;
                    }
                }
            }
        }
        let mut round = [Admission::default(); COMMIT_ROUND];
        for start in (0..misses).step_by(COMMIT_ROUND) {
            let n = (misses - start).min(COMMIT_ROUND);
            for (i, a) in round[..n].iter_mut().enumerate() {
                let m = start + i;
                let c = table.compact(m);
                let pos = (c & COMPACT_HASH_MASK) as usize;
                let direct = overflow && m >= cap;
                let admit = !union_clock && c & COMPACT_ADMIT != 0;
                *a = Admission {
                    token: table.token_at(pos),
                    miss: m,
                    pos,
                    direct,
                    rotate: m < cap && (union_clock || admit),
                    victim: None,
                    placed: false,
                };
                if !(a.direct || a.rotate) {
                    continue;
                }
                if union_clock {
                    // sample this miss's partition of the ring, oldest epoch first
                    let part = (hot - 1 - m) / misses + 1;
                    let samples = part.min(CLOCK_VICTIM_SAMPLES as usize);
                    let mut oldest = 0u32;
                    for sample in 0..samples {
                        let linear = m + sample * part / samples * misses;
                        let cand = (cursor + linear) % hot;
                        let seen = h.refs[cand];
                        if seen == epoch {
                            continue;
                        }
                        let age = (epoch as u32).wrapping_sub(seen as u32) & clock.epoch_mask;
                        if a.victim.is_none() || age > oldest {
                            a.victim = Some(cand);
                            oldest = age;
                        }
                    }
                    if let Some(v) = a.victim {
                        h.refs[v] = epoch;
                    }
                } else {
                    let (count, ordinal) = if direct {
                        (misses - cap, m - cap)
                    } else {
                        (misses, m)
                    };
                    let mut linear = ordinal;
                    while linear < hot {
                        let cand = ((linear as u32)
                            .wrapping_mul(KNUTH)
                            .wrapping_add(epoch as u32)
                            % hot as u32) as usize;
                        if h.refs[cand] != epoch {
                            h.refs[cand] = epoch;
                            a.victim = Some(cand);
                            break;
                        }
                        linear += count;
                    }
                }
            }
            // the rare fallback: probe the whole ring
            for (i, a) in round[..n].iter_mut().enumerate() {
                if !(a.direct || a.rotate) || a.victim.is_some() {
                    continue;
                }
                let begin = (cursor as u32).wrapping_add(((start + i) as u32).wrapping_mul(KNUTH))
                    % hot as u32;
                for attempt in 0..hot as u32 {
                    let cand =
                        (begin.wrapping_add(attempt.wrapping_mul(KNUTH)) % hot as u32) as usize;
                    if h.refs[cand] != epoch {
                        h.refs[cand] = epoch;
                        a.victim = Some(cand);
                        break;
                    }
                }
            }
            for a in round[..n].iter_mut() {
                if !(a.direct || a.rotate) {
                    continue;
                }
                let Some(victim) = a.victim else {
                    table.set_value(a.pos, u32::MAX);
                    continue;
                };
                let old_loc = h.locs[victim];
                let new_loc = if a.direct { old_loc } else { scratch[a.miss] };
                if !in_rows(old_loc as i64, p.device_rows) {
                    err.report(
                        KVT_ERR_SWAP_SLOT_LOC,
                        position | victim as u32,
                        old_loc as i64,
                    );
                }
                if !in_rows(old_loc as i64, p.device_rows)
                    || !in_rows(new_loc as i64, p.device_rows)
                {
                    if a.direct {
                        table.set_value(a.pos, u32::MAX);
                    }
                    continue;
                }
                let old_token = h.tokens[victim];
                h.tokens[victim] = a.token;
                h.refs[victim] = epoch;
                if a.rotate {
                    h.locs[victim] = new_loc;
                    scratch[a.miss] = old_loc;
                } else {
                    let src = hloc_row[a.token as usize];
                    copy(src, old_loc);
                    record(&mut plan, src, old_loc, &mut copies);
                    table.set_value(a.pos, old_loc as u32);
                }
                h.erase(old_token, victim);
                a.placed = true;
            }
            // every erase and slot change of the round before any insertion
            // (as the kernel does, a barrier apart)
            for a in round[..n].iter().filter(|a| a.placed) {
                let victim = a.victim.expect("placed");
                if !h.insert(a.token, victim) {
                    h.degraded = true;
                }
            }
        }
        // 3. The overflowing misses' outputs, now that their rows are known.
        if overflow {
            for (occ, o) in out_row.iter_mut().enumerate() {
                if *o > OVERFLOW_TAG {
                    continue;
                }
                let m = (OVERFLOW_TAG - *o) as usize;
                let pos = (table.compact(m) & COMPACT_HASH_MASK) as usize;
                let v = table.value(pos);
                *o = if v == u32::MAX { -1 } else { v as i32 };
                if v == u32::MAX {
                    // more misses than scratch and victims together
                    err.report(
                        KVT_ERR_SWAP_DEVICE_LOC,
                        position | occ as u32,
                        tokens_row[occ] as i64,
                    );
                }
            }
        }
        counters[rid] = misses as i32;
        counters[r + rid] = 0;
        counters[2 * r + rid] = 0;
        counters[3 * r + rid] = (scratch_epoch | if h.degraded { HASH_DEGRADED } else { 0 }) as i32;
        let next = if misses > 0 {
            (cursor + misses.min(hot)) % hot
        } else {
            cursor
        };
        *ring = clock.pack(epoch, next);
        if let Some((_, _, count, _)) = plan.as_mut() {
            count[b] = copies as i32;
        }
    }
    err
}
