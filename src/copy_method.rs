//! How a kernel's warp moves one entry between the host-mapped pool and HBM:
//! the gather's, the writeback's and the swap-in's miss copy.
//! Every method moves the same bytes; they differ in how the loads over the
//! host link are shaped, which only a GPU can time (`kvtier bench` times each
//! beside the link's contiguous copy). The CPU executor has one way.

use crate::abi::{
    KVT_COPY_BULK_RUNS, KVT_COPY_LINE_ALIGNED, KVT_COPY_MERGED_RUNS, KVT_COPY_RUN_ROWS,
    KVT_SWAP_COPY_BULK, KVT_SWAP_COPY_LINES,
};

/// A warp's way of moving an entry (the `KVT_COPY_*` flags of the kernels).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyMethod {
    /// The warp's lanes load consecutive 16-byte vectors from the entry's
    /// first byte, several passes of 512 bytes in flight (the method every
    /// GPU figure so far measured).
    #[default]
    WarpVectors,
    /// The same accesses with each 512-byte pass aligned to 128-byte lines
    /// of the host address (the source of a gather, the destination of a
    /// writeback), so that no line is split between two instructions (a
    /// 656-byte entry, 5 lines and 16 bytes, otherwise shares a line between
    /// its two). Entries that are not whole 16-byte vectors at 16-byte
    /// aligned addresses move as `WarpVectors`.
    LineAligned,
    /// A warp takes [`CopyMethod::RUN_ROWS`] consecutive rows (of the
    /// gather: consecutive top-k columns of one batch row; of the writeback:
    /// consecutive items of one layer), checks each as the other methods do,
    /// and moves each maximal run of rows that is contiguous at both ends as
    /// one block with `LineAligned`'s line-aligned passes: in the gather,
    /// consecutive columns selecting tokens `t, t + 1, ...`; in the
    /// writeback, consecutive items of one slot with consecutive tokens and
    /// consecutive source rows. Inside a run every 128-byte line of the host
    /// address is whole and a pass carries up to 2 KiB of the run, where one
    /// 656-byte row a warp splits a line at both its ends and fills a third
    /// of a pass. A run not of whole 16-byte vectors at 16-byte aligned
    /// addresses (584-byte entries at every other token) moves as
    /// `LineAligned` moves such an entry. A row that continues no run moves
    /// as `LineAligned`; padding
    /// and refused rows of the gather are zero-filled (neighbours in one
    /// block). Runs never cross a group of `RUN_ROWS` rows. The swap-in has
    /// no kernel of this method; its copy kernel moves misses as
    /// `LineAligned` under it.
    MergedRuns,
    /// The groups and runs of `MergedRuns`, moved by the GPU's bulk-copy
    /// engine (`cp.async.bulk`, sm_90 and later) through the warp's shared
    /// memory instead of through its registers. In the gather each run of
    /// neighbours is one bulk load from the pool into a stage, where
    /// padding and refused rows are zero-filled, and each group of
    /// `RUN_ROWS` output rows one bulk store into HBM; in the writeback each
    /// run is one bulk load from HBM and one bulk store into the pool. Each
    /// warp has two stages, so one group's loads are in flight while the
    /// other's stores go out, with no registers held for the bytes; the
    /// engine's cost is per operation, so it can pay only where runs are
    /// long (selections with locality, a prefill written in order). Entries
    /// must be whole 16-byte units at 16-byte aligned addresses (656, 512,
    /// 1152 bytes in page-aligned pools); a group with a row that is not
    /// moves as `MergedRuns` (a call whose entries are not, or, in the
    /// gather, whose `out` or layer offset is not, runs the `MergedRuns`
    /// kernel), and so does every call on a GPU before sm_90 or whose
    /// blocks' stages ([`CopyMethod::bulk_smem_bytes`]: 16 entries a warp, 8
    /// warps) exceed a block's shared memory (entries above about 1.8 KiB
    /// on an H100).
    /// The swap-in's copy kernel moves each miss with it too (a bulk load a
    /// plane into the warp's shared memory, then a bulk store), where rows
    /// are one value piece of whole 16-byte units (DeepSeek's 656-byte MLA
    /// rows, MiniMax-M3's K and V; not V4's C4 rows, whose 8-byte scale
    /// pieces move as `LineAligned`), and the planners' own copies as
    /// `LineAligned`. No GPU has timed it yet, so the measured table never
    /// picks it.
    BulkRuns,
}

