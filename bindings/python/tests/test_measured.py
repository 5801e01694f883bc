"""The GPU figures the SGLang install report prints are the committed
measurements: each range quoted in ``compat.MEASURED``, ``SPEC_LEFT`` and
``ENGRAM_GATHER_LEFT`` is recomputed here from the JSON lines of the runs
under ``bench/results/`` that the text names (H200 and H100, 2026-11-26;
H100, 2026-11-27; H200, 2026-11-28), and so is every figure of the README's
paragraph on the latest runs, of its first screen, and of
docs/measurements.md (its tables and ranges), docs/rust-api.md and
docs/tables.md, so that a new run, or an edited sentence, cannot leave the
report or a page quoting figures no one measured."""

from __future__ import annotations

import json
import statistics
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


# The second quick pass of 2026-11-27 (H100, commit 8f21590): its paragraph
# and table in docs/measurements.md.
LATEST = "h100-2026-11-27b"
README = RESULTS.parent.parent / "README.md"
KVTIER_STEP = "kvtier: the step's swap-ins (CUDA graph)"
# the default at batch 8 and 64 on sm_90 from this run to the H200 runs of 2026-11-28
ONE_LAUNCH_STEP = "kvtier few_miss_one_launch: the step's swap-ins (CUDA graph)"
SGLANG_STEP = "SGLang 0.5.23's kernel: the step's swap-ins (CUDA graph)"
FLOOR_STEP = "link floor: each call's misses in one contiguous copy"
ONE_LAUNCH = "kvtier swap-in, few-miss planner, one launch"
ONE_LAUNCH_FROM_BATCH = 8
LIMIT = "contiguous H2D copy of the misses (limit)"


def times(values) -> str:
    """A range of speeds as the README writes it: 0.98-1.08×, or 1.07× where both ends round alike."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}×" if low == high else f"{low}-{high}×"


def h100_paragraph() -> str:
    """docs/measurements.md on the H100 run of 2026-11-27 and the H200's first pass of 2026-11-28."""
    text = (README.parent / "docs" / "measurements.md").read_text()
    start = text.index("**The H100 run of 2026-11-27**")
    return text[start:text.index("## The runs of 2026-11-26", start)]


def decode_steps(trace: str, run: str = LATEST) -> dict:
    """{method: median µs} of a trace's three measured steps in all."""
    return {r["method"]: r["median_us"] for r in lines(run, f"6-decode-step/decode-step-{trace}.jsonl")
            if r["params"]["step"] == "all"}


def latest_swap_in_points() -> dict:
    """{(file, entry, hot, batch, misses): {method: record}} over the latest run's swap-in points."""
    pts: dict = defaultdict(dict)
    for name in ("sglang-grid", "production", "realistic-h4096", "realistic-h8192", "dsv4-c4", "m3-kv"):
        for r in lines(LATEST, f"3-bench/swap-in-{name}.jsonl"):
            pts[(name, *(r["params"][k] for k in ("entry", "hot", "batch", "misses")))][r["method"]] = r
    return pts


def default_calls() -> list:
    """[(point, SGLang's time over the default's, apart)] at every point with SGLang's kernel: the
    default is one launch from batch 8 (sm_90), few_miss below; apart: -1 slower, 1 faster, 0 level."""
    out = []
    for p, m in latest_swap_in_points().items():
        ours, theirs = m[ONE_LAUNCH if p[3] >= ONE_LAUNCH_FROM_BATCH else FEW_MISS], m[SGLANG]
        apart = 1 if ours["q3_us"] < theirs["q1_us"] else -1 if ours["q1_us"] > theirs["q3_us"] else 0
        out.append((p, theirs["median_us"] / ours["median_us"], apart))
    return out


def test_the_latest_run_is_one_commit_on_an_h100():
    stages = ("1-tests", "2-sanitizer", "3-bench", "3-bench-part2", "6-decode-step")
    commits = {(RESULTS / LATEST / stage / "COMMIT").read_text().strip() for stage in stages}
    commits |= {r["commit"] for r in lines(LATEST, "3-bench/swap-in-production.jsonl")}
    assert len(commits) == 1 and next(iter(commits)).startswith("8f21590"), commits
    assert {r["device"] for r in lines(LATEST, "6-decode-step/decode-step-dsv32-128k-b64.jsonl")} == {
        "NVIDIA H100 80GB HBM3 (sm_90)"}
    # every step passed; racecheck and synccheck ran out of their time (124), and the second part's
    # last two steps were skipped at the pass's deadline, which the README says
    for stage in stages:
        codes = (RESULTS / LATEST / stage / "exit-codes.txt").read_text().split("\n")
        for line in codes:
            if line.strip():
                name, code = line.split()[:2]
                assert code == "0" or (name in ("racecheck", "synccheck") and code == "124") or (
                    stage == "3-bench-part2" and line.endswith("skipped")), line


