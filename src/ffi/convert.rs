//! The header's argument structs turned into the library's checked
//! argument types (buffers, layouts, pool options, swap-in arguments).

use std::ffi::{CStr, c_char};

use cudarc::driver::sys::CUstream;

use crate::cuda::{REGISTER_FLAGS, Stream};
use crate::error::{Result, invalid};
use crate::executor::Executor;
use crate::layout::{ItemLayout, LayerFirstLayout};
use crate::mem::{Buf, BufMut, Location};
use crate::pool::{DEFAULT_CLIENTS, DeviceSpec, PoolOptions};
use crate::swap_in::{
    IndexBuf, KvBuffers, KvPlane, MissPlan, PlannedCopyArgs, QueryKind, SpecState, SpecSwapInArgs,
    SwapInArgs, SwapInStrategy,
};

use super::types::*;

pub(super) fn executor(ordinal: i32) -> Result<Executor> {
    match ordinal {
        KVT_EXECUTOR_CPU => Ok(Executor::cpu()),
        o if o >= 0 => Executor::cuda(o as usize),
        o => Err(invalid(
            "executor",
            format!("{o} is neither KVT_EXECUTOR_CPU (-1) nor a GPU ordinal"),
        )),
    }
}

pub(super) fn layout(l: &KvtLayout) -> Result<LayerFirstLayout> {
    LayerFirstLayout::new(l.entry_bytes, l.layers, l.tokens_per_region)
}

pub(super) fn pool_options(o: Option<&KvtPoolOptions>) -> PoolOptions {
    let mut options = PoolOptions::default();
    if let Some(o) = o {
        options.rank = o.rank;
        options.ranks = o.ranks.max(1);
        options.clients = if o.clients == 0 {
            DEFAULT_CLIENTS
        } else {
            o.clients
        };
        options.register_flags = if o.register_flags == 0 {
            REGISTER_FLAGS
        } else {
            o.register_flags
        };
    }
    options
}

/// The device specs behind a C array of strings.
///
/// # Safety
/// A non-null `devices` must point to `n` pointers, each null or a C string.
pub(super) unsafe fn device_specs(
    devices: *const *const c_char,
    n: usize,
) -> Result<Vec<DeviceSpec>> {
    if devices.is_null() {
        return Err(invalid("devices", "is a null pointer"));
    }
    if n == 0 || n > crate::pool::MAX_DEVICES {
        return Err(invalid(
            "num_devices",
            format!(
                "{n} devices given; a pool spans 1..={}",
                crate::pool::MAX_DEVICES
            ),
        ));
    }
    // SAFETY: per this function's contract.
    let ptrs = unsafe { std::slice::from_raw_parts(devices, n) };
    ptrs.iter()
        .map(|&p| {
            if p.is_null() {
                return Err(invalid("devices", "holds a null string"));
            }
            // SAFETY: a non-null entry is a C string (contract).
            let s = unsafe { CStr::from_ptr(p) }
                .to_str()
                .map_err(|_| invalid("devices", "holds a string that is not UTF-8"))?;
            s.parse()
        })
        .collect()
}

/// `len` as a usize, for buffers.
pub(super) fn elements(b: &KvtBuf, arg: &'static str) -> Result<usize> {
    usize::try_from(b.len).map_err(|_| invalid(arg, "is longer than the address space"))
}

/// A read-only buffer at `loc`. A null pointer with length 0 is an empty
/// buffer; a null pointer with a length is refused.
///
/// # Safety
/// The caller's promise of the C ABI: `ptr` addresses `len` elements of `T`
/// at `loc`, valid for the call (and for the enqueued work).
pub(super) unsafe fn buf<'a, T>(
    b: &KvtBuf,
    arg: &'static str,
    loc: Location,
) -> Result<Buf<'a, T>> {
    let len = elements(b, arg)?;
    if b.ptr.is_null() && len != 0 {
        return Err(invalid(
            arg,
            format!("is a null pointer with a length of {len}"),
        ));
    }
    // SAFETY: per this function's contract.
    Ok(unsafe { Buf::from_raw(b.ptr as u64, len, loc) })
}

/// A writable buffer at `loc` (as [`buf`]).
///
/// # Safety
/// As for [`buf`], and the memory is the callee's to write for the call.
pub(super) unsafe fn buf_mut<'a, T>(
    b: &KvtBuf,
    arg: &'static str,
    loc: Location,
) -> Result<BufMut<'a, T>> {
    let len = elements(b, arg)?;
    if b.ptr.is_null() && len != 0 {
        return Err(invalid(
            arg,
            format!("is a null pointer with a length of {len}"),
        ));
    }
    // SAFETY: per this function's contract.
    Ok(unsafe { BufMut::from_raw(b.ptr as u64, len, loc) })
}

