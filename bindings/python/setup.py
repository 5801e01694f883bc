"""Builds the kvtier wheel: cargo builds libkvtier.so with its CUDA kernels,
the extension module kvtier._native and the kvtier command, and they go into
the package, tagged as the platform wheel they are (cp39-abi3-linux_<arch>;
scripts/build-wheel.sh then checks it with auditwheel and retags it
manylinux).

Needs cargo (a Rust toolchain) on PATH. The kernels' compiler, CUDA 12.9's
NVRTC and nvFatbin, comes from this package's build requirements
(pyproject.toml), so no CUDA toolkit is needed; NVCC, or KVTIER_NVRTC with
KVTIER_NVFATBIN, picks another (see build.rs). The Rust sources are the
repository around this folder, or, in an sdist, its rust/ folder.

KVTIER_PREBUILT=DIR takes the three files from DIR (a cargo target/release
built by the caller) instead of building them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent

# What the package carries: (cargo's output, its name in the package).
ARTIFACTS = (("libkvtier.so", "libkvtier.so"), ("lib_native.so", "_native.abi3.so"), ("kvtier", "bin/kvtier"))

# What an sdist carries of the Rust workspace, under rust/.
WORKSPACE_FILES = ("Cargo.toml", "Cargo.lock", "build.rs", "README.md", "LICENSE", "NOTICE", "src", "kernels",
                   "benches", "bench/traces", "cli", "bindings/abi.rs", "bindings/kvtier.h", "bindings/python/native/Cargo.toml",
                   "bindings/python/native/src")


def workspace() -> Path:
    for root in (HERE / "rust", HERE.parents[1]):
        if (root / "Cargo.toml").is_file() and (root / "kernels").is_dir():
            return root
    raise SystemExit("kvtier: the Rust sources are missing (neither rust/ nor the repository around "
                     f"{HERE} holds Cargo.toml and kernels/)")


def nvidia_library(relative: str) -> str | None:
    """A library of an nvidia-* wheel on sys.path (the build requirements)."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "nvidia" / relative
        if candidate.is_file():
            return str(candidate)
    return None


def cargo_build(root: Path) -> Path:
    """Builds the three artifacts in release mode; returns cargo's output folder."""
    cargo = shutil.which(os.environ.get("CARGO", "cargo"))
    if cargo is None:
        raise SystemExit("kvtier: building kvtier needs cargo, Rust's build tool, on PATH (https://rustup.rs), "
                         "or KVTIER_PREBUILT naming a folder with libkvtier.so, lib_native.so and kvtier")
    env = dict(os.environ)
    env.setdefault("PYO3_PYTHON", sys.executable)
    if env.get("KVTIER_SKIP_KERNELS") != "1":
        # a wheel without kernels would serve only the CPU executor: fail instead
        env["KVTIER_REQUIRE_KERNELS"] = "1"
    if not any(env.get(v) for v in ("NVCC", "KVTIER_NVRTC", "KVTIER_NVFATBIN")):
        nvrtc = nvidia_library("cuda_nvrtc/lib/libnvrtc.so.12")
        nvfatbin = nvidia_library("nvfatbin/lib/libnvfatbin.so.12")
        if nvrtc and nvfatbin:
            env["KVTIER_NVRTC"], env["KVTIER_NVFATBIN"] = nvrtc, nvfatbin
    # its own target folder: the wheel's environment (compiler paths, the
    # build's Python) differs from a developer's cargo builds, which would
    # otherwise rebuild each other's artifacts
    target = Path(env.get("CARGO_TARGET_DIR") or root / "target" / "python-wheel")
    env["CARGO_TARGET_DIR"] = str(target)
    cmd = [cargo, "build", "--release", "--locked", "-p", "kvtier", "--lib", "-p", "kvtier-cli", "--bins", "-p",
           "kvtier-python"]
    print("kvtier: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=root, env=env, check=True)
    return target / "release"


class BuildWithRust(build_py):
    def run(self):
        super().run()
        prebuilt = os.environ.get("KVTIER_PREBUILT")
        release = Path(prebuilt) if prebuilt else cargo_build(workspace())
        for built, name in ARTIFACTS:
            src = release / built
            if not src.is_file():
                raise SystemExit(f"kvtier: {src} is missing")
            dst = Path(self.build_lib) / "kvtier" / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


class NativeDistribution(Distribution):
    """Native code inside: the files install into platlib, and the wheel is
    a platform one."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """One build for every CPython from 3.9 on: the extension module uses the
    stable ABI, and the library and the command use no Python at all."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "cp39", "abi3", platform


class SdistWithWorkspace(sdist):
    """An sdist that builds the same wheel: the Rust workspace goes in under rust/."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = workspace()
        for name in WORKSPACE_FILES:
            src, dst = root / name, Path(base_dir) / "rust" / name
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "target"))
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildWithRust, "bdist_wheel": PlatformWheel, "sdist": SdistWithWorkspace})
