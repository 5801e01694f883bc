"""SGLang's real HiSparse coordinator, driven on the CPU through decode steps.

The coordinator (``HiSparseCoordinator(device="cpu")``), its request-to-token
pool, device pools, allocators and host pools are SGLang's own classes of the
release on the path, built the way SGLang builds them. Requests are admitted
the way a prefill-decode-disaggregated decode server admits them (logical-only
allocation, host slots from the host pool, the prefill's KV written straight
into the host pool, ``admit_request_direct``), then decoded step by step
(``alloc_decode``, ``map_last_loc_to_buffer``, the new token's KV written at
its device slot, then every layer swapped in through
``swap_in_selected_pages`` or ``swap_in_selected_blocks``). After every
swap-in and replay every selected token's device row is compared, byte for
byte, with the KV written for it (and its host-pool row with the same).

What a CPU cannot run is replaced, and nothing else (:func:`cpu_shims`):

1. ``pool_host/common.py``'s ``_cuda_host_register`` (``cudaHostRegister``)
   records that nothing was registered;
2. the coordinator's per-step backup builds a ``pin_memory=True`` index
   tensor (0.5.22 on), which needs a CUDA driver: its module's ``torch`` is
   torch with a ``tensor()`` that drops the flag;
3. 0.5.21's ``get_device_module()`` gives ``torch.cuda`` on a CUDA build of
   torch with no GPU: the coordinator module's ``device_module`` becomes
   ``torch.cpu``, as 0.5.22 on choose themselves;
4. the host pool's staging and backup copies (``load_to_device_per_layer``,
   ``backup_from_device_all_layer``, ``backup_tokens_from_device_all_layer``)
   are SGLang's CUDA transfer kernels, not bound at all on a CPU build: on the
   coordinator's host pool instance they become byte copies of the same rows;
5. 0.5.21's paged allocator always launches Triton kernels for logical
   allocation: there the same page-granular result comes from the
   allocator's own ``alloc()``;
6. DeepSeek-V4: the top-level ``DeepSeekV4TokenToKVPool`` (sliding-window,
   C128 and indexer pools) is not built; an instance without its constructor
   carries the C4 pool and its logical size, the two things the HiSparse
   allocator reads, over a logical allocator stand-in, and full-token
   indices are contiguous per request.

The swap-ins and replays themselves (the four entry points, the LRU state,
``num_real_reqs``) are SGLang's coordinator calling whatever its module
binds: kvtier's functions after ``kvtier.sglang.install()``, else SGLang's
own CUDA kernels, which cannot build on a CPU.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

PAGE = 64
LAYERS = 6
HOT = 256  # hot slots per request (--hisparse-config device_buffer_size)
TOP_K = 64
M3_BLOCK = 16  # MiniMax-M3's sparse block, in tokens
M3_BLOCKS = 6  # blocks selected per request per step
PATHS = ("dsa", "dsa-shared", "dsv4", "m3")
# Full-token lengths at admission: some shorter than the hot buffer (a few
# outgrowing it while decoding), some much longer. DeepSeek-V4's are 3 mod 4,
# so the first decode step makes a new compressed token (see NEWEST_ON_HOST).
LENGTHS = {"dsa": [40, 150, 250, 300, 700, 1500], "m3": [40, 150, 250, 300, 700, 1500],
           "dsv4": [243, 403, 1015, 1203, 3203]}
LENGTHS["dsa-shared"] = LENGTHS["dsa"]
# Shared-index layers (True: replays its anchor's plan): anchors 0 and 4,
# layer 3 in no group.
SHARED = {"dsa-shared": [False, True, True, False, False, True], "dsv4": [False, True, False, False, True, True]}
U8 = torch.uint8
SERVED = ("load_cache_to_device_buffer_mla", "load_cache_to_device_buffer_dsv4_mla", "copy_cache_planned_mla",
          "load_blocks_to_device_buffer_mha")


def cpu_shims(monkeypatch, hc) -> None:
    """Applies shims 1-3 of the module docstring (`hc`: the coordinator module)."""
    from sglang.srt.mem_cache.pool_host import common

    attr = getattr(common, "_CUDA_HOST_REGISTERED_RANGES_ATTR", "_sglang_cuda_host_registered_ranges")

    def nothing_registered(buffer, *args, **kwargs):
        setattr(buffer, attr, [])
        return buffer

    monkeypatch.setattr(common, "_cuda_host_register", nothing_registered)
    unpinned = types.ModuleType("torch_without_pinning")
    unpinned.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    unpinned.tensor = lambda *a, pin_memory=False, **kw: torch.tensor(*a, **kw)
    monkeypatch.setattr(hc, "torch", unpinned)
    if hc.device_module is torch.cuda and not torch.cuda.is_available():
        monkeypatch.setattr(hc, "device_module", torch.cpu)


def as_rows(t):
    """A [rows, ...] buffer as [rows, bytes]."""
    return t.reshape(t.shape[0], -1) if t.dtype == U8 else t.view(U8).reshape(t.shape[0], -1)


class RowBytes:
    """One item per token row per layer; several planes (MiniMax-M3's K and V)
    side by side in one item."""

    def __init__(self, device_layers, host_layers):
        self.dev = [[as_rows(p) for p in planes] for planes in device_layers]
        self.host = [[as_rows(p) for p in planes] for planes in host_layers]

    @staticmethod
    def _get(planes, rows):
        return torch.cat([p[rows] for p in planes], dim=1)

    @staticmethod
    def _put(planes, rows, data):
        at = 0
        for p in planes:
            p[rows] = data[:, at : at + p.shape[1]]
            at += p.shape[1]

    def dev_get(self, layer, rows):
        return self._get(self.dev[layer], rows)

    def dev_put(self, layer, rows, data):
        self._put(self.dev[layer], rows, data)

    def host_get(self, layer, rows):
        return self._get(self.host[layer], rows)

    def host_put(self, layer, rows, data):
        self._put(self.host[layer], rows, data)

    def item(self):
        return sum(p.shape[1] for p in self.dev[0])


class C4Pages(RowBytes):
    """DeepSeek-V4's C4 pages, the same on host and device: token `loc` is in
    page loc // 64, its 576 value bytes at slot × 576, its 8 scale bytes at
    64 × 576 + slot × 8."""

    VALUE, SCALE, PER_PAGE = 576, 8, 64

    def __init__(self, device_layers, host_layers):
        self.dev, self.host = device_layers, host_layers

    def _columns(self, rows):
        page, slot = rows // self.PER_PAGE, rows % self.PER_PAGE
        value = slot[:, None] * self.VALUE + torch.arange(self.VALUE)
        scale = self.PER_PAGE * self.VALUE + slot[:, None] * self.SCALE + torch.arange(self.SCALE)
        return page[:, None], torch.cat([value, scale], dim=1)

    def _get(self, buf, rows):
        page, cols = self._columns(rows)
        return as_rows(buf)[page, cols]

    def _put(self, buf, rows, data):
        page, cols = self._columns(rows)
        as_rows(buf)[page, cols] = data

    def item(self):
        return self.VALUE + self.SCALE


def copy_transfers(host, acc, layers) -> None:
    """Shim 4: the host pool's staging and backup copies as byte copies."""

    def load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, *args, **kwargs):
        acc.dev_put(layer_id, device_indices.long(), acc.host_get(layer_id, host_indices.long()))

    def backup(host_indices, device_indices):
        for layer in range(layers):
            acc.host_put(layer, host_indices.long(), acc.dev_get(layer, device_indices.long()))

    host.load_to_device_per_layer = load_to_device_per_layer
    # (device_pool, host_indices, device_indices, io_backend) before 0.5.23's DeepSeek-V4 pool
    host.backup_from_device_all_layer = lambda device_pool, h, d, *a, **kw: backup(h, d)
    host.backup_tokens_from_device_all_layer = backup


