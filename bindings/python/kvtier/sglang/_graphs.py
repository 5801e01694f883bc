"""Whether the current torch stream is capturing a CUDA graph: the shim's
per-step work (polls, counter exports, trace recording) starts copies or
allocates, which a capture must not see."""

from __future__ import annotations

import sys


def capturing() -> bool:
    """True while torch captures a CUDA graph on the current stream (False
    without torch or CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False
