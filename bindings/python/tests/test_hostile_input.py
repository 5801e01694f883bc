"""Hostile input gets a KvtierError and nothing else: no ValueError, no
TypeError, no crash. A fixed number of random cases (fixed seeds) replace
one argument of each public call with junk: wrong types, wrong dtypes,
shapes, strides, negative and huge values, arrays of objects, arrays that
share memory with other arguments."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import worked_example

import kvtier
from kvtier import KvtierError
from kvtier.sglang import (
    KvtierConfig,
    copy_cache_planned_mla,
    load_blocks_to_device_buffer_mha,
    load_cache_to_device_buffer_mla,
    load_cache_to_device_buffer_spec_mla,
)

JUNK_SCALARS = [None, "7", 7.5, -1, 2**40, -(2**40), True, [], {}, object(), b"x", np.int64(3), np.float32(1)]


def junk_arrays(rng, like):
    """Arrays near `like` that are wrong in one way, and some that are wild."""
    a = np.asarray(like)
    out = [
        np.array([object()] * max(a.size, 1)).reshape(a.shape if a.size else (1,)),
        a.astype(np.float64),
        a.astype(np.int8),
        a.reshape(-1),
        a[None],
        np.zeros((0,) + a.shape[1:], a.dtype),
        a.byteswap().view(a.dtype.newbyteorder()),
        np.full(a.shape, np.iinfo(a.dtype).max, a.dtype) if a.dtype.kind in "iu" else a,
        np.full(a.shape, -5, a.dtype) if a.dtype.kind == "i" else a,
        np.zeros(a.shape, a.dtype)[..., ::-1] if a.ndim else a,
    ]
    if a.ndim == 2 and a.shape[1] > 1:
        out.append(np.repeat(a, 2, axis=1)[:, ::2])  # strided rows
    rng.shuffle(out)
    return out[:4]


def call_only_raises_kvtier_error(fn, kwargs):
    try:
        fn(**kwargs)
    except KvtierError as e:
        assert str(e), "an error says what is wrong"


@pytest.mark.parametrize("seed", range(6))
def test_the_swap_in_refuses_junk_with_kvtier_errors(seed):
    rng = random.Random(seed)
    for _ in range(150):
        c = worked_example([4, 2, 7])
        kw = c.kwargs()
        name = rng.choice(sorted(kw))
        value = kw[name]
        choices = list(JUNK_SCALARS)
        if isinstance(value, np.ndarray):
            choices += junk_arrays(rng, value)
            others = [v for k, v in kw.items() if isinstance(v, np.ndarray) and k != name]
            choices.append(rng.choice(others))  # shares memory with another argument
        kw[name] = rng.choice(choices)
        call_only_raises_kvtier_error(load_cache_to_device_buffer_mla, kw)


@pytest.mark.parametrize("seed", range(3))
def test_the_other_entry_points_refuse_junk_with_kvtier_errors(seed):
    rng = random.Random(100 + seed)
    for _ in range(100):
        c = worked_example([0, -1])
        plan = dict(miss_src=np.zeros((1, 2), np.int64), miss_dst=np.array([[9, 7]], np.int32),
                    miss_count=np.array([2], np.int32), num_real_reqs=np.array([1], np.int32),
                    host_cache=c.host_cache, device_buffer=c.device_buffer, item_size_bytes=16)
        name = rng.choice(sorted(plan))
        plan[name] = rng.choice(JUNK_SCALARS + (junk_arrays(rng, plan[name]) if isinstance(plan[name], np.ndarray)
                                                else []))
        call_only_raises_kvtier_error(copy_cache_planned_mla, plan)
        mha = dict(top_k_blocks=np.array([[1]], np.int32), device_buffer_tokens=c.tokens,
                   host_cache_locs=c.host_locs, device_buffer_locs=c.locs, host_cache_k=c.host_cache,
                   host_cache_v=c.host_cache.copy(), device_buffer_k=c.device_buffer,
                   device_buffer_v=c.device_buffer.copy(), top_k_device_locs=np.full((1, 4), -1, np.int32),
                   req_pool_indices=c.req, seq_lens=c.seq, lru_slots=c.lru, item_size_bytes=16, hot_buffer_size=4,
                   sparse_block_size=4)
        name = rng.choice(sorted(mha))
        mha[name] = rng.choice(JUNK_SCALARS)
        call_only_raises_kvtier_error(load_blocks_to_device_buffer_mha, mha)


@pytest.mark.parametrize("seed", range(3))
def test_the_speculative_swap_in_refuses_junk_with_kvtier_errors(seed):
    from test_spec_swap_in import Swap

    rng = random.Random(200 + seed)
    for _ in range(60):
        s = Swap(num_reqs=1, hot=1024, page=8, scratch=1024, seq_len=4096, words=1, occurrences=2048)
        kw = dict(top_k_tokens=np.tile(np.arange(1024, dtype=np.int32), (1, 2, 1)),
                  device_buffer_tokens=s.tokens, host_cache_locs=s.host_locs, device_buffer_locs=s.locs,
                  host_cache=s.host, device_buffer=s.device,
                  top_k_device_locs=np.zeros((1, 2, 1024), np.int32), req_pool_indices=np.zeros(1, np.int64),
                  seq_lens=np.full(2, 4096, np.int32), num_real_reqs=np.ones(1, np.int32))
        fields = dict(s.state._asdict())
        name = rng.choice(sorted(kw) + sorted(fields) + ["state"])
        target = fields if name in fields else kw
        value = target.get(name)
        choices = list(JUNK_SCALARS)
        if isinstance(value, np.ndarray):
            choices += junk_arrays(rng, value)
            others = [v for v in list(kw.values()) + list(fields.values())
                      if isinstance(v, np.ndarray) and v is not value]
            choices.append(rng.choice(others))  # shares memory with another argument
        junk = rng.choice(choices)
        if name == "state":
            kw["state"] = junk
        else:
            target[name] = junk
            kw["state"] = type(s.state)(**fields)
        call_only_raises_kvtier_error(load_cache_to_device_buffer_spec_mla, kw)


@pytest.mark.parametrize("junk", JUNK_SCALARS + [(64, 2), ("a", 2, 3), (64, 2, 0), (7, 2, 16)])
def test_pool_calls_refuse_junk_with_kvtier_errors(junk, tmp_path):
    layout = kvtier.Layout(64, 2, 16)
    for call in [
        lambda: kvtier.device_bytes_for(junk, 1),
        lambda: kvtier.device_bytes_for(layout, junk),
        lambda: kvtier.Pool.create(junk, ["anon:4MiB"]),
        lambda: kvtier.Pool.create(layout, junk),
        lambda: kvtier.Pool.create(layout, ["anon:4MiB"], rank=junk),
        lambda: kvtier.Pool.open_or_create(layout, [f"file:{tmp_path}/p:4MiB"], ranks=junk),
        lambda: kvtier.Pool.create(layout, ["anon:4MiB"]).alloc_region(request=junk),
        lambda: kvtier.device_capacity(junk),
        lambda: kvtier.SwapInEngine(junk),
        lambda: kvtier.SwapInEngine("cpu").reserve(junk, 4),
        lambda: KvtierConfig(devices=junk),
        lambda: KvtierConfig(rank=junk),
        lambda: kvtier.sglang.reserve(junk, 4),
    ]:
        try:
            call()
        except KvtierError:
            pass
