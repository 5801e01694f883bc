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
def test_vllm_0_33_0_gets_the_per_rank_pool_and_keeps_the_shared_one():
    r = report_in(TREE, {"devices": ["anon"]})
    assert r["installs"] and r["version"] == "0.33.0", r["refusal"]
    assert r["lines"][0] == "kvtier: installed into vLLM 0.33.0"
    assert any(line.split()[0] == "HiSparseHostPool.allocate" and " kvtier " in line for line in r["lines"])
    assert any("shared single-node TP pool" in line and " vLLM " in line for line in r["lines"])


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
    # the bytes are the region's: written through the tensor, read back through kvtier
    backing[:4] = 7
    assert bytes(region.numpy("uint8", None)[:4]) == b"\x07" * 4
    # the same size again: the same pool (vLLM's profiling pass, then the real one)
    assert pool.allocate(size) is backing
    with pytest.raises(kvtier.KvtierError, match="size changed"):
        pool.allocate(size + 4096)


@needs_runtime
def test_a_pool_beyond_the_kvtier_device_is_refused_saying_what_to_lower(runtime, shm):
    kv_vllm.install({"devices": [f"file:{shm / 'small'}:64MiB"], "rank": 0, "ranks": 1})
    with pytest.raises(kvtier.KvtierError, match="host_pool_gib"):
        new_pool(runtime.module).allocate(200 * 2**20)
    assert runtime.pinned == []


@needs_runtime
def test_the_shared_tp_pool_stays_vllms(runtime, monkeypatch, shm):
    """hisparse_shared_host_pool: vLLM's own path runs (its shared region)."""
    import torch

    rt = runtime.module
    kv_vllm.install({"devices": [f"file:{shm / 'cxl0'}:64MiB"], "rank": 0, "ranks": 1})
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
    original = rt.HiSparseHostPool.allocate
    kv_vllm.install({"devices": [f"file:{shm / 'cxl0'}:64MiB"]})
    assert rt.HiSparseHostPool.allocate is not original
    kv_vllm.uninstall()
    assert rt.HiSparseHostPool.allocate is original


def test_the_plugin_does_nothing_without_its_config(monkeypatch):
    monkeypatch.delenv(kv_vllm.ENV, raising=False)
    called = []
    monkeypatch.setattr(kv_vllm, "install", lambda *a, **k: called.append(1))
    kv_vllm.register()
    assert called == []
    monkeypatch.setenv(kv_vllm.ENV, json.dumps({"devices": ["anon"]}))
    kv_vllm.register()
    assert called == [1]
