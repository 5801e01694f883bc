"""SGLang HiSparse's kernel entry points, served by kvtier: the same names,
keyword signatures, defaults and in-place updates as SGLang's
``sglang.kernels.ops.kvcache.hisparse`` (0.5.21 to 0.5.23).

Semantics (the library's swap_in module has the full contract): per batch
row, the query's entries are resolved against the request's hot buffer; hits
output their device row, misses evict least-recently-used slots and copy
their host rows in, the newest token maps to the reserved slot, and the LRU
order is updated. Rows at or past ``num_real_reqs[0]`` are CUDA-graph
padding (outputs -1, nothing else). On valid input outputs, state, copied
bytes and the miss plan are SGLang's, but for a -1 (padding) inside a long
token query: kvtier outputs -1 there, where SGLang's kernel leaves the output
as it was. On bad input kvtier refuses what SGLang would follow unchecked:
out-of-range tokens, block ids, rows and requests give -1 and are reported
(CPU executor: a :class:`kvtier.KvtierError` at once; CUDA: at
:func:`kvtier.sglang.check`); a duplicated token is loaded once.

torch CUDA tensors run kvtier's kernels on the current torch stream (host
caches must be pinned or registered host memory); numpy arrays and CPU
tensors run the CPU executor. ``block_size`` and ``num_blocks`` are SGLang's
launch shapes: kvtier sizes its own launches (a replay uses as many warps as
``num_blocks × block_size`` would, so that it leaves the same SMs free).
``page_size`` is accepted as SGLang accepts it: its kernels never read it.
"""

from __future__ import annotations

from .. import _lib
from .._lib import KvtierError
from .._swap_in import copy_planned, spec_swap_in, swap_in
from ._config import current_config
from . import trace
from .counters import counted_layer, layer_number, per_step


def _strategy() -> str:
    cfg = current_config()
    return cfg.strategy if cfg is not None else "default"


def _item_bytes(items) -> int:
    """Bytes a row of an item layout carries (value and scale)."""
    return int(items[1]) + int(items[2])


def _layer(device_buffer):
    """The layer a swap-in into `device_buffer` counts as (None: not counted)."""
    cfg = current_config()
    return counted_layer(device_buffer, cfg is None or cfg.counters)


def _record(device_buffer, **call) -> None:
    """The call, to the trace being recorded (if one is)."""
    rec = trace.recorder()
    if rec is not None:
        numbered = layer_number(device_buffer)
        rec.record(None if numbered is None else numbered[1], **call)


