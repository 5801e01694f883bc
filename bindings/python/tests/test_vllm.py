"""kvtier's vLLM plugin against vLLM 0.33.0's own code: its source (read by
the install report, in a fresh interpreter, as inside vLLM) and its real
HiSparse runtime module (imported with real torch on the CPU, from the
pure-Python tree scripts/python-env.sh installs under .tools/vllm/<version>),
whose HiSparseHostPool gets its per-rank pool from a kvtier region.

vLLM's kernels need CUDA; as vLLM's own host-pool tests do, the CUDA
registration (its ``pin_tensor``) is replaced by a recorder on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kvtier
from kvtier import vllm as kv_vllm

PACKAGE_ROOT = Path(kvtier.__file__).resolve().parents[1]
TREES = Path(os.environ.get("KVTIER_VLLM_TREES", Path(__file__).resolve().parents[3] / ".tools/vllm"))
TREE = TREES / kv_vllm.CHECKED_VERSIONS[0]
if os.environ.get("KVTIER_REQUIRE_SGLANG_SOURCE") == "1" and not (TREE / "vllm").is_dir():
    raise RuntimeError(f"vLLM tree {TREE} not found: run scripts/python-env.sh")
needs_tree = pytest.mark.skipif(not (TREE / "vllm").is_dir(), reason="no vLLM tree (scripts/python-env.sh)")

REPORT = """
import json, sys, kvtier.vllm as k
r = k.report(sys.argv[1])
print(json.dumps({"installs": r.installs, "refusal": r.refusal, "version": r.vllm_version, "lines": r.lines()}))
"""


def report_in(tree: Path, config: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(PACKAGE_ROOT)]))
    run = subprocess.run([sys.executable, "-c", REPORT, json.dumps(config)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tree)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@needs_tree
def test_vllm_0_33_0_gets_the_per_rank_and_the_shared_pool(shm):
    r = report_in(TREE, {"devices": [f"file:{shm / 'cxl0'}:64MiB"]})
    assert r["installs"] and r["version"] == "0.33.0", r["refusal"]
    assert r["lines"][0] == "kvtier: installed into vLLM 0.33.0"
    assert any(line.split()[0] == "HiSparseHostPool.allocate" and " kvtier " in line for line in r["lines"])
    assert any("shared single-node TP pool" in line and " kvtier " in line for line in r["lines"])
    r = report_in(TREE, {"devices": ["anon"]})
    assert any("shared single-node TP pool" in line and " vLLM " in line and "one process" in line
               for line in r["lines"])


@needs_tree
@pytest.mark.parametrize("edit,why", [
    (("runtime.py", "def allocate(self, size: int)", "def allocate(self, size: int, pinned: bool = True)"),
     "HiSparseHostPool.allocate takes"),
    (("runtime.py", "self.shared_region: SharedOffloadRegion | None = None", "self.region = None"),
     "does not set ['shared_region']"),
    (("runtime.py", "def check_hisparse_host_memory(", "def check_host_memory("), "no check_hisparse_host_memory"),
    (("binding.py", "host_pool.allocate(host_size)", "host_pool.allocate(host_size, layout)"),
     "no longer calls host_pool.allocate(size)"),
])
def test_a_vllm_kvtier_does_not_know_is_left_alone(tmp_path, edit, why):
    tree = tmp_path / "tree"
    shutil.copytree(TREE / "vllm" / "v1" / "hisparse", tree / "vllm" / "v1" / "hisparse")
    for d in TREE.glob("vllm-*.dist-info"):
        shutil.copytree(d, tree / d.name)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "v1" / "__init__.py").write_text("")
    name, old, new = edit
    f = tree / "vllm" / "v1" / "hisparse" / name
    text = f.read_text()
    assert old in text, f"vLLM 0.33.0's {name} no longer has {old!r}"
    f.write_text(text.replace(old, new))
    r = report_in(tree, {"devices": ["anon"]})
    assert not r["installs"] and why in r["refusal"], r["refusal"]
    assert r["lines"] == [f"kvtier: not installed into vLLM ({r['refusal']}); vLLM runs unchanged"]


def test_a_bad_config_is_refused_in_one_line():
    with pytest.raises(kvtier.KvtierError, match="unknown keys"):
        kv_vllm.load_config({"device": ["anon"]})
    with pytest.raises(kvtier.KvtierError, match="device"):
        kv_vllm.load_config({"devices": ["cxl0"]})


# ---- vLLM's real runtime module ---------------------------------------------------


def _runtime():
    """vLLM 0.33.0's HiSparse runtime, imported from the tree (None where
    torch or the tree is missing)."""
    if not (TREE / "vllm").is_dir():
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    if str(TREE) not in sys.path:
        sys.path.insert(0, str(TREE))
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module("vllm.v1.hisparse.runtime")


needs_runtime = pytest.mark.skipif(_runtime() is None, reason="needs torch and the vLLM tree")


@pytest.fixture
def shm(tmp_path):
    """A folder on tmpfs (a file device must be memory CUDA can register)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvtier-vllm-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def runtime(monkeypatch):
    rt = _runtime()
    pinned = []
    monkeypatch.setattr(rt, "pin_tensor", lambda t: pinned.append((t.data_ptr(), t.numel())))
    yield types.SimpleNamespace(module=rt, pinned=pinned)
    kv_vllm.uninstall()


