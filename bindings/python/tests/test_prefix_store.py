"""The prefix store from Python: pages shared between processes and found
again after a restart; several writers and readers killed at random with
SIGKILL never leave a wrong page readable; bad arguments refused with
kvtier's own errors."""

import hashlib
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time

import numpy as np
import pytest

import kvtier

PAGE = 64 << 10


@pytest.fixture
def store_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield d


def page_of(key: str, n: int = PAGE) -> bytes:
    """The one page a key may ever hold in these tests: derived from the key."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


def test_pages_are_shared_between_handles_and_found_after_reopening(store_dir):
    path = os.path.join(store_dir, "store")
    a = kvtier.PrefixStore.open(path, "model|page_first|bf16", PAGE, 32)
    b = kvtier.PrefixStore.open(path, "model|page_first|bf16", PAGE, 999)
    assert (b.slots, b.page_bytes) == (32, PAGE) and b.file_bytes >= 32 * PAGE
    keys = [f"k{i}" for i in range(8)]
    assert [a.set_bytes(k, page_of(k)) for k in keys] == ["stored"] * 8
    assert b.set_bytes("k0", page_of("k1")) == "present"
    assert b.hits(keys + ["missing"] + keys) == 8
    assert b.hits(["missing"] + keys) == 0
    assert b.get_bytes("k3") == page_of("k3") and b.get_bytes("missing") is None
    a.close()
    b.close()
    c = kvtier.PrefixStore.open(path, "model|page_first|bf16", PAGE, 32)
    assert all(c.get_bytes(k) == page_of(k) for k in keys)
    counters = c.counters()
    assert counters["sets"] == 8 and counters["pages"] == 8 and counters["misses"] == 1
    assert c.clear() == 8 and c.hits(keys) == 0
    c.close()


def test_get_and_set_copy_over_parts_straight_from_and_into_numpy_pages(store_dir):
    s = kvtier.PrefixStore.open(os.path.join(store_dir, "store"), "parts", 3 * 4096, 8)
    src = np.random.default_rng(1).integers(0, 256, (2, 3, 4096), dtype=np.uint8)
    ptrs = np.array([src[p, part].ctypes.data for p in range(2) for part in (2, 0, 1)], dtype=np.uint64)
    lens = np.full(6, 4096, dtype=np.uint64)
    assert s.set(["x", "y"], ptrs, lens, 3) == ["stored", "stored"]
    dst = np.zeros_like(src)
    out = [dst[p, part].ctypes.data for p in range(2) for part in (2, 0, 1)]
    assert s.get(["y", "x"], out, [4096] * 6, 3) == [True, True]
    assert (dst[0] == src[1]).all() and (dst[1] == src[0]).all()
    assert s.get_bytes("x") == src[0, 2].tobytes() + src[0, 0].tobytes() + src[0, 1].tobytes()
    s.close()


def test_bad_arguments_are_refused_with_kvtiers_errors(store_dir):
    path = os.path.join(store_dir, "store")
    with open(path, "wb") as f:
        f.write(b"another program's data")
    with pytest.raises(kvtier.KvtierError) as e:
        kvtier.PrefixStore.open(path, "ns", PAGE, 4)
    assert e.value.status == "POOL_ERROR" and "not a kvtier prefix store" in e.value.message
    assert open(path, "rb").read() == b"another program's data"
    os.remove(path)
    s = kvtier.PrefixStore.open(path, "ns", PAGE, 4)
    with pytest.raises(kvtier.KvtierError, match="holds pages of `ns`"):
        kvtier.PrefixStore.open(path, "other", PAGE, 4)
    with pytest.raises(kvtier.KvtierError, match="1 to 200 bytes"):
        s.hits(["x" * 201])
    with pytest.raises(kvtier.KvtierError, match="NUL"):
        s.hits(["a\0b"])
    with pytest.raises(kvtier.KvtierError, match="one key, not a list"):
        s.hits("abc")
    with pytest.raises(kvtier.KvtierError, match="add up to 4096 B"):
        s.get(["k"], [1], [4096])
    with pytest.raises(kvtier.KvtierError, match="null pointer"):
        s.get(["k"], [0], [PAGE])
    with pytest.raises(kvtier.KvtierError, match="the call needs 2"):
        s.get(["k"], [1], [PAGE], 2)
    with pytest.raises(kvtier.KvtierError, match="a page of this store is"):
        s.set_bytes("k", b"short")
    for bad in (0, -1, 2**41, "8"):
        with pytest.raises(kvtier.KvtierError):
            kvtier.PrefixStore.open(os.path.join(store_dir, "x"), "ns", bad, 4)
    s.close()
    with pytest.raises(kvtier.KvtierError, match="closed"):
        s.hits(["k"])


# Pages large enough (a copy takes about a millisecond) that kills land
# mid-copy.
BIG = 4 << 20
_BIG_PAGES = {}


def big_page(key: str) -> bytes:
    if key not in _BIG_PAGES:
        _BIG_PAGES[key] = page_of(key, BIG)
    return _BIG_PAGES[key]


def _worker(path: str, seed: int, writer: bool, stop_at: float) -> None:
    """Sets pages (each key's one page) or reads them and checks every byte,
    until `stop_at` or its SIGKILL; exits 3 on a wrong page."""
    s = kvtier.PrefixStore.open(path, "kill", BIG, 16)
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        key = f"key{rng.randrange(40)}"
        if writer and rng.random() < 0.6:
            s.set_bytes(key, big_page(key))
        else:
            got = s.get_bytes(key)
            if got is not None and got != big_page(key):
                os._exit(3)
    os._exit(0)


def test_writers_and_readers_killed_at_random_never_leave_a_wrong_page(store_dir):
    path = os.path.join(store_dir, "store")
    kvtier.PrefixStore.open(path, "kill", BIG, 16).close()
    for i in range(40):
        big_page(f"key{i}")  # made once, before the workers fork
    ctx = mp.get_context("fork")
    rng = random.Random(5)
    stop_at = time.monotonic() + 6.0
    procs, killed = [], 0
    while time.monotonic() < stop_at - 1.0:
        while len([p for p in procs if p.is_alive()]) < 6:
            p = ctx.Process(target=_worker, args=(path, rng.randrange(1 << 30), rng.random() < 0.6, stop_at))
            p.start()
            procs.append(p)
        time.sleep(rng.uniform(0.01, 0.08))
        victim = rng.choice([p for p in procs if p.is_alive()] or [None])
        if victim is not None:
            os.kill(victim.pid, signal.SIGKILL)
            killed += 1
    for p in procs:
        p.join(20)
    codes = [p.exitcode for p in procs]
    assert 3 not in codes, "a reader got a wrong page"
    assert killed >= 10 and codes.count(0) >= 1, (killed, codes)
    # the survivors' view: every page held is its key's, and the store still
    # takes pages (slots a killed writer or evictor held are taken back)
    s = kvtier.PrefixStore.open(path, "kill", BIG, 16)
    for i in range(40):
        got = s.get_bytes(f"key{i}")
        assert got is None or got == big_page(f"key{i}"), i
    assert [s.set_bytes(f"fresh{i}", big_page(f"fresh{i}")) for i in range(16)].count("full") == 0
    assert all(s.get_bytes(f"fresh{i}") == big_page(f"fresh{i}") for i in range(16))
    # kills landed mid-copy: slots left WRITING or EVICTING were taken back
    assert s.counters()["reclaimed"] >= 1, s.counters()
    s.close()
