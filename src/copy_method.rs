//! How a kernel's warp moves one entry between the host-mapped pool and HBM:
//! the gather's, the writeback's and the swap-in's miss copy.
//! Every method moves the same bytes; they differ in how the loads over the
//! host link are shaped, which only a GPU can time (`kvtier bench` times each
//! beside the link's contiguous copy). The CPU executor has one way.

use crate::abi::{KVT_COPY_LINE_ALIGNED, KVT_SWAP_COPY_LINES};

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
}

impl CopyMethod {
    /// Every method, for the benchmark and the tests.
    pub const ALL: [CopyMethod; 2] = [CopyMethod::WarpVectors, CopyMethod::LineAligned];

    /// The method [`crate::Tier::gather`] uses for entries of `entry_bytes`:
    /// `LineAligned` where an entry is not whole 128-byte lines (656-byte fp8
    /// DSA, 584-byte V4 C4), `WarpVectors` where it is (512, 1152), as the
    /// GPU runs measured. On an H100 (2026-11-27, 656-byte entries, 131072
    /// tokens of context) the line-aligned gather was faster at 8 of 12 grid
    /// points with the samples' quartile ranges apart (0.79-0.87 of the
    /// link's contiguous copy against 0.77-0.82), level at the other 4,
    /// slower at none; at 1152 bytes the two were level at every point. The
    /// writeback stays `WarpVectors`: its line-aligned method was level with
    /// it at every point of the same run.
    pub fn for_gather(entry_bytes: u32) -> CopyMethod {
        if entry_bytes.is_multiple_of(128) {
            CopyMethod::WarpVectors
        } else {
            CopyMethod::LineAligned
        }
    }

    /// The kernels' flag for the method.
    pub(crate) fn flags(self) -> u32 {
        match self {
            CopyMethod::WarpVectors => 0,
            CopyMethod::LineAligned => KVT_COPY_LINE_ALIGNED,
        }
    }

    /// The swap-in parameters' flag for the method (`kvt_swap_in_params`
    /// keeps its own flag set; the launcher picks the copy kernel by it).
    pub(crate) fn swap_in_flags(self) -> u32 {
        match self {
            CopyMethod::WarpVectors => 0,
            CopyMethod::LineAligned => KVT_SWAP_COPY_LINES,
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
