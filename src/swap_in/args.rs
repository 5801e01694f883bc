//! A swap-in's arguments, in SGLang's formats, and their checks: every
//! shape, stride, location and alignment is checked here, once, before the
//! kernel parameters are built.

use super::items::{self, KvBuffers};
use super::{MAX_BATCH, MAX_HOT, MAX_TOP_K, SwapInStrategy, SwapInTarget, span};
use crate::abi::{
    KVT_SWAP_COMPACT_MAX_ENTRIES, KVT_SWAP_COMPACT_PLAN, KVT_SWAP_COPY_IN_PLAN,
    KVT_SWAP_FEW_MISS_512, KVT_SWAP_FEW_MISS_512_MAX_ENTRIES, KVT_SWAP_QUERY_BLOCKS,
    KVT_SWAP_REQ_INDICES_I64, KVT_SWAP_SEQ_LENS_I64, KVT_SWAP_SKIP_INLINE, KVT_SWAP_SKIP_IO,
    kvt_swap_in_params,
};
use crate::error::{Result, invalid};
use crate::mem::{Buf, BufMut, Location};

/// An index tensor that may be int32 or int64 (SGLang passes either for
/// `req_pool_indices` and `seq_lens`).
#[derive(Clone, Copy, Debug)]
pub enum IndexBuf<'a> {
    I32(Buf<'a, i32>),
    I64(Buf<'a, i64>),
}

impl IndexBuf<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            IndexBuf::I32(b) => b.len(),
            IndexBuf::I64(b) => b.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn is_i64(&self) -> bool {
        matches!(self, IndexBuf::I64(_))
    }

    pub(crate) fn addr(&self) -> u64 {
        match self {
            IndexBuf::I32(b) => b.addr(),
            IndexBuf::I64(b) => b.addr(),
        }
    }

    pub(crate) fn check(&self, arg: &'static str, want: Location, len: usize) -> Result<()> {
        match self {
            IndexBuf::I32(b) => b.check(arg, want, len),
            IndexBuf::I64(b) => b.check(arg, want, len),
        }
    }
}

impl<'a> From<Buf<'a, i32>> for IndexBuf<'a> {
    fn from(b: Buf<'a, i32>) -> Self {
        IndexBuf::I32(b)
    }
}

impl<'a> From<Buf<'a, i64>> for IndexBuf<'a> {
    fn from(b: Buf<'a, i64>) -> Self {
        IndexBuf::I64(b)
    }
}

/// What the columns of a row's query name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueryKind {
    /// Token positions, -1 padding (SGLang's MLA paths: DeepSeek-V3.2/V4, GLM).
    #[default]
    Tokens,
    /// Block ids of `block_tokens` tokens each, -1 padding (SGLang's
    /// `load_blocks_to_device_buffer_mha`, MiniMax-M3): a row resolves
    /// `num_top_k × block_tokens` entries.
    Blocks { block_tokens: u32 },
}

impl QueryKind {
    /// Tokens per query column.
    pub fn block_tokens(self) -> u32 {
        match self {
            QueryKind::Tokens => 1,
            QueryKind::Blocks { block_tokens } => block_tokens,
        }
    }
}

