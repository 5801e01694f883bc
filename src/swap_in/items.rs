//! The KV rows a swap-in moves: one or two planes (MLA's latent cache, or
//! MHA's K and V), each a host cache and a device buffer, addressed with one
//! [`ItemLayout`]; their checks, and the CPU executor's row copy.

use crate::abi::{kvt_item_layout, kvt_swap_in_params};
use crate::error::{Result, invalid};
use crate::layout::ItemLayout;
use crate::mem::{Buf, BufMut, Location};

/// One plane of KV rows: where they live on the host (the pool; host-mapped
/// for the CUDA executor) and on the device.
#[derive(Debug)]
pub struct KvPlane<'a> {
    pub host: Buf<'a, u8>,
    pub device: BufMut<'a, u8>,
}

/// The KV rows of a swap-in or a plan replay: row `r` of every plane is
/// addressed with `layout`; a miss copies host row `h` to device row `d` of
/// each plane.
#[derive(Debug)]
pub struct KvBuffers<'a> {
    pub layout: ItemLayout,
    /// The plane every path has (MLA's latent cache, MHA's K).
    pub k: KvPlane<'a>,
    /// MHA's V, which moves with K.
    pub v: Option<KvPlane<'a>>,
}

impl<'a> KvBuffers<'a> {
    /// One plane of linear rows of `item_bytes` (SGLang's MLA caches).
    pub fn linear(item_bytes: u32, host: Buf<'a, u8>, device: BufMut<'a, u8>) -> Result<Self> {
        Ok(KvBuffers {
            layout: ItemLayout::linear(item_bytes)?,
            k: KvPlane { host, device },
            v: None,
        })
    }
}

/// The planes as the kernels address them.
pub(super) struct CheckedKv {
    pub host: [u64; 2],
    pub device: [u64; 2],
    pub layout: kvt_item_layout,
    /// Bytes one row moves over every plane.
    pub miss_bytes: u32,
    pub host_rows: u64,
    pub device_rows: u64,
}

/// Checks the planes (location, 8-byte alignment) and counts the rows every
/// plane holds at both ends.
pub(super) fn check(kv: &KvBuffers<'_>, want: Location) -> Result<CheckedKv> {
    // Checked on every call: no allocation.
    let planes = [
        Some(("host_cache", "device_buffer", &kv.k)),
        kv.v.as_ref()
            .map(|v| ("host_cache_v", "device_buffer_v", v)),
    ];
    let (mut host, mut device) = ([0u64; 2], [0u64; 2]);
    let (mut host_rows, mut device_rows) = (u64::MAX, u64::MAX);
    for (i, (host_arg, device_arg, plane)) in planes.into_iter().flatten().enumerate() {
        for (arg, addr, len, loc) in [
            (
                host_arg,
                plane.host.addr(),
                plane.host.len(),
                plane.host.location(),
            ),
            (
                device_arg,
                plane.device.addr(),
                plane.device.len(),
                plane.device.location(),
            ),
        ] {
            crate::mem::check_buf(arg, addr, len, loc, want, 8, 0)?;
            if len > 0 && !addr.is_multiple_of(8) {
                return Err(invalid(
                    arg,
                    format!("address {addr:#x} is not 8-byte aligned"),
                ));
            }
        }
        host[i] = plane.host.addr();
        device[i] = plane.device.addr();
        host_rows = host_rows.min(kv.layout.rows_in(plane.host.len() as u64));
        device_rows = device_rows.min(kv.layout.rows_in(plane.device.len() as u64));
    }
    let planes = if kv.v.is_some() { 2 } else { 1 };
    Ok(CheckedKv {
        host,
        device,
        miss_bytes: kv.layout.item_bytes().saturating_mul(planes),
        layout: kv.layout.to_abi(),
        host_rows,
        device_rows,
    })
}

/// The layout back from the kernels' form (checked when it was made).
pub(super) fn layout_of(l: &kvt_item_layout) -> ItemLayout {
    ItemLayout::paged(
        1 << l.page_shift,
        l.value_bytes,
        l.scale_bytes,
        l.page_bytes,
    )
    .expect("built from an ItemLayout")
}

/// The CPU executor's copy of host row `src` to device row `dst` of every
/// plane of `p`, whose rows `layout` (`layout_of(&p.items)`) addresses.
///
/// # Safety
/// `src < p.host_rows` and `dst < p.device_rows`, and the planes of `p` are
/// host memory holding those rows, as [`check`] established.
pub(super) unsafe fn copy_row(p: &kvt_swap_in_params, layout: &ItemLayout, src: u64, dst: u64) {
    // SAFETY: per this function's contract.
    unsafe { copy_planes(p.host_cache, p.device_buffer, layout, src, dst) }
}

/// Host row `src` to device row `dst` of each plane `host[i]` → `device[i]`
/// whose host address is not 0.
///
/// # Safety
/// `src` and `dst` are rows inside the planes, which are host memory holding
/// them, as [`check`] established.
pub(super) unsafe fn copy_planes(
    host: [u64; 2],
    device: [u64; 2],
    layout: &ItemLayout,
    src: u64,
    dst: u64,
) {
    for (host, device) in host.into_iter().zip(device) {
        if host == 0 {
            continue;
        }
        for ((from, len), (to, _)) in layout.pieces(src).into_iter().zip(layout.pieces(dst)) {
            // SAFETY: per this function's contract both rows lie inside their
            // buffers; host and device buffers of a plane may be one buffer
            // (ptr::copy allows the overlap).
            unsafe {
                std::ptr::copy(
                    (host as *const u8).add(from as usize),
                    (device as *mut u8).add(to as usize),
                    len,
                )
            };
        }
    }
}