def test_the_h100_decode_step_table_is_the_measured_one():
    text = h100_paragraph()
    for trace in ("dsv32-128k-b8", "dsv32-128k-b64"):
        m = decode_steps(trace)
        row = (f"| {m[ONE_LAUNCH_STEP] / 1000:.2f} | {m[SGLANG_STEP] / 1000:.2f} | "
               f"{m[SGLANG_STEP] / m[ONE_LAUNCH_STEP]:.2f}× | {m[FLOOR_STEP] / 1000:.2f} |")
        assert f"(`{trace}`) {row}" in text, (trace, row)
    b8, b64 = (decode_steps(t) for t in ("dsv32-128k-b8", "dsv32-128k-b64"))
    assert f"took {b8[KVTIER_STEP] / 1000:.2f} and {b64[KVTIER_STEP] / 1000:.2f} ms" in " ".join(text.split())


def test_the_h100_single_call_figures_are_the_measured_ones():
    text = " ".join(h100_paragraph().split())
    calls = default_calls()
    assert len(calls) == 42
    speeds = sorted(v for _, v, _ in calls)
    median = (speeds[20] + speeds[21]) / 2
    faster, slower = sum(a == 1 for *_, a in calls), sum(a == -1 for *_, a in calls)
    assert f"is at median {median:.2f}× SGLang's kernel (faster at {faster}, slower at {slower}" in text
    two = {p[2]: v for p, v, _ in calls if p[0] == "production" and p[3:] == (256, 2)}
    assert f"({two[4096]:.2f}× at HOT 4096, {two[8192]:.2f}× at 8192)" in text
    assert min(v for _, v, _ in calls) == two[4096]
    # the link's share at batch 64 and 256 at the published miss rates, both kernels
    shares = []
    for p, m in latest_swap_in_points().items():
        if p[0].startswith("realistic") and p[3] >= 64:
            shares += [m[LIMIT]["median_us"] / m[ONE_LAUNCH]["median_us"],
                       m[LIMIT]["median_us"] / m[SGLANG]["median_us"]]
    assert f"({min(shares):.2f}-{max(shares):.2f} of one contiguous copy" in text


# The H200 quick pass of 2026-11-28 (commit 4e141c1): its swap-in grids only.
H200_RUN = "h200-2026-11-28"


def test_the_first_h200_pass_swap_in_figures_are_the_measured_ones():
    text = " ".join(h100_paragraph().split())
    pts: dict = defaultdict(dict)
    for name in ("sglang-grid", "production", "realistic-h4096", "realistic-h8192", "small-batch",
                 "dsv4-c4", "m3-kv"):
        for r in lines(H200_RUN, f"3-bench/swap-in-{name}.jsonl"):
            assert r["commit"].startswith("4e141c1") and r["device"] == "NVIDIA H200 (sm_90)", r
            pts[(name, *(r["params"][k] for k in ("entry", "hot", "batch", "misses")))][r["method"]] = r
    calls = {}
    for p, m in pts.items():
        ours, theirs = m[ONE_LAUNCH if p[3] >= ONE_LAUNCH_FROM_BATCH else FEW_MISS], m[SGLANG]
        apart = 1 if ours["q3_us"] < theirs["q1_us"] else -1 if ours["q1_us"] > theirs["q3_us"] else 0
        calls[p] = (theirs["median_us"] / ours["median_us"], apart)
    assert len(calls) == 46
    speeds = sorted(v for v, _ in calls.values())
    median = (speeds[22] + speeds[23]) / 2
    faster, slower = sum(a == 1 for _, a in calls.values()), sum(a == -1 for _, a in calls.values())
    assert f"the default then is at median {median:.2f}× SGLang's kernel (faster at {faster}, slower at {slower})" in text
    two = {(p[2], p[3]): v for p, (v, _) in calls.items() if p[0] == "production" and p[4] == 2}
    assert (f"({two[(4096, 256)]:.2f}× at HOT 4096, {two[(8192, 256)]:.2f}× at 8192) and at batch 1 with 2 "
            f"misses ({two[(4096, 1)]:.2f}× at HOT 4096)") in text
    # the three slowest points are those the README names
    assert speeds[:3] == sorted([two[(4096, 256)], two[(8192, 256)], two[(4096, 1)]])


def test_the_h100_copy_findings_are_the_measured_ones():
    text = " ".join(h100_paragraph().split())
    gather: dict = defaultdict(dict)
    for r in lines(LATEST, "3-bench/gather.jsonl"):
        gather[json.dumps(r["params"], sort_keys=True)][r["method"]] = r["ratio_to_limit"]
    merged, lines_ = "kvtier gather, neighbouring rows merged into runs", \
        "kvtier gather, passes aligned to 128-byte host lines"
    local = [m[merged] for k, m in gather.items() if json.loads(k)["entry"] == 656
             and json.loads(k)["indices"] == "locality" and json.loads(k)["k"] == 2048 and json.loads(k)["batch"] > 1]
    assert f"moves the gather at {times(local).rstrip('×')} of the link" in text
    uniform = next(m for k, m in gather.items() if json.loads(k) == {
        "batch": 64, "context": 131072, "distinct_regions": 64, "entry": 656, "indices": "uniform", "k": 2048})
    assert f"({uniform[merged]:.2f} with uniform indices at batch 64, k 2048, against {uniform[lines_]:.2f}" in text
    pages = {r["params"]["host_pages"]: r["ratio_to_limit"] for r in lines(LATEST, "3-bench-part2/gather-host-pages.jsonl")
             if r["method"] == "kvtier gather"}
    assert f"({pages['base']:.2f} to {pages['transparent']:.2f} of the link)" in text


