"""SGLang's host KV pools in a kvtier pool: HiSparse's, and HiCache's L2.

SGLang's host pools allocate their buffers through an allocator object with
``allocate(dims, dtype, device)`` (``HostTensorAllocator``), then register
them with the GPU themselves. :class:`KvtierHostTensorAllocator` is such an
allocator; each buffer becomes one kvtier region, on the device the per-rank
round-robin picks for this rank. A region is layer-first ``[layers][rows]
[entry bytes]``, and each HiSparse pool is one of those:

- ``MLATokenToKVPoolHost`` (DSA): one ``[layers, rows, 1, kv_dim]`` buffer;
  an entry is a token's latent.
- ``HiSparseMHATokenToKVPoolHost`` (MiniMax-M3): one ``[2, layers, rows,
  heads, head_dim]`` buffer, K then V; the region has ``2 × layers`` layers.
- ``DeepSeekV4PagedHostPool``: one ``[pages, page_bytes]`` buffer per layer,
  allocated one after the other; the region has the pool's layers, an entry
  being one padded page of 64 C4 tokens, and each call returns the next
  layer of it.

HiCache's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``)
come in five layouts (:data:`LAYOUT_AXES`); a buffer of any of them is one
region holding its bytes in SGLang's order, the region's layers being the
buffer's (times two for MHA's K and V) and its rows the buffer's tokens or
pages, so that its size, and the slack of ``region_layers``, count as for a
layer-first buffer. Only ``layer_first`` is the region's own layout.

SGLang's own host-memory check, which these pools run before they allocate,
is booked against the kvtier pool's capacity when that is not DRAM (see
:mod:`kvtier.sglang.capacity`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
import sys
import weakref

from .._lib import KvtierError
from .._pool import Layout, Pool, device_bytes_for
from . import capacity, counters, topology
from .topology import detect_rank
from ._config import KvtierConfig, is_private


logger = logging.getLogger("kvtier")

_SIZELESS = re.compile(r"^(anon|numa:\d+(\+\d+)*)$")

# SGLang's host-pool layouts (--hicache-mem-layout, 0.5.21 to 0.5.23;
# init_kv_buffer of pool_host/mha.py and pool_host/mla.py): the rank of a
# buffer without MHA's leading K/V axis of 2, and the axes of its layers and
# of its rows (tokens, or pages of page_size tokens) there.
LAYOUT_AXES = {
    "layer_first": (4, 0, 1),  # [layers, tokens, 1, dim]; MHA [2, layers, tokens, heads, dim]
    "page_first": (4, 1, 0),  # [tokens, layers, 1, dim]; MHA [2, tokens, layers, heads, dim]
    "page_first_direct": (5, 1, 0),  # [pages, layers, page, 1, dim]; MHA [2, pages, layers, page, heads, dim]
    "page_head": (5, 3, 0),  # MHA [2, pages, heads, page, layers, dim]
    "page_first_kv_split": (5, 1, 0),  # MLA [pages, layers, page, 1, width], one buffer per part
}
HICACHE_LAYOUTS = tuple(LAYOUT_AXES)

# What to change when a pool does not fit, by the pool's kind.
HISPARSE_ADVICE = "lower host_to_device_ratio in --hisparse-config"
HICACHE_ADVICE = "lower --hicache-ratio or --hicache-size"

# Every allocator of this process, for what their regions already hold of a
# rank's budget when another host pool is built (hybrid models build several).
_allocators: "weakref.WeakSet" = weakref.WeakSet()


def held_bytes(device: str) -> int:
    """Bytes this process's host pools hold in kvtier regions on `device`:
    whole regions (a buffer smaller than its pool's regions holds one all
    the same)."""
    return sum(region_bytes(r) for a in list(_allocators) for r, d in zip(a.regions, a.region_devices) if d == device)


def region_bytes(region) -> int:
    """The bytes a region takes of its pool: the pool's region stride."""
    return max(region.nbytes, region.pool.info()["region_stride"])