/// An int32-or-int64 index buffer.
///
/// # Safety
/// As for [`buf`].
pub(super) unsafe fn index_buf<'a>(
    b: &KvtBuf,
    ty: u32,
    arg: &'static str,
    loc: Location,
) -> Result<IndexBuf<'a>> {
    // SAFETY: per this function's contract.
    unsafe {
        match ty {
            KVT_INDEX_INT32 => Ok(IndexBuf::I32(buf(b, arg, loc)?)),
            KVT_INDEX_INT64 => Ok(IndexBuf::I64(buf(b, arg, loc)?)),
            other => Err(invalid(
                arg,
                format!("has type code {other}; use KVT_INDEX_INT32 (1) or KVT_INDEX_INT64 (2)"),
            )),
        }
    }
}

/// A C count, stride or capacity as a `usize`.
pub(super) fn size(v: u64, arg: &'static str) -> Result<usize> {
    usize::try_from(v).map_err(|_| invalid(arg, "is larger than the address space"))
}

/// An optional int32 `[1]` buffer (a null pointer: none).
///
/// # Safety
/// As for [`buf`].
pub(super) unsafe fn optional_buf<'a, T>(
    b: &KvtBuf,
    arg: &'static str,
    loc: Location,
) -> Result<Option<Buf<'a, T>>> {
    if b.ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: per this function's contract.
    Ok(Some(unsafe { buf(b, arg, loc)? }))
}

/// The Rust form of a `kvt_kv_buffers`.
///
/// # Safety
/// Every buffer in `kv` per [`buf`]'s contract.
pub(super) unsafe fn kv_buffers<'a>(kv: &KvtKvBuffers, loc: Location) -> Result<KvBuffers<'a>> {
    let i = &kv.items;
    let layout = ItemLayout::paged(i.rows_per_page, i.value_bytes, i.scale_bytes, i.page_bytes)?;
    // SAFETY: per this function's contract, for every buffer below.
    unsafe {
        let k = KvPlane {
            host: buf(&kv.host_cache, "host_cache", loc)?,
            device: buf_mut(&kv.device_buffer, "device_buffer", loc)?,
        };
        let v = match (
            kv.host_cache_v.ptr.is_null(),
            kv.device_buffer_v.ptr.is_null(),
        ) {
            (true, true) => None,
            (false, false) => Some(KvPlane {
                host: buf(&kv.host_cache_v, "host_cache_v", loc)?,
                device: buf_mut(&kv.device_buffer_v, "device_buffer_v", loc)?,
            }),
            _ => {
                return Err(invalid(
                    "host_cache_v",
                    "host_cache_v and device_buffer_v must be given together (or neither)",
                ));
            }
        };
        Ok(KvBuffers { layout, k, v })
    }
}

/// A caller's miss plan (all three buffers, or none).
///
/// # Safety
/// Every buffer per [`buf`]'s contract.
pub(super) unsafe fn miss_plan<'a>(
    [src, dst, count]: [&KvtBuf; 3],
    miss_stride: u64,
    miss_capacity: u64,
    loc: Location,
) -> Result<Option<MissPlan<'a>>> {
    match [src, dst, count].map(|b| !b.ptr.is_null()) {
        [false, false, false] => Ok(None),
        [true, true, true] => Ok(Some(MissPlan {
            // SAFETY: per this function's contract.
            src: unsafe { buf_mut(src, "miss_src", loc)? },
            dst: unsafe { buf_mut(dst, "miss_dst", loc)? },
            stride: size(miss_stride, "miss_stride")?,
            capacity: size(miss_capacity, "miss_capacity")?,
            count: unsafe { buf_mut(count, "miss_count", loc)? },
        })),
        _ => Err(invalid(
            "miss_src",
            "miss_src, miss_dst and miss_count must be given together (or none of them)",
        )),
    }
}

