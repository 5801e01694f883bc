"""``python -m kvtier.sglang``: see :mod:`kvtier.sglang.launch`.

The launcher runs as the main module under its own name (a ``__main__``
module is skipped by multiprocessing's spawn, and the children must import
the launcher to install the shim)."""

import runpy

runpy.run_module("kvtier.sglang.launch", run_name="__main__", alter_sys=True)
