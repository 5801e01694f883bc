"""Installing the shim into SGLang: the HiSparse coordinator module's
swap-in function and host pool class are replaced, either at once (module
already imported) or the moment it is imported (an import hook)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading

from .._lib import KvtierError
from ._config import ENV, KvtierConfig, load_config
from .host_pool import KvtierHostTensorAllocator

COORDINATOR = "sglang.srt.managers.hisparse_coordinator"
SWAP_IN = "load_cache_to_device_buffer_mla"
HOST_POOL = "MLATokenToKVPoolHost"

_lock = threading.RLock()
_config: KvtierConfig | None = None
_hook = None


def current_config() -> KvtierConfig | None:
    """The installed configuration (None before :func:`install`)."""
    return _config


def install(config=None) -> KvtierConfig:
    """Replaces SGLang HiSparse's swap-in and host pool allocator with kvtier's
    (see :class:`KvtierConfig`), before the coordinator is created. Sets
    ``KVTIER_SGLANG_CONFIG`` so the processes SGLang spawns install the same
    (through kvtier's SGLang plugin or ``python -m kvtier.sglang``).
    Idempotent; returns the configuration in force."""
    global _config
    cfg = load_config(config)
    with _lock:
        _config = cfg
        os.environ[ENV] = cfg.to_json()
        module = sys.modules.get(COORDINATOR)
        if module is not None:
            _patch(module)
        else:
            _add_hook()
    return cfg


def uninstall() -> None:
    """Undoes :func:`install` in this process (the coordinator module gets its
    own functions back)."""
    global _config, _hook
    with _lock:
        _config = None
        os.environ.pop(ENV, None)
        if _hook is not None and _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None
        module = sys.modules.get(COORDINATOR)
        originals = getattr(module, "_kvtier_originals", None) if module else None
        if originals:
            for name, value in originals.items():
                setattr(module, name, value)
            del module._kvtier_originals


def is_installed(module) -> bool:
    return bool(getattr(module, "_kvtier_originals", None))


def _patch(module) -> None:
    if is_installed(module) or _config is None:
        return
    from . import load_cache_to_device_buffer_mla

    originals = {}
    missing = []
    if _config.swap_in:
        if hasattr(module, SWAP_IN):
            originals[SWAP_IN] = getattr(module, SWAP_IN)
        else:
            missing.append(SWAP_IN)
    if _config.host_pool:
        if isinstance(getattr(module, HOST_POOL, None), type):
            originals[HOST_POOL] = getattr(module, HOST_POOL)
        else:
            missing.append(HOST_POOL)
    if missing:
        raise KvtierError(
            f"this SGLang's {COORDINATOR} has no module-level {' or '.join(missing)}; kvtier's shim supports "
            "the SGLang versions whose coordinator imports them (0.5.12 and later)"
        )
    if SWAP_IN in originals:
        setattr(module, SWAP_IN, load_cache_to_device_buffer_mla)
    if HOST_POOL in originals:
        setattr(module, HOST_POOL, host_pool_class(originals[HOST_POOL]))
    module._kvtier_originals = originals


def host_pool_class(base: type) -> type:
    """`base` (SGLang's MLATokenToKVPoolHost) with its layer-first buffer
    allocated by :class:`KvtierHostTensorAllocator`; other layouts unchanged."""

    class KvtierMLATokenToKVPoolHost(base):
        def init_kv_buffer(self):
            if getattr(self, "layout", None) == "layer_first" and _config is not None:
                self.allocator = KvtierHostTensorAllocator(_config)
            return super().init_kv_buffer()

    KvtierMLATokenToKVPoolHost.__qualname__ = f"kvtier[{base.__qualname__}]"
    KvtierMLATokenToKVPoolHost.__module__ = __name__
    return KvtierMLATokenToKVPoolHost


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
        if fullname != COORDINATOR:
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