def new_pool(rt, shared=False):
    return rt.HiSparseHostPool(types.SimpleNamespace(instance_id="t"),
                               types.SimpleNamespace(hisparse_shared_host_pool=shared))


@needs_runtime
def test_the_per_rank_pool_is_a_kvtier_region_registered_by_vllms_own_call(runtime, shm):
    rt = runtime.module
    device = f"file:{shm / 'cxl0'}:256MiB"
    rep = kv_vllm.install({"devices": [device], "rank": 1, "ranks": 2})
    assert rep.installs, rep.lines()
    pool = new_pool(rt)
    size = 10 * 2**20 + 656 * 64  # not a whole page
    backing = pool.allocate(size)
    assert backing.dtype.is_floating_point is False and backing.dtype.itemsize == 1 and backing.numel() == size
    region = pool._kvtier_allocator.regions[0]
    assert backing.data_ptr() == region.host_addr and region.host_addr % 4096 == 0
    assert pool.registered.data_ptr() == backing.data_ptr() and pool.registered.numel() % 4096 == 0
    assert pool.registered.numel() >= size
    assert runtime.pinned == [(pool.registered.data_ptr(), pool.registered.numel())]
    # the bytes are the region's: every byte written through vLLM's tensor, read back through kvtier
    import torch

    pattern = (torch.arange(size) % 251).to(torch.int8)
    backing.copy_(pattern)
    assert bytes(region.numpy("uint8", None)[:size]) == pattern.numpy().tobytes()
    # the same size again: the same pool (vLLM's profiling pass, then the real one)
    assert pool.allocate(size) is backing
    with pytest.raises(kvtier.KvtierError, match="size changed"):
        pool.allocate(size + 4096)


@needs_runtime
def test_placement_nearest_puts_the_rank_on_the_nodes_nearest_its_gpu(runtime, monkeypatch, caplog):
    """numa: devices with placement "nearest": the rank's pool interleaves
    the configured nodes nearest its GPU (the GPU and the topology stood in
    for; node 0, the only node here, holds the pages)."""
    import logging

    from kvtier.sglang import topology

    rt = runtime.module
    rep = kv_vllm.install({"devices": ["numa:0"], "placement": "nearest", "rank": 1, "ranks": 2})
    assert rep.installs and "nearest each rank's GPU" in rep.lines()[1], rep.lines()
    picked = []

    def nearest(devices, gpu_node, *a):
        picked.append((list(devices), gpu_node))
        return topology.Choice(device="numa:0", nodes=(0,), distance=10, gpu_node=gpu_node)

    monkeypatch.setattr(topology, "nearest", nearest)
    monkeypatch.setattr(topology, "current_gpu", lambda: 1)
    monkeypatch.setattr(topology, "gpu_numa_node", lambda g: g)
    pool = new_pool(rt)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        backing = pool.allocate(3 * 4096 + 100)
    assert picked == [(["numa:0"], 1)]
    assert backing.numel() == 3 * 4096 + 100 and runtime.pinned == [(pool.registered.data_ptr(), 4 * 4096)]
    assert "in kvtier region 0 on numa:0" in caplog.text
    with pytest.raises(kvtier.KvtierError, match="placement"):
        kv_vllm.load_config({"devices": ["anon"], "placement": "closest"})


