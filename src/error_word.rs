//! The device-side error word (`kvt_error_word` in `kernels/abi.h`) and its
//! decoding into a report a person can act on.
//!
//! Kernels record each refused entry with atomics; the CPU executor records
//! into the same struct with [`ErrorWord::report`], which mirrors
//! `kvt::report` in `kernels/common.cuh` bit for bit, so both executors produce
//! identical words for identical inputs and GPU tests compare them directly.

use std::fmt;

use crate::abi::{
    KVT_ERR_FIRST_NONE, KVT_ERR_GATHER_INDEX, KVT_ERR_GATHER_SEQ_LEN, KVT_ERR_GATHER_SLOT,
    KVT_ERR_KINDS, KVT_ERR_SWAP_DEVICE_LOC, KVT_ERR_SWAP_DUP_REQ, KVT_ERR_SWAP_HOST_LOC,
    KVT_ERR_SWAP_LRU, KVT_ERR_SWAP_NUM_REAL, KVT_ERR_SWAP_PLAN_COUNT, KVT_ERR_SWAP_REQ,
    KVT_ERR_SWAP_SEQ_LEN, KVT_ERR_SWAP_SLOT_LOC, KVT_ERR_SWAP_TOKEN, KVT_ERR_WRITEBACK_SLOT,
    KVT_ERR_WRITEBACK_SRC_ROW, KVT_ERR_WRITEBACK_TOKEN, kvt_error_word,
};

/// An error word: which kinds of bad index occurred, how many entries were
/// refused, and the first (lowest-position) bad entry of each kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct ErrorWord(pub kvt_error_word);

impl Default for ErrorWord {
    fn default() -> Self {
        Self::clear()
    }
}

impl ErrorWord {
    /// A word with nothing recorded.
    pub const fn clear() -> Self {
        ErrorWord(kvt_error_word {
            flags: 0,
            count: 0,
            first: [KVT_ERR_FIRST_NONE; KVT_ERR_KINDS as usize],
        })
    }

    /// True when nothing was recorded.
    pub fn is_clear(&self) -> bool {
        self.0.flags == 0 && self.0.count == 0
    }

    /// Records one refused entry, exactly as the kernels do.
    pub fn report(&mut self, kind: u32, position: u32, value: i64) {
        let clamped = value.clamp(i32::MIN as i64, i32::MAX as i64) as i32;
        let key = ((position as u64) << 32) | ((clamped as u32) ^ 0x8000_0000) as u64;
        self.0.flags |= 1 << kind;
        self.0.count = self.0.count.wrapping_add(1);
        let slot = &mut self.0.first[kind as usize];
        *slot = (*slot).min(key);
    }

    /// Adds what `other` recorded, as if its entries had been reported into
    /// this word (the result does not depend on the order of merges).
    pub fn merge(&mut self, other: &ErrorWord) {
        self.0.flags |= other.0.flags;
        self.0.count = self.0.count.wrapping_add(other.0.count);
        for (a, b) in self.0.first.iter_mut().zip(other.0.first) {
            *a = (*a).min(b);
        }
    }
}

/// What was wrong with a refused entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadIndexKind {
    /// `req_slots[row]` is below -1, beyond the slot table, or unbound.
    GatherSlot,
    /// `seq_lens[row]` is negative or beyond the region capacity.
    GatherSeqLen,
    /// `topk[row][col]` is below -1 or not below `seq_lens[row]`.
    GatherIndex,
    /// `slots[item]` is below -1, beyond the slot table, or unbound.
    WritebackSlot,
    /// `tokens[item]` is negative or beyond the region capacity.
    WritebackToken,
    /// `src_rows[item]` is negative or beyond the source buffer.
    WritebackSrcRow,
    /// Swap-in: `num_real_reqs[0]` is negative (taken as 0).
    SwapNumReal,
    /// Swap-in: `req_pool_indices[row]` is outside the request state rows.
    SwapRequest,
    /// Swap-in: `seq_lens[row]` is negative or beyond `host_cache_locs`' width.
    SwapSeqLen,
    /// Swap-in: the request's `lru_slots` row is not a permutation of `0..hot`.
    SwapLru,
    /// Swap-in: `top_k_tokens[row][col]` is below -1 or not below
    /// `seq_lens[row]` (a block query: a block id below -1).
    SwapToken,
    /// Swap-in: the host row of a missed token (or of a replayed plan's
    /// miss `col`) is outside the host cache.
    SwapHostLoc,
    /// Swap-in: a device row is outside the device buffer, or no usable slot
    /// was left (a replayed plan: miss `col`'s device row).
    SwapDeviceLoc,
    /// Swap-in: an evictable slot's device row is outside the device buffer
    /// (the slot is never loaded into; the column is the slot).
    SwapSlotLoc,
    /// Plan replay: `miss_count[row]` is negative or above the plan's
    /// capacity (the row copied nothing).
    SwapPlanCount,
    /// Swap-in: `req_pool_indices[row]` names a request an earlier row of
    /// the batch names (the row was refused: the request's state is the
    /// earlier row's to change).
    SwapDuplicateRequest,
    /// Engram gather: `ids[i]` is inside the rows asked for but past the
    /// table's (recorded under [`BadIndexKind::GatherIndex`]'s bit, which
    /// the Engram gather borrows: the error word has no free kind; see
    /// [`BadIndexReport::as_engram`]).
    EngramId,
    /// Engram gather: `out_rows[i]` is outside `0..n` (id `i` wrote
    /// nothing; recorded under [`BadIndexKind::GatherSlot`]'s bit).
    EngramOutRow,
}

