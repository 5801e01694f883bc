"""Recording top-k traces through the SGLang shim's entry points (numpy, the
CPU executor): what a recorded call holds, sampling, the size limit, and the
config's checks. (Replaying a recording of SGLang's own coordinator to its
hits and misses: test_sglang_coordinator.py.)"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import worked_example

from kvtier import KvtierError
from kvtier.sglang import KvtierConfig, load_cache_to_device_buffer_mla, trace
from kvtier.sglang.counters import layer_number


def lines(path):
    """The lines of the file a recorder given `path` wrote (``path.<pid>``)."""
    written = path.parent / f"{path.name}.{os.getpid()}"
    return [json.loads(x) for x in written.read_text().splitlines()]


def test_a_recorded_call_holds_the_rows_and_the_state_replay_needs(tmp_path):
    c = worked_example([4, 2, 7])
    c.host_locs = np.arange(16, dtype=np.int64).reshape(1, 16)  # room for the next step's token 8
    layer = layer_number(c.device_buffer)[1]
    trace.configure({"path": str(tmp_path / "t.jsonl"), "layers": [layer]})
    try:
        load_cache_to_device_buffer_mla(**c.kwargs())
        # the next step of the same request (seq 9, long): no state needed
        nxt = c.kwargs(top_k_tokens=np.array([[6, 8]], dtype=np.int32), num_top_k=2,
                       seq_lens=np.array([9], dtype=np.int64),
                       top_k_device_locs=np.zeros((1, 2), dtype=np.int32))
        load_cache_to_device_buffer_mla(**nxt)
        other = worked_example([4])
        load_cache_to_device_buffer_mla(**other.kwargs())  # another layer's buffer: not sampled
    finally:
        trace.configure(None)
    header, first, second = lines(tmp_path / "t.jsonl")
    assert header == {"kvtier_trace": 1, "hot": 4, "block_tokens": 0, "item_bytes": 16, "synthetic": False,
                      "note": "recorded by the kvtier SGLang shim"}
    assert first == {"layer": layer, "rows": [{"req": 0, "seq": 8, "topk": [4, 2, 7],
                                                "state": {"tokens": [1, 4, 2, 5], "lru": [0, 1, 2, 3]}}]}
    assert second == {"layer": layer, "rows": [{"req": 0, "seq": 9, "topk": [6, 8]}]}


def test_a_call_the_per_step_hooks_stop_is_not_recorded(tmp_path, monkeypatch):
    """The bad-index poll runs first and may raise (mode "raise"): a call it
    stops never ran, so the trace holds nothing of it."""
    from kvtier.sglang import bad_indices

    def stop():
        raise KvtierError("bad indices on cuda:0 (1 new): planted", "BAD_INDICES")

    c = worked_example([4, 2, 7])
    trace.configure({"path": str(tmp_path / "t.jsonl")})
    try:
        monkeypatch.setattr(bad_indices, "maybe_poll", stop)
        with pytest.raises(KvtierError, match="planted"):
            load_cache_to_device_buffer_mla(**c.kwargs())
        assert c.out.tolist() == [[-7, -7, -7]], "nothing ran"
        monkeypatch.undo()
        load_cache_to_device_buffer_mla(**c.kwargs())
    finally:
        trace.configure(None)
    header, only = lines(tmp_path / "t.jsonl")
    assert only["rows"][0]["topk"] == [4, 2, 7] and "state" in only["rows"][0], "the call that ran, as a first call"


def test_sampling_and_the_size_limit(tmp_path, caplog):
    c = worked_example([4, 2, 7])
    trace.configure({"path": str(tmp_path / "a.jsonl"), "rows_every": 2})
    try:
        k = c.kwargs(req_pool_indices=np.array([1], dtype=np.int32),
                     device_buffer_tokens=np.vstack([c.tokens, c.tokens]),
                     device_buffer_locs=np.vstack([c.locs, c.locs + 12]),
                     lru_slots=np.vstack([c.lru, c.lru]), host_cache_locs=np.vstack([c.host_locs, c.host_locs]),
                     device_buffer=np.zeros(24 * 16, dtype=np.uint8))
        load_cache_to_device_buffer_mla(**k)  # request row 1: not a multiple of 2
    finally:
        trace.configure(None)
    assert len(lines(tmp_path / "a.jsonl")) == 1, "the header only"
    trace.configure({"path": str(tmp_path / "b.jsonl"), "max_mb": 200 / 2**20})
    try:
        rec = trace.recorder()
        load_cache_to_device_buffer_mla(**c.kwargs())
        assert rec.stopped and "limit" in rec.stopped
        load_cache_to_device_buffer_mla(**worked_example([4, 2, 7]).kwargs())  # nothing more written
    finally:
        trace.configure(None)
    assert len(lines(tmp_path / "b.jsonl")) == 1
    assert "stopped" in caplog.text


@pytest.mark.parametrize("bad", [
    {"trace": "t.jsonl"}, {"trace": {}}, {"trace": {"path": ""}}, {"trace": {"path": "t", "rows_every": 0}},
    {"trace": {"path": "t", "layers": [-1]}}, {"trace": {"path": "t", "layers": "all"}},
    {"trace": {"path": "t", "max_mb": 0}}, {"trace": {"path": "t", "extra": 1}},
])
def test_the_config_checks_its_trace_key(bad):
    with pytest.raises(KvtierError, match="trace"):
        KvtierConfig(**bad)
    assert KvtierConfig(trace={"path": "t", "layers": [0, 3], "rows_every": 4, "max_mb": 64}).trace["rows_every"] == 4


def test_each_process_records_into_a_file_of_its_own(tmp_path):
    pid = os.getpid()
    assert trace.per_process_path("/t/x-{pid}.jsonl") == f"/t/x-{pid}.jsonl"
    assert trace.per_process_path("/t/x.jsonl") == f"/t/x.jsonl.{pid}"


def record_worked_example(tmp_path, caplog):
    """One swap-in of the worked example while recording to ``t.jsonl``
    (this process's file: ``t.jsonl.<pid>``); its case."""
    c = worked_example([4, 2, 7])
    trace.configure({"path": str(tmp_path / "t.jsonl")})
    try:
        with caplog.at_level("WARNING"):
            load_cache_to_device_buffer_mla(**c.kwargs())
    finally:
        trace.configure(None)
    return c


def test_a_link_planted_at_the_trace_path_is_never_written_through(tmp_path, caplog):
    """A server (often root) records to a predictable path, perhaps in /tmp:
    a symbolic link planted there by another user stops the recording with a
    warning; its target is untouched and the swap-in still runs."""
    target = tmp_path / "victim"
    target.write_text("untouched")
    planted = tmp_path / f"t.jsonl.{os.getpid()}"
    planted.symlink_to(target)
    c = record_worked_example(tmp_path, caplog)
    assert target.read_text() == "untouched"
    assert "symbolic link" in caplog.text
    assert c.out[0].tolist() == [7, 3, 11], "the swap-in itself ran"


def test_a_fifo_at_the_trace_path_is_refused_at_once(tmp_path, caplog):
    """A FIFO planted where a server records (no one reading it) is refused
    without waiting, named as what it is."""
    os.mkfifo(tmp_path / f"t.jsonl.{os.getpid()}")
    record_worked_example(tmp_path, caplog)
    assert "FIFO" in caplog.text
