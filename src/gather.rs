//! Top-k sparse gather: for one layer and a whole batch, copy the entries the
//! indexer selected from the pool into a contiguous `[batch, k, entry_bytes]`
//! buffer. This module checks the arguments, builds `kvt_gather_params`, and
//! runs it on either executor: the CPU reference below, or `kvt_gather` in
//! `kernels/gather.cu`. Both follow the contract in `kernels/abi.h`.

use crate::abi::{
    KVT_COPY_BULK_RUNS, KVT_COPY_LINE_ALIGNED, KVT_COPY_MERGED_RUNS, KVT_COPY_RUN_ROWS,
    KVT_ERR_GATHER_INDEX, KVT_ERR_GATHER_SEQ_LEN, KVT_ERR_GATHER_SLOT, kvt_gather_params,
};
use crate::copy_method::CopyMethod;
use crate::cuda::{BLOCK_THREADS, CudaDevice, Kernel, Stream};
use crate::error::{Result, invalid};
use crate::error_word::ErrorWord;
use crate::mem::{Buf, BufMut};
use crate::slots::{TierTables, bound_base};

/// Largest batch one gather accepts (error positions keep the row in 16 bits).
pub const MAX_BATCH: usize = 65_535;
/// Largest k one gather accepts (error positions keep the column in 16 bits).
pub const MAX_K: u32 = 65_536;

/// The per-step, per-layer inputs of a gather: which slot each batch row's
/// request is bound to, how many tokens each holds, and the top-k indices.
#[derive(Clone, Copy, Debug)]
pub struct GatherBatch<'a> {
    /// `[batch]` int32: the slot of each row's request (see
    /// [`crate::Tier::bind_slot`]); -1 marks a padding row (zero-filled).
    pub req_slots: Buf<'a, i32>,
    /// `[batch]` int32: tokens stored for each row's request; valid indices
    /// are `0..seq_lens[row]`.
    pub seq_lens: Buf<'a, i32>,
    /// `[batch][topk_stride]` int32: token indices; -1 is padding.
    pub topk: Buf<'a, i32>,
    /// Indices read per row (the output holds `k` entries per row).
    pub k: u32,
    /// Elements between consecutive rows of `topk` (>= k).
    pub topk_stride: u32,
}

impl<'a> GatherBatch<'a> {
    /// A batch whose `topk` rows are packed (`topk_stride == k`).
    pub fn new(
        req_slots: Buf<'a, i32>,
        seq_lens: Buf<'a, i32>,
        topk: Buf<'a, i32>,
        k: u32,
    ) -> Self {
        GatherBatch {
            req_slots,
            seq_lens,
            topk,
            k,
            topk_stride: k,
        }
    }

    /// Rows in the batch.
    pub fn batch(&self) -> usize {
        self.req_slots.len()
    }
}

/// Checks every argument and builds the kernel parameters.
pub(crate) fn plan(
    t: &TierTables,
    layer: u32,
    batch: &GatherBatch<'_>,
    out: &BufMut<'_, u8>,
    method: CopyMethod,
) -> Result<kvt_gather_params> {
    let n = batch.batch();
    let k = batch.k;
    let entry = t.layout.entry_bytes();
    let layer_offset = t.layout.layer_offset(layer)?;
    if n > MAX_BATCH {
        return Err(invalid(
            "req_slots",
            format!("batch of {n} rows exceeds {MAX_BATCH}; split it"),
        ));
    }
    if k > MAX_K {
        return Err(invalid("k", format!("{k} exceeds {MAX_K}")));
    }
    if batch.topk_stride < k {
        return Err(invalid(
            "topk_stride",
            format!("{} is less than k = {k}", batch.topk_stride),
        ));
    }
    let topk_len = if n == 0 || k == 0 {
        0
    } else {
        (n - 1) * batch.topk_stride as usize + k as usize
    };
    let out_len = n * k as usize * entry as usize;
    let want = t.location;
    batch.req_slots.check("req_slots", want, n)?;
    batch.seq_lens.check("seq_lens", want, n)?;
    batch.topk.check("topk", want, topk_len)?;
    out.check_aligned("out", want, 8, out_len)?;
    Ok(kvt_gather_params {
        slot_bases: t.slot_bases,
        req_slots: batch.req_slots.addr(),
        seq_lens: batch.seq_lens.addr(),
        topk: batch.topk.addr(),
        out: out.addr(),
        error: t.error,
        layer_offset,
        entry_bytes: entry,
        tokens_per_region: t.layout.tokens_per_region(),
        num_slots: t.num_slots,
        batch: n as u32,
        k,
        topk_stride: batch.topk_stride,
        flags: method.flags(),
    })
}

