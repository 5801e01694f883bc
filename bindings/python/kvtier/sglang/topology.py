"""Which NUMA devices a rank's host pool uses: those nearest its GPU.

With ``placement: "nearest"`` and NUMA devices (CXL memory onlined as
CPU-less nodes), each rank's host pool is interleaved page by page over the
configured nodes at the smallest NUMA distance from the node its GPU hangs
off (``numa:2+3``): the capacity and the links of every CXL device on the
GPU's socket, none across the socket interconnect. Distances come from
``/sys/devices/system/node/nodeN/distance``; the GPU's node from its PCI
device in sysfs, through the library. Where either is unknown, every
configured node is used.
"""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path
from typing import NamedTuple

from .._lib import KvtierError, library
from .._pool import device_capacity
from ._config import KvtierConfig

SYSFS = Path("/sys")
_NUMA = re.compile(r"^numa:(\d+(?:\+\d+)*)(?::(.+))?$")


class Choice(NamedTuple):
    """A rank's device: `device` (a numa spec), from `nodes` at `distance`
    from `gpu_node` (None: unknown)."""

    device: str
    nodes: tuple
    gpu_node: int | None
    distance: int | None

    def describe(self) -> str:
        where = "an unknown NUMA node" if self.gpu_node is None else f"NUMA node {self.gpu_node}"
        how = "" if self.distance is None else f" at distance {self.distance}"
        return f"GPU on {where}: {self.device}{how}"


def numa_nodes_of(devices: list) -> list:
    """The (nodes, size text or None) of each ``numa:`` device; refuses others."""
    out = []
    for d in devices:
        m = _NUMA.match(d)
        if not m:
            raise KvtierError(f"placement \"nearest\" takes numa: devices only; {d!r} is not one")
        out.append((tuple(int(n) for n in m.group(1).split("+")), m.group(2)))
    return out


def distances_from(node: int, sysfs: Path = SYSFS) -> dict:
    """{node: distance} from `node`, read from sysfs (empty when unknown)."""
    base = sysfs / "devices/system/node"
    try:
        row = [int(x) for x in (base / f"node{node}" / "distance").read_text().split()]
    except (OSError, ValueError):
        return {}
    # the row lists the online nodes in ascending order
    nodes = sorted(int(p.name[4:]) for p in base.glob("node[0-9]*") if p.name[4:].isdigit())
    return dict(zip(nodes, row)) if len(nodes) == len(row) else {}


def nearest(devices: list, gpu_node: int | None, sysfs: Path = SYSFS) -> Choice:
    """The rank's device: the configured nodes nearest `gpu_node`,
    interleaved when there are several (sizes, where given, add up)."""
    parsed = numa_nodes_of(devices)
    dist = distances_from(gpu_node, sysfs) if gpu_node is not None else {}
    best = None
    if dist and all(n in dist for nodes, _ in parsed for n in nodes):
        best = min(dist[n] for nodes, _ in parsed for n in nodes)
        parsed = [(nodes, size) for nodes, size in parsed if all(dist[n] == best for n in nodes)]
    nodes = tuple(n for ns, _ in parsed for n in ns)
    sizes = [size for _, size in parsed]
    spec = "numa:" + "+".join(map(str, nodes))
    if all(s is not None for s in sizes):
        # the library's size syntax, read through an anon: spec of that size
        spec += f":{sum(device_capacity(f'anon:{s}').bytes for s in sizes)}"
    return Choice(spec, nodes, gpu_node, best)


def gpu_numa_node(ordinal: int | None) -> int | None:
    """The NUMA node GPU `ordinal` hangs off, None when unknown (or no GPU)."""
    if ordinal is None:
        return None
    out = ctypes.c_int32(-1)
    try:
        if library().kvt_cuda_numa_node(int(ordinal), ctypes.byref(out)) != 0:
            return None
    except KvtierError:
        return None
    return out.value if out.value >= 0 else None


def local_gpu_count() -> int:
    """GPUs this process sees (torch's count; 0 without torch or a GPU)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except Exception:
        return 0
    return 0


def current_gpu() -> int | None:
    """This process's CUDA device (torch's), None without torch or a GPU."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:
        return None
    return None


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