# The H200 passes of 2026-11-28 that chose today's swap-in default
# (SwapInChoice::default_for): the README's "latest runs" paragraph and
# table, its first screen, and the launcher's sentence (compat.MEASURED).
H200_B, H200_C = "h200-2026-11-28b", "h200-2026-11-28c"
SPLIT = "kvtier swap-in, split planner (a cluster a row, one launch)"
FIXED_LINES = "kvtier swap-in, few-miss planner, one launch, fixed-shape build, line-aligned copy"
ONE_LAUNCH_LINES = "kvtier swap-in, few-miss planner, one launch, line-aligned copy"
SPLIT_UP_TO_BATCH = 10


def latest_paragraph() -> str:
    text = README.read_text()
    start = text.index("**The latest runs**")
    return text[start:text.index("![The H200 run", start)]


def h200_points(run: str = H200_C, stage: str = "3-bench-part3") -> dict:
    """{(file, entry, hot, batch, misses): {method: record}} over a run's swap-in points with SGLang's kernel."""
    pts: dict = defaultdict(dict)
    for f in sorted((RESULTS / run / stage).glob("swap-in-*.jsonl")):
        for r in lines(run, f"{stage}/{f.name}"):
            pts[(f.stem[len("swap-in-"):], *(r["params"][k] for k in ("entry", "hot", "batch", "misses")))][
                r["method"]] = r
    return {p: m for p, m in pts.items() if SGLANG in m}


def apart(a: dict, b: dict) -> int:
    return 1 if a["q3_us"] < b["q1_us"] else -1 if a["q1_us"] > b["q3_us"] else 0


def h200_default_calls(old: bool = False) -> list:
    """[(point, SGLang's time over the default's, apart)]: today's default (the split planner to batch 10,
    the fixed-shape build with line-aligned copies above, their plain builds where the bench left them
    out), or with ``old`` the previous one (one launch from batch 8, few_miss below)."""
    out = []
    for p, m in h200_points().items():
        if old:
            ours = m[ONE_LAUNCH if p[3] >= ONE_LAUNCH_FROM_BATCH else FEW_MISS]
        elif p[3] <= SPLIT_UP_TO_BATCH:
            ours = m.get(SPLIT, m[FEW_MISS])
        else:
            ours = m.get(FIXED_LINES, m[ONE_LAUNCH_LINES])
        out.append((p, m[SGLANG]["median_us"] / ours["median_us"], apart(ours, m[SGLANG]), ours, m))
    return out


def median_of(values) -> float:
    return statistics.median(values)


def test_the_h200_runs_are_their_commits_on_an_h200():
    for run, stage, commit in ((H200_B, "3-bench", "acb1aac"), (H200_C, "3-bench-part3", "2a671a0")):
        records = [r for f in (RESULTS / run / stage).glob("swap-in-*.jsonl") for r in lines(run, f"{stage}/{f.name}")]
        assert {r["commit"][:7] for r in records} == {commit}
        assert {r["device"] for r in records} == {"NVIDIA H200 (sm_90)"}
        assert (RESULTS / run / stage / "COMMIT").read_text().startswith(commit)


def test_the_readme_single_call_figures_are_the_measured_ones():
    text = " ".join(latest_paragraph().split())
    calls = h200_default_calls()
    assert len(calls) == 54
    speeds = [v for _, v, *_ in calls]
    faster, slower = sum(c[2] == 1 for c in calls), sum(c[2] == -1 for c in calls)
    old = h200_default_calls(old=True)
    assert (f"the default is at median {median_of(speeds):.2f}× SGLang's kernel (faster at {faster}, slower at "
            f"{slower}, the quartile ranges apart; the previous default, read from the same files: "
            f"{median_of([v for _, v, *_ in old]):.2f}×, slower at {sum(c[2] == -1 for c in old)})") in text, text
    latency = [v for p, v, *_ in calls if p[4] == 2 and p[3] <= 10]
    many = [v for p, v, *_ in calls if p[3] == 1 and p[4] >= 100]
    two = {p[2]: v for p, v, *_ in calls if p[0] == "production" and p[3:] == (256, 2)}
    assert (f"{times(latency)} with 2 misses a request at batch 1-10, {times(many)} at batch 1 with hundreds of "
            f"misses, and slower by the most at batch 256 with 2 misses a request ({two[4096]:.2f}× at HOT "
            f"4096, {two[8192]:.2f}× at 8192)") in text, text
    assert min(speeds) == two[4096]
    # the link's share from batch 64 with hundreds of misses (SGLang's paths), both kernels
    link = [(m[LIMIT]["median_us"] / ours["median_us"], m[LIMIT]["median_us"] / m[SGLANG]["median_us"])
            for p, _, _, ours, m in calls if p[3] >= 64 and p[4] >= 100 and p[0] not in ("dsv4-c4", "m3-kv")]
    ours_, theirs_ = [a for a, _ in link], [b for _, b in link]
    assert (f"moves {min(ours_):.2f}-{max(ours_):.2f} of one contiguous copy of the same bytes (SGLang's kernel "
            f"{min(theirs_):.2f}-{max(theirs_):.2f})") in text, text


