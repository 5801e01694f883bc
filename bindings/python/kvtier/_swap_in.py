"""The swap-in and the miss-plan replay from Python (the semantics are the
library's, documented in its swap_in module). The per-layer calls are made
by the extension module ``kvtier._native``, which checks every argument in
Rust, so a call costs microseconds; the engines (one per executor, for the
process) are the native module's."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
import threading
from pathlib import Path

from . import _lib
from ._lib import KvtierError, check, library

STRATEGIES = {
    "default": _lib.DEFAULT,
    "plan_then_copy": _lib.PLAN_THEN_COPY,
    "one_block_per_request": _lib.ONE_BLOCK_PER_REQUEST,
    "few_miss": _lib.FEW_MISS,
    "compact": _lib.COMPACT,
    "compact_one_launch": _lib.COMPACT_ONE_LAUNCH,
    "few_miss_512": _lib.FEW_MISS_512,
    "few_miss_one_launch": _lib.FEW_MISS_ONE_LAUNCH,
    "few_miss_512_one_launch": _lib.FEW_MISS_512_ONE_LAUNCH,
}

# The library functions the native module calls (by address: one library in
# the process, the one ctypes loaded).
_NATIVE_CALLS = ("kvt_swap_in_create", "kvt_swap_in_reserve", "kvt_swap_in_capacity", "kvt_swap_in_run",
                 "kvt_swap_in_copy_planned", "kvt_swap_in_run_spec", "kvt_swap_in_map_host", "kvt_last_error",
                 "kvt_engram_create", "kvt_engram_gather")
NATIVE_NAME = "_native.abi3.so"
_native_module = None
_native_lock = threading.Lock()


def native():
    """The extension module ``kvtier._native``, loaded and bound to the
    library on first use: from ``KVTIER_NATIVE`` if set, else this package's
    folder, else the library's folder (a checkout's ``target/release``)."""
    global _native_module
    if _native_module is not None:
        return _native_module
    with _native_lock:
        if _native_module is None:
            lib = library()
            env = os.environ.get("KVTIER_NATIVE")
            paths = [Path(env)] if env else [Path(__file__).resolve().parent / NATIVE_NAME,
                                              Path(lib._kvtier_path).resolve().parent / "lib_native.so"]
            found = [p for p in paths if p.is_file()]
            if not found:
                raise KvtierError(
                    "kvtier's extension module was not found; looked in " + ", ".join(map(str, paths)) +
                    ". Install the package with `pip install ./bindings/python` in the repository (it builds the "
                    "module), or set KVTIER_NATIVE to its path.",
                    "NO_LIBRARY",
                )
            loader = importlib.machinery.ExtensionFileLoader("kvtier._native", str(found[0]))
            spec = importlib.util.spec_from_file_location("kvtier._native", str(found[0]), loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            module.bind({name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _NATIVE_CALLS})
            sys.modules["kvtier._native"] = module
            _native_module = module
    return _native_module


@dataclasses.dataclass(frozen=True)
class SwapInCounters:
    """What one layer's swap-ins did since counting began: calls, batch rows
    below ``num_real_reqs``, LRU slots hit and misses loaded by the long rows
    (``seq_len`` above the hot buffer; short rows always live on the device),
    the bytes those misses moved (none with ``skip_io``), and the entries
    refused as bad indices. Speculative swap-ins and plan replays are not
    counted."""

    calls: int = 0
    rows: int = 0
    hits: int = 0
    misses: int = 0
    bytes: int = 0
    bad_indices: int = 0

    @classmethod
    def of(cls, c) -> "SwapInCounters":
        return cls(**{f.name: getattr(c, f.name) for f in dataclasses.fields(cls)})

    @property
    def hit_rate(self):
        """hits / (hits + misses), None before any lookup."""
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else None


class SwapInEngine:
    """A swap-in engine on one executor: ``"cpu"`` or a CUDA device ordinal.
    It owns the plan scratch (grown by :meth:`reserve`, never shrunk, kept
    alive for CUDA graphs captured earlier) and the error word. The
    swap-ins and replays of :func:`swap_in` and :func:`copy_planned` run on
    the process's engine per executor, :func:`engine_for`."""

    def __init__(self, executor="cpu"):
        ordinal = _lib.EXECUTOR_CPU if executor == "cpu" else _lib.as_int(executor, "executor", -1, 2**31 - 1)
        if ordinal < _lib.EXECUTOR_CPU:
            raise KvtierError(f"executor {executor!r} is neither 'cpu' nor a GPU ordinal")
        self.executor = executor
        handle = ctypes.c_void_p()
        check(library().kvt_swap_in_create(ordinal, ctypes.byref(handle)))
        self._handle = handle
        self._owned = True

    @classmethod
    def _borrowed(cls, executor, handle: int) -> "SwapInEngine":
        """A view of an engine someone else owns (the native module's)."""
        e = cls.__new__(cls)
        e.executor, e._handle, e._owned = executor, ctypes.c_void_p(handle), False
        return e

    def reserve(self, max_batch: int, max_top_k: int) -> None:
        check(library().kvt_swap_in_reserve(self._handle, _lib.as_int(max_batch, "max_batch"),
                                            _lib.as_int(max_top_k, "max_top_k")))

    def capacity(self) -> tuple:
        """(max_batch, max_top_k) the plan scratch holds."""
        b, k = ctypes.c_uint32(), ctypes.c_uint32()
        check(library().kvt_swap_in_capacity(self._handle, ctypes.byref(b), ctypes.byref(k)))
        return b.value, k.value

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

    def poll(self):
        """Without waiting: (new entries, report) when a snapshot of the error
        word, taken at the previous poll, holds bad indices no poll reported
        yet; else None (also while the snapshot is in flight, and always on
        the CPU executor, which raises at once). Not during a CUDA graph
        capture."""
        new = ctypes.c_uint32()
        status = library().kvt_swap_in_poll(self._handle, ctypes.byref(new))
        if status == _lib.OK:
            return None
        message = library().kvt_last_error().decode("utf-8", "replace")
        if _lib.STATUS_NAMES.get(status) != "BAD_INDICES":
            raise KvtierError(message, _lib.STATUS_NAMES.get(status, f"STATUS_{status}"))
        return new.value, message

    def enable_counters(self, layers: int) -> None:
        """Starts counting the swap-ins of `layers` layers (1 to 4096): each
        :func:`swap_in` naming a ``layer`` adds to it, on the executor (the
        kernels add with atomics, no host sync). Set-up work, not during a CUDA
        graph capture; again with at most as many layers keeps the counts."""
        check(library().kvt_swap_in_enable_counters(self._handle, _lib.as_int(layers, "layers")))

    def counters(self, wait: bool = True):
        """Each counted layer's :class:`SwapInCounters`, in layer order; None
        while nothing is counted. ``wait``: once the swap-ins launched before
        have finished (the CUDA executor waits for the device). Without it:
        never waits: the CPU executor's counts as they are, the CUDA
        executor's as a copy the previous such call started found them (None
        on the first call and while it is in flight; once per step at most,
        not during a CUDA graph capture)."""
        lib, n = library(), ctypes.c_uint32()
        # capacity 0: the layers counted, nothing read (a poll is taken once)
        check(lib.kvt_swap_in_read_counters(self._handle, 0, None, 0, ctypes.byref(n)))
        if n.value == 0:
            return None
        out = (_lib.SwapInCountersC * n.value)()
        check(lib.kvt_swap_in_read_counters(self._handle, int(bool(wait)), out, n.value, ctypes.byref(n)))
        return [SwapInCounters.of(c) for c in out[: n.value]] if n.value else None

    def close(self) -> None:
        if self._handle and self._owned:
            library().kvt_swap_in_destroy(self._handle)
        self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def swap_in_limits() -> tuple:
    """(max_hot, max_entries): the most LRU slots per request (SGLang's
    device_buffer_size) and resolved top-k entries per row any swap-in takes."""
    hot, entries = ctypes.c_uint32(), ctypes.c_uint32()
    check(library().kvt_swap_in_limits(ctypes.byref(hot), ctypes.byref(entries)))
    return hot.value, entries.value


