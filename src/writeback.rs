//! Layer-first writeback: copy new KV entries from device KV buffers into the
//! pool, `pool[request][layer][token]`. One layer for many tokens (prefill
//! streams layers while the next one computes), or every layer for the newest
//! token of each request (decode), each in one launch. This module checks the
//! arguments, builds `kvt_writeback_params`, and runs it on either executor:
//! the CPU reference below, or `kvt_writeback` in `kernels/writeback.cu`.

use crate::abi::{
    KVT_COPY_BULK_RUNS, KVT_COPY_LINE_ALIGNED, KVT_COPY_MERGED_RUNS, KVT_COPY_RUN_ROWS,
    KVT_ERR_WRITEBACK_SLOT, KVT_ERR_WRITEBACK_SRC_ROW, KVT_ERR_WRITEBACK_TOKEN,
    kvt_writeback_params,
};
use crate::copy_method::CopyMethod;
use crate::cuda::{BLOCK_THREADS, CudaDevice, Kernel, Stream};
use crate::error::{Result, invalid};
use crate::error_word::ErrorWord;
use crate::mem::Buf;
use crate::slots::{TierTables, bound_base};

/// What to write back: item `i` copies source row `src_rows[i]` to token
/// `tokens[i]` of the region bound to slot `slots[i]`.
#[derive(Clone, Copy, Debug)]
pub struct WritebackItems<'a> {
    /// `[n]` int32: destination slot; -1 skips the item (padding).
    pub slots: Buf<'a, i32>,
    /// `[n]` int32: destination token position.
    pub tokens: Buf<'a, i32>,
    /// `[n]` int64: row of the source KV buffer (e.g. SGLang's `out_cache_loc`).
    pub src_rows: Buf<'a, i64>,
}

impl WritebackItems<'_> {
    /// Items in the list.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when there are no items.
    pub fn is_empty(&self) -> bool {
        self.slots.len() == 0
    }
}

/// The source of a writeback: one layer's buffer, or a table of every
/// layer's buffer.
pub(crate) enum WritebackSource {
    /// One buffer of `rows` rows at `base`.
    Layer { base: u64, rows: u64 },
    /// A table (at `table`) of `layers` buffer addresses, `rows` rows each.
    AllLayers { table: u64, layers: u32, rows: u64 },
}

/// Checks every argument and builds the kernel parameters.
pub(crate) fn plan(
    t: &TierTables,
    first_layer: u32,
    items: &WritebackItems<'_>,
    src: WritebackSource,
    method: CopyMethod,
) -> Result<kvt_writeback_params> {
    let n = items.len();
    let want = t.location;
    if n > u32::MAX as usize {
        return Err(invalid(
            "slots",
            format!("{n} items exceed 2^32 - 1; split the call"),
        ));
    }
    items.slots.check_aligned("slots", want, 4, n)?;
    items.tokens.check_aligned("tokens", want, 4, n)?;
    items.src_rows.check_aligned("src_rows", want, 8, n)?;
    let (src_base, src_layer_bases, num_layers, src_rows) = match src {
        WritebackSource::Layer { base, rows } => (base, 0, 1, rows),
        WritebackSource::AllLayers {
            table,
            layers,
            rows,
        } => (0, table, layers, rows),
    };
    if first_layer as u64 + num_layers as u64 > t.layout.layers() as u64 {
        return Err(invalid(
            "layer",
            format!(
                "layers {first_layer}..{} run past the layout's {} layers",
                first_layer as u64 + num_layers as u64,
                t.layout.layers()
            ),
        ));
    }
    Ok(kvt_writeback_params {
        slot_bases: t.slot_bases,
        item_slots: items.slots.addr(),
        item_tokens: items.tokens.addr(),
        item_src_rows: items.src_rows.addr(),
        src_base,
        src_layer_bases,
        error: t.error,
        src_rows,
        layer_bytes: t.layout.layer_bytes(),
        entry_bytes: t.layout.entry_bytes(),
        tokens_per_region: t.layout.tokens_per_region(),
        num_slots: t.num_slots,
        num_items: n as u32,
        first_layer,
        num_layers,
        flags: method.flags(),
    })
}

/// Destination address of item `i` in layer `layer_i` of the launch, or the
/// refused entry's (kind, value); `Ok(None)` skips a padding item. Mirrors the
/// checks in `kvt_writeback`.
fn destination(
    p: &kvt_writeback_params,
    slot_bases: &[u64],
    slots: &[i32],
    tokens: &[i32],
    src_rows: &[i64],
    i: usize,
    layer_i: u32,
) -> Result<Option<(u64, u64)>, (u32, i64)> {
    let slot = slots[i];
    if slot == -1 {
        return Ok(None);
    }
    let Some(base) = bound_base(slot_bases, slot) else {
        return Err((KVT_ERR_WRITEBACK_SLOT, slot as i64));
    };
    let token = tokens[i];
    if token < 0 || token as u32 >= p.tokens_per_region {
        return Err((KVT_ERR_WRITEBACK_TOKEN, token as i64));
    }
    let row = src_rows[i];
    if row < 0 || row as u64 >= p.src_rows {
        return Err((KVT_ERR_WRITEBACK_SRC_ROW, row));
    }
    let dst = base
        + (p.first_layer + layer_i) as u64 * p.layer_bytes
        + token as u64 * p.entry_bytes as u64;
    Ok(Some((dst, row as u64 * p.entry_bytes as u64)))
}

