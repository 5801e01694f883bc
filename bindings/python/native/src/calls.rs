//! The swap-in and the miss-plan replay: SGLang's arguments checked one by
//! one (dtype, shape, strides, device, writability, no two overlapping where
//! one is written), then the library's parameter struct filled and the call
//! made, the GIL released while it runs.

use std::ffi::c_void;

use kvtier::ffi::{
    KvtBuf, KvtEngramArgs, KvtItems, KvtKvBuffers, KvtPlannedCopyArgs, KvtSpecState,
    KvtSpecSwapInArgs, KvtSwapInArgs,
};
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::view::{DType, Device, View, exchange_current_stream, new_call, view};
use crate::{Handle, engine_handle, engram_handle, ensure_capacity, invalid, library, status};

const INDEX_INT32: u32 = 1;
const INDEX_INT64: u32 = 2;
const EXECUTOR_CPU: i32 = -1;

type Arg<'a, 'py> = Option<&'a Bound<'py, PyAny>>;

/// The views of the arguments, None where the argument is None (or absent).
fn views<'a, 'py, const N: usize>(
    args: [(&'static str, Arg<'a, 'py>); N],
) -> PyResult<[Option<View<'a, 'py>>; N]> {
    new_call();
    let mut out: [Option<View<'a, 'py>>; N] = [const { None }; N];
    for (slot, (name, obj)) in out.iter_mut().zip(args) {
        if let Some(obj) = obj.filter(|o| !o.is_none()) {
            *slot = Some(view(obj, name)?);
        }
    }
    Ok(out)
}

fn required<'b, 'a, 'py>(v: &'b Option<View<'a, 'py>>, name: &str) -> PyResult<&'b View<'a, 'py>> {
    v.as_ref()
        .ok_or_else(|| invalid(name, "is None; this call needs it".into()))
}

fn need(cond: bool, arg: &str, msg: impl FnOnce() -> String) -> PyResult<()> {
    if cond {
        Ok(())
    } else {
        Err(invalid(arg, msg()))
    }
}

/// A Python int (not a bool) within lo..=hi.
fn int(value: &Bound<'_, PyAny>, arg: &str, lo: i64, hi: i64) -> PyResult<i64> {
    let v = if value.is_instance_of::<PyBool>() {
        None
    } else {
        value.extract::<i64>().ok()
    };
    let Some(v) = v else {
        let repr = value.repr().map(|r| r.to_string()).unwrap_or_default();
        return Err(invalid(arg, format!("{repr} is not an int")));
    };
    need((lo..=hi).contains(&v), arg, || {
        format!("{v} is outside {lo}..={hi}")
    })?;
    Ok(v)
}

fn matrix(
    a: &View<'_, '_>,
    dtype: DType,
    min_cols: usize,
    rows: Option<usize>,
    write: bool,
) -> PyResult<()> {
    let n = a.name;
    need(a.dtype == dtype, n, || {
        format!("is {}; it must be {}", a.dtype_name(), dtype.name())
    })?;
    need(a.ndim == 2, n, || {
        format!("has shape {}; it must be 2-D", a.shape_list())
    })?;
    let [r, c] = a.shape;
    need(a.numel == 0 || a.strides[1] == 1 || c == 1, n, || {
        format!(
            "has column stride {}; its rows must be contiguous",
            a.strides[1]
        )
    })?;
    need(c >= min_cols, n, || {
        format!("has {c} columns; this call needs at least {min_cols}")
    })?;
    if let Some(rows) = rows {
        need(r >= rows, n, || {
            format!("has {r} rows; this call needs at least {rows}")
        })?;
    }
    need(a.numel == 0 || r <= 1 || a.strides[0] >= c, n, || {
        format!("has overlapping rows (stride {})", a.strides[0])
    })?;
    if write {
        need(a.writable, n, || "is read-only; the call writes it".into())?;
    }
    Ok(())
}

fn vector(a: &View<'_, '_>, dtypes: &[DType], length: usize, arg_len: &str) -> PyResult<()> {
    let n = a.name;
    need(dtypes.contains(&a.dtype), n, || {
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        format!("is {}; it must be {}", a.dtype_name(), names.join(" or "))
    })?;
    need(a.ndim == 1, n, || {
        format!("has shape {}; it must be 1-D", a.shape_list())
    })?;
    need(a.shape[0] >= length, n, || {
        format!("has {} elements; {arg_len} needs {length}", a.shape[0])
    })?;
    need(a.shape[0] <= 1 || a.strides[0] == 1, n, || {
        "must be contiguous".into()
    })
}

/// A plan's two matrices advance together, row by row.
fn same_row_stride(src: &View<'_, '_>, dst: &View<'_, '_>, rows: usize) -> PyResult<()> {
    need(
        src.strides[0] == dst.strides[0] || rows <= 1,
        "miss_dst",
        || {
            format!(
                "has row stride {}; miss_src has {}, and they must match",
                dst.strides[0], src.strides[0]
            )
        },
    )
}

