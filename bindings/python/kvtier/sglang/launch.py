"""``python -m kvtier.sglang [serve] <SGLang server arguments> --kvtier-config FILE``

Installs the shim, then runs ``sglang.launch_server`` (or, when the first
argument is ``serve``, SGLang's ``sglang serve`` command) with the remaining
arguments unchanged (``--enable-hisparse --hisparse-config ...`` and
``--enable-hierarchical-cache ...`` included).

SGLang starts its schedulers with multiprocessing's *spawn*, which imports
the parent's main module in each child: this module is that main module, so
every child installs the shim from ``KVTIER_SGLANG_CONFIG`` before it creates
a coordinator (SGLang versions with plugins also do it through kvtier's
plugin).
"""

from __future__ import annotations

import os
import runpy
import sys

from .._lib import KvtierError
from . import compat
from ._config import ENV, load_config
from ._patch import install

USAGE = "usage: python -m kvtier.sglang [serve] [SGLang server arguments ...] [--kvtier-config FILE]"

if __name__ != "__main__" and os.environ.get(ENV):
    # A process SGLang spawned, importing the launcher as its main module.
    install()


def split_args(argv: list) -> tuple:
    """(the --kvtier-config value or None, the other arguments in order)."""
    config, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--kvtier-config":
            if i + 1 >= len(argv):
                raise SystemExit(f"--kvtier-config needs a file\n{USAGE}")
            config = argv[i + 1]
            i += 2
            continue
        if a.startswith("--kvtier-config="):
            config = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return config, rest


def hisparse_config_of(args: list):
    """The value of SGLang's ``--hisparse-config`` in `args`, or None."""
    for i, a in enumerate(args):
        if a == "--hisparse-config" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--hisparse-config="):
            return a.split("=", 1)[1]
    return None


def has_flag(args: list, flag: str) -> bool:
    """Whether SGLang's boolean `flag` is among `args` (``--flag`` or ``--flag=...``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        print(__doc__)
        return
    path, rest = split_args(argv)
    try:
        cfg = load_config(os.path.abspath(path) if path else None)
    except KvtierError as e:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        # one line, in the user's words (KVTIER_DEBUG=1 shows the traceback)
        print(f"kvtier: {e.message}", file=sys.stderr)
        raise SystemExit(2) from None
    if compat.sglang_root() is None:
        print("kvtier: SGLang is not installed in this Python environment; nothing to launch", file=sys.stderr)
        raise SystemExit(2)
    # Installs where kvtier can stand in for SGLang's HiSparse entry points and
    # host pools, and says which it serves; otherwise SGLang runs unchanged.
    rep = install(cfg, hisparse_config_of(rest), log=False)
    for line in rep.lines():
        print(line, file=sys.stderr)
    if rep.installs and not has_flag(rest, "--enable-hisparse"):
        hicache = any(rep.served(route) for route in compat.HICACHE_POOLS)
        engram = rep.served("_HostTable") or rep.served("engram_gather")
        if hicache and has_flag(rest, "--enable-hierarchical-cache"):
            print("  kvtier serves HiCache's host KV pool (--enable-hierarchical-cache); HiSparse's paths wait "
                  "for --enable-hisparse", file=sys.stderr)
        else:
            nor = " (nor is --enable-hierarchical-cache)" if hicache else ""
            print(f"  warning: --enable-hisparse is not among SGLang's arguments{nor}: unless a config file of "
                  "SGLang's sets it, SGLang runs without HiSparse and kvtier serves "
                  + ("only the Engram tables (DeepSeek-V4.1, which refuses HiSparse)" if engram else "nothing"),
                  file=sys.stderr)
    if rest[:1] == ["serve"]:
        # `sglang serve ...`, SGLang's command-line entry point
        sys.argv = ["sglang", *rest]
        from sglang.cli.main import main as sglang_main

        sglang_main()
        return
    sys.argv = ["sglang.launch_server", *rest]
    # alter_sys=False: this module stays __main__, which spawned children import.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
