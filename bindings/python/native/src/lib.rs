//! `kvtier._native`: the Python package's per-layer calls (the swap-in and
//! the miss-plan replay), with every argument check in Rust so that a call
//! costs microseconds whatever the arrays are. numpy arrays are read from
//! the array object itself; torch tensors through torch's DLPack C exchange
//! table where it has one (see the view module).
//!
//! The calls go through the C ABI of the `libkvtier.so` the package has
//! loaded (its function addresses are handed over by [`bind`]), so the
//! process holds one copy of the library: one set of engines, one error
//! state. The parameter structs are the library's own (`kvtier::ffi`), not a
//! mirror.

mod calls;
mod view;

use std::ffi::{CStr, c_char, c_void};
use std::sync::{Mutex, OnceLock};

use kvtier::ffi::{KvtEngramArgs, KvtPlannedCopyArgs, KvtSpecSwapInArgs, KvtStatus, KvtSwapInArgs};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

type Handle = *mut c_void;

type CreateFn = unsafe extern "C" fn(i32, *mut Handle) -> KvtStatus;
type ReserveFn = unsafe extern "C" fn(Handle, u32, u32) -> KvtStatus;
type CapacityFn = unsafe extern "C" fn(Handle, *mut u32, *mut u32) -> KvtStatus;
type RunFn = unsafe extern "C" fn(Handle, *const KvtSwapInArgs, u32, *mut c_void) -> KvtStatus;
type CopyPlannedFn =
    unsafe extern "C" fn(Handle, *const KvtPlannedCopyArgs, *mut c_void) -> KvtStatus;
type RunSpecFn = unsafe extern "C" fn(Handle, *const KvtSpecSwapInArgs, *mut c_void) -> KvtStatus;
type MapHostFn = unsafe extern "C" fn(Handle, *const c_void, *mut u64) -> KvtStatus;
type LastErrorFn = unsafe extern "C" fn() -> *const c_char;
type EngramGatherFn = unsafe extern "C" fn(Handle, *const KvtEngramArgs, *mut c_void) -> KvtStatus;

/// The library functions the calls use (bindings/kvtier.h's signatures).
struct Library {
    create: CreateFn,
    reserve: ReserveFn,
    capacity: CapacityFn,
    run: RunFn,
    copy_planned: CopyPlannedFn,
    run_spec: RunSpecFn,
    map_host: MapHostFn,
    last_error: LastErrorFn,
    engram_create: CreateFn,
    engram_gather: EngramGatherFn,
}

static LIBRARY: OnceLock<Library> = OnceLock::new();

fn library() -> PyResult<&'static Library> {
    LIBRARY.get().ok_or_else(|| {
        refuse_status(
            "kvtier._native is not bound to the library yet".into(),
            "NO_LIBRARY",
        )
    })
}

/// Binds the module to the loaded library: `functions` maps each C function
/// name to its address in this process.
#[pyfunction]
fn bind(functions: &Bound<'_, PyDict>) -> PyResult<()> {
    let addr = |name: &str| -> PyResult<usize> {
        let a: usize = functions
            .get_item(name)?
            .ok_or_else(|| refuse_status(format!("bind: no address for {name}"), "NO_LIBRARY"))?
            .extract()?;
        if a == 0 {
            return Err(refuse_status(
                format!("bind: {name} is at address 0"),
                "NO_LIBRARY",
            ));
        }
        Ok(a)
    };
    // SAFETY: the addresses are the library's exported functions (the
    // caller's contract: ctypes' own function pointers), whose signatures
    // are those of bindings/kvtier.h, which these types spell.
    let lib = unsafe {
        Library {
            create: std::mem::transmute::<usize, CreateFn>(addr("kvt_swap_in_create")?),
            reserve: std::mem::transmute::<usize, ReserveFn>(addr("kvt_swap_in_reserve")?),
            capacity: std::mem::transmute::<usize, CapacityFn>(addr("kvt_swap_in_capacity")?),
            run: std::mem::transmute::<usize, RunFn>(addr("kvt_swap_in_run")?),
            copy_planned: std::mem::transmute::<usize, CopyPlannedFn>(addr(
                "kvt_swap_in_copy_planned",
            )?),
            run_spec: std::mem::transmute::<usize, RunSpecFn>(addr("kvt_swap_in_run_spec")?),
            map_host: std::mem::transmute::<usize, MapHostFn>(addr("kvt_swap_in_map_host")?),
            last_error: std::mem::transmute::<usize, LastErrorFn>(addr("kvt_last_error")?),
            engram_create: std::mem::transmute::<usize, CreateFn>(addr("kvt_engram_create")?),
            engram_gather: std::mem::transmute::<usize, EngramGatherFn>(addr("kvt_engram_gather")?),
        }
    };
    // A second bind (the same library) keeps the first.
    let _ = LIBRARY.set(lib);
    Ok(())
}