@needs_runtime
def test_a_pool_beyond_the_kvtier_device_is_refused_saying_what_to_lower(runtime, shm):
    kv_vllm.install({"devices": [f"file:{shm / 'small'}:64MiB"], "rank": 0, "ranks": 1})
    with pytest.raises(kvtier.KvtierError, match="host_pool_gib"):
        new_pool(runtime.module).allocate(200 * 2**20)
    assert runtime.pinned == []


@needs_runtime
def test_with_private_devices_the_shared_tp_pool_stays_vllms(runtime, monkeypatch):
    """hisparse_shared_host_pool on anon devices: vLLM's own path runs (its
    shared region), and the report says why."""
    import torch

    rt = runtime.module
    rep = kv_vllm.install({"devices": ["anon"], "rank": 0, "ranks": 1})
    assert not rep.shared and any("memory of one process" in line for line in rep.lines())
    base = torch.zeros(8192, dtype=torch.int8)
    calls = []

    def fake_shared(vllm_config, tensor_sizes, num_blocks, stride, *, use_shared_host_pool):
        calls.append((tensor_sizes, num_blocks, stride, use_shared_host_pool))
        return [], [], types.SimpleNamespace(base_tensor=base, cleanup=lambda: None)

    monkeypatch.setattr(rt, "allocate_hisparse_host_pools", fake_shared)
    pool = rt.HiSparseHostPool(types.SimpleNamespace(instance_id="t"), types.SimpleNamespace(
        hisparse_shared_host_pool=True, kv_cache_tensors=[], hisparse_host_num_blocks=2,
        hisparse_host_block_stride=4096))
    backing = pool.allocate(6000)
    assert calls == [([], 2, 4096, True)] and backing.data_ptr() == base.data_ptr()
    assert not hasattr(pool, "_kvtier_allocator")


@needs_runtime
def test_uninstall_gives_vllm_its_allocate_back(runtime, shm):
    rt = runtime.module
    original, original_shared = rt.HiSparseHostPool.allocate, rt.allocate_hisparse_host_pools
    kv_vllm.install({"devices": [f"file:{shm / 'cxl0'}:64MiB"]})
    assert rt.HiSparseHostPool.allocate is not original and rt.allocate_hisparse_host_pools is not original_shared
    # installing another config replaces the first: anon devices leave the shared pool to vLLM
    kv_vllm.install({"devices": ["anon"]})
    assert rt.HiSparseHostPool.allocate is not original and rt.allocate_hisparse_host_pools is original_shared
    kv_vllm.uninstall()
    assert rt.HiSparseHostPool.allocate is original and rt.allocate_hisparse_host_pools is original_shared


# ---- the shared single-node TP pool: two TP ranks, two processes ------------------------

