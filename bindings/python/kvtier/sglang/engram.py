"""DeepSeek-V4.1's Engram tables in kvtier's table store, and kvtier's Engram
gather under SGLang's signature (SGLang 0.5.23's ``sglang.srt.layers.engram``).

With ``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE`` SGLang keeps each Engram
table in host memory of its own process group (``_HostTable``: rank 0's
memfd for the "shared" layout, opened by the other ranks through
``/proc/<pid>/fd``; a private mapping of the rank's rows for "per_rank") and
writes it from the checkpoint at every start. With ``engram_tables`` in the
kvtier config, :func:`patch` makes each table a file in the configured table
directory instead (a hugetlbfs or tmpfs folder, or a devdax device's), keyed
by the model, the layer, the layout and row range, the shape and dtype, and
a fingerprint of the checkpoint's files:

- the first server on the host writes it (rank 0 all of it in the "shared"
  layout, each rank its rows in "per_rank"); every later start and every
  other instance with the same key finds it READY and writes nothing (the
  checkpoint's tensors are still read by SGLang's weight iterator, which
  kvtier leaves alone, but not copied, page-faulted or collapsed);
- a loader killed part-way leaves a table no one is served and the next
  start resumes it; a different checkpoint is a different key;
- the "shared" layout needs no shared PID namespace: ranks open the file;
- SGLang's own gather (its Triton kernel, in the captured graphs) reads the
  table through the same ``(device_ptr, device_ptr + w_bytes)`` pair, and the
  staging path reads ``weight``/``scale`` as CPU views of the table, as
  before.

:func:`engram_gather` is kvtier's kernel (or CPU executor) with SGLang's
signature; ``install`` puts it in place of SGLang's only when the config
asks (``"gather": true``): on an H200 it was faster than SGLang's Triton
kernel on a table in GPU memory but slower at most sizes reading a host
table in address order, which is how SGLang reads host tables on a GPU
without ATS (``compat.ENGRAM_GATHER_LEFT`` has the figures). It differs
where kvtier is safer: an id inside the rows asked for but past the table
(SGLang passes ``row_hi = 2**62`` for the shared table) reads nothing, gives
a +0 row and is reported.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import sys
import threading
import weakref
from pathlib import Path

from .._lib import KvtierError, check as _check, library
from .._swap_in import native
from .._table import Table, destroy_table, load_table, table_path
from ._config import current_config

logger = logging.getLogger("kvtier")

ENGRAM = "sglang.srt.layers.engram"
ENGRAM_FILE = "sglang/srt/layers/engram.py"
# SGLang's row-range default: "every row", unchecked.
ALL_ROWS = 2**62
# The byte layout of a table (SGLang's: every row's e4m3 bytes, then every
# row's e8m0 bytes); a change of layout is a new key.
TABLE_FORMAT = "v1"
# cudaHostRegisterReadOnly: readers map the table read-only.
_REGISTER_READ_ONLY = 0x08

_tables_lock = threading.Lock()
_table_rows: dict = {}  # weight address -> rows, for the tables kvtier made


def register_table(weight_ptr: int, rows: int) -> None:
    """Tells :func:`engram_gather` that the table whose e4m3 rows start at
    `weight_ptr` holds `rows` rows (what the shim does for each table it
    makes), so that a call with SGLang's unbounded default range is checked
    against the table."""
    with _tables_lock:
        _table_rows[int(weight_ptr)] = int(rows)


def forget_table(weight_ptr: int) -> None:
    with _tables_lock:
        _table_rows.pop(int(weight_ptr), None)


def engram_gather(weight_ptr, scale_ptr, ids, out, dim, block_size, row_lo=0, row_hi=ALL_ROWS, sort_ids=False):
    """SGLang's ``engram_gather`` on kvtier: rows `ids` (``[N]`` int32/int64)
    of the table at `weight_ptr` (``[rows, dim]`` e4m3 bytes of global rows
    ``row_lo..``) and `scale_ptr` (``[rows, dim // block_size]`` e8m0 bytes)
    dequantized into `out` (``[N, dim]`` bf16; a numpy array: uint16 bf16
    bits): ``bf16(f32(w) * 2^(e - 127))``, e == 0 giving 2^-127; an id
    outside ``[row_lo, row_hi)`` gives a +0 row. Returns `out`.

    torch CUDA tensors run kvtier's kernel on the current stream (the table
    in GPU memory or host memory the GPU maps: no host sync, capturable);
    numpy arrays and CPU tensors the CPU executor (the pointers host
    addresses). The table's rows come from :func:`register_table` for the
    tables kvtier made, else from ``row_hi - row_lo`` (SGLang's per-rank,
    device and staged tables pass their own); a call with neither is
    refused rather than read unbounded. An id past the table is reported:
    at once on the CPU (a KvtierError, every row still written), at
    :func:`engram_check` on a GPU. `sort_ids` reads the rows in address
    order, as SGLang's does: the ids are sorted (torch.sort on their device:
    no host sync, capturable; numpy's argsort on the CPU) and each row is
    written to its own place by the kernel (the output is the same)."""
    for name, v in (("weight_ptr", weight_ptr), ("scale_ptr", scale_ptr), ("dim", dim),
                    ("block_size", block_size), ("row_lo", row_lo), ("row_hi", row_hi)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise KvtierError(f"invalid argument `{name}`: {v!r} is not an int")
    if not isinstance(sort_ids, bool):
        raise KvtierError(f"invalid argument `sort_ids`: {sort_ids!r} is not a bool")
    if not 0 < dim <= 2**31 - 1 or not 0 < block_size <= 2**31 - 1:
        raise KvtierError(f"invalid argument `dim`/`block_size`: {dim}, {block_size} are not positive 32-bit ints")
    if not 0 <= row_lo <= row_hi <= 2**63 - 1:
        raise KvtierError(f"invalid argument `row_lo/row_hi`: rows {row_lo}..{row_hi} are not a range of row ids")
    with _tables_lock:
        rows = _table_rows.get(weight_ptr)
    if rows is None and row_hi >= ALL_ROWS:
        raise KvtierError(
            "invalid argument `row_hi`: the table's rows are unknown (it is not one kvtier's shim made, and "
            "row_hi is SGLang's unbounded default); pass row_lo and row_hi, or register_table() it"
        )
    # the table's rows where known, never more than the range asked for
    rows = row_hi - row_lo if rows is None else min(rows, row_hi - row_lo)
    if not 0 <= weight_ptr < 2**64 or not 0 <= scale_ptr < 2**64:
        raise KvtierError("invalid argument `weight_ptr`/`scale_ptr`: not addresses")
    out_rows = None
    if sort_ids:
        ids, out_rows = _sorted(ids)
    native().engram_gather(weight_ptr, scale_ptr, rows, ids, out, dim, block_size, row_lo, row_hi, out_rows)
    return out


def _sorted(ids):
    """(the ids sorted, the int32 permutation that sorted them): what the
    kernel reads in order and where each row goes."""
    torch = _torch()
    if torch is not None and isinstance(ids, torch.Tensor):
        flat = ids.reshape(-1)
        values, order = torch.sort(flat, stable=True)
        return values, order.to(torch.int32)
    import numpy as np

    if not isinstance(ids, np.ndarray):
        return ids, None  # refused by the call, as without sort_ids
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    return np.ascontiguousarray(flat[order]), order.astype(np.int32)


def engram_check(device="cpu") -> None:
    """Raises what the Engram gathers on `device` (a GPU ordinal) recorded
    since the last check: ids past their table (a KvtierError with status
    BAD_INDICES naming the first); waits for the device. The CPU executor
    reports at once."""
    if device == "cpu":
        return
    ordinal = int(device)
    for o, handle in native().engrams():
        if o == ordinal:
            _check(library().kvt_engram_check(ctypes.c_void_p(handle)))


# ---- the table key -----------------------------------------------------------


def checkpoint_fingerprint(model_path: str, revision=None, cache_dir=None) -> str:
    """A fingerprint of the checkpoint at `model_path` (a folder, or a
    Hugging Face id found in the local cache): each weight and index file's
    name and content hash where the cache names its blob by it, else its
    size and modification time. Raises KvtierError when no file is found
    (give ``engram_tables.fingerprint`` instead)."""
    folder = Path(model_path)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model_path, revision=revision, cache_dir=cache_dir,
                                            local_files_only=True))
        except Exception as e:  # noqa: BLE001 - not in the cache, or no huggingface_hub
            raise KvtierError(
                f"engram tables: cannot find the checkpoint of {model_path!r} on this machine to fingerprint it "
                f"({e}); set engram_tables.fingerprint in the kvtier config"
            ) from e
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name.endswith(".safetensors") or p.name.endswith(".index.json") or p.name == "config.json"))
    if not any(p.name.endswith(".safetensors") for p in files):
        raise KvtierError(f"engram tables: no .safetensors files in {folder} to fingerprint; set "
                          "engram_tables.fingerprint in the kvtier config")
    h = hashlib.sha256()
    for p in files:
        blob = Path(os.path.realpath(p)).name
        if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):
            ident = f"sha256:{blob}"  # the Hugging Face cache names a blob by its content
        else:
            st = p.stat()
            ident = f"{st.st_size}:{st.st_mtime_ns}"
        h.update(f"{p.name}={ident}\n".encode())
    return h.hexdigest()[:32]


def table_key(fingerprint: str, layer_id: int, layout: str, first_row: int, rows: int, dim: int, block: int,
              rank: int) -> str:
    """The key of one layer's table: what it holds and where it came from.
    A per-rank table is that rank's rows; a shared one all rows."""
    part = "all" if layout == "shared" else f"rank{rank}:{first_row}+{rows}"
    return (f"sglang-engram/{TABLE_FORMAT}/{fingerprint}/layer{layer_id}/{layout}/{part}/{rows}x{dim}/"
            f"e4m3+e8m0b{block}")


# ---- the table -------------------------------------------------------------------


class KvtierEngramTable:
    """Stands in for SGLang's ``_HostTable``: one layer's table, a file in
    the table directory. ``layout``, ``nbytes``, ``dirty``, ``device_ptr``,
    ``bytes`` (a uint8 CPU tensor over it, once mapped) and
    ``finish_load(label)`` are SGLang's. Nothing is locked at construction
    (a model built and dropped, as SGLang's meta-device structure pass does,
    holds nothing): a table READY under the key is mapped at once, else the
    first write opens it for loading (waiting for another process loading
    the same key, then attaching to what it published or resuming what it
    left)."""

    def __init__(self, layout: str, nbytes: int, key: str, store: str, group, writes: bool, wait_s: float):
        if layout not in ("shared", "per_rank"):
            raise ValueError(f"Invalid SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT={layout!r}; expected 'shared' or "
                             "'per_rank'")
        self.layout, self.nbytes, self.key, self.group = layout, nbytes, key, group
        self.store, self.path = store, table_path(store, key)
        self.writes, self.wait_s = writes, wait_s
        self.dirty = False
        self.loader = None
        self.table = None
        self.bytes = None
        self.device_ptr = 0
        self.written_bytes = 0
        self.loaded = False  # finish_load has run
        self._opened = False
        self._missing = []
        self._registered = False
        if Path(self.path).exists() and not _default_device_is_meta():
            try:
                self._attach(wait=0)
            except KvtierError:
                pass  # not READY, or being loaded: the first write decides

    @property
    def ready(self) -> bool:
        return self.table is not None

    def write(self, offset: int, data) -> None:
        """Writes the bytes of `data` (a contiguous uint8 numpy array) at
        `offset`, where the table still misses them; nothing when it is
        READY or another rank writes it."""
        if self.loaded:
            raise KvtierError(
                f"engram table {self.key}: weights loaded after the table was finished (a weight update); kvtier's "
                "tables are loaded once per checkpoint and read-only after, so an update is refused rather than "
                "ignored: restart with the new checkpoint (it gets its own table)")
        if self.table is not None or not self.writes:
            return
        if not self._opened:
            Path(self.store).mkdir(parents=True, exist_ok=True)
            self.loader = load_table(self.path, self.key, self.nbytes, wait=self.wait_s)
            self._opened = True
            if self.loader is None:  # another process finished it meanwhile
                self._attach(wait=self.wait_s)
                return
            self._missing = self.loader.missing()
        end = offset + data.nbytes
        for a, b in self._missing:
            lo, hi = max(a, offset), min(b, end)
            if lo < hi:
                self.loader.write(lo, data[lo - offset:hi - offset])
                self.written_bytes += hi - lo
        self.dirty = True

    def _attach(self, wait: float) -> None:
        torch = _torch()
        self.table = Table.attach(self.path, self.key, wait=wait)
        self.device_ptr = self.table.address
        raw = (ctypes.c_uint8 * self.table.nbytes).from_address(self.table.address)
        raw._kvtier_table = self.table  # the mapping lives as long as the views
        self.bytes = torch.frombuffer(raw, dtype=torch.uint8)

    def _register(self) -> None:
        torch = _torch()
        if self._registered or torch is None or not torch.cuda.is_available():
            return
        err = torch.cuda.cudart().cudaHostRegister(self.table.address, self.table.nbytes, _REGISTER_READ_ONLY)
        if int(err) != 0:
            raise KvtierError(f"engram table {self.key}: cudaHostRegister(read-only, {self.table.nbytes} bytes) "
                              f"failed: {err}")
        self._registered = True

    def finish_load(self, label: str) -> None:
        """SGLang's call after loading (collective in the shared layout):
        publishes what this process wrote, then every rank attaches and
        registers the table with CUDA."""
        failure = None
        if self.loader is not None:
            missing = self.loader.missing()
            if missing:
                total = sum(b - a for a, b in missing)
                failure = (f"engram table {label} ({self.key}): {total} of {self.nbytes} bytes were never written by "
                           "the checkpoint; the table is left unpublished (the next start resumes it)")
            else:
                try:
                    self.loader.publish()
                except KvtierError as e:
                    failure = f"engram table {label} ({self.key}): {e}"
            self.loader.close()
            self.loader = None
        if self.layout == "shared" and self.group is not None and getattr(self.group, "world_size", 1) > 1:
            # rank 0's outcome to every rank, after its publish: the others
            # attach to a published table or raise with it, none waits
            failure = self.group.broadcast_object(failure, src=0)
        if failure:
            raise KvtierError(failure)
        if self.table is None:
            self._attach(wait=self.wait_s)
        self._register()
        how = (f"written from the checkpoint ({self.written_bytes} bytes)" if self.dirty
               else "attached (loaded before: nothing written)")
        logger.info("kvtier: engram table %s: layout=%s, %d bytes at %s, %s", label, self.layout, self.nbytes,
                    self.path, how)
        self.dirty = False
        self.loaded = True


def _default_device_is_meta() -> bool:
    torch = _torch()
    try:
        return torch is not None and torch.empty(0).device.type == "meta"
    except Exception:  # noqa: BLE001 - an odd default device: treat as real
        return False


def _torch():
    return sys.modules.get("torch")


# ---- patching SGLang's EngramEmbedding ------------------------------------------------


def _bind_params(embed, table: KvtierEngramTable) -> None:
    """Points the layer's ``weight``/``scale`` at the table: CPU views (no
    copy) of the READY table, or, while it is being written, shape-only
    placeholders (SGLang's weight loader hands them back to ours, which
    writes through the loader)."""
    torch = _torch()
    module = embed._kvtier_module
    n, dim, w_bytes = embed._kvtier_shape
    blocks = dim // module.FP8_BLOCK_SIZE
    if table.ready:
        flat = table.bytes
        weight = flat[:w_bytes].view(torch.float8_e4m3fn).view(n, dim)
        scale = flat[w_bytes:w_bytes + n * blocks].view(torch.float8_e8m0fnu).view(n, blocks)
        embed._host_table_ptrs = (table.device_ptr, table.device_ptr + w_bytes)
        register_table(table.device_ptr, n)
        weakref.finalize(table.table, forget_table, table.device_ptr)
    else:
        weight = torch.empty(n, dim, dtype=torch.float8_e4m3fn, device="meta")
        scale = torch.empty(n, blocks, dtype=torch.float8_e8m0fnu, device="meta")
        embed._host_table_ptrs = (0, 0)
    loader = getattr(embed, "_load_rows", None)
    embed.weight = torch.nn.Parameter(weight, requires_grad=False)
    embed.scale = torch.nn.Parameter(scale, requires_grad=False)
    embed.weight.weight_loader = loader
    embed.scale.weight_loader = loader


def _sorted_reads(module) -> bool:
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return False
    query = getattr(module, "_sorted_host_reads", None)  # SGLang 0.5.23's; 0.5.21-0.5.22 read unsorted
    if query is None:
        return False
    try:
        return bool(query(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - SGLang's query failing means unsorted, as in SGLang
        return False


def _init_host_table(self, num_embeddings: int, dim: int, layer_id: int):
    """kvtier's ``EngramEmbedding._init_host_table``: the table in kvtier's
    store (see the module's documentation)."""
    module = self._kvtier_module
    cfg = current_config()
    tables = cfg.engram_tables
    layout = module.envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.get()
    parallel = module.get_parallel()
    group = parallel.tp_group
    rank = getattr(group, "rank_in_group", 0)
    n = num_embeddings if layout == "shared" else self.rows
    if n == 0:
        # an empty shard: SGLang's own one-byte table (nothing to share)
        return module._kvtier_originals["EngramEmbedding._init_host_table"](self, num_embeddings, dim, layer_id)
    w_bytes = n * dim
    s_bytes = n * (dim // module.FP8_BLOCK_SIZE)
    if layout == "shared" and getattr(group, "world_size", 1) > 1:
        # rank 0's key for every rank: ranks must not fingerprint apart
        key = None
        if rank == 0:
            try:
                key = _key(module, tables, layer_id, layout, self.row_start, n, dim, rank)
            except Exception as e:  # noqa: BLE001 - every rank raises it, none waits
                key = KvtierError(f"engram table key of layer {layer_id}: {type(e).__name__}: {e}")
        key = group.broadcast_object(key, src=0)
        if isinstance(key, Exception):
            raise KvtierError(str(key))
    else:
        key = _key(module, tables, layer_id, layout, self.row_start, n, dim, rank)
    # shared: rank 0 writes every row, the others attach after it; per
    # rank: each writes its own table
    writes = layout == "per_rank" or rank == 0
    self._kvtier_shape = (n, dim, w_bytes)
    self.host_table = KvtierEngramTable(layout, w_bytes + s_bytes, key, tables["store"], group, writes,
                                        float(tables.get("wait_s", 3600)))
    _bind_params(self, self.host_table)
    self._sort_host_reads = _sorted_reads(module)


def _key(module, tables: dict, layer_id, layout, first_row, n, dim, rank) -> str:
    fingerprint = tables.get("fingerprint") or _model_fingerprint(module)
    return table_key(fingerprint, layer_id, layout, first_row, n, dim, module.FP8_BLOCK_SIZE, rank)


def _model_fingerprint(module) -> str:
    model = module.get_model()
    download_dir = None
    try:  # where SGLang downloads to when --download-dir is given
        from sglang.srt.runtime_context import get_server_args

        download_dir = getattr(get_server_args(), "download_dir", None)
    except Exception:  # noqa: BLE001 - no server args here (tests, other releases): the default cache
        pass
    return checkpoint_fingerprint(model.model_path, getattr(model, "revision", None), download_dir)


def _load_rows(self, param, loaded_weight):
    """kvtier's ``EngramEmbedding._load_rows``: writes the rows this process
    writes, where the table misses them; nothing once the table is READY."""
    table = self.host_table
    if not isinstance(table, KvtierEngramTable):
        return self._kvtier_module._kvtier_originals["EngramEmbedding._load_rows"](self, param, loaded_weight)
    if table.loaded:
        table.write(0, None)  # refused: a weight update
    if table.ready or not table.writes:
        return  # READY under this key, or another rank writes it
    n, dim, w_bytes = self._kvtier_shape
    if param is self.weight:
        offset = 0
    elif param is self.scale:
        offset = w_bytes
    else:
        raise KvtierError("engram table: a weight loaded into a parameter that is neither weight nor scale")
    src = loaded_weight
    if table.layout == "per_rank":
        src = src[self.row_start:self.row_start + self.rows]
    if src.shape[0] != n:
        raise KvtierError(f"engram table {table.key}: the checkpoint's tensor has {src.shape[0]} rows, the table "
                          f"{n}")
    # SGLang's copy_ converts a tensor of another dtype; so does this
    data = src.detach().to(device="cpu", dtype=param.dtype).contiguous().view(_torch().uint8).reshape(-1).numpy()
    want = w_bytes if offset == 0 else n * (dim // self._kvtier_module.FP8_BLOCK_SIZE)
    if data.nbytes != want:
        raise KvtierError(f"engram table {table.key}: the checkpoint's {'weight' if offset == 0 else 'scale'} is "
                          f"{data.nbytes} bytes, the table's {want}")
    table.write(offset, data)


def _finish_load(self, label: str):
    """kvtier's ``EngramEmbedding.finish_load``."""
    table = self.host_table
    if not isinstance(table, KvtierEngramTable):
        return self._kvtier_module._kvtier_originals["EngramEmbedding.finish_load"](self, label)
    table.finish_load(label)
    if getattr(self.weight, "is_meta", False) or not self._host_table_ptrs[0]:
        _bind_params(self, table)
    torch = _torch()
    module = self._kvtier_module
    if module.engram_gather is engram_gather and torch.cuda.is_available():
        # the GPU gatherer (its error word a device allocation) made now,
        # not at a first call that may come inside a CUDA graph capture
        native().engram(torch.cuda.current_device())


PATCHED_METHODS = {"_init_host_table": _init_host_table, "_load_rows": _load_rows, "finish_load": _finish_load}


def patch(module, table: bool, gather: bool) -> dict:
    """Patches SGLang's engram `module`: its host table (`table`: the
    methods that make, fill and finish it) and its gather (`gather`).
    Returns the originals, by name, for :func:`unpatch`."""
    originals = {}
    if table:
        cls = module.EngramEmbedding
        for name, fn in PATCHED_METHODS.items():
            originals[f"EngramEmbedding.{name}"] = getattr(cls, name)
            setattr(cls, name, fn)
        cls._kvtier_module = module
    if gather:
        originals["engram_gather"] = module.engram_gather
        module.engram_gather = engram_gather
    module._kvtier_originals = originals
    return originals


def unpatch(module) -> None:
    originals = getattr(module, "_kvtier_originals", None) or {}
    for name, value in originals.items():
        if name.startswith("EngramEmbedding."):
            setattr(module.EngramEmbedding, name.split(".", 1)[1], value)
        else:
            setattr(module, name, value)
    if hasattr(module.EngramEmbedding, "_kvtier_module"):
        del module.EngramEmbedding._kvtier_module
    module._kvtier_originals = {}


__all__ = ["KvtierEngramTable", "checkpoint_fingerprint", "destroy_table", "engram_check", "engram_gather",
           "forget_table", "patch", "register_table", "table_key", "unpatch"]
