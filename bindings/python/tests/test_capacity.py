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
def cxl_file(tmp_path):
    """A pool file standing in for CXL memory: on a filesystem that is not the
    host's DRAM."""
    if kvtier.device_capacity(f"file:{tmp_path}/probe:1MiB").host_dram:
        pytest.skip(f"{tmp_path} is on tmpfs: files there are DRAM")
    return lambda name, size: f"file:{tmp_path}/{name}:{size}"


@pytest.fixture
def small_dram(fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_HOST_DRAM_BYTES", str(1 * MiB))
    return fake_sglang


def test_without_kvtier_sglang_refuses_a_pool_larger_than_dram(small_dram):
    coord = importlib.import_module(COORD)
    with pytest.raises(ValueError, match="Not enough host memory"):
        coord.HiSparseCoordinator("mla", layers=2, rows=2048, dim=1024)


def test_a_pool_beyond_dram_fits_the_kvtier_pool(small_dram, cxl_file, caplog):
    kvtier.sglang.install({"devices": [cxl_file("kv0", "64MiB")], "rank": 0, "ranks": 1})
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
    # the DeepSeek-V4 pool checks through the same budget (its own pool: one
    # process has one HiSparse host pool, and a pool holds one layout)
    kvtier.sglang.uninstall()
    kvtier.sglang.install({"devices": [cxl_file("kv1", "64MiB")], "rank": 0, "ranks": 1})
    dsv4 = coord.HiSparseCoordinator("dsv4", layers=3, rows=32, dim=37440).mem_pool_host
    assert dsv4.allocator.regions[0].nbytes == 3 * 32 * 37440 > 1 * MiB


def test_a_pool_beyond_the_ranks_share_is_refused_with_the_budget(small_dram, cxl_file):
    # 16 ranks share one 64 MiB device: 4 MiB each; the pool wants 8 MiB
    kvtier.sglang.install({"devices": [cxl_file("kv0", "64MiB")], "rank": 3, "ranks": 16})
    coord = importlib.import_module(COORD)
    with pytest.raises(kvtier.KvtierError) as e:
        coord.HiSparseCoordinator("mla", layers=4, rows=2048, dim=1024)
    msg = str(e.value)
    assert "does not fit the kvtier pool" in msg and "Not enough host memory" in msg
    assert "4.0 MiB for rank 3 of 16" in msg and "holds 64.0 MiB shared by 16 ranks" in msg
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


def test_a_non_layer_first_pool_keeps_sglangs_check(small_dram, cxl_file):
    kvtier.sglang.install({"devices": [cxl_file("kv0", "64MiB")], "rank": 0, "ranks": 1})
    coord = importlib.import_module(COORD)
    with pytest.raises(ValueError, match="Not enough host memory"):
        coord.MLATokenToKVPoolHost(2, 2048, 1024, layout="page_first")


def test_each_rank_books_its_share_of_the_device_it_starts_on(cxl_file, tmp_path):
    two = KvtierConfig(devices=[cxl_file("a", "64MiB"), cxl_file("b", "32MiB")])
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