impl BadIndexKind {
    const ALL: [(u32, BadIndexKind); 16] = [
        (KVT_ERR_GATHER_SLOT, BadIndexKind::GatherSlot),
        (KVT_ERR_GATHER_SEQ_LEN, BadIndexKind::GatherSeqLen),
        (KVT_ERR_GATHER_INDEX, BadIndexKind::GatherIndex),
        (KVT_ERR_WRITEBACK_SLOT, BadIndexKind::WritebackSlot),
        (KVT_ERR_WRITEBACK_TOKEN, BadIndexKind::WritebackToken),
        (KVT_ERR_WRITEBACK_SRC_ROW, BadIndexKind::WritebackSrcRow),
        (KVT_ERR_SWAP_NUM_REAL, BadIndexKind::SwapNumReal),
        (KVT_ERR_SWAP_REQ, BadIndexKind::SwapRequest),
        (KVT_ERR_SWAP_SEQ_LEN, BadIndexKind::SwapSeqLen),
        (KVT_ERR_SWAP_LRU, BadIndexKind::SwapLru),
        (KVT_ERR_SWAP_TOKEN, BadIndexKind::SwapToken),
        (KVT_ERR_SWAP_HOST_LOC, BadIndexKind::SwapHostLoc),
        (KVT_ERR_SWAP_DEVICE_LOC, BadIndexKind::SwapDeviceLoc),
        (KVT_ERR_SWAP_SLOT_LOC, BadIndexKind::SwapSlotLoc),
        (KVT_ERR_SWAP_PLAN_COUNT, BadIndexKind::SwapPlanCount),
        (KVT_ERR_SWAP_DUP_REQ, BadIndexKind::SwapDuplicateRequest),
    ];

    /// The kind's bit number in the error word (`KVT_ERR_*`).
    pub fn code(self) -> u32 {
        match self {
            Self::EngramId => return KVT_ERR_GATHER_INDEX,
            Self::EngramOutRow => return KVT_ERR_GATHER_SLOT,
            _ => {}
        }
        Self::ALL.iter().find(|(_, k)| *k == self).unwrap().0
    }

    /// Kinds whose position is (row << 16) | column.
    fn has_column(self) -> bool {
        !matches!(
            self,
            Self::WritebackSlot
                | Self::WritebackToken
                | Self::WritebackSrcRow
                | Self::EngramId
                | Self::EngramOutRow
        )
    }
}

/// The first refused entry of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadIndex {
    pub kind: BadIndexKind,
    /// Gather and swap-in: the batch row; writeback: the item.
    pub row: u32,
    /// Gather and swap-in: the top-k column (0 for row-level kinds); writeback: 0.
    pub col: u32,
    /// The offending value, clamped to the i32 range.
    pub value: i32,
}

/// A decoded error word.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadIndexReport {
    /// Entries refused in total.
    pub count: u32,
    /// The first refused entry of each kind that occurred, in kind order.
    pub first: Vec<BadIndex>,
    /// Kind bits that are set but unknown to this build (a newer kernel ABI).
    pub unknown_flags: u32,
}

