"""kvtier's HiCache storage backend (kvtier.sglang.hicache) on SGLang's real
host pools (the release under test, built on the CPU from CPU device pools),
created through SGLang's own dynamic backend factory as a server creates it:
pages one instance stores through the zero-copy interface another instance
on another host pool finds (the longest prefix) and loads bit for bit, in
every layout the release builds on a CPU; the flat-page interface (a launch
without interface_v1) round-trips too, in a store of its own; MHA tensor-parallel ranks keep their own pages and MLA ranks share
theirs; under SGLang's failure injector nothing wrong is ever reported;
another layout, geometry, dtype or model is another store; hostile keys are
stored and found; a store smaller than what is set evicts, and never serves
a wrong page; SGLang's controller code backs a prefix up and another
instance's finds and prefetches it; a process finds another process's pages
while it runs and after it is gone (a restart). Skipped where SGLang's
modules do not import."""

from __future__ import annotations

import hashlib
import inspect
import os
import random
import shutil
import sys
import tempfile
import types

import pytest
import kvtier
from real_sglang import forget, import_quietly, needs_sglang

pytestmark = needs_sglang

torch = pytest.importorskip("torch")

BACKEND_MODULE = "kvtier.sglang.hicache"
FAILURE_ENV = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"
DELAY_ENV = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"

# Small pools: 64 device tokens, twice that on the host (33 pages of 4).
PAGE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
KV_LORA_RANK = 16
ROPE_DIM = 8
DEVICE_TOKENS = 64

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")
# These must build on a CPU in every supported release; the others may skip.
MUST_BUILD = {("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"), ("mla", "page_first")}
ALL_POOLS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
POOL_IDS = [f"{kind}-{layout}" for kind, layout in ALL_POOLS]


def sglang_classes():
    """SGLang's classes this file uses, and the backend class (imported after
    them, so that it subclasses the HiCacheStorage the factory knows)."""
    memory_pool = import_quietly("sglang.srt.mem_cache.memory_pool")
    storage = import_quietly("sglang.srt.mem_cache.hicache_storage")
    return types.SimpleNamespace(
        MHADevice=memory_pool.MHATokenToKVPool,
        MLADevice=memory_pool.MLATokenToKVPool,
        MHAHost=import_quietly("sglang.srt.mem_cache.pool_host.mha").MHATokenToKVPoolHost,
        MLAHost=import_quietly("sglang.srt.mem_cache.pool_host.mla").MLATokenToKVPoolHost,
        Config=storage.HiCacheStorageConfig,
        Injector=getattr(storage, "HiCacheStorageFailureInjector", None),
        Factory=import_quietly("sglang.srt.mem_cache.storage.backend_factory").StorageBackendFactory,
        Backend=import_quietly(BACKEND_MODULE).KvtierHiCacheStorage,
    )


@pytest.fixture(scope="module")
def sg():
    """SGLang's classes, imported fresh, and the backend module bound to them
    (a backend module imported against an earlier import of SGLang would
    subclass a HiCacheStorage the factory no longer knows)."""
    forget()
    sys.modules.pop(BACKEND_MODULE, None)
    yield sglang_classes()
    sys.modules.pop(BACKEND_MODULE, None)
    forget()


def build_host_pool(sg, kind, layout, *, page=PAGE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM,
                    dtype=torch.bfloat16, host_cls=None, choose=None, ratio=2.0, allocator_type="default"):
    """SGLang's host pool over a CPU device pool, built as the release's
    assembler builds it: 0.5.23 takes the device pool's buffer info and its
    capacity and layer range; 0.5.21 and 0.5.22 take the device pool.
    `choose` (instead of `host_cls`): a function of that first argument
    giving the class, as the assembler's get_mha_host_pool_cls is; `ratio`
    the host pool's size in device pools; `allocator_type` SGLang's (a
    storage backend's allocator)."""
    if kind == "mha":
        device = sg.MHADevice(DEVICE_TOKENS, page, dtype, heads, head_dim, layers, "cpu", False)
        host_cls = host_cls or sg.MHAHost
    else:
        device = sg.MLADevice(DEVICE_TOKENS, page, dtype, KV_LORA_RANK, ROPE_DIM, layers, "cpu", False)
        host_cls = host_cls or sg.MLAHost
    params = inspect.signature(host_cls.__init__).parameters
    kwargs = {}
    if "buffer_info" in params:
        first = device.get_device_pool_infos()[0].buffer_info
        kwargs.update(device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer)
        if "target_layer_num" in params:
            kwargs["target_layer_num"] = device.layer_num
        if kind == "mla" and "override_kv_cache_dim" in params:
            kwargs["override_kv_cache_dim"] = device.kv_cache_dim
    else:
        first = device
    if choose is not None:
        host_cls = choose(first)
    return host_cls(first, ratio, 0, page, layout, pin_memory=False, device="cpu", allocator_type=allocator_type,
                    **kwargs)


