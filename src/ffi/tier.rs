//! Tiers: the per-layer gather, writeback and swap-in on a pool.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUstream;

use crate::error::invalid;
use crate::gather::GatherBatch;
use crate::tier::Tier;
use crate::writeback::WritebackItems;

use super::convert::*;
use super::handles::*;
use super::types::*;

/// # Safety
/// Pointers as `kvt_tier_create` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_create(
    pool: *mut KvtPool,
    exec: i32,
    num_slots: u32,
    out: *mut *mut KvtTier,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let p = unsafe { handle(pool, "pool")? }.pool.clone();
        unsafe {
            put(out, || {
                executor(exec)
                    .and_then(|x| Tier::new(p, x, num_slots))
                    .map(|tier| KvtTier {
                        tag: KvtTier::TAG,
                        tier: Mutex::new(tier),
                    })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_tier_bind_slot` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_bind_slot(
    tier: *mut KvtTier,
    slot: u32,
    region: *const KvtRegion,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let t = unsafe { handle(tier, "tier")? };
        let r = unsafe { handle(region, "region")? };
        let mut tier = lock(&t.tier);
        if !Arc::ptr_eq(tier.pool(), &r.pool) {
            return Err(invalid("region", "belongs to another pool than the tier's"));
        }
        tier.bind_slot(slot, &r.region, stream(stream_))
    })
}

/// # Safety
/// `tier` is null or a live `kvt_tier`; `stream_` as the header says.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_unbind_slot(
    tier: *mut KvtTier,
    slot: u32,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let t = unsafe { handle(tier, "tier")? };
        lock(&t.tier).unbind_slot(slot, stream(stream_))
    })
}

/// # Safety
/// Pointers as `kvt_tier_gather` in `bindings/kvtier.h` describes them; every
/// buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_gather(
    tier: *const KvtTier,
    layer: u32,
    args: *const KvtGatherArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let t = unsafe { handle(tier, "tier")? };
        let a = unsafe { arg_ref(args, "args")? };
        let tier = lock(&t.tier);
        let loc = tier.executor().location();
        let batch = unsafe {
            GatherBatch {
                req_slots: buf(&a.req_slots, "req_slots", loc)?,
                seq_lens: buf(&a.seq_lens, "seq_lens", loc)?,
                topk: buf(&a.topk, "topk", loc)?,
                k: a.k,
                topk_stride: a.topk_stride,
            }
        };
        let out = unsafe { buf_mut(&a.out, "out", loc)? };
        tier.gather(layer, &batch, out, stream(stream_))
    })
}

/// # Safety
/// Pointers as `kvt_tier_writeback_layer` in `bindings/kvtier.h` describes
/// them; every buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_writeback_layer(
    tier: *const KvtTier,
    layer: u32,
    args: *const KvtWritebackArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let t = unsafe { handle(tier, "tier")? };
        let a = unsafe { arg_ref(args, "args")? };
        let tier = lock(&t.tier);
        let loc = tier.executor().location();
        let items = unsafe {
            WritebackItems {
                slots: buf(&a.slots, "slots", loc)?,
                tokens: buf(&a.tokens, "tokens", loc)?,
                src_rows: buf(&a.src_rows, "src_rows", loc)?,
            }
        };
        let src = unsafe { buf(&a.src, "src", loc)? };
        tier.writeback_layer(layer, &items, src, stream(stream_))
    })
}

/// # Safety
/// `tier` is null or a live `kvt_tier`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_enable_swap_in(
    tier: *mut KvtTier,
    max_batch: u32,
    max_top_k: u32,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let t = unsafe { handle(tier, "tier")? };
        lock(&t.tier).enable_swap_in(max_batch, max_top_k)
    })
}

/// # Safety
/// Pointers as `kvt_tier_swap_in` in `bindings/kvtier.h` describes them;
/// every buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_swap_in(
    tier: *const KvtTier,
    args: *const KvtSwapInArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let t = unsafe { handle(tier, "tier")? };
        let a = unsafe { arg_ref(args, "args")? };
        let tier = lock(&t.tier);
        let args = unsafe { swap_in_args(a, tier.executor().location())? };
        tier.swap_in(&args, stream(stream_))
    })
}

/// # Safety
/// `tier` is null or a live `kvt_tier`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_check(tier: *const KvtTier, stream_: CUstream) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let t = unsafe { handle(tier, "tier")? };
        lock(&t.tier).check(stream(stream_))
    })
}

/// # Safety
/// `tier` is null or a live `kvt_tier`; it must not be used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_tier_destroy(tier: *mut KvtTier) {
    // SAFETY: the header's contract.
    unsafe { release(tier, "tier") }
}
