//! The CPU executor of the speculative swap-in: `run` interprets the
//! kernel parameters in occurrence order (the kernel, kernels/spec_swap_in.cu,
//! takes its threads' order), with SGLang's hashes, packed CLOCK and miss
//! table.

use std::slice::{from_raw_parts, from_raw_parts_mut};

use crate::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_DUP_REQ, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_REQ,
    KVT_ERR_SWAP_SEQ_LEN, KVT_ERR_SWAP_SLOT_LOC, KVT_ERR_SWAP_TOKEN, KVT_SWAP_REQ_INDICES_I64,
    KVT_SWAP_SEQ_LENS_I64, kvt_spec_swap_in_params,
};
use crate::error_word::ErrorWord;
use crate::layout::ItemLayout;
use crate::swap_in::cpu::{read_index, real_rows};
use crate::swap_in::items::{self, copy_planes};
use crate::swap_in::policy::in_rows;
use crate::swap_in::span;

// SGLang's encodings of the state (its `hisparse_spec.cuh`).
const HASH_DELETED: i64 = -2;
const COMPACT_HASH_MASK: i32 = (1 << 13) - 1;
const COMPACT_CLAIM: i32 = 1 << 29;
const COMPACT_ADMIT: i32 = 1 << 30;
const CLOCK_VICTIM_SAMPLES: i32 = 6;
const HASH_DEGRADED: u32 = 1 << 31;
const SCRATCH_EPOCH_MASK: u32 = HASH_DEGRADED - 1;
const KNUTH: u32 = 2_654_435_761;
const CUCKOO_KICKS: u32 = 64;
/// Threads of SGLang's commit block: victims are chosen in rounds of this many.
const COMMIT_ROUND: usize = 512;
/// Marks an overflowing miss's output until its row is known: `-2 - m`.
const OVERFLOW_TAG: i32 = -2;

/// The kernel parameters as the CPU executor reads them: sizes as `usize`,
/// the item layout as an [`ItemLayout`].
#[derive(Clone, Copy, Debug)]
struct SpecParams {
    top_k_tokens: u64,
    top_k_stride: usize,
    steps: usize,
    top_k: usize,
    tokens: u64,
    tokens_stride: usize,
    locs: u64,
    locs_stride: usize,
    host_cache_locs: u64,
    host_stride: usize,
    max_tokens: i64,
    host: [u64; 2],
    device: [u64; 2],
    layout: ItemLayout,
    host_rows: u64,
    device_rows: u64,
    out: u64,
    out_stride: usize,
    req_pool_indices: (u64, bool),
    seq_lens: (u64, bool),
    num_real_reqs: u64,
    batch: usize,
    requests: usize,
    hot: usize,
    page: usize,
    cache_index: u64,
    index_stride: usize,
    bank_stride: usize,
    hash_size: usize,
    cache_policy: u64,
    policy_stride: usize,
    scratch_locs: u64,
    scratch_stride: usize,
    scratch_capacity: usize,
    scratch_state: u64,
    state_stride: usize,
    /// The plan: src, dst, count addresses and the row stride.
    plan: Option<(u64, u64, u64, usize)>,
}

impl SpecParams {
    fn of(p: &kvt_spec_swap_in_params) -> Self {
        let n = |v: u64| v as usize;
        SpecParams {
            top_k_tokens: p.top_k_tokens,
            top_k_stride: n(p.top_k_stride),
            steps: p.steps as usize,
            top_k: p.top_k as usize,
            tokens: p.device_buffer_tokens,
            tokens_stride: n(p.tokens_stride),
            locs: p.device_buffer_locs,
            locs_stride: n(p.locs_stride),
            host_cache_locs: p.host_cache_locs,
            host_stride: n(p.host_stride),
            max_tokens: p.max_tokens as i64,
            host: [p.host_cache, 0],
            device: [p.device_buffer, 0],
            layout: items::layout_of(&p.items),
            host_rows: p.host_rows,
            device_rows: p.device_rows,
            out: p.top_k_device_locs,
            out_stride: n(p.out_stride),
            req_pool_indices: (p.req_pool_indices, p.flags & KVT_SWAP_REQ_INDICES_I64 != 0),
            seq_lens: (p.seq_lens, p.flags & KVT_SWAP_SEQ_LENS_I64 != 0),
            num_real_reqs: p.num_real_reqs,
            batch: p.batch as usize,
            requests: p.num_requests as usize,
            hot: p.hot as usize,
            page: p.page as usize,
            cache_index: p.cache_index,
            index_stride: n(p.index_stride),
            bank_stride: n(p.bank_stride),
            hash_size: n(p.hash_size),
            cache_policy: p.cache_policy,
            policy_stride: n(p.policy_stride),
            scratch_locs: p.scratch_locs,
            scratch_stride: n(p.scratch_stride),
            scratch_capacity: n(p.scratch_capacity),
            scratch_state: p.scratch_state,
            state_stride: n(p.state_stride),
            plan: (p.plan_count != 0).then_some((
                p.plan_src,
                p.plan_dst,
                p.plan_count,
                n(p.plan_stride),
            )),
        }
    }
}