/// Elements between rows (a one-row matrix: its width).
fn row_stride(a: &View<'_, '_>, rows: usize) -> u64 {
    (if rows > 1 { a.strides[0] } else { a.shape[1] }) as u64
}

/// The elements the library may touch: one past the last reachable one.
fn buf(a: Option<&View<'_, '_>>) -> KvtBuf {
    match a {
        Some(a) => KvtBuf {
            ptr: a.ptr as *mut c_void,
            len: a.span as u64,
        },
        None => KvtBuf {
            ptr: std::ptr::null_mut(),
            len: 0,
        },
    }
}

fn index_type(a: &View<'_, '_>) -> u32 {
    if a.dtype == DType::I64 {
        INDEX_INT64
    } else {
        INDEX_INT32
    }
}

/// True for the CUDA executor: CUDA when `first` is on a GPU (host caches
/// may then be host memory the GPU maps), the CPU otherwise; every other
/// argument must be on the same side.
fn placement(all: &[&View<'_, '_>], first: &View<'_, '_>) -> PyResult<bool> {
    let Device::Cuda(gpu) = first.device else {
        for a in all {
            if let Device::Cuda(i) = a.device {
                return Err(invalid(
                    a.name,
                    format!(
                        "is on cuda:{i}; {} is on the CPU, so the call runs on the CPU executor and every argument \
                     must be host memory",
                        first.name
                    ),
                ));
            }
        }
        return Ok(false);
    };
    for a in all {
        let same_gpu = a.device == Device::Cuda(gpu);
        // the KV planes only: host_cache_locs is an index table the kernels
        // read on the GPU like every other argument
        if a.name == "host_cache" || a.name == "host_cache_v" {
            need(a.device == Device::Cpu || same_gpu, a.name, || {
                format!(
                    "is on {}; {} is on cuda:{gpu}",
                    a.device.describe(),
                    first.name
                )
            })?;
        } else {
            need(same_gpu, a.name, || {
                format!(
                    "is on {}; {} is on cuda:{gpu}, and every tensor of a call must be on the same GPU",
                    a.device.describe(),
                    first.name
                )
            })?;
        }
    }
    Ok(true)
}

