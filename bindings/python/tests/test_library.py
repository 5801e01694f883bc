"""Loading libkvtier and the ctypes mirrors of bindings/kvtier.h."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from conftest import needs_repository
from kvtier import _lib

REPO = Path(__file__).resolve().parents[3]


def test_the_library_loads_and_says_its_version():
    assert kvtier.version() == "0.1.0"
    assert isinstance(kvtier.kernels_built(), bool)
    path = Path(kvtier.library()._kvtier_path)
    assert path in [Path(p) for p in _lib.candidates()]


@pytest.mark.skipif(os.environ.get("KVTIER_EXPECT_INSTALLED") != "1", reason="testing a source checkout")
def test_the_installed_package_carries_the_library_and_the_plugin():
    """`pip install ./bindings/python` after `cargo build --release`: the
    library inside the package, and SGLang's plugin entry point declared."""
    from importlib.metadata import entry_points

    package = Path(kvtier.__file__).resolve().parent
    assert "site-packages" in str(package), package
    assert Path(kvtier.library()._kvtier_path) == package / "libkvtier.so"
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert plugins.get("kvtier") == "kvtier.sglang.plugin:register"
    vllm_plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert vllm_plugins.get("kvtier") == "kvtier.vllm:register"
    assert (package / "vllm" / "host_pool.py").is_file()


@pytest.mark.skipif(os.environ.get("KVTIER_EXPECT_INSTALLED") != "1", reason="testing a source checkout")
def test_the_installed_package_runs_the_kvtier_command(tmp_path):
    """The kvtier command from the engine's environment: `python -m kvtier`
    and the `kvtier` script the package installs, both the bundled binary."""
    package = Path(kvtier.__file__).resolve().parent
    assert os.access(package / "bin" / "kvtier", os.X_OK)
    script = Path(sys.executable).parent / "kvtier"
    for cmd in ([sys.executable, "-m", "kvtier", "info"], [str(script), "info"]):
        env = {k: v for k, v in os.environ.items() if k != "KVTIER_BIN"}
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.startswith(f"kvtier {kvtier.version()}") and "kernels:" in run.stdout, run.stdout
    run = subprocess.run([sys.executable, "-m", "kvtier", "plan", "--context", "128K", "--hbm-for-kv", "40GiB",
                          "--dram-for-kv", "1TiB", "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0 and '"limited_by"' in run.stdout, run.stdout + run.stderr


def test_python_m_kvtier_without_a_binary_says_how_to_get_one(tmp_path, monkeypatch):
    import kvtier.__main__ as cli

    monkeypatch.setattr(cli, "binary", lambda: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["info"])
    assert e.value.code == 2


def test_a_missing_kvtier_lib_is_a_clear_error(tmp_path):
    package_root = str(Path(kvtier.__file__).resolve().parents[1])
    env = dict(os.environ, KVTIER_LIB=str(tmp_path / "nope.so"), PYTHONPATH=package_root)
    code = "import kvtier\ntry:\n    kvtier.version()\nexcept kvtier.KvtierError as e:\n    print(e.status, e)\n"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert run.stdout.startswith("NO_LIBRARY"), run.stdout + run.stderr
    assert "nope.so does not exist" in run.stdout


@needs_repository
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_ctypes_structs_match_the_c_header(tmp_path):
    """tests/ffi/abi_test.c prints the header's sizes and offsets; the ctypes
    structs here must agree (the Rust side is checked in tests/ffi.rs)."""
    exe = tmp_path / "abi_test"
    lib = Path(kvtier.library()._kvtier_path)
    subprocess.run(
        ["cc", "-std=c11", "-I", str(REPO / "bindings"), str(REPO / "tests/ffi/abi_test.c"), str(lib),
         f"-Wl,-rpath,{lib.parent}", "-o", str(exe)],
        check=True,
    )
    out = subprocess.run([str(exe), "layout"], check=True, capture_output=True, text=True).stdout
    header = {}
    for line in out.splitlines():
        name, value = line.rsplit(" ", 1)
        header[name] = int(value)
    checked = 0
    for cname, struct in _lib.STRUCTS.items():
        assert header[f"sizeof {cname}"] == ctypes.sizeof(struct), cname
        for field, _ in struct._fields_:
            key = f"{cname}.{field}"
            if key in header:
                assert header[key] == getattr(struct, field).offset, key
                checked += 1
    assert checked >= 20
