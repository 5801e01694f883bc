"""The same swap-in tests with torch tensors: CPU tensors (the CPU executor)
wherever torch is installed, CUDA tensors (the CUDA executor, compared with
the CPU executor) where there is a GPU. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ITEM, worked_example
from test_swap_in import as_bytes, random_case, reference

torch = pytest.importorskip("torch")

import kvtier.sglang  # noqa: E402
from kvtier import KvtierError  # noqa: E402
from kvtier.sglang import load_cache_to_device_buffer_mla as swap  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARRAYS = ("tokens", "locs", "lru", "host_locs", "host_cache", "device_buffer", "topk", "req", "seq", "out",
          "num_real")


def to_torch(case, device="cpu", pin_host_cache=False):
    """The case's arrays as torch tensors on `device` (CPU ones share memory)."""
    for name in ARRAYS:
        a = getattr(case, name)
        if a is None:
            continue
        t = torch.from_numpy(np.ascontiguousarray(a)) if device == "cpu" and a.flags.c_contiguous else \
            torch.from_numpy(a.copy())
        if name == "host_cache" and pin_host_cache:
            t = t.pin_memory()
        elif device != "cpu":
            t = t.to(device)
        setattr(case, name, t)
    return case


def test_worked_example_on_cpu_tensors():
    c = to_torch(worked_example([4, 2, 7]))
    swap(**c.kwargs())
    assert c.out.tolist() == [[7, 3, 11]]
    assert c.lru.tolist() == [[0, 3, 1, 2]]


@pytest.mark.parametrize("seed", range(40))
def test_random_cases_on_cpu_tensors(seed):
    c = random_case(seed)
    want = reference(type(c)(tokens=c.tokens.copy(), locs=c.locs, lru=c.lru.copy(), host_locs=c.host_locs,
                             host_cache=as_bytes(c.host_cache), device_buffer=as_bytes(c.device_buffer).copy(),
                             topk=c.topk, req=c.req, seq=c.seq, hot=c.hot, k=c.k, item=c.item,
                             num_real=c.num_real))
    kw = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in c.kwargs().items()}
    swap(**kw)  # views of the numpy arrays: results land in them
    assert c.out.tolist() == want[0].tolist()
    assert c.tokens.tolist() == want[1].tolist()
    assert c.lru.tolist() == want[2].tolist()
    assert (as_bytes(c.device_buffer) == want[3]).all()


def test_bf16_and_fp8_buffers_are_rows_of_bytes():
    c = worked_example([6])
    c.lru = np.array([[0, 3, 1, 2]], dtype=np.int16)
    kw = c.kwargs()
    kw = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    kw["host_cache"] = kw["host_cache"].view(torch.bfloat16)
    kw["device_buffer"] = kw["device_buffer"].view(torch.float8_e4m3fn)
    swap(**kw)
    assert c.out.tolist() == [[9]]
    assert (c.device_buffer[9 * ITEM : 10 * ITEM] == 6).all()


def test_tensors_kvtier_cannot_address_are_refused():
    c = to_torch(worked_example([4, 2, 7]))
    with pytest.raises(KvtierError, match="is on device meta"):
        swap(**c.kwargs(top_k_tokens=c.topk.to("meta")))


@cuda
def test_mixing_cpu_and_cuda_tensors_is_refused():
    c = to_torch(worked_example([4, 2, 7]), "cuda", pin_host_cache=True)
    with pytest.raises(KvtierError, match="every tensor of a call must be on the same GPU"):
        swap(**c.kwargs(lru_slots=c.lru.cpu()))


def test_the_host_allocator_returns_torch_tensors_of_any_dtype():
    alloc = kvtier.sglang.KvtierHostTensorAllocator(kvtier.sglang.KvtierConfig(rank=0, ranks=1))
    t = alloc.allocate((2, 8, 1, 576), torch.bfloat16, "cpu")
    assert t.dtype == torch.bfloat16 and t.shape == (2, 8, 1, 576)
    assert t.data_ptr() == alloc.regions[0].host_addr
    t[1, 3, 0, :] = 1.5
    raw = alloc.regions[0].numpy(np.uint16)
    assert (raw[(1 * 8 + 3) * 576 : (1 * 8 + 4) * 576] == 0x3FC0).all(), "bf16 1.5, layer-first"
    f8 = alloc.allocate((2, 8, 1, 656), torch.uint8)
    assert f8.shape == (2, 8, 1, 656)


# ---- the CUDA executor ---------------------------------------------------------


@cuda
def test_worked_example_on_cuda_with_a_pinned_host_cache():
    c = to_torch(worked_example([4, 2, 7]), "cuda", pin_host_cache=True)
    swap(**c.kwargs())
    torch.cuda.synchronize()
    assert c.out.tolist() == [[7, 3, 11]]
    assert c.lru.tolist() == [[0, 3, 1, 2]]
    kvtier.sglang.check(torch.cuda.current_device())


@cuda
@pytest.mark.parametrize("seed", range(100))
def test_cuda_matches_the_cpu_executor(seed):
    base = random_case(seed)
    cpu_case = random_case(seed)
    swap(**cpu_case.kwargs())
    g = to_torch(base, "cuda", pin_host_cache=True)
    # the output view: a fresh CUDA tensor (the numpy view's strides are kept by copy)
    swap(**g.kwargs())
    torch.cuda.synchronize()
    assert g.out.cpu().tolist() == cpu_case.out.tolist()
    assert g.tokens.cpu().tolist() == cpu_case.tokens.tolist()
    assert g.lru.cpu().tolist() == cpu_case.lru.tolist()
    assert (g.device_buffer.cpu().numpy().view(np.uint8) == as_bytes(cpu_case.device_buffer)).all()


@cuda
def test_cuda_bad_indices_are_reported_at_check():
    c = to_torch(worked_example([4, 9, 7]), "cuda", pin_host_cache=True)
    swap(**c.kwargs())
    with pytest.raises(KvtierError) as e:
        kvtier.sglang.check(torch.cuda.current_device())
    assert e.value.status == "BAD_INDICES" and "top_k_tokens[0][1] = 9" in str(e.value)
    assert c.out.tolist() == [[7, -1, 11]]


@cuda
def test_cuda_refuses_an_unregistered_host_cache():
    c = to_torch(worked_example([6]), "cuda", pin_host_cache=False)
    c.host_cache = c.host_cache.cpu()  # pageable
    with pytest.raises(KvtierError, match="not page-locked"):
        swap(**c.kwargs())


@cuda
def test_cuda_graph_capture_and_replay():
    c = to_torch(worked_example([6]), "cuda", pin_host_cache=True)
    kvtier.sglang.reserve(4, 1, torch.cuda.current_device())
    lru0, tokens0 = c.lru.clone(), c.tokens.clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        swap(**c.kwargs())  # warm-up outside capture
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    c.lru.copy_(lru0)
    c.tokens.copy_(tokens0)
    with torch.cuda.graph(graph, stream=s):
        swap(**c.kwargs())
    c.lru.copy_(lru0)
    c.tokens.copy_(tokens0)
    c.out.fill_(-7)
    c.device_buffer.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    assert c.out.tolist() == [[9]]
    assert (c.device_buffer[9 * ITEM : 10 * ITEM] == 6).all()
