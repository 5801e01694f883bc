"""The GPU figures the SGLang install report prints are the committed
measurements: each range quoted in ``compat.MEASURED``, ``SPEC_LEFT`` and
``ENGRAM_GATHER_LEFT`` is recomputed here from the JSON lines of the runs
under ``bench/results/`` that the text names (H200 and H100, 2026-11-26), so
that a new run, or an edited sentence, cannot leave the report quoting
figures no one measured."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from kvtier.sglang import compat

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"
RUNS = ("h200-2026-11-26", "h100-2026-11-26")
SGLANG = "SGLang 0.5.23's swap-in kernel"
FEW_MISS = "kvtier swap-in, few-miss planner"

pytestmark = pytest.mark.skipif(not (RESULTS / RUNS[0]).is_dir(), reason="no checkout's bench/results here")


def lines(run: str, name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / run / name).read_text().splitlines() if line.strip()]


def medians(run: str, files: tuple[str, ...], key) -> dict:
    """{point: {method: median µs}} of a run's JSON lines."""
    points: dict = defaultdict(dict)
    for name in files:
        for r in lines(run, name):
            points[key(r)][r["method"]] = r["median_us"]
    return points


def swap_in_speeds(run: str) -> dict:
    """{(entry, hot, batch, misses): SGLang's time over few_miss's}."""
    pts = medians(
        run,
        ("3-bench/swap-in-sglang-grid.jsonl", "3-bench/swap-in-production.jsonl"),
        lambda r: tuple(r["params"][k] for k in ("entry", "hot", "batch", "misses")),
    )
    return {p: m[SGLANG] / m[FEW_MISS] for p, m in pts.items()}


def span(values, digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}x"


def test_the_runs_are_the_binaries_of_one_commit():
    commits = {(RESULTS / run / stage / "COMMIT").read_text().strip() for run, stage in
               ((RUNS[0], "1-tests"), (RUNS[0], "3-bench"), (RUNS[0], "4-python"), (RUNS[1], "2-sanitizer"))}
    commits |= {r["commit"] for run in RUNS for r in lines(run, "3-bench/swap-in-production.jsonl")}
    assert len(commits) == 1, commits
    devices = {r["device"] for r in lines(RUNS[0], "3-bench/swap-in-production.jsonl")}
    assert devices == {"NVIDIA H200 (sm_90)"}, devices


def test_the_single_step_swap_in_figures_are_the_measured_ones():
    text = compat.MEASURED["load_cache_to_device_buffer_mla"]
    speeds = [swap_in_speeds(run) for run in RUNS]
    assert {len(s) for s in speeds} == {28}
    every = [(p, v) for s in speeds for p, v in s.items()]
    wide_copy = [v for (_, _, batch, misses), v in every if batch == 1 and misses == 410]
    other = [v for (_, _, batch, misses), v in every if batch <= 100 and not (batch == 1 and misses == 410)]
    two_waves = {hot: [v for (_, h, batch, misses), v in every if batch == 256 and misses == 2 and h == hot]
                 for hot in (4096, 8192)}
    assert f"{span(wide_copy, 1)} its speed at batch 1 with 410 misses" in text, text
    assert f"{span(other, 2)} at batch 1-100 otherwise" in text, text
    assert f"({span(two_waves[4096], 2)} at HOT 4096, {span(two_waves[8192], 2)} at 8192" in text, text
    # "below 1.0 mostly at HOT 4096"
    below = [p for p, v in every if v < 1.0 and p[2] <= 100]
    assert sum(p[1] == 4096 for p in below) > len(below) / 2


def test_the_speculative_figures_are_the_measured_ones():
    pts = medians(RUNS[0], ("3-bench/spec-swap-in.jsonl",), lambda r: json.dumps(r["params"], sort_keys=True))
    speeds = sorted(m["SGLang 0.5.23's speculative kernels"] / m["kvtier speculative swap-in"] for m in pts.values())
    assert len(speeds) == 16
    slower = [v for v in speeds if round(v, 2) < 1.0]
    assert len(slower) == 15 and round(speeds[-1], 2) == 1.0, speeds
    assert f"15 of the 16 points of its grid on an H200 ({span(slower, 2)}, 1.00x at the 16th" in compat.SPEC_LEFT


def test_the_engram_gather_figures_are_the_measured_ones():
    pts = medians(RUNS[0], ("4-python/engram-triton.jsonl",), lambda r: (r["table"], r["tokens"]))
    assert all(r["same_as_kvtier"] for r in lines(RUNS[0], "4-python/engram-triton.jsonl") if "limit" not in r["method"])
    device = [m["SGLang Triton"] / m["kvtier"] for (table, _), m in pts.items() if table == "device"]
    host_sorted = [m["SGLang Triton, sorted reads"] / m["kvtier, sorted reads"]
                   for (table, _), m in pts.items() if table == "pinned host"]
    slower = [v for v in host_sorted if v < 1.0]
    text = compat.ENGRAM_GATHER_LEFT
    assert f"{span(device, 1)} SGLang's speed on a table in GPU memory" in text, text
    assert f"{span(slower, 2)} at {len(slower)} of {len(host_sorted)} points reading a host table" in text, text
