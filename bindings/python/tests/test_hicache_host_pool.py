"""HiCache's host KV pool (its L2) in a kvtier pool, on SGLang's real host
pools (the release under test, built on the CPU from CPU device pools) as
SGLang's assembler builds them once kvtier is installed: in every layout the
release builds on a CPU, MHA and MLA, the pool's buffers are kvtier regions
(their bytes in the pool's file), data written through SGLang's own host-pool
methods reads back and is laid out as in SGLang's own pool, kvtier's HiCache
storage backend round-trips pages through it (zero-copy and flat, and with
an instance whose L2 is SGLang's), TP ranks go round-robin over the devices,
SGLang's host-memory check is booked against the kvtier pool, a pool under a
storage backend with its own allocator stays SGLang's, bad config is refused
by name, and the launcher says what it serves. Skipped where SGLang's modules
do not import."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
import kvtier
import kvtier.sglang
from kvtier.sglang import compat
from kvtier.sglang.host_pool import KvtierHostTensorAllocator
from real_sglang import VERSION, import_quietly, needs_sglang
from test_hicache_sglang import (  # noqa: F401 (sg and hicache are fixtures)
    ALL_POOLS,
    MUST_BUILD,
    POOL_IDS,
    all_pages,
    assert_pages,
    build_host_pool,
    fill,
    hicache,
    indices,
    n_pages,
    page_bytes,
    page_keys,
    sg,
)

pytestmark = needs_sglang

torch = pytest.importorskip("torch")

ASSEMBLER = compat.ASSEMBLER
BUDGET = "sglang.srt.mem_cache.pool_host.base"
MiB = 1 << 20


@pytest.fixture
def shm_files():
    """Paths for pool files in /dev/shm, removed afterwards."""
    made = []

    def path(tag: str) -> str:
        made.append(f"/dev/shm/kvtier-test-l2-{tag}-{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield path
    for p in made:
        if os.path.exists(p):
            os.unlink(p)


@pytest.fixture
def install(sg, monkeypatch):
    """install(config) into the real SGLang; the assembler module, patched."""
    monkeypatch.delenv(kvtier.sglang.ENV, raising=False)

    def do(**config):
        kvtier.sglang.uninstall()
        rep = kvtier.sglang.install({"rank": 0, "ranks": 1, **config}, log=False)
        assert rep.installs, rep.lines()
        return import_quietly(ASSEMBLER)

    yield do
    kvtier.sglang.uninstall()


def chooser(asm, kind):
    """The assembler's way to the host pool class of `kind`."""
    return asm.get_mha_host_pool_cls if kind == "mha" else (lambda first: asm.MLATokenToKVPoolHost)


def l2_pool(sg, asm, kind, layout, **kw):
    """HiCache's host pool as the patched assembler builds it; skipped (with
    SGLang's reason) in a layout this release cannot build on a CPU."""
    try:
        return build_host_pool(sg, kind, layout, choose=chooser(asm, kind), **kw)
    except Exception as e:  # noqa: BLE001 - the reason is reported
        if (kind, layout) in MUST_BUILD:
            raise
        pytest.skip(f"SGLang's {kind} host pool does not build in layout {layout} here: {e!r}")


def buffers(pool):
    return [pool.k_buffer, pool.v_buffer] if pool.layout == "page_first_kv_split" else [pool.kv_buffer]


def assert_in_regions(pool):
    """Every buffer of `pool`, and every page pointer it gives the zero-copy
    path, lies inside a region of its kvtier allocator."""
    alloc = pool.allocator
    assert isinstance(alloc, KvtierHostTensorAllocator), type(alloc)
    spans = [(r.host_addr, r.host_addr + r.nbytes) for r in alloc.regions]
    assert spans

    def inside(addr, size):
        return any(lo <= addr and addr + size <= hi for lo, hi in spans)

    for buf in buffers(pool):
        assert inside(buf.data_ptr(), buf.numel() * buf.element_size()), "a buffer outside the kvtier regions"
    try:
        ptrs, sizes = pool.get_page_buffer_meta(indices(pool, range(n_pages(pool))))
    except NotImplementedError:
        return
    assert ptrs and all(inside(int(p), int(s)) for p, s in zip(ptrs, sizes)), "a page pointer outside the regions"


