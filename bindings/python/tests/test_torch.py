"""The same swap-in tests with torch tensors: CPU tensors (the CPU executor)
wherever torch is installed, CUDA tensors (the CUDA executor, compared with
the CPU executor) where there is a GPU. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest
import hisparse_model as model
from conftest import ITEM, worked_example

torch = pytest.importorskip("torch")

import kvtier._swap_in  # noqa: E402
import kvtier.sglang  # noqa: E402
from kvtier import KvtierError  # noqa: E402
from kvtier.sglang import copy_cache_planned_mla  # noqa: E402
from kvtier.sglang import load_cache_to_device_buffer_mla as swap  # noqa: E402
from test_swap_in import ENTRY  # noqa: E402

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


def model_to_torch(c, device="cpu"):
    """A hisparse_model case as torch tensors on `device` (host caches pinned
    when the device is a GPU); CPU tensors share the numpy arrays' memory."""
    def t(a):
        return torch.from_numpy(a) if device == "cpu" else torch.from_numpy(np.ascontiguousarray(a)).to(device)

    for name in ("tokens", "locs", "lru", "host_locs", "query", "req", "seq", "num_real"):
        a = getattr(c, name)
        if a is not None:
            setattr(c, name, t(a))
    c.out = torch.from_numpy(c.out) if device == "cpu" else torch.full(tuple(c.out.shape), -7, dtype=torch.int32,
                                                                       device=device)
    c.hosts = [torch.from_numpy(h) if device == "cpu" else torch.from_numpy(h.copy()).pin_memory() for h in c.hosts]
    c.devices = [t(d) for d in c.devices]
    return c


@pytest.mark.parametrize("path", ["mla", "dsv4", "mha"])
@pytest.mark.parametrize("seed", range(30))
def test_random_cases_on_cpu_tensors(path, seed):
    c = model.random_case(seed, path)
    want = model.reference(c)
    ENTRY[path](**model_to_torch(c).kwargs())
    assert c.out.tolist() == want["out"].tolist()
    assert c.tokens.tolist() == want["tokens"].tolist()
    assert c.lru.tolist() == want["lru"].tolist()
    for d, w in zip(c.devices, want["devices"]):
        assert (d.numpy().view(np.uint8).reshape(-1) == w).all()


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


class ClaimsGpu(torch.Tensor):
    """A CPU tensor that reports itself on GPU `ordinal` through every
    attribute kvtier reads to place a call (is_cuda, is_cpu, device,
    get_device): what a CPU cannot make for real, for the checks that refuse
    a call mixing places before anything runs."""

    @staticmethod
    def __new__(cls, t, ordinal=0):
        r = torch.Tensor._make_subclass(cls, t)
        r.ordinal = ordinal
        return r

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False

    @property
    def device(self):
        return torch.device("cuda", self.ordinal)

    def get_device(self):
        return self.ordinal


class ByMethods(torch.Tensor):
    """A subclass that changes nothing: kvtier reads subclasses through
    their methods, plain tensors through DLPack."""


# (argument, its tensor made from a fresh worked example): layouts, dtypes and
# shapes that each read must see alike, valid and not
READS = {
    "a valid call": (None, None),
    "int32 LRU": ("lru_slots", lambda c: c.lru.to(torch.int32)),
    "bool LRU": ("lru_slots", lambda c: c.lru.to(torch.bool)),
    "strided host cache": ("host_cache", lambda c: torch.zeros((8, 2 * ITEM), dtype=torch.uint8)[:, ::2]),
    "transposed host cache": ("host_cache", lambda c: c.host_cache.reshape(ITEM, -1).t()),
    "empty host cache": ("host_cache", lambda c: c.host_cache[:0]),
    "bf16 device buffer": ("device_buffer", lambda c: c.device_buffer.view(torch.bfloat16)),
    "top-k broadcast to two rows": ("top_k_tokens", lambda c: c.topk.expand(2, -1)),
    "0-d request index": ("req_pool_indices", lambda c: c.req.reshape(())),
    "every other column of the output": ("top_k_device_locs",
                                         lambda c: torch.full((1, 6), -7, dtype=torch.int32)[:, ::2]),
    "a column of the query": ("top_k_tokens", lambda c: c.topk.t()),
}


@pytest.fixture
def reader():
    """Sets how plain tensors are read (kvtier._native.tensor_reader); the
    fastest again afterwards."""
    native = kvtier._swap_in.native()
    yield native.tensor_reader
    native.tensor_reader("auto")


