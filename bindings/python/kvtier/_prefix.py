"""A prefix store: fixed-size pages under string keys in one shared-memory
file that every process of a host opens (the library's
``kvtier::prefix_store``, through its C ABI). A page one process sets, every
other process finds, and so does a restarted one: the key index is in the
file, with no server.

    store = kvtier.PrefixStore.open("/dev/shm/kvtier-prefix", "my-model/bf16", page_bytes, slots=1024)
    store.set_bytes("page-key", data)             # "stored", "present" or "full"
    store.get_bytes("page-key")                   # the page, or None
    store.hits(["k0", "k1", "k2"])                # how many, from the first, it holds

:meth:`PrefixStore.get` and :meth:`PrefixStore.set` copy pages straight
between the store and memory the caller names by address (SGLang's host
pool), a page's bytes laid end to end over its parts.
"""

from __future__ import annotations

import ctypes
import os

from ._lib import KvtierError, as_c_text, as_int, check, library
from ._pool import _Closable

#: The longest page key, in bytes.
MAX_KEY_BYTES = 200
#: What a set did, by the library's KVT_PREFIX_* value.
OUTCOMES = ("stored", "present", "full")
#: The counters :meth:`PrefixStore.counters` reads, in the library's order.
COUNTERS = ("sets", "hits", "misses", "evictions", "reclaimed", "full", "pages")


def pack_keys(keys, suffix: str = "") -> tuple:
    """`keys` (a list of str), each with `suffix` appended, packed as the
    library takes them: each key's UTF-8 bytes and a NUL, back to back; and
    their number. A KvtierError for a key that holds a NUL or cannot be
    UTF-8 (the library refuses one empty or longer than 200 bytes)."""
    if isinstance(keys, (str, bytes)):
        raise KvtierError(f"invalid argument `keys`: {keys!r} is one key, not a list of keys")
    try:
        keys = list(keys)
        sep = suffix + "\0"
        packed = (sep.join(keys) + sep).encode()
    except TypeError:
        raise KvtierError(f"invalid argument `keys`: {keys!r} is not a list of str") from None
    except UnicodeEncodeError as e:
        raise KvtierError(f"invalid argument `keys`: a key is not valid UTF-8 text ({e.reason})") from None
    if "\0" in suffix or packed.count(b"\0") != len(keys):
        raise KvtierError("invalid argument `keys`: a key holds a NUL character, which a C string cannot carry")
    return packed, len(keys)


def _u64s(values, name: str, n: int):
    """`values` (a sequence of ints, or a contiguous uint64 numpy array) as
    a pointer to `n` u64s, and what keeps it alive."""
    if hasattr(values, "ctypes") and hasattr(values, "dtype"):
        if str(values.dtype) != "uint64" or not values.flags["C_CONTIGUOUS"] or values.size != n:
            raise KvtierError(f"invalid argument `{name}`: a numpy array must be {n} contiguous uint64s")
        return ctypes.c_void_p(values.ctypes.data), values
    try:
        values = list(values)
    except TypeError:
        raise KvtierError(f"invalid argument `{name}`: {values!r} is not a sequence of ints") from None
    if len(values) != n:
        raise KvtierError(f"invalid argument `{name}`: {len(values)} values; the call needs {n}")
    try:
        arr = (ctypes.c_uint64 * n)(*values)
    except (TypeError, OverflowError):
        raise KvtierError(f"invalid argument `{name}`: every value must be an int in 0..2^64") from None
    return ctypes.cast(arr, ctypes.c_void_p), arr


