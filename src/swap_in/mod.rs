//! LRU device-buffer swap-in with page-table update: SGLang HiSparse's
//! single-step swap-in paths, with SGLang's outputs and state on valid input
//! and strictly safer behaviour on bad input.
//!
//! # The contract
//!
//! Per request `req` a swap-in keeps SGLang's state: `device_buffer_tokens`
//! (the token each of the `hot` LRU slots holds, -1 empty),
//! `device_buffer_locs` (the device row of each slot, slot `hot` reserved for
//! the token being decoded), `lru_slots` (a permutation of the `hot` slots,
//! index 0 least recently used) and `host_cache_locs` (the host row of each
//! token position). Only the LRU slots of `device_buffer_tokens` are read or
//! written, so its rows may have `hot` columns or SGLang's `hot + page_size`.
//! Every tensor is read with its own row stride (SGLang's kernel reads
//! `device_buffer_locs` with `device_buffer_tokens`' row stride and
//! `host_cache_locs` as if its rows were contiguous; the coordinator's tensors
//! are laid out so that both readings agree).
//!
//! A batch row `b` names request `req_pool_indices[b]`, whose sequence has
//! `seq_lens[b]` tokens (the one being decoded included), and a query: `K`
//! token positions ([`QueryKind::Tokens`], DeepSeek-V3.2/V4 and GLM), or `K`
//! block ids of `S` tokens each ([`QueryKind::Blocks`], MiniMax-M3), entry
//! `i` being token `i % S` of the block in column `i / S`. A row resolves
//! `E = K` (tokens) or `E = K × S` (blocks) entries and writes one output
//! column per entry:
//!
//! * **Padding rows** (`b >= num_real_reqs[0]`, CUDA-graph padding; a value
//!   above the batch makes every row real): every output -1; state, device
//!   buffer and the row's miss-plan count untouched.
//! * **Short sequence** (`seq_len <= hot`): token `t` lives in slot `t`; no
//!   copies, no state change, an empty miss plan. A token query resolves only
//!   its first `min(seq_len, K)` entries (`device_buffer_locs[t]`, -1 for
//!   padding) and writes -1 to the others whatever they hold; a block query
//!   resolves every entry, tokens past the sequence giving -1.
//! * **Long sequence**:
//!   1. The newest token (`seq_len - 1`) maps to the reserved slot's row and
//!      takes no part in the LRU.
//!   2. Walking `lru_slots` from LRU to MRU, a slot whose token is in the
//!      query is a hit (output its row); every other slot, empty ones
//!      included, is evictable, in LRU order.
//!   3. The misses are the remaining entries in query order; the m-th miss
//!      takes the m-th evictable slot: output its row, set its token, copy
//!      host row `host_cache_locs[req][token]` into that device row (every KV
//!      plane).
//!   4. New LRU order: evictables not used (old order), the slots just loaded
//!      (miss order), the hits (old order).
//!
//!   Entries of a block query that fall past the sequence (the last block's
//!   tail, or a block the selector padded with) and block ids of -1 output -1
//!   and take no part, as in SGLang.
//!
//! With a miss plan ([`MissPlan`], SGLang's `miss_src`/`miss_dst`/
//! `miss_count`) every real row records its misses (host row, device row, in
//! miss order) and their count; short rows record 0, padding rows keep their
//! old count. [`SwapInEngine::copy_planned`] replays such a plan (SGLang's
//! `copy_cache_planned_mla`, for shared-index layers): the copies of rows
//! below `num_real_reqs[0]`, nothing else. `skip_io` moves no KV bytes (a
//! timing probe); outputs, state and plan are as usual.
//!
//! KV rows are addressed with an [`ItemLayout`] (linear rows, or DeepSeek-V4's
//! page-padded C4 pages) on one or two planes ([`KvBuffers`]: MLA's latent
//! cache, or MHA's K and V, which move together).
//!
//! # Where kvtier and SGLang differ
//!
//! On one valid input: `-1` padding inside a long token query (a long
//! request whose indexer found fewer than K tokens). kvtier outputs -1 for
//! it, nothing else. SGLang's kernel uses -1 as its internal hit marker
//! (`TOKEN_HIT`), so it neither copies nor writes that entry: its output keeps
//! whatever the buffer held (a row of an earlier step, if the buffer is
//! reused), and the entry's hash insertion may race with a real token's.
//! Every other output, the state, the bytes and the plan are the same.
//!
//! On bad input kvtier never follows an unchecked index; each refused entry
//! outputs -1 and is recorded in the error word (CPU executor: an error at
//! once; CUDA: at the next [`SwapInEngine::check`]). There kvtier is safer
//! than SGLang's kernel, which follows what it is given:
//!
//! * A duplicated token resolves to one slot: every occurrence outputs that
//!   slot's row, one copy. (SGLang's result depends on thread timing.)
//! * Tokens outside `[-1, seq_len)` of a token query, block ids below -1,
//!   host rows outside the host cache, device rows outside the device buffer,
//!   a request index or length out of range, and an `lru_slots` row that is
//!   not a permutation are refused (a refused request keeps its state), and a
//!   negative `num_real_reqs[0]` is reported (taken as 0). An evictable slot
//!   whose device row is out of range is never loaded into. A replayed plan's
//!   out-of-range rows and counts are refused the same way.
//!
//! # How it runs
//!
//! The CUDA executor runs two kernels: `kvt_swap_in_plan` (one block per row:
//! hits, slot assignment, outputs, state, and the row's miss plan) and
//! `kvt_swap_in_copy` (every miss of the batch over one wide grid, so a step
//! with few rows or few misses is not limited to one block's warps waiting
//! on PCIe latency). On sm_90 and later, on a stream other than the legacy
//! default one, the copy kernel is launched as a programmatic dependent of
//! the plan kernel: it is scheduled while the plan kernel finishes and waits
//! for it on the device, so that the second launch's latency overlaps the
//! plan kernel's tail (on an H100, 2026-11-27, the call's median was lower
//! with it at 33 of 36 points of the swap-in grid, by 0.2-2.9 µs at most of
//! them, but within the samples' quartile ranges at every point).
//! [`SwapInStrategy::OneBlockPerRequest`] copies inside each row's block
//! instead (SGLang's design, kept as a baseline). The copy kernel
//! alone replays a caller's plan. The CPU executor (the `cpu` module) interprets the
//! same parameters with the same semantics and the same error word.

mod args;
mod counters;
mod cpu;
mod cuda;
mod items;
mod policy;
mod replay;
mod speculative;

