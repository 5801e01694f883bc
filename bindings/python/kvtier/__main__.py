"""``python -m kvtier ARGS`` (and the ``kvtier`` command the package
installs): the kvtier command line from the Python environment an engine
runs in (``kvtier info``, ``kvtier selftest``, ``kvtier bench``, ``kvtier
plan``, ``kvtier pool ...``), run from the binary bundled in the package,
else ``KVTIER_BIN``, else a checkout's ``target/release/kvtier``."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def binary() -> Path | None:
    """The kvtier binary this package runs, or None."""
    here = Path(__file__).resolve().parent
    for candidate in (os.environ.get("KVTIER_BIN"), here / "bin" / "kvtier",
                      here.parents[2] / "target" / "release" / "kvtier"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    exe = binary()
    if exe is None:
        print(
            "kvtier: this package holds no kvtier binary (`pip install ./bindings/python` in kvtier's "
            "repository builds the package with it; or set KVTIER_BIN)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(exe), [str(exe), *args])


if __name__ == "__main__":
    main()