// ---- SGLang's hashes and packings ------------------------------------------

/// The scratch union table's home position of `token` (`size` entries).
fn union_slot(token: i32, size: usize) -> usize {
    let h = (token as u32).wrapping_mul(KNUTH);
    if size.is_power_of_two() {
        (h & (size as u32 - 1)) as usize
    } else {
        (h % size as u32) as usize
    }
}

fn ring_primary(token: i32, size: usize) -> usize {
    ((token as u32).wrapping_mul(KNUTH) & (size as u32 - 1)) as usize
}

fn ring_secondary(token: i32, size: usize) -> usize {
    let mut h = token as u32;
    h ^= h >> 16;
    h = h.wrapping_mul(0x7FEB_352D);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846C_A68B);
    h ^= h >> 16;
    (h & (size as u32 - 1)) as usize
}

fn entry(token: i32, slot: i32) -> i64 {
    (((slot as u32 as u64) << 32) | token as u32 as u64) as i64
}

fn entry_token(e: i64) -> i32 {
    e as u32 as i32
}

fn entry_slot(e: i64) -> i32 {
    ((e as u64) >> 32) as i32
}

/// SGLang's packed CLOCK word: an epoch above a cursor of
/// `ceil(log2(hot))` bits.
#[derive(Clone, Copy)]
struct Clock {
    cursor_bits: u32,
    epoch_mask: u32,
    hot: u32,
}

impl Clock {
    fn new(hot: usize) -> Self {
        let cursor_bits = (hot as u32).next_power_of_two().trailing_zeros();
        let epoch_bits = (32 - cursor_bits).min(23);
        Clock {
            cursor_bits,
            epoch_mask: (1u32 << epoch_bits) - 1,
            hot: hot as u32,
        }
    }

    fn next_epoch(&self, packed: i32) -> i32 {
        let e = ((packed as u32 >> self.cursor_bits).wrapping_add(1) & self.epoch_mask) as i32;
        if e == 0 { 1 } else { e }
    }

    fn cursor(&self, packed: i32) -> usize {
        ((packed as u32 & ((1u32 << self.cursor_bits) - 1)) % self.hot) as usize
    }

    fn pack(&self, epoch: i32, cursor: usize) -> i32 {
        ((epoch as u32) << self.cursor_bits | (cursor as u32 & ((1u32 << self.cursor_bits) - 1)))
            as i32
    }
}

/// A request's miss table (its row of `scratch_state`): `t` int64 entries
/// `epoch << 32 | token`, `t` int64 entries `epoch << 32 | value` (the
/// miss's ordinal, then for a miss copied straight into a slot its row), and
/// `t` int32 positions (the m-th miss's table position, and SGLang's
/// admission flags). int64s as pairs of int32, low word first.
struct MissTable<'a> {
    row: &'a mut [i32],
    t: usize,
    epoch: u32,
}

