"""Loading libkvtier with ctypes, the C ABI's structs, and status checking.

The library is looked for, in order: the path in ``KVTIER_LIB``; this
package's own folder (where ``pip install ./bindings/python`` puts it); the
repository's ``target/release`` (running from a checkout). A path given in
``KVTIER_LIB`` that does not load is an error, not a reason to look further.
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
from pathlib import Path

ABI_VERSION = 8
LIB_NAME = "libkvtier.so"

# Status codes (bindings/kvtier.h).
OK = 0
STATUS_NAMES = {
    1: "INVALID_ARGUMENT",
    2: "KERNELS_NOT_BUILT",
    3: "NO_DRIVER",
    4: "DRIVER_ERROR",
    5: "BAD_INDICES",
    6: "POOL_ERROR",
    7: "IO_ERROR",
    8: "INTERNAL_ERROR",
}

EXECUTOR_CPU = -1
INDEX_INT32 = 1
INDEX_INT64 = 2
PLAN_THEN_COPY = 0
ONE_BLOCK_PER_REQUEST = 1
FEW_MISS = 2
COMPACT = 3
COMPACT_ONE_LAUNCH = 4
FEW_MISS_512 = 5
FEW_MISS_ONE_LAUNCH = 6
FEW_MISS_512_ONE_LAUNCH = 7
DEFAULT = 8


class KvtierError(Exception):
    """An error from kvtier: the library's message (or the Python side's,
    for an argument refused before the library was called), and a status
    name such as ``INVALID_ARGUMENT`` or ``BAD_INDICES``."""

    def __init__(self, message: str, status: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.message = message
        self.status = status


def as_int(value, name: str, lo: int = 0, hi: int = 2**32 - 1) -> int:
    """`value` as an int within lo..=hi, else a KvtierError naming `name`
    (never a ValueError or TypeError: kvtier promises its own errors)."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = operator.index(value)  # numpy integers, not floats or strings
        except TypeError:
            raise KvtierError(f"invalid argument `{name}`: {value!r} is not an int") from None
    if not lo <= value <= hi:
        raise KvtierError(f"invalid argument `{name}`: {value} is outside {lo}..={hi}")
    return value


def as_c_text(value, name: str) -> bytes:
    """`value` (str or bytes) as the bytes of a C string, else a KvtierError
    naming `name`: a NUL inside would end the C string there, silently
    naming another key, path or device (``"model-A\\0v2"`` would be
    ``"model-A"``)."""
    if isinstance(value, str):
        try:
            raw = value.encode()
        except UnicodeEncodeError as e:
            raise KvtierError(f"invalid argument `{name}`: {value!r} is not valid UTF-8 text ({e.reason})") from None
    elif isinstance(value, bytes):
        raw = value
    else:
        raise KvtierError(f"invalid argument `{name}`: {value!r} is not a string")
    if b"\0" in raw:
        raise KvtierError(f"invalid argument `{name}`: {value!r} holds a NUL character, which a C string cannot carry")
    return raw


class Buf(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_uint64)]


class Layout(ctypes.Structure):
    _fields_ = [
        ("entry_bytes", ctypes.c_uint32),
        ("layers", ctypes.c_uint32),
        ("tokens_per_region", ctypes.c_uint32),
    ]


class PoolOptions(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_uint32),
        ("ranks", ctypes.c_uint32),
        ("clients", ctypes.c_uint32),
        ("register_flags", ctypes.c_uint32),
    ]


class PoolInfo(ctypes.Structure):
    _fields_ = [
        ("layout", Layout),
        ("num_devices", ctypes.c_uint32),
        ("num_regions", ctypes.c_uint32),
        ("free_regions", ctypes.c_uint32),
        ("_reserved", ctypes.c_uint32),
        ("region_stride", ctypes.c_uint64),
        ("uuid", ctypes.c_uint8 * 16),
    ]


class DeviceCapacity(ctypes.Structure):
    _fields_ = [
        ("bytes", ctypes.c_uint64),
        ("host_dram", ctypes.c_uint32),
        ("pinnable", ctypes.c_uint32),
        ("movable_bytes", ctypes.c_uint64),
    ]


