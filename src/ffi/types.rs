//! The `#[repr(C)]` mirrors of the header's argument structs (what the
//! extension module builds), and their sizes and offsets for the layout
//! test.

use std::ffi::c_void;

use crate::swap_in::SwapInCounters;

/// `KVT_ABI_VERSION` in the header.
pub const KVT_ABI_VERSION: u32 = 8;

pub type KvtStatus = i32;
pub const KVT_OK: KvtStatus = 0;

/// `kvt_prefix_set`'s outcomes (`KVT_PREFIX_*` in the header).
pub const KVT_PREFIX_STORED: u8 = 0;
pub const KVT_PREFIX_PRESENT: u8 = 1;
pub const KVT_PREFIX_FULL: u8 = 2;
pub const KVT_INVALID_ARGUMENT: KvtStatus = 1;
pub const KVT_KERNELS_NOT_BUILT: KvtStatus = 2;
pub const KVT_NO_DRIVER: KvtStatus = 3;
pub const KVT_DRIVER_ERROR: KvtStatus = 4;
pub const KVT_BAD_INDICES: KvtStatus = 5;
pub const KVT_POOL_ERROR: KvtStatus = 6;
pub const KVT_IO_ERROR: KvtStatus = 7;
pub const KVT_INTERNAL_ERROR: KvtStatus = 8;

pub const KVT_EXECUTOR_CPU: i32 = -1;
pub const KVT_INDEX_INT32: u32 = 1;
pub const KVT_INDEX_INT64: u32 = 2;
pub const KVT_SWAP_IN_PLAN_THEN_COPY: u32 = 0;
pub const KVT_SWAP_IN_ONE_BLOCK_PER_REQUEST: u32 = 1;
pub const KVT_SWAP_IN_FEW_MISS: u32 = 2;
pub const KVT_SWAP_IN_COMPACT: u32 = 3;
pub const KVT_SWAP_IN_COMPACT_ONE_LAUNCH: u32 = 4;
pub const KVT_SWAP_IN_FEW_MISS_512: u32 = 5;
pub const KVT_SWAP_IN_FEW_MISS_ONE_LAUNCH: u32 = 6;
pub const KVT_SWAP_IN_FEW_MISS_512_ONE_LAUNCH: u32 = 7;
pub const KVT_SWAP_IN_DEFAULT: u32 = 8;

/// `kvt_buf`: an address and a length in elements.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtBuf {
    pub ptr: *mut c_void,
    pub len: u64,
}

/// `kvt_layout`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtLayout {
    pub entry_bytes: u32,
    pub layers: u32,
    pub tokens_per_region: u32,
}

/// `kvt_pool_options`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtPoolOptions {
    pub rank: u32,
    pub ranks: u32,
    pub clients: u32,
    pub register_flags: u32,
}

/// `kvt_pool_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtPoolInfo {
    pub layout: KvtLayout,
    pub num_devices: u32,
    pub num_regions: u32,
    pub free_regions: u32,
    pub _reserved: u32,
    pub region_stride: u64,
    pub uuid: [u8; 16],
}

/// `kvt_device_capacity`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtDeviceCapacity {
    pub bytes: u64,
    pub host_dram: u32,
    pub pinnable: u32,
    pub movable_bytes: u64,
}

/// `kvt_region_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtRegionInfo {
    pub index: u32,
    pub device: u32,
    pub host_addr: u64,
    pub bytes: u64,
    pub epoch: u64,
    pub joined: u32,
    pub joined_elsewhere: u32,
}

/// `kvt_items`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtItems {
    pub rows_per_page: u32,
    pub value_bytes: u32,
    pub scale_bytes: u32,
    pub _reserved: u32,
    pub page_bytes: u64,
}

/// `kvt_kv_buffers`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtKvBuffers {
    pub items: KvtItems,
    pub host_cache: KvtBuf,
    pub device_buffer: KvtBuf,
    pub host_cache_v: KvtBuf,
    pub device_buffer_v: KvtBuf,
}