pub use args::{IndexBuf, MissPlan, QueryKind, SwapInArgs};
pub use counters::{MAX_COUNTED_LAYERS, SwapInCounters};
pub use cuda::{
    compact_planner_blocks_per_sm, compact_smem_bytes, copy_smem_bytes, copy_smem_bytes_for,
    few_miss_512_blocks_per_sm, few_miss_512_smem_bytes, few_miss_smem_bytes, plan_kernel,
    plan_smem_bytes, split_smem_bytes,
};
pub use items::{KvBuffers, KvPlane};
pub use replay::PlannedCopyArgs;
pub use speculative::emulation_spec_params;
pub use speculative::{
    SPEC_MAX_HOT, SPEC_MAX_OCCURRENCES, SPEC_MAX_STEPS, SPEC_MIN_STEPS, SPEC_MIN_TOP_K, SpecState,
    SpecSwapInArgs,
};

use crate::abi::{KVT_SWAP_MAX_HOT, KVT_SWAP_MAX_TOP_K};
use crate::copy_method::CopyMethod;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::cuda::{DeviceBuffer, DeviceErrorWord, DeviceSnapshot, Stream};
use crate::error::{Result, invalid};
use crate::error_word::{BadIndexReport, ErrorWord};
use crate::executor::Executor;
pub use crate::layout::ItemLayout;

/// Largest number of entries a row resolves (top-k tokens, or blocks × block size).
pub const MAX_TOP_K: u32 = KVT_SWAP_MAX_TOP_K;
/// Largest hot buffer (LRU slots per request) a swap-in accepts.
pub const MAX_HOT: u32 = KVT_SWAP_MAX_HOT;
/// Largest batch a swap-in accepts: the copy kernel keeps a prefix sum per
/// row in shared memory (64 KiB at this size).
pub const MAX_BATCH: u32 = 16_384;

/// How the CUDA executor runs a swap-in (the CPU executor has one way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapInStrategy {
    /// Plan per request, then one copy kernel over every miss of the batch.
    PlanThenCopy,
    /// Plan and copy inside one block per request (SGLang's design): the
    /// baseline the benchmark compares against.
    OneBlockPerRequest,
    /// [`SwapInStrategy::PlanThenCopy`] with the copy kernel launched in
    /// stream order after the plan kernel, never as its programmatic
    /// dependent: what the dependent launch gains (the benchmark compares
    /// the two). The same as `PlanThenCopy` where dependent launches are
    /// not made.
    PlanThenCopyInOrder,
    /// For steps where most requests miss a handful of their top-k tokens
    /// (steady-state decode): a planner of 1024 threads per request that
    /// ranks with warp votes instead of block scans, and copies a request's
    /// misses itself when they are at most [`FEW_MISS_INLINE`] (one per
    /// warp); the copy kernel that follows moves only the other requests'.
    /// Same outputs, state, plan and reports as `PlanThenCopy`. A shape whose
    /// planning state does not fit the GPU's shared memory (top-k and hot
    /// buffer far beyond SGLang's) runs `PlanThenCopy` instead.
    FewMiss,
    /// `FewMiss` with the planning state cut to what lets two 1024-thread
    /// blocks share an SM (32 registers a thread; 57 KiB of shared memory at
    /// top-k 2048 over a hot buffer of 4096 and 74 KiB over 8192, against the
    /// few-miss planner's 64 registers and 125 and 166 KiB): batch 256 fits
    /// one wave of an H100 or H200 instead of two.
    /// A request's misses are copied by its own block when at most
    /// [`FEW_MISS_INLINE`], else by the copy kernel that follows. Rows of
    /// more than 2048 entries, and shapes whose state does not fit the GPU's
    /// shared memory, run `FewMiss` instead. Exact on the CPU (the kernel
    /// emulator) and on an H100. Its first GPU timing (2026-11-27) found it
    /// 4.6× slower than `FewMiss` at batch 1 (93 µs against 20 µs): every
    /// shared-memory address recomputed the hash table's size with a
    /// doubling loop, 56 % of the instructions it executed. With the size in
    /// closed form it was 1.05-3.08× faster than that on an H100 (second run
    /// of 2026-11-27) and still slower than `FewMiss` at every point (median
    /// 0.66× its speed).
    Compact,
    /// `Compact` with every miss copied by its request's planning block: one
    /// launch a swap-in, no copy kernel (SGLang's kernel has one launch too).
    /// For batches wide enough that the planning blocks alone keep the link
    /// busy; a few requests with hundreds of misses each copy faster with
    /// `Compact`'s wide copy kernel. On an H100, after `Compact`'s fix,
    /// slower than `FewMiss` at 41 of 42 points.
    CompactOneLaunch,
    /// `FewMiss` in blocks of 512 threads instead of 1024, its hash table at
    /// most half full instead of a quarter: at top-k 2048 over a hot buffer
    /// of 4096 a block takes 93 KiB of shared memory and 64 registers a
    /// thread, so two share an sm_90 SM, and batch 256 takes one wave of an
    /// H100 or H200 where `FewMiss` takes two (the point where SGLang's
    /// kernel, two blocks an SM, was 1.44× `FewMiss`'s speed on the H100 run
    /// of 2026-11-27); each thread does twice the slots' and entries' work.
    /// Over 8192 slots (133 KiB), or on sm_80, one block an SM. Rows of more than
    /// 2048 entries, and shapes whose state does not fit the GPU's shared
    /// memory, run `FewMiss` instead. Exact on the CPU (the kernel
    /// emulator) and on an H100, where it was slower than `FewMiss` at 38 of
    /// 42 points (median 0.79× its speed).
    FewMiss512,
    /// `FewMiss` with every miss copied by its request's planning block, no
    /// copy kernel: one launch a swap-in. A row's copy starts as soon as its
    /// own plan is done, while other rows still plan, instead of after the
    /// whole batch's plan (where `FewMiss` hands rows of more than
    /// [`FEW_MISS_INLINE`] misses to the copy kernel, which waits for the
    /// plan kernel to complete): for batches wide enough that the planning
    /// blocks alone keep the link busy (on the H100 run of 2026-11-27
    /// `FewMiss` took 273.5 µs at batch 64 with 274 misses a request, the
    /// link's contiguous copy 213.8 µs; one planning block of a 2-miss row
    /// took 19.5 µs under Nsight Compute, the plan's share at batch 64 is
    /// not measured). Where the few-miss planner's state does not fit the GPU's
    /// shared memory, the block-scan planner copies its own misses
    /// (`OneBlockPerRequest`). Exact on the CPU (the kernel emulator) and on
    /// an H100, where it became the default from batch 8 on sm_90; on the
    /// H200 of 2026-11-28, with its fixed-shape build and line-aligned
    /// copies, the default above [`SPLIT_UP_TO_BATCH`] rows on sm_90
    /// ([`SwapInChoice::default_for`]).
    FewMissOneLaunch,
    /// `FewMiss512` with every miss copied by its request's planning block
    /// (as `FewMissOneLaunch`): at batch 256 one wave of two blocks an SM
    /// whose rows copy as they finish planning. Where the 512-thread
    /// planner is ruled out, `FewMissOneLaunch`. Exact on the CPU (the
    /// kernel emulator) and on an H100, where it was slower than `FewMiss`
    /// at 33 of 42 points and faster at one (at batch 256 with 2 misses
    /// 36.9 µs against `FewMiss`'s 39.0 and SGLang's kernel's 29.6).
    FewMiss512OneLaunch,
}

