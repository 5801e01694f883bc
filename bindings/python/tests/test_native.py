"""The extension module's argument checks beyond dtype and shape: arrays of
Python objects and arrays that share memory with one another are refused;
the torch-tensor path (read through a tensor's methods) is exercised with a
stand-in torch module in a child process, since there is no torch here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import ITEM, worked_example

import kvtier
from kvtier import KvtierError
from kvtier.sglang import copy_cache_planned_mla, load_cache_to_device_buffer_mla

swap = load_cache_to_device_buffer_mla
TESTS = Path(__file__).resolve().parent
PACKAGE_ROOT = Path(kvtier.__file__).resolve().parents[1]


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


FAKE_TORCH = textwrap.dedent(
    '''
    """A stand-in torch: CPU "tensors" over numpy arrays, with the methods
    kvtier reads (data_ptr, shape, stride, dtype, element_size, is_cuda,
    is_cpu, get_device, is_contiguous); `cuda=` marks one as a GPU tensor."""
    import numpy as np

    int16, int32, int64, uint8, bfloat16 = "int16", "int32", "int64", "uint8", "bfloat16"
    _np = {np.dtype(np.int16): int16, np.dtype(np.int32): int32, np.dtype(np.int64): int64,
           np.dtype(np.uint8): uint8}


    class Tensor:
        def __init__(self, a, cuda=None, dtype=None):
            self.a, self._cuda = a, cuda
            self.dtype = dtype or _np.get(a.dtype, "float32")
            self.shape = tuple(a.shape)

        def data_ptr(self):
            return self.a.ctypes.data

        def stride(self):
            return tuple(s // self.a.itemsize for s in self.a.strides)

        def element_size(self):
            return self.a.itemsize

        @property
        def is_cuda(self):
            return self._cuda is not None

        @property
        def is_cpu(self):
            return self._cuda is None

        @property
        def device(self):
            return "cpu" if self._cuda is None else f"cuda:{self._cuda}"

        def get_device(self):
            return -1 if self._cuda is None else self._cuda

        def is_contiguous(self):
            return self.a.flags.c_contiguous
    '''
)

TORCH_CHECKS = textwrap.dedent(
    '''
    import numpy as np, torch
    from conftest import worked_example
    from kvtier import KvtierError
    from kvtier.sglang import load_cache_to_device_buffer_mla as swap

    c = worked_example([4, 2, 7])
    kw = c.kwargs()
    kw.pop("num_real_reqs")
    t = {k: torch.Tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    swap(**t)
    assert c.out.tolist() == [[7, 3, 11]] and c.lru.tolist() == [[0, 3, 1, 2]], "CPU tensors: the CPU executor"
    print("cpu tensors ok")

    def refused(expect, **over):
        try:
            swap(**dict(t, **over))
        except KvtierError as e:
            assert expect in str(e), (expect, str(e))
            print("refused:", e)
        else:
            raise AssertionError(f"not refused: {expect}")

    refused("`lru_slots`: is int32; it must be int16", lru_slots=torch.Tensor(c.lru.astype(np.int32)))
    refused("`host_cache`: must be contiguous",
            host_cache=torch.Tensor(np.zeros((8, 2 * 16), np.uint8)[:, ::2]))
    g = dict(t, top_k_tokens=torch.Tensor(c.topk, cuda=0))
    refused("`device_buffer_tokens`: is on cpu; top_k_tokens is on cuda:0, and every tensor of a call must be on "
            "the same GPU", top_k_tokens=g["top_k_tokens"])
    refused("`device_buffer_tokens`: is on cuda:1; top_k_tokens is on the CPU, so the call runs on the CPU "
            "executor", device_buffer_tokens=torch.Tensor(c.tokens, cuda=1))
    refused("`device_buffer_tokens`: is on cuda:1; top_k_tokens is on cuda:0, and every tensor",
            top_k_tokens=g["top_k_tokens"], device_buffer_tokens=torch.Tensor(c.tokens, cuda=1))
    # only the KV planes may stay in host memory: host_cache_locs is not one
    on_gpu = {k: torch.Tensor(v.a, cuda=0) if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    refused("`host_cache_locs`: is on cpu; top_k_tokens is on cuda:0, and every tensor",
            **dict(on_gpu, host_cache_locs=t["host_cache_locs"], host_cache=t["host_cache"]))
    print("all ok")
    '''
)


def test_torch_tensors_through_a_stand_in_torch(tmp_path):
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(TESTS), str(PACKAGE_ROOT)]))
    run = subprocess.run([sys.executable, "-c", TORCH_CHECKS], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cpu tensors ok" in run.stdout and run.stdout.rstrip().endswith("all ok")


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
