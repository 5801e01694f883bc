//! The CUDA executor's launches: `kvt_swap_in_plan` (or
//! `kvt_swap_in_few_miss_plan`, `kvt_swap_in_few_miss_512_plan` or
//! `kvt_swap_in_compact_plan`) then
//! `kvt_swap_in_copy` (or `kvt_swap_in_copy_line_aligned`, the copy method
//! `LineAligned`) for a swap-in (or `kvt_swap_in_few_miss_cluster_plan` alone,
//! in clusters), either copy kernel alone for a plan replay,
//! `kvt_spec_swap_in` for a speculative swap-in, on the caller's stream; and
//! the shared memory each needs.

use crate::abi::{
    KVT_SPEC_SMEM_BYTES, KVT_SPEC_THREADS, KVT_SWAP_CLUSTER, KVT_SWAP_CLUSTER_COPY,
    KVT_SWAP_CLUSTER_PLAN, KVT_SWAP_COMPACT_PLAN, KVT_SWAP_COMPACT_THREADS, KVT_SWAP_COPY_BULK,
    KVT_SWAP_COPY_IN_PLAN, KVT_SWAP_COPY_LINES, KVT_SWAP_FEW_MISS_512,
    KVT_SWAP_FEW_MISS_512_THREADS, KVT_SWAP_FEW_MISS_INLINE, KVT_SWAP_FEW_MISS_THREADS,
    KVT_SWAP_FIXED_SHAPE, KVT_SWAP_PLAN_THREADS, KVT_SWAP_SKIP_INLINE, KVT_SWAP_SKIP_IO,
    kvt_spec_swap_in_params, kvt_swap_in_params,
};
use crate::cuda::{BLOCK_THREADS, CudaDevice, Kernel, Stream};
use crate::error::{Result, invalid};

/// Bytes of dynamic shared memory `kvt_swap_in_plan` uses for rows of
/// `entries` entries (the carve-up of `PlanSmem` in kernels/swap_in.cu).
pub fn plan_smem_bytes(entries: u32, hot: u32) -> usize {
    let hash = (2 * entries as usize).next_power_of_two();
    let words = 4
        + 3 * KVT_SWAP_PLAN_THREADS as usize
        + 2 * hash
        + 2 * entries as usize
        + hot.div_ceil(32) as usize;
    words * 4 + 2 * (hot as usize + entries as usize)
}

/// Bytes of dynamic shared memory `kvt_swap_in_few_miss_plan` uses for rows
/// of `entries` entries over `hot` slots (the carve-up of `Smem` in
/// kernels/swap_in_few_miss.cu).
pub fn few_miss_smem_bytes(entries: u32, hot: u32) -> usize {
    few_miss_smem_of(entries, hot, KVT_SWAP_FEW_MISS_THREADS, 4)
}

/// Bytes of dynamic shared memory `kvt_swap_in_few_miss_512_plan` uses: the
/// few-miss planner's carve-up with 16 warps' totals and a hash table of two
/// cells per entry (93 KiB at top-k 2048 over 4096 slots, against 125 KiB).
pub fn few_miss_512_smem_bytes(entries: u32, hot: u32) -> usize {
    few_miss_smem_of(entries, hot, KVT_SWAP_FEW_MISS_512_THREADS, 2)
}

/// Bytes of dynamic shared memory each block of `kvt_swap_in_split_plan`
/// uses for rows of `entries` entries over `hot` slots (the carve-up of
/// `Smem` in kernels/swap_in_split.cu): the few-miss planner's state with
/// a copy list of a block's misses (up to a row's) and the cluster's
/// counts (149 KiB at top-k 2048 over 4096 slots, 190 KiB over 8192).
pub fn split_smem_bytes(entries: u32, hot: u32) -> usize {
    let (e, h) = (entries as usize, hot as usize);
    let hash = (4 * e).next_power_of_two();
    let warps = (KVT_SWAP_FEW_MISS_THREADS / 32) as usize;
    let xchg = KVT_SWAP_CLUSTER as usize * 5;
    let words = h + (h + 4) + e + xchg + 4 * warps + 4 + 2 * hash + 2 * e + h.div_ceil(32);
    8 * e + 4 * words + 2 * (h + e)
}