/// The arguments of one swap-in, in SGLang's formats (strides in elements;
/// the batch size is `req_pool_indices.len()`).
#[derive(Debug)]
pub struct SwapInArgs<'a> {
    /// `[batch][top_k_stride]` int32: `num_top_k` columns of token positions
    /// or block ids (see `query`), -1 padding.
    pub top_k_tokens: Buf<'a, i32>,
    pub top_k_stride: usize,
    pub query: QueryKind,
    /// `[num_requests][tokens_stride]` int32, the `hot` LRU slots: token per slot, -1 empty.
    pub device_buffer_tokens: BufMut<'a, i32>,
    pub tokens_stride: usize,
    /// `[num_requests][locs_stride]` int32, slots `0..=hot`: device row per slot.
    pub device_buffer_locs: Buf<'a, i32>,
    pub locs_stride: usize,
    /// `[num_requests][lru_stride]` int16, `hot` entries: LRU permutation, 0 = LRU.
    pub lru_slots: BufMut<'a, i16>,
    pub lru_stride: usize,
    /// `[num_requests][host_stride]` int64, `max_tokens` entries: host row per token.
    pub host_cache_locs: Buf<'a, i64>,
    pub host_stride: usize,
    pub max_tokens: u32,
    /// The KV rows: host cache (host-mapped for the CUDA executor) and device
    /// buffer, one or two planes, and their item layout.
    pub kv: KvBuffers<'a>,
    /// `[batch][out_stride]` int32 output: device row per entry (`num_top_k`
    /// columns, `num_top_k × block_tokens` for a block query).
    pub top_k_device_locs: BufMut<'a, i32>,
    pub out_stride: usize,
    /// `[batch]` int32 or int64: request row of each batch row.
    pub req_pool_indices: IndexBuf<'a>,
    /// `[batch]` int32 or int64: tokens of each request, including the one being decoded.
    pub seq_lens: IndexBuf<'a>,
    /// `[1]` int32 on the device: rows at or past it are padding. None: all rows are real.
    pub num_real_reqs: Option<Buf<'a, i32>>,
    /// Rows of the per-request state arrays.
    pub num_requests: u32,
    /// Query columns per row.
    pub num_top_k: u32,
    pub hot_buffer_size: u32,
    /// Move no KV bytes (SGLang's `skip_io` timing probe): outputs, state and
    /// the miss plan as usual, the device buffer untouched.
    pub skip_io: bool,
    /// The layer whose counters this call adds to ([`super::SwapInEngine::enable_counters`]):
    /// None, or an engine without counters, counts nothing.
    pub layer: Option<u32>,
    /// Record the misses here (SGLang's `miss_src`/`miss_dst`/`miss_count`)
    /// instead of in the engine's scratch, e.g. for shared-index layers that
    /// replay them. None: the engine's scratch (CUDA), nothing (CPU).
    pub miss_plan: Option<MissPlan<'a>>,
}

/// Where a swap-in records each row's misses, in SGLang's format: row `b`
/// holds `count[b]` misses, the m-th copying host row `src[b][m]` to device
/// row `dst[b][m]`. Short and refused rows record 0 misses; padding rows keep
/// their count.
#[derive(Debug)]
pub struct MissPlan<'a> {
    /// `[batch][stride]` int64: host row per miss.
    pub src: BufMut<'a, i64>,
    /// `[batch][stride]` int32: device row per miss.
    pub dst: BufMut<'a, i32>,
    /// Elements between rows of `src` and `dst`.
    pub stride: usize,
    /// Misses a row holds (the plan tensors' columns, at most `stride`); a
    /// recording needs room for every entry of a row.
    pub capacity: usize,
    /// `[batch]` int32: misses per row.
    pub count: BufMut<'a, i32>,
}

pub(super) fn within(arg: &'static str, v: u32, lo: u32, hi: u32) -> Result<()> {
    if v < lo || v > hi {
        return Err(invalid(arg, format!("{v} is outside {lo}..={hi}")));
    }
    Ok(())
}

impl MissPlan<'_> {
    /// Checks a plan for `batch` rows of up to `per_row` misses (one per
    /// `what` of a row) where the executor writes it, and adds its bytes to
    /// `ranges`.
    pub(super) fn check(
        &self,
        ranges: &mut ByteRanges,
        want: Location,
        batch: usize,
        per_row: usize,
        what: &str,
    ) -> Result<()> {
        if self.capacity < per_row {
            return Err(invalid(
                "miss_src",
                format!(
                    "holds {} misses per row; a row can have {per_row} (one per {what})",
                    self.capacity
                ),
            ));
        }
        check_stride("miss_plan stride", self.stride, self.capacity)?;
        let rows = span(batch, self.stride, self.capacity);
        ranges.checked("miss_src", &self.src, want, rows, true)?;
        ranges.checked("miss_dst", &self.dst, want, rows, true)?;
        ranges.checked("miss_count", &self.count, want, batch, true)
    }
}

