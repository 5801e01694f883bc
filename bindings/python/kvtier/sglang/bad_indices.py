"""Bad indices recorded by the GPU kernels, surfaced without stalling.

kvtier's kernels refuse a bad index entry by entry (output -1, nothing read
or written through it) and count it in the engine's error word on the GPU.
SGLang never calls :func:`kvtier.sglang.check`, which waits for the device,
so the shim polls instead: at most once per ``bad_index_poll_s``, on the
scheduler's own thread, from kvtier's entry points (eager mode) and from the
host pool's per-step backup (which SGLang calls on the host every decode
step, CUDA graphs or not). A poll starts a copy of the error word on a
stream of the engine's own and reads the copy the previous poll started, so
it never waits; it is skipped while a CUDA graph is being captured. What it
finds is logged as a warning (``bad_indices: "warn"``, the default) with the
count and the first offending entry of each kind (its batch row is the
request), or raised as a :class:`kvtier.KvtierError` (``"raise"``).
"""

from __future__ import annotations

import logging
import time

from .._lib import KvtierError
from .._swap_in import cuda_engines
from ._graphs import capturing as _capturing

logger = logging.getLogger("kvtier")


class BadIndexWatch:
    """The polling policy: `mode` ("warn", "raise", "off"), at most once per
    `interval_s`; `engines` lists the (ordinal, engine) pairs to poll and
    `clock` is the time source (both replaceable in tests)."""

    def __init__(self, mode: str = "warn", interval_s: float = 1.0, engines=cuda_engines, clock=time.monotonic):
        self.mode, self.interval_s = mode, float(interval_s)
        self._engines, self._clock = engines, clock
        self._next = 0.0

    def maybe_poll(self) -> None:
        """Polls when the interval has passed (a clock read otherwise)."""
        if self.mode == "off":
            return
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        if _capturing():
            return
        found = []
        for ordinal, engine in self._engines():
            try:
                hit = engine.poll()
            except KvtierError as e:
                # a poll that cannot run says so; it never stops the server
                logger.warning("kvtier: the bad-index poll on cuda:%d failed: %s", ordinal, e)
                continue
            if hit is not None:
                found.append((ordinal, *hit))
        for ordinal, new, report in found:
            logger.warning("kvtier: %d new bad-index entr%s on cuda:%d: %s", new, "y" if new == 1 else "ies",
                           ordinal, report)
        if found and self.mode == "raise":
            ordinal, new, report = found[0]
            raise KvtierError(f"bad indices on cuda:{ordinal} ({new} new): {report}", "BAD_INDICES")


_watch = BadIndexWatch(mode="off")


def current_watch() -> BadIndexWatch:
    return _watch


def configure(mode: str, interval_s: float) -> None:
    """Sets the process's watch (install does, from the kvtier config)."""
    _watch.mode, _watch.interval_s = mode, float(interval_s)
    _watch._next = 0.0


def maybe_poll() -> None:
    _watch.maybe_poll()