def test_plain_tensors_are_read_through_torchs_exchange_table_where_it_has_one(reader):
    # torch 2.10+ has the table (tvm-ffi installs one on older torch)
    expect = "exchange" if hasattr(torch.Tensor, "__dlpack_c_exchange_api__") else "to_dlpack"
    assert reader() == expect
    assert reader("to_dlpack") == "to_dlpack" and reader("methods") == "methods"
    assert reader("auto") == expect
    with pytest.raises(KvtierError, match="`reader`"):
        reader("fast")


@pytest.mark.parametrize("read", READS)
def test_a_tensor_read_through_dlpack_is_read_as_through_its_methods(read, reader):
    """Every reader sees every argument alike: the exchange table (where
    torch has one), to_dlpack, the methods of a plain tensor, and those of a
    subclass (always read through its methods)."""
    arg, make = READS[read]
    seen = []
    for how, wrap in (("auto", lambda t: t), ("to_dlpack", lambda t: t), ("methods", lambda t: t),
                      ("auto", lambda t: t.as_subclass(ByMethods))):
        reader(how)
        c = to_torch(worked_example([4, 2, 7]))
        kw = c.kwargs(**({arg: make(c)} if arg else {}))
        kw = {k: wrap(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        try:
            swap(**kw)
            got = "ran"
        except KvtierError as e:
            got = str(e)
        seen.append((got, kw["top_k_device_locs"].tolist(), c.lru.tolist(), c.tokens.tolist()))
    assert seen[1:] == seen[:1] * 3, seen


def test_cpu_tensors_with_a_wrong_dtype_or_layout_are_refused():
    c = to_torch(worked_example([4, 2, 7]))
    with pytest.raises(KvtierError, match="`lru_slots`: is int32; it must be int16"):
        swap(**c.kwargs(lru_slots=c.lru.to(torch.int32)))
    strided = torch.zeros((8, 2 * ITEM), dtype=torch.uint8)[:, ::2]
    with pytest.raises(KvtierError, match="`host_cache`: must be contiguous"):
        swap(**c.kwargs(host_cache=strided))
    assert c.out.tolist() == [[-7, -7, -7]] and c.lru.tolist() == [[0, 1, 2, 3]], "nothing ran"


@pytest.mark.parametrize("where, expect", [
    ({"top_k_tokens": 0},
     "`device_buffer_tokens`: is on cpu; top_k_tokens is on cuda:0, and every tensor of a call must be on the "
     "same GPU"),
    ({"device_buffer_tokens": 1},
     "`device_buffer_tokens`: is on cuda:1; top_k_tokens is on the CPU, so the call runs on the CPU executor"),
    ({"top_k_tokens": 0, "device_buffer_tokens": 1},
     "`device_buffer_tokens`: is on cuda:1; top_k_tokens is on cuda:0, and every tensor"),
    # every tensor on GPU 0 but one index tensor: only the KV planes may stay in host memory
    ({"*": 0, "host_cache_locs": None, "host_cache": None},
     "`host_cache_locs`: is on cpu; top_k_tokens is on cuda:0, and every tensor"),
], ids=["one-on-a-gpu", "one-on-another-gpu", "two-gpus", "index-on-the-host"])
def test_a_call_mixing_places_is_refused_before_anything_runs(where, expect):
    c = to_torch(worked_example([4, 2, 7]))
    kw = {k: v for k, v in c.kwargs().items() if v is not None}
    for name, v in list(kw.items()):
        ordinal = where.get(name, where.get("*")) if isinstance(v, torch.Tensor) else None
        if ordinal is not None:
            kw[name] = ClaimsGpu(v, ordinal)
    with pytest.raises(KvtierError) as e:
        swap(**kw)
    assert expect in str(e.value), str(e.value)
    assert c.out.tolist() == [[-7, -7, -7]] and c.lru.tolist() == [[0, 1, 2, 3]], "nothing ran"


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
@pytest.mark.parametrize("path", ["mla", "dsv4", "mha"])
@pytest.mark.parametrize("seed", range(60))
def test_cuda_matches_the_cpu_executor(path, seed):
    cpu_case = model.random_case(seed, path)
    ENTRY[path](**cpu_case.kwargs())
    g = model_to_torch(model.random_case(seed, path), "cuda")
    ENTRY[path](**g.kwargs())
    torch.cuda.synchronize()
    assert g.out.cpu().tolist() == cpu_case.out.tolist()
    assert g.tokens.cpu().tolist() == cpu_case.tokens.tolist()
    assert g.lru.cpu().tolist() == cpu_case.lru.tolist()
    for d, want in zip(g.devices, cpu_case.devices):
        assert (d.cpu().numpy().view(np.uint8).reshape(-1) == model.as_bytes(want)).all()


@cuda
@pytest.mark.parametrize("path", ["mla", "dsv4"])
@pytest.mark.parametrize("seed", range(20))
def test_cuda_replays_match_the_cpu_executor(path, seed):
    """An anchor's recorded plan replayed into another layer, on both executors."""
    results = []
    for device in ("cpu", "cuda"):
        c = model.random_case(500 + seed, path)
        batch = len(c.req)
        plan = [np.zeros((batch, c.entries + 1), dtype=dt) for dt in (np.int64, np.int32)] + [
            np.zeros(batch, dtype=np.int32)]
        skip = [np.random.default_rng(seed).integers(0, 256, size=model.as_bytes(d).size, dtype=np.uint8)
                for d in c.devices]
        if device == "cuda":
            c = model_to_torch(c, "cuda")
            plan = [torch.from_numpy(p).cuda() for p in plan]
            skip = [torch.from_numpy(d).cuda() for d in skip]
        ENTRY[path](**c.kwargs(miss_src=plan[0], miss_dst=plan[1], miss_count=plan[2]))
        real = c.num_real if c.num_real is not None else (
            np.array([batch], np.int32) if device == "cpu" else torch.tensor([batch], dtype=torch.int32).cuda())
        copy_cache_planned_mla(miss_src=plan[0], miss_dst=plan[1], miss_count=plan[2], num_real_reqs=real,
                               host_cache=c.hosts[0], device_buffer=skip[0], item_size_bytes=c.rows.item,
                               is_dsv4_layout=path == "dsv4")
        if device == "cuda":
            torch.cuda.synchronize()
            skip = [d.cpu().numpy() for d in skip]
        results.append(skip[0].tobytes())
    assert results[0] == results[1]


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


def spec_on(device, num_reqs=1, scratch=4096, calls=2):
    """SGLang's 782-miss speculative query on `device` (torch tensors, the
    host cache pinned for CUDA), `calls` times; the state, outputs and device
    buffer come back as numpy for the invariant checks of test_spec_swap_in."""
    from kvtier.sglang import load_cache_to_device_buffer_spec_mla as spec
    from test_spec_swap_in import Swap, cross_step_misses

    s = Swap(num_reqs=num_reqs, hot=4096, page=64, scratch=scratch, seq_len=16384, words=72, occurrences=8192)
    dev = torch.device(device)

    def t(a):
        return torch.from_numpy(a) if device == "cpu" else torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    host = torch.from_numpy(s.host)
    if device != "cpu":
        host = host.pin_memory()
    tk = np.tile(cross_step_misses(), (num_reqs, 1, 1))
    state = type(s.state)(*(t(a) for a in s.state))
    tokens, locs, device_buffer = t(s.tokens), t(s.locs), t(s.device)
    outs = []
    for _ in range(calls):
        out = torch.full(tk.shape, -1, dtype=torch.int32, device=dev)
        spec(top_k_tokens=t(tk), device_buffer_tokens=tokens, host_cache_locs=t(s.host_locs),
             device_buffer_locs=locs, host_cache=host, device_buffer=device_buffer, top_k_device_locs=out,
             req_pool_indices=t(np.arange(num_reqs, dtype=np.int64)),
             seq_lens=t(np.full(4 * num_reqs, 16384, np.int32)), state=state,
             num_real_reqs=t(np.array([num_reqs], np.int32)))
        outs.append(out)
    if device != "cpu":
        torch.cuda.synchronize()
        kvtier.sglang.check(torch.cuda.current_device())
    s.tokens, s.locs, s.device = tokens.cpu().numpy(), locs.cpu().numpy(), device_buffer.cpu().numpy()
    s.state = type(s.state)(*(a.cpu().numpy() for a in state))
    return s, tk, [o.cpu().numpy() for o in outs]


def test_speculative_swap_in_on_cpu_tensors():
    s, tk, (first, second) = spec_on("cpu")
    s.assert_outputs_hold(first, tk)
    s.assert_outputs_hold(second, tk)
    assert s.misses() == 0, "the second call is all hits"
    s.assert_consistent()


@cuda
@pytest.mark.parametrize("scratch", [4096, 1024 + 4096])
def test_speculative_swap_in_on_cuda_keeps_every_invariant(scratch):
    """The kernel's state is not the CPU executor's (thread order), so the
    invariants: every output row holds its token, 782 misses then none, the
    state SGLang's next call needs."""
    s, tk, (first, second) = spec_on("cuda", num_reqs=3, scratch=scratch)
    s.assert_outputs_hold(first, tk)
    s.assert_outputs_hold(second, tk)
    assert all(s.misses(r) == 0 for r in range(3))
    s.assert_consistent()