fn few_miss_smem_of(entries: u32, hot: u32, threads: u32, spread: usize) -> usize {
    let (e, h) = (entries as usize, hot as usize);
    let hash = (spread * e).next_power_of_two();
    let warps = (threads / 32) as usize;
    let inline = KVT_SWAP_FEW_MISS_INLINE as usize;
    let words = inline + 4 * warps + 4 + 2 * hash + h + (h + 1) + 2 * e + h.div_ceil(32);
    8 * inline + 4 * words + 2 * (h + e)
}

/// Bytes of dynamic shared memory `kvt_swap_in_compact_plan` uses for rows of
/// `entries` entries over `hot` slots (the carve-up of `Smem` in
/// kernels/swap_in_compact.cu).
pub fn compact_smem_bytes(entries: u32, hot: u32) -> usize {
    let (e, h) = (entries as usize, hot as usize);
    let hash = (2 * e).next_power_of_two();
    let warps = (KVT_SWAP_COMPACT_THREADS / 32) as usize;
    let inline = KVT_SWAP_FEW_MISS_INLINE as usize;
    // the copy list's host rows and the request; the copy list's device rows,
    // per-warp totals, flags, hash keys, entry tokens, the slot bitmap; hash
    // values, entry positions (even count), LRU order, its inverse, usable slots
    let eights = inline + 1;
    let words = inline + 4 * warps + 4 + hash + e + h.div_ceil(32);
    let halves = hash + e.next_multiple_of(2) + 2 * h + e;
    8 * eights + 4 * words + 2 * halves
}

/// Blocks of the compact planner (`SwapInStrategy::Compact`) an SM of `dev`
/// holds at once for rows of `entries` entries over `hot` slots, as the
/// driver reports it: the occupancy its design is for (two at top-k 2048
/// over 8192 slots on sm_80 and sm_90), checked by the GPU tests.
#[doc(hidden)]
pub fn compact_planner_blocks_per_sm(dev: &CudaDevice, entries: u32, hot: u32) -> Result<u32> {
    dev.resident_blocks(Kernel::SwapInCompactPlan, compact_smem_bytes(entries, hot))
}

/// Blocks of the 512-thread few-miss planner (`SwapInStrategy::FewMiss512`)
/// an SM of `dev` holds at once for rows of `entries` entries over `hot`
/// slots, as the driver reports it: two at top-k 2048 over 4096 slots on
/// sm_90, checked by the GPU tests.
#[doc(hidden)]
pub fn few_miss_512_blocks_per_sm(dev: &CudaDevice, entries: u32, hot: u32) -> Result<u32> {
    dev.resident_blocks(
        Kernel::SwapInFewMiss512Plan,
        few_miss_512_smem_bytes(entries, hot),
    )
}

/// The copy kernel of `p`'s copy method (`KVT_SWAP_COPY_BULK`: the bulk
/// one; `KVT_SWAP_COPY_LINES`: the line-aligned one).
fn copy_kernel(p: &kvt_swap_in_params) -> Kernel {
    if p.flags & KVT_SWAP_COPY_BULK != 0 {
        Kernel::SwapInCopyBulk
    } else if p.flags & KVT_SWAP_COPY_LINES != 0 {
        Kernel::SwapInCopyLineAligned
    } else {
        Kernel::SwapInCopy
    }
}

/// Bytes of dynamic shared memory `kvt_swap_in_copy` and its line-aligned
/// build use: the rows' prefix sums and a word a warp.
pub fn copy_smem_bytes(batch: u32) -> usize {
    4 * (batch as usize + 1 + (BLOCK_THREADS / 32) as usize)
}

/// Bytes of dynamic shared memory the copy kernel of `p`'s method uses:
/// [`copy_smem_bytes`], and for `kvt_swap_in_copy_bulk` (rounded up to 128
/// bytes) two barriers a warp, rounded up to 128 bytes, then two stages a
/// warp of one value piece a plane (`bulk_copy_at` and the kernel's carving
/// in `kernels/swap_in.cu`).
pub fn copy_smem_bytes_for(p: &kvt_swap_in_params) -> usize {
    let prefix = copy_smem_bytes(p.batch);
    if p.flags & KVT_SWAP_COPY_BULK == 0 {
        return prefix;
    }
    let warps = (BLOCK_THREADS / 32) as usize;
    let planes = if p.host_cache[1] != 0 { 2 } else { 1 };
    prefix.next_multiple_of(128)
        + (warps * 16).next_multiple_of(128)
        + warps * 2 * planes * p.items.value_bytes as usize
}

