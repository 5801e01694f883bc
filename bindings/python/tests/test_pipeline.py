"""Pipeline parallelism: stages hold different layer ranges and share one
pool. With region_layers set to the largest stage's layer count, every
stage's regions have that size and each uses its leading layers; without it,
a stage that opens a pool whose regions are too small for it is told what to
set."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

import kvtier
import kvtier.sglang

COORD = "sglang.srt.managers.hisparse_coordinator"


@pytest.fixture
def shared_file(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = f"{base}/kvtier-pp-{os.getpid()}-{tmp_path.name}"
    yield f"file:{path}:16MiB"
    for p in (path, path + "-mha"):
        if os.path.exists(p):
            os.unlink(p)


def stage(rank, layers, config, kind="mla"):
    """Stage `rank`'s host pool of `layers` layers, built as the coordinator builds it."""
    kvtier.sglang.uninstall()
    kvtier.sglang.install(dict(config, rank=rank, ranks=2))
    coord = importlib.import_module(COORD)
    return coord.HiSparseCoordinator(kind, layers=layers, rows=64, dim=64).mem_pool_host


def test_stages_of_a_pipeline_share_one_pool(fake_sglang, shared_file):
    config = {"devices": [shared_file], "region_layers": 3}
    small = stage(1, 2, config)  # the smaller stage starts first
    big = stage(0, 3, config)
    a, b = small.allocator.regions[0], big.allocator.regions[0]
    assert a.pool.info()["uuid"] == b.pool.info()["uuid"] and a.index != b.index
    assert small.kv_buffer.shape == (2, 64, 1, 64) and big.kv_buffer.shape == (3, 64, 1, 64)
    assert a.nbytes == b.nbytes == 3 * 64 * 64, "regions sized for the largest stage"
    small.kv_buffer[:] = 1
    big.kv_buffer[:] = 2
    assert (small.kv_buffer == 1).all() and (big.kv_buffer == 2).all(), "no stage writes into another's"
    # MiniMax-M3's two planes (its own pool): K and V of the stage's layers,
    # the leading 2 x 2 of 2 x 3 layers
    mha = stage(1, 2, dict(config, devices=[shared_file.replace(":16MiB", "-mha:16MiB")]), kind="mha")
    assert mha.kv_buffer.shape == (2, 2, 64, 1, 64)
    assert mha.allocator.regions[0].nbytes == 2 * 3 * 64 * 64


def test_a_stage_too_big_for_the_pool_is_told_to_set_region_layers(fake_sglang, shared_file):
    stage(1, 2, {"devices": [shared_file]})
    with pytest.raises(kvtier.KvtierError) as e:
        stage(0, 3, {"devices": [shared_file]})
    msg = str(e.value)
    assert "regions hold 8 KiB" in msg and "needs 12 KiB" in msg
    assert "set region_layers in the kvtier config to the most layers any stage holds (this stage holds 3)" in msg


def test_without_region_layers_a_smaller_stage_fits_a_larger_ones_pool(fake_sglang, shared_file):
    big = stage(0, 3, {"devices": [shared_file]})
    small = stage(1, 2, {"devices": [shared_file]})
    assert small.kv_buffer.shape == (2, 64, 1, 64) and small.allocator.regions[0].nbytes == 2 * 64 * 64
    assert big.allocator.regions[0].index != small.allocator.regions[0].index


@pytest.mark.parametrize("bad", [0, -1, True, "3"])
def test_region_layers_is_checked(bad):
    with pytest.raises(kvtier.KvtierError, match="region_layers"):
        kvtier.sglang.KvtierConfig(region_layers=bad)


def test_a_view_of_a_regions_leading_bytes():
    from kvtier import Layout, Pool

    pool = Pool.create(Layout(64, 3, 4), ["anon:4MiB"])
    r = pool.alloc_region()
    assert r.numpy(np.int32, (2, 4, 16)).shape == (2, 4, 16)
    with pytest.raises(kvtier.KvtierError, match="needs 1024 B; the region holds 768 B"):
        r.numpy(np.int32, (4, 4, 16))


def test_the_region_layers_slack_counts_against_the_ranks_share(fake_sglang, shared_file, monkeypatch):
    """SGLang books the host pool against the rank's share of the kvtier
    devices for its own layers; the region it gets holds region_layers
    layers. A share that fits the pool but not its region is refused at
    start-up with the slack named, not filled past."""
    from kvtier.sglang import capacity

    def share(bytes_):
        return capacity.RankBudget(bytes_, shared_file, 1 << 30, 1, 1, 2)

    config = {"devices": [shared_file], "region_layers": 4}
    # 2 layers x 64 rows x 64 B = 8 KiB for SGLang; the region holds 4 layers: 16 KiB
    monkeypatch.setattr(capacity, "rank_budget", lambda cfg, rank, ranks: share(12 << 10))
    with pytest.raises(kvtier.KvtierError) as e:
        stage(1, 2, config)
    msg = str(e.value)
    assert "region_layers slack" in msg and "regions of 4 layers for this stage's 2" in msg, msg
    monkeypatch.setattr(capacity, "rank_budget", lambda cfg, rank, ranks: share(16 << 10))
    assert stage(1, 2, config).allocator.regions[0].nbytes == 4 * 64 * 64