def _triton_only(alloc) -> bool:
    """0.5.21's paged allocator has no torch path (shim 5)."""
    return not hasattr(alloc.logical_attn_allocator, "use_triton_kernels")


def logical_extend(alloc, n):
    if not _triton_only(alloc):
        z, s = torch.tensor([0]), torch.tensor([n])
        return alloc.alloc_logical_only(prefix_lens=z, prefix_lens_cpu=z, seq_lens=s, seq_lens_cpu=s,
                                        last_loc=torch.tensor([-1]), extend_num_tokens=n)
    return alloc.logical_attn_allocator.alloc(-(-n // PAGE) * PAGE)[:n]


def logical_decode(alloc, seq, last_loc):
    if not _triton_only(alloc):
        return alloc.alloc_decode(seq, seq.clone(), last_loc)
    out = last_loc + 1
    for i in range(len(seq)):
        if (int(seq[i]) - 1) % PAGE == 0:  # the new token opens a page
            out[i] = alloc.logical_attn_allocator.alloc(PAGE)[0]
    return out


def request(rid, pool_row, n):
    """The fields of SGLang's Req the coordinator reads (0.5.21 reads
    extend_range.end, 0.5.22 on extend_end)."""
    return types.SimpleNamespace(rid=rid, kv=types.SimpleNamespace(req_pool_idx=pool_row, kv_allocated_len=n),
                                 extend_end=n, extend_range=types.SimpleNamespace(start=0, end=n),
                                 hisparse_staging=False)


@dataclass
class Stats:
    steps: int = 0
    swap_ins: int = 0
    replays: int = 0
    padded_rows: int = 0
    rows_checked: int = 0
    misses: int = 0
    hits: int = 0
    counted_rows: int = 0  # real rows of the swap-ins kvtier counts (replays are not)
    item_bytes: int = 0  # bytes a miss moves, every plane


def build(hc, path, max_ctx, num_reqs):
    """SGLang's pools, allocator and coordinator for `path`."""
    from sglang.srt.mem_cache.allocator.hisparse import (
        DeepSeekV4HiSparseTokenToKVPoolAllocator,
        HiSparseTokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool, HiSparseC4DevicePool
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool, ReqToTokenPool

    req_to_token = ReqToTokenPool(size=num_reqs + 2, max_context_len=max_ctx, device="cpu",
                                  enable_memory_saver=False)
    size = 16384
    if path in ("dsa", "dsa-shared"):
        pool = HiSparseDSATokenToKVPool(size, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16,
                                        qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", index_head_dim=128,
                                        enable_memory_saver=False, kv_cache_dim=576)
        alloc = HiSparseTokenToKVPoolAllocator(size, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
                                               kvcache=pool, need_sort=False)
    elif path == "m3":
        pool = MiniMaxSparseKVPool(size=size, page_size=PAGE, dtype=torch.bfloat16, head_num=1, head_dim=128,
                                   idx_head_dim=64, dense_layer_ids=[], sparse_layer_ids=list(range(LAYERS)),
                                   device="cpu", start_layer=0, end_layer=LAYERS, enable_hisparse=True)
        alloc = HiSparseTokenToKVPoolAllocator(size, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
                                               kvcache=pool, need_sort=False)
    else:
        c4_slots = 8192
        c4 = HiSparseC4DevicePool(c4_slots, PAGE, torch.float8_e4m3fn, 448, 64, LAYERS, "cpu", False)
        v4 = object.__new__(DeepSeekV4TokenToKVPool)  # shim 6
        v4.c4_kv_pool, v4.c4_logical_size = c4, 4 * c4_slots
        logical = types.SimpleNamespace(_kvcache=v4, size_full=16 * c4_slots, page_size=256, need_sort=False,
                                        clear=lambda: None)
        alloc = DeepSeekV4HiSparseTokenToKVPoolAllocator(logical)
    import torch.distributed as dist

    coord = hc.HiSparseCoordinator(req_to_token_pool=req_to_token, token_to_kv_pool_allocator=alloc,
                                   top_k=HOT if path == "m3" else TOP_K, device_buffer_size=HOT, device="cpu",
                                   tp_group=dist.group.WORLD, shared_index_layers=SHARED.get(path))
    return req_to_token, alloc, coord


def drive(hc, path, *, steps=48, seed=1234, int32=False, expect_kvtier=True, lengths=None) -> Stats:
    """Admits requests and decodes `steps` steps over every layer through the
    coordinator module `hc`, checking every selected row; raises
    AssertionError on the first wrong byte. Every third step two padded rows
    (request row 0, length 1, junk selections) follow the real ones, with
    ``num_real_reqs`` the real count, as CUDA-graph decode pads; with `int32`
    every other step passes int32 indices and lengths."""
    g = torch.Generator().manual_seed(seed)
    dsv4, m3 = path == "dsv4", path == "m3"
    ratio = 4 if dsv4 else 1  # DeepSeek-V4 compresses four tokens into one C4 entry
    lens = list(lengths or LENGTHS[path])
    shared = SHARED.get(path)
    max_ctx = (max(lens) + steps + PAGE) // PAGE * PAGE + PAGE
    req_to_token, alloc, coord = build(hc, path, max_ctx, len(lens))
    dev, host = coord.mem_pool_device, coord.mem_pool_host
    if m3:
        acc = RowBytes([[dev.k_buffer[i], dev.v_buffer[i]] for i in range(LAYERS)],
                       [[host.k_buffer[i], host.v_buffer[i]] for i in range(LAYERS)])
    elif dsv4:
        acc = C4Pages([dev.kv_buffer[i] for i in range(LAYERS)], [host.kv_buffer[i] for i in range(LAYERS)])
    else:
        acc = RowBytes([[dev.kv_buffer[i]] for i in range(LAYERS)], [[host.kv_buffer[i]] for i in range(LAYERS)])
    copy_transfers(host, acc, LAYERS)
    kvtier_serves = type(host).__qualname__.startswith("kvtier[") and all(
        getattr(hc, n).__module__.startswith("kvtier.") for n in SERVED)
    assert kvtier_serves == expect_kvtier, (type(host).__qualname__, {n: getattr(hc, n).__module__ for n in SERVED})
    assert acc.item() == coord.item_size_bytes * (2 if m3 else 1), (acc.item(), coord.item_size_bytes)

    truth = {}

    def kv(r, layer, tokens):
        """The KV of request r's `tokens` at `layer`: random bytes, drawn once."""
        if (r, layer) not in truth:
            truth[r, layer] = torch.randint(0, 256, (max_ctx, acc.item()), generator=g, dtype=U8)
        return truth[r, layer][tokens]

    # admission, as a disaggregated decode server admits a prefilled request
    reqs = []
    for r, n in enumerate(lens):
        row = r + 1  # req_to_token row 0 is the padding row
        req = request(f"r{r}", row, n)
        if dsv4:
            locs = torch.arange(row * max_ctx, row * max_ctx + n, dtype=torch.int64)  # shim 6
        else:
            locs = logical_extend(alloc, n)
        req_to_token.req_to_token[row, :n] = locs.to(req_to_token.req_to_token.dtype)
        host_len = coord.host_token_len(n)
        host_rows = host.alloc_paged_token_slots(coord.req_to_host_pool, coord.req_to_host_pool_allocated_len, row,
                                                 0, host_len)
        for layer in range(LAYERS):
            acc.host_put(layer, host_rows.long(), kv(r, layer, torch.arange(host_len)))
        coord.admit_request_direct(req)
        reqs.append(req)

    st = Stats(item_bytes=acc.item())

    def row0():
        return [t[:, 0].clone() for t in (coord.req_device_buffer_tokens, coord.req_device_buffer_token_locs,
                                          coord.lru_slots)]

    row0_before = row0()
    seq = torch.tensor(lens, dtype=torch.int64)
    pool_rows = torch.tensor([q.kv.req_pool_idx for q in reqs], dtype=torch.int64)
    last = {}  # (request, layer) -> what it selected last, half of which it selects again (hits)

    def check(layer, tokens, locs, r, what):
        ok = tokens >= 0
        toks, dl = tokens[ok].long(), locs[ok].long()
        assert (dl >= 0).all(), f"{what}: request {r} layer {layer}: a selected token got no device row"
        want = kv(r, layer, toks)
        host_rows = coord.req_to_host_pool[reqs[r].kv.req_pool_idx, toks]
        older = toks < int(cseq[r]) - 1  # the newest token is backed up at the next step
        assert (host_rows[older] >= 0).all(), f"{what}: request {r}: a selected token has no host row"
        if older.any():
            assert torch.equal(acc.host_get(layer, host_rows[older].long()), want[older]), \
                f"{what}: request {r} layer {layer}: the host pool's bytes differ"
        bad = (acc.dev_get(layer, dl) != want).any(dim=1)
        assert not bad.any(), (f"{what}: request {r} layer {layer} length {int(cseq[r])}: {int(bad.sum())} rows "
                               f"differ, tokens {toks[bad][:8].tolist()}")
        st.rows_checked += int(toks.numel())

    def padded_rows_left_row0_alone(what):
        assert all(torch.equal(a, b) for a, b in zip(row0(), row0_before)), \
            f"{what}: a padded row changed request row 0's swap-in state"

    for step in range(steps):
        old = seq.clone()
        seq = seq + 1
        if dsv4:
            out = torch.tensor([q.kv.req_pool_idx * max_ctx + int(o) for q, o in zip(reqs, old)], dtype=torch.int64)
        else:
            out = logical_decode(alloc, seq, req_to_token.req_to_token[pool_rows, old - 1].long())
        req_to_token.req_to_token[pool_rows, old] = out.to(req_to_token.req_to_token.dtype)
        for q in reqs:
            q.kv.kv_allocated_len += 1
        coord.map_last_loc_to_buffer(seq, out, pool_rows, seq.clone(), pool_rows.clone())
        cseq = seq // ratio
        for r in range(len(reqs)):  # the model writes the new token's KV at its device row
            if dsv4 and int(seq[r]) % 4:
                continue  # no new compressed token this step
            full = out[r : r + 1]
            loc = dev._translate_loc_to_hisparse_device(
                dev.translate_loc_from_full_to_compressed(full) if dsv4 else full).long()
            for layer in range(LAYERS):
                acc.dev_put(layer, loc, kv(r, layer, torch.tensor([int(cseq[r]) - 1])))

        bs, pad = len(reqs), (2 if step % 3 == 1 else 0)
        coord.num_real_reqs.fill_(bs)
        b_rows = torch.cat([pool_rows, torch.zeros(pad, dtype=torch.int64)])
        b_seq = torch.cat([cseq if dsv4 else seq, torch.ones(pad, dtype=torch.int64)])
        if int32 and step % 2:
            b_rows, b_seq = b_rows.to(torch.int32), b_seq.to(torch.int32)
        st.padded_rows += pad

        anchor = None
        for layer in range(LAYERS):
            what = f"{path} step {step} layer {layer}"
            if m3:
                blocks = torch.full((bs + pad, M3_BLOCKS), -1, dtype=torch.int32)
                for r in range(bs):
                    n_blocks = (int(seq[r]) + M3_BLOCK - 1) // M3_BLOCK
                    prev = last.get((r, layer))
                    pick = [] if prev is None else \
                        [int(x) for x in prev[torch.randperm(len(prev), generator=g)[: M3_BLOCKS // 2]]]
                    if n_blocks - 1 not in pick:
                        pick.append(n_blocks - 1)
                    for x in torch.randperm(n_blocks, generator=g).tolist():
                        if len(pick) >= min(M3_BLOCKS, n_blocks):
                            break
                        if x not in pick:
                            pick.append(x)
                    last[r, layer] = torch.tensor(pick)
                    blocks[r, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
                if pad:
                    blocks[bs:] = torch.randint(0, 4, (pad, M3_BLOCKS), generator=g, dtype=torch.int32)
                found = lookups(coord, layer, pool_rows, seq, [block_tokens(b, int(n)) for b, n in
                                                                zip(blocks[:bs], seq)])
                st.hits, st.misses = st.hits + found[0], st.misses + found[1]
                st.counted_rows += bs
                locs = coord.swap_in_selected_blocks(b_rows, b_seq, blocks, layer, M3_BLOCK)
                st.swap_ins += 1
                if pad:
                    padded_rows_left_row0_alone(what)
                for r in range(bs):
                    toks = block_tokens(blocks[r], int(seq[r]))
                    got = locs[r, : toks.numel()]
                    assert not ((toks < 0) & (got != -1)).any(), \
                        f"{what}: a token past the sequence or in a -1 block has a device row"
                    check(layer, toks, got, r, what)
                continue

            replayed = shared is not None and shared[layer]
            if replayed:
                sel = anchor  # a shared-index layer takes its anchor's selection
                st.replays += 1
            else:
                sel = torch.full((bs + pad, TOP_K), -1, dtype=torch.int32)
                for r in range(bs):
                    n = int(cseq[r])
                    k = min(TOP_K, n)
                    prev = last.get((r, layer))
                    pick = [] if prev is None else prev[torch.randperm(len(prev), generator=g)[: k // 2]].tolist()
                    if torch.rand(1, generator=g).item() < 0.7 and n - 1 not in pick:
                        pick.append(n - 1)  # the newest token, in the reserved slot
                    seen = set(pick)
                    for x in torch.randperm(n, generator=g)[: 3 * k].tolist():
                        if len(pick) >= k:
                            break
                        if x not in seen:
                            pick.append(x)
                            seen.add(x)
                    last[r, layer] = torch.tensor(pick)
                    sel[r, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
                if pad:
                    sel[bs:] = torch.randint(0, 8, (pad, TOP_K), generator=g, dtype=torch.int32)
                anchor = sel
                found = lookups(coord, layer, pool_rows, cseq, list(sel[:bs]))
                st.hits, st.misses = st.hits + found[0], st.misses + found[1]
                st.counted_rows += bs
            locs = coord.swap_in_selected_pages(b_rows, b_seq, sel, layer)
            st.swap_ins += 1
            if pad:
                padded_rows_left_row0_alone(what)
            for r in range(bs):
                check(layer, sel[r], locs[r], r, what + (" (replayed)" if replayed else ""))
        st.steps += 1

    for q in reqs:
        coord.request_finished(q)
    hot = coord.token_to_kv_pool_allocator.hisparse_attn_allocator
    assert hot.available_size() == hot.size, f"{path}: {hot.size - hot.available_size()} hot slots not freed"
    return st


def block_tokens(blocks, n):
    """The tokens of MiniMax-M3's selected blocks, -1 past the sequence and
    for -1 blocks."""
    b = blocks.long()[:, None]
    tokens = (b * M3_BLOCK + torch.arange(M3_BLOCK)).reshape(-1)
    keep = (b >= 0).expand(-1, M3_BLOCK).reshape(-1) & (tokens < n)
    return torch.where(keep, tokens, torch.full_like(tokens, -1))


def lookups(coord, layer, pool_rows, lengths, selections) -> tuple:
    """(hits, misses): selected tokens of long requests in the hot buffer
    before the call, and not in it (the newest, in its reserved slot, is
    neither)."""
    hits = misses = 0
    for r, sel in enumerate(selections):
        n = int(lengths[r])
        if n <= coord.device_buffer_size:
            continue
        resident = set(coord.req_device_buffer_tokens[layer, int(pool_rows[r]), : coord.device_buffer_size].tolist())
        wanted = [t for t in sel.tolist() if 0 <= t != n - 1]
        hits += sum(1 for t in wanted if t in resident)
        misses += sum(1 for t in wanted if t not in resident)
    return hits, misses