def host_pool(sg, kind, layout, **kw):
    """build_host_pool, skipping (with SGLang's reason) a layout this release
    cannot build on a CPU, unless it is one that must build."""
    try:
        return build_host_pool(sg, kind, layout, **kw)
    except Exception as e:  # noqa: BLE001 - the reason is reported
        if (kind, layout) in MUST_BUILD:
            raise
        why = " (Ascend's layout for DSA pools with an indexer)" if layout == "page_first_kv_split" else ""
        pytest.skip(f"SGLang's {kind} host pool does not build in layout {layout}{why} here: {e!r}")


def n_pages(pool) -> int:
    return pool.size // pool.page_size


def fill(pool, gen) -> None:
    """Random bytes over the whole host pool."""
    buf = pool.kv_buffer
    assert buf.is_contiguous()
    raw = buf.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))


def page_bytes(pool, page: int):
    """Host page `page`'s token data, as the pool itself reads it out."""
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).clone()


def all_pages(pool) -> list:
    return [page_bytes(pool, p) for p in range(n_pages(pool))]


def indices(pool, pages):
    """The host indices of `pages`, in order, as the cache controller passes them."""
    P = pool.page_size
    return torch.cat([torch.arange(p * P, (p + 1) * P, dtype=torch.int64) for p in pages])


def assert_pages(dst, before, copied, src=None, what=""):
    """Every page of `dst` is its `before` bytes, except the pages `copied`
    maps (dst page -> src page of `src`), which hold the source's bytes."""
    for p in range(n_pages(dst)):
        got = page_bytes(dst, p)
        want = page_bytes(src, copied[p]) if p in copied else before[p]
        why = f"is not source page {copied[p]}" if p in copied else "changed, though nothing was loaded into it"
        assert torch.equal(got, want), f"{what}: host page {p} {why}"


