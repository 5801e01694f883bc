"""Tables in shared memory: large read-only arrays (DeepSeek-V4.1's Engram
tables and the like) loaded once per host and attached by every process (the
library's ``kvtier::table``, through its C ABI).

    loader = kvtier.load_table(path, key, nbytes)   # None: loaded already
    if loader is not None:
        for start, end in loader.missing():           # all of it, or what a killed loader left
            loader.write(start, source[start:end])
        loader.publish()
        loader.close()                                # readers may attach now
    table = kvtier.Table.attach(path, key)
    rows = table.numpy()                              # read-only, no copy
"""

from __future__ import annotations

import ctypes
import os


from ._lib import KvtierError, as_c_text, as_int, check, library
from ._pool import _Closable


def _text(value, name: str) -> bytes:
    if not isinstance(value, (str, bytes)) or not value:
        raise KvtierError(f"invalid argument `{name}`: {value!r} is not a non-empty string")
    return as_c_text(value, name)


def _path(value, name: str = "path") -> bytes:
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise KvtierError(f"invalid argument `{name}`: {value!r} is not a path")
    return _text(os.fsencode(value), name)


def _wait_ms(wait: float) -> int:
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 86400:
        raise KvtierError(f"invalid argument `wait`: {wait!r} is not a number of seconds in 0..=86400")
    return int(wait * 1000)


def table_path(store: str, key: str) -> str:
    """The file of `key` in the table directory `store` (one file a key)."""
    d, k = _path(store, "store"), _text(key, "key")
    needed = ctypes.c_size_t()
    library().kvt_table_store_path(d, k, None, 0, ctypes.byref(needed))
    buf = ctypes.create_string_buffer(needed.value)
    check(library().kvt_table_store_path(d, k, buf, needed.value, ctypes.byref(needed)))
    return buf.value.decode()


def load_table(path: str, key: str, nbytes: int, wait: float = 30.0) -> "TableLoader | None":
    """Opens or makes the table `key` of `nbytes` bytes at `path` for
    loading (waiting at most `wait` seconds for another process's lock):
    None when it is loaded already, else a :class:`TableLoader` holding the
    exclusive lock."""
    nbytes = as_int(nbytes, "nbytes", 1, 2**64 - 1)
    h = ctypes.c_void_p()
    check(library().kvt_table_load(_path(path), _text(key, "key"), nbytes, _wait_ms(wait), ctypes.byref(h)))
    return TableLoader(h, nbytes) if h else None


class TableLoader(_Closable):
    """A table being filled. Closing it without :meth:`publish` leaves a
    table the next loader resumes (only the missing chunks written)."""

    _GONE = "this TableLoader was closed"
    _FREE = "kvt_table_loader_close"

    def __init__(self, handle: ctypes.c_void_p, nbytes: int):
        self._init_handle(handle)
        self.nbytes = nbytes

    def missing(self) -> list:
        """The byte ranges ``(start, end)`` not written yet, in order."""
        out, at = [], 0
        a, b = ctypes.c_uint64(), ctypes.c_uint64()
        while True:
            self._call(library().kvt_table_loader_next_missing, at, ctypes.byref(a), ctypes.byref(b))
            if a.value == b.value:
                return out
            out.append((a.value, b.value))
            at = b.value

    def write(self, offset: int, data) -> None:
        """Copies `data` (bytes, or any C-contiguous buffer such as a numpy
        array) to the table at `offset`."""
        offset = as_int(offset, "offset", 0, 2**64 - 1)
        view = memoryview(data)
        if not view.c_contiguous:
            raise KvtierError("invalid argument `data`: not C-contiguous")
        view = view.cast("B")
        n = view.nbytes
        if n == 0:
            return
        if view.readonly:
            buf = (ctypes.c_uint8 * n).from_buffer_copy(view)
        else:
            buf = (ctypes.c_uint8 * n).from_buffer(view)
        self._call(library().kvt_table_loader_write, offset, buf, n)

    def publish(self) -> None:
        """Marks the table READY (refused while bytes are missing); then
        :meth:`close` lets readers in."""
        self._call(library().kvt_table_loader_publish)



class Table(_Closable):
    """A loaded table attached for reading (a shared lock held until
    :meth:`close`)."""

    _GONE = "this Table was closed"
    _FREE = "kvt_table_close"

    def __init__(self, handle: ctypes.c_void_p):
        self._init_handle(handle)
        data, n = ctypes.c_void_p(), ctypes.c_uint64()
        self._call(library().kvt_table_data, ctypes.byref(data), ctypes.byref(n))
        self.address = data.value or 0
        self.nbytes = n.value

    @classmethod
    def attach(cls, path: str, key: str, wait: float = 30.0) -> "Table":
        """Attaches to the READY table `key` at `path`; a table not loaded
        raises, saying how far its load got."""
        h = ctypes.c_void_p()
        check(library().kvt_table_attach(_path(path), _text(key, "key"), _wait_ms(wait), ctypes.byref(h)))
        return cls(h)

    def numpy(self, dtype="uint8", shape=None):
        """The table's bytes as a read-only numpy array of `dtype` (no copy),
        flat or in `shape`; valid while the Table is open."""
        import numpy as np  # optional: kvtier depends on neither numpy nor torch

        if not self._open:
            raise KvtierError(self._GONE, "INVALID_ARGUMENT")
        buf = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
        buf._kvtier_table = self  # the mapping lives as long as the table
        arr = np.frombuffer(buf, dtype=np.uint8)
        arr.flags.writeable = False
        arr = arr.view(dtype)
        return arr if shape is None else arr.reshape(shape)



def destroy_table(path: str) -> None:
    """Removes the table file at `path` (refused while a reader or loader holds it)."""
    check(library().kvt_table_destroy(_path(path)))


__all__ = ["Table", "TableLoader", "destroy_table", "load_table", "table_path"]