class RegionInfo(ctypes.Structure):
    _fields_ = [
        ("index", ctypes.c_uint32),
        ("device", ctypes.c_uint32),
        ("host_addr", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("joined", ctypes.c_uint32),
        ("joined_elsewhere", ctypes.c_uint32),
    ]


class SwapInCountersC(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("calls", "rows", "hits", "misses", "bytes", "bad_indices")]


# An item layout, as the swap-in takes it: (rows_per_page, value_bytes,
# scale_bytes, page_bytes), kvt_items' fields: how a row of a KV buffer is
# addressed. The parameter structs themselves are built by kvtier._native
# from the library's own definitions.


def linear_items(item_bytes: int) -> tuple:
    """Rows of `item_bytes`, back to back."""
    return (1, item_bytes, 0, item_bytes)


# DeepSeek-V4's page-padded C4 cache: pages of 64 rows, a row's 576-byte value
# and 8-byte scale in separate runs, pages padded to a multiple of 576 bytes.
DSV4_PAGE_ROWS = 64
DSV4_VALUE_BYTES = 576
DSV4_SCALE_BYTES = 8
DSV4_ITEM_BYTES = DSV4_VALUE_BYTES + DSV4_SCALE_BYTES
DSV4_PAGE_BYTES = -(-DSV4_ITEM_BYTES * DSV4_PAGE_ROWS // 576) * 576
DSV4_ITEMS = (DSV4_PAGE_ROWS, DSV4_VALUE_BYTES, DSV4_SCALE_BYTES, DSV4_PAGE_BYTES)


def dsv4_items() -> tuple:
    return DSV4_ITEMS


# The structs the layout test compares with the C header, by C name.
STRUCTS = {
    "kvt_buf": Buf,
    "kvt_layout": Layout,
    "kvt_pool_options": PoolOptions,
    "kvt_pool_info": PoolInfo,
    "kvt_region_info": RegionInfo,
    "kvt_device_capacity": DeviceCapacity,
    "kvt_swap_in_counters": SwapInCountersC,
}

_P = ctypes.c_void_p
_S = ctypes.c_int32
_U32 = ctypes.c_uint32
_U64 = ctypes.c_uint64

# name: (restype, argtypes)
_PROTOTYPES = {
    "kvt_abi_version": (_U32, []),
    "kvt_version": (ctypes.c_char_p, []),
    "kvt_last_error": (ctypes.c_char_p, []),
    "kvt_kernels_built": (ctypes.c_int32, []),
    "kvt_pool_create": (_S, [ctypes.POINTER(Layout), ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                             ctypes.POINTER(PoolOptions), ctypes.POINTER(_P)]),
    "kvt_pool_open": (_S, [ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t, ctypes.POINTER(PoolOptions),
                           ctypes.POINTER(_P)]),
    "kvt_pool_open_or_create": (_S, [ctypes.POINTER(Layout), ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                                     ctypes.POINTER(PoolOptions), ctypes.POINTER(_P)]),
    "kvt_pool_device_bytes_for": (_S, [ctypes.POINTER(Layout), _U32, ctypes.POINTER(_U64)]),
    "kvt_pool_info_get": (_S, [_P, ctypes.POINTER(PoolInfo)]),
    "kvt_pool_publish_stats": (_S, [_P, ctypes.c_char_p]),
    "kvt_device_capacity_get": (_S, [ctypes.c_char_p, ctypes.POINTER(DeviceCapacity)]),
    "kvt_cuda_numa_node": (_S, [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)]),
    "kvt_pool_close": (None, [_P]),
    "kvt_region_alloc": (_S, [_P, _U64, ctypes.POINTER(_P)]),
    "kvt_region_join": (_S, [_P, ctypes.POINTER(ctypes.c_uint8), ctypes.c_uint32, _U64, ctypes.POINTER(_P)]),
    "kvt_region_info_get": (_S, [_P, ctypes.POINTER(RegionInfo)]),
    "kvt_region_publish": (_S, [_P]),
    "kvt_region_free": (_S, [_P]),
    "kvt_swap_in_create": (_S, [ctypes.c_int32, ctypes.POINTER(_P)]),
    "kvt_swap_in_reserve": (_S, [_P, _U32, _U32]),
    "kvt_swap_in_capacity": (_S, [_P, ctypes.POINTER(_U32), ctypes.POINTER(_U32)]),
    "kvt_swap_in_limits": (_S, [ctypes.POINTER(_U32), ctypes.POINTER(_U32)]),
    # called by kvtier._native, by address, with the library's own structs
    "kvt_swap_in_run": (_S, [_P, _P, _U32, _P]),
    "kvt_swap_in_copy_planned": (_S, [_P, _P, _P]),
    "kvt_swap_in_run_spec": (_S, [_P, _P, _P]),
    "kvt_swap_in_map_host": (_S, [_P, _P, ctypes.POINTER(_U64)]),
    "kvt_swap_in_check": (_S, [_P]),
    "kvt_swap_in_poll": (_S, [_P, ctypes.POINTER(_U32)]),
    "kvt_swap_in_enable_counters": (_S, [_P, _U32]),
    "kvt_swap_in_read_counters": (_S, [_P, _U32, ctypes.POINTER(SwapInCountersC), _U32, ctypes.POINTER(_U32)]),
    "kvt_swap_in_destroy": (None, [_P]),
    "kvt_table_load": (_S, [ctypes.c_char_p, ctypes.c_char_p, _U64, _U32, ctypes.POINTER(_P)]),
    "kvt_table_loader_next_missing": (_S, [_P, _U64, ctypes.POINTER(_U64), ctypes.POINTER(_U64)]),
    "kvt_table_loader_write": (_S, [_P, _U64, _P, _U64]),
    "kvt_table_loader_publish": (_S, [_P]),
    "kvt_table_loader_close": (None, [_P]),
    "kvt_table_attach": (_S, [ctypes.c_char_p, ctypes.c_char_p, _U32, ctypes.POINTER(_P)]),
    "kvt_table_data": (_S, [_P, ctypes.POINTER(_P), ctypes.POINTER(_U64)]),
    "kvt_table_close": (None, [_P]),
    "kvt_table_store_path": (_S, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_size_t)]),
    "kvt_table_destroy": (_S, [ctypes.c_char_p]),
    # kvt_engram_create and kvt_engram_gather are called by kvtier._native
    "kvt_engram_create": (_S, [ctypes.c_int32, ctypes.POINTER(_P)]),
    "kvt_engram_gather": (_S, [_P, _P, _P]),
    "kvt_engram_check": (_S, [_P]),
    "kvt_engram_destroy": (None, [_P]),
    "kvt_prefix_open": (_S, [ctypes.c_char_p, ctypes.c_char_p, _U64, _U64, _U32, ctypes.POINTER(_P)]),
    "kvt_prefix_info": (_S, [_P, ctypes.POINTER(_U64), ctypes.POINTER(_U64), ctypes.POINTER(_U64)]),
    "kvt_prefix_hits": (_S, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "kvt_prefix_get": (_S, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P]),
    "kvt_prefix_set": (_S, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P]),
    "kvt_prefix_counters": (_S, [_P, ctypes.POINTER(_U64), ctypes.c_size_t]),
    "kvt_prefix_clear": (_S, [_P, ctypes.POINTER(_U64)]),
    "kvt_prefix_close": (None, [_P]),
}

