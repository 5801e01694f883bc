"""SGLang's real modules, where they are importable: the release under test,
a marker for the tests that need it, and install() into it with the kernel
module's names bound to what the installed coordinator calls.

The test command runs the package's tests once per supported release with
that release's tree on PYTHONPATH and ``KVTIER_REAL_SGLANG=<version>`` set
(scripts/test.sh); there, a release that fails to import fails the tests
instead of skipping them. Elsewhere the tests that need SGLang skip."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings

import pytest
from conftest import forget_sglang as forget  # noqa: F401 (the tests import it from here)

REQUIRED = os.environ.get("KVTIER_REAL_SGLANG")  # the release the test command put on the path
COORDINATOR = "sglang.srt.managers.hisparse_coordinator"
KERNELS = "sglang.kernels.ops.kvcache.hisparse"
SERVED = ("load_cache_to_device_buffer_mla", "load_cache_to_device_buffer_dsv4_mla", "copy_cache_planned_mla",
          "load_blocks_to_device_buffer_mha")


def _probe():
    """(version, None) when SGLang's HiSparse coordinator imports here, else
    (None, why)."""
    if importlib.util.find_spec("torch") is None:
        return None, "needs torch"
    if importlib.util.find_spec("sglang") is None:
        return None, "needs SGLang importable"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(COORDINATOR)
        from sglang.version import __version__
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        if REQUIRED:
            raise
        return None, f"SGLang does not import here: {e!r}"
    finally:
        forget()
    if REQUIRED and __version__ != REQUIRED:
        raise RuntimeError(f"KVTIER_REAL_SGLANG={REQUIRED} but SGLang {__version__} is importable")
    return __version__, None


VERSION, WHY_NOT = _probe() if REQUIRED or importlib.util.find_spec("sglang") else (None, "needs SGLang importable")
if REQUIRED and VERSION is None:
    raise RuntimeError(f"KVTIER_REAL_SGLANG={REQUIRED} but SGLang is not importable: {WHY_NOT}")

needs_sglang = pytest.mark.skipif(VERSION is None, reason=WHY_NOT or "")


def import_quietly(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


class Installed:
    """kvtier installed into the real SGLang: `coordinator` and `kernels` are
    SGLang's modules, `report` install()'s report."""

    def __init__(self, coordinator, kernels, report):
        self.coordinator, self.kernels, self.report = coordinator, kernels, report


def install_into_sglang(monkeypatch, config=None, bind_kernel_module=True) -> Installed:
    """install() into the real SGLang, the coordinator imported after it (the
    import hook patches it); with `bind_kernel_module`, the kernel module's
    served names are bound (for this test) to the functions the patched
    coordinator calls, so that code importing them from the kernel module,
    as SGLang's own kernel tests do, reaches them."""
    import kvtier.sglang

    forget()
    monkeypatch.delenv(kvtier.sglang.ENV, raising=False)
    report = kvtier.sglang.install(config or {"devices": ["anon"], "rank": 0, "ranks": 1})
    assert report.installs, report.lines()
    coordinator = import_quietly(COORDINATOR)
    kernels = sys.modules[KERNELS]
    if bind_kernel_module:
        for name in SERVED:
            monkeypatch.setattr(kernels, name, getattr(coordinator, name))
    return Installed(coordinator, kernels, report)


def uninstall_sglang() -> None:
    import kvtier.sglang

    kvtier.sglang.uninstall()
    forget()
