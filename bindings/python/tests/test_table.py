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


def test_a_nul_in_a_key_path_or_device_is_refused_not_cut_off(store):
    """A C string ends at its first NUL: "model-A\\0v2" would have attached
    the table loaded as "model-A\\0v1" (both "model-A" to the library)."""
    path = os.path.join(store, "t.table")
    with pytest.raises(kvtier.KvtierError, match="NUL"):
        kvtier.load_table(path, "model-A\0v1", 8)
    loader = kvtier.load_table(path, "model-A-v1", 8)
    for call in [lambda: kvtier.Table.attach(path, "model-A\0v2", wait=0),
                 lambda: kvtier.load_table(path, "model-A\0v2", 8),
                 lambda: kvtier.load_table(path + "\0.other", "k", 8),
                 lambda: kvtier.table_path(store, "model-A\0v2"),
                 lambda: kvtier.destroy_table(path + "\0x"),
                 lambda: kvtier.device_capacity("file:/dev/shm/x\0:1MiB"),
                 lambda: kvtier.Pool.create(kvtier.Layout(16, 2, 16), ["anon:4MiB\0numa:1"])]:
        with pytest.raises(kvtier.KvtierError, match="NUL"):
            call()
    assert kvtier.table_path(store, "model-A-v1") != kvtier.table_path(store, "model-A-v2")
    loader.close()


def test_what_stands_at_a_tables_path_is_never_waited_on_nor_destroyed_unless_a_table(store):
    """A FIFO at a key's predictable path (it hung attach, status and the
    SGLang shim) is refused at once; destroy removes only a kvtier table."""
    import time

    fifo = os.path.join(store, "fifo.table")
    os.mkfifo(fifo)
    t0 = time.monotonic()
    for call in [lambda: kvtier.Table.attach(fifo, "k", wait=30), lambda: kvtier.load_table(fifo, "k", 8),
                 lambda: kvtier.destroy_table(fifo)]:
        with pytest.raises(kvtier.KvtierError, match="FIFO"):
            call()
    assert time.monotonic() - t0 < 10 and os.path.exists(fifo)
    other = os.path.join(store, "notes.txt")
    with open(other, "w") as f:
        f.write("another program's file")
    with pytest.raises(kvtier.KvtierError, match="not a kvtier table"):
        kvtier.destroy_table(other)
    assert open(other).read() == "another program's file"
    with pytest.raises(kvtier.KvtierError, match="a table holds 1 to"):
        kvtier.load_table(os.path.join(store, "huge.table"), "k", 2**64 - 2**21)
    assert not os.path.exists(os.path.join(store, "huge.table"))
