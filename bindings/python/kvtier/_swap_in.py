"""The swap-in (SGLang HiSparse semantics, DESIGN.md section 4) from Python:
argument checks, the engine per executor, the call into the C ABI."""

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


def _bytes(a: Array) -> _lib.Buf:
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


def _index_type(a: Array) -> int:
    return _lib.INDEX_INT64 if a.dtype == "int64" else _lib.INDEX_INT32


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
    item_size_bytes: int,
    num_top_k: int,
    hot_buffer_size: int,
    num_real_reqs=None,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
    skip_io: bool = False,
    stream=None,
    strategy: str = "plan_then_copy",
) -> None:
    """One layer's swap-in for a batch, SGLang's arguments and semantics
    (see :func:`kvtier.sglang.load_cache_to_device_buffer_mla`). numpy arrays
    or CPU tensors run on the CPU executor; CUDA tensors on the CUDA executor,
    on `stream` (a ``torch.cuda.Stream`` or a raw ``CUstream`` int; default:
    the current torch stream)."""
    views = {
        name: view(x, name)
        for name, x in [
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
        ]
    }
    optional = {
        name: (None if x is None else view(x, name))
        for name, x in [
            ("num_real_reqs", num_real_reqs),
            ("miss_src", miss_src),
            ("miss_dst", miss_dst),
            ("miss_count", miss_count),
        ]
    }
    everything = [v for v in list(views.values()) + list(optional.values()) if v is not None]
    k = _int(num_top_k, "num_top_k", 1)
    hot = _int(hot_buffer_size, "hot_buffer_size", 1)
    item = _int(item_size_bytes, "item_size_bytes", 1)
    _need(strategy in STRATEGIES, "strategy", f"{strategy!r} is not one of {sorted(STRATEGIES)}")

    # Where it runs: CUDA when the index tensors are on a GPU (host_cache may
    # then be pinned host memory), the CPU otherwise.
    t = views["top_k_tokens"]
    cuda = t.device == "cuda"
    for a in everything:
        if a.name == "host_cache" and cuda:
            # Host memory is fine when the GPU can address it: checked below.
            _need(a.device == "cpu" or a.index == t.index, a.name,
                  f"is on cuda:{a.index}; top_k_tokens is on cuda:{t.index}")
        elif cuda:
            _need(a.device == "cuda" and a.index == t.index, a.name,
                  f"is on {a.device}{'' if a.index < 0 else ':' + str(a.index)}; top_k_tokens is on "
                  f"cuda:{t.index}, and every tensor of a call must be on the same GPU")
        else:
            _need(a.device == "cpu", a.name,
                  f"is on {a.device}:{a.index}; top_k_tokens is on the CPU, so the call runs on the CPU "
                  "executor and every argument must be host memory")

    batch = views["req_pool_indices"].shape[0] if views["req_pool_indices"].shape else 0
    _vector(views["req_pool_indices"], ("int32", "int64"), batch)
    _vector(views["seq_lens"], ("int32", "int64"), batch)
    _matrix(views["top_k_tokens"], "int32", k, rows=batch)
    _matrix(views["top_k_device_locs"], "int32", k, rows=batch, write=True)
    tokens, locs = views["device_buffer_tokens"], views["device_buffer_locs"]
    _matrix(tokens, "int32", hot + 1, write=True)
    requests = tokens.shape[0]
    _matrix(locs, "int32", hot + 1, rows=requests)
    _need(locs.strides[0] == tokens.strides[0] or requests <= 1, "device_buffer_locs",
          f"has row stride {locs.strides[0]}; device_buffer_tokens has {tokens.strides[0]}, and they must match")
    _matrix(views["lru_slots"], "int16", hot, rows=requests, write=True)
    hloc = views["host_cache_locs"]
    _matrix(hloc, "int64", 0, rows=requests)
    for name in ("host_cache", "device_buffer"):
        a = views[name]
        _need(a.contiguous, name, "must be contiguous (rows of item_size_bytes, addressed from its first byte)")
    _need(views["device_buffer"].writable, "device_buffer", "is read-only; the call writes it")
    nr = optional["num_real_reqs"]
    if nr is not None:
        _need(nr.dtype == "int32" and nr.numel >= 1, "num_real_reqs",
              f"must be an int32 tensor of at least one element (it is {nr.dtype} {list(nr.shape)})")
    plan = [optional[n] for n in ("miss_src", "miss_dst", "miss_count")]
    if any(p is not None for p in plan):
        _need(all(p is not None for p in plan), "miss_src", "miss_src, miss_dst and miss_count must be given together")
        src, dst, cnt = plan
        _matrix(src, "int64", k, rows=batch, write=True)
        _matrix(dst, "int32", k, rows=batch, write=True)
        _need(src.strides[0] == dst.strides[0] or batch <= 1, "miss_dst",
              f"has row stride {dst.strides[0]}; miss_src has {src.strides[0]}, and they must match")
        _vector(cnt, ("int32",), batch)
        _need(cnt.writable, "miss_count", "is read-only; the call writes it")

    args = _lib.SwapInArgs()
    args.top_k_tokens = _buf(t)
    args.top_k_stride = t.strides[0] if batch > 1 else t.shape[1]
    args.device_buffer_tokens = _buf(tokens)
    args.device_buffer_locs = _buf(locs)
    args.buffer_stride = tokens.strides[0] if requests > 1 else tokens.shape[1]
    lru = views["lru_slots"]
    args.lru_slots = _buf(lru)
    args.lru_stride = lru.strides[0] if requests > 1 else lru.shape[1]
    args.host_cache_locs = _buf(hloc)
    args.host_stride = hloc.strides[0] if requests > 1 else hloc.shape[1]
    args.max_tokens = min(hloc.shape[1], 2**31 - 1)
    args.host_cache = _bytes(views["host_cache"])
    args.device_buffer = _bytes(views["device_buffer"])
    out = views["top_k_device_locs"]
    args.top_k_device_locs = _buf(out)
    args.out_stride = out.strides[0] if batch > 1 else out.shape[1]
    args.req_pool_indices = _buf(views["req_pool_indices"])
    args.req_pool_indices_type = _index_type(views["req_pool_indices"])
    args.seq_lens = _buf(views["seq_lens"])
    args.seq_lens_type = _index_type(views["seq_lens"])
    args.num_real_reqs = _buf(nr)
    if plan[0] is not None:
        args.miss_src, args.miss_dst, args.miss_count = (_buf(p) for p in plan)
        args.miss_stride = plan[0].strides[0] if batch > 1 else plan[0].shape[1]
    args.num_requests = requests
    args.num_top_k = k
    args.hot_buffer_size = hot
    args.item_size_bytes = item
    args.skip_io = 1 if skip_io else 0

    if cuda:
        engine = engine_for(t.index)
        raw_stream = _cuda_stream(stream, t.index)
        hc = views["host_cache"]
        if hc.device == "cpu" and hc.nbytes:
            args.host_cache = _lib.Buf(engine.map_host(hc.ptr), hc.nbytes)
    else:
        engine = engine_for("cpu")
        raw_stream = 0
    if plan[0] is None:
        _ensure_capacity(engine, batch, k, cuda)
    engine.run(args, STRATEGIES[strategy], raw_stream)


def _ensure_capacity(engine: SwapInEngine, batch: int, k: int, cuda: bool) -> None:
    with engine._lock:
        have_b, have_k = engine.capacity()
        if batch <= have_b and k <= have_k:
            return
        if cuda and sys.modules["torch"].cuda.is_current_stream_capturing():
            raise KvtierError(
                f"the swap-in needs plan scratch for batch {batch} × top-k {k} (it has {have_b} × {have_k}) "
                "and cannot allocate during CUDA graph capture: run the largest batch once before capturing "
                "(SGLang's warm-up does), or call kvtier.sglang.reserve(max_batch, top_k) at start-up"
            )
        engine.reserve(max(batch, have_b, 1), max(k, have_k))


def _cuda_stream(stream, index: int) -> int:
    torch = sys.modules["torch"]
    if stream is None:
        return int(torch.cuda.current_stream(index).cuda_stream)
    if isinstance(stream, int):
        return stream
    raw = getattr(stream, "cuda_stream", None)
    _need(raw is not None, "stream", f"{stream!r} is neither a torch.cuda.Stream nor a raw CUstream int")
    return int(raw)