/// Refuses a written argument that shares memory with any other: the
/// library reads and writes them as separate arrays.
fn no_overlap(all: &[&View<'_, '_>], written: &[&str]) -> PyResult<()> {
    let range = |a: &View<'_, '_>| (a.ptr, a.ptr + (a.span * a.itemsize) as u64);
    for w in all
        .iter()
        .filter(|a| written.contains(&a.name) && a.span > 0)
    {
        let (ws, we) = range(w);
        for o in all.iter().filter(|o| o.name != w.name && o.span > 0) {
            let (os, oe) = range(o);
            if ws < oe && os < we {
                return Err(invalid(
                    w.name,
                    format!(
                        "shares memory with `{}`; the call writes it, so it must be an array of its own",
                        o.name
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn num_real<'b, 'a, 'py>(nr: Option<&'b View<'a, 'py>>) -> PyResult<Option<&'b View<'a, 'py>>> {
    if let Some(v) = nr {
        need(
            v.dtype == DType::I32 && v.numel >= 1,
            "num_real_reqs",
            || {
                format!(
                    "must be an int32 tensor of at least one element (it is {} {})",
                    v.dtype_name(),
                    v.shape_list()
                )
            },
        )?;
    }
    Ok(nr)
}

/// (engine handle, executor, raw stream) for the call.
fn engine_and_stream(
    py: Python<'_>,
    cuda: bool,
    first: &View<'_, '_>,
    stream: Arg<'_, '_>,
) -> PyResult<(Handle, i32, usize)> {
    let Device::Cuda(gpu) = first.device else {
        return Ok((engine_handle(EXECUTOR_CPU)?, EXECUTOR_CPU, 0));
    };
    debug_assert!(cuda);
    Ok((engine_handle(gpu)?, gpu, raw_stream(py, gpu, stream)?))
}

/// The raw CUstream a call on `gpu` runs on: `stream` (a torch.cuda.Stream
/// or a raw int), else torch's current stream.
fn raw_stream(py: Python<'_>, gpu: i32, stream: Arg<'_, '_>) -> PyResult<usize> {
    match stream.filter(|s| !s.is_none()) {
        None => current_stream(py, gpu),
        Some(s) if s.is_instance_of::<pyo3::types::PyInt>() && !s.is_instance_of::<PyBool>() => {
            s.extract()
        }
        Some(s) => match s.getattr("cuda_stream") {
            Ok(r) => r.extract(),
            Err(_) => Err(invalid(
                "stream",
                format!(
                    "{} is neither a torch.cuda.Stream nor a raw CUstream int",
                    s.repr()?
                ),
            )),
        },
    }
}

/// torch's current raw stream on `gpu`.
fn current_stream(py: Python<'_>, gpu: i32) -> PyResult<usize> {
    // torch's DLPack exchange table, where it has one: no Python call
    if let Some(s) = exchange_current_stream(py, gpu)? {
        return Ok(s);
    }
    // torch._C._cuda_getCurrentRawStream: an int, no Stream object made;
    // looked up once (an import and two attribute reads cost about a
    // microsecond a call). None where this torch has no such function.
    static RAW: pyo3::sync::PyOnceLock<Option<Py<PyAny>>> = pyo3::sync::PyOnceLock::new();
    let raw = RAW.get_or_try_init(py, || -> PyResult<_> {
        Ok(py
            .import("torch")?
            .getattr("_C")
            .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
            .ok()
            .map(|f| f.unbind()))
    })?;
    if let Some(f) = raw {
        return f.bind(py).call1((gpu,))?.extract();
    }
    py.import("torch")?
        .getattr("cuda")?
        .call_method1("current_stream", (gpu,))?
        .getattr("cuda_stream")?
        .extract()
}

fn is_capturing(py: Python<'_>) -> PyResult<bool> {
    py.import("torch")?
        .getattr("cuda")?
        .call_method0("is_current_stream_capturing")?
        .is_truthy()
}

/// The KV planes: host_cache/device_buffer and, for MHA, their _v twins;
/// contiguous buffers of any dtype, rows addressed with `items`.
fn kv_buffers(
    items: (u32, u32, u32, u64),
    planes: [(Option<&View<'_, '_>>, Option<&View<'_, '_>>); 2],
    cuda: bool,
    engine: Handle,
) -> PyResult<KvtKvBuffers> {
    let [(hk, dk), (hv, dv)] = planes;
    if hv.is_some() || dv.is_some() {
        need(hv.is_some() && dv.is_some(), "host_cache_v", || {
            "host_cache_v and device_buffer_v go together".into()
        })?;
    }
    let empty = KvtBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
    };
    let (rows_per_page, value_bytes, scale_bytes, page_bytes) = items;
    let mut kv = KvtKvBuffers {
        items: KvtItems {
            rows_per_page,
            value_bytes,
            scale_bytes,
            _reserved: 0,
            page_bytes,
        },
        host_cache: empty,
        device_buffer: empty,
        host_cache_v: empty,
        device_buffer_v: empty,
    };
    let bytes = |a: &View<'_, '_>| KvtBuf {
        ptr: a.ptr as *mut c_void,
        len: a.nbytes() as u64,
    };
    let plane = |host: &View<'_, '_>, device: &View<'_, '_>| -> PyResult<(KvtBuf, KvtBuf)> {
        for a in [host, device] {
            need(a.contiguous, a.name, || {
                "must be contiguous (rows addressed from its first byte)".into()
            })?;
        }
        need(device.writable, device.name, || {
            "is read-only; the call writes it".into()
        })?;
        let mut h = bytes(host);
        if cuda && host.device == Device::Cpu && host.nbytes() > 0 {
            let mut mapped = 0u64;
            // SAFETY: a live engine; an out pointer to a local.
            status(unsafe {
                (library()?.map_host)(engine, host.ptr as *const c_void, &mut mapped)
            })?;
            h.ptr = mapped as *mut c_void;
        }
        Ok((h, bytes(device)))
    };
    if let (Some(h), Some(d)) = (hk, dk) {
        (kv.host_cache, kv.device_buffer) = plane(h, d)?;
    }
    if let (Some(h), Some(d)) = (hv, dv) {
        (kv.host_cache_v, kv.device_buffer_v) = plane(h, d)?;
    }
    Ok(kv)
}

/// A caller's miss plan, checked: all three arrays or none, `cols` misses
/// per row for `batch` rows, written. Returns the C ABI's fields (the three
/// buffers, the row stride, the misses a row holds), or None for no plan.
fn miss_plan(
    plan: [Option<&View<'_, '_>>; 3],
    cols: usize,
    batch: usize,
) -> PyResult<Option<([KvtBuf; 3], u64, u64)>> {
    if plan.iter().all(|p| p.is_none()) {
        return Ok(None);
    }
    let [Some(src), Some(dst), Some(cnt)] = plan else {
        return Err(invalid(
            "miss_src",
            "miss_src, miss_dst and miss_count must be given together".into(),
        ));
    };
    matrix(src, DType::I64, cols, Some(batch), true)?;
    matrix(dst, DType::I32, cols, Some(batch), true)?;
    same_row_stride(src, dst, batch)?;
    vector(cnt, &[DType::I32], batch, "batch")?;
    need(cnt.writable, "miss_count", || {
        "is read-only; the call writes it".into()
    })?;
    Ok(Some((
        [buf(Some(src)), buf(Some(dst)), buf(Some(cnt))],
        row_stride(src, batch),
        src.shape[1].min(dst.shape[1]) as u64,
    )))
}

/// One layer's swap-in for a batch (see `kvtier._swap_in.swap_in`).
#[pyfunction]
#[pyo3(signature = (
    top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
    top_k_device_locs, req_pool_indices, seq_lens, lru_slots, items, num_top_k, hot_buffer_size,
    num_real_reqs=None, miss_src=None, miss_dst=None, miss_count=None, skip_io=false, stream=None, strategy=0,
    block_tokens=None, host_cache_v=None, device_buffer_v=None, layer=-1
))]
#[allow(clippy::too_many_arguments)]
pub fn swap_in<'py>(
    py: Python<'py>,
    top_k_tokens: &Bound<'py, PyAny>,
    device_buffer_tokens: &Bound<'py, PyAny>,
    host_cache_locs: &Bound<'py, PyAny>,
    device_buffer_locs: &Bound<'py, PyAny>,
    host_cache: &Bound<'py, PyAny>,
    device_buffer: &Bound<'py, PyAny>,
    top_k_device_locs: &Bound<'py, PyAny>,
    req_pool_indices: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    lru_slots: &Bound<'py, PyAny>,
    items: (u32, u32, u32, u64),
    num_top_k: &Bound<'py, PyAny>,
    hot_buffer_size: &Bound<'py, PyAny>,
    num_real_reqs: Arg<'_, 'py>,
    miss_src: Arg<'_, 'py>,
    miss_dst: Arg<'_, 'py>,
    miss_count: Arg<'_, 'py>,
    skip_io: bool,
    stream: Arg<'_, 'py>,
    strategy: u32,
    block_tokens: Arg<'_, 'py>,
    host_cache_v: Arg<'_, 'py>,
    device_buffer_v: Arg<'_, 'py>,
    layer: i32,
) -> PyResult<()> {
    let v = views([
        ("top_k_tokens", Some(top_k_tokens)),
        ("device_buffer_tokens", Some(device_buffer_tokens)),
        ("host_cache_locs", Some(host_cache_locs)),
        ("device_buffer_locs", Some(device_buffer_locs)),
        ("host_cache", Some(host_cache)),
        ("device_buffer", Some(device_buffer)),
        ("top_k_device_locs", Some(top_k_device_locs)),
        ("req_pool_indices", Some(req_pool_indices)),
        ("seq_lens", Some(seq_lens)),
        ("lru_slots", Some(lru_slots)),
        ("num_real_reqs", num_real_reqs),
        ("miss_src", miss_src),
        ("miss_dst", miss_dst),
        ("miss_count", miss_count),
        ("host_cache_v", host_cache_v),
        ("device_buffer_v", device_buffer_v),
    ])?;
    let [
        t,
        tokens,
        hloc,
        locs,
        hk,
        dk,
        out,
        req,
        seq,
        lru,
        nr,
        src,
        dst,
        cnt,
        hv,
        dv,
    ] = &v;
    let t = required(t, "top_k_tokens")?;
    let tokens = required(tokens, "device_buffer_tokens")?;
    let hloc = required(hloc, "host_cache_locs")?;
    let locs = required(locs, "device_buffer_locs")?;
    required(hk, "host_cache")?;
    required(dk, "device_buffer")?;
    let out = required(out, "top_k_device_locs")?;
    let req = required(req, "req_pool_indices")?;
    let seq = required(seq, "seq_lens")?;
    let lru = required(lru, "lru_slots")?;
    let k = int(num_top_k, "num_top_k", 1, u32::MAX as i64)? as u32;
    let hot = int(hot_buffer_size, "hot_buffer_size", 1, u32::MAX as i64)? as u32;
    let s = match block_tokens {
        Some(b) if !b.is_none() => int(b, "sparse_block_size", 0, u32::MAX as i64)? as u32,
        _ => 0,
    };
    let entries = k as u64 * s.max(1) as u64;
    let all: Vec<&View<'_, '_>> = v.iter().flatten().collect();
    let cuda = placement(&all, t)?;

    let batch = if req.ndim == 0 { 0 } else { req.shape[0] };
    vector(req, &[DType::I32, DType::I64], batch, "batch")?;
    vector(seq, &[DType::I32, DType::I64], batch, "batch")?;
    matrix(t, DType::I32, k as usize, Some(batch), false)?;
    let entries_cols = usize::try_from(entries).unwrap_or(usize::MAX);
    matrix(out, DType::I32, entries_cols, Some(batch), true)?;
    // Only the hot LRU slots of device_buffer_tokens are read and written;
    // device_buffer_locs also holds the newest token's slot.
    matrix(tokens, DType::I32, hot as usize, None, true)?;
    let requests = tokens.shape[0];
    matrix(locs, DType::I32, hot as usize + 1, Some(requests), false)?;
    matrix(lru, DType::I16, hot as usize, Some(requests), true)?;
    matrix(hloc, DType::I64, 0, Some(requests), false)?;
    let nr = num_real(nr.as_ref())?;
    let plan = miss_plan(
        [src.as_ref(), dst.as_ref(), cnt.as_ref()],
        entries_cols,
        batch,
    )?;
    no_overlap(
        &all,
        &[
            "device_buffer_tokens",
            "lru_slots",
            "top_k_device_locs",
            "device_buffer",
            "device_buffer_v",
            "miss_src",
            "miss_dst",
            "miss_count",
        ],
    )?;

    let (engine, executor, raw_stream) = engine_and_stream(py, cuda, t, stream)?;
    let kv = kv_buffers(
        items,
        [(hk.as_ref(), dk.as_ref()), (hv.as_ref(), dv.as_ref())],
        cuda,
        engine,
    )?;
    let mut args = KvtSwapInArgs {
        top_k_tokens: buf(Some(t)),
        top_k_stride: row_stride(t, batch),
        device_buffer_tokens: buf(Some(tokens)),
        tokens_stride: row_stride(tokens, requests),
        device_buffer_locs: buf(Some(locs)),
        locs_stride: row_stride(locs, requests),
        lru_slots: buf(Some(lru)),
        lru_stride: row_stride(lru, requests),
        host_cache_locs: buf(Some(hloc)),
        host_stride: row_stride(hloc, requests),
        kv,
        top_k_device_locs: buf(Some(out)),
        out_stride: row_stride(out, batch),
        req_pool_indices: buf(Some(req)),
        seq_lens: buf(Some(seq)),
        num_real_reqs: buf(nr),
        miss_src: buf(None),
        miss_dst: buf(None),
        miss_count: buf(None),
        miss_stride: 0,
        miss_capacity: 0,
        req_pool_indices_type: index_type(req),
        seq_lens_type: index_type(seq),
        max_tokens: hloc.shape[1].min(i32::MAX as usize) as u32,
        num_requests: u32::try_from(requests)
            .map_err(|_| invalid("device_buffer_tokens", "has too many rows".into()))?,
        num_top_k: k,
        hot_buffer_size: hot,
        block_tokens: s,
        skip_io: u32::from(skip_io),
        layer,
    };
    if let Some(([src, dst, cnt], stride, capacity)) = plan {
        (args.miss_src, args.miss_dst, args.miss_count) = (src, dst, cnt);
        (args.miss_stride, args.miss_capacity) = (stride, capacity);
    } else {
        let b = u32::try_from(batch).unwrap_or(u32::MAX);
        let e = u32::try_from(entries).unwrap_or(u32::MAX);
        ensure_capacity(executor, engine, b, e, || {
            if cuda { is_capturing(py) } else { Ok(false) }
        })?;
    }
    let lib = library()?;
    let (engine, args_addr) = (engine as usize, &args as *const KvtSwapInArgs as usize);
    // SAFETY: a live engine; every buffer in `args` was checked against the
    // array it came from, and those arrays outlive the call (their Python
    // objects are borrowed by this function's arguments).
    let s = py.detach(|| unsafe {
        (lib.run)(
            engine as Handle,
            args_addr as *const KvtSwapInArgs,
            strategy,
            raw_stream as *mut c_void,
        )
    });
    status(s)
}

