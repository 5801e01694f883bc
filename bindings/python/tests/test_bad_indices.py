"""Bad indices the GPU kernels record surface without stalling: the watch
polls at most once per interval, from kvtier's entry points and from the host
pool's per-step backup, and warns or raises. The GPU side of a poll (a
snapshot of the error word on the engine's own stream) is tests/gpu.rs's
`bad_indices_surface_through_polls_without_waiting`; here the engines are
stand-ins that report what a poll would."""

from __future__ import annotations

import importlib
import logging

import pytest
from conftest import worked_example

import kvtier
import kvtier.sglang
from kvtier import KvtierError
from kvtier.sglang import bad_indices
from kvtier.sglang.bad_indices import BadIndexWatch

COORD = "sglang.srt.managers.hisparse_coordinator"
REPORT = ("2 entries were refused for bad indices, none followed (...); first: swap-in row 1, column 3: "
          "token 9000 is not below seq_lens")


class FakeEngine:
    def __init__(self, hits):
        self.hits, self.polls = list(hits), 0

    def poll(self):
        self.polls += 1
        return self.hits.pop(0) if self.hits else None


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_report_is_warned_once_with_its_count_and_first_entry(caplog):
    engine, clock = FakeEngine([None, (2, REPORT)]), Clock()
    watch = BadIndexWatch("warn", 1.0, engines=lambda: [(0, engine)], clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        watch.maybe_poll()
        watch.maybe_poll()  # within the interval: no poll
        assert engine.polls == 1
        clock.t += 1.0
        watch.maybe_poll()
        clock.t += 1.0
        watch.maybe_poll()
    assert engine.polls == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"kvtier: 2 new bad-index entries on cuda:0: {REPORT}"]


def test_raise_mode_raises_and_off_never_polls():
    engine = FakeEngine([(1, REPORT)])
    watch = BadIndexWatch("raise", 0.0, engines=lambda: [(3, engine)], clock=Clock())
    with pytest.raises(KvtierError) as e:
        watch.maybe_poll()
    assert e.value.status == "BAD_INDICES" and str(e.value) == f"bad indices on cuda:3 (1 new): {REPORT}"
    watch.maybe_poll()  # nothing new: quiet
    off = FakeEngine([(1, REPORT)])
    BadIndexWatch("off", 0.0, engines=lambda: [(0, off)], clock=Clock()).maybe_poll()
    assert off.polls == 0


def test_a_poll_that_fails_is_logged_and_the_server_goes_on(caplog):
    class Broken:
        def poll(self):
            raise KvtierError("CUDA driver call cuEventQuery failed", "DRIVER_ERROR")

    watch = BadIndexWatch("raise", 0.0, engines=lambda: [(1, Broken())], clock=Clock())
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        watch.maybe_poll()
    assert "the bad-index poll on cuda:1 failed: CUDA driver call cuEventQuery failed" in caplog.text


def test_a_cpu_engine_has_nothing_to_poll():
    # The CPU executor raises bad indices at once, so its poll is empty.
    assert kvtier.SwapInEngine("cpu").poll() is None


def test_the_installed_shim_polls_per_call_and_per_backup(fake_sglang, monkeypatch):
    kvtier.sglang.install({"devices": ["anon"], "bad_indices": "raise", "bad_index_poll_s": 0})
    engine = FakeEngine([])
    monkeypatch.setattr(bad_indices.current_watch(), "_engines", lambda: [(0, engine)])
    coord = importlib.import_module(COORD)
    hc = coord.HiSparseCoordinator()
    c = worked_example([4, 2, 7])
    kw = c.kwargs()
    kw.pop("num_real_reqs")
    kvtier.sglang.load_cache_to_device_buffer_mla(**kw)
    assert engine.polls == 1, "an entry point polls"
    hc.mem_pool_host.backup_from_device_all_layer(None, None, None, io_backend="kernel")
    assert engine.polls == 2 and hc.mem_pool_host.backups == 1, "the per-step backup polls, then backs up"
    engine.hits.append((4, REPORT))
    with pytest.raises(KvtierError, match="bad indices on cuda:0 \\(4 new\\)"):
        hc.mem_pool_host.backup_from_device_all_layer(None, None, None, io_backend="kernel")
    dsv4 = coord.HiSparseCoordinator("dsv4", layers=2, rows=2, dim=37440).mem_pool_host
    dsv4.backup_tokens_from_device_all_layer(None, None)
    assert engine.polls == 4 and dsv4.backups == 1
    kvtier.sglang.uninstall()
    assert bad_indices.current_watch().mode == "off"


@pytest.mark.parametrize("bad", [{"bad_indices": "loud"}, {"bad_index_poll_s": -1}, {"bad_index_poll_s": True},
                                 {"bad_index_poll_s": "1"}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(KvtierError, match="kvtier config: `bad_ind"):
        kvtier.sglang.KvtierConfig(**bad)
