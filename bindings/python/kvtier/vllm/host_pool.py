"""kvtier's ``HiSparseHostPool.allocate`` and shared TP pool for vLLM (see
:mod:`kvtier.vllm`)."""

from __future__ import annotations

import importlib
import logging

from .._lib import KvtierError
from .._pool import Pool
from ..sglang.host_pool import KvtierHostTensorAllocator, detect_rank
from . import PAGE, VllmConfig

logger = logging.getLogger("kvtier")

_ORIGINAL = "_kvtier_original_allocate"
_ORIGINAL_SHARED = "_kvtier_original_allocate_hisparse_host_pools"


def patch(runtime, config: VllmConfig, shared: bool = False) -> None:
    """Replaces ``runtime.HiSparseHostPool.allocate`` (looked up on the class
    at every call, so pools made before and after both get it) and, with
    `shared`, the module's ``allocate_hisparse_host_pools`` (which that
    ``allocate`` looks up at call time for the shared TP pool)."""
    if shared and getattr(runtime, _ORIGINAL_SHARED, None) is None:
        original_shared = runtime.allocate_hisparse_host_pools

        def allocate_hisparse_host_pools(vllm_config, tensor_sizes, num_blocks, host_block_stride, *,
                                          use_shared_host_pool):
            """The shared single-node TP pool in one kvtier region the TP
            ranks share (private per-layer pools: vLLM's)."""
            if not use_shared_host_pool:
                return original_shared(vllm_config, tensor_sizes, num_blocks, host_block_stride,
                                       use_shared_host_pool=use_shared_host_pool)
            return _shared_pool_in_kvtier(runtime, config, list(tensor_sizes), int(num_blocks),
                                          int(host_block_stride))

        allocate_hisparse_host_pools.__doc__ = original_shared.__doc__
        setattr(runtime, _ORIGINAL_SHARED, original_shared)
        runtime.allocate_hisparse_host_pools = allocate_hisparse_host_pools
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
    original_shared = getattr(runtime, _ORIGINAL_SHARED, None)
    if original_shared is not None:
        runtime.allocate_hisparse_host_pools = original_shared
        delattr(runtime, _ORIGINAL_SHARED)
    cls = runtime.HiSparseHostPool
    original = getattr(cls, _ORIGINAL, None)
    if original is not None:
        cls.allocate = original
        delattr(cls, _ORIGINAL)


