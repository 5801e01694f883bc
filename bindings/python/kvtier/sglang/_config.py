"""The shim's configuration (the JSON file given with --kvtier-config)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._lib import KvtierError

# The environment variable that carries the configuration (as JSON) to the
# processes SGLang spawns, where the plugin or the launcher installs it.
ENV = "KVTIER_SGLANG_CONFIG"

STRATEGIES = ("default", "plan_then_copy", "one_block_per_request", "few_miss", "compact", "compact_one_launch", "few_miss_512",
              "few_miss_one_launch", "few_miss_512_one_launch")
BAD_INDICES = ("warn", "raise", "off")
PLACEMENTS = ("round_robin", "nearest")


def is_private(device: str) -> bool:
    """Whether a device is memory of one process (anon, numa) rather than
    shared by the ranks (file, dax)."""
    return device.split(":", 1)[0] in ("anon", "numa")


@dataclass
class KvtierConfig:
    """What :func:`kvtier.sglang.install` replaces and where the host pool goes.

    - ``devices``: the kvtier pool's devices in the CLI's syntax. ``anon`` and
      ``numa:NODE`` may leave the size out (each is then sized for the host
      pool of one rank); ``file:PATH:SIZE`` and ``dax:PATH`` are shared by the
      ranks of the server (the first rank creates the pool).
    - ``rank`` / ``ranks``: this process's place for the per-rank round-robin
      (rank r on device r mod n); default: torch.distributed's rank and world
      size, else the current CUDA device, else 0 of 1.
    - ``placement``: ``round_robin`` (each rank's host pool on one device,
      rank r on device r mod n) or ``nearest`` (``numa:`` devices only: each
      rank's host pool interleaved over the configured nodes nearest its
      GPU, :mod:`kvtier.sglang.topology`).
    - ``swap_in``: replace the HiSparse coordinator's
      ``load_cache_to_device_buffer_mla`` with kvtier's.
    - ``host_pool``: place the coordinator's host KV pool (layer-first) in the
      kvtier pool.
    - ``hicache_host_pool``: place HiCache's host KV pool (its L2, under
      ``--enable-hierarchical-cache``; every ``--hicache-mem-layout``) in the
      kvtier pool.
    - ``strategy``: ``default`` (kvtier's choice for the call's batch and
      the GPU: on sm_90 the split planner up to batch 10 and
      ``few_miss_one_launch`` with line-aligned copies above, ``few_miss``
      elsewhere; what an H200 measured fastest), ``few_miss`` (the
      warp-vote planner that copies a request's few misses itself),
      ``plan_then_copy`` (the block-scan planner and a wide copy),
      ``one_block_per_request`` (SGLang's design, for comparison) or another
      of ``STRATEGIES``. Same results; they differ in speed only.
    - ``clients``: client slots of a shared pool kvtier creates (0: default).
    - ``region_layers``: under pipeline parallelism, the most model layers
      any stage holds: the stages share one pool whose regions are sized for
      that many layers, each stage using the layers it has (null: this
      process's own count, which is enough without pipeline parallelism).
    - ``bad_indices``: what a bad index recorded by the GPU kernels does once
      kvtier's per-step poll finds it (:mod:`kvtier.sglang.bad_indices`):
      ``warn`` (log it), ``raise`` (raise it at the next kvtier call on the
      scheduler's thread) or ``off``.
    - ``bad_index_poll_s``: the least time between two polls.
    - ``counters``: count each layer's swap-ins on the GPU
      (:mod:`kvtier.sglang.counters`: hits, misses, bytes, bad indices).
    - ``counters_export_s``: the least time between two refreshes of their
      Prometheus export and the pool (0.5 to 3600; null: no export).
    - ``engram_tables``: DeepSeek-V4.1's Engram tables in kvtier's table
      store (:mod:`kvtier.sglang.engram`), where SGLang keeps them in host
      memory (``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE``): null (off: SGLang's
      own host table), or ``{"store": DIR, "fingerprint": null, "wait_s":
      3600, "gather": false}``: the table directory (on hugetlbfs, tmpfs or
      a devdax device's mount), the checkpoint's fingerprint (null: computed
      from its files), how long a start waits for another instance loading
      the same table, and whether kvtier's gather replaces SGLang's.
    - ``trace``: record the indexer's selections for ``kvtier plan --trace``
      (:mod:`kvtier.sglang.trace`): null (off), or ``{"path": FILE,
      "layers": [..] or null, "rows_every": 1, "max_mb": 256}``.
    """

    devices: list = field(default_factory=lambda: ["anon"])
    rank: int | None = None
    ranks: int | None = None
    swap_in: bool = True
    host_pool: bool = True
    hicache_host_pool: bool = True
    strategy: str = "default"
    placement: str = "round_robin"
    clients: int = 0
    region_layers: int | None = None
    bad_indices: str = "warn"
    bad_index_poll_s: float = 1.0
    counters: bool = True
    counters_export_s: float | None = 5.0
    trace: dict | None = None
    engram_tables: dict | None = None

    def __post_init__(self):
        if isinstance(self.devices, str):
            self.devices = [self.devices]
        if not isinstance(self.devices, list) or not self.devices or not all(
            isinstance(d, str) and d for d in self.devices
        ):
            raise KvtierError("kvtier config: `devices` must be a non-empty list of device strings")
        for d in self.devices:
            kind = d.split(":", 1)[0]
            if kind not in ("anon", "numa", "file", "dax"):
                raise KvtierError(
                    f"kvtier config: device {d!r} is not anon[:SIZE], numa:NODE[:SIZE], file:PATH:SIZE or dax:PATH"
                )
        private = [is_private(d) for d in self.devices]
        if any(private) and not all(private):
            raise KvtierError(
                "kvtier config: `devices` mixes private (anon, numa) and shared (file, dax) devices; a pool is "
                "either private to each rank or shared by all"
            )
        for name in ("rank", "ranks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise KvtierError(f"kvtier config: `{name}` must be a non-negative int or null, not {v!r}")
        if self.ranks is not None and self.ranks == 0:
            raise KvtierError("kvtier config: `ranks` must be at least 1")
        if self.rank is not None and self.ranks is not None and self.rank >= self.ranks:
            raise KvtierError(f"kvtier config: rank {self.rank} is not below ranks {self.ranks}")
        for name in ("swap_in", "host_pool", "hicache_host_pool", "counters"):
            if not isinstance(getattr(self, name), bool):
                raise KvtierError(f"kvtier config: `{name}` must be true or false")
        if self.strategy not in STRATEGIES:
            raise KvtierError(f"kvtier config: `strategy` must be one of {', '.join(STRATEGIES)}")
        if not isinstance(self.clients, int) or self.clients < 0:
            raise KvtierError("kvtier config: `clients` must be a non-negative int")
        if self.placement not in PLACEMENTS:
            raise KvtierError(f"kvtier config: `placement` must be one of {', '.join(PLACEMENTS)}")
        if self.placement == "nearest" and not all(d.startswith("numa:") for d in self.devices):
            raise KvtierError(
                "kvtier config: placement \"nearest\" interleaves a rank's host pool over NUMA nodes, so every "
                "device must be numa:NODE[:SIZE]"
            )
        rl = self.region_layers
        if rl is not None and (isinstance(rl, bool) or not isinstance(rl, int) or rl < 1):
            raise KvtierError("kvtier config: `region_layers` must be a positive int or null")
        if self.bad_indices not in BAD_INDICES:
            raise KvtierError(f"kvtier config: `bad_indices` must be one of {', '.join(BAD_INDICES)}")
        poll = self.bad_index_poll_s
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 <= poll <= 3600:
            raise KvtierError("kvtier config: `bad_index_poll_s` must be a number of seconds in 0..3600")
        export = self.counters_export_s
        if export is not None and (
            isinstance(export, bool) or not isinstance(export, (int, float)) or not 0.5 <= export <= 3600
        ):
            raise KvtierError(
                "kvtier config: `counters_export_s` must be a number of seconds in 0.5..3600 (each export reads "
                "the counters and writes a file), or null"
            )
        # imported here: trace needs numpy, which loading a config does not
        from .trace import check_config

        check_config(self.trace)
        _check_engram_tables(self.engram_tables)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


ENGRAM_KEYS = {"store", "fingerprint", "wait_s", "gather"}


def _check_engram_tables(t) -> None:
    if t is None:
        return
    if not isinstance(t, dict):
        raise KvtierError("kvtier config: `engram_tables` must be null or an object")
    unknown = sorted(set(t) - ENGRAM_KEYS)
    if unknown:
        raise KvtierError(f"kvtier config: engram_tables has unknown keys {unknown}; known: {sorted(ENGRAM_KEYS)}")
    if not isinstance(t.get("store"), str) or not t["store"]:
        raise KvtierError("kvtier config: engram_tables.store must be the table directory (a path)")
    fp = t.get("fingerprint")
    if fp is not None and (not isinstance(fp, str) or not fp or "/" in fp):
        raise KvtierError("kvtier config: engram_tables.fingerprint must be null or a non-empty string without '/'")
    wait = t.get("wait_s", 3600)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 86400:
        raise KvtierError("kvtier config: engram_tables.wait_s must be a number of seconds in 0..86400")
    if not isinstance(t.get("gather", False), bool):
        raise KvtierError("kvtier config: engram_tables.gather must be true or false")


def load_config(config=None) -> KvtierConfig:
    """A KvtierConfig from a KvtierConfig, a dict, a JSON file path, or (None)
    the ``KVTIER_SGLANG_CONFIG`` environment variable (JSON text or a path),
    else the defaults."""
    if isinstance(config, KvtierConfig):
        return config
    if config is None:
        env = os.environ.get(ENV)
        if not env:
            return KvtierConfig()
        config = json.loads(env) if env.lstrip().startswith("{") else env
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except OSError as e:
            raise KvtierError(f"kvtier config: cannot read {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise KvtierError(f"kvtier config: {path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise KvtierError(f"kvtier config: expected a JSON object, got {type(config).__name__}")
    known = set(KvtierConfig.__dataclass_fields__)
    unknown = sorted(set(config) - known)
    if unknown:
        raise KvtierError(f"kvtier config: unknown keys {unknown}; known: {sorted(known)}")
    return KvtierConfig(**config)


# The configuration install() put in place in this process (None before it,
# and after uninstall()). Here, not in _patch, so that the modules the shim
# installs read it without importing the module that installs them.
_installed: KvtierConfig | None = None


def current_config() -> KvtierConfig | None:
    """The installed configuration (None before :func:`kvtier.sglang.install`)."""
    return _installed


def set_current_config(config: KvtierConfig | None) -> None:
    """What :func:`kvtier.sglang.install` and ``uninstall`` record."""
    global _installed
    _installed = config
