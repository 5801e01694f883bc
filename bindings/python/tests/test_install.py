"""install() against a stand-in SGLang package (tests/conftest.py): the
coordinator's module-level swap-in and host pool are replaced whether the
module is imported before or after, SGLang's plugin hook installs from the
environment, and `python -m kvtier.sglang` reaches the processes SGLang
spawns."""

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
from kvtier import KvtierError

COORD = "sglang.srt.managers.hisparse_coordinator"
PACKAGE_ROOT = Path(kvtier.__file__).resolve().parents[1]


def test_install_before_the_coordinator_is_imported(fake_sglang):
    cfg = kvtier.sglang.install({"devices": ["anon"], "rank": 0, "ranks": 1})
    assert json.loads(os.environ[kvtier.sglang.ENV]) == json.loads(cfg.to_json())
    coord = importlib.import_module(COORD)
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla

    # The coordinator's swap-in now runs kvtier's (on numpy: the CPU executor).
    c = worked_example([4, 2, 7])
    hc = coord.HiSparseCoordinator(layers=2, rows=16, kv_dim=16)
    hc.swap_in(**c.kwargs())
    assert c.out.tolist() == [[7, 3, 11]]

    # Its host pool sits in a kvtier region.
    pool = hc.mem_pool_host
    assert isinstance(pool.allocator, kvtier.sglang.KvtierHostTensorAllocator)
    assert pool.kv_buffer.shape == (2, 16, 1, 16)
    assert pool.kv_buffer.ctypes.data == pool.allocator.regions[0].host_addr

    kvtier.sglang.uninstall()
    assert coord.load_cache_to_device_buffer_mla is not kvtier.sglang.load_cache_to_device_buffer_mla
    with pytest.raises(RuntimeError, match="SGLang's own swap-in ran"):
        coord.HiSparseCoordinator(1, 4, 16).swap_in()
    assert type(coord.HiSparseCoordinator(1, 4, 16).mem_pool_host.kv_buffer) is np.ndarray


def test_install_after_the_coordinator_is_imported(fake_sglang):
    coord = importlib.import_module(COORD)
    kvtier.sglang.install({"host_pool": False})
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla
    assert coord.MLATokenToKVPoolHost.__name__ == "MLATokenToKVPoolHost", "host pool left alone"
    kvtier.sglang.install()  # idempotent
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla


def test_a_coordinator_without_the_names_is_refused(fake_sglang):
    (fake_sglang / "sglang/srt/managers/hisparse_coordinator.py").write_text("x = 1\n")
    kvtier.sglang.install()
    with pytest.raises(KvtierError, match="no module-level"):
        importlib.import_module(COORD)


def test_the_sglang_plugin_installs_from_the_environment(fake_sglang, monkeypatch):
    from kvtier.sglang import plugin

    plugin.register()  # no KVTIER_SGLANG_CONFIG: nothing happens
    assert kvtier.sglang.current_config() is None
    monkeypatch.setenv(kvtier.sglang.ENV, json.dumps({"devices": ["anon:64MiB"], "swap_in": True}))
    plugin.register()
    assert kvtier.sglang.current_config().devices == ["anon:64MiB"]
    coord = importlib.import_module(COORD)
    assert coord.load_cache_to_device_buffer_mla is kvtier.sglang.load_cache_to_device_buffer_mla


def test_the_launcher_reaches_spawned_processes(fake_sglang, tmp_path):
    cfg = tmp_path / "kvtier.json"
    cfg.write_text(json.dumps({"devices": ["anon"], "strategy": "plan_then_copy"}))
    env = dict(os.environ)
    env.pop(kvtier.sglang.ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(fake_sglang), str(PACKAGE_ROOT), env.get("PYTHONPATH", "")])
    args = ["--model-path", "deepseek-ai/DeepSeek-V3.2", "--enable-hisparse", "--hisparse-config",
            '{"top_k": 2048, "device_buffer_size": 4096}']
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.sglang", *args[:2], "--kvtier-config", str(cfg), *args[2:]],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "argv " + " ".join(args), "SGLang's arguments pass through unchanged"
    assert "parent swap-in from kvtier.sglang host pool kvtier[MLATokenToKVPoolHost]" in lines
    assert "child swap-in from kvtier.sglang host pool kvtier[MLATokenToKVPoolHost]" in lines, run.stdout
    assert "kvtier: installed into SGLang" in run.stderr


def test_the_launcher_refuses_a_bad_config(fake_sglang, tmp_path):
    cfg = tmp_path / "bad.json"
    cfg.write_text('{"devices": ["tape:0"]}')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake_sglang), str(PACKAGE_ROOT)]))
    run = subprocess.run([sys.executable, "-m", "kvtier.sglang", "--kvtier-config", str(cfg)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "KvtierError" in run.stderr and "tape:0" in run.stderr