def _allocate_in_kvtier(pool, runtime, config: VllmConfig, size: int):
    import torch  # optional: vLLM's environment has it, kvtier does not depend on it

    if size <= 0:
        raise KvtierError(f"HiSparse host pool of {size} B")
    pages = -(-size // PAGE)
    if all(d.split(":", 1)[0] == "anon" and d.count(":") == 0 for d in config.devices):
        # a sizeless anon device is the host's DRAM: vLLM's own check of it
        runtime.check_hisparse_host_memory(pages * PAGE)
    allocator = KvtierHostTensorAllocator(config.kvtier_config())
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
    where = allocator.choice.device if config.placement == "nearest" else config.devices[region.device]
    logger.info("kvtier: vLLM's HiSparse host pool, %d B, in kvtier region %d on %s", size, region.index, where)
    return pool.backing


# ---- the shared single-node TP pool --------------------------------------------------


class KvtierSharedRegion:
    """What vLLM keeps of its shared TP pool (``HiSparseHostPool.shared_region``,
    in 0.33.0 a ``SharedOffloadRegion``): ``base_tensor`` (every byte, int8),
    the registered chunks (``pinned_addresses``, ``is_pinned``) and
    ``cleanup()``, which vLLM calls at shutdown or on a failed start on every
    rank. Here the bytes are one kvtier region: TP rank 0 owns it, the other
    ranks joined it."""

    def __init__(self, region, base):
        self.region = region
        self.total_size_bytes = region.nbytes
        self._base = base
        self.pinned_addresses: list = []
        self.is_pinned = False

    @property
    def base_tensor(self):
        if self._base is None:
            raise RuntimeError("Shared offload region has been released.")
        return self._base

    def cleanup(self) -> None:
        """Unregisters the chunks this rank registered (vLLM's
        ``host_unregister``, as its own shared region does) and drops this
        object's references. Like vLLM's region, which stays mapped while
        tensors use it, the region goes when the last view of it does (vLLM's
        pool and layer views included): then rank 0's handle frees it, or, if
        another rank still maps it, the last rank to leave does; another
        rank's handle leaves it. Idempotent."""
        if self.is_pinned:
            unregister = importlib.import_module("vllm.v1.kv_offload.cpu.host_register").host_unregister
            for address in reversed(self.pinned_addresses):
                unregister(address)
            self.pinned_addresses.clear()
            self.is_pinned = False
        self._base = None
        self.region = None


def _shared_pool_in_kvtier(runtime, config: VllmConfig, tensor_sizes: list, num_blocks: int, stride: int):
    """vLLM's ``allocate_hisparse_host_pools(..., use_shared_host_pool=True)``
    on kvtier: TP rank 0 allocates one region of ``num_blocks × stride`` bytes
    on the configured devices and tells the other ranks (index, epoch) over
    vLLM's TP group; each rank maps it, registers it in vLLM's chunks (its
    ``_hisparse_registration_ranges``, through its ``pin_tensor``) and returns
    vLLM's per-tensor views, its private pools (none) and the region."""
    import torch  # optional: vLLM's environment has it, kvtier does not depend on it

    total = num_blocks * stride
    if total <= 0 or total % PAGE:
        raise KvtierError(f"vLLM's shared HiSparse host pool of {num_blocks} blocks × {stride} B is not whole pages")
    # vLLM's own split (and its checks of the sizes), before anything is allocated
    ranges = runtime._hisparse_registration_ranges(tensor_sizes, num_blocks, stride)
    group = runtime.get_tp_group()
    sglang_config = config.kvtier_config()
    owner = group.rank_in_group == 0
    region = None
    if owner:
        try:
            allocator = KvtierHostTensorAllocator(sglang_config)
            region = allocator.region(layers=1, rows=total // PAGE, entry=PAGE, dims=(total,))
            where = region.ticket  # the pool's uuid, the region, this allocation
        except Exception as e:  # anything: the other ranks wait in the broadcast below
            region = None
            why = e.message if isinstance(e, KvtierError) else f"{type(e).__name__}: {e}"
            where = {"error": (
                f"vLLM's shared HiSparse host pool of {total / 2**30:.2f} GiB could not be placed on the kvtier "
                f"devices {', '.join(config.devices)} ({why}); if it does not fit, lower host_pool_gib in the "
                "HiSparseConnector config or give the pool more devices")}
        # the other ranks wait in this broadcast, so they hear of a failure too
        group.broadcast_object(where, src=0)
        if region is None:
            raise KvtierError(where["error"])
        # the allocator's handles go with the region's (its pool stays open through it)
        allocator.regions.clear()
        allocator.pools.clear()
    else:
        where = group.broadcast_object(None, src=0)
        if "error" in where:
            raise KvtierError(f"TP rank 0 could not place the shared pool: {where['error']}")
        rank, ranks = detect_rank(sglang_config)
        pool = Pool.open(list(config.devices), rank=rank, ranks=ranks)
        try:
            # (the join refuses another pool's ticket too; this says what to fix)
            if pool.info()["uuid"] != where["pool"]:
                raise KvtierError(
                    f"the kvtier devices {', '.join(config.devices)} hold another pool here than TP rank 0's: give "
                    "every rank of the TP group the same devices")
            region = pool.join_region(where)
        except BaseException:
            pool.close()
            raise
    shared = KvtierSharedRegion(region, region.torch(torch.int8, (total,)))
    try:
        for start, end in ranges:
            chunk = shared.base_tensor[start:end]
            runtime.pin_tensor(chunk)
            shared.pinned_addresses.append(chunk.data_ptr())
            shared.is_pinned = True
        views, at = [], 0
        for size in tensor_sizes:
            views.append(shared.base_tensor[at:at + size])
            at += size
    except BaseException:
        shared.cleanup()
        raise
    logger.info(
        "kvtier: vLLM's shared HiSparse host pool, %d B, in kvtier region %d (%s, TP rank %d of %d), "
        "registered in %d chunks", total, region.index, "allocated" if owner else "joined", group.rank_in_group,
        group.world_size, len(ranges))
    return views, [], shared