/// The CPU reference of `kvt_writeback`: same pool contents, same error word.
/// Items run in order, so of two items with one destination the later wins
/// (the kernel leaves that race unspecified).
///
/// # Safety
/// Every address in `p` must be host memory matching the shapes in `p` (as
/// [`plan`] checks for host buffers); the source buffers (or the layer table
/// and every buffer it names) must hold `src_rows` rows; every non-zero slot
/// base must be a region of `p`'s layout inside a live mapping.
pub(crate) unsafe fn run_cpu(p: &kvt_writeback_params) -> ErrorWord {
    let mut err = ErrorWord::clear();
    let n = p.num_items as usize;
    if n == 0 {
        return err;
    }
    // SAFETY: shapes checked by `plan`, per this function's contract.
    let (slot_bases, slots, tokens, src_rows) = unsafe {
        (
            std::slice::from_raw_parts(p.slot_bases as *const u64, p.num_slots as usize),
            std::slice::from_raw_parts(p.item_slots as *const i32, n),
            std::slice::from_raw_parts(p.item_tokens as *const i32, n),
            std::slice::from_raw_parts(p.item_src_rows as *const i64, n),
        )
    };
    for layer_i in 0..p.num_layers {
        let src_buf = if p.src_layer_bases != 0 {
            // SAFETY: the table holds num_layers entries.
            unsafe { *(p.src_layer_bases as *const u64).add(layer_i as usize) }
        } else {
            p.src_base
        };
        for i in 0..n {
            match destination(p, slot_bases, slots, tokens, src_rows, i, layer_i) {
                Ok(Some((dst, src_off))) => {
                    // SAFETY: dst is inside a bound region (slot, layer and
                    // token checked); src_off is a checked row of the source.
                    // (memmove: a caller may point the source into the pool.)
                    unsafe {
                        std::ptr::copy(
                            (src_buf + src_off) as *const u8,
                            dst as *mut u8,
                            p.entry_bytes as usize,
                        )
                    }
                }
                Ok(None) => {}
                Err((kind, value)) => err.report(kind, i as u32, value),
            }
        }
    }
    err
}

/// Enqueues `kvt_writeback` on `stream`.
///
/// # Safety
/// `p` must come from [`plan`] for device buffers and a slot table of `dev`,
/// and those buffers must stay valid until the kernel completes.
pub(crate) unsafe fn launch(
    dev: &CudaDevice,
    p: &kvt_writeback_params,
    stream: Stream,
) -> Result<()> {
    let rows = p.num_layers as u64 * p.num_items as u64;
    if rows == 0 {
        return Ok(());
    }
    // The copy method is a kernel of its own (kernels/writeback.cu).
    // A warp of the merged-runs and bulk kernels takes a group of
    // KVT_COPY_RUN_ROWS rows.
    let groups = p.num_layers as u64 * p.num_items.div_ceil(KVT_COPY_RUN_ROWS) as u64;
    // The bulk kernel where the engine can take whole rows (its groups with
    // a misaligned row move as merged runs inside it); the merged-runs
    // kernel where it cannot, or the GPU has no engine.
    if p.flags & KVT_COPY_BULK_RUNS != 0 && p.entry_bytes.is_multiple_of(16) {
        let warps_per_block = Kernel::WritebackBulkRuns.block_threads() / 32;
        let smem = CopyMethod::bulk_smem_bytes(p.entry_bytes, warps_per_block);
        // SAFETY: per this function's contract; the kernel carves `smem`.
        if let Some(r) =
            unsafe { dev.launch_bulk(Kernel::WritebackBulkRuns, groups, smem, p, stream) }
        {
            return r;
        }
    }
    let (kernel, warps) = if p.flags & (KVT_COPY_MERGED_RUNS | KVT_COPY_BULK_RUNS) != 0 {
        (Kernel::WritebackMergedRuns, groups)
    } else if p.flags & KVT_COPY_LINE_ALIGNED != 0 {
        (Kernel::WritebackLineAligned, rows)
    } else {
        (Kernel::Writeback, rows)
    };
    let grid = dev.grid_for_rows(kernel, warps);
    // SAFETY: per this function's contract.
    unsafe { dev.launch(kernel, grid, BLOCK_THREADS, 0, p, stream) }
}
