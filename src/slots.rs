//! The slot table both mechanisms read: the base address of the region bound
//! to each request slot (0 = unbound), as the executor addresses it.

use crate::layout::LayerFirstLayout;
use crate::mem::Location;

/// What a gather or writeback plan needs from its tier: the layout, where
/// argument buffers must live, and the addresses of the slot table and of the
/// error word (0 for the CPU executor, which reports through its return value).
pub(crate) struct TierTables {
    pub layout: LayerFirstLayout,
    pub location: Location,
    pub slot_bases: u64,
    pub num_slots: u32,
    pub error: u64,
}

/// The region base bound to `slot`, or `None` when the slot is outside the
/// table or unbound. The kernels make the same check before any pool access.
pub(crate) fn bound_base(slot_bases: &[u64], slot: i32) -> Option<u64> {
    usize::try_from(slot)
        .ok()
        .and_then(|s| slot_bases.get(s))
        .copied()
        .filter(|&b| b != 0)
}
