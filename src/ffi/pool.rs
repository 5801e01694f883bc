//! Pools and regions.

use std::ffi::{CStr, c_char};
use std::sync::Arc;

use crate::error::Result;
use crate::error::invalid;
use crate::layout::LayerFirstLayout;
use crate::pool::{DeviceSpec, Pool, PoolOptions, Region};

use super::convert::*;
use super::handles::*;
use super::types::*;

/// The shape every pool entry point shares: the layout (where the call
/// takes one), the devices and options read and checked, then the pool
/// `make` gives put behind a new handle in `out`.
///
/// # Safety
/// Pointers as the pool entry points in `bindings/kvtier.h` describe them;
/// `layout_` is null where the call takes no layout.
unsafe fn pool_entry(
    layout_: Option<*const KvtLayout>,
    devices: *const *const c_char,
    num_devices: usize,
    options: *const KvtPoolOptions,
    out: *mut *mut KvtPool,
    make: impl FnOnce(Option<LayerFirstLayout>, Vec<DeviceSpec>, PoolOptions) -> Result<Arc<Pool>>,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let l = match layout_ {
            Some(p) => Some(layout(unsafe { arg_ref(p, "layout")? })?),
            None => None,
        };
        let specs = unsafe { device_specs(devices, num_devices)? };
        let opts = pool_options(unsafe { options.as_ref() });
        unsafe { put_pool(out, || make(l, specs, opts)) }
    })
}

/// # Safety
/// Pointers as `kvt_pool_create` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_create(
    layout_: *const KvtLayout,
    devices: *const *const c_char,
    num_devices: usize,
    options: *const KvtPoolOptions,
    out: *mut *mut KvtPool,
) -> KvtStatus {
    // SAFETY: the header's contract.
    unsafe {
        pool_entry(
            Some(layout_),
            devices,
            num_devices,
            options,
            out,
            |l, specs, opts| Pool::create_on(l.expect("given"), specs, opts),
        )
    }
}

/// # Safety
/// Pointers as `kvt_pool_open` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_open(
    devices: *const *const c_char,
    num_devices: usize,
    options: *const KvtPoolOptions,
    out: *mut *mut KvtPool,
) -> KvtStatus {
    // SAFETY: the header's contract.
    unsafe {
        pool_entry(
            None,
            devices,
            num_devices,
            options,
            out,
            |_, specs, opts| Pool::open(specs, opts),
        )
    }
}

/// # Safety
/// Pointers as `kvt_pool_open_or_create` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_open_or_create(
    layout_: *const KvtLayout,
    devices: *const *const c_char,
    num_devices: usize,
    options: *const KvtPoolOptions,
    out: *mut *mut KvtPool,
) -> KvtStatus {
    // SAFETY: the header's contract.
    unsafe {
        pool_entry(
            Some(layout_),
            devices,
            num_devices,
            options,
            out,
            |l, specs, opts| Pool::open_or_create(l.expect("given"), specs, opts),
        )
    }
}

/// # Safety
/// Pointers as `kvt_pool_device_bytes_for` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_device_bytes_for(
    layout_: *const KvtLayout,
    regions: u32,
    out: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let l = layout(unsafe { arg_ref(layout_, "layout")? })?;
        let bytes = Pool::device_bytes_for(&l, regions)?;
        unsafe { write_out(out, "out", bytes) }
    })
}

/// # Safety
/// Pointers as `kvt_device_capacity_get` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_device_capacity_get(
    device: *const c_char,
    out: *mut KvtDeviceCapacity,
) -> KvtStatus {
    guard(|| {
        if device.is_null() {
            return Err(invalid("device", "is a null pointer"));
        }
        // SAFETY: a non-null `device` is a C string (contract).
        let s = unsafe { CStr::from_ptr(device) }
            .to_str()
            .map_err(|_| invalid("device", "is not UTF-8"))?;
        let c = crate::pool::device_capacity(s)?;
        let info = KvtDeviceCapacity {
            bytes: c.bytes,
            host_dram: u32::from(c.host_dram),
            pinnable: u32::from(c.pinnable),
            movable_bytes: c.movable_bytes,
        };
        // SAFETY: the header's contract for `out`.
        unsafe { write_out(out, "out", info) }
    })
}

