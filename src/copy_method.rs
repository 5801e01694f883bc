//! How a kernel's warp moves one entry between the host-mapped pool and HBM.
//! Every method moves the same bytes; they differ in how the loads over the
//! host link are shaped, which only a GPU can time (`kvtier bench` times each
//! beside the link's contiguous copy). The CPU executor has one way.

use crate::abi::KVT_COPY_LINE_ALIGNED;

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
    /// aligned addresses move as `WarpVectors`. Not yet timed on a GPU.
    LineAligned,
}

impl CopyMethod {
    /// Every method, for the benchmark and the tests.
    pub const ALL: [CopyMethod; 2] = [CopyMethod::WarpVectors, CopyMethod::LineAligned];

    /// The kernels' flag for the method.
    pub(crate) fn flags(self) -> u32 {
        match self {
            CopyMethod::WarpVectors => 0,
            CopyMethod::LineAligned => KVT_COPY_LINE_ALIGNED,
        }
    }
}