/// Replays a recorded miss plan (see `kvtier._swap_in.copy_planned`).
#[pyfunction]
#[pyo3(signature = (
    miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer, items, warps=None, skip_io=false,
    stream=None, host_cache_v=None, device_buffer_v=None
))]
#[allow(clippy::too_many_arguments)]
pub fn copy_planned<'py>(
    py: Python<'py>,
    miss_src: Arg<'_, 'py>,
    miss_dst: Arg<'_, 'py>,
    miss_count: Arg<'_, 'py>,
    num_real_reqs: Arg<'_, 'py>,
    host_cache: Arg<'_, 'py>,
    device_buffer: Arg<'_, 'py>,
    items: (u32, u32, u32, u64),
    warps: Arg<'_, 'py>,
    skip_io: bool,
    stream: Arg<'_, 'py>,
    host_cache_v: Arg<'_, 'py>,
    device_buffer_v: Arg<'_, 'py>,
) -> PyResult<()> {
    let v = views([
        ("miss_src", miss_src),
        ("miss_dst", miss_dst),
        ("miss_count", miss_count),
        ("num_real_reqs", num_real_reqs),
        ("host_cache", host_cache),
        ("device_buffer", device_buffer),
        ("host_cache_v", host_cache_v),
        ("device_buffer_v", device_buffer_v),
    ])?;
    let [src, dst, cnt, nr, hk, dk, hv, dv] = &v;
    let src = required(src, "miss_src")?;
    let dst = required(dst, "miss_dst")?;
    let cnt = required(cnt, "miss_count")?;
    required(hk, "host_cache")?;
    required(dk, "device_buffer")?;
    let all: Vec<&View<'_, '_>> = v.iter().flatten().collect();
    let cuda = placement(&all, cnt)?;
    let rows = if cnt.ndim == 0 { 0 } else { cnt.shape[0] };
    vector(cnt, &[DType::I32], rows, "the plan")?;
    matrix(src, DType::I64, 0, Some(rows), false)?;
    matrix(dst, DType::I32, 0, Some(rows), false)?;
    same_row_stride(src, dst, rows)?;
    let nr = num_real(nr.as_ref())?;
    no_overlap(&all, &["device_buffer", "device_buffer_v"])?;
    let warps = match warps {
        Some(w) if !w.is_none() => int(w, "num_blocks", 0, u32::MAX as i64)? as u32,
        _ => 0,
    };
    let (engine, _, raw_stream) = engine_and_stream(py, cuda, cnt, stream)?;
    let kv = kv_buffers(
        items,
        [(hk.as_ref(), dk.as_ref()), (hv.as_ref(), dv.as_ref())],
        cuda,
        engine,
    )?;
    let args = KvtPlannedCopyArgs {
        miss_src: buf(Some(src)),
        miss_dst: buf(Some(dst)),
        miss_count: buf(Some(cnt)),
        miss_stride: row_stride(src, rows),
        miss_capacity: src.shape[1].min(dst.shape[1]) as u64,
        num_real_reqs: buf(nr),
        kv,
        warps,
        skip_io: u32::from(skip_io),
    };
    let lib = library()?;
    let (engine, args_addr) = (engine as usize, &args as *const KvtPlannedCopyArgs as usize);
    // SAFETY: as in swap_in.
    let s = py.detach(|| unsafe {
        (lib.copy_planned)(
            engine as Handle,
            args_addr as *const KvtPlannedCopyArgs,
            raw_stream as *mut c_void,
        )
    });
    status(s)
}

