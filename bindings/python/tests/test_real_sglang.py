"""install() and uninstall() against SGLang's real modules (the release the
test command put on the path; skipped where SGLang does not import): at once
into an imported coordinator, through the import hook, and through SGLang's
own plugin loader; the report's platform line is true on this machine; the
launcher reaches SGLang's real argument parser in both its forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from real_sglang import COORDINATOR, KERNELS, SERVED, VERSION, forget, import_quietly, needs_sglang

import kvtier.sglang

pytestmark = needs_sglang
POOLS = ("MLATokenToKVPoolHost", "DeepSeekV4PagedHostPool", "HiSparseMHATokenToKVPoolHost")
SGLANG_ONLY = ("load_cache_to_device_buffer_spec_mla",)
PACKAGE_ROOT = Path(kvtier.__file__).resolve().parents[1]
CONFIG = {"devices": ["anon"], "rank": 0, "ranks": 1}


@pytest.fixture
def fresh(monkeypatch):
    """No sglang module imported, nothing installed, before and after."""
    kvtier.sglang.uninstall()
    forget()
    monkeypatch.delenv(kvtier.sglang.ENV, raising=False)
    yield
    kvtier.sglang.uninstall()
    forget()


def assert_served(coordinator):
    own = {name: getattr(sys.modules[KERNELS], name) for name in SERVED}
    for name in SERVED:
        fn = getattr(coordinator, name)
        assert fn is not own[name] and fn.__module__ == "kvtier.sglang.entry_points", (name, fn)
    for name in SGLANG_ONLY:  # where the coordinator calls it (0.5.22 on)
        if hasattr(coordinator, name):
            assert getattr(coordinator, name) is getattr(sys.modules[KERNELS], name), f"{name} is left to SGLang"
    for name in POOLS:
        cls = getattr(coordinator, name)
        original = coordinator._kvtier_originals[name]
        assert cls is not original and issubclass(cls, original), (name, cls)
        assert cls.__module__.startswith("kvtier."), (name, cls.__module__)


def assert_sglangs_own(coordinator):
    kernels = sys.modules[KERNELS]
    for name in SERVED + tuple(n for n in SGLANG_ONLY if hasattr(coordinator, n)):
        assert getattr(coordinator, name) is getattr(kernels, name), name
    for name in POOLS:
        assert not getattr(coordinator, name).__module__.startswith("kvtier."), name
    assert not kvtier.sglang._patch.is_installed(coordinator)


def test_the_release_is_one_kvtier_is_checked_against():
    assert VERSION in kvtier.sglang.CHECKED_VERSIONS


def test_install_into_an_imported_coordinator_and_uninstall(fresh):
    coordinator = import_quietly(COORDINATOR)
    assert_sglangs_own(coordinator)
    rep = kvtier.sglang.install(CONFIG)
    assert rep.installs and rep.sglang_version == VERSION, rep.lines()
    assert_served(coordinator)
    assert json.loads(os.environ[kvtier.sglang.ENV]) == json.loads(rep.config.to_json())
    kvtier.sglang.uninstall()
    assert_sglangs_own(coordinator)
    assert kvtier.sglang.ENV not in os.environ


def test_install_before_the_coordinator_is_imported(fresh):
    rep = kvtier.sglang.install(CONFIG)
    assert rep.installs, rep.lines()
    assert COORDINATOR not in sys.modules
    coordinator = import_quietly(COORDINATOR)
    assert_served(coordinator)
    kvtier.sglang.uninstall()
    assert_sglangs_own(coordinator)


def test_sglangs_plugin_loader_installs_kvtier_from_the_environment(fresh, monkeypatch):
    plugins = import_quietly("sglang.srt.plugins")
    monkeypatch.setenv("SGLANG_PLUGINS", "kvtier")
    # without the configuration variable the plugin does nothing
    plugins.load_plugins()
    assert kvtier.sglang.installed_report() is None
    coordinator = import_quietly(COORDINATOR)
    assert_sglangs_own(coordinator)
    forget()
    monkeypatch.setenv(kvtier.sglang.ENV, json.dumps(CONFIG))
    plugins = import_quietly("sglang.srt.plugins")  # a fresh module: its load-once guard is reset
    plugins.load_plugins()
    rep = kvtier.sglang.installed_report()
    assert rep is not None and rep.installs, rep and rep.lines()
    assert_served(import_quietly(COORDINATOR))


def test_the_report_says_what_this_machine_runs(fresh):
    import torch

    rep = kvtier.sglang.report(kvtier.sglang.KvtierConfig(devices=["anon"]))
    head = rep.lines()[0]
    assert head.startswith(f"kvtier: would install into SGLang {VERSION} on "), head
    if torch.cuda.is_available():
        assert f"on CUDA {torch.version.cuda}" in head, head
    else:
        assert "on CPU only" in head and "no GPU visible" in head and "on CUDA" not in head, head
    routes = {r.name: r.served_by for r in rep.routes}
    assert all(routes[n] == "kvtier" for n in SERVED + POOLS), routes
    # the speculative swap-in: SGLang's where the coordinator calls it (0.5.22 on)
    spec = "absent" if VERSION == "0.5.21" else "SGLang"
    assert routes.get("load_cache_to_device_buffer_spec_mla", "absent") == spec, routes


def launch(tmp_path, *args):
    cfg = tmp_path / "kvtier.json"
    cfg.write_text(json.dumps({"devices": ["anon"]}))
    env = dict(os.environ)
    env.pop(kvtier.sglang.ENV, None)
    return subprocess.run([sys.executable, "-m", "kvtier.sglang", *args, "--kvtier-config", str(cfg), "--help"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("form", [[], ["serve"]], ids=["launch_server", "sglang serve"])
def test_the_launcher_installs_then_reaches_sglangs_parser(tmp_path, form):
    run = launch(tmp_path, *form)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"kvtier: installed into SGLang {VERSION} on " in run.stderr, run.stderr[-4000:]
    # SGLang's own parser answered --help: its usage names the model argument
    assert "usage: sglang serve" in run.stdout.lower() and "--model-path" in run.stdout, run.stdout[:2000]
