"""Per-layer swap-in counters from Python: the engine's table (counted by
hand on the worked example), the SGLang shim's layer numbering, and their
Prometheus export, both into a registry and through prometheus_client's
multiprocess files the way SGLang's ``/metrics`` gathers them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from conftest import ITEM, worked_example

import kvtier
from kvtier import KvtierError, SwapInCounters
from kvtier.sglang import counters as shim_counters
from kvtier.sglang import load_cache_to_device_buffer_mla, swap_in_counters


def _swap(c, layer, engine_layers=None):
    k = c.kwargs()
    kvtier.swap_in(
        k["top_k_tokens"], k["device_buffer_tokens"], k["host_cache_locs"], k["device_buffer_locs"],
        k["host_cache"], k["device_buffer"], k["top_k_device_locs"], k["req_pool_indices"], k["seq_lens"],
        k["lru_slots"], kvtier._lib.linear_items(ITEM), k["num_top_k"], k["hot_buffer_size"], layer=layer,
    )


def _cpu_counters():
    got = kvtier.engine_for("cpu").counters()
    return got if got is not None else []


def _delta(after, before, layer):
    a = after[layer]
    b = before[layer] if layer < len(before) else SwapInCounters()
    return SwapInCounters(*(getattr(a, f) - getattr(b, f) for f in shim_counters.FIELDS))


def test_the_worked_example_counts_what_a_hand_count_says():
    engine = kvtier.engine_for("cpu")
    engine.enable_counters(shim_counters.MAX_LAYERS)  # as the shim enables it (kept if it did)
    before = _cpu_counters()
    _swap(worked_example([4, 2, 7]), layer=3)
    mid = _cpu_counters()
    # slots 1 and 2 hit (tokens 4 and 2); the newest token (7) takes no part
    assert _delta(mid, before, 3) == SwapInCounters(calls=1, rows=1, hits=2)
    _swap(worked_example([6, 0]), layer=3)
    after = _cpu_counters()
    # tokens 6 and 0 miss: two rows of ITEM bytes loaded
    assert _delta(after, mid, 3) == SwapInCounters(calls=1, rows=1, misses=2, bytes=2 * ITEM)
    assert all(_delta(after, before, n) == SwapInCounters() for n in range(len(after)) if n != 3)
    assert engine.counters(wait=False) == after, "the CPU executor's snapshot is exact"
    _swap(worked_example([4]), layer=None)
    assert _cpu_counters() == after, "a call naming no layer counts nothing"


def test_bad_indices_and_layers_are_counted_and_checked():
    engine = kvtier.engine_for("cpu")
    engine.enable_counters(shim_counters.MAX_LAYERS)
    before = _cpu_counters()
    with pytest.raises(KvtierError, match="BAD_INDICES|bad ind"):
        _swap(worked_example([4, 99, -5]), layer=5)
    got = _delta(_cpu_counters(), before, 5)
    assert (got.calls, got.rows, got.hits, got.bad_indices) == (1, 1, 1, 2), got
    with pytest.raises(KvtierError, match="layer"):
        _swap(worked_example([4]), layer=shim_counters.MAX_LAYERS)
    with pytest.raises(KvtierError, match="layer"):
        _swap(worked_example([4]), layer=-2)
    with pytest.raises(KvtierError, match="layers"):
        engine.enable_counters(shim_counters.MAX_LAYERS + 1)
    with pytest.raises(KvtierError, match="layers"):
        engine.enable_counters(0)


def test_a_fresh_engine_counts_nothing_until_enabled():
    engine = kvtier.SwapInEngine("cpu")
    assert engine.counters() is None and engine.counters(wait=False) is None
    engine.enable_counters(2)
    assert engine.counters() == [SwapInCounters(), SwapInCounters()]
    assert SwapInCounters(hits=3, misses=1).hit_rate == 0.75
    assert SwapInCounters().hit_rate is None


def test_the_shim_numbers_layers_by_device_buffer():
    a, b = worked_example([4, 2, 7]), worked_example([6])
    la = shim_counters.counted_layer(a.device_buffer)
    lb = shim_counters.counted_layer(b.device_buffer)
    assert la is not None and lb is not None and la != lb
    assert shim_counters.counted_layer(a.device_buffer) == la, "the same buffer is the same layer"
    assert shim_counters.counted_layer(a.device_buffer, enabled=False) is None
    assert shim_counters.counted_layer(object()) is None
    before = swap_in_counters()["cpu"]
    load_cache_to_device_buffer_mla(**a.kwargs())
    load_cache_to_device_buffer_mla(**b.kwargs())
    after = swap_in_counters()["cpu"]
    assert _delta(after, before, la) == SwapInCounters(calls=1, rows=1, hits=2)
    assert _delta(after, before, lb) == SwapInCounters(calls=1, rows=1, misses=1, bytes=ITEM)


def test_the_export_adds_what_the_counters_gained():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    reads = [
        {"cuda:0": [SwapInCounters(calls=1, hits=5, misses=2, bytes=64)]},
        {"cuda:0": [SwapInCounters(calls=3, hits=9, misses=2, bytes=64), SwapInCounters(bad_indices=4)]},
    ]
    clock = [0.0]
    export = shim_counters.Exporter(
        5.0, reader=lambda: reads.pop(0), prometheus=shim_counters.PrometheusExport(registry, rank=3),
        clock=lambda: clock[0],
    )

    def value(field, layer):
        return registry.get_sample_value(f"kvtier_swap_in_{field}_total",
                                         {"rank": "3", "device": "cuda:0", "layer": layer})

    export.maybe_refresh()
    assert (value("calls", "0"), value("hits", "0"), value("bytes", "0")) == (1, 5, 64)
    clock[0] = 4.0
    export.maybe_refresh()  # within the interval: nothing read
    assert len(reads) == 1
    clock[0] = 5.0
    export.maybe_refresh()
    assert (value("calls", "0"), value("hits", "0"), value("misses", "0")) == (3, 9, 2)
    assert value("bad_indices", "1") == 4


def test_the_counters_reach_pool_status(tmp_path, monkeypatch):
    """What the export publishes to a shared pool is what ``kvtier pool
    status --json`` shows with this process's client entry."""
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run").chmod(0o755)  # whatever the umask: a group-writable run dir is refused
    device = f"file:{tmp_path}/pool"
    pool = kvtier.Pool.create(kvtier.Layout(16, 2, 16), [f"{device}:4MiB"])
    read = {"cuda:0": [SwapInCounters(calls=2, hits=7, misses=3, bytes=96), SwapInCounters(calls=2, misses=1)]}
    export = shim_counters.Exporter(0.0, reader=lambda: read)
    export.add_pool(pool)
    export.maybe_refresh()
    out = subprocess.run([sys.executable, "-m", "kvtier", "pool", "status", "--json", "--device", device],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    clients = json.loads(out.stdout)["clients"]
    mine = [c for c in clients if c["pid"] == os.getpid()]
    assert len(mine) == 1 and mine[0]["published"] == shim_counters.stats_of(read), clients
    assert mine[0]["published"]["totals"]["cuda:0"]["misses"] == 4
    with pytest.raises(KvtierError, match="stats"):
        pool.publish_stats({"x": object()})
    with pytest.raises(KvtierError, match="stats"):
        pool.publish_stats({"x": "y" * (1 << 20)})
    with pytest.raises(KvtierError, match="not JSON-serialisable: Out of range float"):
        pool.publish_stats({"x": float("nan")})
    mine_dir = tmp_path / "run" / f"kvtier-{os.geteuid()}"
    assert [p.name for p in (mine_dir / pool.info()["uuid"]).iterdir()] == [f"{mine[0]['client']}-{mine[0]['generation']}.json"]
    pool.close()
    assert not mine_dir.exists(), "a closed client leaves nothing in the run dir"


def test_a_run_dir_that_refuses_stops_the_export_not_the_server(tmp_path, monkeypatch):
    """A run dir kvtier will not write (here: others may rename what is in
    it) costs the counters' publication, with one warning, and nothing else."""
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    monkeypatch.setenv("KVTIER_RUN_DIR", str(run))
    pool = kvtier.Pool.create(kvtier.Layout(16, 2, 16), [f"file:{tmp_path}/pool:4MiB"])
    read = {"cuda:0": [SwapInCounters(calls=1, hits=1)]}
    export = shim_counters.Exporter(0.0, reader=lambda: read)
    export.add_pool(pool)
    with pytest.warns(RuntimeWarning, match="no longer publishing counters.*sticky"):
        export.maybe_refresh()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        export.maybe_refresh()
    assert again == [], "one warning, then no more tries"
    assert list(run.iterdir()) == []
    pool.close()


def test_the_counters_reach_prometheus_multiprocess_files_as_sglang_gathers_them(tmp_path):
    """A process configured as SGLang's scheduler is (``PROMETHEUS_MULTIPROC_DIR``
    set before it starts) swaps in through the installed shim; what its
    export wrote is read back with prometheus_client's MultiProcessCollector,
    the collector SGLang's ``/metrics`` endpoint uses, and equals the
    counters the process read."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client import multiprocess

    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from conftest import worked_example
        from kvtier.sglang import counters, load_cache_to_device_buffer_mla, swap_in_counters
        counters.configure_export(0.0)
        for query in ([4, 2, 7], [6, 0], [4, 99]):
            try:
                load_cache_to_device_buffer_mla(**worked_example(query).kwargs())
            except Exception as e:
                print("refused:", e, file=sys.stderr)
        counters.maybe_export()
        got = swap_in_counters()["cpu"]
        print(json.dumps([c.__dict__ for c in got]))
        """
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    counted = json.loads(out.stdout.splitlines()[-1])
    assert any(c["bad_indices"] for c in counted) and any(c["misses"] for c in counted), counted
    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    for layer, c in enumerate(counted):
        for field in shim_counters.FIELDS:
            got = registry.get_sample_value(f"kvtier_swap_in_{field}_total",
                                            {"rank": "0", "device": "cpu", "layer": str(layer)})
            assert (got or 0) == c[field], (layer, field, got, c)


def test_the_config_checks_its_counter_keys():
    from kvtier.sglang import KvtierConfig

    assert KvtierConfig().counters is True and KvtierConfig().counters_export_s == 5.0
    assert KvtierConfig(counters_export_s=None).counters_export_s is None
    for bad in ({"counters": 1}, {"counters_export_s": -1}, {"counters_export_s": 0.1}, {"counters_export_s": True},
                {"counters_export_s": "5"}):
        with pytest.raises(KvtierError, match="counters"):
            KvtierConfig(**bad)
    assert np.dtype(np.int32).itemsize == 4


def test_the_export_reads_nothing_while_a_cuda_graph_is_captured(monkeypatch):
    reads = []
    export = shim_counters.Exporter(0.0, reader=lambda: reads.append(1) or {})
    monkeypatch.setattr(shim_counters, "_capturing", lambda: True)
    export.maybe_refresh()
    assert reads == [], "a poll inside a capture would start copies and events"
    monkeypatch.setattr(shim_counters, "_capturing", lambda: False)
    export.maybe_refresh()
    assert reads == [1]


def test_counting_refused_once_is_not_retried_every_layer(monkeypatch):
    tried = []

    class Refusing:
        def enable_counters(self, layers):
            tried.append(layers)
            raise KvtierError("no engine here")

    monkeypatch.setattr(shim_counters, "engine_for", lambda executor: Refusing())
    monkeypatch.setattr(shim_counters, "_layers", {})
    monkeypatch.setattr(shim_counters, "_enabled", set())
    monkeypatch.setattr(shim_counters, "_refused", set())
    buffers = [np.zeros(8, dtype=np.uint8) for _ in range(3)]
    assert [shim_counters.counted_layer(b) for b in buffers] == [None, None, None]
    assert len(tried) == 1