/// The process's swap-in engine per executor (-1: the CPU, else a GPU
/// ordinal), with the plan scratch it was last seen to hold.
struct Engine {
    executor: i32,
    handle: usize,
    capacity: (u32, u32),
}

static ENGINES: Mutex<Vec<Engine>> = Mutex::new(Vec::new());

fn engines_lock() -> std::sync::MutexGuard<'static, Vec<Engine>> {
    ENGINES.lock().unwrap_or_else(|p| p.into_inner())
}

/// The handle for `executor` in `list`, made with `create` on first use
/// (it lives as long as the process).
fn handle_in(list: &Mutex<Vec<Engine>>, executor: i32, create: CreateFn) -> PyResult<Handle> {
    let rc = {
        let mut all = list.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = all.iter().find(|e| e.executor == executor) {
            return Ok(e.handle as Handle);
        }
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: an out pointer to a local. Made under the lock, so the
        // process has one handle per executor; no Python runs here.
        let rc = unsafe { create(executor, &mut h) };
        if rc == kvtier::ffi::KVT_OK {
            all.push(Engine {
                executor,
                handle: h as usize,
                capacity: (0, 0),
            });
            return Ok(h);
        }
        rc
    };
    // the error (a Python object) made outside the lock
    Err(status(rc).expect_err("a failed create"))
}

/// The swap-in engine handle for `executor`.
fn engine_handle(executor: i32) -> PyResult<Handle> {
    handle_in(&ENGINES, executor, library()?.create)
}

/// How plain torch tensors are read now ("exchange", "to_dlpack" or
/// "methods"), after setting it to `reader` ("auto", "to_dlpack",
/// "methods") if given: for the tests that compare the readers, and for
/// the per-call benchmark.
#[pyfunction]
#[pyo3(signature = (reader=None))]
fn tensor_reader(py: Python<'_>, reader: Option<&str>) -> PyResult<&'static str> {
    if let Some(r) = reader {
        view::TensorReader::of_name(r)
            .ok_or_else(|| {
                invalid(
                    "reader",
                    format!("{r:?} is not one of auto, to_dlpack, methods"),
                )
            })?
            .set();
    }
    view::tensor_reader_in_use(py)
}

/// The engine of `executor` ("the process's engine"), as an address for
/// ctypes (`kvt_swap_in_check`, `kvt_swap_in_reserve`).
#[pyfunction]
fn engine(executor: i32) -> PyResult<usize> {
    engine_handle(executor).map(|h| h as usize)
}

/// The engines made so far, as (executor, address).
#[pyfunction]
fn engines() -> Vec<(i32, usize)> {
    made_in(&ENGINES)
}

/// The handles `list` holds, as (executor, address).
fn made_in(list: &Mutex<Vec<Engine>>) -> Vec<(i32, usize)> {
    list.lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|e| (e.executor, e.handle))
        .collect()
}

/// The process's Engram gatherer per executor (its capacity unused).
static ENGRAMS: Mutex<Vec<Engine>> = Mutex::new(Vec::new());

/// The Engram gatherer of `executor`, made on first use.
fn engram_handle(executor: i32) -> PyResult<Handle> {
    handle_in(&ENGRAMS, executor, library()?.engram_create)
}

/// The Engram gatherer of `executor`, as an address for ctypes
/// (`kvt_engram_check`).
#[pyfunction]
fn engram(executor: i32) -> PyResult<usize> {
    engram_handle(executor).map(|h| h as usize)
}

/// The Engram gatherers made so far, as (executor, address).
#[pyfunction]
fn engrams() -> Vec<(i32, usize)> {
    made_in(&ENGRAMS)
}