/// Where row `b`, column `j` comes from: `Ok(Some(address))`, `Ok(None)` for
/// padding (zero-filled, not reported), or `Err((kind, value))` for a refused
/// entry (zero-filled and reported). Mirrors the checks in `kvt_gather`.
fn source(
    p: &kvt_gather_params,
    slot_bases: &[u64],
    req_slots: &[i32],
    seq_lens: &[i32],
    topk: &[i32],
    b: usize,
    j: usize,
) -> Result<Option<u64>, (u32, i64)> {
    let slot = req_slots[b];
    if slot == -1 {
        return Ok(None);
    }
    let Some(base) = bound_base(slot_bases, slot) else {
        return Err((KVT_ERR_GATHER_SLOT, slot as i64));
    };
    let seq_len = seq_lens[b];
    if seq_len < 0 || seq_len as u32 > p.tokens_per_region {
        return Err((KVT_ERR_GATHER_SEQ_LEN, seq_len as i64));
    }
    let token = topk[b * p.topk_stride as usize + j];
    if token == -1 {
        return Ok(None);
    }
    if token < -1 || token >= seq_len {
        return Err((KVT_ERR_GATHER_INDEX, token as i64));
    }
    Ok(Some(
        base + p.layer_offset + token as u64 * p.entry_bytes as u64,
    ))
}

/// The CPU reference of `kvt_gather`: same outputs, same error word.
///
/// # Safety
/// Every address in `p` must be host memory matching the shapes in `p` (as
/// [`plan`] checks for host buffers), and every non-zero slot base must be a
/// region of `p`'s layout inside a live mapping.
pub(crate) unsafe fn run_cpu(p: &kvt_gather_params) -> ErrorWord {
    let mut err = ErrorWord::clear();
    let (n, k, entry) = (p.batch as usize, p.k as usize, p.entry_bytes as usize);
    if n == 0 || k == 0 {
        return err;
    }
    // SAFETY: shapes checked by `plan`, per this function's contract.
    let (slot_bases, req_slots, seq_lens, topk, out) = unsafe {
        (
            std::slice::from_raw_parts(p.slot_bases as *const u64, p.num_slots as usize),
            std::slice::from_raw_parts(p.req_slots as *const i32, n),
            std::slice::from_raw_parts(p.seq_lens as *const i32, n),
            std::slice::from_raw_parts(p.topk as *const i32, (n - 1) * p.topk_stride as usize + k),
            std::slice::from_raw_parts_mut(p.out as *mut u8, n * k * entry),
        )
    };
    for b in 0..n {
        for j in 0..k {
            let row = &mut out[(b * k + j) * entry..][..entry];
            match source(p, slot_bases, req_slots, seq_lens, topk, b, j) {
                Ok(Some(src)) => {
                    // SAFETY: `src` was built from a bound region base and a
                    // token index checked against seq_len <= tokens_per_region.
                    unsafe { std::ptr::copy(src as *const u8, row.as_mut_ptr(), entry) }
                }
                Ok(None) => row.fill(0),
                Err((kind, value)) => {
                    row.fill(0);
                    err.report(kind, ((b as u32) << 16) | j as u32, value);
                }
            }
        }
    }
    err
}

/// Enqueues `kvt_gather` on `stream`: the kernel of the call's copy method,
/// `BulkRuns` where the GPU has the bulk engine and a block's stages fit its
/// shared memory, `MergedRuns` where not.
///
/// # Safety
/// `p` must come from [`plan`] for device buffers and a slot table of `dev`,
/// and those buffers must stay valid until the kernel completes.
pub(crate) unsafe fn launch(dev: &CudaDevice, p: &kvt_gather_params, stream: Stream) -> Result<()> {
    let rows = p.batch as u64 * p.k as u64;
    if rows == 0 {
        return Ok(());
    }
    // The copy method is a kernel of its own (kernels/gather.cu).
    // A warp of the merged-runs kernel takes a group of KVT_COPY_RUN_ROWS rows.
    // The bulk kernel where the engine can take the whole call's rows (its
    // groups of misaligned regions move as merged runs inside it); the
    // merged-runs kernel where it cannot, or the GPU has no engine.
    let groups = p.batch as u64 * p.k.div_ceil(KVT_COPY_RUN_ROWS) as u64;
    if p.flags & KVT_COPY_BULK_RUNS != 0
        && (p.entry_bytes | p.out as u32 | p.layer_offset as u32) & 15 == 0
    {
        let warps_per_block = Kernel::GatherBulkRuns.block_threads() / 32;
        let smem = CopyMethod::bulk_smem_bytes(p.entry_bytes, warps_per_block);
        // SAFETY: per this function's contract; the kernel carves `smem`.
        if let Some(r) = unsafe { dev.launch_bulk(Kernel::GatherBulkRuns, groups, smem, p, stream) }
        {
            return r;
        }
    }
    let (kernel, warps) = if p.flags & (KVT_COPY_MERGED_RUNS | KVT_COPY_BULK_RUNS) != 0 {
        (Kernel::GatherMergedRuns, groups)
    } else if p.flags & KVT_COPY_LINE_ALIGNED != 0 {
        (Kernel::GatherLineAligned, rows)
    } else {
        (Kernel::Gather, rows)
    };
    let grid = dev.grid_for_rows(kernel, warps);
    // SAFETY: per this function's contract.
    unsafe { dev.launch(kernel, grid, BLOCK_THREADS, 0, p, stream) }
}