impl SwapInStrategy {
    /// The few-miss planner: what [`SwapInEngine::run`] and
    /// [`crate::Tier::swap_in`] take on GPUs other than sm_90 and on the CPU
    /// executor, and (as its split-planner build) up to
    /// [`SPLIT_UP_TO_BATCH`] rows on sm_90 ([`SwapInChoice::default_for`]).
    /// Same results as `PlanThenCopy`; on an H100 (2026-11-25) 1.9-2.6x as
    /// fast with 2 misses per request, 1.0-2.2x with 410.
    pub const DEFAULT: SwapInStrategy = SwapInStrategy::FewMiss;

    /// The strategy [`SwapInEngine::run`] and [`crate::Tier::swap_in`] take
    /// for a call of `batch` rows on a GPU of compute capability `arch`
    /// (major × 10 + minor; `None`: the CPU executor, which has one way):
    /// [`SwapInChoice::default_for`]'s strategy.
    pub fn default_for(arch: Option<u32>, batch: usize) -> SwapInStrategy {
        SwapInChoice::default_for(arch, batch).strategy
    }

    /// Every strategy, for the selftest, the tests and the benchmark: one
    /// list, so that a new strategy is checked everywhere once it is here.
    pub const ALL: [SwapInStrategy; 9] = [
        SwapInStrategy::PlanThenCopy,
        SwapInStrategy::OneBlockPerRequest,
        SwapInStrategy::PlanThenCopyInOrder,
        SwapInStrategy::FewMiss,
        SwapInStrategy::Compact,
        SwapInStrategy::CompactOneLaunch,
        SwapInStrategy::FewMiss512,
        SwapInStrategy::FewMissOneLaunch,
        SwapInStrategy::FewMiss512OneLaunch,
    ];
}

/// Which build of the 1024-thread few-miss planner a call of `FewMiss` or
/// `FewMissOneLaunch` runs. Every build has the same contract: the same
/// outputs, state, plan and reports; each falls back to the plain build
/// where it cannot run (below), so a choice never refuses a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlannerBuild {
    /// One block of 1024 threads plans a row (`kvt_swap_in_few_miss_plan`).
    Plain,
    /// `FewMiss` in one launch, a thread-block cluster of
    /// `KVT_SWAP_CLUSTER` blocks a row, each resolving a share of the row's
    /// LRU positions and entries and copying the misses among its entries
    /// (`kvt_swap_in_split_plan`, [`SwapInEngine::run_cluster_plan`]). Where
    /// the GPU launches no clusters (before sm_90) or a block's state does
    /// not fit, the plain build and its copy kernel.
    Split,
    /// The build for rows of exactly a shape of [`FIXED_SHAPES`] (top-k
    /// 2048 over 4096 or 8192 slots), its shapes and threads constants
    /// ([`SwapInEngine::run_fixed_shape`]); the plain build at other shapes.
    FixedShape,
}

/// What [`SwapInEngine::run`] launches for a call: a strategy, the build of
/// its planner and the method of its planner's copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwapInChoice {
    pub strategy: SwapInStrategy,
    pub build: PlannerBuild,
    pub copy: CopyMethod,
}

impl SwapInChoice {
    /// The default for a call of `batch` rows on a GPU of compute capability
    /// `arch` (major × 10 + minor; `None`: the CPU executor, which has one
    /// way). The batch and the row shape are the host's to know (a CUDA
    /// graph is captured per batch size); the miss count is not.
    ///
    /// On sm_90: up to [`SPLIT_UP_TO_BATCH`] rows the split planner
    /// (`FewMiss`, [`PlannerBuild::Split`]); above, `FewMissOneLaunch` with
    /// line-aligned copies ([`CopyMethod::LineAligned`]), in the fixed-shape
    /// build where the rows have one ([`PlannerBuild::FixedShape`]).
    /// Elsewhere `FewMiss`, plain.
    ///
    /// Why: two H200 runs of 2026-11-28 (`bench/results/h200-2026-11-28b`
    /// and `-28c`, every build and SGLang 0.5.23's kernel side by side, 50
    /// CUDA-event samples each). Against the previous default
    /// (`FewMissOneLaunch` from batch 8, `FewMiss` below, both plain), this
    /// choice was faster with the samples' interquartile ranges apart at 37
    /// of the second run's 54 points and slower at none; against SGLang's
    /// kernel its median point was 1.10x SGLang's speed (the previous
    /// default's 1.03x, clearly slower at 12 points), clearly slower at 4 (2
    /// misses a row at batch 256: 0.77x and 0.94x; batch 32 on DeepSeek-V4's
    /// C4 and MiniMax-M3's paths: 0.95x and 0.98x).
    /// - The split planner was 1.00-1.39x the previous default at batch 1
    ///   to 10 in the first run, and slower from batch 16 (a cluster of
    ///   blocks a row takes several waves): with 2 misses a row up to 1.6x
    ///   at batch 16 and 4-6x at batch 100 and 256 (level with 410).
    /// - Above batch 10 the one-launch planner's line-aligned copies were
    ///   2-8 % faster than its warp-vector copies (fixed-shape builds both)
    ///   at 10 of 28 points, every one with hundreds of misses a row (the
    ///   regime the HiSparse paper's miss rates put a server in), and 4-7 %
    ///   slower at 4, every one with 2 misses a row: a 656-byte row takes
    ///   two line-aligned passes of a warp where warp vectors take one, which
    ///   a row of 2 misses waits for.
    ///
    /// The H100 (also sm_90) has not timed the split planner or the
    /// fixed-shape builds. sm_80, sm_86/89 (no clusters), sm_100 and sm_120
    /// keep `FewMiss` until a run of theirs says otherwise.
    pub fn default_for(arch: Option<u32>, batch: usize) -> SwapInChoice {
        let warp = CopyMethod::WarpVectors;
        let (strategy, build, copy) = match arch {
            Some(90) if batch <= SPLIT_UP_TO_BATCH => {
                (SwapInStrategy::FewMiss, PlannerBuild::Split, warp)
            }
            Some(90) => (
                SwapInStrategy::FewMissOneLaunch,
                PlannerBuild::FixedShape,
                CopyMethod::LineAligned,
            ),
            _ => (SwapInStrategy::DEFAULT, PlannerBuild::Plain, warp),
        };
        SwapInChoice {
            strategy,
            build,
            copy,
        }
    }