impl BadIndexReport {
    /// Decodes an error word.
    pub fn decode(word: &ErrorWord) -> Self {
        let mut first = Vec::new();
        let mut known = 0u32;
        for (code, kind) in BadIndexKind::ALL {
            known |= 1 << code;
            if word.0.flags & (1 << code) == 0 {
                continue;
            }
            let key = word.0.first[code as usize];
            let position = (key >> 32) as u32;
            let value = ((key as u32) ^ 0x8000_0000) as i32;
            let (row, col) = if kind.has_column() {
                (position >> 16, position & 0xffff)
            } else {
                (position, 0)
            };
            first.push(BadIndex {
                kind,
                row,
                col,
                value,
            });
        }
        BadIndexReport {
            count: word.0.count,
            first,
            unknown_flags: word.0.flags & !known,
        }
    }

    /// The report of an Engram gather's word: its ids past the table are
    /// recorded with the gather-index bit, its `out_rows` entries outside
    /// `0..n` with the gather-slot bit, both at position `i`, which decodes
    /// as `(i >> 16, i & 0xffff)`; they are named for what they are.
    pub fn as_engram(mut self) -> Self {
        for b in &mut self.first {
            let kind = match b.kind {
                BadIndexKind::GatherIndex => BadIndexKind::EngramId,
                BadIndexKind::GatherSlot => BadIndexKind::EngramOutRow,
                _ => continue,
            };
            *b = BadIndex {
                kind,
                row: (b.row << 16) | b.col,
                col: 0,
                value: b.value,
            };
        }
        self
    }

    /// True when an entry of `kind` was refused.
    pub fn has(&self, kind: BadIndexKind) -> bool {
        self.first.iter().any(|b| b.kind == kind)
    }
}

impl fmt::Display for BadIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (r, c, v) = (self.row, self.col, self.value);
        match self.kind {
            BadIndexKind::GatherSlot => write!(
                f,
                "req_slots[{r}] = {v} is not a bound slot (bind the request's region with \
                 Tier::bind_slot, or pass -1 for a padding row)"
            ),
            BadIndexKind::GatherSeqLen => write!(
                f,
                "seq_lens[{r}] = {v} is outside [0, tokens_per_region] of the pool's layout"
            ),
            BadIndexKind::GatherIndex => write!(
                f,
                "topk[{r}][{c}] = {v} is outside [-1, seq_lens[{r}]) (-1 marks padding)"
            ),
            BadIndexKind::WritebackSlot => write!(
                f,
                "slots[{r}] = {v} is not a bound slot (bind it with Tier::bind_slot, or pass -1 \
                 to skip the item)"
            ),
            BadIndexKind::WritebackToken => write!(
                f,
                "tokens[{r}] = {v} is outside [0, tokens_per_region) of the pool's layout"
            ),
            BadIndexKind::WritebackSrcRow => write!(
                f,
                "src_rows[{r}] = {v}{} is outside the source buffer's rows",
                clamped(v)
            ),
            BadIndexKind::SwapNumReal => {
                write!(
                    f,
                    "num_real_reqs[0] = {v} is negative; it was taken as 0 (every row padding)"
                )
            }
            BadIndexKind::SwapRequest => write!(
                f,
                "req_pool_indices[{r}] = {v}{} is outside the request state rows; the row was refused",
                clamped(v)
            ),
            BadIndexKind::SwapDuplicateRequest => write!(
                f,
                "req_pool_indices[{r}] = {v} names a request an earlier row of the batch names; the row was \
                 refused (two rows would race on the request's state)"
            ),
            BadIndexKind::SwapSeqLen => write!(
                f,
                "seq_lens[{r}] = {v}{} is outside [0, max_tokens]; the row was refused",
                clamped(v)
            ),
            BadIndexKind::SwapLru => write!(
                f,
                "lru_slots of the request of batch row {r} is not a permutation of \
                 0..hot_buffer_size; the row was refused and its state left as it was"
            ),
            BadIndexKind::SwapToken => write!(
                f,
                "top_k_tokens[{r}][{c}] = {v} is outside [-1, seq_lens[{r}]) (-1 marks padding; \
                 a block query: block ids below -1 are refused)"
            ),
            BadIndexKind::SwapHostLoc => write!(
                f,
                "entry [{r}][{c}] (a top-k entry, or a replayed plan's miss_src) maps to host row \
                 {v}{}, outside the host cache",
                clamped(v)
            ),
            BadIndexKind::SwapDeviceLoc => write!(
                f,
                "entry [{r}][{c}] (a top-k entry, or a replayed plan's miss_dst) needs device row \
                 {v}, outside the device buffer (-1: no usable slot was left)"
            ),
            BadIndexKind::SwapSlotLoc => write!(
                f,
                "device_buffer_locs of slot {c} of the request of batch row {r} is {v}, outside the \
                 device buffer; the slot was not loaded into"
            ),
            BadIndexKind::EngramId => write!(
                f,
                "ids[{r}] = {v}{} is inside [row_lo, row_hi) but past the table's rows; its output row \
                 is +0 and nothing was read",
                clamped(v)
            ),
            BadIndexKind::EngramOutRow => write!(
                f,
                "out_rows[{r}] = {v}{} is outside [0, n) (it must be a permutation of the rows); ids[{r}]'s \
                 row was not written",
                clamped(v)
            ),
            BadIndexKind::SwapPlanCount => write!(
                f,
                "miss_count[{r}] = {v} of a replayed plan is outside [0, its capacity]; the row \
                 copied nothing"
            ),
        }
    }
}