impl MissTable<'_> {
    fn get(&self, at: usize) -> u64 {
        (self.row[2 * at] as u32 as u64) | ((self.row[2 * at + 1] as u32 as u64) << 32)
    }

    fn set(&mut self, at: usize, v: u64) {
        self.row[2 * at] = v as u32 as i32;
        self.row[2 * at + 1] = (v >> 32) as u32 as i32;
    }

    fn tagged(&self, v: u32) -> u64 {
        ((self.epoch as u64) << 32) | v as u64
    }

    fn token_at(&self, pos: usize) -> i32 {
        self.get(pos) as u32 as i32
    }

    fn value(&self, pos: usize) -> u32 {
        self.get(self.t + pos) as u32
    }

    fn set_value(&mut self, pos: usize, v: u32) {
        let tagged = self.tagged(v);
        self.set(self.t + pos, tagged);
    }

    fn compact(&self, m: usize) -> i32 {
        self.row[4 * self.t + m]
    }

    fn compact_mut(&mut self, m: usize) -> &mut i32 {
        &mut self.row[4 * self.t + m]
    }

    /// Empties the cells that already carry this call's epoch: the state may
    /// hold them (a wrapped epoch, or a state written by someone else), and
    /// their values would be trusted as this call's miss ordinals.
    fn clear_foreign(&mut self) {
        for pos in 0..self.t {
            if (self.get(pos) >> 32) as u32 == self.epoch {
                self.set(pos, 0);
            }
        }
    }

    /// The ordinal of `token`'s miss and whether this call claimed it, or
    /// None when the table is full (it never is: a row has `t` occurrences).
    fn claim(&mut self, token: i32, next: &mut usize) -> Option<(usize, bool)> {
        let mut pos = union_slot(token, self.t);
        for _ in 0..self.t {
            let e = self.get(pos);
            if (e >> 32) as u32 != self.epoch {
                self.set(pos, self.tagged(token as u32));
                let m = *next;
                *next += 1;
                self.set_value(pos, m as u32);
                *self.compact_mut(m) = pos as i32;
                return Some((m, true));
            }
            if e as u32 as i32 == token {
                return Some((self.value(pos) as usize, false));
            }
            pos = (pos + 1) % self.t;
        }
        None
    }

    /// The ordinal of `token`'s miss in this call, if it is one.
    fn find(&self, token: i32) -> Option<usize> {
        let mut pos = union_slot(token, self.t);
        for _ in 0..self.t {
            let e = self.get(pos);
            if (e >> 32) as u32 != self.epoch {
                return None;
            }
            if e as u32 as i32 == token {
                return Some(self.value(pos) as usize);
            }
            pos = (pos + 1) % self.t;
        }
        None
    }
}

/// One request's hot buffer: its slots, CLOCK epochs and hash banks.
struct Hot<'a> {
    tokens: &'a mut [i32],
    locs: &'a mut [i32],
    refs: &'a mut [i32],
    primary: &'a mut [i64],
    secondary: &'a mut [i64],
    hot: usize,
    degraded: bool,
}

impl Hot<'_> {
    fn holds(&self, slot: i32, token: i32) -> bool {
        slot >= 0 && (slot as usize) < self.hot && self.tokens[slot as usize] == token
    }

    /// The hot slot holding `token`, SGLang's lookup order.
    fn lookup(&self, token: i32) -> Option<usize> {
        if token < 0 {
            return None;
        }
        if (token as usize) < self.hot && self.tokens[token as usize] == token {
            return Some(token as usize);
        }
        let n = self.primary.len();
        for e in [
            self.primary[ring_primary(token, n)],
            self.secondary[ring_secondary(token, n)],
        ] {
            if e >= 0 && entry_token(e) == token && self.holds(entry_slot(e), token) {
                return Some(entry_slot(e) as usize);
            }
        }
        if self.degraded {
            return self.tokens[..self.hot].iter().position(|&x| x == token);
        }
        None
    }

    fn erase(&mut self, token: i32, slot: usize) {
        if token < 0 {
            return;
        }
        let (e, n) = (entry(token, slot as i32), self.primary.len());
        let p = ring_primary(token, n);
        if self.primary[p] == e {
            self.primary[p] = HASH_DELETED;
            return;
        }
        let s = ring_secondary(token, n);
        if self.secondary[s] == e {
            self.secondary[s] = HASH_DELETED;
        }
    }

    /// Whether entry `e` names a slot that holds its token.
    fn live(&self, e: i64) -> bool {
        e >= 0 && self.holds(entry_slot(e), entry_token(e))
    }

    /// Cuckoo insertion (64 kicks); false when it gave up. A stale entry
    /// (its slot no longer holds its token) is taken over or dropped when
    /// met; a live one is carried on, never lost.
    fn insert(&mut self, token: i32, slot: usize) -> bool {
        let n = self.primary.len();
        let packed = entry(token, slot as i32);
        let (p, s) = (ring_primary(token, n), ring_secondary(token, n));
        for second in [false, true] {
            let old = if second {
                self.secondary[s]
            } else {
                self.primary[p]
            };
            if old < 0 || !self.live(old) {
                if second {
                    self.secondary[s] = packed;
                } else {
                    self.primary[p] = packed;
                }
                return true;
            }
        }
        let (mut current, mut use_secondary) = (packed, false);
        for _ in 0..CUCKOO_KICKS {
            let tok = entry_token(current);
            let (bank, at) = if use_secondary {
                (&mut *self.secondary, ring_secondary(tok, n))
            } else {
                (&mut *self.primary, ring_primary(tok, n))
            };
            let displaced = std::mem::replace(&mut bank[at], current);
            if displaced < 0 || !self.live(displaced) {
                return true;
            }
            current = displaced;
            use_secondary = !use_secondary;
        }
        false
    }
}

