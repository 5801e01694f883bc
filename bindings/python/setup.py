"""Bundles libkvtier.so, the extension module kvtier._native and the kvtier
command's binary into the package: from KVTIER_LIB, KVTIER_NATIVE and
KVTIER_BIN if set, else from the repository's target/release (run `cargo
build --release --workspace` first). Without them the package still installs
and finds them at run time through those variables or a checkout's
target/release."""

import os
import shutil
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        release = HERE.parents[1] / "target" / "release"
        for env, built, name in (("KVTIER_LIB", "libkvtier.so", "libkvtier.so"),
                                 ("KVTIER_NATIVE", "lib_native.so", "_native.abi3.so"),
                                 ("KVTIER_BIN", "kvtier", "bin/kvtier")):
            src = Path(os.environ.get(env) or release / built)
            dst = Path(self.build_lib) / "kvtier" / name
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
            else:
                warnings.warn(f"{src} not found: the package is built without {name} (see README.md)")


setup(cmdclass={"build_py": BuildWithLibrary})
