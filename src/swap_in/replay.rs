//! Replaying a recorded miss plan (SGLang's `copy_cache_planned_mla`, for
//! shared-index layers that reuse an anchor layer's selection): the arguments,
//! their checks, and the kernel parameters (the copy kernel's, with
//! `KVT_SWAP_REPLAY`).

use super::args::{ByteRanges, check_stride};
use super::items::{self, KvBuffers};
use super::{MAX_BATCH, SwapInTarget, span};
use crate::abi::{KVT_SWAP_REPLAY, KVT_SWAP_SKIP_IO, kvt_swap_in_params};
use crate::copy_method::CopyMethod;
use crate::error::{Result, invalid};
use crate::mem::Buf;

/// A miss plan to replay: row `b` (below `num_real_reqs[0]`) copies
/// `count[b]` host rows `src[b][m]` to device rows `dst[b][m]` of every KV
/// plane. Whoever recorded it (kvtier's swap-in or SGLang's kernel), every
/// count and row is checked before it is followed.
#[derive(Debug)]
pub struct PlannedCopyArgs<'a> {
    /// `[rows][stride]` int64: host row per miss.
    pub src: Buf<'a, i64>,
    /// `[rows][stride]` int32: device row per miss.
    pub dst: Buf<'a, i32>,
    /// `[rows]` int32: misses per row, at most `capacity`.
    pub count: Buf<'a, i32>,
    /// Elements between rows of `src` and `dst`.
    pub stride: usize,
    /// Misses a row holds (the plan tensors' columns, at most `stride`).
    pub capacity: usize,
    /// `[1]` int32 on the executor's side: rows at or past it are not
    /// replayed. None: every row.
    pub num_real_reqs: Option<Buf<'a, i32>>,
    pub kv: KvBuffers<'a>,
    /// Walk the plan, move no bytes (SGLang's timing probe).
    pub skip_io: bool,
}

/// Checks every argument and builds the parameters of the copy kernel of
/// `copy`'s method.
pub(super) fn check(
    t: &SwapInTarget,
    a: &PlannedCopyArgs<'_>,
    copy: CopyMethod,
) -> Result<kvt_swap_in_params> {
    let rows = a.count.len();
    if rows > MAX_BATCH as usize {
        return Err(invalid(
            "miss_count",
            format!("a plan of {rows} rows exceeds {MAX_BATCH}; split it"),
        ));
    }
    if a.capacity > u32::MAX as usize {
        return Err(invalid(
            "miss_src",
            format!("{} columns exceed the 32-bit range", a.capacity),
        ));
    }
    check_stride("miss_src stride", a.stride, a.capacity)?;
    let want = t.location;
    let cells = span(rows, a.stride, a.capacity);
    let mut ranges = ByteRanges::new();
    ranges.checked("miss_src", &a.src, want, cells, false)?;
    ranges.checked("miss_dst", &a.dst, want, cells, false)?;
    ranges.checked("miss_count", &a.count, want, rows, false)?;
    let num_real = match &a.num_real_reqs {
        Some(n) => {
            n.check("num_real_reqs", want, 1)?;
            n.addr()
        }
        None => 0,
    };
    let kv = items::check(&a.kv, want)?;
    ranges.push_kv(&a.kv, a.num_real_reqs.as_ref());
    ranges.check_disjoint()?;
    let mut flags = KVT_SWAP_REPLAY | copy.swap_in_flags();
    if a.skip_io {
        flags |= KVT_SWAP_SKIP_IO;
    }
    // A replay reads only the plan, num_real_reqs, the planes and the error word.
    Ok(kvt_swap_in_params {
        num_real_reqs: num_real,
        host_cache: kv.host,
        device_buffer: kv.device,
        plan_src: a.src.addr(),
        plan_dst: a.dst.addr(),
        plan_count: a.count.addr(),
        error: t.error,
        items: kv.layout,
        host_rows: kv.host_rows,
        device_rows: kv.device_rows,
        plan_stride: a.stride as u64,
        batch: rows as u32,
        block_tokens: 1,
        plan_capacity: a.capacity as u32,
        flags,
        ..Default::default()
    })
}