def _positive(value, arg: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KvtierError(f"invalid argument `{arg}`: {value!r} is not a positive int")


def _mla_swap_in(items, *, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
                 device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_top_k,
                 hot_buffer_size, page_size, block_size, num_real_reqs, miss_src, miss_dst, miss_count,
                 skip_io) -> None:
    """The MLA swap-ins' body, the entry point's arguments by SGLang's names
    (``hot_buffer_size`` is the library's ``hot``: SGLang's word for the
    slots a request keeps on the GPU)."""
    per_step()
    _positive(page_size, "page_size")
    _positive(block_size, "block_size")
    _record(device_buffer, top_k_tokens=top_k_tokens, num_top_k=num_top_k, req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, num_real_reqs=num_real_reqs, device_buffer_tokens=device_buffer_tokens,
            lru_slots=lru_slots, hot=hot_buffer_size, item_bytes=_item_bytes(items))
    swap_in(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
        top_k_device_locs, req_pool_indices, seq_lens, lru_slots, items, num_top_k, hot_buffer_size,
        num_real_reqs=num_real_reqs, miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count,
        skip_io=bool(skip_io), strategy=_strategy(), layer=_layer(device_buffer),
    )


def load_cache_to_device_buffer_mla(
    top_k_tokens,
    device_buffer_tokens,
    host_cache_locs,
    device_buffer_locs,
    host_cache,
    device_buffer,
    top_k_device_locs,
    req_pool_indices,
    seq_lens,
    lru_slots,
    item_size_bytes,
    num_top_k,
    hot_buffer_size,
    page_size=1,
    block_size=256,
    num_real_reqs=None,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
    skip_io=False,
) -> None:
    """DSA decode (DeepSeek-V3.2, GLM): the swap-in of one layer for a batch,
    host and device caches linear rows of ``item_size_bytes``. With
    ``miss_src``/``miss_dst``/``miss_count`` the misses are recorded there (for
    :func:`copy_cache_planned_mla`); ``skip_io`` moves no KV bytes."""
    _positive(item_size_bytes, "item_size_bytes")
    _mla_swap_in(
        _lib.linear_items(item_size_bytes),
        top_k_tokens=top_k_tokens, device_buffer_tokens=device_buffer_tokens, host_cache_locs=host_cache_locs,
        device_buffer_locs=device_buffer_locs, host_cache=host_cache, device_buffer=device_buffer,
        top_k_device_locs=top_k_device_locs, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        lru_slots=lru_slots, num_top_k=num_top_k, hot_buffer_size=hot_buffer_size, page_size=page_size,
        block_size=block_size, num_real_reqs=num_real_reqs, miss_src=miss_src, miss_dst=miss_dst,
        miss_count=miss_count, skip_io=skip_io,
    )


def load_cache_to_device_buffer_dsv4_mla(
    top_k_tokens,
    device_buffer_tokens,
    host_cache_locs,
    device_buffer_locs,
    host_cache,
    device_buffer,
    top_k_device_locs,
    req_pool_indices,
    seq_lens,
    lru_slots,
    item_size_bytes,
    num_top_k,
    hot_buffer_size,
    page_size=1,
    block_size=256,
    num_real_reqs=None,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
    skip_io=False,
) -> None:
    """DeepSeek-V4: as :func:`load_cache_to_device_buffer_mla`, host and device
    caches in the page-padded C4 layout (pages of 64 tokens, a token's 576-byte
    value and 8-byte scale in separate runs of its page, pages padded to 37440
    bytes); ``item_size_bytes`` must be the C4 token's 584."""
    if item_size_bytes != _lib.DSV4_ITEM_BYTES:
        raise KvtierError(
            f"invalid argument `item_size_bytes`: {item_size_bytes!r}; DeepSeek-V4's C4 token is "
            f"{_lib.DSV4_VALUE_BYTES} + {_lib.DSV4_SCALE_BYTES} = {_lib.DSV4_ITEM_BYTES} bytes"
        )
    _mla_swap_in(
        _lib.dsv4_items(),
        top_k_tokens=top_k_tokens, device_buffer_tokens=device_buffer_tokens, host_cache_locs=host_cache_locs,
        device_buffer_locs=device_buffer_locs, host_cache=host_cache, device_buffer=device_buffer,
        top_k_device_locs=top_k_device_locs, req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        lru_slots=lru_slots, num_top_k=num_top_k, hot_buffer_size=hot_buffer_size, page_size=page_size,
        block_size=block_size, num_real_reqs=num_real_reqs, miss_src=miss_src, miss_dst=miss_dst,
        miss_count=miss_count, skip_io=skip_io,
    )


def load_blocks_to_device_buffer_mha(
    top_k_blocks,
    device_buffer_tokens,
    host_cache_locs,
    device_buffer_locs,
    host_cache_k,
    host_cache_v,
    device_buffer_k,
    device_buffer_v,
    top_k_device_locs,
    req_pool_indices,
    seq_lens,
    lru_slots,
    item_size_bytes,
    hot_buffer_size,
    sparse_block_size,
    page_size=1,
    block_size=256,
    num_real_reqs=None,
    skip_io=False,
) -> None:
    """MiniMax-M3: block-selected MHA. ``top_k_blocks[b]`` names blocks of
    ``sparse_block_size`` tokens; the row resolves every token of every block
    (tokens past the sequence and -1 blocks give -1) into
    ``top_k_device_locs[b, :blocks × sparse_block_size]``, and each miss
    copies its K and V rows (``item_size_bytes`` each)."""
    per_step()
    _positive(page_size, "page_size")
    _positive(block_size, "block_size")
    _positive(item_size_bytes, "item_size_bytes")
    _positive(sparse_block_size, "sparse_block_size")
    shape = getattr(top_k_blocks, "shape", ())
    if len(shape) != 2:
        raise KvtierError(f"invalid argument `top_k_blocks`: has shape {list(shape)}; it must be 2-D")
    _record(device_buffer_k, top_k_tokens=top_k_blocks, num_top_k=int(shape[1]), req_pool_indices=req_pool_indices,
            seq_lens=seq_lens, num_real_reqs=num_real_reqs, device_buffer_tokens=device_buffer_tokens,
            lru_slots=lru_slots, hot=hot_buffer_size, block_tokens=sparse_block_size, item_bytes=2 * item_size_bytes)
    swap_in(
        top_k_blocks, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache_k, device_buffer_k,
        top_k_device_locs, req_pool_indices, seq_lens, lru_slots, _lib.linear_items(item_size_bytes),
        int(shape[1]), hot_buffer_size, num_real_reqs=num_real_reqs, skip_io=bool(skip_io), strategy=_strategy(),
        block_tokens=sparse_block_size, host_cache_v=host_cache_v, device_buffer_v=device_buffer_v,
        layer=_layer(device_buffer_k),
    )


def copy_cache_planned_mla(
    *,
    miss_src,
    miss_dst,
    miss_count,
    num_real_reqs,
    host_cache,
    device_buffer,
    item_size_bytes,
    num_blocks=4,
    block_size=1024,
    is_dsv4_layout=False,
    skip_io=False,
) -> None:
    """Shared-index (skip) layers: replays a recorded miss plan (kvtier's or
    SGLang's: the same format) into this layer's device buffer — copies only,
    rows below ``num_real_reqs[0]``, every count and row checked."""
    per_step()
    _positive(num_blocks, "num_blocks")
    _positive(block_size, "block_size")
    if is_dsv4_layout:
        items = _lib.dsv4_items()
    else:
        _positive(item_size_bytes, "item_size_bytes")
        items = _lib.linear_items(item_size_bytes)
    copy_planned(
        miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer, items,
        warps=-(-num_blocks * block_size // 32), skip_io=bool(skip_io),
    )


def load_cache_to_device_buffer_spec_mla(
    *,
    top_k_tokens,
    device_buffer_tokens,
    host_cache_locs,
    device_buffer_locs,
    host_cache,
    device_buffer,
    top_k_device_locs,
    req_pool_indices,
    seq_lens,
    state,
    num_real_reqs,
    miss_src=None,
    miss_dst=None,
    miss_count=None,
) -> None:
    """MTP/EAGLE verify: the speculative swap-in of one layer (2 to 4 draft
    steps of ``top_k_tokens[b, step, :]``, ``seq_lens[b × steps + step]``) on
    SGLang's ``HiSparseSpecState`` `state` (its ``cache_index``,
    ``cache_policy``, ``scratch_locs``, ``scratch_state``, read and written as
    SGLang lays them out). Misses are deduplicated across steps and copied
    once; draft tokens on the extra page resolve without host I/O; padding
    rows output 0. As SGLang does, the hot buffer is ``cache_policy``'s
    columns, the extra page ``device_buffer_tokens``' columns past it, and an
    item ``host_cache``'s row stride in bytes. numpy arrays and CPU tensors
    run the CPU executor; CUDA tensors kvtier's kernel on the current torch
    stream, exact on an H100 but slower there than SGLang's kernel
    (:func:`kvtier.sglang.install` leaves the path to SGLang's; see the
    install report)."""
    per_step()
    shape = tuple(getattr(top_k_tokens, "shape", ()))
    if len(shape) != 3 or not 2 <= shape[1] <= 4:
        steps = shape[1] if len(shape) == 3 else None
        raise KvtierError(
            f"invalid argument `top_k_tokens`: has shape {list(shape)}; HiSparse speculative swap requires 2-4 "
            f"steps, got {steps}"
        )
    fields = ("cache_index", "cache_policy", "scratch_locs", "scratch_state")
    missing = [f for f in fields if not hasattr(state, f)]
    if missing:
        raise KvtierError(f"invalid argument `state`: {type(state).__name__} has no {missing}; it must be SGLang's "
                          "HiSparseSpecState")
    policy_shape = tuple(getattr(state.cache_policy, "shape", ()))
    tokens_shape = tuple(getattr(device_buffer_tokens, "shape", ()))
    if len(policy_shape) != 2 or len(tokens_shape) != 2:
        raise KvtierError(
            f"invalid argument `state`: cache_policy has shape {list(policy_shape)} and device_buffer_tokens "
            f"{list(tokens_shape)}; both must be 2-D"
        )
    hot = policy_shape[1]
    page = tokens_shape[1] - hot
    if page < 0:
        raise KvtierError(
            f"invalid argument `device_buffer_tokens`: has {tokens_shape[1]} columns, fewer than the "
            f"{hot} hot slots of cache_policy"
        )
    spec_swap_in(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
        top_k_device_locs, req_pool_indices, seq_lens, state.cache_index, state.cache_policy, state.scratch_locs,
        state.scratch_state, num_real_reqs, _lib.linear_items(_row_bytes(host_cache)), hot, page,
        miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count,
    )


def _row_bytes(host_cache) -> int:
    """SGLang's item size: the host cache's row stride in bytes."""
    stride = getattr(host_cache, "stride", None)
    if callable(stride):  # torch
        value = stride(0) * host_cache.element_size()
    else:
        strides = getattr(host_cache, "strides", None)
        if not strides:
            raise KvtierError("invalid argument `host_cache`: it must be a 2-D array of KV rows")
        value = strides[0]
    _positive(value, "host_cache")
    return value


# The entry points kvtier serves, by SGLang's name.
SERVED = {
    f.__name__: f
    for f in (
        load_cache_to_device_buffer_mla,
        load_cache_to_device_buffer_dsv4_mla,
        load_blocks_to_device_buffer_mha,
        copy_cache_planned_mla,
        load_cache_to_device_buffer_spec_mla,
    )
}
