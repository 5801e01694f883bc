"""Installing the shim into SGLang: the HiSparse coordinator module's kernel
entry points and host pool classes, and the host pool classes HiCache's
assembler builds its L2 from, are replaced, either at once (module already
imported) or the moment it is imported (an import hook), after
:mod:`kvtier.sglang.compat` has checked that kvtier can stand in for them."""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading

from . import bad_indices, compat, counters, engram, trace
from ._config import ENV, current_config, load_config, set_current_config
from .entry_points import SERVED
from .host_pool import hicache_mha_chooser, host_pool_class

COORDINATOR = compat.COORDINATOR
ENGRAM = "sglang.srt.layers.engram"
ASSEMBLER = compat.ASSEMBLER
PATCHED = (COORDINATOR, ENGRAM, ASSEMBLER)

logger = logging.getLogger("kvtier")

_lock = threading.RLock()
_report: compat.Report | None = None
_hook = None


def installed_report() -> compat.Report | None:
    """What the last :func:`install` did (None before one)."""
    return _report


def install(config=None, hisparse_config=None, log=True) -> compat.Report:
    """Replaces SGLang HiSparse's kernel entry points and host pool
    allocation with kvtier's, where kvtier can stand in for them (see
    :mod:`kvtier.sglang.compat`), before the coordinator is created. Returns
    the report of what is served by whom, and logs it. When the platform or
    SGLang's entry points are not what kvtier knows, installs nothing (SGLang
    runs unchanged) and says why in the report. Sets ``KVTIER_SGLANG_CONFIG``
    so the processes SGLang spawns install the same (through kvtier's SGLang
    plugin or ``python -m kvtier.sglang``). `hisparse_config` is SGLang's
    ``--hisparse-config`` where known: a hot buffer beyond kvtier's limit
    installs nothing. Idempotent. `log`: log the report's lines (the
    launcher prints them itself)."""
    global _report
    cfg = load_config(config)
    rep = compat.report(cfg, hisparse_config)
    rep.config, rep.dry_run = cfg, False
    with _lock:
        _report = rep
        for line in rep.lines() if log else ():
            warn = not rep.installs or line.startswith("  warning: ")
            (logger.warning if warn else logger.info)("%s", line)
        if not rep.installs:
            return rep
        set_current_config(cfg)
        bad_indices.configure(cfg.bad_indices if cfg.swap_in else "off", cfg.bad_index_poll_s)
        counters.configure_export(cfg.counters_export_s if cfg.swap_in and cfg.counters else None)
        trace.configure(cfg.trace if cfg.swap_in else None)
        os.environ[ENV] = cfg.to_json()
        for name in PATCHED:
            module = sys.modules.get(name)
            if module is not None:
                _patch(module)
        if any(name not in sys.modules for name in PATCHED):
            _add_hook()
    return rep


def uninstall() -> None:
    """Undoes :func:`install` in this process (the coordinator module gets its
    own functions and classes back)."""
    global _hook, _report
    with _lock:
        set_current_config(None)
        _report = None
        bad_indices.configure("off", 1.0)
        counters.configure_export(None)
        trace.configure(None)
        os.environ.pop(ENV, None)
        if _hook is not None and _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None
        engram_module = sys.modules.get(ENGRAM)
        if engram_module is not None:
            engram.unpatch(engram_module)
        for module in (sys.modules.get(COORDINATOR), sys.modules.get(ASSEMBLER)):
            originals = getattr(module, "_kvtier_originals", None) if module else None
            if originals:
                for name, value in originals.items():
                    setattr(module, name, value)
                del module._kvtier_originals


def is_installed(module) -> bool:
    return bool(getattr(module, "_kvtier_originals", None))


def _patch(module) -> None:
    global _report
    if is_installed(module) or current_config() is None or _report is None:
        return
    if module.__name__ == ENGRAM:
        engram.patch(module, table=_report.served("_HostTable"), gather=_report.served("engram_gather"))
        return
    if module.__name__ == ASSEMBLER:
        _patch_assembler(module)
        return
    problem = compat.live_incompatibility(module)
    if problem:
        # The source check passed but the live functions differ (a patched
        # or rebuilt SGLang): install nothing.
        _report.installs = False
        _report.refusal = f"the coordinator's live entry points differ from what kvtier knows: {problem}"
        logger.warning("%s", _report.lines()[0])
        return
    originals = {}
    for route in _report.routes:
        current = getattr(module, route.name, None)
        if route.served_by != "kvtier" or current is None:
            continue
        originals[route.name] = current
        if route.name in SERVED:
            setattr(module, route.name, SERVED[route.name])
        else:
            setattr(module, route.name, host_pool_class(current, current_config()))
    module._kvtier_originals = originals


def _patch_assembler(module) -> None:
    """HiCache's host pools in kvtier: the assembler's MLA pool class, and
    the MHA class its chooser returns, become kvtier's subclasses."""
    originals = {}
    for route, (pool, name, _) in compat.HICACHE_POOLS.items():
        current = getattr(module, name, None)
        if not _report.served(route) or current is None:
            continue
        if name == pool:
            replacement = host_pool_class(current, current_config(), hicache=True)
        else:
            # the chooser picks among MHA pools; the plain one (symmetric K
            # and V, no MXFP8 scales) is the one kvtier serves
            base = getattr(sys.modules.get(current.__module__), pool, None)
            if not isinstance(base, type):
                logger.warning("kvtier: %s is not beside %s in SGLang; HiCache's MHA host pool stays SGLang's",
                               pool, name)
                continue
            replacement = hicache_mha_chooser(current, base, host_pool_class(base, current_config(), hicache=True))
        originals[name] = current
        setattr(module, name, replacement)
    module._kvtier_originals = originals


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it made."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        with _lock:
            _patch(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _CoordinatorHook(importlib.abc.MetaPathFinder):
    """Finds the coordinator module with the other finders and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _add_hook() -> None:
    global _hook
    if _hook is None:
        _hook = _CoordinatorHook()
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
