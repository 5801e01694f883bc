"""install() against a stand-in SGLang package (tests/conftest.py: 0.5.23's
HiSparse entry points, coordinator and host pools): every entry point kvtier
serves and every host pool is replaced whether the coordinator is imported
before or after, the report says who serves what, an SGLang kvtier does not
know is left alone, SGLang's plugin hook installs from the environment, and
`python -m kvtier.sglang` reaches the processes SGLang spawns."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import worked_example

import kvtier.sglang
from kvtier.sglang import compat

COORD = "sglang.srt.managers.hisparse_coordinator"
PACKAGE_ROOT = Path(kvtier.__file__).resolve().parents[1]
SERVED = ["load_cache_to_device_buffer_mla", "load_cache_to_device_buffer_dsv4_mla", "copy_cache_planned_mla",
          "load_blocks_to_device_buffer_mha"]
POOLS = ["MLATokenToKVPoolHost", "DeepSeekV4PagedHostPool", "HiSparseMHATokenToKVPoolHost"]


def swap_args(c, **extra):
    a = dict(c.kwargs(), miss_src=None, miss_dst=None, miss_count=None)
    a.update(extra)
    return a


def test_install_before_the_coordinator_is_imported(fake_sglang):
    rep = kvtier.sglang.install({"devices": ["anon"], "rank": 0, "ranks": 1})
    assert rep.installs and rep.sglang_version == "0.5.23"
    assert json.loads(os.environ[kvtier.sglang.ENV]) == json.loads(rep.config.to_json())
    assert [r.name for r in rep.routes if r.served_by == "kvtier"] == SERVED + POOLS
    assert [(r.name, r.served_by) for r in rep.routes if r.served_by != "kvtier"] == [
        (compat.SPEC, "SGLang"), *((route, "absent") for route in compat.HICACHE_POOLS), ("_HostTable", "absent"),
        ("engram_gather", "absent")]
    coord = importlib.import_module(COORD)
    for name in SERVED:
        assert getattr(coord, name) is getattr(kvtier.sglang, name)

    # The coordinator's calls, with SGLang's keywords, now run kvtier's (on
    # numpy: the CPU executor), miss plan and replay included.
    c = worked_example([6])
    src, dst, cnt = np.zeros((1, 2), np.int64), np.zeros((1, 2), np.int32), np.zeros(1, np.int32)
    hc = coord.HiSparseCoordinator()
    hc.swap_in(swap_args(c, miss_src=src, miss_dst=dst, miss_count=cnt), record_plan=True)
    assert c.out.tolist() == [[9]] and cnt.tolist() == [1] and (src[0, 0], dst[0, 0]) == (6, 9)
    other_layer = np.zeros_like(c.device_buffer)
    hc.replay(dict(miss_src=src, miss_dst=dst, miss_count=cnt, num_real_reqs=np.array([1], np.int32),
                   host_cache=c.host_cache, device_buffer=other_layer, item_size_bytes=16))
    assert (other_layer[9 * 16 : 10 * 16] == 6).all() and not other_layer[: 9 * 16].any()
    with pytest.raises(RuntimeError, match="SGLang's own load_cache_to_device_buffer_spec_mla ran"):
        hc.spec_swap_in()

    # The host pools sit in kvtier regions.
    pool = hc.mem_pool_host
    assert isinstance(pool.allocator, kvtier.sglang.KvtierHostTensorAllocator)
    assert pool.kv_buffer.shape == (2, 16, 1, 16)
    assert pool.kv_buffer.ctypes.data == pool.allocator.regions[0].host_addr

    kvtier.sglang.uninstall()
    assert coord.load_cache_to_device_buffer_mla is not kvtier.sglang.load_cache_to_device_buffer_mla
    with pytest.raises(RuntimeError, match="SGLang's own load_cache_to_device_buffer_mla ran"):
        coord.HiSparseCoordinator().swap_in(swap_args(worked_example([6])))
    assert type(coord.HiSparseCoordinator().mem_pool_host.kv_buffer) is np.ndarray


def test_every_host_pool_is_placed_in_kvtier(fake_sglang):
    kvtier.sglang.install({"devices": ["anon"], "rank": 0, "ranks": 1})
    coord = importlib.import_module(COORD)
    # MiniMax-M3: [2, layers, rows, heads, head_dim], K then V, one region of 2 x layers layers
    mha = coord.HiSparseCoordinator("mha", layers=3, rows=8, dim=16).mem_pool_host
    region = mha.allocator.regions[0]
    assert mha.kv_buffer.shape == (2, 3, 8, 1, 16) and mha.kv_buffer.ctypes.data == region.host_addr
    assert region.nbytes == 2 * 3 * 8 * 16
    # DeepSeek-V4: one [pages, page bytes] buffer per layer, the layers of one region
    dsv4 = coord.HiSparseCoordinator("dsv4", layers=3, rows=2, dim=37440).mem_pool_host
    region = dsv4.allocator.regions[0]
    assert len(dsv4.allocator.regions) == 1 and region.nbytes == 3 * 2 * 37440
    assert [b.ctypes.data - region.host_addr for b in dsv4.kv_buffer] == [0, 2 * 37440, 4 * 37440]
    assert all(b.shape == (2, 37440) for b in dsv4.kv_buffer)


def test_install_after_the_coordinator_is_imported(fake_sglang):
    coord = importlib.import_module(COORD)
    original_pool = coord.MLATokenToKVPoolHost
    rep = kvtier.sglang.install({"host_pool": False})
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla
    assert coord.MLATokenToKVPoolHost is original_pool, "host pool left alone"
    assert {r.name: r.served_by for r in rep.routes}["DeepSeekV4PagedHostPool"] == "SGLang"
    kvtier.sglang.install({"host_pool": False})  # idempotent
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla


def test_the_report_says_who_serves_what(fake_sglang):
    rep = kvtier.sglang.report(kvtier.sglang.KvtierConfig(devices=["numa:0"], swap_in=False))
    lines = rep.lines()
    assert lines[0].startswith("kvtier: would install into SGLang 0.5.23 on "), "a report installs nothing"
    by_name = {r.name: r for r in rep.routes}
    assert by_name["load_cache_to_device_buffer_mla"].served_by == "SGLang"
    assert "swap_in is off" in by_name["copy_cache_planned_mla"].why
    assert by_name["MLATokenToKVPoolHost"].served_by == "kvtier" and "numa:0" in by_name["MLATokenToKVPoolHost"].why
    assert any("load_cache_to_device_buffer_spec_mla" in line and "speculative" in line for line in lines)


def test_an_sglang_with_unknown_arguments_is_left_alone(fake_sglang):
    """SGLang's main branch passes device_locs= and host_binding=: installing
    kvtier there must refuse at once, not fail at the first decode step."""
    kernels = fake_sglang / "sglang/kernels/ops/kvcache/hisparse.py"
    kernels.write_text(kernels.read_text().replace(
        "miss_count=None, skip_io=False):\n    raise RuntimeError(\"SGLang's own load_cache_to_device_buffer_mla",
        "miss_count=None, skip_io=False, device_locs=None, host_binding=None):\n"
        "    raise RuntimeError(\"SGLang's own load_cache_to_device_buffer_mla"))
    rep = kvtier.sglang.install()
    assert not rep.installs
    assert "`device_locs`" in rep.refusal and "load_cache_to_device_buffer_mla" in rep.refusal
    assert kvtier.sglang.ENV not in os.environ, "spawned processes do not install either"
    coord = importlib.import_module(COORD)
    assert coord.load_cache_to_device_buffer_mla.__module__.startswith("sglang."), "SGLang runs unchanged"
    assert coord.MLATokenToKVPoolHost.__module__.startswith("sglang.")
    assert rep.lines() == [f"kvtier: not installed into SGLang ({rep.refusal}); SGLang runs unchanged"]


def test_a_coordinator_passing_unknown_keywords_is_left_alone(fake_sglang):
    coordinator = fake_sglang / "sglang/srt/managers/hisparse_coordinator.py"
    text = coordinator.read_text()
    assert 'is_dsv4_layout=self.kind == "dsv4",' in text
    coordinator.write_text(text.replace('is_dsv4_layout=self.kind == "dsv4",',
                                        'is_dsv4_layout=self.kind == "dsv4", host_binding=None,'))
    rep = kvtier.sglang.install()
    assert not rep.installs and "host_binding" in rep.refusal, rep.refusal


def test_live_functions_are_checked_when_the_module_is_patched(fake_sglang):
    rep = kvtier.sglang.install()
    assert rep.installs
    # The source said 0.5.23; the module that loads is something else.
    kernels = fake_sglang / "sglang/kernels/ops/kvcache/hisparse.py"
    kernels.write_text(kernels.read_text().replace("block_size=1024, is_dsv4_layout=False",
                                                   "block_size=512, is_dsv4_layout=False"))
    coord = importlib.import_module(COORD)
    assert coord.copy_cache_planned_mla.__module__.startswith("sglang."), "nothing replaced"
    assert not kvtier.sglang.installed_report().installs
    assert "block_size" in kvtier.sglang.installed_report().refusal


def test_rocm_and_xpu_install_nothing(fake_sglang, monkeypatch):
    monkeypatch.setattr(compat, "platform", lambda: ("ROCm 6.3", "ROCm: kvtier's kernels are CUDA"))
    rep = kvtier.sglang.install()
    assert not rep.installs and rep.refusal.startswith("ROCm")
    coord = importlib.import_module(COORD)
    assert coord.load_cache_to_device_buffer_mla.__module__.startswith("sglang.")


def test_without_sglang_install_says_so(monkeypatch):
    monkeypatch.setattr(compat, "sglang_root", lambda: None)
    rep = kvtier.sglang.install()
    assert not rep.installs and "SGLang is not installed" in rep.refusal


def test_the_sglang_plugin_installs_from_the_environment(fake_sglang, monkeypatch):
    from kvtier.sglang import plugin

    plugin.register()  # no KVTIER_SGLANG_CONFIG: nothing happens
    assert kvtier.sglang.current_config() is None
    monkeypatch.setenv(kvtier.sglang.ENV, json.dumps({"devices": ["anon:64MiB"], "swap_in": True}))
    plugin.register()
    assert kvtier.sglang.current_config().devices == ["anon:64MiB"]
    coord = importlib.import_module(COORD)
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla


def launch(fake_sglang, tmp_path, config: dict, *args):
    cfg = tmp_path / "kvtier.json"
    cfg.write_text(json.dumps(config))
    env = dict(os.environ)
    env.pop(kvtier.sglang.ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(fake_sglang), str(PACKAGE_ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "kvtier.sglang", *args[:2], "--kvtier-config", str(cfg), *args[2:]],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_launcher_reaches_spawned_processes(fake_sglang, tmp_path):
    args = ["--model-path", "deepseek-ai/DeepSeek-V3.2", "--enable-hisparse", "--hisparse-config",
            '{"top_k": 2048, "device_buffer_size": 4096}']
    run = launch(fake_sglang, tmp_path, {"devices": ["anon"], "strategy": "plan_then_copy"}, *args)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "argv " + " ".join(args), "SGLang's arguments pass through unchanged"
    assert "parent swap-in from kvtier.sglang.entry_points host pool kvtier[MLATokenToKVPoolHost]" in lines
    assert "child swap-in from kvtier.sglang.entry_points host pool kvtier[MLATokenToKVPoolHost]" in lines, run.stdout
    assert "kvtier: installed into SGLang 0.5.23" in run.stderr
    for name in SERVED + POOLS + [compat.SPEC]:
        assert name in run.stderr, f"the launcher reports {name}"


def test_the_launcher_runs_sglang_serve(fake_sglang, tmp_path):
    args = ["--model-path", "deepseek-ai/DeepSeek-V3.2", "--enable-hisparse"]
    run = launch(fake_sglang, tmp_path, {"devices": ["anon"]}, "serve", *args)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "serve argv " + " ".join(args)
    assert "child swap-in from kvtier.sglang.entry_points host pool kvtier[MLATokenToKVPoolHost]" in lines, run.stdout
    assert "kvtier: installed into SGLang 0.5.23" in run.stderr


@pytest.mark.parametrize("hisparse, refused", [
    ('{"top_k": 2048, "device_buffer_size": 16384}', False),
    ('{"top_k": 2048, "device_buffer_size": 16385}', True),
    ('{"top_k": 8193}', True),  # device_buffer_size defaults to 2 x top_k
    ("not json", False),  # SGLang's to refuse
])
def test_a_hot_buffer_beyond_kvtiers_limit_installs_nothing(fake_sglang, tmp_path, hisparse, refused):
    for args in (["--hisparse-config", hisparse], [f"--hisparse-config={hisparse}"]):
        run = launch(fake_sglang, tmp_path, {"devices": ["anon"]}, "--enable-hisparse", *args)
        assert run.returncode == 0, run.stdout + run.stderr
        if refused:
            assert "kvtier: not installed into SGLang (--hisparse-config asks for device_buffer_size" in run.stderr
            assert "at most 16384 slots per request" in run.stderr
            assert "parent swap-in from sglang.kernels.ops.kvcache.hisparse" in run.stdout
            assert "child swap-in from sglang.kernels.ops.kvcache.hisparse" in run.stdout, "children too"
        else:
            assert "kvtier: installed into SGLang 0.5.23" in run.stderr, run.stderr


def test_the_launcher_says_when_it_installs_nothing(fake_sglang, tmp_path):
    kernels = fake_sglang / "sglang/kernels/ops/kvcache/hisparse.py"
    kernels.write_text(kernels.read_text().replace("skip_io=False):\n    raise RuntimeError(\"SGLang's own load_blocks",
                                                   "skip_io=False, extra=1):\n    raise RuntimeError(\"SGLang's own load_blocks"))
    run = launch(fake_sglang, tmp_path, {"devices": ["anon"]}, "--model-path", "m")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kvtier: not installed into SGLang" in run.stderr and "`extra`" in run.stderr
    assert "parent swap-in from sglang.kernels.ops.kvcache.hisparse host pool MLATokenToKVPoolHost" in run.stdout


# Hides an installed SGLang from a child process: a sitecustomize on its path
# drops every path entry that holds an `sglang` package, so the child sees an
# environment without SGLang, and the test holds where SGLang is installed.
HIDE_SGLANG = """
import os, sys
sys.path[:] = [p for p in sys.path if not os.path.exists(os.path.join(p or ".", "sglang"))]
"""


def test_the_launcher_without_sglang_exits_non_zero(tmp_path):
    cfg = tmp_path / "kvtier.json"
    cfg.write_text("{}")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_SGLANG)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), str(PACKAGE_ROOT)]))
    env.pop(kvtier.sglang.ENV, None)
    run = subprocess.run([sys.executable, "-m", "kvtier.sglang", "--kvtier-config", str(cfg)], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "SGLang is not installed" in run.stderr


def test_the_launcher_refuses_a_bad_config(fake_sglang, tmp_path):
    cfg = tmp_path / "bad.json"
    cfg.write_text('{"devices": ["tape:0"]}')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake_sglang), str(PACKAGE_ROOT)]))
    run = subprocess.run([sys.executable, "-m", "kvtier.sglang", "--kvtier-config", str(cfg)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "tape:0" in run.stderr and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_a_library_without_kernels_leaves_the_swap_in_to_sglang(fake_sglang, monkeypatch):
    monkeypatch.setattr(compat, "kernels_built", lambda: False)
    rep = kvtier.sglang.report(kvtier.sglang.KvtierConfig(devices=["anon"]))
    routes = {r.name: r for r in rep.routes}
    for name in SERVED:
        assert routes[name].served_by == "SGLang" and "no CUDA kernels" in routes[name].why, routes[name]
    assert routes["MLATokenToKVPoolHost"].served_by == "kvtier", "the host pool needs no kernels"


def test_the_version_is_the_imported_packages_not_another_copys(fake_sglang, tmp_path, monkeypatch):
    """Another SGLang's metadata later on the path (an installed release
    behind a source tree, say) does not name the version of the one imported."""
    other = tmp_path / "other"
    (other / "sglang-9.9.9.dist-info").mkdir(parents=True)
    (other / "sglang-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(other))
    monkeypatch.syspath_prepend(str(fake_sglang))  # the fake package first, as an import finds it
    assert compat.sglang_root() == fake_sglang
    assert compat.sglang_version(fake_sglang) == "0.5.23"
    assert kvtier.sglang.report(kvtier.sglang.KvtierConfig(devices=["anon"])).sglang_version == "0.5.23"


def test_a_numa_device_onlined_as_movable_is_warned_about(fake_sglang, monkeypatch):
    """CXL memory onlined as movable: registration with the GPU migrates the
    pool's pages off the node; the report says so, and how to fix it."""
    from kvtier import DeviceCapacity
    from kvtier.sglang import capacity

    caps = {"numa:1:4GiB": DeviceCapacity(4 << 30, False, True, 3 << 30),
            "numa:2:4GiB": DeviceCapacity(4 << 30, False, True, 0)}
    monkeypatch.setattr(capacity, "device_capacity", lambda d: caps[d])
    rep = kvtier.sglang.report(kvtier.sglang.KvtierConfig(devices=["numa:1:4GiB", "numa:2:4GiB"]))
    assert rep.installs and rep.served("MLATokenToKVPoolHost")
    assert len(rep.warnings) == 1 and rep.warnings[0].startswith("numa:1:4GiB: 3.0 GiB"), rep.warnings
    text = "\n".join(rep.lines())
    assert "warning: numa:1:4GiB" in text and "ZONE_MOVABLE" in text and "--no-movable" in text, text
    caps["numa:1:4GiB"] = DeviceCapacity(4 << 30, False, True, 0)
    assert kvtier.sglang.report(kvtier.sglang.KvtierConfig(devices=["numa:1:4GiB"])).warnings == []


