"""The pool's Python API: layouts checked when made, publishing twice, the
layer-first view of a region, and the pool example of docs/pool.md (the
README's is its shorter form; both run as written in test_readme.py)."""

from __future__ import annotations

import ctypes
import pickle

import numpy as np
import pytest

import kvtier
from kvtier import KvtierError, Layout, Pool, device_bytes_for
from kvtier import _lib

MAX_TOKENS = 2**31 - 1
MAX_ENTRY = 2**32 - 8

# (entry_bytes, layers, tokens_per_region) on and around each of the limits
# of LayerFirstLayout::new (src/layout.rs).
LAYOUT_CASES = [
    (650, 61, 10),
    (0, 0, 0),
    (0, 1, 1),
    (12, 1, 1),
    (8, 1, 1),
    (656, 61, 131072),
    (8, 0, 1),
    (8, 4096, 1),
    (8, 4097, 1),
    (8, 1, 0),
    (8, 1, MAX_TOKENS),
    (8, 1, MAX_TOKENS + 1),
    (8, 1, 2**32 - 1),
    (MAX_ENTRY, 1, 1),
    (8, 4096, MAX_TOKENS),  # 2**46 B: under 256 TiB
    (2**17, 2**10, 2**21),  # a region of exactly 256 TiB
    (2**17, 2**10, 2**21 + 1),  # one token more
    (MAX_ENTRY, 4096, MAX_TOKENS),
]


def library_verdict(case):
    """What the library says of a layout, bypassing the Python checks: None
    when it accepts it, else its message."""
    out = ctypes.c_uint64()
    status = _lib.library().kvt_pool_device_bytes_for(ctypes.byref(_lib.Layout(*case)), 1, ctypes.byref(out))
    return None if status == _lib.OK else _lib.library().kvt_last_error().decode()


def python_verdict(case):
    try:
        Layout(*case)
    except KvtierError as e:
        assert e.status == "INVALID_ARGUMENT"
        return e.message
    return None


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "x".join(map(str, c)))
def test_a_layout_is_checked_when_made_by_the_librarys_rules(case):
    """Layout() accepts exactly the layouts the library accepts, and refuses
    the others with the library's own message, naming the field."""
    assert python_verdict(case) == library_verdict(case)


def test_a_bad_layout_is_refused_at_construction_naming_the_field():
    refusals = {
        (650, 61, 10): ("entry_bytes", "650 is not a positive multiple of 8"),
        (0, 0, 0): ("entry_bytes", "0 is not a positive multiple of 8"),
        (-8, 1, 1): ("entry_bytes", "-8 is not a positive multiple of 8"),
        (2**32, 1, 1): ("entry_bytes", f"outside 8..={MAX_ENTRY}"),
        (656, 0, 16): ("layers", "0 is outside 1..=4096"),
        (656, 4097, 16): ("layers", "4097 is outside 1..=4096"),
        (656, 61, 0): ("tokens_per_region", f"0 is outside 1..={MAX_TOKENS}"),
        (656, 61, 2**31): ("tokens_per_region", f"2147483648 is outside 1..={MAX_TOKENS}"),
        (2**17, 2**10, 2**21 + 1): ("tokens_per_region", "more than the 281474976710656 B (256 TiB)"),
        ("656", 61, 16): ("entry_bytes", "'656' is not an int"),
        (656, 61.0, 16): ("layers", "61.0 is not an int"),
        (656, 61, True): ("tokens_per_region", "True is not an int"),
    }
    for case, (field, words) in refusals.items():
        with pytest.raises(KvtierError) as e:
            Layout(*case)
        assert e.value.message.startswith(f"invalid argument `{field}`: "), (case, e.value.message)
        assert words in e.value.message, (case, e.value.message)
        assert e.value.status == "INVALID_ARGUMENT"
    with pytest.raises(KvtierError, match="`layers`"):
        Layout(entry_bytes=656, layers=0, tokens_per_region=16)
    with pytest.raises(KvtierError, match="`layers`"):
        Layout(656, 61, 16)._replace(layers=5000)
    with pytest.raises(KvtierError, match="`entry_bytes`"):
        Layout._make([650, 61, 16])
    with pytest.raises(KvtierError, match="`entry_bytes`"):
        Pool.create((650, 61, 16), ["anon:4MiB"])  # a plain tuple, as before


