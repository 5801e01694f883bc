//! The C ABI (`bindings/kvtier.h`): opaque handles over [`Pool`], [`Region`],
//! [`Tier`] and [`SwapInEngine`], a status code from every call and a
//! thread-local message for the last failure.
//!
//! Every entry point checks its pointers before it dereferences them, runs
//! its body under `catch_unwind` (a panic becomes [`KVT_INTERNAL_ERROR`], it
//! never unwinds into C), and builds its buffers through the same checked
//! argument types the Rust API uses. The structs here are `#[repr(C)]`
//! mirrors of the header's; `tests/ffi.rs` compiles a C program against the
//! header and compares every size and offset.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::CUstream;

use crate::cuda::{KernelBuild, REGISTER_FLAGS, Stream};
use crate::error::{Error, Result, invalid};
use crate::executor::Executor;
use crate::gather::GatherBatch;
use crate::layout::{ItemLayout, LayerFirstLayout};
use crate::mem::{Buf, BufMut, Location};
use crate::pool::{DEFAULT_CLIENTS, DeviceSpec, Pool, PoolOptions, Region};
use crate::swap_in::{
    IndexBuf, KvBuffers, KvPlane, MissPlan, PlannedCopyArgs, QueryKind, SpecState, SpecSwapInArgs,
    SwapInArgs, SwapInCounters, SwapInEngine, SwapInStrategy,
};
use crate::tier::Tier;
use crate::writeback::WritebackItems;

/// `KVT_ABI_VERSION` in the header.
pub const KVT_ABI_VERSION: u32 = 7;

pub type KvtStatus = i32;
pub const KVT_OK: KvtStatus = 0;
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

// ---- handles ---------------------------------------------------------------

/// A handle's type tag, so that passing one kind of handle where another is
/// expected is an error rather than a misread.
trait Tagged {
    const TAG: u64;
    const NAME: &'static str;
}

/// `kvt_pool`.
#[repr(C)]
pub struct KvtPool {
    tag: u64,
    pool: Arc<Pool>,
}

/// `kvt_region`.
#[repr(C)]
pub struct KvtRegion {
    tag: u64,
    pool: Arc<Pool>,
    region: Region,
}

/// `kvt_tier`.
#[repr(C)]
pub struct KvtTier {
    tag: u64,
    tier: Mutex<Tier>,
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

/// `kvt_engram`.
#[repr(C)]
pub struct KvtEngram {
    tag: u64,
    gatherer: crate::engram::EngramGatherer,
}

/// `kvt_swap_in`.
#[repr(C)]
pub struct KvtSwapIn {
    tag: u64,
    engine: Mutex<SwapInEngine>,
}

/// `kvt_table_loader`.
#[repr(C)]
pub struct KvtTableLoader {
    tag: u64,
    /// None once published.
    loader: Mutex<Option<Box<crate::table::TableLoader>>>,
}

/// `kvt_table`.
#[repr(C)]
pub struct KvtTable {
    tag: u64,
    table: crate::table::Table,
}

/// Each handle's tag (8 bytes spelling it) and its C name.
macro_rules! tagged {
    ($($t:ty => $tag:literal, $name:literal;)*) => {
        $(impl Tagged for $t {
            const TAG: u64 = u64::from_le_bytes(*$tag);
            const NAME: &'static str = $name;
        })*
    };
}

tagged! {
    KvtTableLoader => b"kvt:tldr", "kvt_table_loader";
    KvtTable => b"kvt:tabl", "kvt_table";
    KvtPool => b"kvt:pool", "kvt_pool";
    KvtRegion => b"kvt:regn", "kvt_region";
    KvtTier => b"kvt:tier", "kvt_tier";
    KvtEngram => b"kvt:engr", "kvt_engram";
    KvtSwapIn => b"kvt:swap", "kvt_swap_in";
}

/// The handle behind `p`, after checking it is non-null and of type `T`.
///
/// # Safety
/// A non-null `p` must point to readable memory of at least 8 bytes; a
/// handle this library returned and that was not released satisfies that.
unsafe fn handle<'a, T: Tagged>(p: *const T, arg: &'static str) -> Result<&'a T> {
    if p.is_null() {
        return Err(invalid(arg, format!("is a null {}", T::NAME)));
    }
    // Every handle struct is #[repr(C)] with its tag first, so a handle of
    // any kind can be told apart by its first 8 bytes. (A released handle is
    // freed memory: its tag is cleared before the free, which often catches
    // a use after release, but reading it is the caller's fault.)
    // SAFETY: per this function's contract.
    let tag = unsafe { std::ptr::read(p as *const u64) };
    if tag != T::TAG {
        return Err(invalid(
            arg,
            format!(
                "is not a {} (a handle of another kind, or a released one)",
                T::NAME
            ),
        ));
    }
    // SAFETY: the tag says this is a live T made by this library.
    Ok(unsafe { &*p })
}

