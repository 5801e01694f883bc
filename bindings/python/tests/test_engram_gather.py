"""kvtier's Engram gather under SGLang's signature on the CPU executor (numpy
arrays, raw host addresses), against an independent model of SGLang's
arithmetic written here with numpy; and bad input refused with a clear
error, never a crash."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.sglang.engram import ALL_ROWS, engram_gather, forget_table, register_table


def e4m3(b: np.ndarray) -> np.ndarray:
    """e4m3fn bytes as float64 (bias 7, no infinities, S.1111.111 NaN)."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    value = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where((e == 0xF) & (m == 0x7), np.nan, sign * value)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """float64 values that are exact in float32, rounded once to bf16 bits
    (ties to even); NaN as 0x7FFF."""
    f = x.astype(np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FFF), rounded)


def model(weights, scales, ids, dim, block, row_lo, row_hi):
    """The rows SGLang's arithmetic gives: bf16(f32(w) × 2^(e − 127)), e == 0
    meaning 2^−127 and e == 255 +inf; +0 for ids outside the range or past
    the table."""
    rows = weights.shape[0]
    out = np.zeros((len(ids), dim), dtype=np.uint16)
    for i, g in enumerate(ids):
        local = int(g) - row_lo
        if not (row_lo <= g < row_hi) or local >= rows:
            continue
        e = np.repeat(scales[local].astype(np.int64), block)
        scale = np.where(e == 0, 2.0**-127, np.where(e == 255, np.inf, 2.0 ** (e - 127.0)))
        with np.errstate(invalid="ignore", over="ignore"):
            out[i] = bf16_rne(e4m3(weights[local]) * scale)
    return out


def table(rows, dim, block, seed):
    rng = np.random.default_rng(seed)
    w = np.zeros(rows * dim + 16, dtype=np.uint8)[:rows * dim].reshape(rows, dim)  # 16-byte aligned base
    w[:] = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    s = rng.integers(0, 256, size=(rows, dim // block), dtype=np.uint8)
    s[0, :] = [0, 255, 127, 1][: dim // block] + [127] * max(0, dim // block - 4)
    return w, s


@pytest.mark.parametrize("dim,block", [(64, 32), (256, 32), (8, 8), (32, 1)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_rows_match_the_model_bit_for_bit(dim, block, dtype):
    w, s = table(97, dim, block, seed=dim + block)
    ids = np.array([0, 1, 96, 5, 5, -1, 97, 2**31 - 1, 40, 0], dtype=dtype)
    row_lo, row_hi = 0, 97
    out = np.full((len(ids), dim), 0xABCD, dtype=np.uint16)
    got = engram_gather(w.ctypes.data, s.ctypes.data, ids, out, dim, block, row_lo, row_hi)
    assert got is out
    assert np.array_equal(out, model(w, s, ids, dim, block, row_lo, row_hi))


def test_a_row_range_reads_the_shard_and_zeros_the_rest():
    """SGLang's per-rank table: rows 1000..1097 of the global table at the
    shard's base, ids global."""
    w, s = table(97, 64, 32, seed=7)
    ids = np.array([999, 1000, 1050, 1096, 1097, 0], dtype=np.int64)
    out = np.zeros((len(ids), 64), dtype=np.uint16)
    engram_gather(w.ctypes.data, s.ctypes.data, ids, out, 64, 32, row_lo=1000, row_hi=1097)
    assert np.array_equal(out, model(w, s, ids, 64, 32, 1000, 1097))
    assert not out[[0, 4, 5]].any() and out[1].any()


def test_the_unbounded_default_needs_a_known_table_and_reports_ids_past_it():
    w, s = table(50, 64, 32, seed=9)
    ids = np.array([3, 50, 49, 1 << 40], dtype=np.int64)
    out = np.zeros((4, 64), dtype=np.uint16)
    with pytest.raises(kvtier.KvtierError, match="rows are unknown"):
        engram_gather(w.ctypes.data, s.ctypes.data, ids, out, 64, 32)
    register_table(w.ctypes.data, 50)
    try:
        out[:] = 0xFFFF
        with pytest.raises(kvtier.KvtierError) as e:
            engram_gather(w.ctypes.data, s.ctypes.data, ids, out, 64, 32, 0, ALL_ROWS)
        assert e.value.status == "BAD_INDICES"
        assert "2 entries" in str(e.value) and "ids[1] = 50" in str(e.value), str(e.value)
        # every row is still written: the table's rows, and +0 for the two past it
        assert np.array_equal(out, model(w, s, ids, 64, 32, 0, 50))
    finally:
        forget_table(w.ctypes.data)


