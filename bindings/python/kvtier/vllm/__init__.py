"""vLLM's HiSparse host pool in a kvtier pool (vLLM 0.33.0).

vLLM's HiSparse keeps each rank's host KV in one CPU allocation
(``HiSparseHostPool.allocate`` in ``vllm.v1.hisparse.runtime``: a byte
buffer, layer-outermost, registered with CUDA as one range), refused above
95 % of the memory psutil says is available: no capacity beyond DRAM, no CXL
devices. With ``KVTIER_VLLM_CONFIG`` set (JSON: ``{"devices": [...], "rank":
null, "ranks": null, "placement": "round_robin"}``, the devices in
kvtier's syntax: ``anon``,
``numa:NODE[:SIZE]``, ``file:PATH:SIZE``, ``dax:PATH``), kvtier's vLLM plugin
(entry point group ``vllm.general_plugins``, which vLLM loads in every
process before the pool exists) makes the per-rank pool a kvtier region
instead:

- on the configured devices, rank ``r`` on device ``r mod n`` (devdax and
  file devices shared by the ranks, each rank its own region);
- refused, with the device and the sizes, where the pool does not fit the
  kvtier device (kvtier's capacity check instead of vLLM's 95 % of DRAM);
- registered with CUDA through vLLM's own ``pin_tensor`` (one range, as vLLM
  registers its own), so that vLLM's shutdown (``cudaHostUnregister`` of the
  ``registered`` tensor), its kernels' check that the pool is registered
  host memory, and NIXL's registration of the per-layer views work as
  before; the region stays mapped as long as the pool object.

The shared single-node TP pool (vLLM's ``/dev/shm`` file, used when every
rank is on one node with TP > 1: one copy of the replicated MLA KV that TP
rank 0 writes and every rank reads) becomes one kvtier region when the
devices are shared ones (``file:``, ``dax:``): TP rank 0 allocates it, tells
the others its (index, epoch) over vLLM's TP group, and they join it (a
kvtier pool's joined region: never reclaimed nor freed while a live rank
maps it). Every rank registers it in vLLM's own chunks
(``_hisparse_registration_ranges``, on host-block and page boundaries)
through ``pin_tensor``, and its ``cleanup()`` unregisters them through
vLLM's ``host_unregister``, as vLLM's own shared region does. With private
devices (``anon``, ``numa:``) the shared pool stays vLLM's.

The plugin reads vLLM's source before it patches anything (:func:`report`):
where the pool's class, its ``allocate`` or the names it relies on differ
from vLLM 0.33.0's, nothing is installed and one line says why; where only
the shared pool's names differ, the shared pool stays vLLM's and its line
says why.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .._lib import KvtierError
from .._packages import package_root, package_version

logger = logging.getLogger("kvtier")

ENV = "KVTIER_VLLM_CONFIG"
RUNTIME = "vllm.v1.hisparse.runtime"
RUNTIME_FILE = "vllm/v1/hisparse/runtime.py"
BINDING_FILE = "vllm/v1/hisparse/binding.py"
CHECKED_VERSIONS = ("0.33.0",)
# What the per-rank pool relies on in vLLM's runtime module.
RUNTIME_NAMES = ("HiSparseHostPool", "check_hisparse_host_memory", "allocate_pinned_host_pool", "pin_tensor",
                 "get_hisparse_host_pool")
POOL_ATTRS = ("vllm_config", "kv_cache_config", "backing", "registered", "shared_region")
HOST_REGISTER_FILE = "vllm/v1/kv_offload/cpu/host_register.py"
# What the shared TP pool relies on in vLLM's runtime module.
SHARED_NAMES = ("allocate_hisparse_host_pools", "_hisparse_registration_ranges", "get_tp_group")
PAGE = 4096


@dataclass
class VllmConfig:
    """What the plugin places where: the kvtier devices, this process's rank
    for the per-rank round-robin (default: torch.distributed's), and the
    placement: ``round_robin`` (rank r's pool on device r mod n) or
    ``nearest`` (``numa:`` devices only: each rank's pool interleaved over
    the configured nodes nearest its GPU, as for SGLang)."""

    devices: list = field(default_factory=lambda: ["anon"])
    rank: int | None = None
    ranks: int | None = None
    placement: str = "round_robin"

    def __post_init__(self):
        # the same device, rank and placement checks as the SGLang shim's
        self.kvtier_config()
        if isinstance(self.devices, str):
            self.devices = [self.devices]

    def kvtier_config(self):
        """The SGLang shim's config for the same placement (its allocator
        places vLLM's pools)."""
        # here, not at the top: kvtier.sglang loads the whole SGLang shim and numpy, which
        # vLLM's plugin load (every process, kvtier configured or not) need not pay
        from ..sglang._config import KvtierConfig

        return KvtierConfig(devices=self.devices, rank=self.rank, ranks=self.ranks, placement=self.placement)


def load_config(config=None) -> VllmConfig:
    """A VllmConfig from a VllmConfig, a dict, JSON text or a JSON file path,
    or (None) ``KVTIER_VLLM_CONFIG``."""
    if isinstance(config, VllmConfig):
        return config
    if config is None:
        config = os.environ.get(ENV) or "{}"
    if isinstance(config, (str, os.PathLike)):
        text = str(config)
        try:
            config = json.loads(text) if text.lstrip().startswith("{") else json.loads(Path(text).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise KvtierError(f"kvtier vLLM config: cannot read {text!r}: {e}") from e
    if not isinstance(config, dict):
        raise KvtierError(f"kvtier vLLM config: expected a JSON object, got {type(config).__name__}")
    unknown = sorted(set(config) - set(VllmConfig.__dataclass_fields__))
    if unknown:
        raise KvtierError(f"kvtier vLLM config: unknown keys {unknown}; known: devices, rank, ranks, placement")
    return VllmConfig(**config)


# ---- what vLLM's source says ----------------------------------------------------


def _top_level(tree: ast.Module) -> tuple:
    """A module's top-level functions and classes by name, and the names it
    imports from other modules."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    return defs, imported


def source_problems(runtime_src: str, binding_src: str) -> list:
    """Why kvtier's per-rank pool cannot stand in for vLLM's, from the
    source of ``vllm/v1/hisparse/runtime.py`` and ``binding.py`` (empty:
    it can)."""
    defs, imported = _top_level(ast.parse(runtime_src))
    problems = [f"no {n}" for n in RUNTIME_NAMES if n not in defs and n not in imported]
    pool = defs.get("HiSparseHostPool")
    if isinstance(pool, ast.ClassDef):
        methods = {n.name: n for n in pool.body if isinstance(n, ast.FunctionDef)}
        want = {"__init__": ["self", "vllm_config", "kv_cache_config"], "allocate": ["self", "size"]}
        for name, params in want.items():
            got = [a.arg for a in methods[name].args.args] if name in methods else None
            if got != params:
                problems.append(f"HiSparseHostPool.{name} takes {got}, kvtier knows {params}")
        init = methods.get("__init__")
        targets = [t for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets] if init else []
        targets += [n.target for n in ast.walk(init) if isinstance(n, ast.AnnAssign)] if init else []
        assigned = {t.attr for t in targets if isinstance(t, ast.Attribute)}
        missing = [a for a in POOL_ATTRS if a not in assigned]
        if missing:
            problems.append(f"HiSparseHostPool.__init__ does not set {missing}")
    calls = [n for n in ast.walk(ast.parse(binding_src)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "allocate"]
    if not any(len(c.args) == 1 and not c.keywords for c in calls):
        problems.append("binding.py no longer calls host_pool.allocate(size)")
    return problems


def _args(fn: ast.FunctionDef) -> tuple:
    return [a.arg for a in fn.args.args], [a.arg for a in fn.args.kwonlyargs]


def shared_source_problems(runtime_src: str, host_register_src: str) -> list:
    """Why kvtier's shared TP pool cannot stand in for vLLM's, from the source
    of ``vllm/v1/hisparse/runtime.py`` and
    ``vllm/v1/kv_offload/cpu/host_register.py`` (empty: it can)."""
    defs, imported = _top_level(ast.parse(runtime_src))
    problems = [f"no {n}" for n in SHARED_NAMES if n not in defs and n not in imported]
    want = {
        "allocate_hisparse_host_pools": (["vllm_config", "tensor_sizes", "num_blocks", "host_block_stride"],
                                         ["use_shared_host_pool"]),
        "_hisparse_registration_ranges": (["tensor_sizes", "num_blocks", "host_block_stride", "max_chunk_bytes"], []),
    }
    for name, params in want.items():
        fn = defs.get(name)
        if isinstance(fn, ast.FunctionDef) and _args(fn) != params:
            problems.append(f"{name} takes {_args(fn)}, kvtier knows {params}")
    pool = defs.get("HiSparseHostPool")
    allocate = next((n for n in pool.body if isinstance(n, ast.FunctionDef) and n.name == "allocate"), None) \
        if isinstance(pool, ast.ClassDef) else None
    calls = [n for n in ast.walk(allocate) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "allocate_hisparse_host_pools"] if allocate else []
    if not any(any(k.arg == "use_shared_host_pool" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in c.keywords) for c in calls):
        problems.append("HiSparseHostPool.allocate no longer calls allocate_hisparse_host_pools(..., "
                        "use_shared_host_pool=True)")
    base = [n for n in ast.walk(allocate) if isinstance(n, ast.Attribute) and n.attr == "base_tensor"] \
        if allocate else []
    if not base:
        problems.append("HiSparseHostPool.allocate no longer registers the shared region's base_tensor")
    unregister = next((n for n in ast.parse(host_register_src).body
                       if isinstance(n, ast.FunctionDef) and n.name == "host_unregister"), None)
    if unregister is None or _args(unregister) != (["ptr"], []):
        problems.append("host_register.host_unregister(ptr) is gone")
    return problems


@dataclass
class Report:
    vllm_version: str | None = None
    installs: bool = False
    refusal: str | None = None
    lines_: list = field(default_factory=list)
    config: VllmConfig | None = None
    shared: bool = False  # the shared single-node TP pool is kvtier's

    def lines(self) -> list:
        if not self.installs:
            return [f"kvtier: not installed into vLLM ({self.refusal}); vLLM runs unchanged"]
        checked = "" if self.vllm_version in CHECKED_VERSIONS else (
            f"; not one of the versions kvtier is checked against ({', '.join(CHECKED_VERSIONS)}), served because "
            "its source matches")
        return [f"kvtier: installed into vLLM {self.vllm_version}{checked}"] + self.lines_

    def __str__(self) -> str:
        return "\n".join(self.lines())


def report(config=None) -> Report:
    """What :func:`install` does here, from vLLM's source (nothing of vLLM
    imported)."""
    cfg = load_config(config)
    r = Report(config=cfg)
    root = package_root("vllm")
    if root is None:
        r.refusal = "vLLM is not installed in this Python environment"
        return r
    r.vllm_version = package_version(root, "vllm")
    runtime, binding = root / RUNTIME_FILE, root / BINDING_FILE
    if not runtime.exists() or not binding.exists():
        r.refusal = f"vLLM {r.vllm_version} has no HiSparse runtime kvtier knows"
        return r
    runtime_src = runtime.read_text()
    problems = source_problems(runtime_src, binding.read_text())
    if problems:
        r.refusal = f"vLLM {r.vllm_version}'s HiSparse host pool differs from what kvtier knows: " + "; ".join(problems)
        return r
    # here, not at the top: as in VllmConfig.kvtier_config
    from ..sglang._config import is_private
    from ..sglang.capacity import device_problem

    problem = device_problem(cfg.devices)
    if problem:
        r.refusal = problem
        return r
    where = ", ".join(cfg.devices)
    per_rank = (f"a kvtier region interleaved over the nodes of {where} nearest each rank's GPU"
                if cfg.placement == "nearest" else f"a kvtier region on {where}, rank r on device r mod n")
    host_register = root / HOST_REGISTER_FILE
    shared_problems = shared_source_problems(
        runtime_src, host_register.read_text() if host_register.exists() else "")
    shared = "  shared single-node TP pool (/dev/shm)  "
    if any(is_private(d) for d in cfg.devices):
        shared += ("vLLM    its own /dev/shm region: kvtier's devices here are memory of one process (anon, numa:); "
                   "list file: or dax: devices to share one kvtier region")
    elif shared_problems:
        shared += "vLLM    its own: its source differs from what kvtier knows: " + "; ".join(shared_problems)
    else:
        shared += (f"kvtier  one kvtier region on {where} that the TP ranks share (rank 0 allocates, the others "
                   "join), registered in vLLM's chunks")
        r.shared = True
    r.lines_ = [
        f"  HiSparseHostPool.allocate (per rank)   kvtier  {per_rank}; "
        "kvtier's capacity check instead of 95 % of available DRAM",
        shared,
    ]
    r.installs = True
    return r


# ---- installing ---------------------------------------------------------------------------

_lock = threading.Lock()
_installed: Report | None = None


def install(config=None, log=True) -> Report:
    """Checks vLLM's source, then replaces ``HiSparseHostPool.allocate`` in
    vLLM's runtime module (imported here) with kvtier's. Idempotent; another
    config replaces the one installed before. Returns the report, and logs
    it."""
    global _installed
    rep = report(config)
    for line in rep.lines() if log else ():
        (logger.info if rep.installs else logger.warning)("%s", line)
    if not rep.installs:
        return rep
    with _lock:
        runtime = importlib.import_module(RUNTIME)
        from .host_pool import patch, unpatch  # here: host_pool imports this module

        if _installed is not None and (_installed.config, _installed.shared) != (rep.config, rep.shared):
            unpatch(runtime)
        patch(runtime, rep.config, shared=rep.shared)
        _installed = rep
    return rep


def uninstall() -> None:
    global _installed
    runtime = sys.modules.get(RUNTIME)
    if runtime is not None:
        from .host_pool import unpatch  # here: host_pool imports this module

        unpatch(runtime)
    _installed = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs when
    ``KVTIER_VLLM_CONFIG`` is set, does nothing otherwise."""
    if os.environ.get(ENV):
        install()


__all__ = ["CHECKED_VERSIONS", "ENV", "Report", "VllmConfig", "install", "load_config", "register", "report",
           "shared_source_problems", "source_problems", "uninstall"]