/// Makes sure the engine of `executor` has plan scratch for `batch` ×
/// `entries`; `capturing` says whether growing it now would break a CUDA
/// graph capture (then it is refused).
fn ensure_capacity(
    executor: i32,
    handle: Handle,
    batch: u32,
    entries: u32,
    capturing: impl FnOnce() -> PyResult<bool>,
) -> PyResult<()> {
    // The engines' lock guards the cached capacity only: no Python and no
    // library call runs under it (a Python call may let another thread take
    // the GIL, and that thread may be waiting for this lock).
    let cached = |set: Option<(u32, u32)>| -> Option<(u32, u32)> {
        let mut all = engines_lock();
        let e = all.iter_mut().find(|e| e.executor == executor)?;
        if let Some(c) = set {
            e.capacity = c;
        }
        Some(e.capacity)
    };
    let fits = |c: (u32, u32)| batch <= c.0 && entries <= c.1;
    let Some(have) = cached(None) else {
        return Err(refuse_status(
            "engine not registered".into(),
            "INTERNAL_ERROR",
        ));
    };
    if fits(have) {
        return Ok(());
    }
    let lib = library()?;
    let read = || -> PyResult<(u32, u32)> {
        let (mut b, mut k) = (0u32, 0u32);
        // SAFETY: a live engine; out pointers to locals.
        status(unsafe { (lib.capacity)(handle, &mut b, &mut k) })?;
        Ok((b, k))
    };
    // Someone (kvtier.sglang.reserve) may have grown it meanwhile.
    let (have_b, have_k) = read()?;
    cached(Some((have_b, have_k)));
    if fits((have_b, have_k)) {
        return Ok(());
    }
    if capturing()? {
        return Err(refuse(format!(
            "the swap-in needs plan scratch for batch {batch} × {entries} entries (it has {have_b} × {have_k}) \
             and cannot allocate during CUDA graph capture: run the largest batch once before capturing \
             (SGLang's warm-up does), or call kvtier.sglang.reserve(max_batch, top_k) at start-up"
        )));
    }
    // SAFETY: a live engine handle.
    status(unsafe { (lib.reserve)(handle, batch.max(have_b).max(1), entries.max(have_k)) })?;
    cached(Some(read()?));
    Ok(())
}

/// kvtier's exception class, `kvtier._lib.KvtierError(message, status)`.
fn error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    ERROR.import(py, "kvtier._lib", "KvtierError")
}

fn refuse_status(message: String, status: &'static str) -> PyErr {
    Python::attach(|py| match error_type(py) {
        Ok(t) => match t.call1((message.clone(), status)) {
            Ok(e) => PyErr::from_value(e),
            Err(e) => e,
        },
        Err(e) => e,
    })
}

/// A refused argument (status INVALID_ARGUMENT), the message as is.
pub(crate) fn refuse(message: String) -> PyErr {
    refuse_status(message, "INVALID_ARGUMENT")
}

/// `invalid argument `arg`: msg`, as the library words it.
pub(crate) fn invalid(arg: &str, msg: String) -> PyErr {
    refuse(format!("invalid argument `{arg}`: {msg}"))
}

const STATUS_NAMES: [&str; 9] = [
    "OK",
    "INVALID_ARGUMENT",
    "KERNELS_NOT_BUILT",
    "NO_DRIVER",
    "DRIVER_ERROR",
    "BAD_INDICES",
    "POOL_ERROR",
    "IO_ERROR",
    "INTERNAL_ERROR",
];

/// Ok for KVT_OK, else the library's error with its message.
fn status(s: KvtStatus) -> PyResult<()> {
    if s == kvtier::ffi::KVT_OK {
        return Ok(());
    }
    let message = match LIBRARY.get() {
        // SAFETY: kvt_last_error returns this thread's NUL-terminated message.
        Some(lib) => unsafe { CStr::from_ptr((lib.last_error)()) }
            .to_string_lossy()
            .into_owned(),
        None => String::new(),
    };
    let name = usize::try_from(s)
        .ok()
        .and_then(|i| STATUS_NAMES.get(i))
        .copied()
        .unwrap_or("INTERNAL_ERROR");
    Err(refuse_status(message, name))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(bind, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_reader, m)?)?;
    m.add_function(wrap_pyfunction!(engine, m)?)?;
    m.add_function(wrap_pyfunction!(engines, m)?)?;
    m.add_function(wrap_pyfunction!(calls::swap_in, m)?)?;
    m.add_function(wrap_pyfunction!(calls::copy_planned, m)?)?;
    m.add_function(wrap_pyfunction!(calls::spec_swap_in, m)?)?;
    m.add_function(wrap_pyfunction!(calls::engram_gather, m)?)?;
    m.add_function(wrap_pyfunction!(engram, m)?)?;
    m.add_function(wrap_pyfunction!(engrams, m)?)?;
    Ok(())
}