def test_no_ids_is_nothing():
    w, s = table(4, 64, 32, seed=1)
    out = np.zeros((0, 64), dtype=np.uint16)
    engram_gather(w.ctypes.data, s.ctypes.data, np.zeros(0, dtype=np.int32), out, 64, 32, 0, 4)


@pytest.mark.parametrize("change,match", [
    (dict(dim=48), "dim"),
    (dict(dim=64, block=24), "block_size"),
    (dict(out=np.zeros((3, 64), dtype=np.uint16)), "out"),
    (dict(out=np.zeros((4, 64), dtype=np.float32)), "out"),
    (dict(out=np.zeros((4, 64), dtype=np.uint16)[:, ::1][::1].T.copy().T), "contiguous"),
    (dict(ids=np.zeros(4, dtype=np.float64)), "ids"),
    (dict(ids=np.zeros(8, dtype=np.int32)[::2]), "contiguous"),
    (dict(row_lo=5, row_hi=4), "row_lo"),
    (dict(row_lo=-1), "row"),
    (dict(weight_ptr=1), "weights"),  # misaligned: e4m3 rows are read 8 bytes at a time
    (dict(weight_ptr=0), "weight_ptr"),
    (dict(ids=[1, 2, 3, 4]), "ids"),
    (dict(dim=True), "dim"),
    (dict(sort_ids=1), "sort_ids"),
])
def test_bad_arguments_are_refused(change, match):
    w, s = table(8, 64, 32, seed=3)
    a = dict(weight_ptr=w.ctypes.data, scale_ptr=s.ctypes.data, ids=np.arange(4, dtype=np.int32),
             out=np.zeros((4, 64), dtype=np.uint16), dim=64, block=32, row_lo=0, row_hi=8, sort_ids=False)
    a.update(change)
    with pytest.raises(kvtier.KvtierError, match=match):
        engram_gather(a["weight_ptr"], a["scale_ptr"], a["ids"], a["out"], a["dim"], a["block"], a["row_lo"],
                      a["row_hi"], sort_ids=a["sort_ids"])


def test_out_rows_place_each_row_and_are_checked():
    """The native call's out_rows (what sort_ids passes): id i's row goes to
    out[out_rows[i]]; an entry outside [0, n) writes nothing and is
    reported; a wrong dtype or length is refused."""
    from kvtier._swap_in import native

    w, s = table(16, 64, 32, seed=6)
    ids = np.array([3, 7, 9], dtype=np.int32)
    want = model(w, s, ids, 64, 32, 0, 16)
    out = np.full((3, 64), 0xABAB, dtype=np.uint16)
    native().engram_gather(w.ctypes.data, s.ctypes.data, 16, ids, out, 64, 32, 0, 16,
                           np.array([2, 0, 1], dtype=np.int32))
    assert np.array_equal(out, want[[1, 2, 0]])
    out[:] = 0xABAB
    with pytest.raises(kvtier.KvtierError, match=r"out_rows\[1\] = 3"):
        native().engram_gather(w.ctypes.data, s.ctypes.data, 16, ids, out, 64, 32, 0, 16,
                               np.array([2, 3, 0], dtype=np.int32))
    assert np.array_equal(out[2], want[0]) and np.array_equal(out[0], want[2]) and (out[1] == 0xABAB).all()
    for bad in (np.array([2, 0, 1], dtype=np.int64), np.array([0, 1], dtype=np.int32)):
        with pytest.raises(kvtier.KvtierError, match="out_rows"):
            native().engram_gather(w.ctypes.data, s.ctypes.data, 16, ids, out, 64, 32, 0, 16, bad)