# -- every layout: where the buffers are, and what SGLang's methods write -------


@pytest.mark.parametrize("kind,layout", ALL_POOLS, ids=POOL_IDS)
def test_the_l2_pool_is_kvtier_memory_and_sglangs_methods_read_back(sg, install, shm_files, kind, layout):
    path = shm_files(f"{kind}-{layout}")
    asm = install(devices=[f"file:{path}:16MiB"])
    pool = l2_pool(sg, asm, kind, layout)
    assert type(pool).__module__ == "kvtier.sglang.host_pool"
    assert_in_regions(pool)
    alloc = pool.allocator
    assert alloc.region_devices == [f"file:{path}:16MiB"] * len(alloc.regions)
    assert sum(b.numel() * b.element_size() for b in buffers(pool)) <= sum(r.nbytes for r in alloc.regions)

    # SGLang's own pool of the same geometry, given the same pages through
    # SGLang's own method, holds the same bytes in the same order
    theirs = build_host_pool(sg, kind, layout)
    assert not isinstance(theirs.allocator, KvtierHostTensorAllocator)
    gen = torch.Generator().manual_seed(5)
    P = pool.page_size
    for p in range(n_pages(pool)):
        flat = pool.get_dummy_flat_data_page()
        flat.view(torch.uint8).copy_(torch.randint(0, 256, flat.view(torch.uint8).shape, dtype=torch.uint8,
                                                   generator=gen))
        pool.set_from_flat_data_page(p * P, flat)
        theirs.set_from_flat_data_page(p * P, flat)
        assert torch.equal(pool.get_data_page(p * P, flat=True).view(torch.uint8), flat.view(torch.uint8))
    for mine, sglangs in zip(buffers(pool), buffers(theirs)):
        raw = mine.reshape(-1).view(torch.uint8)
        assert torch.equal(raw, sglangs.reshape(-1).view(torch.uint8))
        # and those bytes are the pool file's: the region is mapped from it
        with open(path, "rb") as f:
            assert f.read().find(raw.numpy().tobytes()) >= 0, "the buffer's bytes are not in the pool's file"


# -- kvtier's HiCache storage backend on the L2 in kvtier ---------------------------


@pytest.mark.parametrize("v1", [1, 0], ids=["zero-copy", "flat"])
@pytest.mark.parametrize("kind,layout", ALL_POOLS, ids=POOL_IDS)
def test_the_storage_backend_round_trips_pages_through_the_kvtier_l2(sg, install, hicache, kind, layout, v1):
    asm = install(devices=["anon"])
    gen = torch.Generator().manual_seed(21)
    a_pool, b_pool = l2_pool(sg, asm, kind, layout), l2_pool(sg, asm, kind, layout)
    sglangs = build_host_pool(sg, kind, layout)  # an instance whose L2 is SGLang's own
    for p in (a_pool, b_pool, sglangs):
        fill(p, gen)
    assert_in_regions(a_pool)
    mla = kind == "mla"
    a = hicache.open(a_pool, mla=mla, interface_v1=v1)
    b = hicache.open(b_pool, mla=mla, interface_v1=v1)
    c = hicache.open(sglangs, mla=mla, interface_v1=v1)
    assert a.path == b.path == c.path, "the kvtier L2 is another namespace than SGLang's own"
    assert (a._parts > 0) == bool(v1), "zero-copy calls use the pool's page pointers, flat ones its pages"
    keys = page_keys(f"l2-{kind}-{layout}-{v1}", 4)
    src, dst = [3, 9, 1, 14], [20, 5, 11, 30]
    assert a.batch_set_v1(keys, indices(a_pool, src)) == [True] * 4
    for reader, pool, what in ((b, b_pool, "kvtier L2"), (c, sglangs, "SGLang's own L2")):
        before = all_pages(pool)
        assert reader.batch_get_v1(keys, indices(pool, dst)) == [True] * 4, what
        assert_pages(pool, before, dict(zip(dst, src)), a_pool, f"{what} loading pages a kvtier L2 stored")
    # and the other way: SGLang's own L2 stores, the kvtier one loads
    more = page_keys(f"l2-back-{kind}-{layout}-{v1}", 2)
    assert c.batch_set_v1(more, indices(sglangs, [6, 7])) == [True, True]
    before = all_pages(b_pool)
    assert b.batch_get_v1(more, indices(b_pool, [25, 26])) == [True, True]
    assert_pages(b_pool, before, {25: 6, 26: 7}, sglangs, "kvtier L2 loading pages SGLang's own L2 stored")


