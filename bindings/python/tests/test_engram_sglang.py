"""DeepSeek-V4.1's Engram tables in kvtier's table store, through SGLang's own
``EngramEmbedding`` (the release under test, imported for real; CPU tensors):
install() patches its host table and, by choice, its gather; a layer built
as SGLang builds it loads its table from the "checkpoint" once, a second
start with the same checkpoint attaches and writes nothing, another
checkpoint gets another table, and every lookup equals SGLang's own torch
lookup of the same rows bit for bit."""

from __future__ import annotations

import types

import numpy as np
import pytest

from real_sglang import forget, import_quietly, needs_sglang

ENGRAM = "sglang.srt.layers.engram"


class OneRankGroup:
    rank_in_group, world_size = 0, 1

    def barrier(self):
        pass


@pytest.fixture
def engram_sglang(monkeypatch, tmp_path):
    """SGLang's engram module with kvtier installed (table store in tmp_path,
    kvtier's gather chosen), one TP rank, the host table on."""
    import kvtier.sglang

    forget()
    monkeypatch.delenv(kvtier.sglang.ENV, raising=False)
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1")
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "shared")
    store = tmp_path / "tables"
    report = kvtier.sglang.install({"devices": ["anon"], "rank": 0, "ranks": 1,
                                    "engram_tables": {"store": str(store), "gather": True, "wait_s": 5}})
    assert report.installs, report.lines()
    served = {r.name: r.served_by for r in report.routes}
    assert served["_HostTable"] == "kvtier" and served["engram_gather"] == "kvtier", report.lines()
    module = import_quietly(ENGRAM)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model-00001.safetensors").write_bytes(b"weights v1")
    (checkpoint / "config.json").write_text("{}")
    model = types.SimpleNamespace(model_path=str(checkpoint), revision=None)
    monkeypatch.setattr(module, "get_model", lambda: model)
    parallel = types.SimpleNamespace(tp_size=1, tp_rank=0, tp_group=OneRankGroup(), attn_dp_size=1, attn_cp_size=1)
    monkeypatch.setattr(module, "get_parallel", lambda: parallel)
    yield types.SimpleNamespace(module=module, store=store, checkpoint=checkpoint, parallel=parallel)
    kvtier.sglang.uninstall()
    forget()


