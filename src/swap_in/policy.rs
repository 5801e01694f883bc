//! The replacement policy of one batch row (the CPU reference of
//! `kvt_swap_in_plan`): which entries hit, which slots the misses evict, the
//! outputs, the new slot tokens and LRU order, and the misses to copy. Pure:
//! it reads and writes the row's slices and reports into an error word.

use std::collections::HashMap;

use crate::abi::{
    KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_HOST_LOC, KVT_ERR_SWAP_LRU, KVT_ERR_SWAP_SLOT_LOC,
    KVT_ERR_SWAP_TOKEN,
};
use crate::error_word::ErrorWord;

use super::QueryKind;

/// One row's inputs and state.
pub(super) struct Row<'r> {
    /// The row's query columns.
    pub query: &'r [i32],
    pub kind: QueryKind,
    /// Entries the row resolves (columns × block tokens).
    pub entries: usize,
    pub seq: i64,
    pub hot: usize,
    /// The request's LRU slots' tokens (`hot`).
    pub tokens: &'r mut [i32],
    /// The request's slot rows (`hot + 1`, the last the newest token's).
    pub locs: &'r [i32],
    /// The request's LRU order (`hot`).
    pub lru: &'r mut [i16],
    /// The request's host row per token position (`max_tokens`).
    pub host_locs: &'r [i64],
    pub host_rows: u64,
    pub device_rows: u64,
    /// `row << 16`, the error word's position of the row.
    pub position: u32,
}

/// Whether `row` is one of `rows` rows (the executors' bounds check of every
/// row they follow).
pub(super) fn in_rows(row: i64, rows: u64) -> bool {
    row >= 0 && (row as u64) < rows
}

/// What an entry of a long row turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Output decided: a device row, or -1.
    Done(i32),
    /// The token being decoded: the reserved slot `hot`.
    Newest,
    /// A token of the LRU part, canonical (first occurrence).
    Candidate(i32),
    /// Same token as the canonical entry at this index.
    Duplicate(usize),
    /// To be loaded from this host row.
    Miss { token: i32, host_row: i64 },
}