impl CopyMethod {
    /// Every method, for the benchmark and the tests.
    pub const ALL: [CopyMethod; 4] = [
        CopyMethod::WarpVectors,
        CopyMethod::LineAligned,
        CopyMethod::MergedRuns,
        CopyMethod::BulkRuns,
    ];

    /// Rows a warp of `MergedRuns` takes (`KVT_COPY_RUN_ROWS`). Eight: a
    /// group's rows are checked one a lane in one step; eight 656-byte rows
    /// (5248 bytes) fill two and a half passes of 2 KiB; and a gather of
    /// batch 16 at k = 2048 still makes 4096 groups, about one warp
    /// for each a whole H100 holds resident (132 SMs of 32 warps at 4 blocks
    /// of 256 threads), where 32 rows a warp would leave three quarters of
    /// them idle.
    pub const RUN_ROWS: u32 = KVT_COPY_RUN_ROWS;

    /// The method [`crate::Tier::gather`] uses for entries of `entry_bytes`:
    /// `LineAligned` where an entry is not whole 128-byte lines (656-byte fp8
    /// DSA, 584-byte V4 C4), `WarpVectors` where it is (512, 1152), as the
    /// GPU runs measured. On an H100 (2026-11-27, 656-byte entries, 131072
    /// tokens of context) the line-aligned gather was faster at 8 of 12 grid
    /// points with the samples' quartile ranges apart (0.79-0.87 of the
    /// link's contiguous copy against 0.77-0.82), level at the other 4,
    /// slower at none; at 1152 bytes the two were level at every point. The
    /// writeback stays `WarpVectors`: its line-aligned method was level with
    /// it at every point of the same run. This is the rule where the
    /// measured table ([`crate::CopyMethodTable`]) has no choice; the table
    /// takes `MergedRuns` where runs measured it faster.
    pub fn for_gather(entry_bytes: u32) -> CopyMethod {
        if entry_bytes.is_multiple_of(128) {
            CopyMethod::WarpVectors
        } else {
            CopyMethod::LineAligned
        }
    }

    /// Dynamic shared memory a block of the `BulkRuns` kernels takes for
    /// entries of `entry_bytes` and `warps` warps a block: two barriers a
    /// warp, rounded up to 128 bytes, then two stages of
    /// [`CopyMethod::RUN_ROWS`] entries a warp (what the kernels carve:
    /// `kvt::bulk_smem_bytes` in `kernels/bulk.cuh`; the emulator's test
    /// holds the two equal). A call whose blocks would need more than the
    /// GPU gives one runs as `MergedRuns`.
    pub fn bulk_smem_bytes(entry_bytes: u32, warps: u32) -> u64 {
        (warps as u64 * 16).next_multiple_of(128)
            + warps as u64 * 2 * KVT_COPY_RUN_ROWS as u64 * entry_bytes as u64
    }

    /// The kernels' flag for the method.
    pub(crate) fn flags(self) -> u32 {
        match self {
            CopyMethod::WarpVectors => 0,
            CopyMethod::LineAligned => KVT_COPY_LINE_ALIGNED,
            CopyMethod::MergedRuns => KVT_COPY_MERGED_RUNS,
            CopyMethod::BulkRuns => KVT_COPY_BULK_RUNS,
        }
    }

    /// The swap-in parameters' flag for the method (`kvt_swap_in_params`
    /// keeps its own flag set; the launcher picks the copy kernel by it).
    /// `MergedRuns` has no swap-in kernel: its misses move as its rows
    /// outside runs do, `LineAligned`. `BulkRuns` has a copy kernel
    /// (`kvt_swap_in_copy_bulk`); the planners' own copies under it are
    /// `LineAligned`.
    pub(crate) fn swap_in_flags(self) -> u32 {
        match self {
            CopyMethod::WarpVectors => 0,
            CopyMethod::LineAligned | CopyMethod::MergedRuns => KVT_SWAP_COPY_LINES,
            CopyMethod::BulkRuns => KVT_SWAP_COPY_LINES | KVT_SWAP_COPY_BULK,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CopyMethod;

    #[test]
    fn the_gather_aligns_to_lines_where_entries_split_them() {
        for (bytes, method) in [
            (656, CopyMethod::LineAligned),
            (584, CopyMethod::LineAligned),
            (576, CopyMethod::LineAligned),
            (512, CopyMethod::WarpVectors),
            (1152, CopyMethod::WarpVectors),
            (128, CopyMethod::WarpVectors),
        ] {
            assert_eq!(CopyMethod::for_gather(bytes), method, "{bytes} B");
        }
    }
}