class PrefixStore(_Closable):
    """A prefix store this process has open; see :meth:`open`. Threads may
    share it."""

    _GONE = "this PrefixStore was closed"
    _FREE = "kvt_prefix_close"

    def __init__(self, handle: ctypes.c_void_p, path: str, namespace: str):
        self._init_handle(handle)
        self.path = path
        self.namespace = namespace
        page, slots, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        self._call(library().kvt_prefix_info, ctypes.byref(page), ctypes.byref(slots), ctypes.byref(size))
        #: The bytes of one page, the slots the store has, the file's size.
        self.page_bytes, self.slots, self.file_bytes = page.value, slots.value, size.value

    @classmethod
    def open(cls, path, namespace: str, page_bytes: int, slots: int, wait: float = 30.0) -> "PrefixStore":
        """Opens the store at `path` (a file on tmpfs), making it
        with `slots` slots of `page_bytes` when missing. An existing store must
        hold pages of the same `namespace` and `page_bytes`; its slot count is
        its own. A file that is not a prefix store is refused, never written."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise KvtierError(f"invalid argument `path`: {path!r} is not a path")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 86400:
            raise KvtierError(f"invalid argument `wait`: {wait!r} is not a number of seconds in 0..=86400")
        h = ctypes.c_void_p()
        check(
            library().kvt_prefix_open(
                as_c_text(os.fsencode(path), "path"),
                as_c_text(namespace, "namespace"),
                as_int(page_bytes, "page_bytes", 1, 2**40),
                as_int(slots, "slots", 1, 2**30),
                int(wait * 1000),
                ctypes.byref(h),
            )
        )
        return cls(h, os.fsdecode(path), namespace)

    def hits(self, keys, suffix: str = "") -> int:
        """How many of `keys` (each with `suffix` appended), from the first,
        the store holds."""
        return self.hits_packed(*pack_keys(keys, suffix))

    def hits_packed(self, packed: bytes, n: int) -> int:
        """:meth:`hits` for keys packed already (see :func:`pack_keys`)."""
        out = ctypes.c_size_t()
        self._call(library().kvt_prefix_hits, packed, len(packed), as_int(n, "n", 0, 2**40), ctypes.byref(out))
        return out.value

    def _pages(self, fn, packed: bytes, n: int, ptrs, lens, parts_per_page: int) -> list:
        n = as_int(n, "n", 0, 2**40)
        parts = as_int(parts_per_page, "parts_per_page", 1, 2**20)
        p, keep_p = _u64s(ptrs, "ptrs", n * parts)
        l, keep_l = _u64s(lens, "lens", n * parts)
        out = (ctypes.c_uint8 * max(n, 1))()
        self._call(fn, packed, len(packed), n, p, l, parts, ctypes.cast(out, ctypes.c_void_p))
        del keep_p, keep_l
        return list(out[:n])

    def get(self, keys, ptrs, lens, parts_per_page: int = 1, suffix: str = "") -> list:
        """Copies each key's page out, over its parts (page i: parts
        ``i*parts_per_page`` onward of `ptrs` and `lens`, addresses and
        bytes adding up to :attr:`page_bytes`); True for each page found.
        The addresses are the caller's promise: writable memory of that size."""
        return self.get_packed(*pack_keys(keys, suffix), ptrs, lens, parts_per_page)

    def get_packed(self, packed: bytes, n: int, ptrs, lens, parts_per_page: int = 1) -> list:
        """:meth:`get` for keys packed already (see :func:`pack_keys`)."""
        return [bool(f) for f in self._pages(library().kvt_prefix_get, packed, n, ptrs, lens, parts_per_page)]

    def set(self, keys, ptrs, lens, parts_per_page: int = 1, suffix: str = "") -> list:
        """Copies each page in and publishes it under its key (laid out as for
        :meth:`get`); per page "stored", "present" (held already, or being
        written by another) or "full" (every slot pinned or being written)."""
        return self.set_packed(*pack_keys(keys, suffix), ptrs, lens, parts_per_page)

    def set_packed(self, packed: bytes, n: int, ptrs, lens, parts_per_page: int = 1) -> list:
        """:meth:`set` for keys packed already (see :func:`pack_keys`)."""
        return [OUTCOMES[o] for o in self._pages(library().kvt_prefix_set, packed, n, ptrs, lens, parts_per_page)]

    def get_bytes(self, key):
        """The page under `key` as bytes, or None."""
        buf = ctypes.create_string_buffer(self.page_bytes)
        found = self.get([key], [ctypes.addressof(buf)], [self.page_bytes])
        return buf.raw if found[0] else None

    def set_bytes(self, key, data) -> str:
        """Publishes `data` (bytes-like, exactly :attr:`page_bytes`) under `key`."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.page_bytes:
            raise KvtierError(f"invalid argument `data`: {view.nbytes} B; a page of this store is {self.page_bytes} B")
        buf = (ctypes.c_char * view.nbytes).from_buffer_copy(view) if view.readonly else (ctypes.c_char * view.nbytes).from_buffer(view)
        return self.set([key], [ctypes.addressof(buf)], [self.page_bytes])[0]

    def counters(self) -> dict:
        """The store's counters, for every process together: pages set, hits,
        misses, evictions, slots a killed process left and taken back, sets
        refused as full, and pages held now."""
        out = (ctypes.c_uint64 * len(COUNTERS))()
        self._call(library().kvt_prefix_counters, out, len(COUNTERS))
        return dict(zip(COUNTERS, out))

    def clear(self) -> int:
        """Evicts every page no reader holds now; how many."""
        n = ctypes.c_uint64()
        self._call(library().kvt_prefix_clear, ctypes.byref(n))
        return n.value
