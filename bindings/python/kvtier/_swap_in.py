"""The swap-in and the miss-plan replay from Python (the semantics are the
library's, documented in its swap_in module): argument checks, the engine per
executor, the calls into the C ABI."""

from __future__ import annotations

import ctypes
import sys
import threading

from . import _lib
from ._arrays import Array, view
from ._lib import KvtierError, check, library

STRATEGIES = {"plan_then_copy": _lib.PLAN_THEN_COPY, "one_block_per_request": _lib.ONE_BLOCK_PER_REQUEST}


class SwapInEngine:
    """A swap-in engine on one executor: ``"cpu"`` or a CUDA device ordinal.
    It owns the plan scratch (grown by :meth:`reserve`, never shrunk, kept
    alive for CUDA graphs captured earlier) and the error word."""

    def __init__(self, executor="cpu"):
        ordinal = _lib.EXECUTOR_CPU if executor == "cpu" else int(executor)
        if ordinal < _lib.EXECUTOR_CPU:
            raise KvtierError(f"executor {executor!r} is neither 'cpu' nor a GPU ordinal")
        self.executor = executor
        handle = ctypes.c_void_p()
        check(library().kvt_swap_in_create(ordinal, ctypes.byref(handle)))
        self._handle = handle
        self._lock = threading.Lock()
        self._capacity = (0, 0)

    def reserve(self, max_batch: int, max_top_k: int) -> None:
        check(library().kvt_swap_in_reserve(self._handle, int(max_batch), int(max_top_k)))
        b, k = ctypes.c_uint32(), ctypes.c_uint32()
        check(library().kvt_swap_in_capacity(self._handle, ctypes.byref(b), ctypes.byref(k)))
        # Kept here so the per-layer call does not ask the library each time.
        self._capacity = (b.value, k.value)

    def capacity(self) -> tuple:
        return self._capacity

    def map_host(self, host_addr: int) -> int:
        """The address the engine's kernels use for host memory at `host_addr`
        (the mapped device address of pinned or registered memory for the CUDA
        executor; a clear error for memory that is neither)."""
        out = ctypes.c_uint64()
        check(library().kvt_swap_in_map_host(self._handle, ctypes.c_void_p(host_addr), ctypes.byref(out)))
        return out.value

    def check(self) -> None:
        """Waits for the device, then raises the bad indices recorded since the
        last check (a KvtierError with status BAD_INDICES)."""
        check(library().kvt_swap_in_check(self._handle))

    def run(self, args: "_lib.SwapInArgs", strategy: int, stream: int) -> None:
        check(library().kvt_swap_in_run(self._handle, ctypes.byref(args), strategy, ctypes.c_void_p(stream)))

    def copy_planned(self, args: "_lib.PlannedCopyArgs", stream: int) -> None:
        check(library().kvt_swap_in_copy_planned(self._handle, ctypes.byref(args), ctypes.c_void_p(stream)))

    def close(self) -> None:
        if self._handle:
            library().kvt_swap_in_destroy(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_engines: dict = {}
_engines_lock = threading.Lock()


def swap_in_limits() -> tuple:
    """(max_hot, max_entries): the most LRU slots per request (SGLang's
    device_buffer_size) and resolved top-k entries per row any swap-in takes."""
    hot, entries = ctypes.c_uint32(), ctypes.c_uint32()
    check(library().kvt_swap_in_limits(ctypes.byref(hot), ctypes.byref(entries)))
    return hot.value, entries.value


def engine_for(executor) -> SwapInEngine:
    """The process's engine for `executor` ("cpu" or a GPU ordinal)."""
    with _engines_lock:
        e = _engines.get(executor)
        if e is None:
            e = _engines[executor] = SwapInEngine(executor)
        return e


def _buf(a: Array | None) -> _lib.Buf:
    if a is None:
        return _lib.Buf(None, 0)
    # One past the last element reachable through the strides: what the
    # library may touch, and all the caller's tensor is known to hold.
    return _lib.Buf(a.ptr or None, a.span())


def _bytes(a: Array | None) -> _lib.Buf:
    if a is None:
        return _lib.Buf(None, 0)
    return _lib.Buf(a.ptr or None, a.nbytes)


def _need(cond: bool, arg: str, msg: str) -> None:
    if not cond:
        raise KvtierError(f"invalid argument `{arg}`: {msg}")


def _int(value, arg: str, lo: int = 0, hi: int = 2**32 - 1) -> int:
    _need(isinstance(value, int) and not isinstance(value, bool), arg, f"{value!r} is not an int")
    _need(lo <= value <= hi, arg, f"{value} is outside {lo}..={hi}")
    return value


def _matrix(a: Array, dtype: str, min_cols: int, rows: int | None = None, write: bool = False) -> None:
    _need(a.dtype == dtype, a.name, f"is {a.dtype}; it must be {dtype}")
    _need(len(a.shape) == 2, a.name, f"has shape {list(a.shape)}; it must be 2-D")
    _need(a.numel == 0 or a.strides[1] == 1 or a.shape[1] == 1, a.name,
          f"has column stride {a.strides[1]}; its rows must be contiguous")
    _need(a.shape[1] >= min_cols, a.name, f"has {a.shape[1]} columns; this call needs at least {min_cols}")
    if rows is not None:
        _need(a.shape[0] >= rows, a.name, f"has {a.shape[0]} rows; this call needs at least {rows}")
    _need(a.numel == 0 or a.shape[0] <= 1 or a.strides[0] >= a.shape[1], a.name,
          f"has overlapping rows (stride {a.strides[0]})")
    if write:
        _need(a.writable, a.name, "is read-only; the call writes it")


def _vector(a: Array, dtypes: tuple, length: int, arg_len: str = "batch") -> None:
    _need(a.dtype in dtypes, a.name, f"is {a.dtype}; it must be {' or '.join(dtypes)}")
    _need(len(a.shape) == 1, a.name, f"has shape {list(a.shape)}; it must be 1-D")
    _need(a.shape[0] >= length, a.name, f"has {a.shape[0]} elements; {arg_len} needs {length}")
    _need(a.shape[0] <= 1 or a.strides[0] == 1, a.name, "must be contiguous")


def _stride(a: Array, rows: int) -> int:
    """Elements between rows (a one-row matrix: its width)."""
    return a.strides[0] if rows > 1 else a.shape[1]


def _index_type(a: Array) -> int:
    return _lib.INDEX_INT64 if a.dtype == "int64" else _lib.INDEX_INT32


def _views(pairs) -> dict:
    return {name: (None if x is None else view(x, name)) for name, x in pairs}


def _placement(views: list, first: Array) -> bool:
    """True for the CUDA executor: CUDA when `first` is on a GPU (host caches
    may then be pinned host memory), the CPU otherwise. Every other tensor
    must be on the same side."""
    cuda = first.device == "cuda"
    for a in views:
        if a.name.startswith("host_cache") and cuda:
            # Host memory is fine when the GPU can address it: checked later.
            _need(a.device == "cpu" or a.index == first.index, a.name,
                  f"is on cuda:{a.index}; {first.name} is on cuda:{first.index}")
        elif cuda:
            _need(a.device == "cuda" and a.index == first.index, a.name,
                  f"is on {a.device}{'' if a.index < 0 else ':' + str(a.index)}; {first.name} is on "
                  f"cuda:{first.index}, and every tensor of a call must be on the same GPU")
        else:
            _need(a.device == "cpu", a.name,
                  f"is on {a.device}:{a.index}; {first.name} is on the CPU, so the call runs on the CPU "
                  "executor and every argument must be host memory")
    return cuda


def _num_real(nr: Array | None) -> Array | None:
    if nr is not None:
        _need(nr.dtype == "int32" and nr.numel >= 1, "num_real_reqs",
              f"must be an int32 tensor of at least one element (it is {nr.dtype} {list(nr.shape)})")
    return nr


def _engine(cuda: bool, first: Array, stream) -> tuple:
    """(engine, raw stream): `first`'s GPU and the given (or current torch)
    stream for the CUDA executor, the CPU engine and no stream otherwise."""
    if cuda:
        return engine_for(first.index), _cuda_stream(stream, first.index)
    return engine_for("cpu"), 0


def _kv_buffers(v: dict, items: "_lib.Items", cuda: bool, engine: SwapInEngine) -> "_lib.KvBuffers":
    """The KV planes: host_cache/device_buffer and, for MHA, their _v twins;
    contiguous buffers of any dtype, rows addressed with `items`."""
    planes = [("host_cache", "device_buffer")]
    if v.get("host_cache_v") is not None or v.get("device_buffer_v") is not None:
        _need(v.get("host_cache_v") is not None and v.get("device_buffer_v") is not None, "host_cache_v",
              "host_cache_v and device_buffer_v go together")
        planes.append(("host_cache_v", "device_buffer_v"))
    kv = _lib.KvBuffers()
    kv.items = items
    for host_name, device_name in planes:
        for name in (host_name, device_name):
            _need(v[name].contiguous, name, "must be contiguous (rows addressed from its first byte)")
        _need(v[device_name].writable, device_name, "is read-only; the call writes it")
        host = _bytes(v[host_name])
        if cuda and v[host_name].device == "cpu" and v[host_name].nbytes:
            host = _lib.Buf(engine.map_host(v[host_name].ptr), v[host_name].nbytes)
        setattr(kv, host_name, host)
        setattr(kv, device_name, _bytes(v[device_name]))
    return kv


def swap_in(
    top_k_tokens,
    device_buffer_tokens,
    host_cache_locs,
    device_buffer_locs,
    host_cache,
    device_buffer,
    top_k_device_locs,
    req_pool_indices,
    seq_lens,
    lru_slots,
    items: "_lib.Items",
    num_top_k: int,
    hot_buffer_size: int,
    num_real_reqs=None,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
    skip_io: bool = False,
    stream=None,
    strategy: str = "plan_then_copy",
    block_tokens: int = 0,
    host_cache_v=None,
    device_buffer_v=None,
) -> None:
    """One layer's swap-in for a batch, SGLang's arguments and semantics (see
    :mod:`kvtier.sglang`). `items` addresses the KV rows
    (:func:`kvtier._lib.linear_items`, :func:`kvtier._lib.dsv4_items`);
    `block_tokens` > 0 makes `top_k_tokens` block ids of that many tokens;
    `host_cache_v`/`device_buffer_v` are MHA's V plane. numpy arrays or CPU
    tensors run on the CPU executor; CUDA tensors on the CUDA executor, on
    `stream` (a ``torch.cuda.Stream`` or a raw ``CUstream`` int; default: the
    current torch stream)."""
    v = _views([
        ("top_k_tokens", top_k_tokens),
        ("device_buffer_tokens", device_buffer_tokens),
        ("host_cache_locs", host_cache_locs),
        ("device_buffer_locs", device_buffer_locs),
        ("host_cache", host_cache),
        ("device_buffer", device_buffer),
        ("top_k_device_locs", top_k_device_locs),
        ("req_pool_indices", req_pool_indices),
        ("seq_lens", seq_lens),
        ("lru_slots", lru_slots),
        ("num_real_reqs", num_real_reqs),
        ("miss_src", miss_src),
        ("miss_dst", miss_dst),
        ("miss_count", miss_count),
        ("host_cache_v", host_cache_v),
        ("device_buffer_v", device_buffer_v),
    ])
    for name in ("top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs", "host_cache",
                 "device_buffer", "top_k_device_locs", "req_pool_indices", "seq_lens", "lru_slots"):
        _need(v[name] is not None, name, "is None; this call needs it")
    k = _int(num_top_k, "num_top_k", 1)
    hot = _int(hot_buffer_size, "hot_buffer_size", 1)
    s = _int(block_tokens, "sparse_block_size", 0)
    entries = k * max(s, 1)
    _need(strategy in STRATEGIES, "strategy", f"{strategy!r} is not one of {sorted(STRATEGIES)}")
    t = v["top_k_tokens"]
    cuda = _placement([a for a in v.values() if a is not None], t)

    batch = v["req_pool_indices"].shape[0] if v["req_pool_indices"].shape else 0
    _vector(v["req_pool_indices"], ("int32", "int64"), batch)
    _vector(v["seq_lens"], ("int32", "int64"), batch)
    _matrix(t, "int32", k, rows=batch)
    _matrix(v["top_k_device_locs"], "int32", entries, rows=batch, write=True)
    tokens, locs = v["device_buffer_tokens"], v["device_buffer_locs"]
    # Only the hot LRU slots of device_buffer_tokens are read and written;
    # device_buffer_locs also holds the newest token's slot.
    _matrix(tokens, "int32", hot, write=True)
    requests = tokens.shape[0]
    _matrix(locs, "int32", hot + 1, rows=requests)
    _matrix(v["lru_slots"], "int16", hot, rows=requests, write=True)
    hloc = v["host_cache_locs"]
    _matrix(hloc, "int64", 0, rows=requests)
    nr = _num_real(v["num_real_reqs"])
    plan = [v["miss_src"], v["miss_dst"], v["miss_count"]]
    if any(p is not None for p in plan):
        _need(all(p is not None for p in plan), "miss_src", "miss_src, miss_dst and miss_count must be given together")
        src, dst, cnt = plan
        _matrix(src, "int64", entries, rows=batch, write=True)
        _matrix(dst, "int32", entries, rows=batch, write=True)
        _need(src.strides[0] == dst.strides[0] or batch <= 1, "miss_dst",
              f"has row stride {dst.strides[0]}; miss_src has {src.strides[0]}, and they must match")
        _vector(cnt, ("int32",), batch)
        _need(cnt.writable, "miss_count", "is read-only; the call writes it")

    engine, raw_stream = _engine(cuda, t, stream)
    args = _lib.SwapInArgs()
    args.top_k_tokens = _buf(t)
    args.top_k_stride = _stride(t, batch)
    args.device_buffer_tokens = _buf(tokens)
    args.tokens_stride = _stride(tokens, requests)
    args.device_buffer_locs = _buf(locs)
    args.locs_stride = _stride(locs, requests)
    lru = v["lru_slots"]
    args.lru_slots = _buf(lru)
    args.lru_stride = _stride(lru, requests)
    args.host_cache_locs = _buf(hloc)
    args.host_stride = _stride(hloc, requests)
    args.max_tokens = min(hloc.shape[1], 2**31 - 1)
    args.kv = _kv_buffers(v, items, cuda, engine)
    out = v["top_k_device_locs"]
    args.top_k_device_locs = _buf(out)
    args.out_stride = _stride(out, batch)
    args.req_pool_indices = _buf(v["req_pool_indices"])
    args.req_pool_indices_type = _index_type(v["req_pool_indices"])
    args.seq_lens = _buf(v["seq_lens"])
    args.seq_lens_type = _index_type(v["seq_lens"])
    args.num_real_reqs = _buf(nr)
    if plan[0] is not None:
        args.miss_src, args.miss_dst, args.miss_count = (_buf(p) for p in plan)
        args.miss_stride = _stride(plan[0], batch)
        args.miss_capacity = min(plan[0].shape[1], plan[1].shape[1])
    args.num_requests = requests
    args.num_top_k = k
    args.hot_buffer_size = hot
    args.block_tokens = s
    args.skip_io = 1 if skip_io else 0
    if plan[0] is None:
        _ensure_capacity(engine, batch, entries, cuda)
    engine.run(args, STRATEGIES[strategy], raw_stream)


def copy_planned(
    miss_src,
    miss_dst,
    miss_count,
    num_real_reqs,
    host_cache,
    device_buffer,
    items: "_lib.Items",
    warps: int = 0,
    skip_io: bool = False,
    stream=None,
    host_cache_v=None,
    device_buffer_v=None,
) -> None:
    """Replays a recorded miss plan: for rows below ``num_real_reqs[0]``,
    host rows ``miss_src[r][:miss_count[r]]`` of the host cache go to device
    rows ``miss_dst[r][...]`` (every count and row checked). `warps` caps the
    CUDA grid (0: as the plan needs)."""
    v = _views([
        ("miss_src", miss_src),
        ("miss_dst", miss_dst),
        ("miss_count", miss_count),
        ("num_real_reqs", num_real_reqs),
        ("host_cache", host_cache),
        ("device_buffer", device_buffer),
        ("host_cache_v", host_cache_v),
        ("device_buffer_v", device_buffer_v),
    ])
    for name in ("miss_src", "miss_dst", "miss_count", "host_cache", "device_buffer"):
        _need(v[name] is not None, name, "is None; this call needs it")
    cnt = v["miss_count"]
    cuda = _placement([a for a in v.values() if a is not None], cnt)
    rows = cnt.shape[0] if cnt.shape else 0
    _vector(cnt, ("int32",), rows, "the plan")
    src, dst = v["miss_src"], v["miss_dst"]
    _matrix(src, "int64", 0, rows=rows)
    _matrix(dst, "int32", 0, rows=rows)
    _need(src.strides[0] == dst.strides[0] or rows <= 1, "miss_dst",
          f"has row stride {dst.strides[0]}; miss_src has {src.strides[0]}, and they must match")
    nr = _num_real(v["num_real_reqs"])
    engine, raw_stream = _engine(cuda, cnt, stream)
    args = _lib.PlannedCopyArgs()
    args.miss_src, args.miss_dst, args.miss_count = _buf(src), _buf(dst), _buf(cnt)
    args.miss_stride = _stride(src, rows)
    args.miss_capacity = min(src.shape[1], dst.shape[1])
    args.num_real_reqs = _buf(nr)
    args.kv = _kv_buffers(v, items, cuda, engine)
    args.warps = _int(warps, "num_blocks", 0)
    args.skip_io = 1 if skip_io else 0
    engine.copy_planned(args, raw_stream)


def _ensure_capacity(engine: SwapInEngine, batch: int, entries: int, cuda: bool) -> None:
    with engine._lock:
        have_b, have_k = engine.capacity()
        if batch <= have_b and entries <= have_k:
            return
        if cuda and sys.modules["torch"].cuda.is_current_stream_capturing():
            raise KvtierError(
                f"the swap-in needs plan scratch for batch {batch} × {entries} entries (it has {have_b} × "
                f"{have_k}) and cannot allocate during CUDA graph capture: run the largest batch once before "
                "capturing (SGLang's warm-up does), or call kvtier.sglang.reserve(max_batch, top_k) at start-up"
            )
        engine.reserve(max(batch, have_b, 1), max(entries, have_k))


def _cuda_stream(stream, index: int) -> int:
    torch = sys.modules["torch"]
    if stream is None:
        return int(torch.cuda.current_stream(index).cuda_stream)
    if isinstance(stream, int):
        return stream
    raw = getattr(stream, "cuda_stream", None)
    _need(raw is not None, "stream", f"{stream!r} is neither a torch.cuda.Stream nor a raw CUstream int")
    return int(raw)