def test_a_layout_is_still_a_named_tuple():
    lay = Layout(656, 61, 4096)
    assert isinstance(lay, tuple) and lay._fields == ("entry_bytes", "layers", "tokens_per_region")
    assert lay == (656, 61, 4096) and tuple(lay) == (656, 61, 4096) and hash(lay) == hash((656, 61, 4096))
    assert (lay.entry_bytes, lay.layers, lay.tokens_per_region) == (656, 61, 4096)
    entry, layers, tokens = lay
    assert (entry, layers, tokens) == (656, 61, 4096)
    assert Layout(entry_bytes=656, layers=61, tokens_per_region=4096) == lay
    assert lay._replace(layers=1) == Layout(656, 1, 4096)
    assert lay._asdict() == {"entry_bytes": 656, "layers": 61, "tokens_per_region": 4096}
    assert repr(lay) == "Layout(entry_bytes=656, layers=61, tokens_per_region=4096)"
    assert pickle.loads(pickle.dumps(lay)) == lay and type(pickle.loads(pickle.dumps(lay))) is Layout
    assert lay.region_bytes() == 656 * 61 * 4096
    # numpy integers are taken, as the Python ints they stand for
    n = Layout(np.int64(656), np.uint32(61), np.int32(4096))
    assert n == lay and all(type(v) is int for v in n)
    c = lay._c()
    assert (c.entry_bytes, c.layers, c.tokens_per_region) == (656, 61, 4096)
    assert device_bytes_for(lay) == device_bytes_for((656, 61, 4096))


def small_pool(layout, regions=1):
    return Pool.create(layout, [f"anon:{device_bytes_for(layout, regions)}"])


def test_publishing_a_region_twice_says_it_is_already_published():
    with small_pool(Layout(16, 2, 4), 2) as pool:
        r = pool.alloc_region()
        r.publish()
        with pytest.raises(KvtierError) as e:
            r.publish()
        assert e.value.message.startswith(f"region {r.index} is already published"), e.value.message
        assert "Some(" not in e.value.message and "Ready" not in e.value.message
        assert e.value.status == "POOL_ERROR"  # the library's status for it, as before
        other = pool.alloc_region()
        other.publish()  # another region publishes once too
        r.free()
        with pytest.raises(KvtierError, match="this Region was freed"):
            r.publish()  # freed wins over published
        again = pool.alloc_region()
        again.publish()  # a new allocation of the region publishes afresh
        other.free()
        again.free()