def placement(layout: str, dims: tuple, itemsize: int) -> tuple:
    """(layers, rows, entry bytes, planes) of the region for a host-pool
    buffer of `dims` in SGLang's `layout`; a KvtierError for dims that are
    not that layout's."""
    if layout not in LAYOUT_AXES:
        raise KvtierError(f"KvtierHostTensorAllocator: SGLang's host layout {layout!r} is not one of "
                          f"{', '.join(LAYOUT_AXES)}")
    rank, layer_axis, row_axis = LAYOUT_AXES[layout]
    planes = 2 if len(dims) == rank + 1 and dims[0] == 2 else 1
    if len(dims) != rank + (planes == 2):
        what = "layer-first buffers ([layers, rows, 1, kv_dim], [2, layers, rows, heads, head_dim], or one [rows, " \
               "bytes] per layer of a pool of known layers)" if layout == "layer_first" else f"{layout} buffers"
        raise KvtierError(f"KvtierHostTensorAllocator places {what}; got dims {dims}")
    axes = dims[1:] if planes == 2 else dims
    layers, rows = axes[layer_axis], axes[row_axis]
    entry = math.prod(d for i, d in enumerate(axes) if i not in (layer_axis, row_axis)) * itemsize
    return layers, rows, entry, planes


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
    """An SGLang host-tensor allocator that places a host pool's buffers in
    kvtier regions (see the module docs for the shapes). With a torch dtype
    it returns a CPU torch tensor, with a numpy dtype a numpy array; either
    is a view of the region (no copy) that keeps it alive.

    `layers` is the layer count of a pool that allocates one ``[rows,
    entry_bytes]`` buffer per layer (DeepSeek-V4's): the first call makes the
    region, each call returns the next layer. `layout` is the pool's SGLang
    host layout (one of :data:`LAYOUT_AXES`); `advice` what the refusal of a
    pool too large for the budget tells the user to change."""

    def __init__(self, config: KvtierConfig | None = None, layers: int | None = None, budget=None,
                 layout: str = "layer_first", advice: str = HISPARSE_ADVICE):
        self.config = config or KvtierConfig()
        self.layers = layers
        self.layout = layout
        self.advice = advice
        # the rank's share of the kvtier devices (capacity.RankBudget), which
        # SGLang's own check booked the pool against without the region
        # slack that region_layers adds: checked again here with it
        self.budget = budget
        self.dtype = None
        self.dims = None
        self.pools = []
        self.regions = []
        self.region_devices = []  # the configured device each region is on (its budget's device)
        self.placements = []  # (rank, ranks, region device index) per region
        self.choice = None  # with placement "nearest": the rank's topology.Choice
        self._per_layer = None  # (dims, dtype, region view, next layer) while handing out layers
        _allocators.add(self)

    def allocate(self, dims, dtype, device="cpu"):
        if str(device) != "cpu":
            raise KvtierError(f"KvtierHostTensorAllocator allocates host memory; device={device!r} was asked for")
        dims = tuple(int(d) for d in dims)
        if min(dims, default=0) <= 0:
            raise KvtierError(f"KvtierHostTensorAllocator: dims {dims} have an empty axis")
        itemsize = _itemsize(dtype)
        if len(dims) == 2 and self.layers:
            return self._next_layer(dims, dtype, itemsize)
        layers, rows, entry, planes = placement(self.layout, dims, itemsize)
        if self.layout != "layer_first":
            # the region only holds these bytes, in SGLang's order: its entry
            # is a unit of size, rounded up to the pool's 8 B
            entry = -(-entry // 8) * 8
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
            named = self.rank_devices()
            devices = sized_devices(named, layout)
            pool = Pool.create(layout, devices, rank=rank, ranks=ranks)
        else:
            layout = Layout(entry, planes * max(layers, self.config.region_layers or 0), rows)
            devices = named = self.config.devices
            used = sum(region_bytes(r) for r in self.regions)

            def check_budget(takes: int):
                if self.budget is None or used + takes <= self.budget.bytes:
                    return
                slack = takes - planes * layers * rows * entry
                raise KvtierError(
                    f"the host pool takes {takes / 2**20:.1f} MiB in the kvtier pool "
                    f"({slack / 2**20:.1f} MiB of it slack: the region_layers slack of regions of "
                    f"{layout.layers // planes} layers for this stage's {layers}, or a region the pool sized for a "
                    f"larger buffer), more than {(self.budget.bytes - used) / 2**20:.1f} MiB left of "
                    f"{self.budget.describe()}: {self.advice}, or give the pool more devices"
                )

            check_budget(layout.region_bytes())
            try:
                pool = Pool.open_or_create(layout, devices, rank=rank, ranks=ranks, clients=self.config.clients)
            except KvtierError as e:
                if "regions hold" not in e.message:
                    raise
                raise KvtierError(
                    f"{e.message}: the pool's regions were sized by the first host buffer placed in it; set "
                    f"region_layers in the kvtier config to the most layers any stage holds (this stage holds "
                    f"{layers}), or, where a rank places host pools of different sizes (hybrid models' pools, "
                    f"HiSparse and HiCache together), give it private devices (numa:, anon)", e.status,
                ) from e
            # a buffer smaller than the pool's regions takes a whole one
            check_budget(max(layout.region_bytes(), pool.info()["region_stride"]))
        region = pool.alloc_region(request=rank)
        self.pools.append(pool)
        counters.publish_to(pool)
        self.regions.append(region)
        self.region_devices.append(named[region.device])
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


def host_pool_class(base: type, config: KvtierConfig, hicache: bool = False) -> type:
    """`base` (one of SGLang's host pools) with its buffers allocated by
    :class:`KvtierHostTensorAllocator`. SGLang's pools set ``self.allocator``
    in their constructor and allocate through it; here reading it gives
    kvtier's allocator for a pool kvtier serves, SGLang's for any other.

    A HiSparse pool (`hicache` false) is served in layout ``layer_first``, the
    one kvtier's swap-in reads. A HiCache pool is served in every layout of
    :data:`LAYOUT_AXES` when SGLang's allocator is its plain host memory: the
    allocators of storage backends (Mooncake, shm, ...) register or share
    their memory themselves, so those pools stay theirs."""
    layouts = HICACHE_LAYOUTS if hicache else ("layer_first",)
    advice = HICACHE_ADVICE if hicache else HISPARSE_ADVICE

    def served(pool) -> bool:
        if getattr(pool, "layout", None) not in layouts:
            return False
        theirs = pool.__dict__.get("_sglang_allocator")
        return not hicache or type(theirs).__name__ == "HostTensorAllocator"

    class KvtierHostPool(base):
        @property
        def allocator(self):
            if not served(self):
                return self.__dict__.get("_sglang_allocator")
            mine = self.__dict__.get("_kvtier_allocator")
            if mine is None:
                mine = KvtierHostTensorAllocator(config, layers=getattr(self, "layer_num", None),
                                                 budget=self.__dict__.get("_kvtier_budget"), layout=self.layout,
                                                 advice=advice)
                self.__dict__["_kvtier_allocator"] = mine
            return mine

        @allocator.setter
        def allocator(self, value):
            self.__dict__["_sglang_allocator"] = value

        # SGLang's signature, for code that inspects it (inspect.signature
        # follows __wrapped__)
        @functools.wraps(base.__init__)
        def __init__(self, *args, **kwargs):
            budget = None
            # (a pool left to a storage backend's allocator stays in DRAM:
            # SGLang's check books it against DRAM, as without kvtier)
            layout, allocator_type = _pool_arguments(base, args, kwargs)
            if layout in layouts and not (hicache and allocator_type in STORAGE_ALLOCATORS):
                budget = capacity.rank_budget(config, *detect_rank(config))
                if budget is not None:
                    budget = budget.less(held_bytes(budget.device))
            self.__dict__["_kvtier_budget"] = budget
            with capacity.booked_against(budget, base.__qualname__, advice):
                super().__init__(*args, **kwargs)
            mine = self.__dict__.get("_kvtier_allocator")
            layout = getattr(self, "layout", None)
            if layout in layouts and (mine is None or not mine.regions):
                theirs = type(self.__dict__.get("_sglang_allocator")).__name__
                logger.warning(
                    "kvtier: %s (layout %s) allocated its buffers without kvtier's allocator%s; they are in "
                    "SGLang's host memory, not the kvtier pool", base.__qualname__, layout,
                    "" if served(self) else f" (SGLang's allocator is its storage backend's {theirs})",
                )
            elif mine is not None and mine.regions:
                if budget is not None:
                    capacity.log_use(self, budget, sum(r.nbytes for r in mine.regions), base.__qualname__,
                                     "--hicache-ratio {}" if hicache else "host_to_device_ratio {} in --hisparse-config")
                if hicache:
                    logger.info("kvtier: HiCache's host KV pool %s (layout %s) is in the kvtier pool: %s",
                                base.__qualname__, layout, ", ".join(
                                    f"region {r.index} on {d} ({r.nbytes} B)"
                                    for r, d in zip(mine.regions, mine.region_devices)))

    if not hicache:
        # SGLang backs up each decode step's newest tokens through one of
        # these, on the host, CUDA graphs or not: the per-step moment to poll
        # for bad indices (kvtier.sglang.bad_indices).
        for name in PER_STEP_METHODS:
            original = getattr(base, name, None)
            if callable(original):
                setattr(KvtierHostPool, name, _polling(original))

    KvtierHostPool.__name__ = base.__name__
    KvtierHostPool.__qualname__ = f"kvtier[{base.__qualname__}]"
    KvtierHostPool.__module__ = __name__
    return KvtierHostPool


def hicache_mha_chooser(choose, base: type, served: type):
    """SGLang's choice of an MHA host pool class (`choose`), giving `served`
    where it gives `base` and SGLang's own choice otherwise (K and V of
    different widths, MXFP8 scales: allocated otherwise, not in kvtier)."""

    @functools.wraps(choose)
    def chooser(*args, **kwargs):
        chosen = choose(*args, **kwargs)
        if chosen is base:
            return served
        logger.info("kvtier: HiCache's host KV pool %s stays in SGLang's host memory (kvtier places %s)",
                    getattr(chosen, "__name__", chosen), base.__name__)
        return chosen

    return chooser


PER_STEP_METHODS = ("backup_from_device_all_layer", "backup_tokens_from_device_all_layer")


def _polling(method):
    @functools.wraps(method)
    def per_step(self, *args, **kwargs):
        counters.per_step()
        return method(self, *args, **kwargs)

    return per_step


# The `allocator_type`s for which SGLang's get_allocator_from_storage
# (pool_host/common.py, 0.5.21-0.5.23) gives a storage backend's allocator
# where the backend is installed; every other gives its plain host memory.
STORAGE_ALLOCATORS = ("mooncake", "mori", "shm", "tensorcast")


def _pool_arguments(base: type, args: tuple, kwargs: dict) -> tuple:
    """(`layout`, `allocator_type`) a host pool is being built with, read from
    its constructor's arguments before it runs: a pool without a layout
    parameter is layer-first (SGLang's MHA HiSparse pool), one without an
    allocator type SGLang's "default"; (None, "default") if they do not
    bind."""
    try:
        sig = inspect.signature(base.__init__)
        bound = sig.bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return None, "default"
    bound.apply_defaults()
    layout = bound.arguments.get("layout") if "layout" in sig.parameters else "layer_first"
    return layout, bound.arguments.get("allocator_type", "default")


def _torch_dtype(dtype):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype
    return None


def _torch_itemsize(dtype) -> int:
    torch = sys.modules["torch"]
    return torch.empty((), dtype=dtype).element_size()