/// The Rust arguments of a C swap-in call.
///
/// # Safety
/// Every buffer in `a` per [`buf`]'s contract.
pub(super) unsafe fn swap_in_args<'a>(a: &KvtSwapInArgs, loc: Location) -> Result<SwapInArgs<'a>> {
    // SAFETY: per this function's contract.
    let miss_plan = unsafe {
        miss_plan(
            [&a.miss_src, &a.miss_dst, &a.miss_count],
            a.miss_stride,
            a.miss_capacity,
            loc,
        )?
    };
    let query = match a.block_tokens {
        0 => QueryKind::Tokens,
        block_tokens => QueryKind::Blocks { block_tokens },
    };
    // SAFETY: per this function's contract, for every buffer below.
    unsafe {
        Ok(SwapInArgs {
            top_k_tokens: buf(&a.top_k_tokens, "top_k_tokens", loc)?,
            top_k_stride: size(a.top_k_stride, "top_k_stride")?,
            query,
            device_buffer_tokens: buf_mut(&a.device_buffer_tokens, "device_buffer_tokens", loc)?,
            tokens_stride: size(a.tokens_stride, "tokens_stride")?,
            device_buffer_locs: buf(&a.device_buffer_locs, "device_buffer_locs", loc)?,
            locs_stride: size(a.locs_stride, "locs_stride")?,
            lru_slots: buf_mut(&a.lru_slots, "lru_slots", loc)?,
            lru_stride: size(a.lru_stride, "lru_stride")?,
            host_cache_locs: buf(&a.host_cache_locs, "host_cache_locs", loc)?,
            host_stride: size(a.host_stride, "host_stride")?,
            max_tokens: a.max_tokens,
            kv: kv_buffers(&a.kv, loc)?,
            top_k_device_locs: buf_mut(&a.top_k_device_locs, "top_k_device_locs", loc)?,
            out_stride: size(a.out_stride, "out_stride")?,
            req_pool_indices: index_buf(
                &a.req_pool_indices,
                a.req_pool_indices_type,
                "req_pool_indices",
                loc,
            )?,
            seq_lens: index_buf(&a.seq_lens, a.seq_lens_type, "seq_lens", loc)?,
            num_real_reqs: optional_buf(&a.num_real_reqs, "num_real_reqs", loc)?,
            num_requests: a.num_requests,
            num_top_k: a.num_top_k,
            hot_buffer_size: a.hot_buffer_size,
            skip_io: a.skip_io != 0,
            layer: match a.layer {
                -1 => None,
                l if l >= 0 => Some(l as u32),
                l => return Err(invalid("layer", format!("{l} is neither -1 nor a layer"))),
            },
            miss_plan,
        })
    }
}

/// The Rust arguments of a C speculative swap-in call.
///
/// # Safety
/// Every buffer in `a` per [`buf`]'s contract.
pub(super) unsafe fn spec_swap_in_args<'a>(
    a: &KvtSpecSwapInArgs,
    loc: Location,
) -> Result<SpecSwapInArgs<'a>> {
    let st = &a.state;
    // SAFETY: per this function's contract, for every buffer below.
    unsafe {
        let Some(num_real_reqs) = optional_buf(&a.num_real_reqs, "num_real_reqs", loc)? else {
            return Err(invalid(
                "num_real_reqs",
                "is a null pointer; the speculative swap-in needs it (int32 [1])",
            ));
        };
        Ok(SpecSwapInArgs {
            top_k_tokens: buf(&a.top_k_tokens, "top_k_tokens", loc)?,
            top_k_stride: size(a.top_k_stride, "top_k_stride")?,
            num_steps: a.num_steps,
            num_top_k: a.num_top_k,
            device_buffer_tokens: buf_mut(&a.device_buffer_tokens, "device_buffer_tokens", loc)?,
            tokens_stride: size(a.tokens_stride, "tokens_stride")?,
            device_buffer_locs: buf_mut(&a.device_buffer_locs, "device_buffer_locs", loc)?,
            locs_stride: size(a.locs_stride, "locs_stride")?,
            host_cache_locs: buf(&a.host_cache_locs, "host_cache_locs", loc)?,
            host_stride: size(a.host_stride, "host_stride")?,
            max_tokens: a.max_tokens,
            kv: kv_buffers(&a.kv, loc)?,
            top_k_device_locs: buf_mut(&a.top_k_device_locs, "top_k_device_locs", loc)?,
            out_stride: size(a.out_stride, "out_stride")?,
            req_pool_indices: index_buf(
                &a.req_pool_indices,
                a.req_pool_indices_type,
                "req_pool_indices",
                loc,
            )?,
            seq_lens: index_buf(&a.seq_lens, a.seq_lens_type, "seq_lens", loc)?,
            num_real_reqs,
            state: SpecState {
                cache_index: buf_mut(&st.cache_index, "cache_index", loc)?,
                index_rows: size(st.index_rows, "index_rows")?,
                index_stride: size(st.index_stride, "index_stride")?,
                bank_stride: size(st.bank_stride, "bank_stride")?,
                hash_size: size(st.hash_size, "hash_size")?,
                cache_policy: buf_mut(&st.cache_policy, "cache_policy", loc)?,
                policy_rows: size(st.policy_rows, "policy_rows")?,
                policy_stride: size(st.policy_stride, "policy_stride")?,
                policy_width: size(st.policy_width, "policy_width")?,
                scratch_locs: buf_mut(&st.scratch_locs, "scratch_locs", loc)?,
                scratch_stride: size(st.scratch_stride, "scratch_stride")?,
                scratch_capacity: size(st.scratch_capacity, "scratch_capacity")?,
                scratch_state: buf_mut(&st.scratch_state, "scratch_state", loc)?,
                state_rows: size(st.state_rows, "state_rows")?,
                state_stride: size(st.state_stride, "state_stride")?,
                state_width: size(st.state_width, "state_width")?,
            },
            num_requests: a.num_requests,
            hot_buffer_size: a.hot_buffer_size,
            page_size: a.page_size,
            miss_plan: miss_plan(
                [&a.miss_src, &a.miss_dst, &a.miss_count],
                a.miss_stride,
                a.miss_capacity,
                loc,
            )?,
        })
    }
}