def test_the_readme_decode_step_table_is_the_measured_one():
    text = latest_paragraph()
    for trace in ("dsv32-128k-b8", "dsv32-128k-b64", "dsv4flash-128k-b64", "m3-128k-b64"):
        m = decode_steps(trace, H200_C)
        row = (f"| {m[KVTIER_STEP] / 1000:.2f} | {m[SGLANG_STEP] / 1000:.2f} | "
               f"{m[SGLANG_STEP] / m[KVTIER_STEP]:.2f}× | {m[FLOOR_STEP] / 1000:.2f} |")
        assert f"(`{trace}`) {row}" in text, (trace, row)
    # kvtier's row ran 2a671a0's default: the split planner at batch 8, the fixed-shape build at 64
    for trace, strategy, build in (("dsv32-128k-b8", "FewMiss", "Split"),
                                   ("dsv32-128k-b64", "FewMissOneLaunch", "FixedShape")):
        params = {(r["params"]["strategy"], r["params"]["build"])
                  for r in lines(H200_C, f"6-decode-step/decode-step-{trace}.jsonl")}
        assert params == {(strategy, build)}, params


def test_the_readme_gather_findings_are_the_measured_ones():
    text = " ".join(latest_paragraph().split())
    by_entry: dict = defaultdict(list)
    for r in lines(H200_B, "3-bench-part2/gather-entry-sizes.jsonl"):
        if r["method"].startswith("kvtier gather") and "bulk-copy" not in r["method"]:
            by_entry[r["params"]["entry"]].append(r["ratio_to_limit"])
    whole = {f"{v:.2f}" for e in (640, 768) for v in by_entry[e]}
    assert len(whole) == 1, whole
    assert (f"moves {whole.pop()} of the link at rows of 640 and 768 bytes (whole 128-byte lines), "
            f"{min(by_entry[656]):.2f}-{max(by_entry[656]):.2f} at 656") in text, text
    pages = [r["ratio_to_limit"] for r in lines(H200_B, "3-bench-part2/gather-host-pages.jsonl")
             if r["method"] in ("kvtier gather", "kvtier gather, passes aligned to 128-byte host lines")]
    assert f"lift the 128K-context one ({min(pages):.2f}-{max(pages):.2f})" in text, text


def test_the_first_screens_figures_are_the_measured_ones():
    glance = " ".join(README.read_text().split("**At a glance.**", 1)[1].split("**Contents:**", 1)[0].split())
    speeds = [m[SGLANG_STEP] / m[KVTIER_STEP]
              for m in (decode_steps(t, H200_C) for t in ("dsv32-128k-b8", "dsv32-128k-b64"))]
    assert f"is {times(speeds)} SGLang's (H200, 2026-11-28)" in glance, glance
    calls = h200_default_calls()
    two = min(v for _, v, *_ in calls)
    assert (f"is at median {median_of([v for _, v, *_ in calls]):.2f}× over {len(calls)} points and {two:.2f}× at "
            f"batch 256 with 2 misses (H200, 2026-11-28)") in glance, glance


def test_the_launchers_single_call_sentence_is_the_measured_one():
    text = compat.MEASURED["load_cache_to_device_buffer_mla"]
    calls = h200_default_calls()
    speeds = [v for _, v, *_ in calls]
    slower = [c for c in calls if c[2] == -1]
    wide = [v for p, v, *_ in calls if p[3] == 1 and p[4] >= 100]
    two = {p[2]: v for p, v, *_ in calls if p[0] == "production" and p[3:] == (256, 2)}
    assert (f"{median_of(speeds):.2f}x its speed at the median of {len(calls)} single calls "
            f"({min(speeds):.2f}-{max(speeds):.2f}x; {span(wide, 1)} at batch 1 with hundreds of misses), "
            f"slower at {len(slower)} of them, by the most at batch 256 with 2 misses per request "
            f"({two[4096]:.2f}x at HOT 4096, {two[8192]:.2f}x at 8192)") in text, text
    steps = [f"{m[SGLANG_STEP] / m[KVTIER_STEP]:.2f}x at batch {b}"
             for b, m in ((8, decode_steps("dsv32-128k-b8", H200_C)), (64, decode_steps("dsv32-128k-b64", H200_C)))]
    assert ", ".join(steps) in text, steps


# The HiCache backend beside SGLang's file backend (CPU, 2026-11-27):
# docs/hicache.md quotes the table and the sentence below, and the README the
# sentence, recomputed here from the committed JSON.
HICACHE_RUN = RESULTS / "cpu-hicache-2026-11-27" / "hicache.json"
HICACHE_BACKENDS = (("kvtier", "kvtier"), ("file-metadata-cache", "file, metadata cache on"),
                    ("file", "file, metadata cache off"))