# One TP rank: vLLM 0.33.0's real runtime module with real torch on the CPU,
# its TP group replaced by one over files (broadcast_object, barrier), its
# CUDA registration calls by recorders, its registration chunk limit lowered
# so that the pool is registered in several chunks. vLLM's HiSparseHostPool
# allocates the shared pool (its own allocate, sizes and registration split);
# rank 0 writes, rank 1 reads and writes bytes of its own, each checks the
# other's; then vLLM's own release_pinned_state runs, rank 0 first.
TP_RANK = r"""
import json, os, pickle, sys, time, types
rank, world, d, device, chunk, linger = sys.argv[1:7]
rank, world, chunk, linger = int(rank), int(world), int(chunk), float(linger)
import torch
import vllm.v1.hisparse.runtime as rt
import vllm.v1.kv_offload.cpu.host_register as hr
import kvtier
import kvtier.vllm as kv

class Group:
    rank_in_group, world_size, n = rank, world, 0
    def _wait(self, path):
        t0 = time.time()
        while not os.path.exists(path):
            assert time.time() - t0 < 120, path
            time.sleep(0.005)
    def broadcast_object(self, obj=None, src=0):
        self.n += 1
        path = f"{d}/bcast{self.n}"
        if rank == src:
            with open(path + ".tmp", "wb") as f:
                pickle.dump(obj, f)
            os.rename(path + ".tmp", path)
            return obj
        self._wait(path)
        with open(path, "rb") as f:
            return pickle.load(f)
    def barrier(self):
        self.n += 1
        open(f"{d}/barrier{self.n}.{rank}", "w").close()
        for r in range(world):
            self._wait(f"{d}/barrier{self.n}.{r}")

group, pinned, unpinned = Group(), [], []
rt.get_tp_group = lambda: group
rt.pin_tensor = lambda t: pinned.append((t.data_ptr(), t.numel()))
hr.host_unregister = lambda ptr: unpinned.append(ptr)
vllm_ranges = rt._hisparse_registration_ranges
rt._hisparse_registration_ranges = lambda *a: vllm_ranges(*a, max_chunk_bytes=chunk)
rep = kv.install({"devices": [device], "rank": rank, "ranks": world})
assert rep.installs and rep.shared, rep.lines()

# vLLM's KV cache config: 3 layers of 2048 B blocks, 2 of 1312 B (two fp8
# DSA rows), and a device-resident tensor; 64 host blocks of a page-rounded
# 12288 B
T = types.SimpleNamespace
blocks, stride = 64, 12288
tensors = [T(offset=0, layer_stride=blocks * 2048, layers=[0, 1, 2], host_resident=True),
           T(offset=3 * blocks * 2048, layer_stride=blocks * 1312, layers=[3, 4], host_resident=True),
           T(offset=0, layer_stride=4096, layers=[0], host_resident=False)]
sizes = [blocks * 2048] * 3 + [blocks * 1312] * 2
pool = rt.HiSparseHostPool(T(instance_id="t"), T(hisparse_shared_host_pool=True, kv_cache_tensors=tensors,
                                                  hisparse_host_num_blocks=blocks, hisparse_host_block_stride=stride))
try:
    backing = pool.allocate(sum(sizes))
except kvtier.KvtierError as e:
    print(json.dumps({"error": e.message}))
    sys.exit(0)
region = pool.shared_region
base = region.base_tensor
out = {"total": base.numel(), "size": backing.numel(), "same": backing.data_ptr() == base.data_ptr(),
       "registered": pool.registered.data_ptr() == base.data_ptr(), "joined": region.region.joined,
       "index": region.region.index, "epoch": region.region.epoch,
       "chunks": [(p - base.data_ptr(), n) for p, n in pinned],
       "vllm_ranges": [list(r) for r in vllm_ranges(sizes, blocks, stride, max_chunk_bytes=chunk)]}
assert pool.allocate(sum(sizes)) is backing  # the profiling pass's pool, reused
# every byte of the pool: written by one rank, read back by the other
pattern = (torch.arange(backing.numel()) % 251).to(torch.int8)
if rank == 0:  # TP rank 0 is vLLM's host writer
    backing.copy_(pattern)
group.barrier()
out["sees_rank0"] = bool(torch.equal(backing, pattern))
group.barrier()
last = slice(sum(sizes) - sizes[-1], sum(sizes))
if rank == 1:
    backing[last] = -7
group.barrier()
pattern[last] = -7
out["sees_rank1"] = bool(torch.equal(backing, pattern))
group.barrier()
time.sleep(linger)  # rank 1 lingers: rank 0 lets go of the region first
t0 = time.time()
torch.accelerator.synchronize = lambda: None  # no GPU here
torch.cuda.cudart = lambda: None
rt.release_pinned_state([], [], region)
out["cleanup_s"] = time.time() - t0
out["unpinned"] = [p - pinned[0][0] for p in unpinned]
out["released"] = region.region is None and region.pinned_addresses == []
# vLLM's pool still holds its tensors after the release, as with its own
# region: they stay mapped and readable until they go
out["readable"] = bool(torch.equal(backing, pattern))
del pool, backing, base, region, pattern
rt.drop_hisparse_host_pool(T(instance_id="t"))
import gc
gc.collect()
print(json.dumps(out))
"""


