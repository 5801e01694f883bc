"""SGLang HiCache's storage tier on a kvtier prefix store (SGLang 0.5.21 to
0.5.23): the KV pages of prefixes, in one shared-memory file that every SGLang
instance of the host opens, so an instance finds the prefixes another one (or
its own earlier run) computed, with no server and no file per page.

Launch with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang.hicache", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "capacity": "64GiB"}'

Extra config keys of its own: ``directory`` (where the store's file goes, on
tmpfs; default ``/dev/shm``), ``capacity`` (the store's size when it is made:
bytes, or a string such as ``"64GiB"``; default 4 GiB) and ``wait`` (seconds
to wait for another process making the store, default 30).
With ``interface_v1`` SGLang calls the zero-copy methods: a page moves in
one copy between the store and the host-pool pages SGLang chose.

What one store holds is fixed by its namespace: the model, the host pool's
class, layout, dtype, page geometry, and the byte order of a page (the host
pool's zero-copy parts with ``interface_v1``, SGLang's flat pages without:
they differ in some layouts). Instances that differ in any of them use
different files (named by a hash of the namespace), so pages are only ever
read back in the order they were written in: launch every instance alike.
Tensor-parallel ranks of an MHA model keep their own pages (their shards
differ); MLA ranks share one. The store is one host's: hosts sharing a CXL device have no common
lock, so do not point two hosts at one file.

It serves the KV pool, through SGLang's v1 interface and its older
``batch_get``/``batch_set``; models whose HiCache registers further pools
(DSA indexer caches, Mamba or SWA state) are refused when they register one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .._lib import KvtierError
from .._prefix import MAX_KEY_BYTES, PrefixStore, pack_keys

logger = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "/dev/shm"
DEFAULT_CAPACITY = 4 << 30
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_capacity(value) -> int:
    """Bytes from an int or a string such as ``"64GiB"``, ``"500MB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", str(value), re.IGNORECASE)
    if not m or isinstance(value, bool):
        raise KvtierError(f"invalid argument `capacity`: {value!r} is not a size such as 64GiB")
    n = int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if n <= 0:
        raise KvtierError(f"invalid argument `capacity`: {value!r} is not a positive size")
    return n


HASHED = "sha256:"


def store_key(key: str, suffix: str) -> str:
    """The store's key for SGLang's page key `key`: the key and this rank's
    `suffix`; or, where that is no plain short text (it holds a NUL, is not
    UTF-8, is longer than the store takes, or starts like a hashed key),
    ``sha256:`` and the hash of it, so no two keys ever share a page."""
    full = f"{key}{suffix}"
    try:
        raw = full.encode()
    except UnicodeEncodeError:
        raw = None
    if raw is None or b"\0" in raw or not 0 < len(raw) <= MAX_KEY_BYTES or full.startswith(HASHED):
        return HASHED + hashlib.sha256(full.encode("utf-8", "surrogatepass")).hexdigest()
    return full


