"""The pool from Python, and SGLang's host KV pool placed in it."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier import KvtierError, Layout, Pool, device_bytes_for
from kvtier.sglang import KvtierConfig, KvtierHostTensorAllocator
from kvtier.sglang.host_pool import held_bytes


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
    with pytest.raises(KvtierError, match="regions hold 4 KiB .* needs 8 KiB"):
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


# SGLang's HiCache host buffers per layout (pool_host/mha.py and mla.py,
# 0.5.21-0.5.23): 3 layers, 40 tokens in 10 pages of 4, 2 heads of 8, an MLA
# row of 24 (float16); the region's layers (K and V planes × layers) and rows.
HICACHE_BUFFERS = [
    ("layer_first", (2, 3, 40, 2, 8), np.float16, (6, 40)),
    ("layer_first", (3, 40, 1, 24), np.float16, (3, 40)),
    ("page_first", (2, 40, 3, 2, 8), np.float16, (6, 40)),
    ("page_first", (40, 3, 1, 24), np.float16, (3, 40)),
    ("page_first_direct", (2, 10, 3, 4, 2, 8), np.float16, (6, 10)),
    ("page_first_direct", (10, 3, 4, 1, 24), np.float16, (3, 10)),
    ("page_head", (2, 10, 2, 4, 3, 8), np.float16, (6, 10)),
    # Ascend's MLA split, one buffer per part: K, the rope part, an
    # indexer's float32 scales on 2 of the layers
    ("page_first_kv_split", (10, 3, 4, 1, 16), np.float16, (3, 10)),
    ("page_first_kv_split", (10, 3, 4, 1, 8), np.float16, (3, 10)),
    ("page_first_kv_split", (10, 2, 4, 1, 1), np.float32, (2, 10)),
    # a 12 B unit of a non-layer-first buffer takes 16 B of the region
    ("page_first", (40, 3, 1, 6), np.float16, (3, 40)),
]


@pytest.mark.parametrize("layout,dims,dtype,region", HICACHE_BUFFERS,
                         ids=[f"{b[0]}-{'x'.join(map(str, b[1]))}" for b in HICACHE_BUFFERS])
def test_the_host_allocator_places_each_hicache_layouts_bytes_in_a_region(layout, dims, dtype, region):
    alloc = KvtierHostTensorAllocator(KvtierConfig(rank=0, ranks=1), layout=layout)
    buf = alloc.allocate(dims, dtype)
    r = alloc.regions[0]
    assert buf.shape == dims and buf.ctypes.data == r.host_addr
    assert (r.layout.layers, r.layout.tokens_per_region) == region
    unit = buf.nbytes // (region[0] * region[1])
    assert r.layout.entry_bytes == -(-unit // 8) * 8 and r.nbytes == r.layout.region_bytes()
    buf[...] = np.arange(buf.size).reshape(dims)
    assert (r.numpy(dtype, dims) == buf).all(), "the buffer is the region's leading bytes, in SGLang's order"


def test_host_pools_of_one_rank_on_a_shared_device_hold_whole_regions(tmp_path):
    """A rank's host pools on a shared (file:) device share one kvtier pool,
    whose regions the first buffer sized: a smaller buffer takes a whole
    region, and counts so; a larger one is refused saying why."""
    device = f"file:{tmp_path / 'dev0'}:16MiB"
    cfg = KvtierConfig(devices=[device], rank=0, ranks=1)
    first = KvtierHostTensorAllocator(cfg, layout="page_first")
    first.allocate((2, 400, 3, 2, 8), np.float16)
    stride = first.pools[0].info()["region_stride"]
    smaller = KvtierHostTensorAllocator(cfg, layout="page_first")
    smaller.allocate((2, 400, 1, 2, 8), np.float16)
    assert smaller.regions[0].nbytes < stride
    assert held_bytes(device) == 2 * stride
    larger = KvtierHostTensorAllocator(cfg, layout="page_first")
    with pytest.raises(KvtierError, match="sized by the first host buffer placed in it.*private devices"):
        larger.allocate((2, 400, 6, 2, 8), np.float16)


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


FORK_SCRIPT = '''
import os, sys
import numpy as np
from kvtier import Layout, Pool, device_bytes_for

layout = Layout(16, 2, 8)
path = sys.argv[1]
pool = Pool.create(layout, [f"file:{path}:{device_bytes_for(layout, 4)}"])
regions = [pool.alloc_region(request=i) for i in range(2)]
for i, r in enumerate(regions):
    r.numpy()[:] = 10 + i
    r.publish()
pid = os.fork()
if pid == 0:
    # the child: allocating through the parent's pool is refused, then it
    # exits normally, so interpreter shutdown finalizes the inherited objects
    try:
        pool.alloc_region()
        print("child allocated through the parent's handle", flush=True)
    except Exception as e:
        print("child refused:", e, flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
free = pool.info()["free_regions"]
other = Pool.open([f"file:{path}"])
taken = [other.alloc_region() for _ in range(other.info()["free_regions"])]
intact = all((r.numpy() == 10 + i).all() for i, r in enumerate(regions))
clash = {t.index for t in taken} & {r.index for r in regions}
print(f"parent free={free} intact={intact} clash={sorted(clash)}", flush=True)
'''


def test_a_forked_child_leaves_its_parents_pool_alone(tmp_path):
    """A child forked after the pool is open (as SGLang and torch start
    workers) and exiting normally finalizes the Pool and Region objects it
    inherited: that frees none of the parent's regions, and the child cannot
    allocate through the parent's handle."""
    import os
    import subprocess
    import sys

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"kvtier-fork-{os.getpid()}")
    try:
        run = subprocess.run([sys.executable, "-c", FORK_SCRIPT, path], capture_output=True, text=True, timeout=60)
    finally:
        if os.path.exists(path):
            os.remove(path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "child refused:" in run.stdout and "must open the pool itself" in run.stdout, run.stdout
    assert "parent free=2 intact=True clash=[]" in run.stdout, run.stdout