impl Row<'_> {
    /// The token entry `i` names: `Some(t)` with `t` in `[0, seq)`, or None
    /// (padding, a block's tokens past the sequence, or refused and reported).
    fn token(&self, i: usize, err: &mut ErrorWord) -> Option<i32> {
        let (t, bad_value, column) = match self.kind {
            QueryKind::Tokens => {
                let t = self.query[i];
                (t as i64, t as i64, i)
            }
            QueryKind::Blocks { block_tokens } => {
                let s = block_tokens as usize;
                let block = self.query[i / s];
                let t = if block < 0 {
                    block as i64
                } else {
                    block as i64 * s as i64 + (i % s) as i64
                };
                if block < -1 && i.is_multiple_of(s) {
                    err.report(
                        KVT_ERR_SWAP_TOKEN,
                        self.position | (i / s) as u32,
                        block as i64,
                    );
                }
                if block < 0 || t >= self.seq {
                    // padding, a refused block (reported once above), or a
                    // block's tokens past the sequence
                    return None;
                }
                (t, t, i)
            }
        };
        if t == -1 {
            return None;
        }
        if t < -1 || t >= self.seq {
            err.report(KVT_ERR_SWAP_TOKEN, self.position | column as u32, bad_value);
            return None;
        }
        Some(t as i32)
    }

    fn loc_or_report(&self, slot: usize, i: usize, err: &mut ErrorWord) -> i32 {
        let loc = self.locs[slot];
        if in_rows(loc as i64, self.device_rows) {
            loc
        } else {
            err.report(
                KVT_ERR_SWAP_DEVICE_LOC,
                self.position | i as u32,
                loc as i64,
            );
            -1
        }
    }

    /// Resolves a short row (`seq <= hot`): token `t` is in slot `t`. A token
    /// query resolves its first `min(seq, entries)` entries, a block query
    /// all of them.
    pub fn short(&self, out: &mut [i32], err: &mut ErrorWord) {
        let count = match self.kind {
            QueryKind::Tokens => (self.seq as usize).min(self.entries),
            QueryKind::Blocks { .. } => self.entries,
        };
        for (i, o) in out.iter_mut().enumerate() {
            *o = if i < count {
                match self.token(i, err) {
                    Some(t) => self.loc_or_report(t as usize, i, err),
                    None => -1,
                }
            } else {
                -1
            };
        }
    }

    /// Resolves a long row (`seq > hot`): writes `out`, the new slot tokens
    /// and LRU order, and returns the misses loaded, `(host row, device
    /// row)` in miss order, and the LRU slots hit. A broken LRU row refuses
    /// the row (outputs -1, state kept, no misses, no hits).
    pub fn long(&mut self, out: &mut [i32], err: &mut ErrorWord) -> (Vec<(i64, i32)>, usize) {
        let (hot, pos0) = (self.hot, self.position);
        // Classify the entries; canonical = first occurrence of a token.
        let newest = (self.seq - 1) as i32;
        let mut first: HashMap<i32, usize> = HashMap::new();
        let mut entries: Vec<Entry> = Vec::with_capacity(self.entries);
        for i in 0..self.entries {
            entries.push(match self.token(i, err) {
                None => Entry::Done(-1),
                Some(t) if t == newest => Entry::Newest,
                Some(t) => match first.get(&t) {
                    Some(&c) => Entry::Duplicate(c),
                    None => {
                        first.insert(t, i);
                        Entry::Candidate(t)
                    }
                },
            });
        }
        let mut seen = vec![false; hot];
        let lru_ok = self.lru.iter().all(|&s| {
            let ok = s >= 0 && (s as usize) < hot && !seen[s as usize];
            if ok {
                seen[s as usize] = true;
            }
            ok
        });
        if !lru_ok {
            err.report(KVT_ERR_SWAP_LRU, pos0, 0);
            out.fill(-1);
            return (Vec::new(), 0);
        }

        // Hits (lowest LRU position per token) and usable evictables.
        let old: Vec<usize> = self.lru.iter().map(|&s| s as usize).collect();
        let mut hit_pos: HashMap<usize, usize> = HashMap::new(); // canonical entry -> LRU position
        let mut is_hit = vec![false; hot];
        // the device row each usable slot had when it was checked: the
        // copies use these, never a second read of `locs` (which a caller's
        // aliasing buffer or another thread could have changed meanwhile)
        let mut usable: Vec<Option<i32>> = vec![None; hot];
        for (pos, &slot) in old.iter().enumerate() {
            let token = self.tokens[slot];
            match first.get(&token).filter(|_| token >= 0) {
                Some(&c) => {
                    is_hit[pos] = true;
                    hit_pos.entry(c).or_insert(pos);
                }
                None => {
                    let loc = self.locs[slot];
                    if in_rows(loc as i64, self.device_rows) {
                        usable[pos] = Some(loc);
                    } else {
                        err.report(KVT_ERR_SWAP_SLOT_LOC, pos0 | slot as u32, loc as i64);
                    }
                }
            }
        }
        for (i, entry) in entries.iter_mut().enumerate() {
            *entry = match *entry {
                Entry::Newest => Entry::Done(self.loc_or_report(hot, i, err)),
                Entry::Candidate(t) => match hit_pos.get(&i) {
                    Some(&pos) => Entry::Done(self.loc_or_report(old[pos], i, err)),
                    None => {
                        let h = self.host_locs[t as usize];
                        if in_rows(h, self.host_rows) {
                            Entry::Miss {
                                token: t,
                                host_row: h,
                            }
                        } else {
                            err.report(KVT_ERR_SWAP_HOST_LOC, pos0 | i as u32, h);
                            Entry::Done(-1)
                        }
                    }
                },
                e => e,
            };
        }

        // The m-th miss takes the m-th usable evictable slot.
        let usable_slots: Vec<(usize, i32)> = (0..hot)
            .filter(|&pos| !is_hit[pos])
            .filter_map(|pos| usable[pos].map(|loc| (old[pos], loc)))
            .collect();
        let mut misses = Vec::new();
        for (i, entry) in entries.iter_mut().enumerate() {
            if let Entry::Miss { token, host_row } = *entry {
                *entry = match usable_slots.get(misses.len()) {
                    Some(&(slot, loc)) => {
                        self.tokens[slot] = token;
                        misses.push((host_row, loc));
                        Entry::Done(loc)
                    }
                    None => {
                        err.report(KVT_ERR_SWAP_DEVICE_LOC, pos0 | i as u32, -1);
                        Entry::Done(-1)
                    }
                };
            }
        }
        let output = |e: Entry| match e {
            Entry::Done(o) => o,
            _ => unreachable!("every entry is resolved"),
        };
        for (i, o) in out.iter_mut().enumerate() {
            *o = match entries[i] {
                Entry::Duplicate(c) => output(entries[c]),
                e => output(e),
            };
        }

        // New LRU order.
        let n_load = misses.len();
        let mut loaded = vec![false; hot];
        usable_slots[..n_load]
            .iter()
            .for_each(|&(s, _)| loaded[s] = true);
        let mut new_order: Vec<i16> = Vec::with_capacity(hot);
        new_order.extend(
            (0..hot)
                .filter(|&pos| !is_hit[pos] && !loaded[old[pos]])
                .map(|pos| old[pos] as i16),
        );
        new_order.extend(usable_slots[..n_load].iter().map(|&(s, _)| s as i16));
        new_order.extend(
            (0..hot)
                .filter(|&pos| is_hit[pos])
                .map(|pos| old[pos] as i16),
        );
        self.lru.copy_from_slice(&new_order);
        (misses, is_hit.iter().filter(|&&h| h).count())
    }
}