# -- placement ------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False], ids=["file", "anon"])
def test_tp_ranks_go_round_robin_over_the_devices(sg, install, shm_files, shared):
    devices = [f"file:{shm_files(f'rr{i}')}:8MiB" for i in range(2)] if shared else ["anon", "anon"]
    uuids = set()
    for rank in range(4):
        asm = install(devices=devices, rank=rank, ranks=4)
        pool = l2_pool(sg, asm, "mha", "page_first")
        alloc = pool.allocator
        assert [p[2] for p in alloc.placements] == [rank % 2], f"rank {rank} of 4"
        assert alloc.region_devices == [devices[rank % 2]]
        assert_in_regions(pool)
        uuids.add(alloc.pools[0].info()["uuid"])
    assert len(uuids) == (1 if shared else 4), "the ranks of a shared pool share it; private ones are their own"


# -- capacity -------------------------------------------------------------------------


@pytest.fixture
def small_dram(monkeypatch):
    """SGLang's host-memory check sees 1 MiB of DRAM beyond its reserve."""
    base = import_quietly(BUDGET)
    monkeypatch.setattr(base, "available_host_memory_bytes",
                        lambda *a, **k: base.HICACHE_HOST_MEMORY_RESERVE_BYTES + MiB)
    return base


# 64 device tokens × 1040 (+ a padding page of 4) × 192 B: 12.2 MiB of MHA K and V
BIG = dict(ratio=1040)


def test_sglangs_host_memory_check_is_booked_against_the_kvtier_pool(sg, install, small_dram, caplog):
    with pytest.raises(ValueError, match="Not enough host memory"):
        build_host_pool(sg, "mha", "page_first", **BIG)  # SGLang's own L2, against 1 MiB of DRAM

    asm = install(devices=["numa:0:32MiB"])
    with caplog.at_level(logging.INFO, logger="kvtier"):
        first = l2_pool(sg, asm, "mha", "page_first", **BIG)
    used = first.allocator.regions[0].nbytes
    assert used == first.size * 192 > MiB
    assert_in_regions(first)
    log = caplog.text
    assert "MHATokenToKVPoolHost is checked against the kvtier pool, not DRAM: 32.0 MiB for rank 0 of 1" in log
    # 32 MiB of 192 B tokens, less a padding page of 4, in device pools of 64
    assert "MHATokenToKVPoolHost takes 12.2 MiB of 32.0 MiB" in log and "--hicache-ratio 2730 would fill it" in log

    # a second pool of the rank (a hybrid model builds several) books what is left
    second = l2_pool(sg, asm, "mha", "page_first", **BIG)
    # whole regions: the pool's stride, its alignment included
    stride = first.allocator.regions[0].pool.info()["region_stride"]
    assert second.allocator.budget.held == stride and used <= stride < used + MiB
    with pytest.raises(kvtier.KvtierError) as e:
        l2_pool(sg, asm, "mha", "page_first", **BIG)
    msg = str(e.value)
    assert "does not fit the kvtier pool" in msg and "Not enough host memory" in msg, msg
    assert "24.4 MiB of its share held by this rank's other host pools" in msg and "--hicache-ratio" in msg, msg


def test_dram_devices_keep_sglangs_check(sg, install, small_dram):
    asm = install(devices=["anon"])
    with pytest.raises(ValueError, match="Not enough host memory") as e:
        l2_pool(sg, asm, "mla", "layer_first", **BIG)
    assert not isinstance(e.value, kvtier.KvtierError)


def test_a_pool_left_to_a_storage_backend_keeps_sglangs_dram_check(sg, install, small_dram):
    """Its buffers stay in SGLang's memory (the shm backend's), so the kvtier
    pool's budget must not stand in for DRAM in SGLang's check."""
    asm = install(devices=["numa:0:32MiB"])
    with pytest.raises(ValueError, match="Not enough host memory") as e:
        build_host_pool(sg, "mha", "page_first", choose=chooser(asm, "mha"), allocator_type="shm", **BIG)
    assert not isinstance(e.value, kvtier.KvtierError)