def cuda_engines() -> list:
    """The process's engines on GPUs made so far, as (ordinal, engine)."""
    if _native_module is None:
        return []
    return [(o, SwapInEngine._borrowed(o, h)) for o, h in _native_module.engines() if o >= 0]


def engine_for(executor) -> SwapInEngine:
    """The process's engine for `executor` ("cpu" or a GPU ordinal): the one
    the swap-ins and replays run on."""
    ordinal = _lib.EXECUTOR_CPU if executor == "cpu" else _lib.as_int(executor, "executor", -1, 2**31 - 1)
    if ordinal < _lib.EXECUTOR_CPU:
        raise KvtierError(f"executor {executor!r} is neither 'cpu' nor a GPU ordinal")
    return SwapInEngine._borrowed(executor, native().engine(ordinal))


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
    items: tuple,
    num_top_k: int,
    hot_buffer_size: int,
    num_real_reqs=None,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
    skip_io: bool = False,
    stream=None,
    strategy: str = "default",
    block_tokens: int = 0,
    host_cache_v=None,
    device_buffer_v=None,
    layer=None,
) -> None:
    """One layer's swap-in for a batch, SGLang's arguments and semantics (see
    :mod:`kvtier.sglang`). `items` addresses the KV rows
    (:func:`kvtier._lib.linear_items`, :func:`kvtier._lib.dsv4_items`);
    `block_tokens` > 0 makes `top_k_tokens` block ids of that many tokens;
    `host_cache_v`/`device_buffer_v` are MHA's V plane. numpy arrays or CPU
    tensors run on the CPU executor; CUDA tensors on the CUDA executor, on
    `stream` (a ``torch.cuda.Stream`` or a raw ``CUstream`` int; default: the
    current torch stream). `layer`: the layer whose counters the call adds to
    (:meth:`SwapInEngine.enable_counters`), None for none."""
    if strategy not in STRATEGIES:
        raise KvtierError(f"invalid argument `strategy`: {strategy!r} is not one of {sorted(STRATEGIES)}")
    native().swap_in(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
        top_k_device_locs, req_pool_indices, seq_lens, lru_slots, _items(items), num_top_k, hot_buffer_size,
        num_real_reqs, miss_src, miss_dst, miss_count, bool(skip_io), stream, STRATEGIES[strategy], block_tokens,
        host_cache_v, device_buffer_v, -1 if layer is None else _lib.as_int(layer, "layer", 0, 2**31 - 1),
    )


