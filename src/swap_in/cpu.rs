//! The CPU executor: the reference of `kvt_swap_in_plan` +
//! `kvt_swap_in_copy` (same outputs, same state, same device buffer, same
//! miss plan, same error word), interpreting the same kernel parameters.

use std::slice::{from_raw_parts, from_raw_parts_mut};

use super::counters::{self, SwapInCounters};
use super::items::{copy_row, layout_of};
use super::policy::{Row, in_rows};
use super::{QueryKind, span};
use crate::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_DUP_REQ, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_NUM_REAL,
    KVT_ERR_SWAP_PLAN_COUNT, KVT_ERR_SWAP_REQ, KVT_ERR_SWAP_SEQ_LEN, KVT_SWAP_QUERY_BLOCKS,
    KVT_SWAP_REQ_INDICES_I64, KVT_SWAP_SEQ_LENS_I64, KVT_SWAP_SKIP_IO, kvt_swap_in_params,
};
use crate::error_word::ErrorWord;

/// Element `i` of an int32 or int64 (`is_i64`) index array at `addr`.
///
/// # Safety
/// `addr` holds at least `i + 1` elements of its type.
pub(super) unsafe fn read_index((addr, is_i64): (u64, bool), i: usize) -> i64 {
    // SAFETY: per this function's contract.
    unsafe {
        if is_i64 {
            *(addr as *const i64).add(i)
        } else {
            *(addr as *const i32).add(i) as i64
        }
    }
}

/// Rows below `num_real_reqs[0]` (at `num_real_reqs`; 0: none given),
/// clamped to the batch (a value above it makes every row real), reporting a
/// negative value when `report` is set.
///
/// # Safety
/// `num_real_reqs` is 0 or one readable int32.
pub(super) unsafe fn real_rows(
    num_real_reqs: u64,
    batch: usize,
    err: &mut ErrorWord,
    report: bool,
) -> usize {
    if num_real_reqs == 0 {
        return batch;
    }
    // SAFETY: per this function's contract.
    let given = unsafe { *(num_real_reqs as *const i32) } as i64;
    if report && given < 0 {
        err.report(KVT_ERR_SWAP_NUM_REAL, 0, given);
    }
    given.clamp(0, batch as i64) as usize
}

/// One swap-in, counted into `p.counters` when set (as the kernels count).
///
/// # Safety
/// Every address in `p` must be host memory matching the shapes in `p`, as
/// the argument checks establish for host buffers; `p.counters` is 0 or an
/// entry of the CPU executor's counter table.
pub(super) unsafe fn run(p: &kvt_swap_in_params) -> ErrorWord {
    let mut counted = SwapInCounters::default();
    // SAFETY: per this function's contract.
    let err = unsafe { run_counted(p, &mut counted) };
    if p.batch > 0 {
        // nothing is launched, so nothing counted, for an empty batch
        counted.calls = 1;
        counted.bad_indices = err.0.count as u64;
        // SAFETY: per this function's contract.
        unsafe { counters::add_cpu(p.counters, &counted) };
    }
    err
}