fn into_raw<T>(value: T) -> *mut T {
    Box::into_raw(Box::new(value))
}

/// Makes a new handle and stores it through `out`, which is checked first
/// (so that nothing is created for a call that is refused).
///
/// # Safety
/// A non-null `out` must be valid for a pointer write.
unsafe fn put<T>(out: *mut *mut T, make: impl FnOnce() -> Result<T>) -> Result<()> {
    if out.is_null() {
        return Err(invalid("out", "is a null pointer"));
    }
    let value = make()?;
    // SAFETY: per this function's contract.
    unsafe { out.write(into_raw(value)) };
    Ok(())
}

/// [`put`] for a pool handle.
///
/// # Safety
/// As for [`put`].
unsafe fn put_pool(out: *mut *mut KvtPool, open: impl FnOnce() -> Result<Arc<Pool>>) -> Result<()> {
    // SAFETY: per this function's contract.
    unsafe {
        put(out, || {
            open().map(|pool| KvtPool {
                tag: KvtPool::TAG,
                pool,
            })
        })
    }
}

/// Frees a handle this library made with `Box::into_raw`, its tag cleared
/// first (which often catches a use after release); null, or a handle of
/// another kind, is left alone. Panics stay inside.
///
/// # Safety
/// `p` is null or a live handle, released once and not used afterwards.
unsafe fn release<T: Tagged>(p: *mut T, arg: &'static str) {
    guard_void(|| {
        // SAFETY: per this function's contract.
        if unsafe { handle(p, arg) }.is_ok() {
            // SAFETY: every handle is #[repr(C)] with its tag first; made by
            // into_raw in this library and released once.
            unsafe {
                (p as *mut u64).write(0);
                drop(Box::from_raw(p));
            }
        }
    })
}

/// Writes `value` through `out` (checked non-null first).
///
/// # Safety
/// A non-null `out` must be valid for a write of `T`.
unsafe fn write_out<T>(out: *mut T, arg: &'static str, value: T) -> Result<()> {
    if out.is_null() {
        return Err(invalid(arg, "is a null pointer"));
    }
    // SAFETY: per this function's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// `&*p`, after a null check.
///
/// # Safety
/// A non-null `p` must point to a valid `T`.
unsafe fn arg_ref<'a, T>(p: *const T, arg: &'static str) -> Result<&'a T> {
    if p.is_null() {
        return Err(invalid(arg, "is a null pointer"));
    }
    // SAFETY: per this function's contract.
    Ok(unsafe { &*p })
}

/// A NUL-terminated UTF-8 argument.
///
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a call was reported as an internal error; the object
    // itself holds no invariant a panic could break halfway.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- status and the last error --------------------------------------------

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: String) {
    let msg = CString::new(msg.replace('\0', " ")).expect("NULs were replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

fn status_of(e: &Error) -> KvtStatus {
    match e {
        Error::InvalidArgument { .. } => KVT_INVALID_ARGUMENT,
        Error::KernelsNotBuilt(_) => KVT_KERNELS_NOT_BUILT,
        Error::NoDriver(_) => KVT_NO_DRIVER,
        Error::Driver { .. } => KVT_DRIVER_ERROR,
        Error::BadIndices(_) => KVT_BAD_INDICES,
        Error::Pool(_) => KVT_POOL_ERROR,
        Error::Io { .. } => KVT_IO_ERROR,
    }
}

/// Runs an entry point's body: its error becomes a status and the thread's
/// last error; a panic becomes [`KVT_INTERNAL_ERROR`].
fn guard(body: impl FnOnce() -> Result<()>) -> KvtStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => KVT_OK,
        Ok(Err(e)) => {
            set_last_error(e.to_string());
            status_of(&e)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last_error(format!(
                "internal error in kvtier (a bug; please report it): {what}"
            ));
            KVT_INTERNAL_ERROR
        }
    }
}

/// Runs a release function's body, swallowing panics (it returns nothing).
fn guard_void(body: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(body));
}

#[unsafe(no_mangle)]
pub extern "C" fn kvt_abi_version() -> u32 {
    KVT_ABI_VERSION
}