def test_sort_ids_gives_the_same_rows():
    w, s = table(64, 64, 32, seed=5)
    ids = np.array([63, 2, 40, 2, 0], dtype=np.int32)
    a, b = (np.zeros((5, 64), dtype=np.uint16) for _ in range(2))
    engram_gather(w.ctypes.data, s.ctypes.data, ids, a, 64, 32, 0, 64)
    engram_gather(w.ctypes.data, s.ctypes.data, ids, b, 64, 32, 0, 64, sort_ids=True)
    assert np.array_equal(a, b)


def _cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.mark.skipif(_cuda() is None, reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["device", "pinned host"])
def test_the_cuda_kernel_matches_the_cpu_executor(where):
    """SGLang's call on torch CUDA tensors, the table in GPU memory or in
    pinned host memory the GPU maps: kvtier's kernel on the current stream,
    bit for bit the CPU executor's rows; an id past the table is recorded
    and raised by engram_check."""
    import torch

    from kvtier.sglang.engram import engram_check

    rows, dim, block = 4099, 256, 32
    w, s = table(rows, dim, block, seed=11)
    ids = np.random.default_rng(12).integers(-5, rows + 5, size=3000).astype(np.int64)
    ids[:4] = [0, rows - 1, 17, 17]
    want = np.zeros((len(ids), dim), dtype=np.uint16)
    register_table(w.ctypes.data, rows)
    try:
        with pytest.raises(kvtier.KvtierError):
            engram_gather(w.ctypes.data, s.ctypes.data, ids, want, dim, block)
    finally:
        forget_table(w.ctypes.data)
    if where == "device":
        tw, ts = torch.from_numpy(w).cuda(), torch.from_numpy(s).cuda()
    else:
        tw, ts = torch.from_numpy(w).pin_memory(), torch.from_numpy(s).pin_memory()
    register_table(tw.data_ptr(), rows)
    try:
        out = torch.empty(len(ids), dim, dtype=torch.bfloat16, device="cuda")
        engram_gather(tw.data_ptr(), ts.data_ptr(), torch.from_numpy(ids).cuda(), out, dim, block)
        torch.cuda.synchronize()
        assert np.array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16), want)
        # sorted reads (torch.sort on the GPU), the same rows
        out.zero_()
        engram_gather(tw.data_ptr(), ts.data_ptr(), torch.from_numpy(ids).cuda(), out, dim, block, sort_ids=True)
        torch.cuda.synchronize()
        assert np.array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16), want)
        with pytest.raises(kvtier.KvtierError) as e:
            engram_check(torch.cuda.current_device())
        assert e.value.status == "BAD_INDICES" and "past the table" in str(e.value)
        engram_check(torch.cuda.current_device())  # reported once
        # int32 ids inside the table: nothing to report
        inside = torch.arange(0, rows, 7, dtype=torch.int32, device="cuda")
        out2 = torch.empty(len(inside), dim, dtype=torch.bfloat16, device="cuda")
        engram_gather(tw.data_ptr(), ts.data_ptr(), inside, out2, dim, block, 0, rows)
        engram_check(torch.cuda.current_device())
        expect = np.zeros((len(inside), dim), dtype=np.uint16)
        engram_gather(w.ctypes.data, s.ctypes.data, inside.cpu().numpy(), expect, dim, block, 0, rows)
        assert np.array_equal(out2.view(torch.int16).cpu().numpy().view(np.uint16), expect)
    finally:
        forget_table(tw.data_ptr())


def test_sorted_reads_report_an_id_at_its_place_in_the_callers_order():
    w, s = table(4, 64, 32, seed=13)
    ids = np.array([9, 0, 1, 2, 3], dtype=np.int64)
    register_table(w.ctypes.data, 4)
    try:
        for sort in (False, True):
            out = np.zeros((5, 64), dtype=np.uint16)
            with pytest.raises(kvtier.KvtierError, match=r"ids\[0\] = 9 "):
                engram_gather(w.ctypes.data, s.ctypes.data, ids, out, 64, 32, sort_ids=sort)
            assert np.array_equal(out, model(w, s, ids, 64, 32, 0, 4))
    finally:
        forget_table(w.ctypes.data)