/// Whether the bulk-copy engine can move every miss of `p` whole (the
/// kernel's `bulk_rows`): rows of one value piece of whole 16-byte units,
/// pages and buffers 16-byte aligned.
fn bulk_rows(p: &kvt_swap_in_params) -> bool {
    let l = &p.items;
    let bases = p.host_cache[0] | p.device_buffer[0] | p.host_cache[1] | p.device_buffer[1];
    l.scale_bytes == 0
        && l.value_bytes.is_multiple_of(16)
        && l.page_bytes.is_multiple_of(16)
        && bases.is_multiple_of(16)
}

/// `p` as the copy kernel runs it on `dev`: with the bulk method only where
/// the GPU has the engine, the rows suit it and its stages fit a block's
/// shared memory; the line-aligned kernel otherwise.
fn copy_params(dev: &CudaDevice, p: &kvt_swap_in_params) -> kvt_swap_in_params {
    let mut q = *p;
    if q.flags & KVT_SWAP_COPY_BULK != 0
        && !(dev.bulk_copy() && bulk_rows(p) && copy_smem_bytes_for(p) <= dev.max_dynamic_smem())
    {
        q.flags &= !KVT_SWAP_COPY_BULK;
    }
    q
}

/// The 1024-thread few-miss planner's build for `p`, its copies moved as
/// `KVT_COPY_LINE_ALIGNED` where `lines`: with `KVT_SWAP_FIXED_SHAPE`, the
/// fixed-shape build of its shape where there is one
/// ([`super::FIXED_SHAPES`]), else the plain build.
fn few_miss_build(p: &kvt_swap_in_params, lines: bool) -> Kernel {
    // in the order of FIXED_SHAPES
    const BUILDS: [Kernel; super::FIXED_SHAPES.len()] = [
        Kernel::SwapInFewMissK2048H4096Plan,
        Kernel::SwapInFewMissK2048H8192Plan,
    ];
    const LINES_BUILDS: [Kernel; super::FIXED_SHAPES.len()] = [
        Kernel::SwapInFewMissK2048H4096LinesPlan,
        Kernel::SwapInFewMissK2048H8192LinesPlan,
    ];
    let (plain, fixed) = if lines {
        (Kernel::SwapInFewMissLinesPlan, LINES_BUILDS)
    } else {
        (Kernel::SwapInFewMissPlan, BUILDS)
    };
    if p.flags & KVT_SWAP_FIXED_SHAPE == 0 {
        return plain;
    }
    super::FIXED_SHAPES
        .iter()
        .position(|&shape| shape == (p.entries, p.hot))
        .map_or(plain, |i| fixed[i])
}

fn fits(dev: &CudaDevice, smem: usize, what: impl FnOnce() -> String) -> Result<()> {
    let max = dev.max_dynamic_smem();
    if smem > max {
        return Err(invalid(
            "num_top_k",
            format!(
                "{} needs {smem} B of shared memory per block; this GPU offers {max} B",
                what()
            ),
        ));
    }
    Ok(())
}

/// The plan kernel [`launch`] runs for `p`, its threads a block and its
/// dynamic shared memory a block: the compact or few-miss planner (and
/// which build of it) where the flags ask for it, else `kvt_swap_in_plan`.
/// Public (hidden from the API docs) so that the kernel emulator's tests
/// run the kernel a launch would, not a copy of this choice.
#[doc(hidden)]
pub fn plan_kernel(p: &kvt_swap_in_params) -> (Kernel, u32, usize) {
    // The argument checks asked for the few-miss planner only where its
    // state fits this GPU's shared memory. Copying every miss with the
    // line-aligned method, the 1024-thread few-miss planner's line-aligned
    // build (the 512-thread one has none: slower than the 1024-thread one
    // on an H100, not worth the library's size).
    let lines = p.flags & KVT_SWAP_COPY_IN_PLAN != 0 && p.flags & KVT_SWAP_COPY_LINES != 0;
    if p.flags & KVT_SWAP_FEW_MISS_512 != 0 {
        (
            Kernel::SwapInFewMiss512Plan,
            KVT_SWAP_FEW_MISS_512_THREADS,
            few_miss_512_smem_bytes(p.entries, p.hot),
        )
    } else if p.flags & KVT_SWAP_COMPACT_PLAN != 0 {
        (
            Kernel::SwapInCompactPlan,
            KVT_SWAP_COMPACT_THREADS,
            compact_smem_bytes(p.entries, p.hot),
        )
    } else if p.flags & KVT_SWAP_SKIP_INLINE != 0 {
        (
            few_miss_build(p, lines),
            KVT_SWAP_FEW_MISS_THREADS,
            few_miss_smem_bytes(p.entries, p.hot),
        )
    } else {
        (
            Kernel::SwapInPlan,
            KVT_SWAP_PLAN_THREADS,
            plan_smem_bytes(p.entries, p.hot),
        )
    }
}

