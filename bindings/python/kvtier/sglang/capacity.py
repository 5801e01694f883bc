"""Host-memory accounting for a host pool in kvtier (HiSparse's, HiCache's).

SGLang checks every host pool against a DRAM budget before it allocates
(``host_memory_budget_bytes`` in ``sglang/srt/mem_cache/pool_host/base.py``:
the host's available memory, less a reserve, divided among the host's ranks),
and refuses a pool larger than that. Memory on a devdax CXL device, or a file
on a DAX-mounted one, is not in the kernel's available memory, so a pool far
larger than DRAM, the reason to put host KV on CXL, would be refused.

When the kvtier pool's devices are not the host's DRAM, kvtier books the pool
against the rank's share of the kvtier devices instead: SGLang's own check
runs inside its ``host_memory_budget_scope`` with that share as the budget.
When they are DRAM (``anon``, files on tmpfs or ramfs), SGLang's check is the
right one and stays.

A rank's host pool is one region of the kvtier pool, on the device its
per-rank round-robin gives it first (rank r on device r mod n). Its share is
that device's capacity divided among the ranks that start on it, or for a
device private to the rank (``numa:NODE:SIZE``) the device's size, less what
the rank's other host pools (a hybrid model builds several) already hold
there.
"""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

from .._lib import KvtierError
from .._pool import device_capacity
from . import topology
from ._config import KvtierConfig, is_private

logger = logging.getLogger("kvtier")

# Where SGLang keeps its host-memory budget (0.5.21 to 0.5.23).
BUDGET_MODULE = "sglang.srt.mem_cache.pool_host.base"


class RankBudget(NamedTuple):
    """The host-pool budget of rank `rank` of `ranks` in the kvtier pool."""

    bytes: int  # the rank's share of `device`
    device: str  # the device the rank's host pool goes to
    device_bytes: int  # what that device holds
    sharing_ranks: int  # ranks whose host pools share it
    rank: int
    ranks: int
    held: int = 0  # of the share, what the rank's earlier host pools hold

    def less(self, held: int) -> "RankBudget":
        """The budget left once the rank's other host pools hold `held` bytes."""
        return self._replace(bytes=max(self.bytes - held, 0), held=self.held + held) if held else self

    def describe(self) -> str:
        share = "" if self.sharing_ranks == 1 else f" shared by {self.sharing_ranks} ranks"
        held = f", {_size(self.held)} of its share held by this rank's other host pools" if self.held else ""
        return (
            f"{_size(self.bytes)} for rank {self.rank} of {self.ranks}: {self.device} holds "
            f"{_size(self.device_bytes)}{share}{held}"
        )