/// `kvt_swap_in_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtSwapInArgs {
    pub top_k_tokens: KvtBuf,
    pub top_k_stride: u64,
    pub device_buffer_tokens: KvtBuf,
    pub tokens_stride: u64,
    pub device_buffer_locs: KvtBuf,
    pub locs_stride: u64,
    pub lru_slots: KvtBuf,
    pub lru_stride: u64,
    pub host_cache_locs: KvtBuf,
    pub host_stride: u64,
    pub kv: KvtKvBuffers,
    pub top_k_device_locs: KvtBuf,
    pub out_stride: u64,
    pub req_pool_indices: KvtBuf,
    pub seq_lens: KvtBuf,
    pub num_real_reqs: KvtBuf,
    pub miss_src: KvtBuf,
    pub miss_dst: KvtBuf,
    pub miss_count: KvtBuf,
    pub miss_stride: u64,
    pub miss_capacity: u64,
    pub req_pool_indices_type: u32,
    pub seq_lens_type: u32,
    pub max_tokens: u32,
    pub num_requests: u32,
    pub num_top_k: u32,
    pub hot_buffer_size: u32,
    pub block_tokens: u32,
    pub skip_io: u32,
    pub layer: i32,
}

/// `kvt_swap_in_counters`: the library's own type, `repr(C)`.
pub type KvtSwapInCounters = SwapInCounters;

/// `kvt_spec_state`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtSpecState {
    pub cache_index: KvtBuf,
    pub index_rows: u64,
    pub index_stride: u64,
    pub bank_stride: u64,
    pub hash_size: u64,
    pub cache_policy: KvtBuf,
    pub policy_rows: u64,
    pub policy_stride: u64,
    pub policy_width: u64,
    pub scratch_locs: KvtBuf,
    pub scratch_stride: u64,
    pub scratch_capacity: u64,
    pub scratch_state: KvtBuf,
    pub state_rows: u64,
    pub state_stride: u64,
    pub state_width: u64,
}

/// `kvt_spec_swap_in_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtSpecSwapInArgs {
    pub top_k_tokens: KvtBuf,
    pub top_k_stride: u64,
    pub device_buffer_tokens: KvtBuf,
    pub tokens_stride: u64,
    pub device_buffer_locs: KvtBuf,
    pub locs_stride: u64,
    pub host_cache_locs: KvtBuf,
    pub host_stride: u64,
    pub kv: KvtKvBuffers,
    pub top_k_device_locs: KvtBuf,
    pub out_stride: u64,
    pub req_pool_indices: KvtBuf,
    pub seq_lens: KvtBuf,
    pub num_real_reqs: KvtBuf,
    pub miss_src: KvtBuf,
    pub miss_dst: KvtBuf,
    pub miss_count: KvtBuf,
    pub miss_stride: u64,
    pub miss_capacity: u64,
    pub state: KvtSpecState,
    pub req_pool_indices_type: u32,
    pub seq_lens_type: u32,
    pub max_tokens: u32,
    pub num_requests: u32,
    pub num_steps: u32,
    pub num_top_k: u32,
    pub hot_buffer_size: u32,
    pub page_size: u32,
}

/// `kvt_planned_copy_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtPlannedCopyArgs {
    pub miss_src: KvtBuf,
    pub miss_dst: KvtBuf,
    pub miss_count: KvtBuf,
    pub miss_stride: u64,
    pub miss_capacity: u64,
    pub num_real_reqs: KvtBuf,
    pub kv: KvtKvBuffers,
    pub warps: u32,
    pub skip_io: u32,
}

/// `kvt_gather_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtGatherArgs {
    pub req_slots: KvtBuf,
    pub seq_lens: KvtBuf,
    pub topk: KvtBuf,
    pub k: u32,
    pub topk_stride: u32,
    pub out: KvtBuf,
}

/// `kvt_writeback_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtWritebackArgs {
    pub slots: KvtBuf,
    pub tokens: KvtBuf,
    pub src_rows: KvtBuf,
    pub src: KvtBuf,
}

/// `kvt_engram_args`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvtEngramArgs {
    pub weights: KvtBuf,
    pub scales: KvtBuf,
    pub ids: KvtBuf,
    pub out: KvtBuf,
    pub out_rows: KvtBuf,
    pub row_lo: i64,
    pub row_hi: i64,
    pub dim: u32,
    pub block: u32,
    pub ids_type: u32,
}

