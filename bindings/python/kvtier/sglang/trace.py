"""Recording what SGLang's indexer selects, for ``kvtier plan --trace``.

Off by default. With ``trace`` in the kvtier config, the shim's swap-in entry
points write each call of the sampled layers and request rows to a trace
file (the format is the library's ``trace`` module's: JSON lines, a header,
then per call the real rows' request row, sequence length, query and, where
replay needs it, the request's hot-buffer state before the call).
``kvtier plan --trace FILE`` replays it at other HOT sizes: the replay at the
recorded size gives the hits and misses the run had.

What it costs and where it works: each recorded call copies its query,
lengths and (for new rows) state rows to the host, which waits for the GPU;
it is for finding the HOT size, not for production. Calls replayed from a
CUDA graph never reach Python, so decode steps are recorded only with
SGLang's CUDA graphs off (``--disable-cuda-graph``); calls made during a
capture are not recorded. Each process writes its own file: ``path`` with
``{pid}`` replaced by its process id, or ``path.<pid>`` (a tensor-parallel
server's schedulers each record their rank's calls), line by line, so a
server stopped by a signal leaves whole lines. A file stops growing at
``max_mb`` (the calls before the limit stay exact; the log says it
stopped). Sampling: ``layers``
(a list; null: all) and ``rows_every`` (request rows whose index is a
multiple of it): rows and layers replay independently, so a sample is exact
for what it holds.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading

import numpy as np

from .._lib import KvtierError
from ._graphs import capturing as _capturing

logger = logging.getLogger("kvtier")


def _host(a):
    """A numpy view or copy of `a` (numpy array or torch tensor)."""
    if a is None:
        return None
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _create_output(path: str):
    """The trace file, opened to write as the library opens what it writes
    where other users may have been first (a server runs as root, the path
    may be in /tmp): never through a symbolic link planted there (the write
    would land in its target), never a FIFO, never another user's file or
    one with other hard links; emptied, then written a line at a time."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = {errno.ELOOP: "it is a symbolic link",
               errno.ENXIO: "it is a FIFO (or a device) no one reads"}.get(e.errno, e.strerror)
        raise KvtierError(f"invalid argument `trace`: cannot write {path}: {why}") from None
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "it is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"it belongs to user {st.st_uid}"
        elif st.st_nlink > 1:
            problem = "it has other hard links"
        if problem:
            raise KvtierError(f"invalid argument `trace`: cannot write {path}: {problem}")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise KvtierError(f"invalid argument `trace`: cannot write {path}: {e.strerror}") from None
        raise
    return os.fdopen(fd, "w", buffering=1)


