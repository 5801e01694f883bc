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
from .._swap_in import STRATEGIES, copy_planned, native, spec_swap_in
from ._config import current_config
from . import trace
from .counters import counted_layer, layer_number, per_step

# The largest item size the library's layouts take (a u32).
_MAX_ITEM_BYTES = 2**32 - 1


def _record(device_buffer, **call) -> None:
    """The call, to the trace being recorded (if one is)."""
    rec = trace.recorder()
    if rec is not None:
        numbered = layer_number(device_buffer)
        rec.record(None if numbered is None else numbered[1], **call)


def _positive(value, arg: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KvtierError(f"invalid argument `{arg}`: {value!r} is not a positive int")


def _item_size(value, arg: str = "item_size_bytes") -> int:
    """A row size the library's layouts take: a positive int of at most 32 bits."""
    _positive(value, arg)
    if value > _MAX_ITEM_BYTES:
        raise KvtierError(f"invalid argument `{arg}`: {value} is outside 1..={_MAX_ITEM_BYTES}")
    return value


def _begin(page_size, block_size) -> None:
    """What every swap-in entry point does first: the per-step hooks (the
    bad-index poll, which may raise, and the counters' export), then the
    launch shapes SGLang passes checked."""
    per_step()
    _positive(page_size, "page_size")
    _positive(block_size, "block_size")


def _run(items, item_bytes, top_k, tokens, host_locs, locs, host, device, out, req, seq, lru, k, hot, num_real,
         miss_src, miss_dst, miss_count, skip_io, block_tokens, host_v, device_v) -> None:
    """Every swap-in entry point's body after its checks (`_begin` first),
    its arguments positional: the per-call path of a served layer, which
    eager mode pays on every call (see docs/sglang.md's per-call cost).
    ``items`` is a layout the entry point built from checked values,
    ``item_bytes`` the bytes a token moves (a trace's header); ``hot`` is
    SGLang's ``hot_buffer_size``, its word for the slots a request keeps on
    the GPU."""
    if trace.recorder() is not None:
        _record(device, top_k_tokens=top_k, num_top_k=k, req_pool_indices=req, seq_lens=seq, num_real_reqs=num_real,
                device_buffer_tokens=tokens, lru_slots=lru, hot=hot, block_tokens=block_tokens, item_bytes=item_bytes)
    cfg = current_config()
    if cfg is None:
        strategy, layer = _lib.DEFAULT, counted_layer(device, True)
    else:
        strategy, layer = STRATEGIES[cfg.strategy], counted_layer(device, cfg.counters)
    native().swap_in(
        top_k, tokens, host_locs, locs, host, device, out, req, seq, lru, items, k, hot, num_real, miss_src,
        miss_dst, miss_count, bool(skip_io), None, strategy, block_tokens, host_v, device_v,
        -1 if layer is None else layer,
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
    items = _lib.linear_items(_item_size(item_size_bytes))
    _begin(page_size, block_size)
    _run(items, item_size_bytes, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
         device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_top_k, hot_buffer_size,
         num_real_reqs, miss_src, miss_dst, miss_count, skip_io, 0, None, None)


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
    _begin(page_size, block_size)
    _run(_lib.dsv4_items(), item_size_bytes, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
         host_cache, device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, num_top_k,
         hot_buffer_size, num_real_reqs, miss_src, miss_dst, miss_count, skip_io, 0, None, None)


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
    _begin(page_size, block_size)
    items = _lib.linear_items(_item_size(item_size_bytes))
    _positive(sparse_block_size, "sparse_block_size")
    shape = getattr(top_k_blocks, "shape", ())
    if len(shape) != 2:
        raise KvtierError(f"invalid argument `top_k_blocks`: has shape {list(shape)}; it must be 2-D")
    _run(items, 2 * item_size_bytes, top_k_blocks, device_buffer_tokens, host_cache_locs, device_buffer_locs,
         host_cache_k, device_buffer_k, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, int(shape[1]),
         hot_buffer_size, num_real_reqs, None, None, None, skip_io, sparse_block_size, host_cache_v, device_buffer_v)


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