/// Sizes and field offsets of the `#[repr(C)]` mirrors, for the layout test
/// against the C header (`tests/ffi.rs`).
#[doc(hidden)]
pub fn layout_table() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! fields {
        ($t:ty, $name:literal: $($f:ident),*) => {{
            let mut v = vec![(concat!("sizeof ", $name), size_of::<$t>())];
            $(v.push((concat!($name, ".", stringify!($f)), offset_of!($t, $f)));)*
            v
        }};
    }
    let mut v = Vec::new();
    v.extend(fields!(KvtBuf, "kvt_buf": ptr, len));
    v.extend(fields!(KvtLayout, "kvt_layout": entry_bytes, layers, tokens_per_region));
    v.extend(fields!(KvtPoolOptions, "kvt_pool_options": rank, ranks, clients, register_flags));
    v.extend(
        fields!(KvtPoolInfo, "kvt_pool_info": layout, num_devices, num_regions, free_regions,
        region_stride, uuid),
    );
    v.extend(fields!(KvtDeviceCapacity, "kvt_device_capacity": bytes, host_dram, pinnable, movable_bytes));
    v.extend(fields!(KvtRegionInfo, "kvt_region_info": index, device, host_addr, bytes, epoch, joined, joined_elsewhere));
    v.extend(
        fields!(KvtSwapInArgs, "kvt_swap_in_args": top_k_tokens, top_k_stride,
        device_buffer_tokens, tokens_stride, device_buffer_locs, locs_stride, lru_slots,
        lru_stride, host_cache_locs, host_stride, kv, top_k_device_locs, out_stride,
        req_pool_indices, seq_lens, num_real_reqs, miss_src, miss_dst, miss_count, miss_stride,
        miss_capacity, req_pool_indices_type, seq_lens_type, max_tokens, num_requests, num_top_k,
        hot_buffer_size, block_tokens, skip_io, layer),
    );
    v.extend(
        fields!(KvtSwapInCounters, "kvt_swap_in_counters": calls, rows, hits, misses, bytes,
        bad_indices),
    );
    v.extend(
        fields!(KvtSpecState, "kvt_spec_state": cache_index, index_rows, index_stride,
        bank_stride, hash_size, cache_policy, policy_rows, policy_stride, policy_width,
        scratch_locs, scratch_stride, scratch_capacity, scratch_state, state_rows, state_stride,
        state_width),
    );
    v.extend(
        fields!(KvtSpecSwapInArgs, "kvt_spec_swap_in_args": top_k_tokens, top_k_stride,
        device_buffer_tokens, tokens_stride, device_buffer_locs, locs_stride, host_cache_locs,
        host_stride, kv, top_k_device_locs, out_stride, req_pool_indices, seq_lens,
        num_real_reqs, miss_src, miss_dst, miss_count, miss_stride, miss_capacity, state,
        req_pool_indices_type, seq_lens_type, max_tokens, num_requests, num_steps, num_top_k,
        hot_buffer_size, page_size),
    );
    v.extend(fields!(KvtItems, "kvt_items": rows_per_page, value_bytes, scale_bytes, page_bytes));
    v.extend(
        fields!(KvtKvBuffers, "kvt_kv_buffers": items, host_cache, device_buffer, host_cache_v,
        device_buffer_v),
    );
    v.extend(
        fields!(KvtPlannedCopyArgs, "kvt_planned_copy_args": miss_src, miss_dst, miss_count,
        miss_stride, miss_capacity, num_real_reqs, kv, warps, skip_io),
    );
    v.extend(
        fields!(KvtGatherArgs, "kvt_gather_args": req_slots, seq_lens, topk, k, topk_stride,
        out),
    );
    v.extend(fields!(KvtWritebackArgs, "kvt_writeback_args": slots, tokens, src_rows, src));
    v.extend(
        fields!(KvtEngramArgs, "kvt_engram_args": weights, scales, ids, out, out_rows, row_lo,
        row_hi, dim, block, ids_type),
    );
    v
}