    /// The launcher's flags for this choice's build and copy method.
    fn flags(self) -> u32 {
        let build = match self.build {
            PlannerBuild::Plain => 0,
            PlannerBuild::Split => crate::abi::KVT_SWAP_CLUSTER_PLAN,
            PlannerBuild::FixedShape => crate::abi::KVT_SWAP_FIXED_SHAPE,
        };
        build | self.copy.swap_in_flags()
    }
}

/// [`SwapInEngine::default_choice`]: [`SwapInChoice::default_for`] `arch`
/// and `batch`, `FewMiss` (plain) where the few-miss planner's state does
/// not fit (`few_miss_fits` false): its stand-in, the block-scan planner
/// and a copy kernel, copies hundreds of misses faster than the block-scan
/// planner alone.
fn default_of(arch: Option<u32>, batch: usize, few_miss_fits: bool) -> SwapInChoice {
    let choice = SwapInChoice::default_for(arch, batch);
    if few_miss_fits {
        return choice;
    }
    SwapInChoice {
        strategy: SwapInStrategy::FewMiss,
        build: PlannerBuild::Plain,
        copy: CopyMethod::WarpVectors,
    }
}

/// The largest batch [`SwapInChoice::default_for`] runs the split planner
/// at on sm_90: the largest batch of the H200 runs that chose it (at batch
/// 10 it was ahead of the one-launch planner's fixed-shape build with a hot
/// buffer of 8192 and behind it with 4096, 2 misses a row: medians 20.8-21.5
/// against 23.3-24.2 µs and 17.6-19.2 against 16.4-17.9; batches 11 to 15
/// were not timed; at 16 it was up to 1.6x slower).
pub const SPLIT_UP_TO_BATCH: usize = 10;

/// The row shapes (entries, hot slots) the 1024-thread few-miss planner has
/// fixed-shape builds of ([`SwapInEngine::run_fixed_shape`]): top-k 2048
/// over hot buffers of 4096 and 8192 slots.
#[doc(hidden)]
pub const FIXED_SHAPES: [(u32, u32); 2] = [(2048, 4096), (2048, 8192)];

/// The most misses a [`SwapInStrategy::FewMiss`] planning block copies
/// itself.
pub const FEW_MISS_INLINE: u32 = crate::abi::KVT_SWAP_FEW_MISS_INLINE;

/// The plan scratch of the CUDA executor: a host row and a device row per
/// entry of each batch row, and a miss count per batch row.
struct PlanScratch {
    src: DeviceBuffer<i64>,
    dst: DeviceBuffer<i32>,
    count: DeviceBuffer<i32>,
}

/// Where the plan scratch and the error word are, as the executor addresses
/// them (plan addresses 0: no scratch, as for the CPU executor).
pub(crate) struct SwapInTarget {
    pub location: crate::mem::Location,
    pub max_batch: u32,
    pub max_top_k: u32,
    pub plan_src: u64,
    pub plan_dst: u64,
    pub plan_count: u64,
    pub error: u64,
    /// The counter table (0: none) and its layers.
    pub counters: u64,
    pub counter_layers: u32,
    /// Dynamic shared memory a planning block may take: the few-miss planner
    /// runs only where its state fits (unbounded off the GPU).
    pub max_smem: usize,
}

/// Runs swap-ins and miss-plan replays on one executor: owns the plan
/// scratch and the error word they report into. A [`crate::Tier`] holds one;
/// engines that keep their KV elsewhere (the SGLang shim) use one directly.
///
/// Swap-ins of one engine must run one after the other (one stream, or
/// ordered with events), as layers do: they share the scratch. SGLang
/// 0.5.21-0.5.23 never has two in flight on one GPU: two-batch overlap steps
/// its micro-batches on one stream, speculative decoding swaps in for the
/// target model only, DeepSeek-V4's indexer stream forks from and joins the
/// main stream every layer, and the shared-index replays on its prefetch
/// stream read SGLang's own miss plan (not this scratch) and finish before
/// the next anchor layer's swap-in (its events order them).
pub struct SwapInEngine {
    exec: Executor,
    /// The CUDA executor's error word (the CPU executor reports at once).
    error: Option<DeviceErrorWord>,
    max_batch: u32,
    max_top_k: u32,
    scratch: Option<PlanScratch>,
    /// Scratch replaced by a larger [`SwapInEngine::reserve`]: a CUDA graph
    /// captured earlier still addresses it, so it lives as long as the engine.
    retired: Vec<PlanScratch>,
    /// The non-blocking watch on the error word ([`SwapInEngine::poll_bad_indices`]),
    /// made on first use, and the entry count the last poll reported.
    watch: Option<DeviceSnapshot<ErrorWord>>,
    polled_count: AtomicU32,
    /// How many times a check has cleared the word: a poll drops a snapshot
    /// taken before the latest clear.
    clears: AtomicU64,
    /// Per-layer counters, once [`SwapInEngine::enable_counters`] made them.
    counters: Option<counters::CounterTable>,
}

impl SwapInTarget {
    /// The counters entry of `layer` (0 when the engine counts nothing).
    pub(crate) fn counters_of(&self, layer: Option<u32>) -> Result<u64> {
        match layer {
            Some(_) if self.counters == 0 => Ok(0),
            None => Ok(0),
            Some(l) if l >= self.counter_layers => Err(invalid(
                "layer",
                format!(
                    "{l} is outside the {} layers the engine counts (enable_counters)",
                    self.counter_layers
                ),
            )),
            Some(l) => {
                Ok(self.counters + l as u64 * size_of::<crate::abi::kvt_swap_counters>() as u64)
            }
        }
    }
}