_lock = threading.Lock()
_lib = None


def candidates() -> list:
    """Where the library is looked for, in order (see the module docs)."""
    env = os.environ.get("KVTIER_LIB")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    return [here / LIB_NAME, here.parents[2] / "target" / "release" / LIB_NAME]


def library() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _load()
        return _lib


def _load() -> ctypes.CDLL:
    paths = candidates()
    if os.environ.get("KVTIER_LIB"):
        path = paths[0]
        if not path.exists():
            raise KvtierError(f"KVTIER_LIB={path} does not exist", "NO_LIBRARY")
    else:
        found = [p for p in paths if p.exists()]
        if not found:
            raise KvtierError(
                "libkvtier.so was not found; looked in "
                + ", ".join(str(p) for p in paths)
                + ". Install the package with `pip install ./bindings/python` in the repository (it builds the "
                "library), or set KVTIER_LIB to its path.",
                "NO_LIBRARY",
            )
        path = found[0]
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KvtierError(f"loading {path} failed: {e}", "NO_LIBRARY") from e
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise KvtierError(f"{path} has no {name}: an old or foreign build", "NO_LIBRARY") from e
        fn.restype = restype
        fn.argtypes = argtypes
    abi = lib.kvt_abi_version()
    if abi != ABI_VERSION:
        raise KvtierError(
            f"{path} speaks C ABI version {abi}; this package needs {ABI_VERSION}. Rebuild the library "
            "and the package from the same checkout.",
            "NO_LIBRARY",
        )
    lib._kvtier_path = str(path)
    return lib


def check(status: int) -> None:
    """Raises KvtierError with the library's message unless `status` is OK."""
    if status != OK:
        message = library().kvt_last_error().decode("utf-8", "replace")
        raise KvtierError(message, STATUS_NAMES.get(status, f"STATUS_{status}"))
