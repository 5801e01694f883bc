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

mod cpu;

pub(super) use cpu::run;

use super::args::{ByteRanges, IndexBuf, MissPlan, Named, check_stride, within};
use super::items::{self, KvBuffers};
use super::{MAX_BATCH, span};
use crate::abi::{KVT_SWAP_REQ_INDICES_I64, KVT_SWAP_SEQ_LENS_I64, kvt_spec_swap_in_params};
use crate::error::{Result, invalid};
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
    let mut ranges = ByteRanges::new();
    for (name, buf, len, written) in [
        (
            "top_k_tokens",
            &a.top_k_tokens as &dyn Named,
            span(batch, a.top_k_stride, t),
            false,
        ),
        (
            "top_k_device_locs",
            &a.top_k_device_locs,
            span(batch, a.out_stride, t),
            true,
        ),
        (
            "device_buffer_tokens",
            &a.device_buffer_tokens,
            span(r, a.tokens_stride, slots),
            true,
        ),
        (
            "device_buffer_locs",
            &a.device_buffer_locs,
            span(r, a.locs_stride, slots),
            true,
        ),
        (
            "host_cache_locs",
            &a.host_cache_locs,
            span(r, a.host_stride, a.max_tokens as usize),
            false,
        ),
        ("req_pool_indices", &a.req_pool_indices, batch, false),
        ("seq_lens", &a.seq_lens, batch * s as usize, false),
        ("cache_index", &st.cache_index, index_len, true),
        ("cache_policy", &st.cache_policy, policy_len, true),
        ("scratch_locs", &st.scratch_locs, scratch_len, true),
        ("scratch_state", &st.scratch_state, state_len, true),
    ] {
        ranges.checked(name, buf, want, len, written)?;
    }
    a.num_real_reqs.check("num_real_reqs", want, 1)?;
    if state_len > 0 && !st.scratch_state.addr().is_multiple_of(8) {
        return Err(invalid(
            "scratch_state",
            "is not 8-byte aligned; its rows are read as int64 pairs",
        ));
    }
    let kv = items::check(&a.kv, want)?;
    ranges.push_kv(&a.kv, Some(&a.num_real_reqs));
    let plan = match &a.miss_plan {
        Some(m) => {
            m.check(&mut ranges, want, batch, t, "occurrence")?;
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