def copy_planned(
    miss_src,
    miss_dst,
    miss_count,
    num_real_reqs,
    host_cache,
    device_buffer,
    items: tuple,
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
    native().copy_planned(
        miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer, _items(items), warps,
        bool(skip_io), stream, host_cache_v, device_buffer_v,
    )


def spec_swap_in(
    top_k_tokens,
    device_buffer_tokens,
    host_cache_locs,
    device_buffer_locs,
    host_cache,
    device_buffer,
    top_k_device_locs,
    req_pool_indices,
    seq_lens,
    cache_index,
    cache_policy,
    scratch_locs,
    scratch_state,
    num_real_reqs,
    items: tuple,
    hot_buffer_size: int,
    page_size: int,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
    stream=None,
) -> None:
    """One layer's speculative swap-in (MTP/EAGLE verify), SGLang's arguments
    and semantics: `top_k_tokens` and `top_k_device_locs` are ``[batch,
    steps, top_k]``, `seq_lens` ``[batch × steps]``, and `cache_index`,
    `cache_policy`, `scratch_locs`, `scratch_state` SGLang's
    ``HiSparseSpecState`` (read and written as SGLang lays it out). numpy
    arrays and CPU tensors run on the CPU executor, CUDA tensors on the CUDA
    executor (host caches pinned or registered), on `stream`."""
    tokens3 = _rows(top_k_tokens, "top_k_tokens", 3)
    out3 = _rows(top_k_device_locs, "top_k_device_locs", 3)
    index3 = _rows(cache_index, "cache_index", 3)
    steps = top_k_tokens.shape[1]
    if tuple(top_k_device_locs.shape[1:]) != tuple(top_k_tokens.shape[1:]):
        raise KvtierError(f"invalid argument `top_k_device_locs`: has shape {list(top_k_device_locs.shape)}; "
                          f"top_k_tokens has {list(top_k_tokens.shape)}")
    if cache_index.shape[1] != 2:
        raise KvtierError(f"invalid argument `cache_index`: has shape {list(cache_index.shape)}; it must be "
                          "[requests, 2, hash_size] (two hash banks per request)")
    native().spec_swap_in(
        tokens3, steps, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer, out3,
        req_pool_indices, seq_lens, index3, cache_index.shape[2], cache_policy, scratch_locs, scratch_state,
        num_real_reqs, _items(items), hot_buffer_size, page_size, miss_src, miss_dst, miss_count, stream,
    )


def _rows(a, name: str, ndim: int):
    """`a` (``ndim``-D, each row contiguous) as a 2-D view of the same memory,
    one row per first index: never a copy, which the call would write in
    vain."""
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != ndim:
        raise KvtierError(f"invalid argument `{name}`: has shape {list(shape) if shape is not None else None}; "
                          f"it must be {ndim}-D")
    rows, width = shape[0], 1
    for n in shape[1:]:
        width *= n
    if hasattr(a, "data_ptr"):  # torch
        try:
            return a.view(rows, width)
        except RuntimeError:
            raise KvtierError(f"invalid argument `{name}`: its rows must be contiguous "
                              f"(strides {list(a.stride())})") from None
    flat = a.reshape(rows, width)
    if flat.size and flat.__array_interface__["data"][0] != a.__array_interface__["data"][0]:
        raise KvtierError(f"invalid argument `{name}`: its rows must be contiguous (strides {list(a.strides)})")
    return flat


def _items(items) -> tuple:
    """An item layout as the native module takes it."""
    if isinstance(items, tuple) and len(items) == 4:
        rows, value, scale, page = items
        u32 = 2**32 - 1
        return (_lib.as_int(rows, "rows_per_page", 1, u32), _lib.as_int(value, "item_size_bytes", 1, u32),
                _lib.as_int(scale, "scale_bytes", 0, u32), _lib.as_int(page, "page_bytes", 1, 2**64 - 1))
    raise KvtierError(f"invalid argument `items`: {items!r} is not a (rows_per_page, value_bytes, scale_bytes, "
                      "page_bytes) tuple")
