"""Capacity beyond DRAM: a host pool in kvtier is checked against the kvtier
pool's capacity, not the host's DRAM, through SGLang's own budget scope (the
stand-in SGLang of conftest.py checks as 0.5.21-0.5.23 do, with
FAKE_HOST_DRAM_BYTES of DRAM). Pools whose memory is DRAM keep SGLang's
check."""

from __future__ import annotations

import importlib
import logging

import pytest

import kvtier
import kvtier.sglang
from kvtier.sglang import KvtierConfig
from kvtier.sglang.capacity import rank_budget

COORD = "sglang.srt.managers.hisparse_coordinator"
MiB = 1 << 20


@pytest.fixture
def cxl():
    """A device standing in for CXL memory: a NUMA node's memory, which is
    not in SGLang's DRAM budget but in kvtier's (a sized numa device is each
    rank's own)."""
    return lambda size: f"numa:0:{size}"


@pytest.fixture
def small_dram(fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_HOST_DRAM_BYTES", str(1 * MiB))
    return fake_sglang


def test_without_kvtier_sglang_refuses_a_pool_larger_than_dram(small_dram):
    coord = importlib.import_module(COORD)
    with pytest.raises(ValueError, match="Not enough host memory"):
        coord.HiSparseCoordinator("mla", layers=2, rows=2048, dim=1024)


def test_a_pool_beyond_dram_fits_the_kvtier_pool(small_dram, cxl, caplog):
    kvtier.sglang.install({"devices": [cxl("64MiB")], "rank": 0, "ranks": 1})
    coord = importlib.import_module(COORD)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        pool = coord.HiSparseCoordinator("mla", layers=2, rows=2048, dim=1024).mem_pool_host
    region = pool.allocator.regions[0]
    assert region.nbytes == 4 * MiB and pool.kv_buffer.ctypes.data == region.host_addr
    log = caplog.text
    assert "MLATokenToKVPoolHost is checked against the kvtier pool, not DRAM: 64.0 MiB for rank 0 of 1" in log
    assert "MLATokenToKVPoolHost takes 4.0 MiB of 64.0 MiB" in log and "(6%)" in log
    # 2048 rows of 2 x 1024 B against 64 MiB: 32768 rows, one a padding page;
    # the pool's ratio 2 (1024 device tokens) could be 31
    assert "host_to_device_ratio 31 in --hisparse-config would fill it" in log
    # the DeepSeek-V4 pool checks through the same budget
    dsv4 = coord.HiSparseCoordinator("dsv4", layers=3, rows=32, dim=37440).mem_pool_host
    assert dsv4.allocator.regions[0].nbytes == 3 * 32 * 37440 > 1 * MiB


def test_a_pool_beyond_the_ranks_share_is_refused_with_the_budget(small_dram):
    # numa:0 without a size: the node's free memory, shared by the 16 ranks;
    # the pool asks for twice rank 3's share (the node's free memory moves
    # between this reading and the pool's own), so nothing is allocated
    config = {"devices": ["numa:0"], "rank": 3, "ranks": 16}
    share = rank_budget(KvtierConfig(**config), 3, 16)
    kvtier.sglang.install(config)
    coord = importlib.import_module(COORD)
    with pytest.raises(kvtier.KvtierError) as e:
        coord.HiSparseCoordinator("mla", layers=4, rows=2 * (share.bytes // 4096) + 1, dim=1024)
    msg = str(e.value)
    assert "does not fit the kvtier pool" in msg and "Not enough host memory" in msg
    assert "for rank 3 of 16: numa:0 holds" in msg and "shared by 16 ranks" in msg
    assert "host_to_device_ratio" in msg


def test_dram_devices_keep_sglangs_check(small_dram, tmp_path):
    kvtier.sglang.install({"devices": ["anon"], "rank": 0, "ranks": 1})
    coord = importlib.import_module(COORD)
    with pytest.raises(ValueError, match="Not enough host memory") as e:
        coord.HiSparseCoordinator("mla", layers=2, rows=2048, dim=1024)
    assert not isinstance(e.value, kvtier.KvtierError)
    if kvtier.device_capacity("file:/dev/shm/kvtier-probe:1MiB").host_dram:
        kvtier.sglang.uninstall()
        kvtier.sglang.install({"devices": [f"file:/dev/shm/kvtier-test-{tmp_path.name}:64MiB"]})
        with pytest.raises(ValueError, match="Not enough host memory"):
            coord.HiSparseCoordinator("mla", layers=2, rows=2048, dim=1024)


def test_a_non_layer_first_pool_keeps_sglangs_check(small_dram, cxl):
    kvtier.sglang.install({"devices": [cxl("64MiB")], "rank": 0, "ranks": 1})
    coord = importlib.import_module(COORD)
    with pytest.raises(ValueError, match="Not enough host memory"):
        coord.MLATokenToKVPoolHost(2, 2048, 1024, layout="page_first")


def test_each_rank_books_its_share_of_the_device_it_starts_on(tmp_path):
    two = KvtierConfig(devices=[f"file:{tmp_path}/a:64MiB", f"file:{tmp_path}/b:32MiB"])
    # ranks 0 and 2 start on a, 1 and 3 on b
    assert [(b.device.rsplit("/", 1)[1], b.bytes, b.sharing_ranks) for b in
            (rank_budget(two, r, 4) for r in range(4))] == [
        ("a:64MiB", 32 * MiB, 2), ("b:32MiB", 16 * MiB, 2), ("a:64MiB", 32 * MiB, 2), ("b:32MiB", 16 * MiB, 2)]
    assert rank_budget(two, 1, 3).bytes == 32 * MiB, "rank 1 of 3 alone on b"
    assert rank_budget(KvtierConfig(devices=["anon"]), 0, 1) is None
    assert rank_budget(KvtierConfig(devices=["anon:1GiB"]), 0, 1) is None
    # a sized NUMA device is each rank's own
    own = rank_budget(KvtierConfig(devices=["numa:0:1GiB"]), 3, 8)
    assert (own.bytes, own.sharing_ranks) == (1 << 30, 1)
    # numa:NODE without a size: the node's free memory, shared by the ranks on it
    node = rank_budget(KvtierConfig(devices=["numa:0"]), 0, 2)
    assert node.sharing_ranks == 2 and node.bytes == node.device_bytes // 2 > 0
    with pytest.raises(kvtier.KvtierError, match="does not exist"):
        rank_budget(KvtierConfig(devices=["numa:4095"]), 0, 1)


def test_files_whose_pages_cannot_be_pinned_keep_the_host_pool_in_sglang(fake_sglang, tmp_path):
    device = f"file:{tmp_path}/kv0:64MiB"
    if kvtier.device_capacity(device).pinnable:
        pytest.skip(f"{tmp_path} is on a filesystem whose pages can be pinned")
    rep = kvtier.sglang.install({"devices": [device]})
    routes = {r.name: r for r in rep.routes}
    for pool in ("MLATokenToKVPoolHost", "DeepSeekV4PagedHostPool", "HiSparseMHATokenToKVPoolHost"):
        assert routes[pool].served_by == "SGLang" and "cannot be pinned" in routes[pool].why, routes[pool]
    assert routes["load_cache_to_device_buffer_mla"].served_by == "kvtier"
    coord = importlib.import_module(COORD)
    assert not isinstance(coord.HiSparseCoordinator().mem_pool_host.allocator,
                          kvtier.sglang.KvtierHostTensorAllocator)


def test_a_missing_device_keeps_the_host_pool_in_sglang_and_says_why(fake_sglang, tmp_path):
    rep = kvtier.sglang.report(KvtierConfig(devices=["dax:/dev/dax97.3"]))
    route = {r.name: r for r in rep.routes}["MLATokenToKVPoolHost"]
    assert route.served_by == "SGLang" and route.why.startswith("dax:/dev/dax97.3: ") and "dax97.3" in route.why[17:]
    # typos surface at install, not minutes later when SGLang makes the pool
    for typo, says in [("anon:12QB", "12QB"), ("numa:99:1GiB", "NUMA node 99 does not exist"),
                       (f"file:{tmp_path}/no/such/dir/kv:1GiB", "no/such/dir")]:
        rep = kvtier.sglang.report(KvtierConfig(devices=[typo]))
        route = {r.name: r for r in rep.routes}["MLATokenToKVPoolHost"]
        assert route.served_by == "SGLang" and says in route.why, (typo, route.why)