#[unsafe(no_mangle)]
pub extern "C" fn kvt_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

#[unsafe(no_mangle)]
pub extern "C" fn kvt_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[unsafe(no_mangle)]
pub extern "C" fn kvt_kernels_built() -> i32 {
    matches!(crate::cuda::kernels::BUILD, KernelBuild::Built { .. }) as i32
}

/// # Safety
/// Pointers as `kvt_cuda_numa_node` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_cuda_numa_node(ordinal: i32, out: *mut i32) -> KvtStatus {
    guard(|| {
        let ordinal = usize::try_from(ordinal)
            .map_err(|_| invalid("ordinal", format!("{ordinal} is not a GPU")))?;
        let dev = crate::cuda::CudaDevice::open(ordinal)?;
        let node = dev.numa_node().map_or(-1, |n| n as i32);
        // SAFETY: the header's contract for `out`.
        unsafe { write_out(out, "out", node) }
    })
}

// ---- conversions -----------------------------------------------------------

fn executor(ordinal: i32) -> Result<Executor> {
    match ordinal {
        KVT_EXECUTOR_CPU => Ok(Executor::cpu()),
        o if o >= 0 => Executor::cuda(o as usize),
        o => Err(invalid(
            "executor",
            format!("{o} is neither KVT_EXECUTOR_CPU (-1) nor a GPU ordinal"),
        )),
    }
}

fn layout(l: &KvtLayout) -> Result<LayerFirstLayout> {
    LayerFirstLayout::new(l.entry_bytes, l.layers, l.tokens_per_region)
}

fn pool_options(o: Option<&KvtPoolOptions>) -> PoolOptions {
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
unsafe fn device_specs(devices: *const *const c_char, n: usize) -> Result<Vec<DeviceSpec>> {
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
fn elements(b: &KvtBuf, arg: &'static str) -> Result<usize> {
    usize::try_from(b.len).map_err(|_| invalid(arg, "is longer than the address space"))
}

/// A read-only buffer at `loc`. A null pointer with length 0 is an empty
/// buffer; a null pointer with a length is refused.
///
/// # Safety
/// The caller's promise of the C ABI: `ptr` addresses `len` elements of `T`
/// at `loc`, valid for the call (and for the enqueued work).
unsafe fn buf<'a, T>(b: &KvtBuf, arg: &'static str, loc: Location) -> Result<Buf<'a, T>> {
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
unsafe fn buf_mut<'a, T>(b: &KvtBuf, arg: &'static str, loc: Location) -> Result<BufMut<'a, T>> {
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
unsafe fn index_buf<'a>(
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
fn size(v: u64, arg: &'static str) -> Result<usize> {
    usize::try_from(v).map_err(|_| invalid(arg, "is larger than the address space"))
}

/// An optional int32 `[1]` buffer (a null pointer: none).
///
/// # Safety
/// As for [`buf`].
unsafe fn optional_buf<'a, T>(
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
unsafe fn kv_buffers<'a>(kv: &KvtKvBuffers, loc: Location) -> Result<KvBuffers<'a>> {
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
unsafe fn miss_plan<'a>(
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
unsafe fn swap_in_args<'a>(a: &KvtSwapInArgs, loc: Location) -> Result<SwapInArgs<'a>> {
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
unsafe fn spec_swap_in_args<'a>(
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
unsafe fn planned_copy_args<'a>(
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

fn strategy(s: u32) -> Result<SwapInStrategy> {
    match s {
        KVT_SWAP_IN_PLAN_THEN_COPY => Ok(SwapInStrategy::PlanThenCopy),
        KVT_SWAP_IN_ONE_BLOCK_PER_REQUEST => Ok(SwapInStrategy::OneBlockPerRequest),
        KVT_SWAP_IN_FEW_MISS => Ok(SwapInStrategy::FewMiss),
        KVT_SWAP_IN_COMPACT => Ok(SwapInStrategy::Compact),
        KVT_SWAP_IN_COMPACT_ONE_LAUNCH => Ok(SwapInStrategy::CompactOneLaunch),
        other => Err(invalid(
            "strategy",
            format!("{other} is not a KVT_SWAP_IN_* strategy (0 to 4)"),
        )),
    }
}

fn stream(s: CUstream) -> Stream {
    // SAFETY: the C ABI's contract: a live stream of the GPU's primary
    // context, or NULL (the CPU executor ignores it).
    unsafe { Stream::from_raw(s) }
}

// ---- pool ------------------------------------------------------------------

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
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let l = layout(unsafe { arg_ref(layout_, "layout")? })?;
        let specs = unsafe { device_specs(devices, num_devices)? };
        let opts = pool_options(unsafe { options.as_ref() });
        unsafe { put_pool(out, || Pool::create_on(l, specs, opts)) }
    })
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
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let specs = unsafe { device_specs(devices, num_devices)? };
        let opts = pool_options(unsafe { options.as_ref() });
        unsafe { put_pool(out, || Pool::open(specs, opts)) }
    })
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
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let l = layout(unsafe { arg_ref(layout_, "layout")? })?;
        let specs = unsafe { device_specs(devices, num_devices)? };
        let opts = pool_options(unsafe { options.as_ref() });
        unsafe { put_pool(out, || Pool::open_or_create(l, specs, opts)) }
    })
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
unsafe fn region_handle(
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

// ---- swap-in ---------------------------------------------------------------

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
        engine.run_with(&args, s, stream(stream_))
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

// ---- tier ------------------------------------------------------------------

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

// ---- tables ---------------------------------------------------------------

/// # Safety
/// A non-null `p` must be a NUL-terminated string.
unsafe fn text_arg<'a>(p: *const c_char, arg: &'static str) -> Result<&'a str> {
    if p.is_null() {
        return Err(invalid(arg, "is a null pointer"));
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| invalid(arg, "is not UTF-8"))
}