def test_a_region_joined_by_another_pool_handle_is_one_copy_its_owner_cannot_free_meanwhile(tmp_path):
    import os
    import tempfile

    d = tempfile.mkdtemp(prefix="kvtier-join-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    device = f"file:{d}/cxl0:8MiB"
    try:
        owner = Pool.create(Layout(16, 2, 4), [device])
        peer = Pool.open([device])
        r = owner.alloc_region()
        assert r.epoch > 0 and not r.joined and not r.joined_elsewhere
        assert r.ticket == {"pool": owner.info()["uuid"], "index": r.index, "epoch": r.epoch}
        with pytest.raises(KvtierError, match="is gone"):
            peer.join_region({**r.ticket, "epoch": r.epoch + 1})
        with pytest.raises(KvtierError, match="epoch"):
            peer.join_region({**r.ticket, "epoch": -1})
        for bad in [(r.index, r.epoch), {"index": r.index, "epoch": r.epoch}, {**r.ticket, "pool": "zz"},
                    {**r.ticket, "pool": "00" * 15}]:
            with pytest.raises(KvtierError, match="ticket"):
                peer.join_region(bad)
        # another pool's ticket with this pool's numbers (every pool's first
        # allocation of a region has the same epoch) maps nothing
        with small_pool(Layout(16, 2, 4)) as other:
            theirs = other.alloc_region()
            with pytest.raises(KvtierError, match="not of this pool"):
                peer.join_region({**r.ticket, "pool": other.info()["uuid"]})
            theirs.free()
        j = peer.join_region(r.ticket)
        assert j.joined and (j.index, j.epoch, j.nbytes) == (r.index, r.epoch, r.nbytes)
        assert j.ticket == r.ticket
        j.numpy()[:4] = [1, 2, 3, 4]
        assert list(r.numpy()[:4]) == [1, 2, 3, 4]  # one copy, two mappings
        assert r.joined_elsewhere
        with pytest.raises(KvtierError, match="still mapped by a process that joined it"):
            r.free()
        assert owner.info()["free_regions"] == owner.info()["num_regions"] - 1, "the refused region stays"
        j.free()
        assert owner.info()["free_regions"] == owner.info()["num_regions"], "and goes with its joiner's leave"
        owner.close()
        peer.close()
        with small_pool(Layout(16, 2, 4)) as private:
            mine = private.alloc_region()
            with pytest.raises(KvtierError, match="file: or dax:"):
                private.join_region(mine.ticket)
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_a_region_as_layers_of_tokens_of_entries():
    layout = Layout(24, 3, 5)
    with small_pool(layout) as pool:
        r = pool.alloc_region()
        assert r.layout == layout
        flat = r.numpy()
        assert flat.shape == (layout.region_bytes(),) and flat.dtype == np.uint8, "the default stays flat"
        flat[:] = 0
        kv = r.numpy(shaped=True)
        assert kv.shape == (3, 5, 24) and kv.dtype == np.uint8 and np.shares_memory(kv, flat)
        kv[2, 4] = np.arange(24)
        at = (2 * 5 + 4) * 24
        assert flat[at : at + 24].tolist() == list(range(24)), "[layer][token][entry_bytes]"
        assert flat.sum() == sum(range(24)), "nothing else written"
        words = r.numpy(np.uint64, shaped=True)
        assert words.shape == (3, 5, 3) and np.shares_memory(words, flat)
        assert r.numpy(np.uint16, shaped=True).shape == (3, 5, 12)
        with pytest.raises(KvtierError, match="not both"):
            r.numpy(shape=(3, 5, 24), shaped=True)
        with pytest.raises(KvtierError, match="24 B is not a whole number of 16-byte items"):
            r.numpy(np.complex128, shaped=True)
        r.free()
        with pytest.raises(KvtierError, match="this Region was freed"):
            r.numpy(shaped=True)


README_POOL_EXAMPLE = """\
import numpy as np
import kvtier

layout = kvtier.Layout(entry_bytes=656, layers=4, tokens_per_region=128)  # fp8 DSA entries
devices = [f"anon:{kvtier.device_bytes_for(layout, regions=2)}"]        # or numa:2:64GiB, dax:/dev/dax0.0
with kvtier.Pool.create(layout, devices) as pool:
    region = pool.alloc_region(request=1)
    kv = region.numpy(shaped=True)       # [layers][tokens][entry_bytes] uint8, no copy
    entry = np.arange(656) % 251
    kv[2, 17] = entry                    # layer 2, token 17
    region.publish()                     # written: readers may trust its bytes from now on
    flat = region.numpy()                # the same bytes, flat and layer-first
    at = (2 * layout.tokens_per_region + 17) * layout.entry_bytes
    assert (flat[at:at + layout.entry_bytes] == entry).all()
    region.free()
"""


def test_the_readme_pool_example():
    exec(compile(README_POOL_EXAMPLE, "README_POOL_EXAMPLE", "exec"), {})


def test_the_readme_pool_example_uses_only_the_public_api():
    assert "kvtier._" not in README_POOL_EXAMPLE and "from kvtier" not in README_POOL_EXAMPLE
    assert all(hasattr(kvtier, name) for name in ("Layout", "Pool", "device_bytes_for"))