def checkpoint_tensors(rows: int, dim: int, block: int, seed: int):
    """A layer's fp8 rows and e8m0 scales as the checkpoint holds them: no
    NaN values and no 255 scale (where torch's e8m0 reads NaN and SGLang's
    Triton kernel, like kvtier, +inf)."""
    import torch

    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x38
    s = rng.integers(0, 255, size=(rows, dim // block), dtype=np.uint8)
    s[0, 0] = 0  # 2^-127: subnormal products
    return (torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(s).view(torch.float8_e8m0fnu))


def new_embedding(module, rows, dim, layer):
    """SGLang's EngramEmbedding (0.5.23 takes the hash columns' bounds; one
    column here, so its rows split evenly over the ranks as before)."""
    import inspect

    if "column_bounds" in inspect.signature(module.EngramEmbedding).parameters:
        return module.EngramEmbedding(rows, dim, layer, column_bounds=(0, rows))
    return module.EngramEmbedding(rows, dim, layer)


def build_and_load(module, rows, dim, layer, weight, scale):
    embed = new_embedding(module, rows, dim, layer)
    embed.weight.weight_loader(embed.weight, weight)
    embed.scale.weight_loader(embed.scale, scale)
    embed.finish_load(f"layer {layer}")
    return embed


def sglang_torch_lookup(module, monkeypatch, rows, dim, layer, weight, scale, ids):
    """SGLang's own lookup of the same rows: its device-table layout (host
    table off) on CPU tensors, which takes its torch path."""
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "0")
    plain = new_embedding(module, rows, dim, layer)
    plain.weight.data.copy_(weight)
    plain.scale.data.copy_(scale)
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1")
    return plain._owned_rows(ids)


@needs_sglang
def test_a_table_loads_once_and_every_start_after_attaches(engram_sglang, monkeypatch):
    import torch

    from kvtier.sglang.engram import KvtierEngramTable

    m = engram_sglang.module
    rows, dim, block = 3000, 64, m.FP8_BLOCK_SIZE
    weight, scale = checkpoint_tensors(rows, dim, block, seed=1)
    first = build_and_load(m, rows, dim, 1, weight, scale)
    table = first.host_table
    assert isinstance(table, KvtierEngramTable) and table.ready
    assert table.written_bytes == rows * (dim + dim // block)
    files = sorted(engram_sglang.store.iterdir())
    assert len(files) == 1
    # the staging path's CPU views are the checkpoint's bytes
    assert torch.equal(first.weight.data.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(first.scale.data.view(torch.uint8), scale.view(torch.uint8))
    assert first._host_table_ptrs == (table.device_ptr, table.device_ptr + rows * dim)

    ids = torch.tensor([[0, 5, rows - 1], [17, 17, 2999]], dtype=torch.int64)
    want = sglang_torch_lookup(m, monkeypatch, rows, dim, 1, weight, scale, ids)
    got = first(ids)  # SGLang's forward: the shared table through kvtier's gather
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, dim)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # sorted reads (what SGLang asks for on a GPU without ATS): the same rows
    out = torch.empty(6, dim, dtype=torch.bfloat16)
    m.engram_gather(*first._host_table_ptrs, ids.reshape(-1), out, dim, block, sort_ids=True)
    assert torch.equal(out.view(torch.int16), want.view(-1, dim).view(torch.int16))

    # a restart (a second server, or the same one again): the table is READY
    # under the same key, so nothing is written and the bytes are the same
    second = build_and_load(m, rows, dim, 1, weight, scale)
    assert second.host_table.ready and second.host_table.written_bytes == 0
    assert second.host_table.path == table.path
    assert torch.equal(second(ids).view(torch.int16), want.view(torch.int16))

    # ids past the table (SGLang's shared table passes row_hi = 2**62) are
    # refused and their rows +0, where SGLang's kernel would read past it
    import kvtier

    past = torch.tensor([5, rows + 7], dtype=torch.int32)
    out = torch.full((2, dim), 7.0, dtype=torch.bfloat16)
    with pytest.raises(kvtier.KvtierError) as e:
        m.engram_gather(*second._host_table_ptrs, past, out, dim, block)
    assert e.value.status == "BAD_INDICES" and f"ids[1] = {rows + 7}" in str(e.value)
    assert torch.equal(out[0].view(torch.int16), want[0, 1].view(torch.int16))
    assert not out[1].view(torch.int16).any()


@needs_sglang
def test_another_checkpoint_never_attaches_to_the_old_table(engram_sglang):
    import torch

    m = engram_sglang.module
    rows, dim = 512, 64
    old_w, old_s = checkpoint_tensors(rows, dim, m.FP8_BLOCK_SIZE, seed=2)
    old = build_and_load(m, rows, dim, 14, old_w, old_s)
    (engram_sglang.checkpoint / "model-00001.safetensors").write_bytes(b"weights v2, longer")
    new_w, new_s = checkpoint_tensors(rows, dim, m.FP8_BLOCK_SIZE, seed=3)
    new = build_and_load(m, rows, dim, 14, new_w, new_s)
    assert new.host_table.path != old.host_table.path and new.host_table.written_bytes > 0
    assert torch.equal(new.weight.data.view(torch.uint8), new_w.view(torch.uint8))
    assert torch.equal(old.weight.data.view(torch.uint8), old_w.view(torch.uint8))
    assert len(list(engram_sglang.store.iterdir())) == 2


@needs_sglang
def test_the_per_rank_layout_holds_a_ranks_rows(engram_sglang, monkeypatch):
    """Rank 1 of 2 in the per-rank layout: its table holds its own rows, and
    SGLang's owned-rows lookup through kvtier's gather gives its rows and +0
    for the others, as SGLang's torch lookup does."""
    import torch

    m = engram_sglang.module
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "per_rank")
    p = engram_sglang.parallel
    p.tp_size, p.tp_rank = 2, 1
    rows, dim = 1000, 64
    weight, scale = checkpoint_tensors(rows, dim, m.FP8_BLOCK_SIZE, seed=4)
    embed = build_and_load(m, rows, dim, 1, weight, scale)
    assert (embed.row_start, embed.rows) == (500, 500)
    assert embed.host_table.layout == "per_rank" and embed.host_table.nbytes == 500 * (64 + 2)
    ids = torch.tensor([0, 499, 500, 777, 999], dtype=torch.int32)
    got = embed._owned_rows(ids)
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "0")
    plain = new_embedding(m, rows, dim, 1)
    plain.weight.data.copy_(weight[500:])
    plain.scale.data.copy_(scale[500:])
    want = plain._owned_rows(ids)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not got[:2].view(torch.int16).any() and got[2:].view(torch.int16).any()


