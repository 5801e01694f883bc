"""kvtier as a drop-in for SGLang HiSparse (SGLang 0.5.21 to 0.5.23).

- The kernel entry points SGLang's HiSparse coordinator calls, with SGLang's
  keyword signatures and in-place updates, on kvtier's kernels (torch CUDA
  tensors) or its CPU executor (numpy arrays, CPU tensors):
  :func:`load_cache_to_device_buffer_mla` (DSA decode: DeepSeek-V3.2, GLM),
  :func:`load_cache_to_device_buffer_dsv4_mla` (DeepSeek-V4's page-padded C4
  cache), :func:`copy_cache_planned_mla` (shared-index layers replaying a
  miss plan) and :func:`load_blocks_to_device_buffer_mha` (MiniMax-M3's
  block-selected K and V). :func:`load_cache_to_device_buffer_spec_mla`
  (MTP/EAGLE verify, on SGLang's ``HiSparseSpecState``) is there too, but
  its kernel, exact on an H100, is slower there than SGLang's, so
  :func:`install` leaves that path to SGLang.
- :class:`KvtierHostTensorAllocator`: places SGLang's HiSparse host KV pools
  (``MLATokenToKVPoolHost``, ``DeepSeekV4PagedHostPool``,
  ``HiSparseMHATokenToKVPoolHost``) in a kvtier pool on CXL devices, per rank
  round-robin.
- :func:`install`: replaces the coordinator's module-level entry points and
  host pool classes, before the coordinator is created, where kvtier can
  stand in for them; :func:`report` says what it would do here, and why.
  ``python -m kvtier.sglang [serve] <SGLang server arguments> --kvtier-config
  FILE`` installs and launches (``sglang.launch_server``, or ``sglang serve``).
- DeepSeek-V4.1's Engram tables (:mod:`kvtier.sglang.engram`): with
  ``engram_tables`` in the config, SGLang's host tables become kvtier
  tables, loaded once per checkpoint and attached by every start and
  instance; :func:`engram_gather` is kvtier's gather with SGLang's
  signature (installed only when the config asks), :func:`engram_check`
  raises the ids past a table its GPU gathers recorded.
- :func:`swap_in_counters`: each layer's swap-in hits, misses, bytes and bad
  indices, counted on the GPU while serving (:mod:`kvtier.sglang.counters`;
  exported to SGLang's Prometheus metrics where it serves them).
- :mod:`kvtier.sglang.hicache`: HiCache's storage tier (``--hicache-storage-
  backend dynamic``) on a kvtier prefix store, shared by every SGLang instance
  of the host; not imported here (it imports torch and SGLang: SGLang's
  backend factory imports it by name).
"""

from __future__ import annotations

from .._lib import KvtierError
from .._swap_in import engine_for
from ._config import ENV, KvtierConfig, current_config, load_config
from ._patch import install, installed_report, uninstall
from .compat import CHECKED_VERSIONS, Report, report
from .counters import swap_in_counters
from .entry_points import (
    copy_cache_planned_mla,
    load_blocks_to_device_buffer_mha,
    load_cache_to_device_buffer_dsv4_mla,
    load_cache_to_device_buffer_mla,
    load_cache_to_device_buffer_spec_mla,
)
from .engram import engram_check, engram_gather
from .host_pool import KvtierHostTensorAllocator

__all__ = [
    "CHECKED_VERSIONS",
    "ENV",
    "KvtierConfig",
    "KvtierError",
    "KvtierHostTensorAllocator",
    "Report",
    "check",
    "copy_cache_planned_mla",
    "current_config",
    "engram_check",
    "engram_gather",
    "install",
    "installed_report",
    "load_blocks_to_device_buffer_mha",
    "load_cache_to_device_buffer_dsv4_mla",
    "load_cache_to_device_buffer_mla",
    "load_cache_to_device_buffer_spec_mla",
    "load_config",
    "report",
    "reserve",
    "swap_in_counters",
    "uninstall",
]


def reserve(max_batch: int, top_k: int, device="cpu") -> None:
    """Sizes the swap-in's plan scratch on `device` ("cpu" or a CUDA ordinal)
    ahead of time, e.g. before CUDA graph capture (it otherwise grows on the
    first call that needs more); `top_k` counts resolved entries (blocks ×
    block size for MiniMax-M3)."""
    engine_for(device).reserve(max_batch, top_k)


def check(device="cpu") -> None:
    """Raises the bad indices the swap-ins and replays on `device` recorded
    since the last check (a KvtierError with status BAD_INDICES); waits for
    the device."""
    engine_for(device).check()