def test_report_takes_what_install_takes_and_checks_it_the_same(fake_sglang, monkeypatch):
    rep = kvtier.sglang.report({"devices": ["numa:0"], "swap_in": False})
    assert rep.installs and not kvtier.sglang._patch.is_installed(importlib.import_module(COORD))
    assert {r.name: r.served_by for r in rep.routes}["load_cache_to_device_buffer_mla"] == "SGLang"
    for bad in ({"swap_inn": False}, {"strategy": "fastest"}):
        with pytest.raises(kvtier.KvtierError, match="kvtier config"):
            kvtier.sglang.report(bad)
    # without SGLang the same mistakes are refused, not passed over
    monkeypatch.setattr(kvtier.sglang.compat, "sglang_root", lambda: None)
    with pytest.raises(kvtier.KvtierError, match="swap_inn"):
        kvtier.sglang.report({"swap_inn": False})
    assert "not installed" in kvtier.sglang.report({}).lines()[0]


def test_the_launcher_says_a_config_error_in_one_line(fake_sglang, tmp_path):
    env = dict(os.environ)
    env.pop(kvtier.sglang.ENV, None)
    env.pop("KVTIER_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join([str(fake_sglang), str(PACKAGE_ROOT), env.get("PYTHONPATH", "")])
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{devices: anon")
    typo = tmp_path / "typo.json"
    typo.write_text('{"device": ["anon"]}')
    for path, says in [(tmp_path / "missing.json", "cannot read"), (bad_json, "is not valid JSON"),
                       (typo, "unknown keys ['device']")]:
        run = subprocess.run([sys.executable, "-m", "kvtier.sglang", "--kvtier-config", str(path), "--enable-hisparse"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stdout + run.stderr
        assert run.stderr.count("\n") == 1 and says in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_the_launcher_prints_its_report_once_and_warns_without_hisparse(fake_sglang, tmp_path):
    run = launch(fake_sglang, tmp_path, {"devices": ["anon"]}, "--model-path", "m")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr.count("kvtier: installed into SGLang") == 1, run.stderr
    assert "--enable-hisparse is not among SGLang's arguments" in run.stderr
    run = launch(fake_sglang, tmp_path, {"devices": ["anon"]}, "--model-path", "m", "--enable-hisparse")
    assert run.returncode == 0 and "--enable-hisparse is not" not in run.stderr, run.stderr
    kernels = fake_sglang / "sglang/kernels/ops/kvcache/hisparse.py"
    kernels.write_text(kernels.read_text().replace("skip_io=False):\n    raise RuntimeError(\"SGLang's own load_blocks",
                                                   "skip_io=False, extra=1):\n    raise RuntimeError(\"SGLang's own load_blocks"))
    run = launch(fake_sglang, tmp_path, {"devices": ["anon"]}, "--enable-hisparse")
    assert run.stderr.count("kvtier: not installed into SGLang") == 1, run.stderr