/// Checks the stride of a buffer of rows `width` elements wide.
pub(super) fn check_stride(arg: &'static str, stride: usize, width: usize) -> Result<()> {
    if stride < width {
        return Err(invalid(
            arg,
            format!("{stride} is less than the row width {width}"),
        ));
    }
    Ok(())
}

/// A buffer a call names, as the argument checks see it: where it is, its
/// element size, and the check that it holds enough elements where the
/// executor reads them.
pub(super) trait Named {
    fn addr(&self) -> u64;
    fn element_bytes(&self) -> u64;
    fn check_len(&self, arg: &'static str, want: Location, len: usize) -> Result<()>;
}

impl<T> Named for Buf<'_, T> {
    fn addr(&self) -> u64 {
        Buf::addr(self)
    }
    fn element_bytes(&self) -> u64 {
        std::mem::size_of::<T>() as u64
    }
    fn check_len(&self, arg: &'static str, want: Location, len: usize) -> Result<()> {
        self.check(arg, want, len)
    }
}

impl<T> Named for BufMut<'_, T> {
    fn addr(&self) -> u64 {
        BufMut::addr(self)
    }
    fn element_bytes(&self) -> u64 {
        std::mem::size_of::<T>() as u64
    }
    fn check_len(&self, arg: &'static str, want: Location, len: usize) -> Result<()> {
        self.check(arg, want, len)
    }
}

impl Named for IndexBuf<'_> {
    fn addr(&self) -> u64 {
        IndexBuf::addr(self)
    }
    fn element_bytes(&self) -> u64 {
        if self.is_i64() { 8 } else { 4 }
    }
    fn check_len(&self, arg: &'static str, want: Location, len: usize) -> Result<()> {
        self.check(arg, want, len)
    }
}

