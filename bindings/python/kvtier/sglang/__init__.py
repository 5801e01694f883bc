"""kvtier as a drop-in for SGLang HiSparse.

- :func:`load_cache_to_device_buffer_mla`: SGLang's swap-in function, same
  keyword signature (SGLang 0.5.18+'s, whose first sixteen parameters are the
  0.5.12-0.5.15 signature), same semantics and in-place updates (DESIGN.md
  section 4), on kvtier's kernels (torch CUDA tensors) or its CPU executor
  (numpy arrays, CPU tensors).
- :class:`KvtierHostTensorAllocator`: places SGLang's layer-first host KV pool
  in a kvtier pool on CXL devices, per rank round-robin.
- :func:`install`: replaces the HiSparse coordinator's module-level swap-in
  function and its host pool's allocator, before the coordinator is created.
  ``python -m kvtier.sglang <sglang.launch_server arguments> --kvtier-config
  FILE`` installs and launches.
"""

from __future__ import annotations

from .._lib import KvtierError
from .._swap_in import engine_for, swap_in
from ._config import ENV, KvtierConfig, load_config
from ._patch import current_config, install, uninstall
from .host_pool import KvtierHostTensorAllocator

__all__ = [
    "ENV",
    "KvtierConfig",
    "KvtierError",
    "KvtierHostTensorAllocator",
    "check",
    "current_config",
    "install",
    "load_cache_to_device_buffer_mla",
    "load_config",
    "reserve",
    "uninstall",
]


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
    """SGLang HiSparse's MLA swap-in for one layer and a batch, in place.

    Per batch row ``b`` (request ``req_pool_indices[b]``, ``seq_lens[b]``
    tokens including the one being decoded, query ``top_k_tokens[b]``): writes
    ``top_k_device_locs[b]`` (the device row of each top-k token), updates the
    request's ``device_buffer_tokens`` and ``lru_slots``, and copies each
    missed token's host row ``host_cache_locs[req][token]`` of ``host_cache``
    into its evicted slot's row ``device_buffer_locs[req][slot]`` of
    ``device_buffer`` (rows of ``item_size_bytes``; any dtype). Rows at or
    past ``num_real_reqs[0]`` are padding. With ``miss_src``/``miss_dst``/
    ``miss_count`` the misses are recorded there (SGLang's miss plan);
    ``skip_io`` moves no KV bytes. ``page_size`` must be 1 (the MLA path);
    ``block_size`` is SGLang's launch parameter and is accepted for
    compatibility only: kvtier sizes its own launches.

    Differences, on bad input only: -1 inside a long query is padding (not a
    miss), duplicates load once, and out-of-range tokens, rows and requests
    are refused with output -1 and reported (CPU: a KvtierError at once;
    CUDA: at ``kvtier.sglang.check()``), never read out of bounds.
    """
    if page_size != 1:
        raise KvtierError(f"invalid argument `page_size`: {page_size!r}; the MLA swap-in works on single tokens (1)")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise KvtierError(f"invalid argument `block_size`: {block_size!r} is not a positive int")
    cfg = current_config()
    swap_in(
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
        num_real_reqs=num_real_reqs,
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        skip_io=bool(skip_io),
        strategy=cfg.strategy if cfg is not None else "plan_then_copy",
    )


def reserve(max_batch: int, top_k: int, device="cpu") -> None:
    """Sizes the swap-in's plan scratch on `device` ("cpu" or a CUDA ordinal)
    ahead of time, e.g. before CUDA graph capture (it otherwise grows on the
    first call that needs more)."""
    engine_for(device).reserve(max_batch, top_k)


def check(device="cpu") -> None:
    """Raises the bad indices the swap-ins on `device` recorded since the last
    check (a KvtierError with status BAD_INDICES); waits for the device."""
    engine_for(device).check()