/// [`run`]'s body: the call's rows, hits, misses and bytes into `counted`.
///
/// # Safety
/// As for [`run`].
unsafe fn run_counted(p: &kvt_swap_in_params, counted: &mut SwapInCounters) -> ErrorWord {
    let mut err = ErrorWord::clear();
    let (batch, k, entries, hot) = (
        p.batch as usize,
        p.top_k as usize,
        p.entries as usize,
        p.hot as usize,
    );
    let r = p.num_requests as usize;
    if batch == 0 {
        return err;
    }
    // SAFETY: shapes checked, per this function's contract.
    let (topk, out, btok, bloc, lru, hloc) = unsafe {
        (
            from_raw_parts(
                p.top_k_tokens as *const i32,
                span(batch, p.top_k_stride as usize, k),
            ),
            from_raw_parts_mut(
                p.top_k_device_locs as *mut i32,
                span(batch, p.out_stride as usize, entries),
            ),
            from_raw_parts_mut(
                p.device_buffer_tokens as *mut i32,
                span(r, p.tokens_stride as usize, hot),
            ),
            from_raw_parts(
                p.device_buffer_locs as *const i32,
                span(r, p.locs_stride as usize, hot + 1),
            ),
            from_raw_parts_mut(p.lru_slots as *mut i16, span(r, p.lru_stride as usize, hot)),
            from_raw_parts(
                p.host_cache_locs as *const i64,
                span(r, p.host_stride as usize, p.max_tokens as usize),
            ),
        )
    };
    // SAFETY: `row` < batch, the checked length of these arrays.
    let index = |base: u64, row: usize, is_i64: bool| unsafe { read_index((base, is_i64), row) };
    let kind = if p.flags & KVT_SWAP_QUERY_BLOCKS != 0 {
        QueryKind::Blocks {
            block_tokens: p.block_tokens,
        }
    } else {
        QueryKind::Tokens
    };
    let skip_io = p.flags & KVT_SWAP_SKIP_IO != 0;
    let layout = layout_of(&p.items);
    // The miss plan, where one is recorded (the caller's; the CPU executor
    // has no scratch).
    let plan_stride = p.plan_stride as usize;
    // SAFETY: the caller's plan buffers were checked against the batch.
    let mut miss_plan = (p.plan_count != 0).then(|| unsafe {
        (
            from_raw_parts_mut(
                p.plan_src as *mut i64,
                span(batch, plan_stride, p.plan_capacity as usize),
            ),
            from_raw_parts_mut(
                p.plan_dst as *mut i32,
                span(batch, plan_stride, p.plan_capacity as usize),
            ),
            from_raw_parts_mut(p.plan_count as *mut i32, batch),
        )
    });
    // SAFETY: num_real_reqs was checked to hold one element.
    let num_real = unsafe { real_rows(p.num_real_reqs, p.batch as usize, &mut err, true) };
    counted.rows = num_real as u64;

    for b in 0..batch {
        let position = (b as u32) << 16;
        let out_row = &mut out[b * p.out_stride as usize..][..entries];
        if b >= num_real {
            // padding: outputs -1; state and the plan row's count as they were
            out_row.fill(-1);
            continue;
        }
        let mut record = |misses: &[(i64, i32)]| {
            if let Some((src, dst, count)) = miss_plan.as_mut() {
                for (m, &(h, d)) in misses.iter().enumerate() {
                    src[b * plan_stride + m] = h;
                    dst[b * plan_stride + m] = d;
                }
                count[b] = misses.len() as i32;
            }
        };
        let rid = index(
            p.req_pool_indices,
            b,
            p.flags & KVT_SWAP_REQ_INDICES_I64 != 0,
        );
        if rid < 0 || rid >= r as i64 {
            err.report(KVT_ERR_SWAP_REQ, position, rid);
            out_row.fill(-1);
            record(&[]);
            continue;
        }
        // a request an earlier row names: its state is that row's to change
        let flag = p.flags & KVT_SWAP_REQ_INDICES_I64 != 0;
        if (0..b).any(|e| index(p.req_pool_indices, e, flag) == rid) {
            err.report(KVT_ERR_SWAP_DUP_REQ, position, rid);
            out_row.fill(-1);
            record(&[]);
            continue;
        }
        let seq = index(p.seq_lens, b, p.flags & KVT_SWAP_SEQ_LENS_I64 != 0);
        if seq < 0 || seq > p.max_tokens as i64 {
            err.report(KVT_ERR_SWAP_SEQ_LEN, position, seq);
            out_row.fill(-1);
            record(&[]);
            continue;
        }
        let rid = rid as usize;
        let mut row = Row {
            query: &topk[b * p.top_k_stride as usize..][..k],
            kind,
            entries,
            seq,
            hot,
            tokens: &mut btok[rid * p.tokens_stride as usize..][..hot],
            locs: &bloc[rid * p.locs_stride as usize..][..hot + 1],
            lru: &mut lru[rid * p.lru_stride as usize..][..hot],
            host_locs: &hloc[rid * p.host_stride as usize..][..p.max_tokens as usize],
            host_rows: p.host_rows,
            device_rows: p.device_rows,
            position,
        };
        if seq <= hot as i64 {
            row.short(out_row, &mut err);
            record(&[]);
            continue;
        }
        let (misses, hits) = row.long(out_row, &mut err);
        record(&misses);
        counted.hits += hits as u64;
        counted.misses += misses.len() as u64;
        if !skip_io {
            counted.bytes += misses.len() as u64 * p.miss_bytes as u64;
            for &(h, d) in &misses {
                // SAFETY: the policy loads only host rows < host_rows into
                // device rows < device_rows. Distinct slots of a request have
                // distinct rows, or the caller accepts the race the kernel
                // leaves.
                unsafe { copy_row(p, &layout, h as u64, d as u64) };
            }
        }
    }
    err
}

/// Replays a caller's miss plan (`kvt_swap_in_copy` with KVT_SWAP_REPLAY):
/// the copies of rows below `num_real_reqs`, each count and row checked.
///
/// # Safety
/// As for [`run`], for the plan, `num_real_reqs` and the KV planes.
pub(super) unsafe fn replay(p: &kvt_swap_in_params) -> ErrorWord {
    let mut err = ErrorWord::clear();
    let (batch, stride, cap) = (
        p.batch as usize,
        p.plan_stride as usize,
        p.plan_capacity as usize,
    );
    if batch == 0 {
        return err; // nothing is launched for an empty plan
    }
    // SAFETY: num_real_reqs was checked to hold one element.
    let num_real = unsafe { real_rows(p.num_real_reqs, p.batch as usize, &mut err, true) };
    if p.flags & KVT_SWAP_SKIP_IO != 0 {
        return err;
    }
    // SAFETY: the plan buffers were checked against batch × capacity.
    let (src, dst, count) = unsafe {
        (
            from_raw_parts(p.plan_src as *const i64, span(batch, stride, cap)),
            from_raw_parts(p.plan_dst as *const i32, span(batch, stride, cap)),
            from_raw_parts(p.plan_count as *const i32, batch),
        )
    };
    let layout = layout_of(&p.items);
    for (b, &c) in count.iter().enumerate().take(num_real) {
        let position = (b as u32) << 16;
        if c < 0 || c as usize > cap {
            err.report(KVT_ERR_SWAP_PLAN_COUNT, position, c as i64);
            continue;
        }
        for m in 0..c as usize {
            let (h, d) = (src[b * stride + m], dst[b * stride + m] as i64);
            if !in_rows(h, p.host_rows) {
                err.report(KVT_ERR_SWAP_HOST_LOC, position | m as u32, h);
            } else if !in_rows(d, p.device_rows) {
                err.report(KVT_ERR_SWAP_DEVICE_LOC, position | m as u32, d);
            } else {
                // SAFETY: both rows were just checked.
                unsafe { copy_row(p, &layout, h as u64, d as u64) };
            }
        }
    }
    err
}
