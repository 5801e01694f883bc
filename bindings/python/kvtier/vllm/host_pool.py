"""kvtier's ``HiSparseHostPool.allocate`` for vLLM (see :mod:`kvtier.vllm`)."""

from __future__ import annotations

import logging

from .._lib import KvtierError
from . import PAGE, VllmConfig

logger = logging.getLogger("kvtier")

_ORIGINAL = "_kvtier_original_allocate"


def patch(runtime, config: VllmConfig) -> None:
    """Replaces ``runtime.HiSparseHostPool.allocate`` (looked up on the class
    at every call, so pools made before and after both get it)."""
    cls = runtime.HiSparseHostPool
    if getattr(cls, _ORIGINAL, None) is not None:
        return
    original = cls.allocate

    def allocate(self, size: int):
        """A per-rank pool in a kvtier region (the shared TP pool: vLLM's)."""
        if self.backing is not None:
            if self.backing.numel() != size:
                raise KvtierError(f"HiSparse host pool size changed: {self.backing.numel()} B, now {size} B")
            return self.backing
        if self.kv_cache_config.hisparse_shared_host_pool:
            return original(self, size)
        return _allocate_in_kvtier(self, runtime, config, int(size))

    allocate.__doc__ = original.__doc__
    setattr(cls, _ORIGINAL, original)
    cls.allocate = allocate


def unpatch(runtime) -> None:
    cls = runtime.HiSparseHostPool
    original = getattr(cls, _ORIGINAL, None)
    if original is not None:
        cls.allocate = original
        delattr(cls, _ORIGINAL)


def _allocate_in_kvtier(pool, runtime, config: VllmConfig, size: int):
    import torch

    from ..sglang._config import KvtierConfig, is_private
    from ..sglang.host_pool import KvtierHostTensorAllocator

    if size <= 0:
        raise KvtierError(f"HiSparse host pool of {size} B")
    pages = -(-size // PAGE)
    if all(d.split(":", 1)[0] == "anon" and d.count(":") == 0 for d in config.devices):
        # a sizeless anon device is the host's DRAM: vLLM's own check of it
        runtime.check_hisparse_host_memory(pages * PAGE)
    sglang_config = KvtierConfig(devices=list(config.devices), rank=config.rank, ranks=config.ranks)
    allocator = KvtierHostTensorAllocator(sglang_config)
    try:
        region = allocator.region(layers=1, rows=pages, entry=PAGE, dims=(size,))
    except KvtierError as e:
        raise KvtierError(
            f"vLLM's HiSparse host pool of {size / 2**30:.2f} GiB does not fit the kvtier devices "
            f"{', '.join(config.devices)} ({e.message}); lower host_pool_gib in the HiSparseConnector config or "
            f"give the pool more devices", e.status,
        ) from e
    registered = region.torch(torch.int8, (pages * PAGE,))
    # vLLM's own registration call (a module global, looked up now), so its
    # shutdown unregisters what was registered
    runtime.pin_tensor(registered)
    pool._kvtier_allocator = allocator  # the region lives as long as the pool object
    pool.registered = registered
    pool.backing = registered[:size]
    where = config.devices[region.device] if not all(is_private(d) for d in config.devices) else "this rank's pool"
    logger.info("kvtier: vLLM's HiSparse host pool, %d B, in kvtier region %d on %s", size, region.index, where)
    return pool.backing