def page_keys(tag, n):
    """SGLang-shaped page keys: 64 hex characters each."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class HiCache:
    """Opens backends through SGLang's factory in a temporary /dev/shm
    directory; closes them and removes the directory afterwards."""

    def __init__(self, sg, directory):
        self.sg, self.directory, self.opened = sg, directory, []

    def config(self, *, mla, tp_rank=0, tp_size=1, model="org/test-model", **extra):
        extra_config = dict(backend_name="kvtier", module_path=BACKEND_MODULE, class_name="KvtierHiCacheStorage",
                            interface_v1=1, directory=self.directory, capacity="16MiB", wait=5)
        extra_config.update(extra)
        return self.sg.Config(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
                              model_name=model, extra_config=extra_config)

    def open(self, pool, *, mla, wrapped=False, **config):
        backend = self.sg.Factory.create_backend("dynamic", self.config(mla=mla, **config), pool)
        self.opened.append(backend)
        if not wrapped:
            assert type(backend) is self.sg.Backend, type(backend)
        backend.register_mem_pool_host(pool)
        return backend

    def close(self):
        for b in self.opened:
            b.close()


@pytest.fixture
def hicache(sg, monkeypatch):
    monkeypatch.delenv(FAILURE_ENV, raising=False)
    monkeypatch.delenv(DELAY_ENV, raising=False)
    directory = tempfile.mkdtemp(prefix="kvtier-hicache-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    h = HiCache(sg, directory)
    try:
        yield h
    finally:
        h.close()
        shutil.rmtree(directory, ignore_errors=True)


def two_pools(sg, kind, layout, seed=1, **kw):
    """Two host pools of one geometry, filled with different random bytes."""
    gen = torch.Generator().manual_seed(seed)
    a, b = host_pool(sg, kind, layout, **kw), host_pool(sg, kind, layout, **kw)
    fill(a, gen)
    fill(b, gen)
    return a, b


def parts_per_page(pool) -> int:
    ptrs, _ = pool.get_page_buffer_meta(indices(pool, [0]))
    return len(ptrs)


# -- 1, 2: the zero-copy interface between two instances --------------------------


@pytest.mark.parametrize("kind,layout", ALL_POOLS, ids=POOL_IDS)
def test_zero_copy_pages_of_one_instance_load_in_another(sg, hicache, kind, layout):
    a_pool, b_pool = two_pools(sg, kind, layout)
    mla = kind == "mla"
    a = hicache.open(a_pool, mla=mla)
    b = hicache.open(b_pool, mla=mla)
    assert a.path == b.path and os.path.dirname(a.path) == hicache.directory
    assert a._parts == parts_per_page(a_pool) > 0, "the zero-copy path (the pool's page buffer meta) is not used"

    keys = page_keys(f"{kind}-{layout}", 5)
    missing = page_keys("never-stored", 1)[0]
    src, dst = [3, 7, 1, 10, 5], [20, 2, 15, 9, 30]
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, indices(a_pool, src)) == [True] * 5
    assert a.batch_set_v1(keys[:2], indices(a_pool, src[:2])) == [True, True], "a page held already is a success"

    assert b.batch_exists(keys) == 5
    assert b.batch_exists(keys[:2] + [missing] + keys[2:]) == 2
    assert b.batch_exists([missing] + keys) == 0
    assert b.batch_exists([]) == 0
    assert b.exists(keys[4]) and not b.exists(missing)

    before = all_pages(b_pool)
    assert b.batch_get_v1(keys, indices(b_pool, dst)) == [True] * 5
    assert_pages(b_pool, before, dict(zip(dst, src)), a_pool, "zero-copy load")

    # a key missing in the middle: its page is left alone, the others load
    fill(b_pool, torch.Generator().manual_seed(7))
    before = all_pages(b_pool)
    assert b.batch_get_v1([keys[1], missing, keys[3]], indices(b_pool, [11, 12, 13])) == [True, False, True]
    assert_pages(b_pool, before, {11: src[1], 13: src[3]}, a_pool, "load with a missing key")
    assert b.batch_get_v1([], torch.empty(0, dtype=torch.int64)) == []


# -- 3: the flat-page interface (cache_controller's generic page get/set) ---------


@pytest.mark.parametrize("kind,layout", ALL_POOLS, ids=POOL_IDS)
def test_flat_pages_round_trip(sg, hicache, kind, layout):
    a_pool, b_pool = two_pools(sg, kind, layout, seed=2)
    mla = kind == "mla"
    a = hicache.open(a_pool, mla=mla, interface_v1=0)
    b = hicache.open(b_pool, mla=mla, interface_v1=0)
    assert a._parts == 0 and a.path == b.path
    P = a_pool.page_size
    keys = page_keys(f"flat-{kind}-{layout}", 4)
    src, dst = [2, 9, 4, 17], [6, 1, 25, 12]
    # as _generic_page_set: the pool's data pages, by the first index of each page
    assert a.batch_set(keys, [a_pool.get_data_page(indices(a_pool, src)[i * P]) for i in range(len(keys))]) is True

    before = all_pages(b_pool)
    # as _generic_page_get: dummy flat pages, then set_from_flat_data_page
    got = b.batch_get(keys, [b_pool.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None for g in got)
    for i, page in enumerate(got):
        b_pool.set_from_flat_data_page(indices(b_pool, dst)[i * P], page)
    assert_pages(b_pool, before, dict(zip(dst, src)), a_pool, "flat load")

    # one page at a time, and a miss
    extra = page_keys(f"flat-one-{kind}-{layout}", 1)[0]
    assert a.set(extra, a_pool.get_data_page(21 * P)) is True
    target = b_pool.get_dummy_flat_data_page()
    assert b.get(extra, target) is target
    assert torch.equal(target.view(torch.uint8), page_bytes(a_pool, 21))
    missing = page_keys("never-stored", 1)[0]
    assert b.get(missing, b_pool.get_dummy_flat_data_page()) is None
    assert b.batch_get([keys[0], missing], [b_pool.get_dummy_flat_data_page() for _ in range(2)])[1] is None


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_pool_without_zero_copy_meta_goes_through_flat_pages(sg, hicache, kind):
    """batch_get_v1/batch_set_v1 on a host pool whose layout has no page
    buffer meta copy whole flat pages instead."""
    base = sg.MHAHost if kind == "mha" else sg.MLAHost

    class NoMetaHost(base):
        def get_page_buffer_meta(self, indices):
            raise NotImplementedError("no zero-copy meta for this layout")

    gen = torch.Generator().manual_seed(3)
    a_pool = build_host_pool(sg, kind, "layer_first", host_cls=NoMetaHost)
    b_pool = build_host_pool(sg, kind, "layer_first", host_cls=NoMetaHost)
    fill(a_pool, gen)
    fill(b_pool, gen)
    a = hicache.open(a_pool, mla=kind == "mla")
    b = hicache.open(b_pool, mla=kind == "mla")
    assert a._parts == 0
    keys = page_keys(f"nometa-{kind}", 3)
    src, dst = [5, 0, 14], [8, 27, 3]
    assert a.batch_set_v1(keys, indices(a_pool, src)) == [True] * 3
    assert b.batch_exists(keys) == 3
    before = all_pages(b_pool)
    assert b.batch_get_v1(keys + page_keys("never-stored", 1), indices(b_pool, dst + [19])) == [True] * 3 + [False]
    assert_pages(b_pool, before, dict(zip(dst, src)), a_pool, "flat fallback load")


# SGLang picks the interface from `interface_v1` per launch: a page one
# instance stored zero-copy, another (or a restart) launched without
# interface_v1 reads through flat pages. Some layouts lay the two out
# differently (MHA layer_first: K0 V0 K1 V1 ... as parts, all K then all V as
# a flat page), so they use different stores: the reader gets a miss, never
# another order's bytes; and a zero-copy backend refuses flat calls.
MIXED_PARAMS = [pytest.param(kind, layout, id=f"{kind}-{layout}") for kind, layout in ALL_POOLS]


@pytest.mark.parametrize("kind,layout", MIXED_PARAMS)
def test_a_zero_copy_page_read_through_flat_pages_is_the_same_or_a_miss(sg, hicache, kind, layout):
    a_pool, b_pool = two_pools(sg, kind, layout, seed=4)
    mla = kind == "mla"
    writer = hicache.open(a_pool, mla=mla)
    reader = hicache.open(b_pool, mla=mla, interface_v1=0)
    assert writer.path != reader.path
    with pytest.raises(kvtier.KvtierError, match="interface_v1"):
        writer.get(page_keys("any", 1)[0], a_pool.get_dummy_flat_data_page())
    with pytest.raises(kvtier.KvtierError, match="interface_v1"):
        writer.set(page_keys("any", 1)[0], a_pool.get_data_page(0))
    P = a_pool.page_size
    keys = page_keys(f"mixed-{kind}-{layout}", 3)
    src, dst = [4, 11, 6], [13, 0, 22]
    assert writer.batch_set_v1(keys, indices(a_pool, src)) == [True] * 3
    before = all_pages(b_pool)
    loaded = {}
    for key, s, d in zip(keys, src, dst):
        page = reader.get(key, b_pool.get_dummy_flat_data_page())
        if page is not None:
            b_pool.set_from_flat_data_page(d * P, page)
            loaded[d] = s
    assert_pages(b_pool, before, loaded, a_pool, "zero-copy page read through flat pages")
    # and the other way round
    keys = page_keys(f"mixed-back-{kind}-{layout}", 2)
    assert reader.batch_set(keys, [b_pool.get_data_page(p * P) for p in (16, 18)]) is True
    before = all_pages(a_pool)
    found = writer.batch_get_v1(keys, indices(a_pool, [26, 29]))
    assert_pages(a_pool, before, {d: s for d, s, f in zip((26, 29), (16, 18), found) if f}, b_pool,
                 "flat page read zero-copy")


# -- 4: tensor-parallel ranks ------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_tensor_parallel_ranks_keep_their_own_pages(sg, hicache, layout):
    p0, p1 = two_pools(sg, "mha", layout, seed=5)
    r0 = hicache.open(p0, mla=False, tp_rank=0, tp_size=2)
    r1 = hicache.open(p1, mla=False, tp_rank=1, tp_size=2)
    keys = page_keys(f"tp-mha-{layout}", 4)
    assert r0.batch_set_v1(keys, indices(p0, [1, 2, 3, 4])) == [True] * 4
    assert r1.batch_exists(keys) == 0 and not r1.exists(keys[0])
    before = all_pages(p1)
    assert r1.batch_get_v1(keys, indices(p1, [10, 11, 12, 13])) == [False] * 4
    assert_pages(p1, before, {}, what="rank 1 loading rank 0's keys")

    # rank 1's own shard under the same keys: each rank reads back its own
    assert r1.batch_set_v1(keys, indices(p1, [5, 6, 7, 8])) == [True] * 4
    assert r0.batch_exists(keys) == 4 and r1.batch_exists(keys) == 4
    before = all_pages(p1)
    assert r1.batch_get_v1(keys, indices(p1, [20, 21, 22, 23])) == [True] * 4
    assert_pages(p1, before, {20: 5, 21: 6, 22: 7, 23: 8}, p1, "rank 1's own pages")
    before = all_pages(p0)
    assert r0.batch_get_v1(keys, indices(p0, [20, 21, 22, 23])) == [True] * 4
    assert_pages(p0, before, {20: 1, 21: 2, 22: 3, 23: 4}, p0, "rank 0's own pages")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_tensor_parallel_ranks_share_pages(sg, hicache, layout):
    p0, p1 = two_pools(sg, "mla", layout, seed=6)
    r0 = hicache.open(p0, mla=True, tp_rank=0, tp_size=2)
    r1 = hicache.open(p1, mla=True, tp_rank=1, tp_size=2)
    keys = page_keys(f"tp-mla-{layout}", 4)
    assert r0.batch_set_v1(keys, indices(p0, [1, 2, 3, 4])) == [True] * 4
    assert r1.batch_exists(keys) == 4
    before = all_pages(p1)
    assert r1.batch_get_v1(keys, indices(p1, [10, 11, 12, 13])) == [True] * 4
    assert_pages(p1, before, {10: 1, 11: 2, 12: 3, 13: 4}, p0, "rank 1 loading rank 0's MLA pages")


# -- 5: SGLang's failure injector ----------------------------------------------------


@pytest.mark.parametrize("v1", [1, 0], ids=["zero-copy", "flat"])
def test_under_the_failure_injector_nothing_wrong_is_reported(sg, hicache, monkeypatch, v1):
    if sg.Injector is None:
        pytest.skip("this SGLang release has no HiCacheStorageFailureInjector (0.5.23 on)")
    monkeypatch.setenv(FAILURE_ENV, "0.3")
    gen = torch.Generator().manual_seed(8)
    w_pool, r_pool = two_pools(sg, "mha", "page_first", seed=8)
    writer = hicache.open(w_pool, mla=False, wrapped=True, interface_v1=v1)
    reader = hicache.open(r_pool, mla=False, wrapped=True, interface_v1=v1)
    for backend in (writer, reader):
        assert type(backend) is sg.Injector and type(backend._backend) is sg.Backend
    P = w_pool.page_size
    keys = page_keys("injected", 25)
    source = {k: i + 1 for i, k in enumerate(keys)}  # key -> writer page holding its data
    never = set(keys[4::5])  # asked for, never set: chunks over them have a partial prefix
    stored = set()
    rng = random.Random(8)
    ok_loads = misses_of_stored = 0

    def chunk(settable=False):
        """1 to 4 consecutive keys; for a set, those of them ever set."""
        start = rng.randrange(len(keys))
        ks = keys[start:start + rng.randint(1, 4)]
        if settable:
            ks = [k for k in ks if k not in never] or [keys[start - 1]]
        return ks

    def check_flat(key, page):
        assert key in stored, "a page never stored was loaded"
        assert torch.equal(page.view(torch.uint8), page_bytes(w_pool, source[key])), "a load succeeded with wrong bytes"

    for _ in range(400):
        # a zero-copy backend refuses flat calls; a flat one serves both
        # (its batch_*_v1 copy flat pages)
        flat_ops = [] if v1 else ["set", "batch_set", "get", "batch_get"]
        op = rng.choice(["set_v1", "set_v1", "get_v1", "get_v1", "exists", "batch_exists"] + flat_ops)
        ks = chunk(settable=op.startswith(("set", "batch_set")))
        if op == "set_v1":
            for k, ok in zip(ks, writer.batch_set_v1(ks, indices(w_pool, [source[k] for k in ks]))):
                if ok:
                    stored.add(k)
        elif op == "set":
            if writer.set(ks[0], w_pool.get_data_page(source[ks[0]] * P)):
                stored.add(ks[0])
        elif op == "batch_set":
            if writer.batch_set(ks, [w_pool.get_data_page(source[k] * P) for k in ks]):
                stored.update(ks)
        elif op == "get_v1":
            fill(r_pool, gen)  # a load that reports success without copying shows
            dst = list(range(20, 20 + len(ks)))
            for k, d, ok in zip(ks, dst, reader.batch_get_v1(ks, indices(r_pool, dst))):
                if ok:
                    ok_loads += 1
                    check_flat(k, page_bytes(r_pool, d))
                elif k in stored:
                    misses_of_stored += 1
        elif op == "get":
            page = reader.get(ks[0], r_pool.get_dummy_flat_data_page())
            if page is not None:
                ok_loads += 1
                check_flat(ks[0], page)
            elif ks[0] in stored:
                misses_of_stored += 1
        elif op == "batch_get":
            for k, page in zip(ks, reader.batch_get(ks, [r_pool.get_dummy_flat_data_page() for _ in ks])):
                if page is not None:
                    ok_loads += 1
                    check_flat(k, page)
                elif k in stored:
                    misses_of_stored += 1
        elif op == "exists":
            if reader.exists(ks[0]):
                assert ks[0] in stored, "exists reported a page never stored"
        else:
            n = reader.batch_exists(ks)
            prefix = next((i for i, k in enumerate(ks) if k not in stored), len(ks))
            assert n in (0, prefix), f"batch_exists said {n}; the stored prefix is {prefix}"
    assert not stored & never
    assert ok_loads > 20 and misses_of_stored > 5 and len(stored) > 12, (ok_loads, misses_of_stored, len(stored))


# -- 6: one store per namespace ------------------------------------------------------

VARIANTS = {
    # same page bytes and parts, another token order within the page
    "layout": (dict(kind="mha", layout="page_first"), dict(kind="mha", layout="page_first_direct")),
    "layout-mla": (dict(kind="mla", layout="page_first"), dict(kind="mla", layout="page_first_direct")),
    "page-size": (dict(kind="mha", layout="page_first", page=4), dict(kind="mha", layout="page_first", page=16)),
    # same bytes per page, another element type
    "dtype": (dict(kind="mha", layout="page_first", dtype=torch.bfloat16),
              dict(kind="mha", layout="page_first", dtype=torch.float16)),
    "heads": (dict(kind="mha", layout="layer_first", heads=2), dict(kind="mha", layout="layer_first", heads=4)),
    "layers": (dict(kind="mla", layout="layer_first", layers=3), dict(kind="mla", layout="layer_first", layers=4)),
    "model": (dict(kind="mha", layout="page_first", model="org/model-a"),
              dict(kind="mha", layout="page_first", model="org/model-b")),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_another_layout_geometry_or_model_is_another_store(sg, hicache, variant):
    backends, pools = [], []
    for i, spec in enumerate(VARIANTS[variant]):
        spec = dict(spec)
        kind, layout, model = spec.pop("kind"), spec.pop("layout"), spec.pop("model", "org/test-model")
        pool = host_pool(sg, kind, layout, **spec)
        fill(pool, torch.Generator().manual_seed(10 + i))
        pools.append(pool)
        backends.append(hicache.open(pool, mla=kind == "mla", model=model))
    (x, y), (x_pool, y_pool) = backends, pools
    assert x.path != y.path
    keys = page_keys(f"namespace-{variant}", 3)
    assert x.batch_set_v1(keys, indices(x_pool, [1, 2, 3])) == [True] * 3
    assert y.batch_exists(keys) == 0 and not y.exists(keys[0])
    before = all_pages(y_pool)
    assert y.batch_get_v1(keys, indices(y_pool, [4, 5, 6])) == [False] * 3
    assert_pages(y_pool, before, {}, what=f"{variant}: the other store's keys")


# -- 7: hostile keys -----------------------------------------------------------------

HOSTILE_KEYS = ["a\0b", "a", "a\0c", "\0", "\udcff", "\udcfe", "x\udcffy", "k" * 10_000, "k" * 9_999 + "j",
                "", "\u00e9" * 101, "\U0001f600", "\ud83d\ude00", "plain"]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_hostile_keys_are_stored_and_found(sg, hicache, kind):
    a_pool, b_pool = two_pools(sg, kind, "page_first", seed=11)
    mla = kind == "mla"
    a = hicache.open(a_pool, mla=mla)
    b = hicache.open(b_pool, mla=mla)
    n = len(HOSTILE_KEYS)
    src, dst = list(range(1, n + 1)), list(range(n + 2, 2 * n + 2))
    assert b.batch_exists(HOSTILE_KEYS) == 0
    assert a.batch_set_v1(HOSTILE_KEYS, indices(a_pool, src)) == [True] * n
    assert b.batch_exists(HOSTILE_KEYS) == n
    assert all(b.exists(k) for k in HOSTILE_KEYS)
    assert b.batch_exists(["\udcfd"] + HOSTILE_KEYS) == 0 and not b.exists("a\0d")
    before = all_pages(b_pool)
    # every key its own page: distinct data shows no two keys share a page
    assert b.batch_get_v1(HOSTILE_KEYS, indices(b_pool, dst)) == [True] * n
    assert_pages(b_pool, before, dict(zip(dst, src)), a_pool, "hostile keys")

    # the flat interface too (a launch without interface_v1)
    a = hicache.open(a_pool, mla=mla, interface_v1=0)
    b = hicache.open(b_pool, mla=mla, interface_v1=0)
    P = a_pool.page_size
    flat = ["flat\0key", "flat\udcff", "f" * 10_000]
    assert a.batch_set(flat, [a_pool.get_data_page(p * P) for p in (28, 29, 30)]) is True
    got = b.batch_get(flat, [b_pool.get_dummy_flat_data_page() for _ in flat])
    for page, p in zip(got, (28, 29, 30)):
        assert page is not None and torch.equal(page.view(torch.uint8), page_bytes(a_pool, p))
    assert b.get("flat\0other", b_pool.get_dummy_flat_data_page()) is None


def test_a_plain_key_never_aliases_a_hashed_one(sg, hicache):
    """An MLA store takes a plain key as it is, and a key it cannot (a NUL,
    not UTF-8, too long) as "sha256:" and the hash: a plain key spelled that
    way must still be another key."""
    a_pool, b_pool = two_pools(sg, "mla", "page_first", seed=12)
    a = hicache.open(a_pool, mla=True)
    b = hicache.open(b_pool, mla=True)
    long_key = "L" * 300
    lookalike = "sha256:" + hashlib.sha256(long_key.encode()).hexdigest()
    assert a.batch_set_v1([long_key], indices(a_pool, [3])) == [True]
    assert b.batch_exists([lookalike]) == 0, "a key never stored is found: it names another key's page"


# -- 8: a store smaller than what is set -----------------------------------------------


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_a_small_store_evicts_old_pages_and_never_serves_wrong_bytes(sg, hicache, kind, layout):
    a_pool, b_pool = two_pools(sg, kind, layout, seed=13)
    mla = kind == "mla"
    flat = a_pool.get_dummy_flat_data_page()
    slots = 6
    capacity = f"{slots * flat.numel() * flat.element_size()}B"
    a = hicache.open(a_pool, mla=mla, capacity=capacity)
    b = hicache.open(b_pool, mla=mla, capacity=capacity)
    assert a.store.slots == slots
    keys = page_keys(f"evict-{kind}-{layout}", 3 * slots)
    src = [1 + i % 30 for i in range(len(keys))]
    for i in range(0, len(keys), 2):  # oldest first, two a call
        assert a.batch_set_v1(keys[i:i + 2], indices(a_pool, src[i:i + 2])) == [True, True]
    assert a.counters()["evictions"] >= len(keys) - slots

    found = []
    for key, s in zip(keys, src):
        fill(b_pool, torch.Generator().manual_seed(len(found) + 100))
        before = all_pages(b_pool)
        ok = b.batch_get_v1([key], indices(b_pool, [31]))
        assert len(ok) == 1
        assert_pages(b_pool, before, {31: s} if ok[0] else {}, a_pool, f"key {keys.index(key)} after evictions")
        found.append(ok[0])
    assert 0 < sum(found) <= slots
    assert not found[0] and found[-1], "the oldest page was kept, or the newest was not"
    assert b.batch_exists(keys) == 0 and b.batch_exists(keys[-1:]) == 1


# -- SGLang's own cache controller code driving the backend -------------------------


def controller_on(sg, backend, pool, *, v1: bool):
    """An object whose storage methods are SGLang's HiCacheController's own
    (backup, the prefix hit query, the prefetch transfer, the zero-copy and
    flat page calls), with the few attributes they read: the controller's
    storage threads, minus the threads and the TP collectives."""
    cc = import_quietly("sglang.srt.managers.cache_controller")
    real = cc.HiCacheController
    names = ("_page_backup", "_page_transfer", "_page_transfer_kv_batch", "_storage_hit_query",
             "_page_get_zero_copy", "_page_set_zero_copy", "_generic_page_get", "_generic_page_set")
    Driven = type("DrivenHiCacheController", (), {n: getattr(real, n) for n in names if hasattr(real, n)})
    ctl = Driven()
    ctl.storage_backend = backend
    ctl.mem_pool_host = ctl.storage_host_pool = pool
    ctl.page_size = pool.page_size
    ctl.page_get_func = ctl._page_get_zero_copy if v1 else ctl._generic_page_get
    ctl.page_set_func = ctl._page_set_zero_copy if v1 else ctl._generic_page_set
    import queue

    ctl.prefetch_sync_queue = queue.Queue()
    return ctl, cc


def chained_page_hashes(tokens, prior=None, page_size=None):
    """A page hash chain (each page's hash covers the pages before it), for
    SGLang's get_storage_hash_str, whose native extension is compiled on
    first use (a JIT build this test machine does not make)."""
    out, h = [], prior or ""
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256((h + ",".join(map(str, tokens[i:i + page_size]))).encode()).hexdigest()
        out.append(h)
    return out


@pytest.mark.parametrize("v1", [1, 0], ids=["zero-copy", "flat"])
@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_sglangs_controller_backs_up_a_prefix_that_another_instance_finds_and_loads(sg, hicache, monkeypatch,
                                                                                    kind, layout, v1):
    """One instance's controller code backs a request's pages up; another
    instance's finds the longest prefix of a longer request by its page
    hashes (SGLang's batching and prefix walk; the hash function itself
    stood in for) and loads it into its host pool, bit for bit."""
    a_pool, b_pool = two_pools(sg, kind, layout, seed=20)
    mla = kind == "mla"
    writer, cc = controller_on(sg, hicache.open(a_pool, mla=mla, interface_v1=v1), a_pool, v1=bool(v1))
    monkeypatch.setattr(cc, "get_storage_hash_str", chained_page_hashes)
    reader, _ = controller_on(sg, hicache.open(b_pool, mla=mla, interface_v1=v1), b_pool, v1=bool(v1))
    P = a_pool.page_size
    tokens = [random.Random(20).randrange(50_000) for _ in range(6 * P)]
    hashes = cc.get_storage_hash_str(tokens, None, page_size=P)
    assert len(hashes) == 6
    src = [3, 8, 1, 12, 5, 9]
    backup = cc.StorageOperation(indices(a_pool, src), tokens, hash_value=hashes)
    writer._page_backup(backup)
    assert backup.completed_tokens == len(tokens)

    # a longer request sharing the prefix: the stored six pages are its hit
    longer = tokens + [7] * (2 * P)
    fetch = cc.PrefetchOperation("req-1", longer)
    hit_hashes, hit_tokens = reader._storage_hit_query(fetch)
    assert hit_tokens == 6 * P and hit_hashes == hashes
    fetch.hash_value = hit_hashes
    dst = [20, 2, 15, 7, 30, 11]
    fetch.host_indices = indices(b_pool, dst)
    before = all_pages(b_pool)
    assert reader._page_transfer(fetch) == 6
    assert_pages(b_pool, before, dict(zip(dst, src)), a_pool, "prefetched by SGLang's controller code")
    # another request's tokens: no hit
    other = cc.PrefetchOperation("req-2", [t + 1 for t in tokens])
    assert reader._storage_hit_query(other)[1] == 0


# -- two processes, and a restart --------------------------------------------------

WRITER = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
import test_hicache_sglang as t
sg = t.sglang_classes()
pool = t.build_host_pool(sg, {kind!r}, {layout!r})
t.fill(pool, torch.Generator().manual_seed({seed}))
h = t.HiCache(sg, {directory!r})
b = h.open(pool, mla={mla})
keys = t.page_keys("two-processes", {n})
assert b.batch_set_v1(keys, t.indices(pool, {src})) == [True] * {n}
print("stored", flush=True)
sys.stdin.readline()  # held open until the reader has looked
b.close()
"""


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_another_process_finds_a_process_pages_while_it_runs_and_after_it_is_gone(sg, hicache, kind, layout):
    """A writer process stores a prefix; this process (another SGLang
    instance) finds and loads it while the writer runs; once the writer is
    gone, a new backend (a restart) finds and loads it again."""
    import subprocess

    seed, src = 31, [4, 9, 2, 17, 11]
    code = WRITER.format(tests=os.path.dirname(__file__), kind=kind, layout=layout, seed=seed,
                         directory=hicache.directory, mla=kind == "mla", n=len(src), src=src)
    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = writer.stdout.readline()
        assert line.strip() == "stored", writer.stderr.read()
        # the writer's bytes, made again from its seed
        source = build_host_pool(sg, kind, layout)
        fill(source, torch.Generator().manual_seed(seed))
        keys = page_keys("two-processes", len(src))
        for attempt, dst in (("while the writer runs", [20, 1, 30, 7, 12]), ("after a restart", [3, 22, 8, 27, 15])):
            pool = build_host_pool(sg, kind, layout)
            fill(pool, torch.Generator().manual_seed(99))
            reader = hicache.open(pool, mla=kind == "mla")
            assert reader.batch_exists(keys + page_keys("never-stored", 1)) == len(keys), attempt
            before = all_pages(pool)
            assert reader.batch_get_v1(keys, indices(pool, dst)) == [True] * len(keys), attempt
            assert_pages(pool, before, dict(zip(dst, src)), source, f"loaded from another process {attempt}")
            reader.close()
            if attempt == "while the writer runs":
                writer.stdin.write("done\n")
                writer.stdin.flush()
                assert writer.wait(60) == 0, writer.stderr.read()
    finally:
        if writer.poll() is None:
            writer.kill()
