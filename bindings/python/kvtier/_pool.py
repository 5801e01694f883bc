"""The pool from Python: layer-first regions on CXL devices (devdax or NUMA
nodes), shared files or anonymous memory, placed per rank round-robin."""

from __future__ import annotations

import ctypes
import json
import operator
import os
import sys
import threading
import warnings
import weakref
from typing import NamedTuple, Sequence

from . import _lib
from ._lib import KvtierError, as_c_text, as_int, check, library


class _LayoutFields(NamedTuple):
    entry_bytes: int
    layers: int
    tokens_per_region: int


def _layout_int(value, name: str) -> int:
    """`value` as an int (numpy integers too), else a KvtierError naming it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise KvtierError(f"invalid argument `{name}`: {value!r} is not an int")


class Layout(_LayoutFields):
    """Region geometry: `layers` × `tokens_per_region` entries of `entry_bytes`,
    layer-first (``[layer][token][entry_bytes]``). A NamedTuple, checked when
    made, by the library's own rules (a KvtierError naming the field):

    - `entry_bytes`: a positive multiple of 8 that fits 32 bits (656 for
      fp8 DSA, 1152 for bf16 MLA, 584 for DeepSeek-V4's C4 token);
    - `layers`: 1 to :attr:`MAX_LAYERS` (4096);
    - `tokens_per_region`: 1 to :attr:`MAX_TOKENS_PER_REGION` (2**31 - 1;
      token indices are int32 on the device);
    - and a region, their product, at most :attr:`MAX_REGION_BYTES` (256 TiB).
    """

    __slots__ = ()

    MAX_ENTRY_BYTES = 2**32 - 8
    MAX_LAYERS = 4096
    MAX_TOKENS_PER_REGION = 2**31 - 1
    MAX_REGION_BYTES = 1 << 48

    def __new__(cls, entry_bytes: int, layers: int, tokens_per_region: int):
        # The rules of LayerFirstLayout::new (src/layout.rs), with its wording.
        e = _layout_int(entry_bytes, "entry_bytes")
        if e <= 0 or e % 8:
            raise KvtierError(
                f"invalid argument `entry_bytes`: {e} is not a positive multiple of 8 (656, 1152 and 584 are valid)"
            )
        if e > cls.MAX_ENTRY_BYTES:
            raise KvtierError(
                f"invalid argument `entry_bytes`: {e} is outside 8..={cls.MAX_ENTRY_BYTES} (a 32-bit count)"
            )
        n = _layout_int(layers, "layers")
        if not 1 <= n <= cls.MAX_LAYERS:
            raise KvtierError(f"invalid argument `layers`: {n} is outside 1..={cls.MAX_LAYERS}")
        t = _layout_int(tokens_per_region, "tokens_per_region")
        if not 1 <= t <= cls.MAX_TOKENS_PER_REGION:
            raise KvtierError(
                f"invalid argument `tokens_per_region`: {t} is outside 1..={cls.MAX_TOKENS_PER_REGION}"
            )
        region = e * n * t
        if region > cls.MAX_REGION_BYTES:
            raise KvtierError(
                f"invalid argument `tokens_per_region`: {e} B × {n} layers × {t} tokens is {region} B a region, "
                f"more than the {cls.MAX_REGION_BYTES} B (256 TiB) a region may hold"
            )
        return super().__new__(cls, e, n, t)

    @classmethod
    def _make(cls, iterable) -> "Layout":
        # NamedTuple's _make (and so _replace) bypasses __new__: check those too.
        return cls(*iterable)

    def region_bytes(self) -> int:
        return self.entry_bytes * self.layers * self.tokens_per_region

    def _c(self) -> _lib.Layout:
        for name, v in zip(self._fields, self):
            if not isinstance(v, int) or not 0 <= v < 2**32:
                raise KvtierError(f"invalid argument `{name}`: {v!r} is not a 32-bit unsigned int")
        return _lib.Layout(*self)


def _layout(layout) -> Layout:
    """A Layout from a Layout or a 3-sequence, else a KvtierError."""
    try:
        return Layout(*layout)
    except TypeError:
        raise KvtierError(f"invalid argument `layout`: {layout!r} is not (entry_bytes, layers, tokens_per_region)") from None


def device_bytes_for(layout: Layout, regions: int = 1) -> int:
    """Bytes a single-device pool needs to hold `regions` regions of `layout`."""
    out = ctypes.c_uint64()
    lay = _layout(layout)._c()
    check(library().kvt_pool_device_bytes_for(ctypes.byref(lay), as_int(regions, "regions"), ctypes.byref(out)))
    return out.value


class DeviceCapacity(NamedTuple):
    """What a device offers a pool: `bytes`; whether they are the host's
    general DRAM (`host_dram`: anon memory, files on tmpfs or ramfs; not a
    devdax device, a NUMA node's memory or a file on another filesystem);
    and whether the kernel lets a GPU or RDMA registration pin them for as
    long as it holds them (`pinnable`: false for a file on a disk filesystem
    or FS-DAX); and `movable_bytes`, for ``numa:`` devices the bytes of the
    nodes' online memory in ZONE_MOVABLE, whose pages a GPU or RDMA
    registration migrates off the node (into another node's DRAM)."""

    bytes: int
    host_dram: bool
    pinnable: bool
    movable_bytes: int = 0


def device_capacity(device: str) -> DeviceCapacity:
    """The capacity of one device string, without mapping it: the size it
    gives, else the file's length, the devdax device's size, or for
    ``numa:NODE[+NODE...]`` without a size the nodes' free memory."""
    if not isinstance(device, str):
        raise KvtierError(f"invalid argument `device`: {device!r} is not a device string")
    out = _lib.DeviceCapacity()
    check(library().kvt_device_capacity_get(as_c_text(device, "device"), ctypes.byref(out)))
    return DeviceCapacity(out.bytes, bool(out.host_dram), bool(out.pinnable), out.movable_bytes)


def _specs(devices: Sequence[str]):
    if isinstance(devices, str):
        devices = [devices]
    if not isinstance(devices, (list, tuple)) or not devices or not all(isinstance(d, str) for d in devices):
        raise KvtierError("invalid argument `devices`: give a list of device strings such as 'numa:2:64GiB'")
    arr = (ctypes.c_char_p * len(devices))(*(as_c_text(d, "devices") for d in devices))
    return arr, len(devices)


def _options(rank: int, ranks: int, clients: int) -> _lib.PoolOptions:
    return _lib.PoolOptions(as_int(rank, "rank"), as_int(ranks, "ranks"), as_int(clients, "clients"), 0)


class _Handle:
    """A library handle shared by threads. ctypes releases the GIL for a
    foreign call, so a call that checked the handle may still be inside the
    library when another thread releases it: each call that passes the handle
    counts itself in flight (:meth:`_call`: a lock held for a few
    instructions, never across the call, so independent calls run
    concurrently), and :meth:`_release` first refuses new calls, then waits
    for those in flight to leave, then frees the handle."""

    _GONE = "this handle was released"

    def _init_handle(self, handle: ctypes.c_void_p) -> None:
        self._handle = handle  # first: __del__ frees it even if __init__ fails later
        self._open = True  # False once release began: calls are refused
        self._calls = 0  # calls inside the library with the handle
        self._lock = threading.Lock()
        self._idle = None  # a Condition on _lock, made when _release must wait
        _HANDLES.add(self)

    def _call(self, fn, *args) -> None:
        """``fn(handle, *args)``, counted in flight while it runs, its status
        checked; a KvtierError once the handle is released (or being released)."""
        lock = self._lock
        with lock:
            if not self._open:
                raise KvtierError(self._GONE, "INVALID_ARGUMENT")
            self._calls += 1
            h = self._handle
        try:
            status = fn(h, *args)
        finally:
            with lock:
                self._calls -= 1
                if not self._calls and self._idle is not None:
                    self._idle.notify_all()
        check(status)

    def _release(self, free) -> int:
        """Refuses new calls, waits for those in flight, then ``free(handle)``
        (under the lock, so a concurrent release returns once it is done);
        returns its status, or OK when the handle was already released."""
        with self._lock:
            if not self._open:
                # Another thread's release is under way (waiting for calls):
                # return once it has freed the handle.
                while self._handle:
                    self._wait()
                return _lib.OK
            self._open = False
            while self._calls:
                self._wait()
            h, self._handle = self._handle, ctypes.c_void_p()
            try:
                return free(h)
            finally:
                if self._idle is not None:
                    self._idle.notify_all()

    def _wait(self) -> None:
        if self._idle is None:
            self._idle = threading.Condition(self._lock)
        self._idle.wait()

    def _release_unreferenced(self, free) -> None:
        """For __del__: no reference is left, so no call is in flight and no
        other thread can be releasing it; never takes the lock or waits (it
        may run at interpreter shutdown, or in a forked child)."""
        h = getattr(self, "_handle", None)
        if h:
            self._open = False
            self._handle = ctypes.c_void_p()
            free(h)

    # The library function that frees this kind of handle.
    _FREE = ""

    def __del__(self):
        # No reference is left: nothing else can be using or freeing it.
        try:
            self._release_unreferenced(getattr(library(), self._FREE))
        except Exception:
            pass

    def _after_fork_in_child(self) -> None:
        # The parent's other threads are gone: their calls in flight will
        # never leave, and the lock may be held by one of them. A release they
        # began is abandoned, its handle left unfreed in the child.
        self._lock = threading.Lock()
        self._idle = None
        self._calls = 0
        if not self._open:
            self._handle = ctypes.c_void_p()


_HANDLES: "weakref.WeakSet[_Handle]" = weakref.WeakSet()


class _Closable(_Handle):
    """A handle closed by :meth:`close` or a ``with`` block."""

    def close(self) -> None:
        """Closes it, after the calls on it in flight in other threads have
        returned; calls made after it raise. Closing twice is a no-op."""
        self._release(getattr(library(), self._FREE))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _reset_handles_in_child() -> None:
    for h in list(_HANDLES):
        h._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_handles_in_child)


class Pool(_Closable):
    """A kvtier pool; see :meth:`create`, :meth:`open`, :meth:`open_or_create`.
    Closing it (or dropping the last reference) frees the regions this process
    still holds.

    A Pool may be shared by threads: :meth:`close` waits for the other
    threads' calls on it that are inside the library, and a call made after
    it raises ``KvtierError("this Pool was closed")``."""

    _GONE = "this Pool was closed"
    _FREE = "kvt_pool_close"

    def __init__(self, handle: ctypes.c_void_p):
        self._init_handle(handle)

    @classmethod
    def create(cls, layout, devices, rank: int = 0, ranks: int = 1, clients: int = 0) -> "Pool":
        """A new pool of `layout` regions on `devices` (refuses devices that hold one)."""
        arr, n = _specs(devices)
        h = ctypes.c_void_p()
        opts = _options(rank, ranks, clients)
        check(library().kvt_pool_create(ctypes.byref(_layout(layout)._c()), arr, n, ctypes.byref(opts), ctypes.byref(h)))
        return cls(h)

    @classmethod
    def open(cls, devices, rank: int = 0, ranks: int = 1) -> "Pool":
        """Attaches to the pool on shared devices (file:, dax:)."""
        arr, n = _specs(devices)
        h = ctypes.c_void_p()
        opts = _options(rank, ranks, 0)
        check(library().kvt_pool_open(arr, n, ctypes.byref(opts), ctypes.byref(h)))
        return cls(h)

    @classmethod
    def open_or_create(cls, layout, devices, rank: int = 0, ranks: int = 1, clients: int = 0) -> "Pool":
        """Opens the pool on `devices`, or creates it if the first holds none
        (ranks that start together share one pool; private devices create)."""
        arr, n = _specs(devices)
        h = ctypes.c_void_p()
        opts = _options(rank, ranks, clients)
        check(
            library().kvt_pool_open_or_create(
                ctypes.byref(_layout(layout)._c()), arr, n, ctypes.byref(opts), ctypes.byref(h)
            )
        )
        return cls(h)

    def info(self) -> dict:
        i = _lib.PoolInfo()
        self._call(library().kvt_pool_info_get, ctypes.byref(i))
        return {
            "layout": Layout(i.layout.entry_bytes, i.layout.layers, i.layout.tokens_per_region),
            "num_devices": i.num_devices,
            "num_regions": i.num_regions,
            "free_regions": i.free_regions,
            "region_stride": i.region_stride,
            "uuid": bytes(i.uuid).hex(),
        }

    @property
    def layout(self) -> Layout:
        return self.info()["layout"]

    def publish_stats(self, stats: dict) -> None:
        """Publishes this process's `stats` (a JSON-serialisable dict, at most
        1 MiB as JSON) for readers of the pool: ``kvtier pool status --json``
        shows them with this process's client entry. Replaces what it
        published before; a file write, not for the per-layer path."""
        if not isinstance(stats, dict):
            raise KvtierError(f"invalid argument `stats`: a {type(stats).__name__}, not a dict")
        try:
            # NaN and infinities are not JSON (json.dumps would write them
            # anyway, and the library would refuse the text without saying why)
            text = json.dumps(stats, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise KvtierError(f"invalid argument `stats`: not JSON-serialisable: {e}") from None
        self._call(library().kvt_pool_publish_stats, text.encode())

    def alloc_region(self, request: int = 0) -> "Region":
        """A free region, placed per rank round-robin, owned by this process."""
        request = as_int(request, "request", 0, 2**64 - 1)
        h = ctypes.c_void_p()
        self._call(library().kvt_region_alloc, request, ctypes.byref(h))
        return Region(h, self)

    def join_region(self, ticket: dict) -> "Region":
        """Maps the region `ticket` names (its owner's :attr:`Region.ticket`:
        ``{"pool": uuid, "index": i, "epoch": e}``), which another live
        process owns: one copy that processes share (a TP group's host KV).
        A ticket of another pool (also of a pool made again on the same
        devices) is refused. While joined it is neither reclaimed nor freed
        by its owner; :meth:`Region.free` of the joined handle leaves it to
        the owner. Needs file: or dax: devices."""
        if not isinstance(ticket, dict) or set(ticket) != {"pool", "index", "epoch"}:
            raise KvtierError(
                f"invalid argument `ticket`: {ticket!r} is not a region ticket (a dict of pool, index and epoch, "
                "as Region.ticket gives it)"
            )
        uuid = ticket["pool"]
        try:
            raw = bytes.fromhex(uuid) if isinstance(uuid, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != 16:
            raise KvtierError(f"invalid argument `ticket`: pool {uuid!r} is not a pool uuid (32 hex digits)")
        index = as_int(ticket["index"], "index", 0, 2**32 - 1)
        epoch = as_int(ticket["epoch"], "epoch", 0, 2**64 - 1)
        h = ctypes.c_void_p()
        self._call(library().kvt_region_join, (ctypes.c_uint8 * 16).from_buffer_copy(raw), index, epoch,
                   ctypes.byref(h))
        return Region(h, self)


def _prefix_bytes(shape, itemsize: int, nbytes: int) -> int:
    n = itemsize
    for d in shape:
        n *= int(d)
    if n > nbytes:
        raise KvtierError(f"a view of shape {tuple(shape)} needs {n} B; the region holds {nbytes} B")
    return n


class Region(_Handle):
    """One region of a pool: `layers` × `tokens_per_region` entries, layer-first,
    at `host_addr` in this process.

    :meth:`free` waits for other threads' calls on the region that are inside
    the library (:meth:`publish`); a call made after it raises
    ``KvtierError("this Region was freed")``. Views of its bytes are the
    caller's to stop using before freeing it."""

    _GONE = "this Region was freed"
    # Views of the region hold a reference to it: when it is collected, none is left.
    _FREE = "kvt_region_free"
    _published = False  # whether publish() succeeded on this handle

    def __init__(self, handle: ctypes.c_void_p, pool: Pool):
        self._init_handle(handle)
        self.pool = pool  # keeps the pool open while the region is used
        info = _lib.RegionInfo()
        check(library().kvt_region_info_get(handle, ctypes.byref(info)))
        self.index = info.index
        self.device = info.device
        self.host_addr = info.host_addr
        self.nbytes = info.bytes
        self.epoch = info.epoch  # with the pool and index, names this allocation (Region.ticket)
        self.joined = bool(info.joined)  # a region another process owns, joined here

    @property
    def ticket(self) -> dict:
        """What another process passes to :meth:`Pool.join_region` to map this
        region: this pool's uuid, the region's index and this allocation's
        epoch (JSON-serialisable, to send over the caller's own channel)."""
        return {"pool": self.pool.info()["uuid"], "index": self.index, "epoch": self.epoch}

    @property
    def joined_elsewhere(self) -> bool:
        """Whether another process (or pool handle) has joined this region
        and holds it now (its owner's :meth:`free` is refused meanwhile)."""
        info = _lib.RegionInfo()
        self._call(library().kvt_region_info_get, ctypes.byref(info))
        return bool(info.joined_elsewhere)

    def _bytes(self):
        if not self._open:
            raise KvtierError(self._GONE, "INVALID_ARGUMENT")
        buf = (ctypes.c_uint8 * self.nbytes).from_address(self.host_addr)
        buf._kvtier_region = self  # the memory lives as long as the region
        return buf

    @property
    def layout(self) -> Layout:
        """The pool's :class:`Layout`, which :meth:`numpy` ``(shaped=True)`` uses."""
        return self.pool.layout

    def numpy(self, dtype="uint8", shape=None, *, shaped: bool = False):
        """The region's bytes as a numpy array of `dtype` (no copy): flat by
        default; with `shape`, its leading bytes in that shape; with
        ``shaped=True``, in the layer-first layout, ``[layers][tokens_per_region]
        [entry_bytes]`` for uint8 (the last axis ``entry_bytes // itemsize``
        for another `dtype`), so ``region.numpy(shaped=True)[layer, token]`` is
        that token's entry in that layer::

            kv = region.numpy(shaped=True)  # uint8, (layers, tokens, entry_bytes)
            kv[layer, token] = entry         # an entry_bytes-long uint8 array
        """
        import numpy as np  # optional: kvtier depends on neither numpy nor torch

        if shaped:
            if shape is not None:
                raise KvtierError("invalid argument `shape`: give a shape or shaped=True, not both")
            shape = self._layer_first_shape(np.dtype(dtype).itemsize)
        arr = np.frombuffer(self._bytes(), dtype=np.uint8)
        if shape is not None:
            arr = arr[: _prefix_bytes(shape, np.dtype(dtype).itemsize, self.nbytes)]
        arr = arr.view(dtype)
        return arr if shape is None else arr.reshape(shape)

    def _layer_first_shape(self, itemsize: int) -> tuple:
        if not self._open:
            raise KvtierError(self._GONE, "INVALID_ARGUMENT")
        lay = self.layout
        if lay.entry_bytes % itemsize:
            raise KvtierError(
                f"invalid argument `dtype`: an entry of {lay.entry_bytes} B is not a whole number of "
                f"{itemsize}-byte items"
            )
        return (lay.layers, lay.tokens_per_region, lay.entry_bytes // itemsize)

    def torch(self, dtype=None, shape=None):
        """The region's bytes as a CPU torch tensor of `dtype` (no copy; any
        torch dtype, bf16 and fp8 included)."""
        torch = sys.modules.get("torch")
        if torch is None:
            try:
                import torch  # optional, as numpy
            except ImportError as e:
                raise KvtierError(f"Region.torch needs torch, which is not installed ({e})") from None
        with warnings.catch_warnings():
            # ctypes arrays are writable; torch warns for any buffer regardless
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(self._bytes(), dtype=torch.uint8)
        if shape is not None:
            item = torch.empty((), dtype=dtype).element_size() if dtype is not None else 1
            t = t[: _prefix_bytes(shape, item, self.nbytes)]
        if dtype is not None:
            t = t.view(dtype)
        if shape is not None:
            t = t.view(shape)
        t._kvtier_region = self
        return t

    def publish(self) -> None:
        """Publishes the region: its bytes are written, and readers may trust
        them from now on. Once per allocation: publishing it again raises
        ``KvtierError("region N is already published")``."""
        with self._lock:
            if self._open and self._published:
                raise KvtierError(
                    f"region {self.index} is already published (a region is published once; free it and "
                    "allocate another to write new bytes)",
                    "POOL_ERROR",
                )
        self._call(library().kvt_region_publish)
        self._published = True

    def free(self) -> None:
        """Returns the region to the pool (views of it must no longer be
        used), after the calls on it in flight in other threads have
        returned; a joined region's handle leaves it to its owner. Freeing
        twice is a no-op. An owner's region that another process holds
        joined raises, and stays allocated until its joiners have left."""
        check(self._release(library().kvt_region_free))