impl SwapInEngine {
    /// An engine on `exec` with no capacity yet: reserve some, or pass a
    /// [`MissPlan`] with every swap-in. For the CUDA executor this allocates
    /// the error word.
    pub fn new(exec: Executor) -> Result<Self> {
        let error = match &exec {
            Executor::Cpu => None,
            Executor::Cuda(dev) => Some(DeviceErrorWord::new(dev)?),
        };
        Ok(SwapInEngine {
            exec,
            error,
            max_batch: 0,
            max_top_k: 0,
            scratch: None,
            retired: Vec::new(),
            watch: None,
            polled_count: AtomicU32::new(0),
            clears: AtomicU64::new(0),
            counters: None,
        })
    }

    /// Starts counting (set-up, not for the per-layer path): a zeroed table
    /// of `layers` [`SwapInCounters`] where the swap-ins run, which every
    /// swap-in naming a `layer` below `layers` adds to from then on. Counting
    /// is on for the engine's life; enabling it again with at most as many
    /// layers keeps the counts, with more it is refused (a CUDA graph
    /// captured before addresses the table it has).
    pub fn enable_counters(&mut self, layers: u32) -> Result<()> {
        args::within("layers", layers, 1, MAX_COUNTED_LAYERS)?;
        if let Some(t) = &self.counters {
            if layers <= t.layers() {
                return Ok(());
            }
            return Err(invalid(
                "layers",
                format!(
                    "counters are enabled for {} layers; {layers} asked",
                    t.layers()
                ),
            ));
        }
        self.counters = Some(counters::CounterTable::new(&self.exec, layers)?);
        Ok(())
    }

    /// The layers counted (0 before [`SwapInEngine::enable_counters`]).
    pub fn counter_layers(&self) -> u32 {
        self.counters.as_ref().map_or(0, |t| t.layers())
    }

    /// Every counted layer's [`SwapInCounters`] once the swap-ins launched
    /// before the call have finished: the CUDA executor waits for the whole
    /// device (not for the per-layer path; [`SwapInEngine::poll_counters`]
    /// never waits). None before [`SwapInEngine::enable_counters`].
    pub fn counters(&self) -> Result<Option<Vec<SwapInCounters>>> {
        self.counters.as_ref().map(|t| t.read()).transpose()
    }

    /// The counters without waiting (once per step at most, outside a CUDA
    /// graph capture): the CPU executor's as they are; the CUDA executor's
    /// as a copy on a stream of the engine's own, started by the previous
    /// poll, found them (None on the first poll and while it is in flight).
    /// None before [`SwapInEngine::enable_counters`].
    pub fn poll_counters(&mut self) -> Result<Option<Vec<SwapInCounters>>> {
        match self.counters.as_mut() {
            Some(t) => t.poll(),
            None => Ok(None),
        }
    }

    /// The executor.
    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// The largest batch and number of entries per row (top-k tokens, or
    /// blocks × block size) a swap-in without a caller's miss plan may have.
    pub fn capacity(&self) -> (u32, u32) {
        (self.max_batch, self.max_top_k)
    }

    /// Makes room for swap-ins of up to `max_batch` rows of up to
    /// `max_top_k` entries (never shrinks): for the CUDA executor, allocates
    /// plan scratch of 12 B per row and entry. Set-up work, not for the
    /// per-layer path or inside a CUDA graph capture. Scratch it replaces is
    /// kept until the engine drops, so graphs captured before stay valid.
    pub fn reserve(&mut self, max_batch: u32, max_top_k: u32) -> Result<()> {
        if max_batch == 0 || max_batch > MAX_BATCH {
            return Err(invalid(
                "max_batch",
                format!("{max_batch} is outside 1..={MAX_BATCH}"),
            ));
        }
        if max_top_k == 0 || max_top_k > MAX_TOP_K {
            return Err(invalid(
                "max_top_k",
                format!("{max_top_k} is outside 1..={MAX_TOP_K}"),
            ));
        }
        let (batch, top_k) = (max_batch.max(self.max_batch), max_top_k.max(self.max_top_k));
        if (batch, top_k) == (self.max_batch, self.max_top_k) {
            return Ok(());
        }
        if let Executor::Cuda(dev) = &self.exec {
            let entries = batch as usize * top_k as usize;
            let fresh = PlanScratch {
                src: DeviceBuffer::zeroed(dev, entries)?,
                dst: DeviceBuffer::zeroed(dev, entries)?,
                count: DeviceBuffer::zeroed(dev, batch as usize)?,
            };
            if let Some(old) = self.scratch.replace(fresh) {
                self.retired.push(old);
            }
        }
        (self.max_batch, self.max_top_k) = (batch, top_k);
        Ok(())
    }

    fn target(&self) -> SwapInTarget {
        let (plan_src, plan_dst, plan_count) = match &self.scratch {
            Some(s) => (s.src.device_ptr(), s.dst.device_ptr(), s.count.device_ptr()),
            None => (0, 0, 0),
        };
        SwapInTarget {
            location: self.exec.location(),
            max_batch: self.max_batch,
            max_top_k: self.max_top_k,
            plan_src,
            plan_dst,
            plan_count,
            error: self.error.as_ref().map_or(0, |e| e.device_ptr()),
            counters: self.counters.as_ref().map_or(0, |t| t.address()),
            counter_layers: self.counters.as_ref().map_or(0, |t| t.layers()),
            max_smem: match &self.exec {
                Executor::Cuda(dev) => dev.max_dynamic_smem(),
                Executor::Cpu => usize::MAX,
            },
        }
    }

    /// One layer's swap-in for a whole batch (see the module docs) as
    /// [`SwapInEngine::default_choice`] picks it. On `stream`, no
    /// allocation, no host synchronisation; bad indices are refused and
    /// reported (CPU: now; CUDA: at the next [`SwapInEngine::check`]).
    pub fn run(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        self.run_choice(args, self.default_choice(args), stream)
    }