/// Enqueues the swap-in on `stream`: the plan kernel (the compact planner
/// for `KVT_SWAP_COMPACT_PLAN`, else the few-miss planner for
/// `KVT_SWAP_SKIP_INLINE`), then, unless the plan kernel
/// copies every row itself or `skip_io`, the copy kernel, as its
/// programmatic dependent where `dependent` and the device allow it.
///
/// # Safety
/// `p` must come from the argument checks for device buffers and plan
/// scratch of `dev` sized for its batch and entries, valid until the kernels
/// complete.
pub(super) unsafe fn launch(
    dev: &CudaDevice,
    p: &kvt_swap_in_params,
    dependent: bool,
    stream: Stream,
) -> Result<()> {
    if p.batch == 0 {
        return Ok(());
    }
    let plain_few_miss = p.flags & KVT_SWAP_SKIP_INLINE != 0
        && p.flags & (KVT_SWAP_FEW_MISS_512 | KVT_SWAP_COMPACT_PLAN | KVT_SWAP_COPY_IN_PLAN) == 0;
    // The one-launch cluster builds of the plain few-miss planner (asked
    // for with its flags only; their misses move as warp vectors, so no
    // copy method's flags): the split planner (KVT_SWAP_CLUSTER_PLAN) and
    // the few-miss planner's cluster build (KVT_SWAP_CLUSTER_COPY). Each
    // runs where the GPU launches clusters and a block's state fits;
    // elsewhere its flag goes and the few-miss planner and the copy kernel
    // run (which refuse a state that does not fit).
    for (flag, kernel, smem) in [
        (
            KVT_SWAP_CLUSTER_PLAN,
            Kernel::SwapInSplitPlan,
            split_smem_bytes(p.entries, p.hot),
        ),
        (
            KVT_SWAP_CLUSTER_COPY,
            Kernel::SwapInFewMissClusterPlan,
            few_miss_smem_bytes(p.entries, p.hot),
        ),
    ] {
        if p.flags & flag == 0 {
            continue;
        }
        debug_assert_eq!(p.flags & (KVT_SWAP_COPY_LINES | KVT_SWAP_COPY_BULK), 0);
        if plain_few_miss && dev.cluster_launch() && smem <= dev.max_dynamic_smem() {
            // SAFETY: per this function's contract; both kernels are written
            // for clusters of KVT_SWAP_CLUSTER blocks, a cluster a row.
            return unsafe {
                dev.launch_clustered(
                    kernel,
                    (p.batch, KVT_SWAP_CLUSTER),
                    KVT_SWAP_FEW_MISS_THREADS,
                    smem as u32,
                    p,
                    stream,
                )
            };
        }
        let mut q = *p;
        q.flags &= !flag;
        // SAFETY: per this function's contract (the same call without the flag).
        return unsafe { launch(dev, &q, dependent, stream) };
    }
    let (kernel, threads, smem) = plan_kernel(p);
    fits(dev, smem.max(copy_smem_bytes(p.batch)), || {
        format!("{} entries with a hot buffer of {}", p.entries, p.hot)
    })?;
    // SAFETY: per this function's contract; grid = one block per row.
    unsafe { dev.launch(kernel, p.batch, threads, smem as u32, p, stream)? };
    if p.flags & (KVT_SWAP_COPY_IN_PLAN | KVT_SWAP_SKIP_IO) == 0 {
        let q = copy_params(dev, p);
        let copy = copy_kernel(&q);
        let grid = dev.grid_for_rows(copy, q.batch as u64 * q.entries as u64);
        let smem = copy_smem_bytes_for(&q) as u32;
        // SAFETY: the plan kernel was enqueued just before on the same
        // stream; the copy kernel waits for it (grid_dependency_wait), a
        // no-op after an ordinary launch.
        unsafe {
            if dependent {
                dev.launch_dependent(copy, grid, BLOCK_THREADS, smem, &q, stream)?
            } else {
                dev.launch(copy, grid, BLOCK_THREADS, smem, &q, stream)?
            }
        };
    }
    Ok(())
}