def hicache_table(data: dict) -> str:
    rows = [
        "| pages | backend | set, fresh store | set, full store | get, a page a call | of memcpy "
        "| get, 64 pages a call | of memcpy | get, 8 processes "
        "| `batch_exists`, 64 hits | 512 hits | restart to first hit |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["results"]:
        pages = f"{r['dtype']}, {r['page_bytes'] / 2**20:.2f} MiB"
        mem = r["memcpy"]["gb_per_s"]
        rows.append(f"| {pages} | memcpy (the limit) | | | {mem:.2f} GB/s | 1.00 | | "
                    f"| {r['memcpy_8_processes']['gb_per_s']:.2f} GB/s | | | |")
        for kind, name in HICACHE_BACKENDS:
            x = r[kind]
            rows.append(
                f"| {pages} | {name} | {x['set_page_first_fill']['gb_per_s']:.2f} GB/s "
                f"| {x['set_page']['gb_per_s']:.2f} GB/s | {x['get_page']['gb_per_s']:.2f} GB/s "
                f"| {x['get_page']['gb_per_s'] / mem:.2f} | {x['get_batch_64']['gb_per_s']:.2f} GB/s "
                f"| {x['get_batch_64']['gb_per_s'] / mem:.2f} | {x['get_8_processes']['gb_per_s']:.2f} GB/s "
                f"| {x['exists']['hit_64']['calls_per_s']:,.0f}/s | {x['exists']['hit_512']['calls_per_s']:,.0f}/s "
                f"| {x['restart_to_first_hit_ms']:.2f} ms |")
    return "\n".join(rows)


def hicache_ratios(data: dict) -> str:
    """kvtier's lookup rate over the file backend's, at 64 and 512 keys a
    batch, with the file backend's metadata cache off and on (both page
    sizes: the range)."""
    def ratio(n, kind):
        return [r["kvtier"]["exists"][f"hit_{n}"]["calls_per_s"] / r[kind]["exists"][f"hit_{n}"]["calls_per_s"]
                for r in data["results"]]
    def rng(v):
        lo, hi = min(v), max(v)
        return f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"
    def of_memcpy(what, kind="kvtier"):
        v = [r[kind][what]["gb_per_s"] / r["memcpy"]["gb_per_s"] for r in data["results"]]
        return f"{min(v):.2f}-{max(v):.2f}"
    return (f"lookups at {rng(ratio(64, 'file'))} (64 keys a batch) and {rng(ratio(512, 'file'))} (512) the file "
            f"backend's rate with its metadata cache off, {rng(ratio(64, 'file-metadata-cache'))} and "
            f"{rng(ratio(512, 'file-metadata-cache'))} with it on; a get at {of_memcpy('get_page')} of memcpy "
            f"a page a call and {of_memcpy('get_batch_64')} at 64 pages a call (the file backend: "
            f"{of_memcpy('get_page', 'file')} and {of_memcpy('get_batch_64', 'file')})")


@pytest.mark.skipif(not HICACHE_RUN.exists(), reason="no committed HiCache run here")
def test_the_hicache_page_quotes_the_measured_run():
    data = json.loads(HICACHE_RUN.read_text())
    text = (RESULTS.parents[1] / "docs" / "hicache.md").read_text()
    assert hicache_table(data) in text, hicache_table(data)
    assert hicache_ratios(data) in " ".join(text.split()), hicache_ratios(data)
    readme = (RESULTS.parents[1] / "README.md").read_text()
    assert hicache_ratios(data) in " ".join(readme.split()), "the README's HiCache figures"


# The runs of 2026-11-26 as the README's first screen, docs/measurements.md,
# docs/rust-api.md and docs/tables.md quote them: each figure recomputed from
# the runs' JSON lines, each page's text (whitespace folded) checked for it.
DOCS = RESULTS.parents[1] / "docs"
PLAN_THEN_COPY = "kvtier swap-in (plan + wide copy)"
NO_PDL = "kvtier swap-in, copy launched after the plan (no PDL)"


def page(name: str) -> str:
    return " ".join((RESULTS.parents[1] / name).read_text().split())


def rng(values, digits: int = 2, unit: str = "×") -> str:
    """A range as the pages write it: 0.93-1.18×."""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}{unit}"


def swap_in_points(run: str) -> dict:
    """{(entry, hot, batch, misses): {method: median µs}} of a run's swap-in grid."""
    return medians(run, ("3-bench/swap-in-sglang-grid.jsonl", "3-bench/swap-in-production.jsonl"),
                   lambda r: tuple(r["params"][k] for k in ("entry", "hot", "batch", "misses")))


def test_the_readmes_first_screen_quotes_the_runs():
    text = page("README.md")
    every = [(p, v) for run in RUNS for p, v in swap_in_speeds(run).items()]
    wide = [v for (_, _, b, m), v in every if b == 1 and m == 410]
    other = [v for (_, _, b, m), v in every if b <= 100 and not (b == 1 and m == 410)]
    two_waves = [v for (_, _, b, m), v in every if b == 256 and m == 2]
    h200 = sorted(swap_in_speeds(RUNS[0]).values())
    median = (h200[13] + h200[14]) / 2
    quoted = (f"kvtier's is {rng(wide, 1)} as fast at batch 1 with 410 misses and {rng(other)} elsewhere at batch "
              f"1-100, and **slower**, {rng(two_waves)}, at batch 256 with 2 misses (median {median:.2f}× over the "
              f"{len(h200)} points; `few_miss`, the default then")
    assert quoted in text, quoted
    gather = [r["ratio_to_limit"] for r in lines(RUNS[0], "3-bench/gather.jsonl") if r["method"] == "kvtier gather"]
    assert f"The top-k gather moves {rng(gather, unit='')} of what the link's contiguous copy moves" in text