/// One layer's speculative swap-in (see `kvtier._swap_in.spec_swap_in`):
/// `top_k_tokens`, `top_k_device_locs` and `cache_index` come flattened to
/// rows (`[batch, steps × top_k]`, `[requests, 2 × hash_size]`).
#[pyfunction]
#[pyo3(signature = (
    top_k_tokens, num_steps, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
    top_k_device_locs, req_pool_indices, seq_lens, cache_index, hash_size, cache_policy, scratch_locs,
    scratch_state, num_real_reqs, items, hot_buffer_size, page_size, miss_src=None, miss_dst=None, miss_count=None,
    stream=None
))]
#[allow(clippy::too_many_arguments)]
pub fn spec_swap_in<'py>(
    py: Python<'py>,
    top_k_tokens: &Bound<'py, PyAny>,
    num_steps: &Bound<'py, PyAny>,
    device_buffer_tokens: &Bound<'py, PyAny>,
    host_cache_locs: &Bound<'py, PyAny>,
    device_buffer_locs: &Bound<'py, PyAny>,
    host_cache: &Bound<'py, PyAny>,
    device_buffer: &Bound<'py, PyAny>,
    top_k_device_locs: &Bound<'py, PyAny>,
    req_pool_indices: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    cache_index: &Bound<'py, PyAny>,
    hash_size: &Bound<'py, PyAny>,
    cache_policy: &Bound<'py, PyAny>,
    scratch_locs: &Bound<'py, PyAny>,
    scratch_state: &Bound<'py, PyAny>,
    num_real_reqs: &Bound<'py, PyAny>,
    items: (u32, u32, u32, u64),
    hot_buffer_size: &Bound<'py, PyAny>,
    page_size: &Bound<'py, PyAny>,
    miss_src: Arg<'_, 'py>,
    miss_dst: Arg<'_, 'py>,
    miss_count: Arg<'_, 'py>,
    stream: Arg<'_, 'py>,
) -> PyResult<()> {
    let v = views([
        ("top_k_tokens", Some(top_k_tokens)),
        ("device_buffer_tokens", Some(device_buffer_tokens)),
        ("host_cache_locs", Some(host_cache_locs)),
        ("device_buffer_locs", Some(device_buffer_locs)),
        ("host_cache", Some(host_cache)),
        ("device_buffer", Some(device_buffer)),
        ("top_k_device_locs", Some(top_k_device_locs)),
        ("req_pool_indices", Some(req_pool_indices)),
        ("seq_lens", Some(seq_lens)),
        ("cache_index", Some(cache_index)),
        ("cache_policy", Some(cache_policy)),
        ("scratch_locs", Some(scratch_locs)),
        ("scratch_state", Some(scratch_state)),
        ("num_real_reqs", Some(num_real_reqs)),
        ("miss_src", miss_src),
        ("miss_dst", miss_dst),
        ("miss_count", miss_count),
    ])?;
    let [
        t,
        tokens,
        hloc,
        locs,
        hk,
        dk,
        out,
        req,
        seq,
        index,
        policy,
        scratch,
        state,
        nr,
        src,
        dst,
        cnt,
    ] = &v;
    let t = required(t, "top_k_tokens")?;
    let tokens = required(tokens, "device_buffer_tokens")?;
    let hloc = required(hloc, "host_cache_locs")?;
    let locs = required(locs, "device_buffer_locs")?;
    required(hk, "host_cache")?;
    required(dk, "device_buffer")?;
    let out = required(out, "top_k_device_locs")?;
    let req = required(req, "req_pool_indices")?;
    let seq = required(seq, "seq_lens")?;
    let index = required(index, "cache_index")?;
    let policy = required(policy, "cache_policy")?;
    let scratch = required(scratch, "scratch_locs")?;
    let state = required(state, "scratch_state")?;
    let nr = num_real(Some(required(nr, "num_real_reqs")?))?;
    let steps = int(num_steps, "num_steps", 0, u32::MAX as i64)? as u32;
    let hash = int(hash_size, "hash_size", 1, u32::MAX as i64)? as u64;
    let hot = int(hot_buffer_size, "hot_buffer_size", 1, u32::MAX as i64)? as u32;
    let page = int(page_size, "page_size", 0, u32::MAX as i64)? as u32;
    let all: Vec<&View<'_, '_>> = v.iter().flatten().collect();
    let cuda = placement(&all, t)?;

    let batch = if req.ndim == 0 { 0 } else { req.shape[0] };
    vector(req, &[DType::I32, DType::I64], batch, "batch")?;
    matrix(t, DType::I32, 1, Some(batch), false)?;
    let occurrences = t.shape[1];
    need(
        steps > 0 && occurrences.is_multiple_of(steps as usize),
        "top_k_tokens",
        || format!("has {occurrences} tokens per row, not {steps} steps of equal length"),
    )?;
    let k = u32::try_from(occurrences / steps as usize)
        .map_err(|_| invalid("top_k_tokens", "has too many columns".into()))?;
    vector(
        seq,
        &[DType::I32, DType::I64],
        batch * steps as usize,
        "batch × steps",
    )?;
    matrix(out, DType::I32, occurrences, Some(batch), true)?;
    matrix(scratch, DType::I32, 1, None, true)?;
    let requests = scratch.shape[0];
    let slots = hot as usize + page as usize;
    matrix(tokens, DType::I32, slots, Some(requests), true)?;
    matrix(locs, DType::I32, slots, Some(requests), true)?;
    matrix(hloc, DType::I64, 0, Some(requests), false)?;
    matrix(index, DType::I64, 2 * hash as usize, Some(requests), true)?;
    matrix(policy, DType::I32, hot as usize, Some(requests + 1), true)?;
    matrix(state, DType::I32, 1, Some(requests + 1), true)?;
    let plan = miss_plan(
        [src.as_ref(), dst.as_ref(), cnt.as_ref()],
        occurrences,
        batch,
    )?;
    no_overlap(
        &all,
        &[
            "device_buffer_tokens",
            "device_buffer_locs",
            "top_k_device_locs",
            "device_buffer",
            "cache_index",
            "cache_policy",
            "scratch_locs",
            "scratch_state",
            "miss_src",
            "miss_dst",
            "miss_count",
        ],
    )?;
    let (engine, _, raw_stream) = engine_and_stream(py, cuda, t, stream)?;
    let kv = kv_buffers(
        items,
        [(hk.as_ref(), dk.as_ref()), (None, None)],
        cuda,
        engine,
    )?;
    let count = |a: &View<'_, '_>, axis: usize| a.shape[axis] as u64;
    let mut args = KvtSpecSwapInArgs {
        top_k_tokens: buf(Some(t)),
        top_k_stride: row_stride(t, batch),
        device_buffer_tokens: buf(Some(tokens)),
        tokens_stride: row_stride(tokens, requests),
        device_buffer_locs: buf(Some(locs)),
        locs_stride: row_stride(locs, requests),
        host_cache_locs: buf(Some(hloc)),
        host_stride: row_stride(hloc, requests),
        kv,
        top_k_device_locs: buf(Some(out)),
        out_stride: row_stride(out, batch),
        req_pool_indices: buf(Some(req)),
        seq_lens: buf(Some(seq)),
        num_real_reqs: buf(nr),
        miss_src: buf(None),
        miss_dst: buf(None),
        miss_count: buf(None),
        miss_stride: 0,
        miss_capacity: 0,
        state: KvtSpecState {
            cache_index: buf(Some(index)),
            index_rows: count(index, 0),
            index_stride: row_stride(index, index.shape[0]),
            bank_stride: hash,
            hash_size: hash,
            cache_policy: buf(Some(policy)),
            policy_rows: count(policy, 0),
            policy_stride: row_stride(policy, policy.shape[0]),
            policy_width: count(policy, 1),
            scratch_locs: buf(Some(scratch)),
            scratch_stride: row_stride(scratch, requests),
            scratch_capacity: count(scratch, 1),
            scratch_state: buf(Some(state)),
            state_rows: count(state, 0),
            state_stride: row_stride(state, state.shape[0]),
            state_width: count(state, 1),
        },
        req_pool_indices_type: index_type(req),
        seq_lens_type: index_type(seq),
        max_tokens: hloc.shape[1].min(i32::MAX as usize) as u32,
        num_requests: u32::try_from(requests)
            .map_err(|_| invalid("scratch_locs", "has too many rows".into()))?,
        num_steps: steps,
        num_top_k: k,
        hot_buffer_size: hot,
        page_size: page,
    };
    if let Some(([src, dst, cnt], stride, capacity)) = plan {
        (args.miss_src, args.miss_dst, args.miss_count) = (src, dst, cnt);
        (args.miss_stride, args.miss_capacity) = (stride, capacity);
    }
    let lib = library()?;
    let (engine, args_addr) = (engine as usize, &args as *const KvtSpecSwapInArgs as usize);
    // SAFETY: as in swap_in.
    let s = py.detach(|| unsafe {
        (lib.run_spec)(
            engine as Handle,
            args_addr as *const KvtSpecSwapInArgs,
            raw_stream as *mut c_void,
        )
    });
    status(s)
}