/// What one commit-round thread of SGLang's works on.
#[derive(Clone, Copy, Default)]
struct Admission {
    token: i32,
    miss: usize,
    pos: usize,
    direct: bool,
    rotate: bool,
    victim: Option<usize>,
    /// It took its victim's slot (and enters the hash after the round's erases).
    placed: bool,
}

/// A caller's miss plan: src, dst and count rows, and the row stride.
type Plan<'a> = (&'a mut [i64], &'a mut [i32], &'a mut [i32], usize);

/// One speculative swap-in on the CPU.
///
/// # Safety
/// Every address in `p` is host memory matching the shapes in `p`, as
/// [`check`] establishes for host buffers.
pub(in crate::swap_in) unsafe fn run(p: &kvt_spec_swap_in_params) -> ErrorWord {
    let p = &SpecParams::of(p);
    let mut err = ErrorWord::clear();
    let (batch, steps, k, hot) = (p.batch, p.steps, p.top_k, p.hot);
    let t = steps * k;
    if batch == 0 {
        return err;
    }
    // SAFETY: num_real_reqs was checked to hold one element.
    let num_real = unsafe { real_rows(p.num_real_reqs, batch, &mut err, true) };
    // SAFETY: req_pool_indices holds batch elements and seq_lens batch ×
    // steps, as `check` established; every index below is within them.
    let index = |a: (u64, bool), i: usize| unsafe { read_index(a, i) };
    let clock = Clock::new(hot);
    let r = p.requests;
    // SAFETY: shapes checked, per this function's contract; the buffers are
    // pairwise disjoint where one is written.
    let (topk, out, hloc, counters) = unsafe {
        (
            from_raw_parts(p.top_k_tokens as *const i32, span(batch, p.top_k_stride, t)),
            from_raw_parts_mut(p.out as *mut i32, span(batch, p.out_stride, t)),
            from_raw_parts(
                p.host_cache_locs as *const i64,
                span(r, p.host_stride, p.max_tokens as usize),
            ),
            from_raw_parts_mut(p.scratch_state as *mut i32, 4 * r),
        )
    };
    let mut plan: Option<Plan<'_>> = p.plan.map(|(src, dst, count, stride)| unsafe {
        let rows = span(batch, stride, t);
        (
            from_raw_parts_mut(src as *mut i64, rows),
            from_raw_parts_mut(dst as *mut i32, rows),
            from_raw_parts_mut(count as *mut i32, batch),
            stride,
        )
    });
    for b in 0..batch {
        let position = (b as u32) << 16;
        let out_row = &mut out[b * p.out_stride..][..t];
        if b >= num_real {
            out_row.fill(0);
            if let Some((_, _, count, _)) = plan.as_mut() {
                count[b] = 0;
            }
            continue;
        }
        let refuse = |out_row: &mut [i32], plan: &mut Option<Plan<'_>>| {
            out_row.fill(-1);
            if let Some((_, _, count, _)) = plan {
                count[b] = 0;
            }
        };
        let rid = index(p.req_pool_indices, b);
        if rid < 0 || rid >= r as i64 {
            err.report(KVT_ERR_SWAP_REQ, position, rid);
            refuse(out_row, &mut plan);
            continue;
        }
        if (0..b).any(|e| index(p.req_pool_indices, e) == rid) {
            err.report(KVT_ERR_SWAP_DUP_REQ, position, rid);
            refuse(out_row, &mut plan);
            continue;
        }
        if let Some(bad) = (0..steps)
            .map(|s| index(p.seq_lens, b * steps + s))
            .find(|&n| n < 0 || n > p.max_tokens)
        {
            err.report(KVT_ERR_SWAP_SEQ_LEN, position, bad);
            refuse(out_row, &mut plan);
            continue;
        }
        let rid = rid as usize;
        let slots = hot + p.page;
        // SAFETY: the request's rows, inside the checked spans; distinct
        // buffers (checked disjoint), so no two slices alias.
        let mut h = unsafe {
            let banks = p.cache_index as *mut i64;
            Hot {
                tokens: from_raw_parts_mut(
                    (p.tokens as *mut i32).add(rid * p.tokens_stride),
                    slots,
                ),
                locs: from_raw_parts_mut((p.locs as *mut i32).add(rid * p.locs_stride), slots),
                refs: from_raw_parts_mut(
                    (p.cache_policy as *mut i32).add((1 + rid) * p.policy_stride),
                    hot,
                ),
                primary: from_raw_parts_mut(banks.add(rid * p.index_stride), p.hash_size),
                secondary: from_raw_parts_mut(
                    banks.add(rid * p.index_stride + p.bank_stride),
                    p.hash_size,
                ),
                hot,
                degraded: false,
            }
        };
        let (ring, scratch, meta) = unsafe {
            (
                &mut *(p.cache_policy as *mut i32).add(rid),
                from_raw_parts_mut(
                    (p.scratch_locs as *mut i32).add(rid * p.scratch_stride),
                    p.scratch_capacity,
                ),
                from_raw_parts_mut(
                    (p.scratch_state as *mut i32).add((1 + rid) * p.state_stride),
                    5 * t,
                ),
            )
        };
        let generation = counters[3 * r + rid] as u32;
        h.degraded = generation & HASH_DEGRADED != 0;
        let mut scratch_epoch = (generation & SCRATCH_EPOCH_MASK) + 1;
        if scratch_epoch > SCRATCH_EPOCH_MASK {
            scratch_epoch = 1;
        }
        let epoch = clock.next_epoch(*ring);
        let cursor = clock.cursor(*ring);
        let mut table = MissTable {
            row: meta,
            t,
            epoch: scratch_epoch,
        };
        table.clear_foreign();
        let tokens_row = &topk[b * p.top_k_stride..][..t];
        let hloc_row = &hloc[rid * p.host_stride..][..p.max_tokens as usize];
        let cap = p.scratch_capacity;
        let (mut misses, mut union_hits, mut copies) = (0usize, 0usize, 0usize);
        let record = |plan: &mut Option<Plan<'_>>, src: i64, dst: i32, copies: &mut usize| {
            if let Some((s, d, _, stride)) = plan {
                s[b * *stride + *copies] = src;
                d[b * *stride + *copies] = dst;
            }
            *copies += 1;
        };
        let copy = |src: i64, dst: i32| unsafe {
            // SAFETY: both rows checked in range by the caller.
            copy_planes(p.host, p.device, &p.layout, src as u64, dst as u64)
        };

        // 1. Resolve every occurrence; copy each unique miss once into scratch.
        for (occ, &token) in tokens_row.iter().enumerate() {
            let seq = index(p.seq_lens, b * steps + occ / k);
            let col = position | occ as u32;
            out_row[occ] = -1;
            if token == -1 {
                continue;
            }
            if token < -1 || token as i64 >= seq {
                err.report(KVT_ERR_SWAP_TOKEN, col, token as i64);
                continue;
            }
            // a verify-step token on the extra page: no host I/O
            if token as i64 >= seq - p.page as i64
                && let Some(slot) = (hot..slots).find(|&s| h.tokens[s] == token)
                && h.locs[slot] >= 0
            {
                let loc = h.locs[slot];
                if in_rows(loc as i64, p.device_rows) {
                    out_row[occ] = loc;
                } else {
                    err.report(KVT_ERR_SWAP_DEVICE_LOC, col, loc as i64);
                }
                continue;
            }
            if let Some(slot) = h.lookup(token) {
                let loc = h.locs[slot];
                if in_rows(loc as i64, p.device_rows) {
                    out_row[occ] = loc;
                } else {
                    err.report(KVT_ERR_SWAP_DEVICE_LOC, col, loc as i64);
                }
                if h.refs[slot] != epoch {
                    h.refs[slot] = epoch;
                    union_hits += 1;
                }
                continue;
            }
            let src = hloc_row[token as usize];
            if src < 0 {
                continue; // SGLang's "no host copy": nothing to load
            }
            if !in_rows(src, p.host_rows) {
                err.report(KVT_ERR_SWAP_HOST_LOC, col, src);
                continue;
            }
            let Some((m, claimed)) = table.claim(token, &mut misses) else {
                continue;
            };
            if m >= cap {
                out_row[occ] = OVERFLOW_TAG - m as i32;
                continue;
            }
            let loc = scratch[m];
            if !in_rows(loc as i64, p.device_rows) {
                err.report(KVT_ERR_SWAP_DEVICE_LOC, col, loc as i64);
                continue;
            }
            if claimed {
                copy(src, loc);
                record(&mut plan, src, loc, &mut copies);
            }
            out_row[occ] = loc;
        }

        // 2. The CLOCK: admit misses into the hot buffer.
        let overflow = misses > cap;
        let union_clock = misses + union_hits <= hot;
        let budget = if union_clock {
            0
        } else if overflow {
            hot.saturating_sub(union_hits + (misses - cap))
        } else {
            hot
        };
        if !union_clock {
            // Approximate: keep the last step's working set.
            if !overflow {
                h.refs.fill(0);
            }
            let last = (steps - 1) * k;
            let seq = index(p.seq_lens, b * steps + steps - 1);
            let mut admitted = 0usize;
            for &token in &tokens_row[last..] {
                if token < 0 || token as i64 >= seq {
                    continue;
                }
                if let Some(slot) = h.lookup(token) {
                    h.refs[slot] = epoch;
                    continue;
                }
                if let Some(m) = table.find(token).filter(|&m| m < cap) {
                    let c = table.compact(m);
                    if c & COMPACT_CLAIM == 0 {
                        *table.compact_mut(m) |= COMPACT_CLAIM;
                        if admitted < budget {
                            *table.compact_mut(m) |= COMPACT_ADMIT;
                        }
                        admitted += 1;
                    }
                }
            }
        }
        let mut round = [Admission::default(); COMMIT_ROUND];
        for start in (0..misses).step_by(COMMIT_ROUND) {
            let n = (misses - start).min(COMMIT_ROUND);
            for (i, a) in round[..n].iter_mut().enumerate() {
                let m = start + i;
                let c = table.compact(m);
                let pos = (c & COMPACT_HASH_MASK) as usize;
                let direct = overflow && m >= cap;
                let admit = !union_clock && c & COMPACT_ADMIT != 0;
                *a = Admission {
                    token: table.token_at(pos),
                    miss: m,
                    pos,
                    direct,
                    rotate: m < cap && (union_clock || admit),
                    victim: None,
                    placed: false,
                };
                if !(a.direct || a.rotate) {
                    continue;
                }
                if union_clock {
                    // sample this miss's partition of the ring, oldest epoch first
                    let part = (hot - 1 - m) / misses + 1;
                    let samples = part.min(CLOCK_VICTIM_SAMPLES as usize);
                    let mut oldest = 0u32;
                    for sample in 0..samples {
                        let linear = m + sample * part / samples * misses;
                        let cand = (cursor + linear) % hot;
                        let seen = h.refs[cand];
                        if seen == epoch {
                            continue;
                        }
                        let age = (epoch as u32).wrapping_sub(seen as u32) & clock.epoch_mask;
                        if a.victim.is_none() || age > oldest {
                            a.victim = Some(cand);
                            oldest = age;
                        }
                    }
                    if let Some(v) = a.victim {
                        h.refs[v] = epoch;
                    }
                } else {
                    let (count, ordinal) = if direct {
                        (misses - cap, m - cap)
                    } else {
                        (misses, m)
                    };
                    let mut linear = ordinal;
                    while linear < hot {
                        let cand = ((linear as u32)
                            .wrapping_mul(KNUTH)
                            .wrapping_add(epoch as u32)
                            % hot as u32) as usize;
                        if h.refs[cand] != epoch {
                            h.refs[cand] = epoch;
                            a.victim = Some(cand);
                            break;
                        }
                        linear += count;
                    }
                }
            }
            // the rare fallback: probe the whole ring
            for (i, a) in round[..n].iter_mut().enumerate() {
                if !(a.direct || a.rotate) || a.victim.is_some() {
                    continue;
                }
                let begin = (cursor as u32).wrapping_add(((start + i) as u32).wrapping_mul(KNUTH))
                    % hot as u32;
                for attempt in 0..hot as u32 {
                    let cand =
                        (begin.wrapping_add(attempt.wrapping_mul(KNUTH)) % hot as u32) as usize;
                    if h.refs[cand] != epoch {
                        h.refs[cand] = epoch;
                        a.victim = Some(cand);
                        break;
                    }
                }
            }
            for a in round[..n].iter_mut() {
                if !(a.direct || a.rotate) {
                    continue;
                }
                let Some(victim) = a.victim else {
                    table.set_value(a.pos, u32::MAX);
                    continue;
                };
                let old_loc = h.locs[victim];
                let new_loc = if a.direct { old_loc } else { scratch[a.miss] };
                if !in_rows(old_loc as i64, p.device_rows) {
                    err.report(
                        KVT_ERR_SWAP_SLOT_LOC,
                        position | victim as u32,
                        old_loc as i64,
                    );
                }
                if !in_rows(old_loc as i64, p.device_rows)
                    || !in_rows(new_loc as i64, p.device_rows)
                {
                    if a.direct {
                        table.set_value(a.pos, u32::MAX);
                    }
                    continue;
                }
                let old_token = h.tokens[victim];
                h.tokens[victim] = a.token;
                h.refs[victim] = epoch;
                if a.rotate {
                    h.locs[victim] = new_loc;
                    scratch[a.miss] = old_loc;
                } else {
                    let src = hloc_row[a.token as usize];
                    copy(src, old_loc);
                    record(&mut plan, src, old_loc, &mut copies);
                    table.set_value(a.pos, old_loc as u32);
                }
                h.erase(old_token, victim);
                a.placed = true;
            }
            // every erase and slot change of the round before any insertion
            // (as the kernel does, a barrier apart)
            for a in round[..n].iter().filter(|a| a.placed) {
                let victim = a.victim.expect("placed");
                if !h.insert(a.token, victim) {
                    h.degraded = true;
                }
            }
        }
        // 3. The overflowing misses' outputs, now that their rows are known.
        if overflow {
            for (occ, o) in out_row.iter_mut().enumerate() {
                if *o > OVERFLOW_TAG {
                    continue;
                }
                let m = (OVERFLOW_TAG - *o) as usize;
                let pos = (table.compact(m) & COMPACT_HASH_MASK) as usize;
                let v = table.value(pos);
                *o = if v == u32::MAX { -1 } else { v as i32 };
                if v == u32::MAX {
                    // more misses than scratch and victims together
                    err.report(
                        KVT_ERR_SWAP_DEVICE_LOC,
                        position | occ as u32,
                        tokens_row[occ] as i64,
                    );
                }
            }
        }
        counters[rid] = misses as i32;
        counters[r + rid] = 0;
        counters[2 * r + rid] = 0;
        counters[3 * r + rid] = (scratch_epoch | if h.degraded { HASH_DEGRADED } else { 0 }) as i32;
        let next = if misses > 0 {
            (cursor + misses.min(hot)) % hot
        } else {
            cursor
        };
        *ring = clock.pack(epoch, next);
        if let Some((_, _, count, _)) = plan.as_mut() {
            count[b] = copies as i32;
        }
    }
    err
}