def packed_plain_keys(keys: List[str], suffix: str) -> Optional[bytes]:
    """The keys, each with `suffix` and a NUL, packed as the store takes them,
    where every one is its own store key (the common case: SGLang's hex page
    hashes), told by a few scans of the joined keys rather than a Python step
    a key; None where one is not (see :func:`store_key`)."""
    if not keys:
        return b""
    sep = suffix + "\0"
    joined = sep.join(keys) + sep
    if (
        joined.isascii()
        and joined.count("\0") == len(keys)
        and ("\0" + joined).find("\0" + HASHED) < 0
        and 0 < min(map(len, keys))
        and max(map(len, keys)) + len(suffix) <= MAX_KEY_BYTES
    ):
        return joined.encode("ascii")
    return None


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a kvtier :class:`~kvtier.PrefixStore`
    (built by SGLang's dynamic backend factory as ``cls(storage_config,
    kwargs)``; the store opens when SGLang registers its host pool)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.directory = str(extra.get("directory", DEFAULT_DIRECTORY))
        self.capacity = parse_capacity(extra.get("capacity", DEFAULT_CAPACITY))
        wait = extra.get("wait", 30)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 86400:
            raise KvtierError(f"invalid argument `wait`: {wait!r} is not a number of seconds in 0..=86400")
        self.wait = float(wait)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        c = storage_config
        # Which pages this rank may share: MLA's are the same on every TP
        # rank; MHA's are each rank's own heads. Pipeline stages and context
        # parallel ranks hold different layers or slices.
        shard = ""
        if c.pp_size > 1:
            shard += f"@pp{c.pp_rank}/{c.pp_size}"
        if getattr(c, "attn_cp_size", 1) > 1:
            shard += f"@cp{c.attn_cp_rank}/{c.attn_cp_size}"
        if getattr(c, "dcp_size", 1) > 1:
            shard += f"@dcp{c.dcp_rank}/{c.dcp_size}@page{c.logical_page_size}"
        self.suffix = shard if c.is_mla_model else f"@tp{c.tp_rank}/{c.tp_size}{shard}"
        self.model = c.model_name or ""
        self.store: Optional[PrefixStore] = None
        self.mem_pool_host = None
        self._parts = 0  # a page's parts in get_page_buffer_meta; 0: the copying path

    # -- setup ---------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        if self.store is not None:  # registered again (a re-attach): the new pool's store
            self.store.close()
            self.store = None
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        page = int(pool.page_size)
        first = torch.arange(page, dtype=torch.int64)
        parts = 0
        if self.interface_v1:
            # SGLang's zero-copy calls: a page is the host pool's parts for
            # it, in the pool's order, copied straight in and out
            try:
                ptrs, sizes = pool.get_page_buffer_meta(first)
                sizes = [int(x) for x in sizes]
                if len(ptrs) and len(sizes) == len(ptrs):
                    parts = len(ptrs)
            except (NotImplementedError, ValueError, AttributeError, AssertionError, TypeError):
                pass
        if parts:
            page_bytes = sum(sizes)
            order = "parts=" + ",".join(str(x) for x in sizes[:8]) + f"x{parts}"
        else:
            # flat pages, SGLang's get_data_page order (which differs from the
            # parts' order in some layouts: the two never share a store)
            try:
                dummy = pool.get_dummy_flat_data_page()
                pool.get_data_page(0, flat=True)
            except Exception as e:
                raise KvtierError(
                    f"kvtier's HiCache backend cannot serve this host pool ({type(pool).__name__}, layout "
                    f"{getattr(pool, 'layout', '?')}): it has no page pointers and no flat pages ({e})"
                ) from e
            page_bytes = dummy.numel() * dummy.element_size()
            order = f"flat={tuple(dummy.shape)}"
        self._parts = parts
        shape = ",".join(
            f"{a}={getattr(pool, a)}"
            for a in ("head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim")
            if isinstance(getattr(pool, a, None), int)
        )
        namespace = "|".join(
            [
                "sglang-hicache",
                self.model or "unnamed-model",
                type(pool).__name__,
                f"layout={getattr(pool, 'layout', '?')}",
                f"dtype={getattr(pool, 'dtype', '?')}",
                f"page={page}",
                f"layers={getattr(pool, 'layer_num', '?')}",
                shape,
                order,
                "mla" if self.config.is_mla_model else "mha",
            ]
        )
        name = "kvtier-hicache-" + hashlib.sha256(namespace.encode()).hexdigest()[:16]
        self.path = os.path.join(self.directory, name)
        slots = max(1, self.capacity // page_bytes)
        self.store = PrefixStore.open(self.path, namespace, page_bytes, slots, wait=self.wait)
        logger.info(
            "kvtier HiCache store %s: %d pages of %d B (%s), %s copies",
            self.path,
            self.store.slots,
            page_bytes,
            namespace,
            "zero-copy" if parts else "flat-page",
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if str(host_pool_name) in ("kv", "__default__"):
            return super().register_mem_host_pool_v2(host_pool, host_pool_name)
        raise KvtierError(
            f"kvtier's HiCache backend serves the KV pool only; this model also registers the "
            f"{host_pool_name!s} pool (DSA indexer, Mamba or SWA state): use another storage backend for it"
        )

    def _store(self) -> PrefixStore:
        if self.store is None:
            raise KvtierError("kvtier's HiCache backend has no host pool registered yet")
        return self.store

    def _packed(self, keys: List[str]):
        """The store keys of `keys`, packed as the store takes them, and their
        number: one join where every key is plain (see
        :func:`packed_plain_keys`), else each one's :func:`store_key`."""
        packed = packed_plain_keys(keys, self.suffix)
        if packed is None:
            packed, _ = pack_keys([store_key(k, self.suffix) for k in keys])
        return packed, len(keys)

    def _flat_only(self, what: str) -> None:
        if self._parts:
            raise KvtierError(
                f"{what}: this backend was set up for SGLang's zero-copy calls (interface_v1), whose pages are "
                "laid out as the host pool's parts; flat pages may be laid out otherwise, so they go to a "
                "store of their own: launch without interface_v1 for them"
            )

    # -- lookups ---------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        return self._store().hits_packed(*self._packed(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the zero-copy interface (interface_v1) ---------------------------------

    def _page_size_for(self, n: int, host_indices: torch.Tensor) -> int:
        """The host pool's page size, once `host_indices` is found to hold
        `n` pages of it."""
        page = int(self.mem_pool_host.page_size)
        if host_indices is None or host_indices.numel() != n * page:
            raise KvtierError(
                f"{n} keys need {n * page} host indices (pages of {page}), not "
                f"{None if host_indices is None else host_indices.numel()}"
            )
        return page

    def _page_parts(self, n: int, host_indices: torch.Tensor):
        self._page_size_for(n, host_indices)
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != n * self._parts:
            raise KvtierError(f"the host pool gave {len(ptrs)} parts for {n} pages; {self._parts} a page expected")
        return ptrs, sizes

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if not self._parts:
            return self._flat_get(keys, host_indices)
        ptrs, sizes = self._page_parts(len(keys), host_indices)
        return self._store().get_packed(*self._packed(keys), ptrs, sizes, self._parts)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if not self._parts:
            return self._flat_set(keys, host_indices)
        ptrs, sizes = self._page_parts(len(keys), host_indices)
        outcomes = self._store().set_packed(*self._packed(keys), ptrs, sizes, self._parts)
        return [o != "full" for o in outcomes]

    def _flat_get(self, keys, host_indices) -> List[bool]:
        pool = self.mem_pool_host
        page = self._page_size_for(len(keys), host_indices)
        out = []
        for i, key in enumerate(keys):
            got = self.get(key, pool.get_dummy_flat_data_page())
            if got is not None:
                pool.set_from_flat_data_page(int(host_indices[i * page]), got)
            out.append(got is not None)
        return out

    def _flat_set(self, keys, host_indices) -> List[bool]:
        pool = self.mem_pool_host
        page = self._page_size_for(len(keys), host_indices)
        return [self.set(key, pool.get_data_page(int(host_indices[i * page]), flat=True)) for i, key in enumerate(keys)]

    # -- the older interface: whole flat pages as tensors ------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        store = self._store()
        self._flat_only("get")
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        t = target_location
        if not t.is_contiguous() or t.device.type != "cpu" or t.numel() * t.element_size() != store.page_bytes:
            raise KvtierError(f"the target must be a contiguous CPU tensor of {store.page_bytes} B")
        found = store.get_packed(*self._packed([key]), [t.data_ptr()], [store.page_bytes])
        return t if found[0] else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        store = self._store()
        self._flat_only("set")
        v = value.contiguous()
        if v.device.type != "cpu" or v.numel() * v.element_size() != store.page_bytes:
            raise KvtierError(f"the value must be a CPU tensor of {store.page_bytes} B")
        return store.set_packed(*self._packed([key]), [v.data_ptr()], [store.page_bytes])[0] != "full"

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return all([self.set(k, v) for k, v in zip(keys, values)])  # every page tried

    # -- the rest --------------------------------------------------------------

    def clear(self) -> None:
        """Evicts every page no reader holds: every instance's, since the store
        is shared (as SGLang's file backend's clear empties its directory)."""
        if self.store is not None:
            self.store.clear()

    def counters(self) -> dict:
        """The store's counters (every process's together); see
        :meth:`kvtier.PrefixStore.counters`."""
        return self._store().counters()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