    /// What [`SwapInEngine::run`] launches for `args`:
    /// [`SwapInChoice::default_for`] this engine's GPU and the call's batch,
    /// except that where the few-miss planner's state does not fit the GPU's
    /// shared memory it is `FewMiss`, plain (whose stand-in, the block-scan
    /// planner and a copy kernel, copies hundreds of misses faster than the
    /// block-scan planner alone). Host arithmetic on the arguments' shapes
    /// only.
    pub fn default_choice(&self, args: &SwapInArgs<'_>) -> SwapInChoice {
        let arch = match &self.exec {
            Executor::Cuda(dev) => {
                let (major, minor) = dev.compute_capability();
                u32::try_from(major * 10 + minor).ok()
            }
            Executor::Cpu => None,
        };
        let batch = args.req_pool_indices.len();
        let fits =
            args::few_miss_fits(&self.target(), args::entries_of(args), args.hot_buffer_size);
        default_of(arch, batch, fits)
    }

    /// The strategy [`SwapInEngine::run`] takes for `args`
    /// ([`SwapInEngine::default_choice`]'s).
    pub fn default_strategy(&self, args: &SwapInArgs<'_>) -> SwapInStrategy {
        self.default_choice(args).strategy
    }

    /// [`SwapInEngine::run`] with an explicit strategy for the CUDA executor
    /// (the CPU executor has one); the benchmark runs the
    /// one-block-per-request baseline on identical inputs with it.
    pub fn run_with(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        stream: Stream,
    ) -> Result<()> {
        self.run_with_copy(args, strategy, CopyMethod::WarpVectors, stream)
    }

    /// [`SwapInEngine::run_with`] with the misses moved by the copy kernel of
    /// `copy`'s method ([`CopyMethod`]; `run` and `run_with` use
    /// `WarpVectors`). The rows a planning block copies beside the copy
    /// kernel (at most [`FEW_MISS_INLINE`] misses) move as `WarpVectors`
    /// under every method: the latency regime, a pass or two of a warp.
    /// `FewMissOneLaunch`, copying every miss in its planning blocks, takes
    /// the method for those copies (`MergedRuns` and `BulkRuns` as
    /// `LineAligned`: a row's misses are seldom neighbours in the pool); the
    /// copy kernel takes `BulkRuns` as its own bulk-copy build where the
    /// GPU and the rows allow it; the other strategies with
    /// no copy kernel (`OneBlockPerRequest`, `CompactOneLaunch`,
    /// `FewMiss512OneLaunch`) move every row as `WarpVectors`. The CPU executor
    /// has one way.
    pub fn run_with_copy(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        copy: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        let build = PlannerBuild::Plain;
        self.run_choice(
            args,
            SwapInChoice {
                strategy,
                build,
                copy,
            },
            stream,
        )
    }

    /// [`SwapInEngine::run_with_copy`] with the 1024-thread few-miss
    /// planner's fixed-shape builds (`kvt_swap_in_few_miss_k2048_h4096_plan`
    /// and `_h8192_plan`, taken by `FewMiss` and `FewMissOneLaunch` for rows
    /// of exactly a shape of [`FIXED_SHAPES`]; the plain build elsewhere):
    /// the shapes and the block's threads are constants of the build, so
    /// the planner computes no carve-up, hash size or loop bound per
    /// thread. The same outputs, state, plan and reports. For the benchmark,
    /// which times it beside the plain build; the default takes it with
    /// line-aligned copies above [`SPLIT_UP_TO_BATCH`] rows on sm_90
    /// ([`SwapInChoice::default_for`]). The CPU executor has one way.
    #[doc(hidden)]
    pub fn run_fixed_shape(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        copy: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        let build = PlannerBuild::FixedShape;
        self.run_choice(
            args,
            SwapInChoice {
                strategy,
                build,
                copy,
            },
            stream,
        )
    }

    /// [`SwapInStrategy::FewMiss`] in one launch on GPUs that launch
    /// thread-block clusters (sm_90 and later: `CudaDevice::cluster_launch`):
    /// `kvt_swap_in_few_miss_cluster_plan`, a cluster of
    /// `KVT_SWAP_CLUSTER` blocks a batch row, whose first block plans the
    /// row (copying a row of at most [`FEW_MISS_INLINE`] misses itself) and
    /// whose other blocks copy the misses of a row of more, once the plan is
    /// written (a cluster barrier), instead of a copy kernel launched after
    /// the plan.
    /// Elsewhere the few-miss planner and its copy kernel. The same
    /// outputs, state, plan and reports. For the benchmark, which times it
    /// beside `FewMiss` and `FewMissOneLaunch`: no default takes it before a
    /// GPU has timed it. The CPU executor has one way.
    #[doc(hidden)]
    pub fn run_cluster_copy(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        self.run_flagged(
            args,
            SwapInStrategy::FewMiss,
            crate::abi::KVT_SWAP_CLUSTER_COPY,
            stream,
        )
    }

    /// [`SwapInStrategy::FewMiss`] in one launch, planned by a thread-block
    /// cluster a batch row on GPUs that launch them (sm_90 and later):
    /// `kvt_swap_in_split_plan`, `KVT_SWAP_CLUSTER` blocks a row, each
    /// resolving a share of the row's LRU positions and query entries and
    /// copying the misses among its entries, the row's counts exchanged
    /// through distributed shared memory. Elsewhere, or where a block's
    /// state ([`split_smem_bytes`]) does not fit, the few-miss planner and
    /// its copy kernel. The same outputs, state, plan and reports. For the
    /// benchmark, which times it beside `FewMiss`; the default takes it up
    /// to [`SPLIT_UP_TO_BATCH`] rows on sm_90 ([`SwapInChoice::default_for`]).
    /// The CPU executor has one way.
    #[doc(hidden)]
    pub fn run_cluster_plan(&self, args: &SwapInArgs<'_>, stream: Stream) -> Result<()> {
        let choice = SwapInChoice {
            strategy: SwapInStrategy::FewMiss,
            build: PlannerBuild::Split,
            copy: CopyMethod::WarpVectors,
        };
        self.run_choice(args, choice, stream)
    }

    /// `choice`'s strategy with the launcher's flags of its build and copy
    /// method ([`SwapInChoice`]'s one mapping of them).
    fn run_choice(
        &self,
        args: &SwapInArgs<'_>,
        choice: SwapInChoice,
        stream: Stream,
    ) -> Result<()> {
        self.run_flagged(args, choice.strategy, choice.flags(), stream)
    }