/// Enqueues a plan replay on `stream`: the copy kernel over the plan's rows,
/// on at most `warps` warps (None: enough for every planned miss, capped at
/// what is resident at once).
///
/// # Safety
/// `p` must come from the replay's argument checks for device buffers,
/// valid until the kernel completes.
pub(super) unsafe fn launch_replay(
    dev: &CudaDevice,
    p: &kvt_swap_in_params,
    warps: Option<u32>,
    stream: Stream,
) -> Result<()> {
    if p.batch == 0 {
        return Ok(());
    }
    let q = copy_params(dev, p);
    let smem = copy_smem_bytes_for(&q);
    fits(dev, smem, || format!("a plan of {} rows", q.batch))?;
    let copy = copy_kernel(&q);
    let mut grid = dev.grid_for_rows(copy, q.batch as u64 * q.plan_capacity as u64);
    if let Some(w) = warps {
        grid = grid.min(w.div_ceil(BLOCK_THREADS / 32).max(1));
    }
    // SAFETY: per this function's contract.
    unsafe { dev.launch(copy, grid, BLOCK_THREADS, smem as u32, &q, stream) }
}

/// Enqueues a speculative swap-in on `stream`: one block per batch row.
///
/// # Safety
/// `p` must come from the speculative swap-in's argument checks for device
/// buffers of `dev` (the host cache mapped for it), valid until the kernel
/// completes.
pub(super) unsafe fn launch_spec(
    dev: &CudaDevice,
    p: &kvt_spec_swap_in_params,
    stream: Stream,
) -> Result<()> {
    if p.batch == 0 {
        return Ok(());
    }
    // SAFETY: per this function's contract; grid = one block per row.
    unsafe {
        dev.launch(
            Kernel::SpecSwapIn,
            p.batch,
            KVT_SPEC_THREADS,
            KVT_SPEC_SMEM_BYTES,
            p,
            stream,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 512-thread few-miss planner's state at top-k 2048 over 4096 slots
    /// fits two blocks in an sm_90 SM (228 KiB of shared memory, 1 KiB
    /// reserved per block), not in an sm_80 one (164 KiB); over 8192 slots
    /// two fit neither; the figures the docs quote (93 and 133 KiB).
    #[test]
    fn the_512_thread_few_miss_planners_state_fits_two_blocks_at_hot_4096() {
        let (h4096, h8192) = (
            few_miss_512_smem_bytes(2048, 4096),
            few_miss_512_smem_bytes(2048, 8192),
        );
        assert!(2 * (h4096 + 1024) <= 228 * 1024, "{h4096} B");
        assert!(2 * (h4096 + 1024) > 164 * 1024, "{h4096} B");
        assert!(2 * (h8192 + 1024) > 228 * 1024, "{h8192} B");
        assert_eq!([h4096 / 1024, h8192 / 1024], [93, 133]);
        // 64 registers a thread: two blocks of 512 fill the 64K-register file
        assert_eq!(2 * KVT_SWAP_FEW_MISS_512_THREADS * 64, 65_536);
    }

    /// The compact planner's state at top-k 2048 over 8192 slots fits two
    /// blocks in an sm_80 SM (164 KiB of shared memory, 1 KiB of it reserved
    /// per block) and is below half of the few-miss planner's.
    #[test]
    fn the_compact_planners_state_fits_two_blocks_on_sm_80() {
        let compact = compact_smem_bytes(2048, 8192);
        assert!(2 * (compact + 1024) <= 164 * 1024, "{compact} B");
        assert!(2 * compact < few_miss_smem_bytes(2048, 8192), "{compact} B");
        // the figures the docs quote (57 and 74 KiB; 125 and 166 KiB)
        assert_eq!([compact_smem_bytes(2048, 4096), compact], [58_776, 75_672]);
        assert_eq!(
            [
                few_miss_smem_bytes(2048, 4096),
                few_miss_smem_bytes(2048, 8192)
            ],
            [128_404, 169_876]
        );
    }
}
