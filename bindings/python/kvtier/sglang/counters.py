"""Per-layer swap-in counters while SGLang serves: what each layer's swap-ins
hit, missed, moved and refused, counted by kvtier's kernels on the GPU (no
host sync) or by its CPU executor, and exported.

SGLang's kernel entry points carry no layer number, so the shim numbers the
layers itself: layer n of an executor is the n-th distinct ``device_buffer``
its swap-ins name (SGLang gives each sparse layer its own device buffer and
calls the layers in order, so this is the order of the model's sparse layers
on that rank). Counting starts at an executor's first swap-in outside a CUDA
graph capture (SGLang's warm-up runs come first; the counter table is
allocated then, and the captured graphs add to it like any other kernel
argument). Until then a capture's calls are not counted; once counting has
started, a layer first seen during a capture is numbered and counted.

:func:`swap_in_counters` reads them. Once per ``counters_export_s`` at most,
from the same per-step points that poll for bad indices, the shim reads them
without waiting for the GPU and exports them:

- to Prometheus, where SGLang serves metrics (``--enable-metrics``: it sets
  ``PROMETHEUS_MULTIPROC_DIR`` before it starts its scheduler processes, and
  its ``/metrics`` endpoint gathers the counters each process writes there),
  as counters ``kvtier_swap_in_{calls,rows,hits,misses,bytes,bad_indices}_total``
  labelled with the process's ``rank`` (torch.distributed's), the ``device``
  (``cuda:N`` or ``cpu``) and the ``layer``;
- to the kvtier pools of its host KV pools, where ``kvtier pool status
  --json`` shows them with the process's client entry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import warnings
import weakref

from .._lib import KvtierError
from .._swap_in import SwapInCounters, engine_for
from . import bad_indices
from ._config import current_config
from ._graphs import capturing as _capturing
from .topology import detect_rank

logger = logging.getLogger("kvtier")

# Layers one executor's table holds (SGLang's sparse models have 43 to 78).
MAX_LAYERS = 512

FIELDS = tuple(f.name for f in dataclasses.fields(SwapInCounters))

_lock = threading.Lock()
# executor -> {device buffer address: layer}
_layers: dict = {}
_enabled: set = set()
_refused: set = set()


def _executor_and_address(device_buffer):
    """("cpu" or a CUDA ordinal, the buffer's address), or None for an
    object that is neither a numpy array nor a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and type(device_buffer) is torch.Tensor:
        # the swap-in's per-call path: an attribute and two method calls
        # (get_device() is a CUDA tensor's ordinal)
        if device_buffer.is_cuda:
            return device_buffer.get_device(), device_buffer.data_ptr()
        return "cpu", device_buffer.data_ptr()
    interface = getattr(device_buffer, "__array_interface__", None)
    if interface is not None and not hasattr(device_buffer, "data_ptr"):
        return "cpu", interface["data"][0]
    device = getattr(device_buffer, "device", None)
    data_ptr = getattr(device_buffer, "data_ptr", None)
    if device is None or data_ptr is None:
        return None
    if getattr(device, "type", None) == "cuda":
        index = device.index
        if index is None:
            index = sys.modules["torch"].cuda.current_device()
        return index, data_ptr()
    return "cpu", data_ptr()


def layer_number(device_buffer):
    """(executor, layer): the layer a swap-in into `device_buffer` is, by the
    order the executor's device buffers were first named in; None for an
    object that is neither a numpy array nor a torch tensor, or past
    MAX_LAYERS layers."""
    found = _executor_and_address(device_buffer)
    if found is None:
        return None
    executor, address = found
    layers = _layers.get(executor)
    if layers is not None:
        layer = layers.get(address)
        if layer is not None:
            return executor, layer
    with _lock:
        layers = _layers.setdefault(executor, {})
        if address not in layers:
            if len(layers) >= MAX_LAYERS:
                return None
            layers[address] = len(layers)
        return executor, layers[address]


def counted_layer(device_buffer, enabled: bool = True):
    """The layer a swap-in into `device_buffer` counts as (None: not
    counted), starting its executor's counters on first use outside a
    capture."""
    if not enabled:
        return None
    found = layer_number(device_buffer)
    if found is None:
        return None
    executor, layer = found
    if executor not in _enabled:
        if executor in _refused or _capturing():
            return None  # counting cannot start inside a capture: it allocates
        with _lock:
            if executor not in _enabled:
                try:
                    engine_for(executor).enable_counters(MAX_LAYERS)
                except KvtierError:
                    # no engine there (no driver, a bad device: the swap-in
                    # itself says why), or counting enabled elsewhere with
                    # fewer layers: not tried again on every layer
                    _refused.add(executor)
                    return None
                _enabled.add(executor)
    return layer


def swap_in_counters(wait: bool = True) -> dict:
    """{device: [SwapInCounters of layer 0, 1, ...]} for every executor this
    process counts, ``device`` being ``"cuda:N"`` or ``"cpu"``. ``wait``:
    once the swap-ins launched before have finished (waits for the GPU; not
    on the serving path); without it never waits (a device whose snapshot is
    still in flight is left out)."""
    out = {}
    with _lock:
        counted = {executor: len(layers) for executor, layers in _layers.items()}
    for executor, n in counted.items():
        if executor not in _enabled:
            continue
        per_layer = engine_for(executor).counters(wait=wait)
        if per_layer is not None:
            out[_device_name(executor)] = per_layer[:n]
    return out


def _device_name(executor) -> str:
    return "cpu" if executor == "cpu" else f"cuda:{executor}"


class PrometheusExport:
    """Adds what the counters gained since the last refresh to Prometheus
    counters (in prometheus_client's multiprocess mode they land where
    SGLang's ``/metrics`` gathers every process's). `registry` is
    prometheus_client's (its default: the one SGLang's own metrics use)."""

    def __init__(self, registry=None, rank: int = 0):
        from prometheus_client import Counter  # ImportError: the caller's to handle

        kwargs = {} if registry is None else {"registry": registry}
        self._metrics = {
            f: Counter(f"kvtier_swap_in_{f}", _HELP[f], ["rank", "device", "layer"], **kwargs) for f in FIELDS
        }
        # the process's rank: processes that each see their GPU as cuda:0
        # (one visible device each) would otherwise be summed together
        self._rank = str(rank)
        self._last: dict = {}

    def refresh(self, read: dict) -> None:
        """`read`: {device: [SwapInCounters per layer]}, as :func:`swap_in_counters` gives."""
        for device, per_layer in read.items():
            for layer, c in enumerate(per_layer):
                before = self._last.get((device, layer), SwapInCounters())
                for f in FIELDS:
                    gained = getattr(c, f) - getattr(before, f)
                    if gained > 0:
                        self._metrics[f].labels(rank=self._rank, device=device, layer=str(layer)).inc(gained)
                self._last[(device, layer)] = c


_HELP = {
    "calls": "kvtier swap-in calls per layer",
    "rows": "batch rows kvtier's swap-ins served (CUDA-graph padding excluded)",
    "hits": "hot-buffer slots kvtier's swap-ins found the selected token in",
    "misses": "selected tokens kvtier's swap-ins loaded from the host pool",
    "bytes": "bytes kvtier's swap-ins moved from the host pool to the GPU",
    "bad_indices": "entries kvtier's swap-ins refused as bad indices",
}


def stats_of(read: dict) -> dict:
    """What a process publishes to its pools (``kvtier pool status --json``
    shows it): {"swap_in": {device: [counters of each layer]}, "totals":
    {device: the layers summed}}."""
    return {
        "swap_in": {d: [dataclasses.asdict(c) for c in per_layer] for d, per_layer in read.items()},
        "totals": {d: {f: sum(getattr(c, f) for c in per_layer) for f in FIELDS} for d, per_layer in read.items()},
    }


class Exporter:
    """The per-step export: at most once per `interval_s`, reads the counters
    without waiting (`reader`), adds their gains to the Prometheus counters
    (`prometheus`, when SGLang serves metrics) and publishes them to the
    pools of the kvtier host pools this process allocated."""

    def __init__(self, interval_s: float, reader=None, prometheus=None, clock=time.monotonic):
        self.interval_s, self._clock, self._next = float(interval_s), clock, 0.0
        self._reader = reader or (lambda: swap_in_counters(wait=False))
        self.prometheus = prometheus
        self._pools: list = []  # weak references

    def add_pool(self, pool) -> None:
        self._pools.append(weakref.ref(pool))

    def maybe_refresh(self) -> None:
        if _capturing():
            return  # a poll starts copies and events: never inside a capture
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        read = self._reader()
        if not read:
            return
        if self.prometheus is not None:
            self.prometheus.refresh(read)
        pools = [p for p in (r() for r in self._pools) if p is not None]
        self._pools = [weakref.ref(p) for p in pools]
        if pools:
            stats = stats_of(read)
            for pool in pools:
                try:
                    pool.publish_stats(stats)
                except KvtierError as e:
                    # the run dir refused (another user's directory in this
                    # user's name, say), or the pool was closed: say so once
                    # and stop publishing to this pool; serving goes on
                    self._pools = [r for r in self._pools if r() is not pool]
                    warnings.warn(f"kvtier: no longer publishing counters to a host pool: {e}", RuntimeWarning,
                                  stacklevel=2)


_exporter: Exporter | None = None
_prometheus: PrometheusExport | None = None  # registered once per process
_prometheus_tried = False


def configure_export(interval_s: float | None) -> None:
    """Sets the export's refresh interval (None: no export)."""
    global _exporter
    if interval_s is None:
        _exporter = None
        return
    if _exporter is None:
        _exporter = Exporter(interval_s)
    _exporter.interval_s = float(interval_s)


def publish_to(pool) -> None:
    """Publishes the counters to `pool` from now on (while it lives)."""
    if _exporter is not None:
        _exporter.add_pool(pool)


def _prometheus_export():
    """The process's Prometheus export, made on first use where SGLang serves
    metrics (``PROMETHEUS_MULTIPROC_DIR`` set) and prometheus_client imports."""
    global _prometheus, _prometheus_tried
    if _prometheus is None and not _prometheus_tried:
        _prometheus_tried = True
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            try:
                cfg = current_config()
                rank = detect_rank(cfg)[0] if cfg is not None else 0
                _prometheus = PrometheusExport(rank=rank)
            except ImportError:
                logger.info("kvtier: prometheus_client is not importable; swap-in counters are not exported")
            except ValueError as e:  # a metric of that name registered by someone else
                logger.warning("kvtier: swap-in counters are not exported to Prometheus: %s", e)
    return _prometheus


def maybe_export() -> None:
    """The per-step hook: refreshes the export when its interval has passed.
    A failure is logged and turns the export off (serving goes on)."""
    global _exporter
    if _exporter is None:
        return
    if _exporter.prometheus is None:
        _exporter.prometheus = _prometheus_export()
    try:
        _exporter.maybe_refresh()
    except KvtierError as e:
        logger.warning("kvtier: exporting the swap-in counters failed; export off: %s", e)
        _exporter = None


def per_step() -> None:
    """What the shim does at each of its per-step points (every entry point,
    and the host pool's per-step backup): the bad-index poll and this
    export, each at most once per its interval."""
    bad_indices.maybe_poll()
    maybe_export()