/// # Safety
/// Pointers as `kvt_table_load` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_load(
    path: *const c_char,
    key: *const c_char,
    data_bytes: u64,
    wait_ms: u32,
    out: *mut *mut KvtTableLoader,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (path, key) = unsafe { (text_arg(path, "path")?, text_arg(key, "key")?) };
        if out.is_null() {
            return Err(invalid("out", "is a null pointer"));
        }
        let wait = std::time::Duration::from_millis(wait_ms as u64);
        let handle = match crate::table::load(std::path::Path::new(path), key, data_bytes, wait)? {
            crate::table::Load::Ready => std::ptr::null_mut(),
            crate::table::Load::Filling(l) => into_raw(KvtTableLoader {
                tag: KvtTableLoader::TAG,
                loader: Mutex::new(Some(l)),
            }),
        };
        // SAFETY: checked non-null above.
        unsafe { out.write(handle) };
        Ok(())
    })
}

fn with_loader<R>(
    l: &KvtTableLoader,
    f: impl FnOnce(&mut crate::table::TableLoader) -> Result<R>,
) -> Result<R> {
    match lock(&l.loader).as_mut() {
        Some(t) => f(t),
        None => Err(invalid("loader", "was published already")),
    }
}

/// # Safety
/// Pointers as `kvt_table_loader_next_missing` in `bindings/kvtier.h`
/// describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_next_missing(
    loader: *const KvtTableLoader,
    from: u64,
    start: *mut u64,
    end: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let l = unsafe { handle(loader, "loader")? };
        let r = with_loader(l, |t| {
            Ok(t.missing()
                .into_iter()
                .find(|r| r.end > from)
                .map(|r| r.start.max(from)..r.end))
        })?;
        let (a, b) = r.map_or((0, 0), |r| (r.start, r.end));
        // SAFETY: the header's contract.
        unsafe {
            write_out(start, "start", a)?;
            write_out(end, "end", b)
        }
    })
}

/// # Safety
/// Pointers as `kvt_table_loader_write` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_write(
    loader: *const KvtTableLoader,
    offset: u64,
    bytes: *const c_void,
    len: u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let l = unsafe { handle(loader, "loader")? };
        if len > 0 && bytes.is_null() {
            return Err(invalid("bytes", "is a null pointer"));
        }
        let len = usize::try_from(len).map_err(|_| invalid("len", "larger than memory"))?;
        let data: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: `len` readable bytes at `bytes`, per the header.
            unsafe { std::slice::from_raw_parts(bytes as *const u8, len) }
        };
        with_loader(l, |t| t.write(offset, data))
    })
}

/// # Safety
/// `loader` as `kvt_table_loader_publish` in `bindings/kvtier.h` describes it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_publish(loader: *const KvtTableLoader) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let l = unsafe { handle(loader, "loader")? };
        let mut slot = lock(&l.loader);
        let Some(t) = slot.as_ref() else {
            return Err(invalid("loader", "was published already"));
        };
        if !t.missing().is_empty() {
            // refused without giving up the load: write the rest and retry
            let bytes: u64 = t.missing().iter().map(|r| r.end - r.start).sum();
            return Err(Error::Pool(format!(
                "the table cannot be published: {bytes} B of it not written yet"
            )));
        }
        slot.take().expect("checked above").publish()
    })
}