@needs_sglang
def test_without_the_config_sglangs_host_table_is_left_alone(monkeypatch):
    import kvtier.sglang

    forget()
    monkeypatch.delenv(kvtier.sglang.ENV, raising=False)
    report = kvtier.sglang.install({"devices": ["anon"], "rank": 0, "ranks": 1})
    try:
        module = import_quietly(ENGRAM)
        served = {r.name: (r.served_by, r.why) for r in report.routes}
        assert served["_HostTable"] == ("SGLang", "engram_tables is off in the kvtier config")
        assert served["engram_gather"][0] == "SGLang"
        from kvtier.sglang.engram import engram_gather

        assert module.engram_gather is not engram_gather
        assert module.EngramEmbedding._init_host_table.__module__ == ENGRAM
    finally:
        kvtier.sglang.uninstall()
        forget()


@needs_sglang
def test_the_scale_may_come_before_the_weight_and_in_another_dtype(engram_sglang):
    """SGLang's loader reads the checkpoint's keys in sorted order (the
    scale first) on a thread pool, and a scale may come as float32: the
    table still completes, byte for byte the checkpoint's, the chunk the
    weight and scale share included (w_bytes is not chunk-aligned here)."""
    import torch

    m = engram_sglang.module
    rows, dim = 40_000, 64  # 2,560,000 B of weights: past one 2 MiB chunk, not on a boundary
    weight, scale = checkpoint_tensors(rows, dim, m.FP8_BLOCK_SIZE, seed=8)
    embed = new_embedding(m, rows, dim, 1)
    embed.scale.weight_loader(embed.scale, scale.float())
    embed.weight.weight_loader(embed.weight, weight)
    embed.finish_load("layer 1")
    assert embed.host_table.ready
    assert torch.equal(embed.weight.data.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(embed.scale.data.view(torch.uint8), scale.view(torch.uint8))


@needs_sglang
def test_a_weight_update_is_refused_not_ignored(engram_sglang):
    import kvtier

    m = engram_sglang.module
    weight, scale = checkpoint_tensors(256, 64, m.FP8_BLOCK_SIZE, seed=9)
    embed = build_and_load(m, 256, 64, 1, weight, scale)
    new_w, _ = checkpoint_tensors(256, 64, m.FP8_BLOCK_SIZE, seed=10)
    with pytest.raises(kvtier.KvtierError, match="weight update"):
        embed.weight.weight_loader(embed.weight, new_w)


@needs_sglang
def test_a_model_built_on_the_meta_device_and_dropped_holds_nothing(engram_sglang):
    """SGLang builds a meta-device copy of the model to learn its structure
    and drops it: that copy must not hold the table's load lock, or the real
    model would wait on its own process."""
    import gc
    import time

    import torch

    m = engram_sglang.module
    weight, scale = checkpoint_tensors(512, 64, m.FP8_BLOCK_SIZE, seed=11)
    with torch.device("meta"):
        ghost = new_embedding(m, 512, 64, 1)
    assert ghost.weight.is_meta and not ghost.host_table.ready
    del ghost
    gc.collect()
    started = time.monotonic()
    embed = build_and_load(m, 512, 64, 1, weight, scale)
    assert embed.host_table.ready and time.monotonic() - started < 4  # the fixture's wait is 5 s


@needs_sglang
def test_rank_0_tells_the_other_ranks_when_its_table_fails(engram_sglang):
    """The shared layout: rank 0's finish_load sends its outcome (here: the
    scale never came) to the other ranks instead of leaving them at a
    barrier, and raises it."""
    import kvtier

    m = engram_sglang.module
    sent = []

    class TwoRanks:
        rank_in_group, world_size = 0, 2

        def broadcast_object(self, obj, src=0):
            sent.append(obj)
            return obj

        def barrier(self):
            raise AssertionError("a barrier rank 0 may never reach")

    engram_sglang.parallel.tp_group = TwoRanks()
    weight, _ = checkpoint_tensors(256, 64, m.FP8_BLOCK_SIZE, seed=12)
    embed = new_embedding(m, 256, 64, 1)
    embed.weight.weight_loader(embed.weight, weight)
    with pytest.raises(kvtier.KvtierError, match="never written"):
        embed.finish_load("layer 1")
    assert isinstance(sent[0], str) and sent[-1] and "never written" in sent[-1]
