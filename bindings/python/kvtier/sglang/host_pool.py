"""SGLang's host KV pool in a kvtier pool.

SGLang's host pools allocate their buffer through an allocator object with
``allocate(dims, dtype, device)`` (``HostTensorAllocator``), then register it
with the GPU themselves. :class:`KvtierHostTensorAllocator` is such an
allocator: the layer-first ``[layers, rows, 1, kv_dim]`` buffer of
``MLATokenToKVPoolHost`` becomes one kvtier region (whose layout is exactly
that), on the device the per-rank round-robin picks for this rank.
"""

from __future__ import annotations

import logging
import re
import sys


from .._lib import KvtierError
from .._pool import Layout, Pool, device_bytes_for
from ._config import KvtierConfig, is_private


def detect_rank(config: KvtierConfig) -> tuple:
    """(rank, ranks) for placement: the config's, else torch.distributed's,
    else the current CUDA device's, else (0, 1)."""
    rank, ranks = config.rank, config.ranks
    torch = sys.modules.get("torch")
    if rank is None and torch is not None:
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            ranks = ranks if ranks is not None else dist.get_world_size()
        elif torch.cuda.is_available():
            rank = torch.cuda.current_device()
            ranks = ranks if ranks is not None else torch.cuda.device_count()
    rank = 0 if rank is None else rank
    ranks = max(ranks if ranks is not None else rank + 1, rank + 1)
    return rank, ranks


logger = logging.getLogger("kvtier")

_SIZELESS = re.compile(r"^(anon|numa:\d+)$")


def sized_devices(devices: list, layout: Layout) -> list:
    """The device strings with a size added where the config left it out
    (``anon``, ``numa:NODE``): room for one region of `layout`."""
    need = None
    out = []
    for d in devices:
        if _SIZELESS.match(d):
            if need is None:
                need = device_bytes_for(layout, 1)
            out.append(f"{d}:{need}")
        else:
            out.append(d)
    return out


class KvtierHostTensorAllocator:
    """An SGLang host-tensor allocator that places each buffer in a kvtier
    region: ``allocate((layers, rows, 1, kv_dim), dtype, "cpu")``. With a torch
    dtype it returns a CPU torch tensor, with a numpy dtype a numpy array;
    either is a view of the region (no copy) that keeps it alive."""

    def __init__(self, config: KvtierConfig | None = None):
        self.config = config or KvtierConfig()
        self.dtype = None
        self.dims = None
        self.pools = []
        self.regions = []
        self.placements = []  # (rank, ranks, region device index) per allocation

    def allocate(self, dims, dtype, device="cpu"):
        if str(device) != "cpu":
            raise KvtierError(f"KvtierHostTensorAllocator allocates host memory; device={device!r} was asked for")
        dims = tuple(int(d) for d in dims)
        if len(dims) != 4 or dims[2] != 1 or min(dims) <= 0:
            raise KvtierError(
                f"KvtierHostTensorAllocator places layer-first buffers [layers, rows, 1, kv_dim]; got dims {dims} "
                "(use layout='layer_first' for the HiSparse host pool)"
            )
        torch_dtype = _torch_dtype(dtype)
        if torch_dtype is not None:
            itemsize = torch_dtype.itemsize if hasattr(torch_dtype, "itemsize") else _torch_itemsize(torch_dtype)
        else:
            import numpy as np

            itemsize = np.dtype(dtype).itemsize
        layers, rows, _, kv_dim = dims
        entry = kv_dim * itemsize
        if entry % 8:
            raise KvtierError(f"an entry of {kv_dim} × {itemsize} B = {entry} B is not a multiple of 8 B")
        layout = Layout(entry, layers, rows)
        rank, ranks = detect_rank(self.config)
        devices = sized_devices(self.config.devices, layout)
        if all(is_private(d) for d in devices):
            pool = Pool.create(layout, devices, rank=rank, ranks=ranks)
        else:
            pool = Pool.open_or_create(layout, devices, rank=rank, ranks=ranks, clients=self.config.clients)
        region = pool.alloc_region(request=rank)
        self.pools.append(pool)
        self.regions.append(region)
        self.placements.append((rank, ranks, region.device))
        self.dtype, self.dims = dtype, dims
        logger.info(
            "kvtier: host KV pool of %d layers × %d rows × %d B in region %d on %s (rank %d of %d)",
            layers,
            rows,
            entry,
            region.index,
            devices[region.device],
            rank,
            ranks,
        )
        if torch_dtype is not None:
            return region.torch(torch_dtype, dims)
        return region.numpy(dtype, dims)


def _torch_dtype(dtype):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype
    return None


def _torch_itemsize(dtype) -> int:
    torch = sys.modules["torch"]
    return torch.empty((), dtype=dtype).element_size()