/// # Safety
/// `loader` is null or a live `kvt_table_loader`; not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_close(loader: *mut KvtTableLoader) {
    // SAFETY: the header's contract.
    unsafe { release(loader, "loader") }
}

/// # Safety
/// Pointers as `kvt_table_attach` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_attach(
    path: *const c_char,
    key: *const c_char,
    wait_ms: u32,
    out: *mut *mut KvtTable,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (path, key) = unsafe { (text_arg(path, "path")?, text_arg(key, "key")?) };
        let wait = std::time::Duration::from_millis(wait_ms as u64);
        // SAFETY: the header's contract.
        unsafe {
            put(out, || {
                Ok(KvtTable {
                    tag: KvtTable::TAG,
                    table: crate::table::Table::attach(std::path::Path::new(path), key, wait)?,
                })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_table_data` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_data(
    table: *const KvtTable,
    data: *mut *const c_void,
    len: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let t = unsafe { handle(table, "table")? };
        let d = t.table.data();
        // SAFETY: the header's contract.
        unsafe {
            write_out(data, "data", d.as_ptr() as *const c_void)?;
            write_out(len, "len", d.len() as u64)
        }
    })
}

/// # Safety
/// `table` is null or a live `kvt_table`; not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_close(table: *mut KvtTable) {
    // SAFETY: the header's contract.
    unsafe { release(table, "table") }
}

/// # Safety
/// Pointers as `kvt_table_store_path` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_store_path(
    dir: *const c_char,
    key: *const c_char,
    out: *mut c_char,
    capacity: usize,
    needed: *mut usize,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (dir, key) = unsafe { (text_arg(dir, "dir")?, text_arg(key, "key")?) };
        let path = crate::table::TableStore::new(dir).path_of(key);
        let bytes = path.as_os_str().as_encoded_bytes();
        // SAFETY: the header's contract.
        unsafe { write_out(needed, "needed", bytes.len() + 1)? };
        if capacity < bytes.len() + 1 {
            return Err(invalid(
                "capacity",
                format!("{capacity} bytes; the path needs {}", bytes.len() + 1),
            ));
        }
        if out.is_null() {
            return Err(invalid("out", "is a null pointer"));
        }
        // SAFETY: `capacity` writable bytes at `out`, per the header.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out as *mut u8, bytes.len());
            *out.add(bytes.len()) = 0;
        }
        Ok(())
    })
}

/// # Safety
/// `path` as `kvt_table_destroy` in `bindings/kvtier.h` describes it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_destroy(path: *const c_char) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let path = unsafe { text_arg(path, "path")? };
        crate::table::destroy(std::path::Path::new(path))
    })
}

// ---- Engram gather ---------------------------------------------------------

/// # Safety
/// `out` is null or valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_create(exec: i32, out: *mut *mut KvtEngram) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        unsafe {
            put(out, || {
                executor(exec)
                    .and_then(crate::engram::EngramGatherer::new)
                    .map(|gatherer| KvtEngram {
                        tag: KvtEngram::TAG,
                        gatherer,
                    })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_engram_gather` in `bindings/kvtier.h` describes them;
/// every buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_gather(
    engram: *const KvtEngram,
    args: *const KvtEngramArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let e = unsafe { handle(engram, "engram")? };
        let a = unsafe { arg_ref(args, "args")? };
        let loc = e.gatherer.executor().location();
        let args = unsafe {
            crate::engram::EngramArgs {
                weights: buf(&a.weights, "weights", loc)?,
                scales: buf(&a.scales, "scales", loc)?,
                ids: index_buf(&a.ids, a.ids_type, "ids", loc)?,
                out: buf_mut(&a.out, "out", loc)?,
                out_rows: optional_buf(&a.out_rows, "out_rows", loc)?,
                dim: a.dim,
                block: a.block,
                row_lo: a.row_lo,
                row_hi: a.row_hi,
            }
        };
        e.gatherer.gather(&args, stream(stream_))
    })
}

/// # Safety
/// `engram` is null or a live `kvt_engram`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_check(engram: *const KvtEngram) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        unsafe { handle(engram, "engram")? }.gatherer.check()
    })
}

/// # Safety
/// `engram` is null or a live `kvt_engram`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_destroy(engram: *mut KvtEngram) {
    // SAFETY: the header's contract.
    unsafe { release(engram, "engram") }
}
