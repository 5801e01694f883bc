//! The swap-in engine: HiSparse swap-ins, speculative swap-ins, planned
//! copies, counters.

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys::CUstream;

use crate::error::{Error, invalid};
use crate::swap_in::SwapInEngine;

use super::convert::*;
use super::handles::*;
use super::types::*;

/// # Safety
/// `out` is null or valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_create(exec: i32, out: *mut *mut KvtSwapIn) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        unsafe {
            put(out, || {
                executor(exec)
                    .and_then(SwapInEngine::new)
                    .map(|engine| KvtSwapIn {
                        tag: KvtSwapIn::TAG,
                        engine: Mutex::new(engine),
                    })
            })
        }
    })
}

/// # Safety
/// `engine` is null or a live `kvt_swap_in`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_reserve(
    engine: *mut KvtSwapIn,
    max_batch: u32,
    max_top_k: u32,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let e = unsafe { handle(engine, "engine")? };
        lock(&e.engine).reserve(max_batch, max_top_k)
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_capacity` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_capacity(
    engine: *const KvtSwapIn,
    max_batch: *mut u32,
    max_top_k: *mut u32,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let e = unsafe { handle(engine, "engine")? };
        if max_batch.is_null() || max_top_k.is_null() {
            return Err(invalid("max_batch", "an out pointer is null"));
        }
        let (b, k) = lock(&e.engine).capacity();
        unsafe {
            write_out(max_batch, "max_batch", b)?;
            write_out(max_top_k, "max_top_k", k)
        }
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_limits` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_limits(max_hot: *mut u32, max_entries: *mut u32) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        unsafe {
            write_out(max_hot, "max_hot", crate::swap_in::MAX_HOT)?;
            write_out(max_entries, "max_entries", crate::swap_in::MAX_TOP_K)
        }
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_run` in `bindings/kvtier.h` describes them; every
/// buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_run(
    engine: *const KvtSwapIn,
    args: *const KvtSwapInArgs,
    strategy_: u32,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let e = unsafe { handle(engine, "engine")? };
        let a = unsafe { arg_ref(args, "args")? };
        let s = strategy(strategy_)?;
        let engine = lock(&e.engine);
        let args = unsafe { swap_in_args(a, engine.executor().location())? };
        match s {
            Some(s) => engine.run_with(&args, s, stream(stream_)),
            None => engine.run(&args, stream(stream_)),
        }
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_run_spec` in `bindings/kvtier.h` describes them;
/// every buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_run_spec(
    engine: *const KvtSwapIn,
    args: *const KvtSpecSwapInArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let e = unsafe { handle(engine, "engine")? };
        let a = unsafe { arg_ref(args, "args")? };
        let engine = lock(&e.engine);
        let args = unsafe { spec_swap_in_args(a, engine.executor().location())? };
        engine.run_spec(&args, stream(stream_))
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_copy_planned` in `bindings/kvtier.h` describes
/// them; every buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_copy_planned(
    engine: *const KvtSwapIn,
    args: *const KvtPlannedCopyArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let e = unsafe { handle(engine, "engine")? };
        let a = unsafe { arg_ref(args, "args")? };
        let engine = lock(&e.engine);
        let args = unsafe { planned_copy_args(a, engine.executor().location())? };
        let warps = (a.warps != 0).then_some(a.warps);
        engine.copy_planned(&args, warps, stream(stream_))
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_map_host` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_map_host(
    engine: *const KvtSwapIn,
    host: *const c_void,
    out: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let e = unsafe { handle(engine, "engine")? };
        if host.is_null() {
            return Err(invalid("host", "is a null pointer"));
        }
        let addr = lock(&e.engine).host_address_for_executor(host as u64)?;
        unsafe { write_out(out, "out", addr) }
    })
}

/// # Safety
/// `engine` is null or a live `kvt_swap_in`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_check(engine: *const KvtSwapIn) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let e = unsafe { handle(engine, "engine")? };
        lock(&e.engine).check()
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_poll` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_poll(
    engine: *const KvtSwapIn,
    new_entries: *mut u32,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let e = unsafe { handle(engine, "engine")? };
        if new_entries.is_null() {
            return Err(invalid("new_entries", "is a null pointer"));
        }
        let found = lock(&e.engine).poll_bad_indices()?;
        // SAFETY: checked non-null; the header's contract.
        unsafe {
            write_out(
                new_entries,
                "new_entries",
                found.as_ref().map_or(0, |(_, n)| *n),
            )?
        };
        match found {
            Some((report, _)) => Err(Error::BadIndices(report)),
            None => Ok(()),
        }
    })
}

/// # Safety
/// `engine` is null or a live `kvt_swap_in`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_enable_counters(
    engine: *mut KvtSwapIn,
    layers: u32,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let e = unsafe { handle(engine, "engine")? };
        lock(&e.engine).enable_counters(layers)
    })
}

/// # Safety
/// Pointers as `kvt_swap_in_read_counters` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_read_counters(
    engine: *const KvtSwapIn,
    wait: u32,
    out: *mut KvtSwapInCounters,
    capacity: u32,
    layers: *mut u32,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let e = unsafe { handle(engine, "engine")? };
        if layers.is_null() {
            return Err(invalid("layers", "is a null pointer"));
        }
        if out.is_null() && capacity > 0 {
            return Err(invalid("out", "is a null pointer with a capacity above 0"));
        }
        let mut engine = lock(&e.engine);
        if capacity == 0 {
            // how many layers to make room for: read nothing (a poll here
            // would take the snapshot the caller's next call is for)
            // SAFETY: checked non-null; the header's contract.
            return unsafe { write_out(layers, "layers", engine.counter_layers()) };
        }
        let counted = if wait != 0 {
            engine.counters()?
        } else {
            engine.poll_counters()?
        }
        .unwrap_or_default();
        for (i, c) in counted.iter().take(capacity as usize).enumerate() {
            // SAFETY: `out` holds `capacity` elements, per the header.
            unsafe { out.add(i).write(*c) };
        }
        // SAFETY: checked non-null; the header's contract.
        unsafe { write_out(layers, "layers", counted.len() as u32) }
    })
}

/// # Safety
/// `engine` is null or a live `kvt_swap_in`; it must not be used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_swap_in_destroy(engine: *mut KvtSwapIn) {
    // SAFETY: the header's contract.
    unsafe { release(engine, "engine") }
}
