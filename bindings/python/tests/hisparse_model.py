"""A reference model of SGLang HiSparse's single-step paths, written here from
the contract (independent of the library), and random cases for every entry
point kvtier serves: SGLang-shaped numpy arrays, one layer of the
coordinator's `[layers, requests, width]` state.

Paths: "mla" (load_cache_to_device_buffer_mla: token queries, linear rows),
"dsv4" (load_cache_to_device_buffer_dsv4_mla: token queries, page-padded C4
rows), "mha" (load_blocks_to_device_buffer_mha: block queries, K and V
planes). Replays (copy_cache_planned_mla) are modelled by `replay`.
"""

from __future__ import annotations

import numpy as np

DSV4_ROWS, DSV4_VALUE, DSV4_SCALE = 64, 576, 8
DSV4_PAGE = -(-(DSV4_VALUE + DSV4_SCALE) * DSV4_ROWS // 576) * 576


class Rows:
    """How row r of a KV buffer is addressed: linear rows of `item` bytes, or
    DeepSeek-V4's C4 pages (value and scale in separate runs of a page)."""

    def __init__(self, item: int, paged: bool = False):
        self.item, self.paged = item, paged

    def pieces(self, r: int):
        if not self.paged:
            return [(r * self.item, self.item)]
        page, off = divmod(r, DSV4_ROWS)
        base = page * DSV4_PAGE
        return [(base + off * DSV4_VALUE, DSV4_VALUE), (base + DSV4_ROWS * DSV4_VALUE + off * DSV4_SCALE, DSV4_SCALE)]

    def nbytes(self, rows: int) -> int:
        return -(-rows // DSV4_ROWS) * DSV4_PAGE if self.paged else rows * self.item

    def rows_in(self, nbytes: int) -> int:
        return nbytes // DSV4_PAGE * DSV4_ROWS if self.paged else nbytes // self.item

    def read(self, buf: np.ndarray, r: int) -> bytes:
        return b"".join(bytes(buf[a : a + n]) for a, n in self.pieces(r))

    def copy(self, src: np.ndarray, s: int, dst: np.ndarray, d: int) -> None:
        for (a, n), (b, _) in zip(self.pieces(s), self.pieces(d)):
            dst[b : b + n] = src[a : a + n]


def as_bytes(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8).reshape(-1)


class Case:
    """One layer's swap-in on `path`. Arrays are SGLang's; `hosts`/`devices`
    are the KV planes (one, or K and V)."""

    def __init__(self, path, *, tokens, locs, lru, host_locs, hosts, devices, query, req, seq, hot, k, rows,
                 block=1, num_real=None, out=None):
        self.path, self.rows, self.block = path, rows, block
        self.tokens, self.locs, self.lru, self.host_locs = tokens, locs, lru, host_locs
        self.hosts, self.devices = hosts, devices
        self.query, self.req, self.seq = query, req, seq
        self.hot, self.k, self.num_real = hot, k, num_real
        self.entries = k * block
        self.out = np.full((len(req), self.entries), -7, dtype=np.int32) if out is None else out

    def kwargs(self, **over) -> dict:
        common = dict(device_buffer_tokens=self.tokens, host_cache_locs=self.host_locs,
                      device_buffer_locs=self.locs, top_k_device_locs=self.out, req_pool_indices=self.req,
                      seq_lens=self.seq, lru_slots=self.lru, hot_buffer_size=self.hot, num_real_reqs=self.num_real)
        if self.path == "mha":
            kw = dict(common, top_k_blocks=self.query, host_cache_k=self.hosts[0], host_cache_v=self.hosts[1],
                      device_buffer_k=self.devices[0], device_buffer_v=self.devices[1],
                      item_size_bytes=self.rows.item, sparse_block_size=self.block)
        else:
            kw = dict(common, top_k_tokens=self.query, host_cache=self.hosts[0], device_buffer=self.devices[0],
                      item_size_bytes=self.rows.item, num_top_k=self.k)
        kw.update(over)
        return kw

    def snapshot(self) -> dict:
        return dict(out=self.out.copy(), tokens=self.tokens.copy(), lru=self.lru.copy(),
                    devices=[as_bytes(d).copy() for d in self.devices])


def entry_token(case: Case, b: int, i: int, seq: int):
    """The token entry i of row b names, or None (padding, or a block's tokens
    past the sequence). Valid input only."""
    if case.path != "mha":
        t = int(case.query[b, i])
        return None if t == -1 else t
    blk = int(case.query[b, i // case.block])
    if blk < 0:
        return None
    t = blk * case.block + i % case.block
    return t if t < seq else None


def reference(case: Case, plan_rows=None) -> dict:
    """The contract on valid input: outputs, slot tokens, LRU order, device
    planes, and (when `plan_rows` is given, the plan's previous content per
    row) the miss plan as {row: [(host row, device row)]} with padding rows
    keeping their previous entry."""
    tokens, lru = case.tokens.copy(), case.lru.copy()
    devices = [as_bytes(d).copy() for d in case.devices]
    hosts = [as_bytes(h) for h in case.hosts]
    hot, e = case.hot, case.entries
    batch = len(case.req)
    real = batch if case.num_real is None else int(case.num_real[0])
    out = np.full((batch, e), -1, dtype=np.int32)
    plan = dict(plan_rows or {})
    for b in range(real):
        r, s = int(case.req[b]), int(case.seq[b])
        locs = case.locs[r]
        named = [entry_token(case, b, i, s) for i in range(e)]
        if s <= hot:
            # token t is in slot t; a token query resolves only its first
            # min(seq_len, K) entries
            count = e if case.path == "mha" else min(s, e)
            out[b] = [int(locs[t]) if i < count and t is not None else -1 for i, t in enumerate(named)]
            plan[b] = []
            continue
        newest = s - 1
        wanted = []
        for t in named:
            if t is not None and t != newest and t not in wanted:
                wanted.append(t)
        order = [int(x) for x in lru[r]]
        hits = [slot for slot in order if tokens[r, slot] in wanted]
        evictable = [slot for slot in order if tokens[r, slot] not in wanted]
        where = {int(tokens[r, slot]): slot for slot in hits}
        misses = [t for t in wanted if t not in where]
        plan[b] = []
        for m, t in enumerate(misses):
            slot = evictable[m]
            tokens[r, slot] = t
            src, dst = int(case.host_locs[r, t]), int(locs[slot])
            plan[b].append((src, dst))
            for h, d in zip(hosts, devices):
                case.rows.copy(h, src, d, dst)
            where[t] = slot
        out[b] = [int(locs[hot]) if t == newest else -1 if t is None else int(locs[where[t]]) for t in named]
        lru[r] = evictable[len(misses):] + evictable[: len(misses)] + hits
    return dict(out=out, tokens=tokens, lru=lru, devices=devices, plan=plan)


def replay(plan: dict, rows: Rows, hosts, devices, num_real: int) -> list:
    """copy_cache_planned_mla on valid input: rows below num_real copy their
    planned host rows into the planned device rows of every plane."""
    devices = [as_bytes(d).copy() for d in devices]
    for b in range(num_real):
        for src, dst in plan.get(b, []):
            for h, d in zip(hosts, devices):
                rows.copy(as_bytes(h), src, d, dst)
    return devices


def random_case(seed: int, path: str = "mla", short_share: float = 0.3) -> Case:
    """A valid random case of `path`, in SGLang's shapes: state rows wider
    than needed (hot + page columns), a layer of a `[layers, ...]` state, an
    output that is a slice of a wider buffer."""
    rng = np.random.default_rng(seed)
    hot = int(rng.integers(1, 24))
    block = int(rng.integers(1, 5)) if path == "mha" else 1
    block = min(block, hot)
    k = int(rng.integers(1, hot // block + 1))
    e = k * block
    requests = int(rng.integers(1, 6))
    batch = int(rng.integers(0, requests + 1))
    max_tokens = hot + int(rng.integers(1, 2 * e + 8))
    rows = Rows(584, paged=True) if path == "dsv4" else Rows(int(rng.choice([8, 16, 24, 656])))
    pad = int(rng.integers(0, 3))
    width = hot + 1 + pad  # the coordinator's rows: hot + page_size columns
    layers = 2
    tokens_all = np.full((layers, requests, width), -1, dtype=np.int32)
    locs_all = np.full((layers, requests, width), -1, dtype=np.int32)
    lru_all = np.zeros((layers, requests, hot), dtype=np.int16)
    host_locs = np.full((requests, max_tokens + pad), -1, dtype=np.int64)
    dev_rows = rng.permutation(requests * (hot + 1) + 3).astype(np.int32)
    host_rows = rng.permutation(requests * max_tokens + 2).astype(np.int64)
    seqs = []
    for r in range(requests):
        s = int(rng.integers(0, hot + 1)) if rng.random() < short_share else int(rng.integers(hot + 1, max_tokens + 1))
        seqs.append(s)
        locs_all[1, r, : hot + 1] = dev_rows[r * (hot + 1) : (r + 1) * (hot + 1)]
        host_locs[r, :max_tokens] = host_rows[r * max_tokens : (r + 1) * max_tokens]
        lru_all[1, r] = rng.permutation(hot)
        if s <= hot:
            tokens_all[1, r, :hot] = [t if t < s else -1 for t in range(hot)]
        else:
            resident = rng.permutation(s - 1)[:hot]
            tokens_all[1, r, :hot] = [t if rng.random() > 0.1 else -1 for t in resident]
            tokens_all[1, r, hot] = s - 1
    req = rng.permutation(requests)[:batch]
    query = np.full((batch + 2, k + pad), -9, dtype=np.int32)
    for b, r in enumerate(req):
        s = seqs[r]
        if path == "mha":
            blocks = list(rng.permutation(-(-s // block)))[:k]
            blocks += [-1] * (k - len(blocks))
            query[b, :k] = rng.permutation(blocks)
        elif s <= hot:
            valid = list(rng.permutation(s))
            query[b, :k] = [valid[i] if i < len(valid) else -1 for i in range(k)]
        else:
            pick = list(rng.permutation(s)[:k])
            pick += [-1] * (k - len(pick))
            query[b, :k] = pick
    n_host, n_dev = rows.nbytes(len(host_rows)), rows.nbytes(len(dev_rows))
    planes = 2 if path == "mha" else 1
    hosts = [rng.integers(0, 256, size=n_host, dtype=np.uint8) for _ in range(planes)]
    devices = [rng.integers(0, 256, size=n_dev, dtype=np.uint8) for _ in range(planes)]
    if path == "dsv4":
        # SGLang's C4 buffers are [pages, page bytes] uint8
        hosts = [h.reshape(-1, DSV4_PAGE) for h in hosts]
        devices = [d.reshape(-1, DSV4_PAGE) for d in devices]
    elif rng.random() < 0.5:
        # any dtype: rows are addressed by item_size_bytes
        hosts = [h.view(np.float16) for h in hosts]
        devices = [d.view(np.int32 if rows.item % 4 == 0 else np.uint8) for d in devices]
    num_real = np.array([int(rng.integers(0, batch + 1))], dtype=np.int32) if rng.random() < 0.5 else None
    case = Case(
        path, tokens=tokens_all[1], locs=locs_all[1], lru=lru_all[1], host_locs=host_locs, hosts=hosts,
        devices=devices, query=query[:batch, :k], req=req.astype(np.int64 if rng.random() < 0.5 else np.int32),
        seq=np.array([seqs[r] for r in req], dtype=np.int64 if rng.random() < 0.5 else np.int32),
        hot=hot, k=k, rows=rows, block=block, num_real=num_real,
    )
    # the output: rows of a wider buffer, as SGLang's top_k_device_locs_buffer[:n, :entries]
    case.out = np.full((batch + 3, e + pad), -7, dtype=np.int32)[:batch, :e]
    case.layers = (tokens_all, locs_all, lru_all)
    return case
