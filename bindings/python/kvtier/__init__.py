"""kvtier: the KV-cache tier for sparse-attention LLMs, from Python.

The library (libkvtier.so) is loaded with ctypes on first use: from
``KVTIER_LIB`` if set, else from this package's folder, else from the
repository's ``target/release``. Errors raise :class:`KvtierError` with the
library's message.

- :func:`swap_in` / :class:`SwapInEngine`: SGLang HiSparse's swap-in (numpy
  arrays or CPU tensors run on the CPU executor, CUDA tensors on the GPU),
  and its per-layer :class:`SwapInCounters`.
- :class:`Pool`, :class:`Region`, :class:`Layout`: the pool on CXL devices.
- :func:`load_table`, :class:`Table`: tables in shared memory, loaded once
  per host and attached by every process.
- :class:`PrefixStore`: pages under string keys in shared memory, found by
  every process of the host (SGLang's HiCache prefixes:
  :mod:`kvtier.sglang.hicache`).
- :mod:`kvtier.sglang`: the drop-in for SGLang.
"""

from ._lib import KvtierError, library
from ._pool import DeviceCapacity, Layout, Pool, Region, device_bytes_for, device_capacity
from ._swap_in import SwapInCounters, SwapInEngine, engine_for, spec_swap_in, swap_in
from ._prefix import PrefixStore
from ._table import Table, TableLoader, destroy_table, load_table, table_path

__all__ = [
    "DeviceCapacity",
    "KvtierError",
    "Layout",
    "Pool",
    "PrefixStore",
    "Region",
    "SwapInCounters",
    "SwapInEngine",
    "Table",
    "TableLoader",
    "destroy_table",
    "load_table",
    "table_path",
    "engine_for",
    "device_bytes_for",
    "device_capacity",
    "library",
    "spec_swap_in",
    "swap_in",
    "version",
    "kernels_built",
]

__version__ = "0.1.0"


def version() -> str:
    """The loaded library's version."""
    return library().kvt_version().decode()


def kernels_built() -> bool:
    """Whether the loaded library carries its CUDA kernels."""
    return bool(library().kvt_kernels_built())
