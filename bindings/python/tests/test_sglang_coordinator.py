"""SGLang's real HiSparse coordinator decoding on the CPU with kvtier installed
(sglang_drive.py says how, and what a CPU cannot run): DSA, DSA with
shared-index layers replaying their anchor's plan, DeepSeek-V4 and
MiniMax-M3, several requests of different lengths, 48 steps × 6 layers,
hits and misses, padded batches, every swapped-in row byte-checked. The same
drive without kvtier fails at the first swap-in, in SGLang's CUDA kernel;
and the drive's checks catch a wrong byte and a replay that copies nothing.
Skipped where SGLang's modules do not import."""

from __future__ import annotations

import traceback

import pytest
from real_sglang import forget, import_quietly, install_into_sglang, needs_sglang, uninstall_sglang

pytestmark = needs_sglang

torch = pytest.importorskip("torch")
COORDINATOR = "sglang.srt.managers.hisparse_coordinator"


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """The one-rank gloo group the coordinator's tensor-parallel group is."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads cost more than they save (10-30 s a
    path with the default, about 1 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kvtier_session():
    """Undoes what `with_kvtier` did, once, at the end of the module."""
    state = {"mp": pytest.MonkeyPatch(), "coordinator": None}
    yield state
    uninstall_sglang()
    state["mp"].undo()


@pytest.fixture
def with_kvtier(process_group, one_thread, kvtier_session):
    """The coordinator module, kvtier installed (through the import hook),
    the CPU shims applied; reused while it is the module SGLang has loaded
    (a test without kvtier drops it)."""
    import sys

    import kvtier.sglang
    from sglang_drive import cpu_shims

    coordinator = kvtier_session["coordinator"]
    if coordinator is None or sys.modules.get(COORDINATOR) is not coordinator or \
            not kvtier.sglang._patch.is_installed(coordinator):
        mp = kvtier_session["mp"]
        coordinator = install_into_sglang(mp, bind_kernel_module=False).coordinator
        cpu_shims(mp, coordinator)
        kvtier_session["coordinator"] = coordinator
    return coordinator


@pytest.fixture
def without_kvtier(process_group, one_thread, monkeypatch):
    """The coordinator module as SGLang ships it, the CPU shims applied."""
    import kvtier.sglang
    from sglang_drive import cpu_shims

    kvtier.sglang.uninstall()
    forget()
    coordinator = import_quietly(COORDINATOR)
    cpu_shims(monkeypatch, coordinator)
    yield coordinator
    forget()


@pytest.mark.parametrize("path", ["dsa", "dsa-shared", "dsv4", "m3"])
def test_decode_through_sglangs_coordinator_is_byte_exact(with_kvtier, path):
    import kvtier.sglang
    from sglang_drive import LAYERS, drive

    def counted():
        total = dict.fromkeys(("calls", "rows", "hits", "misses", "bytes", "bad_indices"), 0)
        for c in kvtier.sglang.swap_in_counters().get("cpu", []):
            for f in total:
                total[f] += getattr(c, f)
        return total

    before = counted()
    st = drive(with_kvtier, path, steps=48)
    assert st.steps == 48 and st.swap_ins == 48 * LAYERS
    assert st.misses > 1000 and st.rows_checked > 50_000 and st.padded_rows == 32, st
    assert (st.replays > 0) == (path in ("dsa-shared", "dsv4")), st
    kvtier.sglang.check("cpu")  # no bad index recorded
    # the layers' counters, summed, are what the harness counted against
    # SGLang's own state: every swap-in but the replays, its real rows, the
    # selected tokens found in the hot buffer and those loaded, their bytes
    after = counted()
    gained = {f: after[f] - before[f] for f in after}
    assert gained == {
        "calls": st.swap_ins - st.replays, "rows": st.counted_rows, "hits": st.hits, "misses": st.misses,
        "bytes": st.misses * st.item_bytes, "bad_indices": 0,
    }, (gained, st)


@pytest.mark.parametrize("path", ["dsa", "dsa-shared", "dsv4", "m3"])
def test_int32_indices_and_lengths_every_other_step(with_kvtier, path):
    from sglang_drive import drive

    st = drive(with_kvtier, path, steps=12, seed=99, int32=True)
    assert st.misses > 0 and st.rows_checked > 0, st


@pytest.mark.parametrize("path", ["dsa", "dsa-shared", "dsv4", "m3"])
def test_without_kvtier_only_sglangs_cuda_kernel_fails(without_kvtier, path):
    """Pools, admission and the per-step slot mapping all run; the first
    swap-in fails inside SGLang's own kernel module (its CUDA kernel is built
    at first use)."""
    from sglang_drive import SERVED, drive

    with pytest.raises(Exception) as e:
        drive(without_kvtier, path, steps=2, expect_kvtier=False)
    assert not isinstance(e.value, AssertionError), "the drive's own check failed, not SGLang's kernel"
    frames = traceback.extract_tb(e.value.__traceback__)
    names = [f.name for f in frames]
    assert "swap_in_selected_blocks" in names if path == "m3" else "swap_in_selected_pages" in names, names
    entered = [i for i, f in enumerate(frames) if f.name in SERVED and "sglang/kernels/" in f.filename]
    assert entered, f"failed before SGLang's kernel entry point: {frames[-1]}"
    assert all("sglang/kernels/" in f.filename or "/site-packages/" in f.filename or "/lib/python" in f.filename
               for f in frames[entered[0]:]), frames[entered[0]:]


def test_the_checks_catch_a_wrong_byte(with_kvtier, monkeypatch):
    from sglang_drive import drive

    real = with_kvtier.load_cache_to_device_buffer_mla

    def one_byte_off(**kw):
        real(**kw)
        locs = kw["top_k_device_locs"]
        if locs.shape[0] > 4 and int(locs[4, 3]) >= 0:
            kw["device_buffer"][int(locs[4, 3])].view(-1).view(torch.uint8)[5] ^= 1

    one_byte_off.__module__ = "kvtier.planted"
    monkeypatch.setattr(with_kvtier, "load_cache_to_device_buffer_mla", one_byte_off)
    with pytest.raises(AssertionError, match="request 4 layer 0 .*1 rows differ"):
        drive(with_kvtier, "dsa", steps=2)


def test_the_checks_catch_a_replay_that_copies_nothing(with_kvtier, monkeypatch):
    from sglang_drive import drive

    def copies_nothing(**kw):
        pass

    copies_nothing.__module__ = "kvtier.planted"
    monkeypatch.setattr(with_kvtier, "copy_cache_planned_mla", copies_nothing)
    with pytest.raises(AssertionError, match=r"layer 1 .*\(replayed\)"):
        drive(with_kvtier, "dsa-shared", steps=2)


@pytest.mark.parametrize("path", ["dsa", "dsv4", "m3"])
def test_a_recorded_trace_replays_to_the_hits_and_misses_of_its_run(with_kvtier, path, tmp_path):
    """The shim records what SGLang's coordinator asks for while it decodes;
    ``kvtier plan --trace`` replays the file at the recorded HOT size through
    the swap-in's policy and gets the hits and misses the run counted, layer
    by layer; at other sizes it still runs (and a bigger buffer misses no
    more than a smaller one here)."""
    import json
    import os
    import subprocess
    import sys

    import kvtier.sglang
    from kvtier.sglang import trace
    from sglang_drive import drive

    def per_layer():
        return [(c.calls, c.rows, c.hits, c.misses) for c in kvtier.sglang.swap_in_counters().get("cpu", [])]

    before = per_layer()
    trace.configure({"path": str(tmp_path / "trace-{pid}.jsonl")})
    file = tmp_path / f"trace-{os.getpid()}.jsonl"
    try:
        st = drive(with_kvtier, path, steps=24, seed=7)
    finally:
        trace.configure(None)
    after = per_layer()
    gained = {
        layer: tuple(a - b for a, b in zip(c, before[layer] if layer < len(before) else (0, 0, 0, 0)))
        for layer, c in enumerate(after)
    }
    gained = {layer: g for layer, g in gained.items() if g[0]}
    assert sum(g[3] for g in gained.values()) == st.misses > 0, (gained, st)
    header = json.loads(file.read_text().splitlines()[0])
    hot = header["hot"]

    def replay(*sizes):
        out = subprocess.run([sys.executable, "-m", "kvtier", "plan", "--trace", str(file), "--json", "--hot",
                              ",".join(map(str, sizes))], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["curve"]

    [at_hot] = replay(hot)
    layers = {n: (c["calls"], c["rows"], c["hits"], c["misses"]) for n, c in enumerate(at_hot["per_layer"]) if c["calls"]}
    # the recording numbers layers as the counters do, so layer n is layer n
    assert layers == gained, (layers, gained)
    assert at_hot["bytes"] == st.misses * st.item_bytes
    smaller, bigger = replay(max(hot // 2, 1), hot * 2)
    assert bigger["misses"] <= at_hot["misses"], (bigger, at_hot)
    assert smaller["hits"] + smaller["misses"] > 0
    # the decode-step scenario replays the same file a step at a time (every
    # recorded layer's call, at SGLang's padded batch) to the run's misses
    out = subprocess.run([sys.executable, "-m", "kvtier", "bench", "--scenario", "decode-step", "--trace", str(file),
                          "--replay-only", "--executor", "cpu", "--pool-memory", "64MiB"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f", {st.misses} misses in all;" in out.stdout, out.stdout
