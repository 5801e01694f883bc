"""Tables in shared memory from Python: load, resume, publish, attach,
destroy; bad arguments refused with kvtier's own errors."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import kvtier


@pytest.fixture
def store():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield d


def test_a_table_loads_resumes_publishes_and_is_attached_read_only(store):
    key = "model/engram.0 [3 x 2 MiB + 5] test"
    path = kvtier.table_path(store, key)
    assert path.startswith(store) and path.endswith(".table")
    data = (np.arange((6 << 20) + 5, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)
    loader = kvtier.load_table(path, key, data.nbytes)
    assert loader.missing() == [(0, data.nbytes)]
    loader.write(0, data[: 2 << 20])
    with pytest.raises(kvtier.KvtierError) as e:
        loader.publish()
    assert e.value.status == "POOL_ERROR" and "not written yet" in e.value.message
    loader.close()  # as a loader that stopped
    with pytest.raises(kvtier.KvtierError) as e:
        kvtier.Table.attach(path, key, wait=0)
    assert "1 of 4 chunks written" in e.value.message
    loader = kvtier.load_table(path, key, data.nbytes)
    assert loader.missing() == [(2 << 20, data.nbytes)]
    for start, end in loader.missing():
        loader.write(start, data[start:end])
    loader.publish()
    loader.close()
    assert kvtier.load_table(path, key, data.nbytes) is None  # loaded already
    with kvtier.Table.attach(path, key) as t:
        view = t.numpy()
        assert t.nbytes == data.nbytes and np.array_equal(view, data)
        assert not view.flags.writeable
        assert t.numpy("uint8", (1, data.nbytes)).shape == (1, data.nbytes)
        with pytest.raises(kvtier.KvtierError):
            kvtier.destroy_table(path)  # a reader holds it
    with pytest.raises(kvtier.KvtierError) as e:
        t.numpy()
    assert "closed" in e.value.message
    kvtier.destroy_table(path)
    assert not os.path.exists(path)


def test_another_process_attaches_without_loading(store):
    key = "model/engram.1"
    path = kvtier.table_path(store, key)
    loader = kvtier.load_table(path, key, 4096)
    loader.write(0, bytes(range(256)) * 16)
    loader.publish()
    loader.close()
    code = (
        "import kvtier, sys\n"
        f"t = kvtier.Table.attach({path!r}, {key!r})\n"
        "assert bytes(t.numpy()[:256]) == bytes(range(256))\n"
        f"assert kvtier.load_table({path!r}, {key!r}, 4096) is None\n"
        "print('attached', t.nbytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and "attached 4096" in out.stdout, out.stderr
    kvtier.destroy_table(path)


def test_bad_arguments_raise_kvtier_errors(store):
    path = os.path.join(store, "t.table")
    for args in [(path, "", 1), (path, "k", 0), (path, "k", -1), (None, "k", 1), (path, 3, 1)]:
        with pytest.raises(kvtier.KvtierError):
            kvtier.load_table(*args)
    with pytest.raises(kvtier.KvtierError):
        kvtier.load_table(path, "k", 1, wait=-1)
    loader = kvtier.load_table(path, "k", 100)
    with pytest.raises(kvtier.KvtierError) as e:
        loader.write(90, b"x" * 20)
    assert "runs past" in e.value.message
    with pytest.raises(kvtier.KvtierError):
        loader.write(0, np.zeros((4, 4), dtype=np.uint8)[:, 1])  # not contiguous
    loader.close()
    with pytest.raises(kvtier.KvtierError):
        loader.write(0, b"x")  # closed
    with pytest.raises(kvtier.KvtierError) as e:
        kvtier.Table.attach(path, "another key", wait=0)
    assert "holds the table" in e.value.message