# -- what stays SGLang's, and bad config ----------------------------------------------


def test_a_pool_under_a_storage_backends_own_allocator_stays_sglangs(sg, install, caplog):
    """SGLang's shm allocator (the shm storage backend's: memory it shares by
    fd) keeps the pool; kvtier says so."""
    asm = install(devices=["anon"])
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        pool = l2_pool(sg, asm, "mla", "page_first", allocator_type="shm")
    assert type(pool).__module__ == "kvtier.sglang.host_pool"
    assert type(pool.allocator).__name__ == "ShmHostTensorAllocator" and pool.fd is not None
    assert "SGLang's allocator is its storage backend's ShmHostTensorAllocator" in caplog.text


def test_turned_off_the_assembler_builds_sglangs_own_pools(sg, install):
    asm = install(devices=["anon"], hicache_host_pool=False)
    rep = kvtier.sglang.installed_report()
    assert {r.name: r.served_by for r in rep.routes if r.name in compat.HICACHE_POOLS} == dict.fromkeys(
        compat.HICACHE_POOLS, "SGLang")
    for kind in ("mha", "mla"):
        pool = build_host_pool(sg, kind, "page_first", choose=chooser(asm, kind))
        assert not isinstance(pool.allocator, KvtierHostTensorAllocator)


def test_install_serves_and_uninstall_restores_the_assembler(sg, install):
    asm = install(devices=["anon"])
    rep = kvtier.sglang.installed_report()
    assert all(rep.served(r) for r in compat.HICACHE_POOLS), rep.lines()
    originals = dict(asm._kvtier_originals)
    assert set(originals) == {"MLATokenToKVPoolHost", "get_mha_host_pool_cls"}
    assert asm.MLATokenToKVPoolHost is not sg.MLAHost and issubclass(asm.MLATokenToKVPoolHost, sg.MLAHost)
    kvtier.sglang.uninstall()
    assert asm.MLATokenToKVPoolHost is sg.MLAHost
    assert asm.get_mha_host_pool_cls is originals["get_mha_host_pool_cls"]


def test_bad_config_and_buffers_are_refused_by_name(sg):
    with pytest.raises(kvtier.KvtierError, match="`hicache_host_pool` must be true or false"):
        kvtier.sglang.load_config({"hicache_host_pool": "yes"})
    with pytest.raises(kvtier.KvtierError, match="unknown keys \\['hicache_host_pools'\\]"):
        kvtier.sglang.load_config({"hicache_host_pools": True})
    alloc = KvtierHostTensorAllocator(kvtier.sglang.KvtierConfig(rank=0, ranks=1), layout="page_head")
    with pytest.raises(kvtier.KvtierError, match="places page_head buffers; got dims \\(2, 33, 3, 8\\)"):
        alloc.allocate((2, 33, 3, 8), torch.bfloat16)
    with pytest.raises(kvtier.KvtierError, match="host layout 'page_unified' is not one of"):
        KvtierHostTensorAllocator(layout="page_unified").allocate((4, 8), torch.bfloat16)
    assert not alloc.regions


# -- the launcher -------------------------------------------------------------------


def test_the_launcher_says_it_serves_hicaches_host_pool(tmp_path):
    cfg = tmp_path / "kvtier.json"
    cfg.write_text(json.dumps({"devices": ["anon"]}))
    env = dict(os.environ)
    env.pop(kvtier.sglang.ENV, None)
    run = subprocess.run([sys.executable, "-m", "kvtier.sglang", "--enable-hierarchical-cache", "--kvtier-config",
                          str(cfg), "--help"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"kvtier: installed into SGLang {VERSION}" in run.stderr
    assert "HiCache MHATokenToKVPoolHost           kvtier" in run.stderr, run.stderr[-4000:]
    assert "kvtier serves HiCache's host KV pool (--enable-hierarchical-cache)" in run.stderr
    assert "--enable-hisparse is not among" not in run.stderr