/// # Safety
/// Pointers as `kvt_pool_info_get` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_info_get(
    pool: *const KvtPool,
    out: *mut KvtPoolInfo,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let p = &unsafe { handle(pool, "pool")? }.pool;
        let l = p.layout();
        let info = KvtPoolInfo {
            layout: KvtLayout {
                entry_bytes: l.entry_bytes(),
                layers: l.layers(),
                tokens_per_region: l.tokens_per_region(),
            },
            num_devices: p.devices().len() as u32,
            num_regions: p.num_regions(),
            free_regions: p.free_regions(),
            _reserved: 0,
            region_stride: p.region_stride(),
            uuid: p.uuid(),
        };
        unsafe { write_out(out, "out", info) }
    })
}

/// # Safety
/// `pool` is null or a live `kvt_pool`; `json` is null or a NUL-terminated
/// string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_publish_stats(
    pool: *const KvtPool,
    json: *const c_char,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let p = &unsafe { handle(pool, "pool")? }.pool;
        // SAFETY: a NUL-terminated string, per the header.
        p.publish_stats(unsafe { text_arg(json, "json")? })
    })
}

/// # Safety
/// `pool` is null or a live `kvt_pool`; it must not be used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_pool_close(pool: *mut KvtPool) {
    // SAFETY: the header's contract.
    unsafe { release(pool, "pool") }
}

/// # Safety
/// Pointers as `kvt_region_alloc` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_region_alloc(
    pool: *mut KvtPool,
    request: u64,
    out: *mut *mut KvtRegion,
) -> KvtStatus {
    // SAFETY: the header's contract for each pointer.
    unsafe { region_handle(pool, out, |p| p.alloc_region_for(request)) }
}

/// A new `kvt_region` for the region `get` takes from `pool`, put in `out`.
///
/// # Safety
/// `pool` is null or a live `kvt_pool`; `out` null or valid for a pointer write.
pub(super) unsafe fn region_handle(
    pool: *mut KvtPool,
    out: *mut *mut KvtRegion,
    get: impl FnOnce(&Arc<Pool>) -> crate::Result<Region>,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the caller's contract for each pointer.
        let p = unsafe { handle(pool, "pool")? }.pool.clone();
        unsafe {
            put(out, || {
                get(&p).map(|region| KvtRegion {
                    tag: KvtRegion::TAG,
                    pool: p.clone(),
                    region,
                })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_region_join` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_region_join(
    pool: *mut KvtPool,
    pool_uuid: *const u8,
    index: u32,
    epoch: u64,
    out: *mut *mut KvtRegion,
) -> KvtStatus {
    // SAFETY: the header's contract for each pointer.
    unsafe {
        region_handle(pool, out, |p| {
            if pool_uuid.is_null() {
                return Err(invalid(
                    "pool_uuid",
                    "is null; pass the 16 bytes of the owner's kvt_pool_info.uuid",
                ));
            }
            let mut uuid = [0u8; 16];
            // SAFETY: the caller's 16 readable bytes (the header's contract).
            std::ptr::copy_nonoverlapping(pool_uuid, uuid.as_mut_ptr(), 16);
            p.join_region(crate::pool::RegionTicket {
                pool_uuid: uuid,
                index,
                epoch,
            })
        })
    }
}

/// # Safety
/// Pointers as `kvt_region_info_get` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_region_info_get(
    region: *const KvtRegion,
    out: *mut KvtRegionInfo,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let r = unsafe { handle(region, "region")? };
        let info = KvtRegionInfo {
            index: r.region.index(),
            device: r.region.device(),
            host_addr: r.pool.region_host_addr(&r.region)?,
            bytes: r.pool.layout().region_bytes(),
            // 0 for a region no longer allocated (an owner's handle whose
            // region was reclaimed): no join matches it
            epoch: r.pool.region_epoch(&r.region).unwrap_or(0),
            joined: r.region.is_joined() as u32,
            joined_elsewhere: r.pool.region_joined_elsewhere(&r.region)? as u32,
        };
        unsafe { write_out(out, "out", info) }
    })
}

/// # Safety
/// `region` is null or a live `kvt_region`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_region_publish(region: *const KvtRegion) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let r = unsafe { handle(region, "region")? };
        r.pool.publish(&r.region)
    })
}

/// # Safety
/// `region` is null or a live `kvt_region`; it must not be used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_region_free(region: *mut KvtRegion) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        unsafe { handle(region, "region")? };
        // SAFETY: made by into_raw in this library; released once.
        let b = unsafe { Box::from_raw(region) };
        let KvtRegion { pool, region, .. } = *b;
        pool.free_region(region)
    })
}