/// " (clamped)" for values at the i32 limits, which the error word saturates to.
fn clamped(v: i32) -> &'static str {
    if v == i32::MAX || v == i32::MIN {
        " (clamped)"
    } else {
        ""
    }
}

impl fmt::Display for BadIndexReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} entr{} refused for bad indices, none followed (gather rows zero-filled, writeback \
             items skipped, swap-in outputs -1)",
            self.count,
            if self.count == 1 { "y was" } else { "ies were" }
        )?;
        for b in &self.first {
            write!(f, "; first: {b}")?;
        }
        if self.unknown_flags != 0 {
            write!(f, "; unknown error bits {:#x}", self.unknown_flags)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_is_lowest_position_whatever_the_order() {
        let mut a = ErrorWord::clear();
        let mut b = ErrorWord::clear();
        let events = [
            (KVT_ERR_GATHER_INDEX, (3 << 16) | 7, 9000i64),
            (KVT_ERR_GATHER_INDEX, (1 << 16) | 2, -5),
        ];
        for (k, p, v) in events {
            a.report(k, p, v);
        }
        for (k, p, v) in events.iter().rev() {
            b.report(*k, *p, *v);
        }
        assert_eq!(a, b);
        let report = BadIndexReport::decode(&a);
        assert_eq!(report.count, 2);
        assert_eq!(
            report.first,
            vec![BadIndex {
                kind: BadIndexKind::GatherIndex,
                row: 1,
                col: 2,
                value: -5
            }]
        );
    }

    #[test]
    fn merged_words_equal_one_word_with_every_report() {
        let events = [
            (KVT_ERR_GATHER_INDEX, (3 << 16) | 7, 9000i64),
            (KVT_ERR_SWAP_TOKEN, (1 << 16) | 2, -5),
            (KVT_ERR_GATHER_INDEX, (1 << 16) | 2, -5),
            (KVT_ERR_SWAP_LRU, 4 << 16, 0),
        ];
        let mut all = ErrorWord::clear();
        let (mut a, mut b) = (ErrorWord::clear(), ErrorWord::clear());
        for (i, &(k, p, v)) in events.iter().enumerate() {
            all.report(k, p, v);
            if i % 2 == 0 { &mut a } else { &mut b }.report(k, p, v);
        }
        let mut ab = a;
        ab.merge(&b);
        let mut ba = b;
        ba.merge(&a);
        assert_eq!(ab, all);
        assert_eq!(ba, all);
        let mut same = all;
        same.merge(&ErrorWord::clear());
        assert_eq!(same, all);
    }

    #[test]
    fn values_beyond_i32_are_clamped() {
        let mut w = ErrorWord::clear();
        w.report(KVT_ERR_WRITEBACK_SRC_ROW, 4, i64::MAX);
        w.report(KVT_ERR_WRITEBACK_TOKEN, 2, i64::MIN);
        let r = BadIndexReport::decode(&w);
        assert_eq!(r.first[0].kind, BadIndexKind::WritebackToken);
        assert_eq!(r.first[0].value, i32::MIN);
        assert_eq!(r.first[1].value, i32::MAX);
        assert!(
            r.to_string().contains("src_rows[4] = 2147483647 (clamped)"),
            "{r}"
        );
    }

    #[test]
    fn clear_word_is_ok() {
        assert!(ErrorWord::clear().into_result().is_ok());
        let mut w = ErrorWord::clear();
        w.report(KVT_ERR_GATHER_SLOT, 0, 77);
        let err = w.into_result().unwrap_err();
        assert!(
            err.to_string()
                .contains("req_slots[0] = 77 is not a bound slot"),
            "{err}"
        );
    }
}
