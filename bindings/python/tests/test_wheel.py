"""The wheel scripts/build-wheel.sh builds (KVTIER_WHEEL names it; the test
command sets it): a manylinux platform wheel that auditwheel agrees with,
holding the library, the extension module and the kvtier command, whose
kernels a CUDA 12 compiler built; the wheel built from the sdist holds the
same files. The pins of the kernels' compiler agree wherever they are
written."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

import kvtier
from conftest import REPOSITORY as REPO
from conftest import needs_repository
WHEEL = os.environ.get("KVTIER_WHEEL")
needs_wheel = pytest.mark.skipif(not WHEEL, reason="KVTIER_WHEEL is not set (scripts/test.sh sets it)")


def members(wheel: Path) -> dict[str, zipfile.ZipInfo]:
    with zipfile.ZipFile(wheel) as z:
        return {i.filename: i for i in z.infolist()}


def payload(wheel: Path) -> set[str]:
    """The files a wheel installs (auditwheel adds folder entries and
    rewrites RECORD and WHEEL)."""
    return {n for n in members(wheel) if not n.endswith(("/", "RECORD", "WHEEL"))}


@needs_repository
def test_the_kernel_compiler_pins_agree():
    """pyproject's build requirements and scripts/install-tools.sh pin the
    same NVRTC and nvFatbin, so a developer's build and the wheel compile the
    kernels with one compiler."""
    pyproject = (REPO / "bindings/python/pyproject.toml").read_text()
    tools = (REPO / "scripts/install-tools.sh").read_text()
    pins = re.findall(r"(nvidia-(?:cuda-nvrtc|nvfatbin)-cu12==[0-9.]+)", pyproject)
    assert len(pins) == 2, pins
    for pin in pins:
        assert pin in tools, f"{pin} is a build requirement of the wheel but not in scripts/install-tools.sh"
    assert len({p.split("==")[1].rsplit(".", 1)[0] for p in pins}) == 1, f"one release series: {pins}"


@needs_wheel
def test_the_wheel_is_a_manylinux_platform_wheel_auditwheel_agrees_with():
    wheel = Path(WHEEL)
    m = re.fullmatch(r"kvtier-(?P<v>[^-]+)-cp39-abi3-manylinux_(?P<glibc>\d+_\d+)_x86_64\.whl", wheel.name)
    assert m, wheel.name
    assert m["v"] == kvtier.version()
    auditwheel = shutil.which("auditwheel", path=str(Path(sys.executable).parent)) or shutil.which("auditwheel")
    if auditwheel is None:
        pytest.skip("auditwheel is not installed here")
    show = subprocess.run([auditwheel, "show", str(wheel)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    text = " ".join(show.stdout.split())
    assert f'following platform tag: "manylinux_{m["glibc"]}_x86_64"' in text, text


@needs_wheel
def test_the_tag_promised_is_the_tag_built_and_what_its_files_need():
    """The install page promises a manylinux tag (the glibc floor: RHEL 9 has 2.34)
    and a size; the wheel carries that tag, no file in it needs a newer
    glibc symbol version (the command once needed hypotf@GLIBC_2.35), and its
    size is the one stated."""
    readme = (REPO / "docs" / "install.md").read_text()
    promised = set(re.findall(r"`manylinux_(\d+)_(\d+)_x86_64`", readme))
    assert len(promised) == 1, promised
    floor = tuple(int(x) for x in promised.pop())
    wheel = Path(WHEEL)
    m = re.search(r"manylinux_(\d+)_(\d+)_x86_64\.whl$", wheel.name)
    assert m and (int(m[1]), int(m[2])) == floor, (wheel.name, floor)
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed here")
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
        for name in ("kvtier/libkvtier.so", "kvtier/_native.abi3.so", "kvtier/bin/kvtier"):
            path = z.extract(name, d)
            out = subprocess.run([readelf, "-V", "--wide", path], capture_output=True, text=True, check=True).stdout
            needed = {tuple(int(x) for x in v) for v in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", out)}
            newest = max(needed)
            assert newest <= floor, f"{name} needs GLIBC_{newest[0]}.{newest[1]}, past the promised {floor}"
    stated = re.search(r"The wheel is (\d+(?:\.\d+)?) MB", readme)
    assert stated, "docs/install.md states the wheel's size"
    size = wheel.stat().st_size / 1e6
    assert abs(size - float(stated[1])) <= 0.1 * size, f"the wheel is {size:.1f} MB, docs/install.md says {stated[1]}"


@needs_wheel
def test_the_wheel_holds_the_library_the_extension_and_the_command():
    files = members(Path(WHEEL))
    for name in ("kvtier/libkvtier.so", "kvtier/_native.abi3.so", "kvtier/bin/kvtier"):
        assert name in files, sorted(files)
        with zipfile.ZipFile(WHEEL) as z:
            assert z.read(name)[:4] == b"\x7fELF", name
    mode = files["kvtier/bin/kvtier"].external_attr >> 16
    assert mode & stat.S_IXUSR, oct(mode)
    dist = f"kvtier-{kvtier.version()}.dist-info"
    for name in ("licenses/LICENSE", "licenses/NOTICE", "entry_points.txt", "METADATA", "WHEEL"):
        assert f"{dist}/{name}" in files, name
    with zipfile.ZipFile(WHEEL) as z:
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
        metadata = z.read(f"{dist}/METADATA").decode()
        wheel_meta = z.read(f"{dist}/WHEEL").decode()
    assert "kvtier = kvtier.__main__:main" in entry_points
    assert "kvtier = kvtier.sglang.plugin:register" in entry_points
    assert "[vllm.general_plugins]" in entry_points and "kvtier = kvtier.vllm:register" in entry_points
    assert "License-Expression: Apache-2.0" in metadata
    assert "Root-Is-Purelib: false" in wheel_meta


@needs_wheel
def test_the_installed_wheels_kernels_were_built_by_cuda_12():
    """`kvtier info` from the installed package: kernels compiled by NVRTC
    12.9, the minimum driver stated (R525 for the SASS)."""
    package = Path(kvtier.__file__).resolve().parent
    assert "site-packages" in str(package), package
    run = subprocess.run([sys.executable, "-m", "kvtier", "info"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "KVTIER_BIN"}, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "built by NVRTC 12.9" in run.stdout, run.stdout
    assert "SASS for sm_80, sm_90, sm_100" in run.stdout, run.stdout
    assert "the SASS needs a driver for CUDA 12.0 or newer (NVIDIA driver R525 or later)" in run.stdout, run.stdout
    assert kvtier.kernels_built()


@needs_wheel
def test_the_wheel_built_from_the_sdist_holds_the_same_files():
    sdist_wheels = sorted(Path(WHEEL).parent.glob("sdist/kvtier-*.whl"))
    if not sdist_wheels:
        pytest.skip("no wheel built from the sdist next to KVTIER_WHEEL (scripts/build-wheel.sh --sdist)")
    ours, theirs = payload(Path(WHEEL)), payload(sdist_wheels[0])
    assert {"kvtier/libkvtier.so", "kvtier/_native.abi3.so", "kvtier/bin/kvtier"} <= theirs
    assert ours == theirs, ours ^ theirs


@needs_wheel
def test_the_aarch64_wheel_holds_the_same_files_built_for_aarch64():
    """scripts/cross-aarch64.sh's wheel, next to KVTIER_WHEEL where this
    machine could build it (it smoke-tests the binaries under qemu-user)."""
    wheels = sorted(Path(WHEEL).parent.glob("kvtier-*-cp39-abi3-manylinux_*_aarch64.whl"))
    if not wheels:
        pytest.skip("no aarch64 wheel next to KVTIER_WHEEL (scripts/build-wheel.sh --aarch64 says why)")
    ours, theirs = payload(Path(WHEEL)), payload(wheels[0])
    assert ours == theirs, ours ^ theirs
    with zipfile.ZipFile(wheels[0]) as z:
        for name in ("kvtier/libkvtier.so", "kvtier/_native.abi3.so", "kvtier/bin/kvtier"):
            elf = z.read(name)
            # e_machine at offset 18: 183 is EM_AARCH64
            assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183, name
        # the same kernels: the fatbin does not depend on the host CPU
        fatbin = bytes.fromhex("50ed55ba")
        assert z.read("kvtier/libkvtier.so").count(fatbin) == 1
