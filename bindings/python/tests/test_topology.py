"""Placement "nearest": a rank's host pool interleaves the configured NUMA
nodes nearest its GPU. A stand-in sysfs describes a two-socket host: DRAM
nodes 0 and 1, CXL nodes 2 and 3 on socket 0, 4 and 5 on socket 1."""

from __future__ import annotations

import pytest

import kvtier
from kvtier.sglang import KvtierConfig, KvtierHostTensorAllocator, topology

ROWS = {0: "10 21 14 14 24 24", 1: "21 10 24 24 14 14", 2: "14 24 10 26 28 28",
        3: "14 24 26 10 28 28", 4: "24 14 28 28 10 26", 5: "24 14 28 28 26 10"}
CXL = ["numa:2", "numa:3", "numa:4", "numa:5"]


@pytest.fixture
def sysfs(tmp_path):
    for node, row in ROWS.items():
        d = tmp_path / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "distance").write_text(row + "\n")
    return tmp_path


def test_each_socket_gets_its_own_cxl_nodes(sysfs):
    assert topology.distances_from(1, sysfs) == {0: 21, 1: 10, 2: 24, 3: 24, 4: 14, 5: 14}
    near0 = topology.nearest(CXL, 0, sysfs)
    assert (near0.device, near0.nodes, near0.distance) == ("numa:2+3", (2, 3), 14)
    near1 = topology.nearest(CXL, 1, sysfs)
    assert (near1.device, near1.nodes, near1.distance) == ("numa:4+5", (4, 5), 14)
    assert near1.describe() == "GPU on NUMA node 1: numa:4+5 at distance 14"


def test_unknown_topology_uses_every_node(sysfs, tmp_path):
    every = topology.nearest(CXL, None, sysfs)
    assert (every.device, every.distance) == ("numa:2+3+4+5", None)
    assert topology.nearest(CXL, 7, sysfs).nodes == (2, 3, 4, 5), "a node sysfs does not list"
    assert topology.nearest(CXL, 0, tmp_path / "nowhere").nodes == (2, 3, 4, 5)


def test_sizes_add_up_and_other_devices_are_refused(sysfs):
    sized = topology.nearest(["numa:2:64GiB", "numa:3:32GiB", "numa:4:64GiB"], 0, sysfs)
    assert sized.device == f"numa:2+3:{96 << 30}"
    with pytest.raises(kvtier.KvtierError, match="numa: devices only"):
        topology.nearest(["numa:2", "file:/dev/shm/x:1GiB"], 0, sysfs)
    with pytest.raises(kvtier.KvtierError, match="every device must be numa"):
        KvtierConfig(devices=["numa:2", "anon"], placement="nearest")
    with pytest.raises(kvtier.KvtierError, match="placement"):
        KvtierConfig(placement="closest")


def test_the_allocator_places_the_rank_on_its_nearest_nodes(monkeypatch, sysfs):
    monkeypatch.setattr(topology, "SYSFS", sysfs)
    monkeypatch.setattr(topology, "current_gpu", lambda: 5)
    monkeypatch.setattr(topology, "gpu_numa_node", lambda g: 1 if g >= 4 else 0)
    monkeypatch.setattr(topology.nearest, "__defaults__", (sysfs,))
    alloc = KvtierHostTensorAllocator(KvtierConfig(devices=CXL, placement="nearest", rank=5, ranks=8))
    assert alloc.rank_devices() == ["numa:4+5"]
    assert alloc.choice.gpu_node == 1


def test_nearest_on_this_machine_allocates(caplog):
    # node 0 is the only node here; no GPU: every configured node
    import logging

    alloc = KvtierHostTensorAllocator(KvtierConfig(devices=["numa:0"], placement="nearest", rank=0, ranks=1))
    with caplog.at_level(logging.INFO, logger="kvtier"):
        buf = alloc.allocate((2, 8, 1, 64), "uint8")
    assert buf.shape == (2, 8, 1, 64) and alloc.choice.device == "numa:0"
    assert "reads its host KV from the devices nearest its GPU: GPU on an unknown NUMA node: numa:0" in caplog.text
