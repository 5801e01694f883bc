//! The opaque handles (a type tag first, checked on every use), how they
//! are made, checked and released, and the status code and thread-local
//! message every entry point answers with.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::cuda::KernelBuild;
use crate::error::{Error, Result, invalid};
use crate::pool::{Pool, Region};
use crate::swap_in::SwapInEngine;
use crate::tier::Tier;

use super::types::*;

/// A handle's type tag, so that passing one kind of handle where another is
/// expected is an error rather than a misread.
pub(super) trait Tagged {
    const TAG: u64;
    const NAME: &'static str;
}

/// `kvt_pool`.
#[repr(C)]
pub struct KvtPool {
    pub(super) tag: u64,
    pub(super) pool: Arc<Pool>,
}

/// `kvt_region`.
#[repr(C)]
pub struct KvtRegion {
    pub(super) tag: u64,
    pub(super) pool: Arc<Pool>,
    pub(super) region: Region,
}

/// `kvt_tier`.
#[repr(C)]
pub struct KvtTier {
    pub(super) tag: u64,
    pub(super) tier: Mutex<Tier>,
}

/// `kvt_engram`.
#[repr(C)]
pub struct KvtEngram {
    pub(super) tag: u64,
    pub(super) gatherer: crate::engram::EngramGatherer,
}

/// `kvt_swap_in`.
#[repr(C)]
pub struct KvtSwapIn {
    pub(super) tag: u64,
    pub(super) engine: Mutex<SwapInEngine>,
}

/// `kvt_table_loader`.
#[repr(C)]
pub struct KvtTableLoader {
    pub(super) tag: u64,
    /// None once published.
    pub(super) loader: Mutex<Option<Box<crate::table::TableLoader>>>,
}

/// `kvt_table`.
#[repr(C)]
pub struct KvtTable {
    pub(super) tag: u64,
    pub(super) table: crate::table::Table,
}

/// `kvt_prefix_store`.
#[repr(C)]
pub struct KvtPrefixStore {
    pub(super) tag: u64,
    pub(super) store: crate::prefix_store::PrefixStore,
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
    KvtPrefixStore => b"kvt:pfxs", "kvt_prefix_store";
}

/// The handle behind `p`, after checking it is non-null and of type `T`.
///
/// # Safety
/// A non-null `p` must point to readable memory of at least 8 bytes; a
/// handle this library returned and that was not released satisfies that.
pub(super) unsafe fn handle<'a, T: Tagged>(p: *const T, arg: &'static str) -> Result<&'a T> {
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

pub(super) fn into_raw<T>(value: T) -> *mut T {
    Box::into_raw(Box::new(value))
}

/// Makes a new handle and stores it through `out`, which is checked first
/// (so that nothing is created for a call that is refused).
///
/// # Safety
/// A non-null `out` must be valid for a pointer write.
pub(super) unsafe fn put<T>(out: *mut *mut T, make: impl FnOnce() -> Result<T>) -> Result<()> {
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
pub(super) unsafe fn put_pool(
    out: *mut *mut KvtPool,
    open: impl FnOnce() -> Result<Arc<Pool>>,
) -> Result<()> {
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
pub(super) unsafe fn release<T: Tagged>(p: *mut T, arg: &'static str) {
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
pub(super) unsafe fn write_out<T>(out: *mut T, arg: &'static str, value: T) -> Result<()> {
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
pub(super) unsafe fn arg_ref<'a, T>(p: *const T, arg: &'static str) -> Result<&'a T> {
    if p.is_null() {
        return Err(invalid(arg, "is a null pointer"));
    }
    // SAFETY: per this function's contract.
    Ok(unsafe { &*p })
}

/// A NUL-terminated UTF-8 argument.
///
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a call was reported as an internal error; the object
    // itself holds no invariant a panic could break halfway.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(super) fn set_last_error(msg: String) {
    let msg = CString::new(msg.replace('\0', " ")).expect("NULs were replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

pub(super) fn status_of(e: &Error) -> KvtStatus {
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
pub(super) fn guard(body: impl FnOnce() -> Result<()>) -> KvtStatus {
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
pub(super) fn guard_void(body: impl FnOnce()) {
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