/// The Rust arguments of a C plan replay.
///
/// # Safety
/// Every buffer in `a` per [`buf`]'s contract.
pub(super) unsafe fn planned_copy_args<'a>(
    a: &KvtPlannedCopyArgs,
    loc: Location,
) -> Result<PlannedCopyArgs<'a>> {
    // SAFETY: per this function's contract, for every buffer below.
    unsafe {
        Ok(PlannedCopyArgs {
            src: buf(&a.miss_src, "miss_src", loc)?,
            dst: buf(&a.miss_dst, "miss_dst", loc)?,
            count: buf(&a.miss_count, "miss_count", loc)?,
            stride: size(a.miss_stride, "miss_stride")?,
            capacity: size(a.miss_capacity, "miss_capacity")?,
            num_real_reqs: optional_buf(&a.num_real_reqs, "num_real_reqs", loc)?,
            kv: kv_buffers(&a.kv, loc)?,
            skip_io: a.skip_io != 0,
        })
    }
}

/// The strategy `s` names; `None` for `KVT_SWAP_IN_DEFAULT` (the engine's
/// choice for the call, `SwapInEngine::run`: `default_choice`).
pub(super) fn strategy(s: u32) -> Result<Option<SwapInStrategy>> {
    if s == KVT_SWAP_IN_DEFAULT {
        return Ok(None);
    }
    let named = match s {
        KVT_SWAP_IN_PLAN_THEN_COPY => Ok(SwapInStrategy::PlanThenCopy),
        KVT_SWAP_IN_ONE_BLOCK_PER_REQUEST => Ok(SwapInStrategy::OneBlockPerRequest),
        KVT_SWAP_IN_FEW_MISS => Ok(SwapInStrategy::FewMiss),
        KVT_SWAP_IN_COMPACT => Ok(SwapInStrategy::Compact),
        KVT_SWAP_IN_COMPACT_ONE_LAUNCH => Ok(SwapInStrategy::CompactOneLaunch),
        KVT_SWAP_IN_FEW_MISS_512 => Ok(SwapInStrategy::FewMiss512),
        KVT_SWAP_IN_FEW_MISS_ONE_LAUNCH => Ok(SwapInStrategy::FewMissOneLaunch),
        KVT_SWAP_IN_FEW_MISS_512_ONE_LAUNCH => Ok(SwapInStrategy::FewMiss512OneLaunch),
        other => Err(invalid(
            "strategy",
            format!("{other} is not a KVT_SWAP_IN_* strategy (0 to 8)"),
        )),
    };
    named.map(Some)
}

pub(super) fn stream(s: CUstream) -> Stream {
    // SAFETY: the C ABI's contract: a live stream of the GPU's primary
    // context, or NULL (the CPU executor ignores it).
    unsafe { Stream::from_raw(s) }
}

/// # Safety
/// A non-null `p` must be a NUL-terminated string.
pub(super) unsafe fn text_arg<'a>(p: *const c_char, arg: &'static str) -> Result<&'a str> {
    if p.is_null() {
        return Err(invalid(arg, "is a null pointer"));
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| invalid(arg, "is not UTF-8"))
}