/// The byte ranges one call reads and writes, kept on the stack: the check
/// runs on every per-layer call, which must not allocate.
pub(super) struct ByteRanges {
    /// A buffer's name, first byte, bytes, and whether the call writes it.
    ranges: [(&'static str, u64, u64, bool); ByteRanges::CAPACITY],
    len: usize,
}

impl ByteRanges {
    /// The most one call names: a speculative swap-in's eleven index and
    /// state buffers, the KV plane with `num_real_reqs` (three), and a
    /// recording's three plan tensors (a single-step swap-in names 16).
    const CAPACITY: usize = 17;

    pub(super) fn new() -> Self {
        ByteRanges {
            ranges: [("", 0, 0, false); Self::CAPACITY],
            len: 0,
        }
    }

    /// Adds `bytes` bytes from `addr`, which the call writes when `written`.
    pub(super) fn push(&mut self, name: &'static str, addr: u64, bytes: u64, written: bool) {
        // A fixed number of pushes per call site, within CAPACITY: an
        // overflow is a bug here, whatever the input.
        self.ranges[self.len] = (name, addr, bytes, written);
        self.len += 1;
    }

    /// Checks that `buf` holds `len` elements where the executor reads them
    /// (its location, alignment and length) and adds their bytes, which the
    /// call writes when `written`.
    pub(super) fn checked(
        &mut self,
        name: &'static str,
        buf: &(impl Named + ?Sized),
        want: Location,
        len: usize,
        written: bool,
    ) -> Result<()> {
        buf.check_len(name, want, len)?;
        // `len` fits the buffer now, so the product fits the address space
        // unless the buffer claims more than it could hold (a C caller's lie).
        let bytes = buf.element_bytes().saturating_mul(len as u64);
        self.push(name, buf.addr(), bytes, written);
        Ok(())
    }

    /// Adds the KV planes (the device planes written) and `num_real_reqs`,
    /// which swap-ins and replays share.
    pub(super) fn push_kv(&mut self, kv: &KvBuffers<'_>, num_real: Option<&Buf<'_, i32>>) {
        self.push(
            "host_cache",
            kv.k.host.addr(),
            kv.k.host.len() as u64,
            false,
        );
        self.push(
            "device_buffer",
            kv.k.device.addr(),
            kv.k.device.len() as u64,
            true,
        );
        if let Some(v) = &kv.v {
            self.push("host_cache_v", v.host.addr(), v.host.len() as u64, false);
            self.push(
                "device_buffer_v",
                v.device.addr(),
                v.device.len() as u64,
                true,
            );
        }
        if let Some(n) = num_real {
            self.push("num_real_reqs", n.addr(), 4, false);
        }
    }

    /// Refuses a written buffer whose bytes meet any other buffer's.
    pub(super) fn check_disjoint(&self) -> Result<()> {
        let ranges = &self.ranges[..self.len];
        for (i, &(w, ws, wn, written)) in ranges.iter().enumerate() {
            if !written || wn == 0 {
                continue;
            }
            for (j, &(o, os, on, _)) in ranges.iter().enumerate() {
                if i != j && on != 0 && ws < os.saturating_add(on) && os < ws.saturating_add(wn) {
                    return Err(invalid(
                        w,
                        format!(
                            "shares memory with `{o}`; the swap-in writes it, so it must be a buffer of its own"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Whether the few-miss planner's state for rows of `entries` entries over
/// `hot` slots fits the GPU's shared memory: the one test [`check`] and the
/// engine's choice of default make.
pub(super) fn few_miss_fits(t: &SwapInTarget, entries: u32, hot: u32) -> bool {
    super::few_miss_smem_bytes(entries, hot) <= t.max_smem
}

/// The entries a row of `a` resolves (tokens, or blocks × their tokens),
/// saturated: a shape [`check`] refuses fails there whatever this says.
pub(super) fn entries_of(a: &SwapInArgs<'_>) -> u32 {
    (a.num_top_k as u64 * a.query.block_tokens() as u64).min(u32::MAX as u64) as u32
}

/// Checks every argument and builds the kernel parameters.
pub(crate) fn check(
    t: &SwapInTarget,
    a: &SwapInArgs<'_>,
    strategy: SwapInStrategy,
) -> Result<kvt_swap_in_params> {
    let (k, hot) = (a.num_top_k, a.hot_buffer_size);
    let block_tokens = a.query.block_tokens();
    let batch = a.req_pool_indices.len();
    within("num_top_k", k, 1, MAX_TOP_K)?;
    within("sparse_block_size", block_tokens, 1, MAX_TOP_K)?;
    let entries = k as u64 * block_tokens as u64;
    if entries > MAX_TOP_K as u64 {
        return Err(invalid(
            "num_top_k",
            format!(
                "{k} blocks of {block_tokens} tokens resolve {entries} entries per row; at most {MAX_TOP_K}"
            ),
        ));
    }
    let entries = entries as u32;
    if hot < entries || hot > MAX_HOT {
        return Err(invalid(
            "hot_buffer_size",
            format!("{hot} must be at least the entries per row ({entries}) and at most {MAX_HOT}"),
        ));
    }
    if batch > MAX_BATCH as usize {
        return Err(invalid(
            "req_pool_indices",
            format!("batch of {batch} rows exceeds {MAX_BATCH}; split it"),
        ));
    }
    // A caller's miss plan needs no scratch, so no capacity either.
    if a.miss_plan.is_none() && (batch > t.max_batch as usize || entries > t.max_top_k) {
        return Err(invalid(
            "top_k_tokens",
            format!(
                "batch {batch} × {entries} entries exceeds the swap-in capacity {} × {} reserved \
                 (SwapInEngine::reserve, Tier::enable_swap_in)",
                t.max_batch, t.max_top_k
            ),
        ));
    }
    if a.max_tokens > i32::MAX as u32 {
        return Err(invalid(
            "max_tokens",
            format!("{} exceeds the int32 token range", a.max_tokens),
        ));
    }
    let (k_us, e_us, hot_us, r) = (
        k as usize,
        entries as usize,
        hot as usize,
        a.num_requests as usize,
    );
    for (arg, stride, width) in [
        ("top_k_stride", a.top_k_stride, k_us),
        ("out_stride", a.out_stride, e_us),
        ("tokens_stride", a.tokens_stride, hot_us),
        ("locs_stride", a.locs_stride, hot_us + 1),
        ("lru_stride", a.lru_stride, hot_us),
        ("host_stride", a.host_stride, a.max_tokens as usize),
    ] {
        check_stride(arg, stride, width)?;
    }
    let want = t.location;
    // What the swap-in reads and writes, by byte range: a written buffer that
    // shares memory with any other would let the kernels follow values they
    // wrote themselves (a device row read back from a token slot, say).
    let mut ranges = ByteRanges::new();
    for (name, buf, len, written) in [
        (
            "top_k_tokens",
            &a.top_k_tokens as &dyn Named,
            span(batch, a.top_k_stride, k_us),
            false,
        ),
        (
            "top_k_device_locs",
            &a.top_k_device_locs,
            span(batch, a.out_stride, e_us),
            true,
        ),
        (
            "device_buffer_tokens",
            &a.device_buffer_tokens,
            span(r, a.tokens_stride, hot_us),
            true,
        ),
        (
            "device_buffer_locs",
            &a.device_buffer_locs,
            span(r, a.locs_stride, hot_us + 1),
            false,
        ),
        (
            "lru_slots",
            &a.lru_slots,
            span(r, a.lru_stride, hot_us),
            true,
        ),
        (
            "host_cache_locs",
            &a.host_cache_locs,
            span(r, a.host_stride, a.max_tokens as usize),
            false,
        ),
        ("req_pool_indices", &a.req_pool_indices, batch, false),
        ("seq_lens", &a.seq_lens, batch, false),
    ] {
        ranges.checked(name, buf, want, len, written)?;
    }
    let num_real = match &a.num_real_reqs {
        Some(n) => {
            n.check("num_real_reqs", want, 1)?;
            n.addr()
        }
        None => 0,
    };
    let kv = items::check(&a.kv, want)?;
    ranges.push_kv(&a.kv, a.num_real_reqs.as_ref());
    let (plan_src, plan_dst, plan_count, plan_stride) = match &a.miss_plan {
        Some(m) => {
            m.check(&mut ranges, want, batch, e_us, "entry")?;
            (m.src.addr(), m.dst.addr(), m.count.addr(), m.stride as u64)
        }
        None => (t.plan_src, t.plan_dst, t.plan_count, t.max_top_k as u64),
    };
    ranges.check_disjoint()?;
    let counters = t.counters_of(a.layer)?;
    let mut flags = 0;
    if a.skip_io {
        flags |= KVT_SWAP_SKIP_IO;
    }
    if a.seq_lens.is_i64() {
        flags |= KVT_SWAP_SEQ_LENS_I64;
    }
    if a.req_pool_indices.is_i64() {
        flags |= KVT_SWAP_REQ_INDICES_I64;
    }
    if matches!(a.query, QueryKind::Blocks { .. }) {
        flags |= KVT_SWAP_QUERY_BLOCKS;
    }
    match strategy {
        SwapInStrategy::OneBlockPerRequest => flags |= KVT_SWAP_COPY_IN_PLAN,
        // Where its state does not fit the GPU's shared memory, the
        // block-scan planner runs the same parameters (same results).
        SwapInStrategy::FewMiss if few_miss_fits(t, entries, hot) => flags |= KVT_SWAP_SKIP_INLINE,
        SwapInStrategy::FewMiss => {}
        // Where its limits or this GPU's shared memory rule the compact
        // planner out, the few-miss planner (or the block-scan one) runs
        // the same parameters; the one-launch kind keeps its one launch only
        // with the compact planner.
        SwapInStrategy::Compact | SwapInStrategy::CompactOneLaunch => {
            if entries <= KVT_SWAP_COMPACT_MAX_ENTRIES
                && super::compact_smem_bytes(entries, hot) <= t.max_smem
            {
                flags |= KVT_SWAP_COMPACT_PLAN;
                flags |= if strategy == SwapInStrategy::Compact {
                    KVT_SWAP_SKIP_INLINE
                } else {
                    KVT_SWAP_COPY_IN_PLAN
                };
            } else if few_miss_fits(t, entries, hot) {
                flags |= KVT_SWAP_SKIP_INLINE
            }
        }
        // Where its limit or this GPU's shared memory rules it out, the
        // 1024-thread few-miss planner (or the block-scan one) runs the same
        // parameters.
        SwapInStrategy::FewMiss512 => {
            if entries <= KVT_SWAP_FEW_MISS_512_MAX_ENTRIES
                && super::few_miss_512_smem_bytes(entries, hot) <= t.max_smem
            {
                flags |= KVT_SWAP_FEW_MISS_512 | KVT_SWAP_SKIP_INLINE;
            } else if few_miss_fits(t, entries, hot) {
                flags |= KVT_SWAP_SKIP_INLINE
            }
        }
        // One launch: the planning blocks copy every miss. Where the
        // few-miss planners are ruled out, the block-scan planner copies its
        // own (OneBlockPerRequest's parameters), still one launch.
        SwapInStrategy::FewMissOneLaunch | SwapInStrategy::FewMiss512OneLaunch => {
            flags |= KVT_SWAP_COPY_IN_PLAN;
            if strategy == SwapInStrategy::FewMiss512OneLaunch
                && entries <= KVT_SWAP_FEW_MISS_512_MAX_ENTRIES
                && super::few_miss_512_smem_bytes(entries, hot) <= t.max_smem
            {
                flags |= KVT_SWAP_FEW_MISS_512 | KVT_SWAP_SKIP_INLINE;
            } else if few_miss_fits(t, entries, hot) {
                flags |= KVT_SWAP_SKIP_INLINE
            }
        }
        SwapInStrategy::PlanThenCopy | SwapInStrategy::PlanThenCopyInOrder => {}
    }
    Ok(kvt_swap_in_params {
        top_k_tokens: a.top_k_tokens.addr(),
        device_buffer_tokens: a.device_buffer_tokens.addr(),
        device_buffer_locs: a.device_buffer_locs.addr(),
        lru_slots: a.lru_slots.addr(),
        host_cache_locs: a.host_cache_locs.addr(),
        top_k_device_locs: a.top_k_device_locs.addr(),
        req_pool_indices: a.req_pool_indices.addr(),
        seq_lens: a.seq_lens.addr(),
        num_real_reqs: num_real,
        host_cache: kv.host,
        device_buffer: kv.device,
        plan_src,
        plan_dst,
        plan_count,
        error: t.error,
        counters,
        items: kv.layout,
        host_rows: kv.host_rows,
        device_rows: kv.device_rows,
        top_k_stride: a.top_k_stride as u64,
        tokens_stride: a.tokens_stride as u64,
        locs_stride: a.locs_stride as u64,
        lru_stride: a.lru_stride as u64,
        host_stride: a.host_stride as u64,
        out_stride: a.out_stride as u64,
        plan_stride,
        batch: batch as u32,
        top_k: k,
        block_tokens,
        entries,
        hot,
        num_requests: a.num_requests,
        max_tokens: a.max_tokens,
        plan_capacity: entries,
        flags,
        miss_bytes: kv.miss_bytes,
    })
}