def test_the_measurements_pages_swap_in_table_is_the_measured_one():
    h200, h100 = swap_in_points(RUNS[0]), swap_in_points(RUNS[1])
    text = (DOCS / "measurements.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 5") or line.startswith("| 6")]
    expected = []
    for p in sorted(h200):
        m, sglang = h200[p], h200[p][SGLANG]
        expected.append(
            f"| {p[0]} B | {p[1]} | {p[2]} | {p[3]} | {sglang:.1f} | {m[FEW_MISS]:.1f} | **{sglang / m[FEW_MISS]:.2f}×** "
            f"| {m[PLAN_THEN_COPY]:.1f} | {sglang / m[PLAN_THEN_COPY]:.2f}× | {h100[p][SGLANG] / h100[p][FEW_MISS]:.2f}× |")
    assert rows == expected, "\n".join(expected)


def test_the_measurements_pages_swap_in_findings_are_the_measured_ones():
    text = page("docs/measurements.md")
    h200, h100 = swap_in_points(RUNS[0]), swap_in_points(RUNS[1])
    a, b = swap_in_speeds(RUNS[0]), swap_in_speeds(RUNS[1])
    pick = lambda speeds, keep: [v for p, v in speeds.items() if keep(*p)]  # noqa: E731
    wide = pick(a, lambda e, h, batch, m: batch == 1 and m == 410)
    hot8192 = pick(a, lambda e, h, batch, m: m == 2 and h == 8192 and batch <= 100)
    rest = pick(a, lambda e, h, batch, m: (m == 2 and h == 4096 and batch <= 100) or (m == 410 and batch >= 10))
    assert (f"`few_miss` (kvtier's default then) is {rng(wide, 1)} SGLang's speed at batch 1 with 410 misses" in text
            and f"{rng(hot8192)} with 2 misses at HOT 8192, and {rng(rest)} with 2 misses at HOT 4096 and with 410 "
                f"misses at batch 10-256" in text), (wide, hot8192, rest)
    two = {(gpu, hot): s[(656, hot, 256, 2)] for gpu, s in (("h200", a), ("h100", b)) for hot in (4096, 8192)}
    assert (f"{two['h200', 4096]:.2f}× (HOT 4096) and {two['h200', 8192]:.2f}× (HOT 8192) on the H200, "
            f"{two['h100', 4096]:.2f}× and {two['h100', 8192]:.2f}× on the H100") in text, two
    apart = max(abs(a[p] - b[p]) for p in a)
    assert f"agree within {apart + 0.005:.2f} at every point" in text, apart
    at_least = [sum(v >= 1 for v in s.values()) for s in (a, b)]
    assert (f"at least as fast as SGLang's kernel at {at_least[0]} of the {len(a)} points on the H200" in text
            and f"; {at_least[1]} on the H100)" in text), at_least
    two_miss_ptc = [m[SGLANG] / m[PLAN_THEN_COPY] for p, m in h200.items() if p[3] == 2]
    assert f"`plan_then_copy` (the first planner) is {rng(two_miss_ptc)} SGLang's speed with 2 misses" in text
    # against the H100 run of 2026-11-25, at batch 1-100 or 2 misses
    old = swap_in_points("h100-2026-11-25-few-miss")
    points = [p for p in h100 if p[2] <= 100 or p[3] == 2]
    grew = [h100[p][FEW_MISS] / old[p][FEW_MISS] - 1 for p in points]
    by = [h100[p][FEW_MISS] - old[p][FEW_MISS] for p in points if h100[p][FEW_MISS] > old[p][FEW_MISS]]
    sglang_moved = sorted(h100[p][SGLANG] / old[p][SGLANG] - 1 for p in points)
    median = lambda v: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1:][:2]) / 2  # noqa: E731
    quoted = (f"longer at {len(by)} of the {len(points)} points of batch 1-100 or 2 misses (by "
              f"{100 * median(grew):.1f} % at the median of the {len(points)}, up to {100 * max(grew):.1f} %, "
              f"{min(by):.2f}-{max(by):.1f} µs; from the two runs' JSON lines) while SGLang's kernel's moved by "
              f"{100 * median(sglang_moved):.1f} % at the median")
    assert quoted in text, quoted


def test_the_pdl_figures_are_the_measured_ones():
    text = page("docs/rust-api.md")
    faster, slower = [], []
    for run in RUNS:
        for p, m in swap_in_points(run).items():
            (faster if m[NO_PDL] > m[PLAN_THEN_COPY] else slower).append((run, p, m[NO_PDL] - m[PLAN_THEN_COPY], m))
    per_gpu = {sum(run == r for r, *_ in faster) for run in RUNS}
    assert f"at {per_gpu.pop()} of the 28 points of the swap-in grid on each GPU" in text and not per_gpu
    gain = lambda misses: [d for _, p, d, _ in faster if p[3] == misses]  # noqa: E731
    assert f"by {rng(gain(2), 1, ' µs')} with 2 misses, by {min(gain(410)):.1f}-{max(gain(410)):.0f} µs with 410" in text
    loss2 = [-d for _, p, d, _ in slower if p[3] == 2]
    loss410 = [(-d, m[PLAN_THEN_COPY], p) for _, p, d, m in slower if p[3] == 410]
    assert len(loss2) == len(loss410) == len(RUNS) and max(loss2) < 0.3, slower
    assert len({p for *_, p in loss410}) == len(RUNS), "a different point on each GPU"
    assert f"at one 410-miss point (by {min(d for d, *_ in loss410):.0f}-{max(d for d, *_ in loss410):.0f} µs in a" \
        in text, loss410