/// One Engram gather (see `kvtier.sglang.engram_gather`): the table as raw
/// addresses (`weight_ptr`, `scale_ptr`) of `rows` rows of global ids
/// `row_lo..`, read where the executor reads (host memory for the CPU, GPU
/// memory or host memory the GPU maps for CUDA); `ids` `[N]` int32/int64 and
/// `out` `[N, dim]` bf16 (uint16 bits) decide the executor.
#[pyfunction]
#[pyo3(signature = (
    weight_ptr, scale_ptr, rows, ids, out, dim, block_size, row_lo, row_hi, out_rows=None, stream=None
))]
#[allow(clippy::too_many_arguments)]
pub fn engram_gather<'py>(
    py: Python<'py>,
    weight_ptr: u64,
    scale_ptr: u64,
    rows: u64,
    ids: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    dim: u32,
    block_size: u32,
    row_lo: i64,
    row_hi: i64,
    out_rows: Arg<'_, 'py>,
    stream: Arg<'_, 'py>,
) -> PyResult<()> {
    new_call();
    let ids = view(ids, "ids")?;
    let out = view(out, "out")?;
    let out_rows = match out_rows.filter(|o| !o.is_none()) {
        Some(o) => Some(view(o, "out_rows")?),
        None => None,
    };
    need(matches!(ids.dtype, DType::I32 | DType::I64), "ids", || {
        format!("is {}; it must be int32 or int64", ids.dtype_name())
    })?;
    need(ids.contiguous, "ids", || "must be contiguous".into())?;
    need(matches!(out.dtype, DType::BF16 | DType::U16), "out", || {
        format!(
            "is {}; it must be bfloat16 (a numpy array: uint16 holding bf16 bits)",
            out.dtype_name()
        )
    })?;
    need(out.contiguous && out.writable, "out", || {
        "must be contiguous and writable".into()
    })?;
    let n = ids.numel;
    need(
        out.numel == n.saturating_mul(dim as usize) && (out.ndim != 2 || out.shape[0] == n),
        "out",
        || {
            format!(
                "has shape {}; it must be [{n}, {dim}] (one row of dim values an id)",
                out.shape_list()
            )
        },
    )?;
    if let Some(r) = &out_rows {
        need(
            r.dtype == DType::I32 && r.contiguous && r.numel == n,
            "out_rows",
            || {
                format!(
                    "is {} {}; it must be a contiguous int32 array of the {n} ids' output rows",
                    r.dtype_name(),
                    r.shape_list()
                )
            },
        )?;
    }
    let mut all = vec![&ids, &out];
    all.extend(out_rows.as_ref());
    let cuda = placement(&all, &ids)?;
    for (ptr, name) in [(weight_ptr, "weight_ptr"), (scale_ptr, "scale_ptr")] {
        need(ptr != 0 || rows == 0, name, || {
            "is 0 (a null address)".into()
        })?;
    }
    let per_row = if block_size != 0 && dim.is_multiple_of(block_size) {
        (dim / block_size) as u64
    } else {
        0 // the library refuses the block size before it reads the scales
    };
    let bytes = |per: u64, name: &str| {
        rows.checked_mul(per)
            .ok_or_else(|| invalid(name, format!("{rows} rows of {per} bytes overflow")))
    };
    let args = KvtEngramArgs {
        weights: KvtBuf {
            ptr: weight_ptr as *mut c_void,
            len: bytes(dim as u64, "weight_ptr")?,
        },
        scales: KvtBuf {
            ptr: scale_ptr as *mut c_void,
            len: bytes(per_row, "scale_ptr")?,
        },
        ids: buf(Some(&ids)),
        out: buf(Some(&out)),
        out_rows: buf(out_rows.as_ref()),
        row_lo,
        row_hi,
        dim,
        block: block_size,
        ids_type: index_type(&ids),
    };
    let (executor, raw) = match ids.device {
        Device::Cuda(gpu) => (gpu, raw_stream(py, gpu, stream)?),
        Device::Cpu => (EXECUTOR_CPU, 0),
    };
    debug_assert_eq!(cuda, executor != EXECUTOR_CPU);
    let handle = engram_handle(executor)? as usize;
    let lib = library()?;
    let args_addr = &args as *const KvtEngramArgs as usize;
    // SAFETY: `args` lives across the call; its buffers are the arrays'
    // memory (checked above: dtype, contiguity, lengths) and the caller's
    // table addresses (the contract of kvtier.sglang.engram_gather).
    let s = py.detach(|| unsafe {
        (lib.engram_gather)(
            handle as Handle,
            args_addr as *const KvtEngramArgs,
            raw as *mut c_void,
        )
    });
    status(s)
}