    /// Checks `args` for `strategy`, adds `flags` (the launcher's choices of
    /// a copy method or a planner build, which change which kernel runs,
    /// never what it may touch) and runs the call on this engine's executor.
    fn run_flagged(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
        flags: u32,
        stream: Stream,
    ) -> Result<()> {
        let mut p = args::check(&self.target(), args, strategy)?;
        p.flags |= flags;
        match &self.exec {
            // SAFETY: `check` checked every host buffer against its shape.
            Executor::Cpu => unsafe { cpu::run(&p) }.into_result(),
            // SAFETY: `check` checked every buffer is device memory of the
            // right size; the scratch is this engine's and fits batch ×
            // entries (or the caller's plan was checked instead).
            Executor::Cuda(dev) => unsafe {
                let dependent = strategy != SwapInStrategy::PlanThenCopyInOrder;
                cuda::launch(dev, &p, dependent, stream)
            },
        }
    }

    /// One layer's speculative swap-in (SGLang's
    /// `load_cache_to_device_buffer_spec_mla`, MTP/EAGLE verify) on SGLang's
    /// `HiSparseSpecState`: see the `spec` module's contract. On `stream`, no
    /// allocation, no host synchronisation; bad indices are refused and
    /// reported (CPU: now; CUDA: at the next [`SwapInEngine::check`]). The
    /// CUDA kernel has run under host emulation only, not yet on a GPU.
    pub fn run_spec(&self, args: &SpecSwapInArgs<'_>, stream: Stream) -> Result<()> {
        let t = self.target();
        let p = speculative::check(args, t.location, t.error)?;
        match &self.exec {
            // SAFETY: `check` checked every host buffer against its shape and
            // that the written ones share no memory.
            Executor::Cpu => unsafe { speculative::run(&p) }.into_result(),
            // SAFETY: `check` checked every buffer is device memory of the
            // right size; the error word is this engine's.
            Executor::Cuda(dev) => unsafe { cuda::launch_spec(dev, &p, stream) },
        }
    }

    /// The kernel parameters [`SwapInEngine::run_with`] would launch `args`
    /// with, after the same checks: for the benchmark, which hands them to a
    /// build of SGLang's own kernel to time it on identical inputs.
    #[doc(hidden)]
    pub fn swap_in_params(
        &self,
        args: &SwapInArgs<'_>,
        strategy: SwapInStrategy,
    ) -> Result<crate::abi::kvt_swap_in_params> {
        args::check(&self.target(), args, strategy)
    }

    /// The kernel parameters [`SwapInEngine::run_spec`] would launch `args`
    /// with, after the same checks: for the benchmark, which hands them to a
    /// build of SGLang's own kernel to time it on identical inputs.
    #[doc(hidden)]
    pub fn spec_params(
        &self,
        args: &SpecSwapInArgs<'_>,
    ) -> Result<crate::abi::kvt_spec_swap_in_params> {
        let t = self.target();
        speculative::check(args, t.location, t.error)
    }

    /// Replays a recorded miss plan (SGLang's `copy_cache_planned_mla`): the
    /// host → device copies of the rows below `num_real_reqs`, nothing else.
    /// `warps` caps the copy grid (SGLang passes `num_blocks × block_size /
    /// 32` worth of warps so that the replay, on a side stream, leaves the
    /// other SMs to the compute it overlaps); None sizes it for the plan.
    pub fn copy_planned(
        &self,
        args: &PlannedCopyArgs<'_>,
        warps: Option<u32>,
        stream: Stream,
    ) -> Result<()> {
        self.copy_planned_with_copy(args, warps, CopyMethod::WarpVectors, stream)
    }

    /// [`SwapInEngine::copy_planned`] with the copy kernel of `copy`'s method
    /// (`copy_planned` uses `WarpVectors`, the method every GPU run so far
    /// timed); the same bytes move. The CPU executor has one way.
    pub fn copy_planned_with_copy(
        &self,
        args: &PlannedCopyArgs<'_>,
        warps: Option<u32>,
        copy: CopyMethod,
        stream: Stream,
    ) -> Result<()> {
        let p = replay::check(&self.target(), args, copy)?;
        match &self.exec {
            // SAFETY: `check` checked every host buffer against its shape.
            Executor::Cpu => unsafe { cpu::replay(&p) }.into_result(),
            // SAFETY: `check` checked every buffer is device memory of the right size.
            Executor::Cuda(dev) => unsafe { cuda::launch_replay(dev, &p, warps, stream) },
        }
    }

    /// The address this engine's kernels use for host memory at `host`: the
    /// same address for the CPU executor; for the CUDA executor the mapped
    /// device address, when the memory is pinned or registered (else an
    /// error naming `host_cache`).
    pub fn host_address_for_executor(&self, host: u64) -> Result<u64> {
        match &self.exec {
            Executor::Cpu => Ok(host),
            Executor::Cuda(dev) => dev.mapped_host_address(host),
        }
    }

    /// The sync point: waits for the device, then reports (and clears) the
    /// bad indices that swap-ins recorded since the last check. A no-op for
    /// the CPU executor. Not for the per-layer path.
    pub fn check(&self) -> Result<()> {
        self.take_word()?.into_result()
    }

    /// The bad indices swap-ins recorded, without waiting for the device:
    /// the error word as a copy the previous poll started found it, when it
    /// holds entries no poll had reported yet (the report counts every entry
    /// since the last [`check`](Self::check), of which `new` are new). The
    /// copy runs on a stream of the engine's own, so neither the caller's
    /// stream nor the host waits; call it once per step, outside any CUDA
    /// graph capture. Always None for the CPU executor, which reports at once.
    pub fn poll_bad_indices(&mut self) -> Result<Option<(BadIndexReport, u32)>> {
        let (Executor::Cuda(dev), Some(error)) = (&self.exec, &self.error) else {
            return Ok(None);
        };
        if self.watch.is_none() {
            self.watch = Some(DeviceSnapshot::new(dev, 1)?);
        }
        let watch = self.watch.as_mut().expect("made above");
        // SAFETY: the word is one ErrorWord on the watch's device, owned by
        // this engine, which drops the watch first.
        let snapshot =
            unsafe { watch.poll(error.device_ptr(), self.clears.load(Ordering::Acquire))? };
        let Some(word) = snapshot.map(|w| w[0]) else {
            return Ok(None);
        };
        let seen = self.polled_count.swap(word.0.count, Ordering::Relaxed);
        if word.is_clear() || word.0.count == seen {
            return Ok(None);
        }
        // A check in between cleared the word: all of it is new.
        let new = if word.0.count > seen {
            word.0.count - seen
        } else {
            word.0.count
        };
        Ok(Some((BadIndexReport::decode(&word), new)))
    }