def test_the_pdl_figures_call_lengths_are_the_measured_ones():
    text = page("docs/rust-api.md")
    loss410 = [(m[PLAN_THEN_COPY] - m[NO_PDL], m[PLAN_THEN_COPY]) for run in RUNS for p, m in swap_in_points(run).items()
               if p[3] == 410 and m[NO_PDL] <= m[PLAN_THEN_COPY]]
    assert (f"at one 410-miss point (by {min(d for d, _ in loss410):.0f}-{max(d for d, _ in loss410):.0f} µs in a "
            f"{min(t for _, t in loss410):.0f}-{max(t for _, t in loss410):.0f} µs call") in text, loss410


def test_the_speculative_figures_the_pages_quote_are_the_measured_ones():
    pts = medians(RUNS[0], ("3-bench/spec-swap-in.jsonl",), lambda r: json.dumps(r["params"], sort_keys=True))
    speeds = {k: m["SGLang 0.5.23's speculative kernels"] / m["kvtier speculative swap-in"] for k, m in pts.items()}
    slower = [v for v in speeds.values() if round(v, 2) < 1.0]
    (last,) = [json.loads(k) for k, v in speeds.items() if round(v, 2) >= 1.0]
    assert f"at 15 of the 16 points on the H200 ({rng(slower)}, 1.00× at batch {last['batch']}, " \
           f"{last['steps']} steps, {last['misses']} misses" in page("docs/measurements.md"), last
    assert f"at {len(slower)} of {len(speeds)} points of the grid ({rng(slower)} on the H200, 1.00× at the 16th" \
           in page("docs/rust-api.md")


def test_the_measurements_pages_gather_writeback_and_engram_figures_are_the_measured_ones():
    text = page("docs/measurements.md")
    gather = [r for r in lines(RUNS[0], "3-bench/gather.jsonl") if r["method"] == "kvtier gather"]
    of = lambda entry, batches: [r["ratio_to_limit"] for r in gather  # noqa: E731
                                 if r["params"]["entry"] == entry and r["params"]["batch"] in batches]
    small, wide = (1,), (8, 16, 32, 64)
    assert (f"656-byte entries reach {rng(of(656, small), unit='')} of the link at batch 1 and "
            f"{rng(of(656, wide), unit='')} at batch 8-64" in text
            and f"1152-byte entries {rng(of(1152, small), unit='')} at batch 1 and {rng(of(1152, wide), unit='')} "
                f"at batch 8-64" in text)
    uniform64 = sorted((r["params"]["k"], r["ratio_to_limit"], r["bytes"]) for r in gather if r["params"]["entry"] == 656
                       and r["params"]["batch"] == 64 and r["params"]["indices"] == "uniform" and r["params"]["k"] >= 1024)
    assert (f"({uniform64[0][1]:.2f} and {uniform64[1][1]:.2f} with uniform indices at batch 64, k 1024-2048: "
            f"{uniform64[0][2] / 1e6:.0f}-{uniform64[1][2] / 1e6:.0f} MB)") in text, uniform64
    wb = {json.dumps(r["params"], sort_keys=True): r for r in lines(RUNS[0], "3-bench/writeback.jsonl")
          if r["method"] == "kvtier writeback"}
    wb = [r for r in wb.values()]
    prefill = {r["params"]["entry"]: r["ratio_to_limit"] for r in wb if r["params"].get("tokens") == 8192}
    decode = lambda batches: [r for r in wb if r["params"]["phase"] == "decode" and r["params"]["batch"] in batches]  # noqa: E731
    assert (f"a prefill chunk of 8192 tokens reaches {prefill[656]:.2f} (656 B) and {prefill[1152]:.2f} (1152 B); "
            f"the decode step's newest token for all 61 layers "
            f"{rng([r['ratio_to_limit'] for r in decode((64,))], unit='')} at batch 64 and "
            f"{rng([r['ratio_to_limit'] for r in decode((1, 8))], unit='')} at batch 1-8 "
            f"({min(r['bytes'] for r in decode((1, 8))) / 1e3:.0f}-{max(r['bytes'] for r in decode((1, 8))) / 1e3:.0f} KB"
            ) in text
    engram = lines(RUNS[0], "3-bench/engram-gather.jsonl")
    by = lambda method, tokens: [r for r in engram if r["method"] == method and r["params"]["tokens"] in tokens]  # noqa: E731
    plain, sorted_reads = "kvtier Engram gather", "kvtier Engram gather, sorted reads (sort not timed)"
    staging = "host index_select to pinned staging + one H2D copy (SGLang's staging)"
    (big,), (big_sorted,) = by(plain, (8192,)), by(sorted_reads, (8192,))
    assert (f"{rng([r['ratio_to_limit'] for r in by(plain, (1, 8, 64, 320))], unit='')} of the link at 1-320 tokens, "
            f"{big['ratio_to_limit']:.2f} at 8192 tokens ({big['bytes'] / 1e6:.1f} MB; "
            f"{big_sorted['ratio_to_limit']:.2f} with the ids sorted") in text
    assert f"at {rng([r['ratio_to_limit'] for r in engram if r['method'] == staging], unit='')}." in text
    # beside SGLang's Triton kernel, from Python (4-python): also docs/tables.md's
    pts = medians(RUNS[0], ("4-python/engram-triton.jsonl",), lambda r: (r["table"], r["tokens"]))
    ids = {t: [m["SGLang Triton"] / m["kvtier"] for (table, _), m in pts.items() if table == t]
           for t in ("device", "pinned host")}
    addr = {t: [m["SGLang Triton, sorted reads"] / m["kvtier, sorted reads"] for (table, _), m in pts.items()
                if table == t] for t in ("device", "pinned host")}
    slower = [v for v in addr["pinned host"] if v < 1.0]
    faster = sorted((v for v in addr["pinned host"] if v >= 1.0), reverse=True)
    assert (f"kvtier's is {rng(ids['device'], 1)} its speed on a table in GPU memory (SGLang reads device tables so) "
            f"and {rng(ids['pinned host'], 1)} on a host table; read in address order it is "
            f"{rng(addr['device'])} on a table in GPU memory and, on a host table, {rng(slower)} at "
            f"{len(slower)} of {len(addr['pinned host'])} points "
            f"({' and '.join(f'{v:.2f}×' for v in faster)} at the others)") in text
    assert (f"kvtier's was {rng(ids['device'], 1)} the speed of SGLang's Triton kernel on a table in GPU memory" in
            page("docs/tables.md") and f"but {rng(slower)} at {len(slower)} of {len(addr['pinned host'])} sizes "
                                       f"reading a host table in address order" in page("docs/tables.md"))


