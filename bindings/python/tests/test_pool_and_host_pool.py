"""The pool from Python, and SGLang's host KV pool placed in it."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier import KvtierError, Layout, Pool, device_bytes_for
from kvtier.sglang import KvtierConfig, KvtierHostTensorAllocator


def test_a_pool_a_region_and_its_layer_first_bytes():
    layout = Layout(16, 3, 10)
    with Pool.create(layout, [f"anon:{device_bytes_for(layout, 2)}"]) as pool:
        info = pool.info()
        assert info["layout"] == layout and info["num_regions"] == 2 and info["free_regions"] == 2
        r = pool.alloc_region(request=7)
        assert r.nbytes == layout.region_bytes()
        view = r.numpy(np.uint8, (3, 10, 16))
        view[2, 4] = 99
        flat = r.numpy()
        assert (flat[(2 * 10 + 4) * 16 : (2 * 10 + 5) * 16] == 99).all(), "[layer][token][entry]"
        assert pool.info()["free_regions"] == 1
        r.free()
        assert pool.info()["free_regions"] == 2
        with pytest.raises(KvtierError, match="freed"):
            r.numpy()


def test_pool_errors_carry_the_librarys_message():
    with pytest.raises(KvtierError) as e:
        Pool.create(Layout(16, 1, 1), ["tape:/dev/st0"])
    assert e.value.status == "INVALID_ARGUMENT"
    assert "is not a device kind" in str(e.value)
    with pytest.raises(KvtierError, match="entry_bytes"):
        Pool.create(Layout(12, 1, 1), ["anon:4MiB"])
    with pytest.raises(KvtierError, match="holds no|no such file|No such file|opening"):
        Pool.open(["file:/nonexistent/kvtier-pool"])


def test_ranks_share_a_file_pool_round_robin(tmp_path):
    layout = Layout(64, 2, 16)
    devices = [f"file:{tmp_path / f'dev{i}'}:4MiB" for i in range(2)]
    pools = [Pool.open_or_create(layout, devices, rank=r, ranks=4) for r in range(4)]
    regions = [p.alloc_region(request=r) for r, p in enumerate(pools)]
    assert len({p.info()["uuid"] for p in pools}) == 1, "one pool, created by the first"
    assert [r.device for r in regions] == [0, 1, 0, 1], "rank r on device r mod 2"
    # a smaller layout fits the regions (a pipeline stage with fewer layers); a larger one does not
    assert Pool.open_or_create(Layout(64, 1, 16), devices).layout == Layout(64, 1, 16)
    with pytest.raises(KvtierError, match="regions hold 4096 B .* needs 8192 B"):
        Pool.open_or_create(Layout(64, 8, 16), devices)


def test_the_host_allocator_places_sglangs_buffer_in_a_region():
    alloc = KvtierHostTensorAllocator(KvtierConfig(devices=["anon", "anon"], rank=1, ranks=2))
    dims = (3, 50, 1, 656)  # 3 layers, 50 rows, one 656-byte fp8 DSA entry (uint8) per row
    buf = alloc.allocate(dims, np.uint8, "cpu")
    assert buf.shape == dims and buf.dtype == np.uint8
    region = alloc.regions[0]
    assert alloc.placements == [(1, 2, 1)], "rank 1 of 2 lands on device 1"
    assert buf.ctypes.data == region.host_addr, "the buffer is the region itself"
    buf[2, 17, 0, :] = 5
    flat = region.numpy()
    assert (flat[(2 * 50 + 17) * 656 : (2 * 50 + 18) * 656] == 5).all()
    # a bf16-like dtype: 576 × 2 B = 1152 B entries
    buf16 = alloc.allocate((2, 8, 1, 576), np.float16)
    assert buf16.shape == (2, 8, 1, 576)
    assert alloc.regions[1].nbytes == 2 * 8 * 1152


def test_the_host_allocator_refuses_what_it_cannot_place():
    alloc = KvtierHostTensorAllocator(KvtierConfig())
    with pytest.raises(KvtierError, match="layer-first"):
        alloc.allocate((3, 50, 82), np.uint8)
    with pytest.raises(KvtierError, match="host memory"):
        alloc.allocate((3, 50, 1, 82), np.uint8, "cuda")
    with pytest.raises(KvtierError, match="multiple of 8"):
        alloc.allocate((3, 50, 1, 81), np.uint8)


def test_config_is_checked():
    with pytest.raises(KvtierError, match="unknown keys"):
        kvtier.sglang.load_config({"device": ["anon"]})
    with pytest.raises(KvtierError, match="mixes private"):
        KvtierConfig(devices=["anon", "dax:/dev/dax0.0"])
    with pytest.raises(KvtierError, match="not anon"):
        KvtierConfig(devices=["tape:0"])
    with pytest.raises(KvtierError, match="strategy"):
        KvtierConfig(strategy="fast")
    with pytest.raises(KvtierError, match="rank 2 is not below"):
        KvtierConfig(rank=2, ranks=2)