def run_tp_group(shm, device: str, chunk: int, linger: float = 0.0) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TREE), str(PACKAGE_ROOT)]))
    ranks = [subprocess.Popen([sys.executable, "-c", TP_RANK, str(r), "2", str(shm), device, str(chunk),
                               str(linger if r == 1 else 0.0)], env=env, cwd=shm, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in ranks:
        try:
            stdout, stderr = p.communicate(timeout=300)
        finally:
            p.kill()
        assert p.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@needs_runtime
def test_the_shared_tp_pool_is_one_kvtier_region_the_tp_ranks_share(shm):
    device = f"file:{shm / 'cxl0'}:16MiB"
    r0, r1 = run_tp_group(shm, device, chunk=192 * 1024, linger=1.0)
    for r in (r0, r1):
        assert r["total"] == 64 * 12288 and r["size"] == 64 * (3 * 2048 + 2 * 1312)
        assert r["same"] and r["registered"]
        # registered in vLLM's own chunks, every byte once, at each process's own addresses
        assert [list(c) for c in r["chunks"]] == [[s, e - s] for s, e in r["vllm_ranges"]]
        assert len(r["chunks"]) > 1 and r["chunks"][-1][0] + r["chunks"][-1][1] == r["total"]
        assert r["unpinned"] == [c[0] for c in reversed(r["chunks"])] and r["released"]
        # one copy: each rank sees the other's bytes
        assert r["sees_rank0"] and r["sees_rank1"] and r["readable"]
        assert r["cleanup_s"] < 5, r["cleanup_s"]
    assert (r0["index"], r0["epoch"]) == (r1["index"], r1["epoch"])
    assert not r0["joined"] and r1["joined"]
    # rank 0 let go while rank 1 still mapped the region; rank 1, the last to
    # leave, freed it (kvtier pool status reclaims nothing)
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))
    status = subprocess.run([sys.executable, "-m", "kvtier", "pool", "status", "--json", "--device", device],
                            env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    regions = json.loads(status.stdout)["regions"]
    assert regions["allocated"] == regions["ready"] == regions["joined"] == 0, regions


@needs_runtime
def test_a_shared_tp_pool_beyond_the_devices_fails_on_every_rank(shm):
    r0, r1 = run_tp_group(shm, f"file:{shm / 'small'}:2MiB", chunk=1 << 30)
    assert "host_pool_gib" in r0["error"], r0
    assert r1["error"].startswith("TP rank 0 could not place the shared pool") and "host_pool_gib" in r1["error"]


@needs_runtime
def test_vllms_own_plugin_loader_installs_kvtier_from_its_entry_point(tmp_path, shm):
    """vLLM's load_general_plugins finds kvtier through the entry point the
    package declares (pyproject.toml, as an installed wheel would record
    it) and installs with KVTIER_VLLM_CONFIG set, in a fresh interpreter."""
    import tomllib

    # the checkout's pyproject.toml (the package under test may be an installed wheel)
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    dist = tmp_path / "kvtier-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier\nVersion: 0.0.0\n")
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
             for group, eps in project["entry-points"].items()]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    script = ("import vllm.plugins as p, vllm.v1.hisparse.runtime as rt; p.load_general_plugins(); "
              "print(hasattr(rt.HiSparseHostPool, '_kvtier_original_allocate'), "
              "rt.allocate_hisparse_host_pools.__module__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(TREE), str(PACKAGE_ROOT)]))
    for config, want in ((json.dumps({"devices": [f"file:{shm / 'cxl0'}:64MiB"]}),
                          "True kvtier.vllm.host_pool"), (None, "False vllm.v1.hisparse.runtime")):
        env.pop(kv_vllm.ENV, None)
        if config:
            env[kv_vllm.ENV] = config
        # run in tmp_path: a package's build metadata in the working directory would shadow the dist-info
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip().splitlines()[-1] == want, run.stdout + run.stderr[-3000:]


def test_the_plugin_does_nothing_without_its_config(monkeypatch):
    monkeypatch.delenv(kv_vllm.ENV, raising=False)
    called = []
    monkeypatch.setattr(kv_vllm, "install", lambda *a, **k: called.append(1))
    kv_vllm.register()
    assert called == []
    monkeypatch.setenv(kv_vllm.ENV, json.dumps({"devices": ["anon"]}))
    kv_vllm.register()
    assert called == [1]
