"""The extension module's argument checks beyond dtype and shape: arrays of
Python objects and arrays that share memory with one another are refused,
and threads calling at once each get their own answer. The torch-tensor path
is tested with real torch in test_torch.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ITEM, worked_example

from kvtier import KvtierError
from kvtier.sglang import copy_cache_planned_mla, load_cache_to_device_buffer_mla

swap = load_cache_to_device_buffer_mla


def kwargs(**over):
    c = worked_example([4, 2, 7])
    kw = c.kwargs(**over)
    kw.pop("num_real_reqs")
    return c, kw


@pytest.mark.parametrize("arg", ["host_cache", "device_buffer", "top_k_tokens", "seq_lens"])
def test_arrays_of_python_objects_are_refused(arg):
    c, kw = kwargs()
    kw[arg] = np.array([object()] * 8)
    with pytest.raises(KvtierError, match=f"`{arg}` holds Python objects"):
        swap(**kw)


def test_a_structured_dtype_holding_objects_is_refused():
    c, kw = kwargs()
    kw["host_cache"] = np.zeros(8, dtype=[("a", np.int64), ("b", object)])
    with pytest.raises(KvtierError, match="`host_cache` holds Python objects"):
        swap(**kw)


@pytest.mark.parametrize("written, other", [
    ("top_k_device_locs", "top_k_tokens"),
    ("device_buffer_tokens", "device_buffer_locs"),
    ("lru_slots", "lru_slots_alias"),
    ("device_buffer", "host_cache"),
])
def test_a_written_array_sharing_memory_with_another_is_refused(written, other):
    c, kw = kwargs()
    if other == "lru_slots_alias":
        # a view of device_buffer_tokens' memory, reinterpreted as int16
        kw["lru_slots"] = kw["device_buffer_tokens"].view(np.int16)[:, :4]
        other = "device_buffer_tokens"
    elif written == "device_buffer":
        kw["device_buffer"] = kw["host_cache"]
    elif written == "device_buffer_tokens":
        kw["device_buffer_tokens"] = kw["device_buffer_locs"][:, :]
    else:
        kw[written] = kw[other]
    with pytest.raises(KvtierError) as e:
        swap(**kw)
    msg = str(e.value)
    assert "shares memory with" in msg and (f"`{written}`" in msg or f"`{other}`" in msg), msg
    # nothing ran
    assert c.out.tolist() == [[-7, -7, -7]] and c.lru.tolist() == [[0, 1, 2, 3]]
    assert c.tokens.tolist() == [[1, 4, 2, 5, 7]] and (c.device_buffer == 0xEE).all()


def test_partial_overlap_is_found_and_disjoint_views_pass():
    # two views of one buffer: disjoint halves are fine, overlapping ones not
    c, kw = kwargs()
    both = np.zeros(24 * ITEM, dtype=np.uint8)
    kw["host_cache"], kw["device_buffer"] = both[: 8 * ITEM], both[8 * ITEM :]
    kw["host_cache"][:] = np.repeat(np.arange(8, dtype=np.uint8), ITEM)
    swap(**kw)
    assert c.out.tolist() == [[7, 3, 11]]
    kw["device_buffer"] = both[8 * ITEM - 1 : 20 * ITEM - 1]
    with pytest.raises(KvtierError, match="`device_buffer`: shares memory with `host_cache`"):
        swap(**kw)


def test_replay_refuses_a_device_buffer_over_its_plan():
    plan = np.zeros((1, 4), np.int64)
    with pytest.raises(KvtierError, match="`device_buffer`: shares memory with `miss_src`"):
        copy_cache_planned_mla(
            miss_src=plan, miss_dst=np.zeros((1, 4), np.int32), miss_count=np.zeros(1, np.int32),
            num_real_reqs=np.array([1], np.int32), host_cache=np.zeros(64, np.uint8),
            device_buffer=plan.view(np.uint8), item_size_bytes=8)


def test_threads_call_at_once_and_grow_the_scratch():
    """Several threads swap in at once, with batches that grow the shared
    engine's plan scratch: every call completes with its own right answer."""
    import threading

    errors = []

    def worker(seed):
        try:
            for n in range(60):
                c = worked_example([4, 2, 7])
                kw = c.kwargs()
                kw.pop("num_real_reqs")
                batch = 1 + (seed * 7 + n) % 9
                for name in ("top_k_tokens", "req_pool_indices", "seq_lens"):
                    kw[name] = np.repeat(kw[name], batch, axis=0)[:batch]
                kw["top_k_device_locs"] = np.full((batch, 3), -7, np.int32)
                kw["req_pool_indices"] = np.zeros(batch, np.int32)
                kw["num_real_reqs"] = np.array([1], np.int32)  # one real row, the rest padding
                swap(**kw)
                assert kw["top_k_device_locs"][0].tolist() == [7, 3, 11], kw["top_k_device_locs"]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]