    /// Reads and clears the error word (waits for the whole context).
    pub(crate) fn take_word(&self) -> Result<ErrorWord> {
        self.polled_count.store(0, Ordering::Relaxed);
        self.clears.fetch_add(1, Ordering::AcqRel);
        match (&self.exec, &self.error) {
            (Executor::Cuda(_), Some(error)) => error.take(),
            _ => Ok(ErrorWord::clear()),
        }
    }
}

impl Drop for SwapInEngine {
    fn drop(&mut self) {
        // Kernels still running may use the scratch and the error word.
        if let Executor::Cuda(dev) = &self.exec {
            let _ = dev.synchronize_all();
        }
    }
}

impl std::fmt::Debug for SwapInEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapInEngine")
            .field("executor", &self.exec)
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// Elements a buffer of `rows` rows `stride` apart, `width` used per row, spans.
/// Saturates instead of wrapping: a stride no buffer could hold gives a span
/// no buffer has, which the buffer checks then refuse.
pub(crate) fn span(rows: usize, stride: usize, width: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1).saturating_mul(stride).saturating_add(width)
    }
}

/// Plan scratch at host addresses, for [`emulation_params`].
#[doc(hidden)]
pub struct EmulationScratch {
    pub src: u64,
    pub dst: u64,
    pub count: u64,
    pub max_batch: u32,
    pub max_top_k: u32,
    /// A counters table (`kvt_swap_counters` per layer) at a host address,
    /// or 0, and its layers.
    pub counters: u64,
    pub counter_layers: u32,
}

/// The kernel parameters a swap-in of host buffers launches with, for tests
/// that run the kernels' own source on the host (tests/kernel_emulation.rs):
/// the same checks and the same parameters as a real launch.
#[doc(hidden)]
pub fn emulation_params(
    args: &SwapInArgs<'_>,
    strategy: SwapInStrategy,
    scratch: EmulationScratch,
    error: u64,
) -> Result<crate::abi::kvt_swap_in_params> {
    emulation_params_with_copy(args, strategy, CopyMethod::WarpVectors, scratch, error)
}

/// As [`emulation_params`], with the copy method of
/// [`SwapInEngine::run_with_copy`].
#[doc(hidden)]
pub fn emulation_params_with_copy(
    args: &SwapInArgs<'_>,
    strategy: SwapInStrategy,
    copy: CopyMethod,
    scratch: EmulationScratch,
    error: u64,
) -> Result<crate::abi::kvt_swap_in_params> {
    let target = SwapInTarget {
        location: crate::mem::Location::Host,
        max_batch: scratch.max_batch,
        max_top_k: scratch.max_top_k,
        plan_src: scratch.src,
        plan_dst: scratch.dst,
        plan_count: scratch.count,
        error,
        counters: scratch.counters,
        counter_layers: scratch.counter_layers,
        max_smem: usize::MAX,
    };
    let mut p = args::check(&target, args, strategy)?;
    p.flags |= copy.swap_in_flags();
    Ok(p)
}

/// As [`emulation_params`], for a plan replay with the copy kernel of
/// `copy`'s method.
#[doc(hidden)]
pub fn emulation_replay_params(
    args: &PlannedCopyArgs<'_>,
    copy: CopyMethod,
    error: u64,
) -> Result<crate::abi::kvt_swap_in_params> {
    let target = SwapInTarget {
        location: crate::mem::Location::Host,
        max_batch: 0,
        max_top_k: 0,
        plan_src: 0,
        plan_dst: 0,
        plan_count: 0,
        error,
        counters: 0,
        counter_layers: 0,
        max_smem: usize::MAX,
    };
    replay::check(&target, args, copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default is the measured choice on sm_90: the split planner up to
    /// SPLIT_UP_TO_BATCH rows, the one-launch planner's fixed-shape build
    /// with line-aligned copies above (the H200 runs that chose them); the plain few-miss planner and
    /// its copy kernel on every other GPU and on the CPU executor.
    #[test]
    fn the_default_is_split_then_one_launch_fixed_shape_lines_on_sm_90_only() {
        let at = |arch, batch| SwapInChoice::default_for(arch, batch);
        let choice = |strategy, build| SwapInChoice {
            strategy,
            build,
            copy: CopyMethod::WarpVectors,
        };
        let split = choice(SwapInStrategy::FewMiss, PlannerBuild::Split);
        let fixed = SwapInChoice {
            copy: CopyMethod::LineAligned,
            ..choice(SwapInStrategy::FewMissOneLaunch, PlannerBuild::FixedShape)
        };
        let plain = choice(SwapInStrategy::FewMiss, PlannerBuild::Plain);
        for batch in [0, 1, 8, SPLIT_UP_TO_BATCH] {
            assert_eq!(at(Some(90), batch), split, "{batch}");
        }
        for batch in [SPLIT_UP_TO_BATCH + 1, 64, 256, 16384] {
            assert_eq!(at(Some(90), batch), fixed, "{batch}");
            assert_eq!(
                SwapInStrategy::default_for(Some(90), batch),
                SwapInStrategy::FewMissOneLaunch
            );
        }
        for arch in [None, Some(80), Some(86), Some(89), Some(100), Some(120)] {
            for batch in [1, 256] {
                assert_eq!(at(arch, batch), plain, "{arch:?} {batch}");
            }
        }
        assert_eq!(split.flags(), crate::abi::KVT_SWAP_CLUSTER_PLAN);
        assert_eq!(
            fixed.flags(),
            crate::abi::KVT_SWAP_FIXED_SHAPE | crate::abi::KVT_SWAP_COPY_LINES
        );
        assert_eq!(plain.flags(), 0);
    }

    /// Where the few-miss planner's state does not fit the GPU's shared
    /// memory the default is `FewMiss`, plain (which then runs the
    /// block-scan planner and a copy kernel), not the block-scan planner
    /// copying alone nor a build of the few-miss planner.
    #[test]
    fn the_default_leaves_the_few_miss_builds_where_the_planner_does_not_fit() {
        let plain = SwapInChoice {
            strategy: SwapInStrategy::FewMiss,
            build: PlannerBuild::Plain,
            copy: CopyMethod::WarpVectors,
        };
        assert_eq!(
            default_of(Some(90), 64, true).strategy,
            SwapInStrategy::FewMissOneLaunch
        );
        assert_eq!(default_of(Some(90), 64, false), plain);
        assert_eq!(default_of(Some(90), 1, false), plain);
        assert_eq!(default_of(Some(90), 1, true).build, PlannerBuild::Split);
        assert_eq!(default_of(None, 64, true), plain);
    }
}