def test_the_measurements_pages_per_call_figures_are_the_measured_ones():
    calls = {r["case"]: r["median_us"] for r in lines(RUNS[0], "4-python/per-call-cuda.jsonl")}
    entry_points = [v for k, v in calls.items() if k.startswith("load_") and not k.endswith("+plan")]
    assert (f"{rng(entry_points, 1, ' µs')} per swap-in entry point, "
            f"{calls['load_cache_to_device_buffer_mla+plan']:.1f} µs with a caller's miss plan, "
            f"{calls['copy_cache_planned_mla']:.1f} µs for a replay (`copy_cache_planned_mla`), against "
            f"{calls['floor: an empty Python call, same arguments']:.1f} µs for an empty Python call") \
        in page("docs/measurements.md"), calls


def test_the_sglang_pages_torch_per_call_figures_are_the_measured_ones():
    """Medians of each case's three runs; the range over the four swap-in
    entry points (the recorded plan's call included)."""
    def cases(reader):
        runs = defaultdict(list)
        for r in lines(".", f"python-per-call-torch-cpu-{reader}.jsonl"):
            assert r["reader"] == reader and r["device"] == "torch-cpu", r
            runs[r["case"]].append(r["median_us"])
        assert all(len(v) == 3 for v in runs.values()), runs
        return {k: statistics.median(v) for k, v in runs.items()}

    readers = ("exchange", "to_dlpack", "methods")
    by = {b: cases(b) for b in readers}
    swap = {b: [v for k, v in by[b].items() if k.startswith("load_")] for b in readers}
    sglang = [v for b in readers for k, v in by[b].items() if k.startswith("sglang:")]
    floor = "floor: an empty Python call, same arguments"
    text = " ".join(page("docs/sglang.md").split())
    assert (f"a swap-in call took {rng(swap['exchange'], 1, ' µs')} through the exchange table, "
            f"{rng(swap['to_dlpack'], 1, ' µs')} through `to_dlpack` and {rng(swap['methods'], 1, ' µs')} through "
            f"the tensors' methods. A replay took {by['exchange']['copy_cache_planned_mla']:.1f}, "
            f"{by['to_dlpack']['copy_cache_planned_mla']:.1f} and {by['methods']['copy_cache_planned_mla']:.1f} µs. "
            f"The empty call took {by['exchange'][floor]:.1f}, {by['to_dlpack'][floor]:.1f} and "
            f"{by['methods'][floor]:.1f} µs.") in text
    assert len(sglang) == 3, sglang
    assert f"SGLang 0.5.23's own entry point, timed in the same runs: {rng(sglang, 1, ' µs')}." in text
    mla = by["exchange"]["load_cache_to_device_buffer_mla"]
    assert f"the CPU executor's work included, took {mla:.1f} µs: level with it." in text
    assert abs(mla - max(sglang)) < 0.5, "the page's 'level with it' no longer holds"
    numpy = {r["case"]: r["median_us"] for r in lines(".", "python-per-call-cpu.jsonl")}
    loads = [v for k, v in numpy.items() if k.startswith("load_")]
    assert (f"on numpy arrays: {min(loads):.1f} to {max(loads):.1f} µs, against {numpy[floor]:.1f} µs for the "
            f"empty call") in text
    assert f"A replay costs {numpy['copy_cache_planned_mla']:.1f} µs." in text