class TraceRecorder:
    """Writes sampled swap-in calls to `path` (see the module docs)."""

    def __init__(self, path: str, layers=None, rows_every: int = 1, max_mb: float = 256.0):
        self.path, self.rows_every = per_process_path(str(path)), int(rows_every)
        self.layers = None if layers is None else set(layers)
        self.max_bytes = int(max_mb * 2**20)
        self._file = None
        self._written = 0
        self._header = None  # (hot, block_tokens, item_bytes)
        self._last: dict = {}  # (layer, request row) -> (seq, was long)
        self.stopped: str | None = None
        self._lock = threading.Lock()

    def record(self, layer, *, top_k_tokens, num_top_k, req_pool_indices, seq_lens, num_real_reqs,
               device_buffer_tokens, lru_slots, hot, block_tokens=0, item_bytes=0) -> None:
        """One call of layer `layer` (None: not numbered, not recorded),
        before it runs."""
        if layer is None or self.stopped is not None or (self.layers is not None and layer not in self.layers):
            return
        if _capturing():
            return
        with self._lock:
            self._record(layer, top_k_tokens, int(num_top_k), req_pool_indices, seq_lens, num_real_reqs,
                         device_buffer_tokens, lru_slots, int(hot), int(block_tokens), int(item_bytes))

    def _record(self, layer, topk, k, req, seq, num_real, tokens, lru, hot, block_tokens, item_bytes):
        header = (hot, block_tokens, item_bytes)
        if self._header is None:
            # line-buffered: a server stopped by a signal leaves whole lines
            try:
                self._file = _create_output(self.path)
            except KvtierError as e:
                self._stop(e.message)  # recording stops; serving goes on
                return
            self._header = header
            self._write({"kvtier_trace": 1, "hot": hot, "block_tokens": block_tokens, "item_bytes": item_bytes,
                         "synthetic": False, "note": "recorded by the kvtier SGLang shim"})
        elif header != self._header:
            self._stop(f"a call with HOT {hot}, block size {block_tokens}, item {item_bytes} B in a trace of "
                       f"{self._header}")
            return
        topk, req, seq = _host(topk), _host(req), _host(seq)
        batch = len(req)
        real = batch if num_real is None else max(0, min(batch, int(_host(num_real).reshape(-1)[0])))
        tokens_h = lru_h = None
        rows = []
        for b in range(real):
            r, n = int(req[b]), int(seq[b])
            if r < 0 or r % self.rows_every:
                continue
            row = {"req": r, "seq": n, "topk": topk[b, :k].astype(np.int64).tolist()}
            last = self._last.get((layer, r))
            if last is None or not last[1] or n != last[0] + 1:
                if tokens_h is None:
                    tokens_h, lru_h = _host(tokens), _host(lru)
                row["state"] = {"tokens": tokens_h[r, :hot].astype(np.int64).tolist(),
                                "lru": lru_h[r, :hot].astype(np.int64).tolist()}
            self._last[(layer, r)] = (n, n > hot)
            rows.append(row)
        if rows:
            self._write({"layer": int(layer), "rows": rows})

    def _write(self, obj) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        if self._written + len(line) > self.max_bytes:
            self._stop(f"the trace reached its limit of {self.max_bytes} bytes")
            return
        self._file.write(line)
        self._written += len(line)

    def _stop(self, why: str) -> None:
        self.stopped = why
        logger.warning("kvtier: trace %s stopped: %s (the calls before stay exact)", self.path, why)
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def per_process_path(path: str) -> str:
    """`path` with ``{pid}`` replaced by this process's id; without the
    placeholder, ``.<pid>`` is appended: every scheduler process of a
    tensor-parallel server records, each into a file of its own."""
    pid = str(os.getpid())
    return path.replace("{pid}", pid) if "{pid}" in path else f"{path}.{pid}"


_recorder: TraceRecorder | None = None


def configure(trace) -> None:
    """Starts recording per the config's ``trace`` (None: off; a recorder
    already recording is closed)."""
    global _recorder
    if _recorder is not None:
        _recorder.close()
    _recorder = None
    if trace is not None:
        _recorder = TraceRecorder(trace["path"], trace.get("layers"), trace.get("rows_every", 1),
                                  trace.get("max_mb", 256.0))


def recorder() -> TraceRecorder | None:
    return _recorder


def check_config(trace) -> None:
    """Raises KvtierError when the config's ``trace`` value is not what
    :func:`configure` takes."""
    if trace is None:
        return
    if not isinstance(trace, dict) or not isinstance(trace.get("path"), str) or not trace["path"]:
        raise KvtierError("kvtier config: `trace` must be null or an object with a `path` string")
    unknown = sorted(set(trace) - {"path", "layers", "rows_every", "max_mb"})
    if unknown:
        raise KvtierError(f"kvtier config: unknown `trace` keys {unknown}")
    layers = trace.get("layers")
    if layers is not None and not (
        isinstance(layers, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
    ):
        raise KvtierError("kvtier config: `trace.layers` must be null or a list of layer numbers")
    every = trace.get("rows_every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise KvtierError("kvtier config: `trace.rows_every` must be a positive int")
    mb = trace.get("max_mb", 256.0)
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb <= 1 << 20:
        raise KvtierError("kvtier config: `trace.max_mb` must be a positive number of MiB")
