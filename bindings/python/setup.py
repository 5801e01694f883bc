"""Bundles libkvtier.so into the package: from KVTIER_LIB if set, else from
the repository's target/release (run `cargo build --release` first). Without
one the package still installs and finds the library at run time through
KVTIER_LIB or a checkout's target/release."""

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
        src = Path(os.environ.get("KVTIER_LIB") or HERE.parents[1] / "target" / "release" / "libkvtier.so")
        dst = Path(self.build_lib) / "kvtier" / "libkvtier.so"
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        else:
            warnings.warn(f"{src} not found: the package is built without libkvtier.so (see README.md)")


setup(cmdclass={"build_py": BuildWithLibrary})