def rank_budget(config: KvtierConfig, rank: int, ranks: int) -> RankBudget | None:
    """The budget of `rank` in the kvtier pool `config` describes, or None
    when the pool's memory is the host's DRAM (then SGLang's own accounting
    applies)."""
    devices = config.devices
    if any(d == "anon" or d.startswith("anon:") for d in devices):
        return None
    if config.placement == "nearest":
        mine = topology.nearest(devices, topology.gpu_numa_node(topology.current_gpu()))
        device = mine.device
        # the ranks whose GPUs are nearest the same nodes (all, when unknown)
        gpus = topology.local_gpu_count()
        same = [g for g in range(gpus) if topology.nearest(devices, topology.gpu_numa_node(g)).nodes == mine.nodes]
        sharers = len(same) if mine.gpu_node is not None and same else ranks
    else:
        d = rank % len(devices)
        device = devices[d]
        sharers = len(range(d, ranks, len(devices)))
    cap = device_capacity(device)
    if cap.host_dram:
        return None
    # numa:NODE without a size: the node's free memory, which every rank on
    # the node draws from; a sized private device is the rank's own.
    own = is_private(device) and device.count(":") >= 2
    sharing = 1 if own else max(sharers, 1)
    return RankBudget(cap.bytes // sharing, device, cap.bytes, sharing, rank, ranks)


def device_problem(devices: list) -> str | None:
    """Why the host pool cannot live on `devices`, or None. SGLang registers
    its host pool with the GPU (``cudaHostRegister``), and under
    prefill/decode disaggregation with the KV transfer engine (``ibv_reg_mr``);
    both pin the pages for as long as they are registered, which Linux refuses
    for files on a disk filesystem or FS-DAX. A device that cannot be read
    (a missing dax device or NUMA node) is named with the library's reason."""
    for d in devices:
        if d == "anon":
            continue  # sized for the pool when it is made
        try:
            cap = device_capacity(d)
        except KvtierError as e:
            if d.startswith("file:") and d.count(":") == 1:
                continue  # a pool file to open, made by another rank
            return f"{d}: {e}"
        if not cap.pinnable:
            return (
                f"{d} is a file on a filesystem whose pages cannot be pinned (a disk or FS-DAX), so SGLang's "
                f"registration of the host pool with the GPU would fail: use tmpfs, hugetlbfs, dax: or numa:"
            )
    return None


def device_warnings(devices: list) -> list:
    """What may keep the host pool from being where `devices` say, served all
    the same: a ``numa:`` device whose nodes' memory is (partly) in
    ZONE_MOVABLE, whose pages SGLang's registration of the host pool with
    the GPU migrates off the node, into another node's DRAM."""
    out = []
    for d in devices:
        if not d.startswith("numa:"):
            continue
        try:
            cap = device_capacity(d)
        except KvtierError:
            continue  # device_problem names it
        if cap.movable_bytes:
            out.append(
                f"{d}: {cap.movable_bytes / 2**30:.1f} GiB of its nodes' memory is onlined as movable "
                f"(ZONE_MOVABLE); SGLang's registration of the host pool with the GPU migrates those pages off "
                f"the node, into DRAM. Online the CXL memory as normal memory (daxctl online-memory "
                f"--no-movable), or give it as a dax: device"
            )
    return out


@contextlib.contextmanager
def booked_against(budget: RankBudget | None, pool_name: str,
                   advice: str = "lower host_to_device_ratio in --hisparse-config"):
    """Runs a host pool's construction with SGLang's host-memory check
    booking against `budget` instead of DRAM (nothing changes for None). A
    refusal by that check is raised as a :class:`KvtierError` that says what
    the budget was, and `advice`: what to change."""
    if budget is None:
        yield
        return
    try:
        scope = __import__(BUDGET_MODULE, fromlist=["host_memory_budget_scope"]).host_memory_budget_scope
    except (ImportError, AttributeError):
        logger.warning(
            "kvtier: this SGLang has no host_memory_budget_scope; %s is checked against DRAM, not the kvtier "
            "pool's %s", pool_name, budget.describe(),
        )
        yield
        return
    logger.info("kvtier: %s is checked against the kvtier pool, not DRAM: %s", pool_name, budget.describe())
    try:
        with scope(budget.bytes):
            yield
    except ValueError as e:
        if "host memory" not in str(e):
            raise
        raise KvtierError(
            f"{pool_name} does not fit the kvtier pool: {e} (the budget was the kvtier pool's "
            f"{budget.describe()}); give the pool more or larger devices, or {advice}"
        ) from e


def log_use(pool, budget: RankBudget, used_bytes: int, pool_name: str,
            ratio_setting: str = "host_to_device_ratio {} in --hisparse-config") -> None:
    """Logs how much of the rank's budget the host pool takes and, for a pool
    sized by a ratio to the device pool, the setting of that ratio
    (`ratio_setting`, formatted with it) that would fill it."""
    if used_bytes <= 0 or budget.bytes <= 0:
        return
    line = f"kvtier: {pool_name} takes {_size(used_bytes)} of {budget.describe()} ({100 * used_bytes / budget.bytes:.0f}%)"
    ratio = fill_ratio(pool, budget.bytes, used_bytes)
    if ratio is not None:
        line += f"; {ratio_setting.format(ratio)} would fill it"
    logger.info("%s", line)


def fill_ratio(pool, budget_bytes: int, used_bytes: int) -> int | None:
    """The largest whole host_to_device_ratio whose host pool fits
    `budget_bytes`, for a pool whose `size` rows are `device_capacity_tokens`
    × the ratio (SGLang's HostKVCache); None for others."""
    size = getattr(pool, "size", None)
    device_tokens = getattr(pool, "device_capacity_tokens", None)
    if not isinstance(size, int) or not isinstance(device_tokens, int) or size <= 0 or device_tokens <= 0:
        return None
    bytes_per_row = used_bytes / size
    # SGLang adds one padding page to the ratio's rows; leave room for it.
    page = getattr(pool, "page_size", 1) if isinstance(getattr(pool, "page_size", 1), int) else 1
    return max(int((budget_bytes / bytes_per_row - page) // device_tokens), 0)


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
