"""SGLang's HiSparse host KV pools in a kvtier pool.

SGLang's host pools allocate their buffers through an allocator object with
``allocate(dims, dtype, device)`` (``HostTensorAllocator``), then register
them with the GPU themselves. :class:`KvtierHostTensorAllocator` is such an
allocator; each layer-first buffer becomes one kvtier region, on the device
the per-rank round-robin picks for this rank. A region is layer-first
``[layers][rows][entry bytes]``, and each HiSparse pool is one of those:

- ``MLATokenToKVPoolHost`` (DSA): one ``[layers, rows, 1, kv_dim]`` buffer;
  an entry is a token's latent.
- ``HiSparseMHATokenToKVPoolHost`` (MiniMax-M3): one ``[2, layers, rows,
  heads, head_dim]`` buffer, K then V; the region has ``2 × layers`` layers.
- ``DeepSeekV4PagedHostPool``: one ``[pages, page_bytes]`` buffer per layer,
  allocated one after the other; the region has the pool's layers, an entry
  being one padded page of 64 C4 tokens, and each call returns the next
  layer of it.

SGLang's own host-memory check, which these pools run before they allocate,
is booked against the kvtier pool's capacity when that is not DRAM (see
:mod:`kvtier.sglang.capacity`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys

from .._lib import KvtierError
from .._pool import Layout, Pool, device_bytes_for
from . import capacity, counters, topology
from .topology import detect_rank
from ._config import KvtierConfig, is_private


logger = logging.getLogger("kvtier")

_SIZELESS = re.compile(r"^(anon|numa:\d+(\+\d+)*)$")


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


def _itemsize(dtype) -> int:
    torch_dtype = _torch_dtype(dtype)
    if torch_dtype is not None:
        return torch_dtype.itemsize if hasattr(torch_dtype, "itemsize") else _torch_itemsize(torch_dtype)
    import numpy as np

    return np.dtype(dtype).itemsize


class KvtierHostTensorAllocator:
    """An SGLang host-tensor allocator that places layer-first buffers in
    kvtier regions (see the module docs for the three shapes). With a torch
    dtype it returns a CPU torch tensor, with a numpy dtype a numpy array;
    either is a view of the region (no copy) that keeps it alive.

    `layers` is the layer count of a pool that allocates one ``[rows,
    entry_bytes]`` buffer per layer (DeepSeek-V4's): the first call makes the
    region, each call returns the next layer."""

    def __init__(self, config: KvtierConfig | None = None, layers: int | None = None, budget=None):
        self.config = config or KvtierConfig()
        self.layers = layers
        # the rank's share of the kvtier devices (capacity.RankBudget), which
        # SGLang's own check booked the pool against without the region
        # slack that region_layers adds: checked again here with it
        self.budget = budget
        self.dtype = None
        self.dims = None
        self.pools = []
        self.regions = []
        self.placements = []  # (rank, ranks, region device index) per region
        self.choice = None  # with placement "nearest": the rank's topology.Choice
        self._per_layer = None  # (dims, dtype, region view, next layer) while handing out layers

    def allocate(self, dims, dtype, device="cpu"):
        if str(device) != "cpu":
            raise KvtierError(f"KvtierHostTensorAllocator allocates host memory; device={device!r} was asked for")
        dims = tuple(int(d) for d in dims)
        if min(dims, default=0) <= 0:
            raise KvtierError(f"KvtierHostTensorAllocator: dims {dims} have an empty axis")
        itemsize = _itemsize(dtype)
        if len(dims) == 2 and self.layers:
            return self._next_layer(dims, dtype, itemsize)
        if len(dims) == 4 and dims[2] == 1:  # MLA [layers, rows, 1, kv_dim]
            layers, rows, entry, planes = dims[0], dims[1], dims[3] * itemsize, 1
        elif len(dims) == 5 and dims[0] == 2:  # MHA [K/V, layers, rows, heads, head_dim]
            layers, rows, entry, planes = dims[1], dims[2], dims[3] * dims[4] * itemsize, 2
        else:
            raise KvtierError(
                f"KvtierHostTensorAllocator places layer-first buffers ([layers, rows, 1, kv_dim], "
                f"[2, layers, rows, heads, head_dim], or one [rows, bytes] per layer of a pool of known "
                f"layers); got dims {dims} (use layout='layer_first' for the HiSparse host pool)"
            )
        region = self.region(layers, rows, entry, dims, planes)
        self.dtype, self.dims = dtype, dims
        return _view(region, dtype, dims)

    def _next_layer(self, dims, dtype, itemsize):
        if self._per_layer is None:
            rows, entry = dims[0], dims[1] * itemsize
            region = self.region(self.layers, rows, entry, (self.layers,) + dims)
            self._per_layer = [dims, dtype, _view(region, dtype, (self.layers,) + dims), 0]
            self.dtype, self.dims = dtype, dims
        want, want_dtype, whole, i = self._per_layer
        if dims != want or _itemsize(want_dtype) != itemsize:
            raise KvtierError(f"KvtierHostTensorAllocator: layer {i} asks for {dims}, the earlier layers for {want}")
        if i >= self.layers:
            raise KvtierError(f"KvtierHostTensorAllocator: a {i + 1}th layer was asked for; the pool has {self.layers}")
        self._per_layer[3] = i + 1
        return whole[i]

    def rank_devices(self) -> list:
        """The devices this rank's pool is made of: the configured ones, or
        with placement "nearest" one numa device interleaving the nodes
        nearest this rank's GPU (logged)."""
        if self.config.placement != "nearest":
            return list(self.config.devices)
        choice = topology.nearest(self.config.devices, topology.gpu_numa_node(topology.current_gpu()))
        rank, ranks = detect_rank(self.config)
        logger.info("kvtier: rank %d of %d reads its host KV from the devices nearest its GPU: %s", rank, ranks,
                    choice.describe())
        self.choice = choice
        return [choice.device]

    def region(self, layers: int, rows: int, entry: int, dims: tuple, planes: int = 1):
        """A region for `layers` model layers of `rows` entries of `entry` B
        (`planes` layer-first planes each: MHA's K and V), sized for the
        config's region_layers when that is more (the stages of a pipeline
        share the pool; each uses the leading layers of its regions)."""
        if entry % 8:
            raise KvtierError(f"an entry of {entry} B (dims {dims}) is not a multiple of 8 B")
        rank, ranks = detect_rank(self.config)
        if all(is_private(d) for d in self.config.devices):
            layout = Layout(entry, planes * layers, rows)
            devices = sized_devices(self.rank_devices(), layout)
            pool = Pool.create(layout, devices, rank=rank, ranks=ranks)
        else:
            layout = Layout(entry, planes * max(layers, self.config.region_layers or 0), rows)
            devices = self.config.devices
            used = sum(r.nbytes for r in self.regions)
            if self.budget is not None and used + layout.region_bytes() > self.budget.bytes:
                slack = layout.region_bytes() - planes * layers * rows * entry
                raise KvtierError(
                    f"the host pool takes {layout.region_bytes() / 2**20:.1f} MiB in the kvtier pool "
                    f"({slack / 2**20:.1f} MiB of it the region_layers slack: regions of "
                    f"{layout.layers // planes} layers for this stage's {layers}), more than "
                    f"{(self.budget.bytes - used) / 2**20:.1f} MiB left of {self.budget.describe()}: lower "
                    f"host_to_device_ratio in --hisparse-config, or give the pool more devices"
                )
            try:
                pool = Pool.open_or_create(layout, devices, rank=rank, ranks=ranks, clients=self.config.clients)
            except KvtierError as e:
                if "regions hold" not in e.message:
                    raise
                raise KvtierError(
                    f"{e.message}: set region_layers in the kvtier config to the most layers any stage holds (this "
                    f"stage holds {layers})", e.status,
                ) from e
        region = pool.alloc_region(request=rank)
        self.pools.append(pool)
        counters.publish_to(pool)
        self.regions.append(region)
        self.placements.append((rank, ranks, region.device))
        logger.info(
            "kvtier: host KV of %d layers × %d rows × %d B in region %d (%d B) on %s (rank %d of %d)",
            planes * layers, rows, entry, region.index, region.nbytes, devices[region.device], rank, ranks,
        )
        return region


def _view(region, dtype, dims):
    if _torch_dtype(dtype) is not None:
        return region.torch(dtype, dims)
    return region.numpy(dtype, dims)


def host_pool_class(base: type, config: KvtierConfig) -> type:
    """`base` (one of SGLang's HiSparse host pools) with its layer-first
    buffers allocated by :class:`KvtierHostTensorAllocator`; other layouts
    unchanged. SGLang's pools set ``self.allocator`` in their constructor and
    allocate through it; here reading it gives kvtier's allocator for a
    layer-first pool (SGLang's for any other layout)."""

    class KvtierHostPool(base):
        @property
        def allocator(self):
            if getattr(self, "layout", None) != "layer_first":
                return self.__dict__.get("_sglang_allocator")
            mine = self.__dict__.get("_kvtier_allocator")
            if mine is None:
                mine = KvtierHostTensorAllocator(config, layers=getattr(self, "layer_num", None),
                                                 budget=self.__dict__.get("_kvtier_budget"))
                self.__dict__["_kvtier_allocator"] = mine
            return mine

        @allocator.setter
        def allocator(self, value):
            self.__dict__["_sglang_allocator"] = value

        def __init__(self, *args, **kwargs):
            budget = None
            if _layout_argument(base, args, kwargs) == "layer_first":
                budget = capacity.rank_budget(config, *detect_rank(config))
            self.__dict__["_kvtier_budget"] = budget
            with capacity.booked_against(budget, base.__qualname__):
                super().__init__(*args, **kwargs)
            mine = self.__dict__.get("_kvtier_allocator")
            if getattr(self, "layout", None) == "layer_first" and (mine is None or not mine.regions):
                logger.warning(
                    "kvtier: %s allocated its buffers without kvtier's allocator; they are in SGLang's host "
                    "memory, not the kvtier pool", base.__qualname__,
                )
            elif budget is not None and mine is not None:
                capacity.log_use(self, budget, sum(r.nbytes for r in mine.regions), base.__qualname__)

    # SGLang backs up each decode step's newest tokens through one of these,
    # on the host, CUDA graphs or not: the per-step moment to poll for bad
    # indices (kvtier.sglang.bad_indices).
    for name in PER_STEP_METHODS:
        original = getattr(base, name, None)
        if callable(original):
            setattr(KvtierHostPool, name, _polling(original))

    KvtierHostPool.__name__ = base.__name__
    KvtierHostPool.__qualname__ = f"kvtier[{base.__qualname__}]"
    KvtierHostPool.__module__ = __name__
    return KvtierHostPool


PER_STEP_METHODS = ("backup_from_device_all_layer", "backup_tokens_from_device_all_layer")


def _polling(method):
    @functools.wraps(method)
    def per_step(self, *args, **kwargs):
        counters.per_step()
        return method(self, *args, **kwargs)

    return per_step


def _layout_argument(base: type, args: tuple, kwargs: dict):
    """The `layout` a host pool is being built with, read from its
    constructor's arguments before it runs (a pool without the parameter is
    layer-first: SGLang's MHA HiSparse pool); None if they do not bind."""
    try:
        sig = inspect.signature(base.__init__)
        bound = sig.bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return None
    if "layout" not in sig.parameters:
        return "layer_first"
    bound.apply_defaults()
    return bound.arguments.get("layout")


def _torch_dtype(dtype):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype
    return None


def _torch_itemsize(dtype) -> int:
    torch = sys.modules["torch"]
    return torch.empty((), dtype=dtype).element_size()
