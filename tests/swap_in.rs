//! LRU swap-in on the CPU executor: the worked example of the contract
//! (src/swap_in/mod.rs), batches with padding rows and mixed short/long
//! sequences, SGLang compatibility on valid input, the safety rules on bad
//! input, argument checks, and property tests against the model in
//! tests/common/swap.rs.

mod common;

use common::swap::*;
use common::*;
use kvtier::{
    BadIndexKind, Buf, BufMut, DeviceSpec, Error, Executor, IndexBuf, ItemLayout, KvBuffers,
    LayerFirstLayout, MissPlan, Pool, QueryKind, Stream, SwapInArgs, SwapInCounters, SwapInEngine,
    SwapInStrategy, Tier,
};
use proptest::prelude::*;

const ITEM: usize = 16;

/// The worked example: HOT = 4; slots 0..3 hold tokens 1, 4, 2, 5 at device
/// rows 9, 7, 3, 5; the newest token 7 sits in the reserved slot at row 11;
/// LRU order [0, 1, 2, 3]; seq_len 8; host row of token t is t (row t filled
/// with t).
fn worked_example(query: &[i32]) -> SwapCase {
    SwapCase {
        hot: 4,
        k: query.len(),
        query: QueryKind::Tokens,
        layout: ItemLayout::linear(ITEM as u32).unwrap(),
        requests: 1,
        max_tokens: 8,
        tokens_stride: 5,
        locs_stride: 5,
        lru_stride: 4,
        host_stride: 8,
        top_k_stride: query.len(),
        out_stride: query.len(),
        tokens: vec![1, 4, 2, 5, 7],
        locs: vec![9, 7, 3, 5, 11],
        lru: vec![0, 1, 2, 3],
        host_locs: (0..8).collect(),
        host_cache: (0..8u8).flat_map(|r| [r; ITEM]).collect(),
        device_buffer: vec![0xEE; 12 * ITEM],
        host_cache_v: None,
        device_buffer_v: None,
        topk: query.to_vec(),
        req: vec![0],
        seq: vec![8],
        req_i64: false,
        seq_i64: true,
        num_real: None,
    }
}

fn cpu(case: &SwapCase) -> SwapOutcome {
    case.run(&Executor::cpu(), SwapInStrategy::PlanThenCopy)
}

#[test]
fn design_worked_example() {
    let first = worked_example(&[4, 2, 7]);
    let after = cpu(&first);
    assert_eq!(after.report, None);
    assert_eq!(after.out, vec![7, 3, 11]);
    assert_eq!(after.lru, vec![0, 3, 1, 2]);
    assert_eq!(
        after.tokens, first.tokens,
        "hits and the newest token change no slot"
    );
    assert_eq!(after.device_buffer, first.device_buffer, "no copies");
    // counted by hand: one call, one real row; slots 1 and 2 hit (tokens 4
    // and 2), the newest token takes no part, nothing loaded
    assert_eq!(
        after.counters,
        Some(SwapInCounters {
            calls: 1,
            rows: 1,
            hits: 2,
            misses: 0,
            bytes: 0,
            bad_indices: 0,
        })
    );

    let mut second = worked_example(&[6]);
    (second.tokens, second.lru, second.device_buffer) =
        (after.tokens, after.lru, after.device_buffer);
    let after = cpu(&second);
    assert_eq!(after.report, None);
    assert_eq!(
        after.out,
        vec![9],
        "slot 0 (the LRU) is evicted; its device row is 9"
    );
    assert_eq!(after.tokens, vec![6, 4, 2, 5, 7]);
    assert_eq!(after.lru, vec![3, 1, 2, 0]);
    assert_eq!(
        after.device_buffer[9 * ITEM..10 * ITEM],
        [6u8; ITEM],
        "device row 9 now holds host row 6"
    );
    let untouched = |r: usize| {
        second.device_buffer[r * ITEM..(r + 1) * ITEM]
            == after.device_buffer[r * ITEM..(r + 1) * ITEM]
    };
    assert!((0..12).filter(|&r| r != 9).all(untouched));
    // token 6 misses: one row of 16 bytes loaded, no slot hit
    assert_eq!(
        after.counters,
        Some(SwapInCounters {
            calls: 1,
            rows: 1,
            hits: 0,
            misses: 1,
            bytes: ITEM as u64,
            bad_indices: 0,
        })
    );
    assert_eq!(cpu(&second), second.expected());
    assert_eq!(cpu(&second), second.sglang(-1));
}

/// Two requests of the worked example's shape: request 1 a copy of request 0
/// at other device rows, request 2 a short one (seq_len 3 <= HOT).
fn three_requests() -> SwapCase {
    let mut c = worked_example(&[4, 2, 7]);
    c.requests = 3;
    c.tokens = vec![
        1, 4, 2, 5, 7, /* r1 */ 1, 4, 2, 5, 7, /* r2 */ 0, 1, 2, -1, -1,
    ];
    c.locs = vec![
        9, 7, 3, 5, 11, /* r1 */ 12, 13, 14, 15, 16, /* r2 */ 17, 18, 19, 20, 21,
    ];
    c.lru = vec![
        0, 1, 2, 3, /* r1 */ 3, 2, 1, 0, /* r2 */ 0, 1, 2, 3,
    ];
    c.host_locs = (0..8).chain(8..16).chain(16..24).collect();
    c.host_cache = (0..24u8).flat_map(|r| [r; ITEM]).collect();
    c.device_buffer = vec![0xEE; 22 * ITEM];
    c
}

#[test]
fn batch_with_padding_rows_leaves_their_state_alone() {
    let mut c = three_requests();
    c.req = vec![1, 0, 2];
    c.seq = vec![8, 8, 3];
    c.topk = vec![
        6, 0, 7, /* row 1 */ 4, 2, 7, /* row 2: padding */ 1, 2, 0,
    ];
    c.num_real = Some(2);
    let after = cpu(&c);
    assert_eq!(after.report, None);
    // row 0 (request 1, LRU [3,2,1,0]): 6 and 0 miss; evictables in LRU order
    // are slots 3, 2, 1, 0; the misses take slots 3 and 2 (rows 15 and 14)
    assert_eq!(after.out[..3], [15, 14, 16]);
    assert_eq!(after.tokens[5..10], [1, 4, 0, 6, 7]);
    assert_eq!(after.lru[4..8], [1, 0, 3, 2]);
    assert_eq!(
        after.device_buffer[15 * ITEM..16 * ITEM],
        [14u8; ITEM],
        "host row of request 1's token 6 is 8 + 6"
    );
    // row 1: the worked example
    assert_eq!(after.out[3..6], [7, 3, 11]);
    // row 2 is padding: outputs -1, request 2 untouched
    assert_eq!(after.out[6..9], [-1, -1, -1]);
    assert_eq!(after.lru[8..12], c.lru[8..12]);
    assert_eq!(after, c.expected());
    let mut sglang = c.sglang(-1);
    sglang.report = None;
    assert_eq!(after, sglang);
}

/// Two rows naming one request would race on its state on the GPU: the later
/// row is refused and reported, the earlier one runs as if alone.
#[test]
fn a_request_named_twice_in_a_batch_is_refused_in_the_later_row() {
    let mut c = three_requests();
    c.req = vec![1, 0, 1];
    c.seq = vec![8, 8, 8];
    c.topk = vec![
        6, 0, 7, /* row 1 */ 4, 2, 7, /* row 2: request 1 again */ 5, 3, 2,
    ];
    let after = cpu(&c);
    let report = after.report.clone().expect("the duplicate is reported");
    assert!(
        report.has(kvtier::BadIndexKind::SwapDuplicateRequest),
        "{report}"
    );
    assert_eq!(report.count, 1);
    assert!(
        report
            .to_string()
            .contains("req_pool_indices[2] = 1 names a request an earlier row"),
        "{report}"
    );
    // rows 0 and 1 as in a batch without row 2; row 2 outputs -1
    assert_eq!(after.out[..3], [15, 14, 16]);
    assert_eq!(after.out[6..9], [-1, -1, -1]);
    assert_eq!(after.tokens[5..10], [1, 4, 0, 6, 7]);
    assert_eq!(after, c.expected());
}

#[test]
fn mixed_short_and_long_rows() {
    let mut c = three_requests();
    c.req = vec![2, 0];
    c.seq = vec![3, 8];
    c.topk = vec![2, 0, -1, /* row 1 */ 5, 6, 1];
    let after = cpu(&c);
    assert_eq!(after.report, None);
    assert_eq!(after.out[..3], [19, 17, -1], "short: token t in slot t");
    assert_eq!(after.lru[8..12], c.lru[8..12], "short rows change no state");
    // long row: 5 and 1 hit (slots 3 and 0), 6 misses into slot 1 (LRU order 1, 2)
    assert_eq!(after.out[3..6], [5, 7, 9]);
    assert_eq!(after.tokens[..5], [1, 6, 2, 5, 7]);
    assert_eq!(after.lru[..4], [2, 1, 0, 3]);
    assert_eq!(after, c.expected());
    assert_eq!(after, c.sglang(-1));
}

#[test]
fn minus_one_inside_a_long_query_is_padding_not_a_miss() {
    // SGLang's internal hit marker (TOKEN_HIT) is also -1, so its kernel
    // takes the entry for a resolved one: no copy, no slot, and no output
    // written (the entry keeps what the buffer held). kvtier writes -1.
    let c = worked_example(&[4, -1, 6]);
    let after = cpu(&c);
    assert_eq!(after.report, None);
    assert_eq!(after.out, vec![7, -1, 9]);
    assert_eq!(after.tokens, vec![6, 4, 2, 5, 7]);
    assert_eq!(
        after.lru,
        vec![2, 3, 0, 1],
        "one miss (6 into slot 0), one hit (slot 1)"
    );
    assert_eq!(after, c.expected());
    assert_eq!(after, c.sglang(-1), "SGLang on a -1 pre-filled output");
    let stale = c.sglang(123);
    assert_eq!(
        stale.out,
        vec![7, 123, 9],
        "SGLang leaves the entry unwritten"
    );
    assert_eq!((stale.tokens, stale.lru), (after.tokens, after.lru));
}

#[test]
fn duplicates_resolve_to_one_slot_and_one_copy() {
    let c = worked_example(&[6, 4, 6, 4, 7, 7]);
    let mut c = SwapCase { hot: 6, ..c };
    // widen to HOT 6 so that K = 6 fits; two more empty slots
    (c.tokens_stride, c.locs_stride) = (7, 7);
    c.lru_stride = 6;
    c.tokens = vec![1, 4, 2, 5, -1, -1, 7];
    c.locs = vec![9, 7, 3, 5, 1, 2, 11];
    c.lru = vec![0, 1, 2, 3, 4, 5];
    let after = cpu(&c);
    assert_eq!(after.report, None);
    assert_eq!(after.out, vec![9, 7, 9, 7, 11, 11]);
    assert_eq!(
        after.tokens,
        vec![6, 4, 2, 5, -1, -1, 7],
        "6 loaded once, into the LRU slot"
    );
    assert_eq!(after.lru, vec![2, 3, 4, 5, 0, 1]);
    assert_eq!(after, c.expected());
}

#[test]
fn bad_tokens_and_rows_are_refused_and_reported() {
    let mut c = three_requests();
    c.req = vec![0, 7, 1, 2];
    c.seq = vec![8, 8, 99, 3];
    c.topk = vec![
        8, -3, 6, /* bad req */ 4, 2, 7, /* bad seq */ 4, 2, 7, /* short */ 3, 0, 1,
    ];
    c.host_locs[6] = 1000; // request 0's token 6 maps outside the host cache
    let after = cpu(&c);
    let r = after.report.clone().expect("reported");
    let kinds: Vec<BadIndexKind> = r.first.iter().map(|b| b.kind).collect();
    assert_eq!(
        kinds,
        vec![
            BadIndexKind::SwapRequest,
            BadIndexKind::SwapSeqLen,
            BadIndexKind::SwapToken,
            BadIndexKind::SwapHostLoc
        ]
    );
    assert_eq!(r.count, 6, "{r}");
    assert_eq!(
        after.out,
        vec![
            -1, -1, -1, -1, -1, -1, -1, -1, -1, /* short row: 3 >= seq_len */ -1, 17, 18
        ]
    );
    assert_eq!(
        (
            after.tokens.clone(),
            after.lru.clone(),
            after.device_buffer.clone()
        ),
        (c.tokens.clone(), c.lru.clone(), c.device_buffer.clone())
    );
    assert_eq!(after, c.expected());
    let text = kvtier::Error::BadIndices(r).to_string();
    assert!(
        text.contains("req_pool_indices[1] = 7") && text.contains("top_k_tokens[0][0] = 8"),
        "{text}"
    );
}

#[test]
fn a_broken_lru_row_refuses_the_request_and_keeps_its_state() {
    let mut c = worked_example(&[4, 6, 7]);
    c.lru = vec![0, 1, 1, 3];
    let after = cpu(&c);
    let r = after.report.clone().unwrap();
    assert!(r.has(BadIndexKind::SwapLru), "{r}");
    assert_eq!(after.out, vec![-1, -1, -1]);
    assert_eq!(
        (after.tokens, after.lru, after.device_buffer),
        (c.tokens, c.lru, c.device_buffer)
    );
}

#[test]
fn evictable_slots_with_bad_device_rows_are_never_loaded() {
    let mut c = worked_example(&[6, 0, 7]);
    c.locs[0] = 500; // the LRU slot's device row is outside the 12-row buffer
    let after = cpu(&c);
    let r = after.report.clone().unwrap();
    assert_eq!(r.count, 1, "{r}");
    assert!(r.has(BadIndexKind::SwapSlotLoc), "{r}");
    assert!(
        r.to_string()
            .contains("slot 0 of the request of batch row 0 is 500"),
        "{r}"
    );
    assert_eq!(
        after.out,
        vec![7, 3, 11],
        "6 and 0 miss; slot 0 is skipped, slots 1 and 2 take them"
    );
    assert_eq!(after.tokens, vec![1, 6, 0, 5, 7]);
    assert_eq!(
        after.lru,
        vec![0, 3, 1, 2],
        "the broken slot stays with the unused evictables"
    );
    assert_eq!(after, c.expected());
}

fn args_error(f: impl FnOnce(&mut SwapInArgs<'_>)) -> (&'static str, String) {
    let pool = Pool::create(
        LayerFirstLayout::new(8, 1, 8).unwrap(),
        DeviceSpec::Anon { bytes: 4 << 20 },
    )
    .unwrap();
    let mut tier = Tier::new(pool, Executor::cpu(), 1).unwrap();
    tier.enable_swap_in(4, 4).unwrap();
    let mut b = Bare::new();
    let mut args = b.args();
    f(&mut args);
    match tier.swap_in(&args, Stream::null()) {
        Err(Error::InvalidArgument { arg, msg }) => (arg, msg),
        other => panic!("expected an argument error, got {other:?}"),
    }
}

#[test]
fn arguments_are_checked_before_anything_runs() {
    assert_eq!(args_error(|a| a.num_top_k = 5).0, "hot_buffer_size");
    assert_eq!(args_error(|a| a.num_top_k = 0).0, "num_top_k");
    assert_eq!(args_error(|a| a.top_k_stride = 2).0, "top_k_stride");
    assert_eq!(args_error(|a| a.tokens_stride = 3).0, "tokens_stride");
    assert_eq!(args_error(|a| a.locs_stride = 4).0, "locs_stride");
    assert_eq!(args_error(|a| a.num_requests = 2).0, "device_buffer_tokens");
    assert_eq!(args_error(|a| a.max_tokens = 9).0, "host_stride");
    let (arg, msg) = args_error(|a| a.hot_buffer_size = 5);
    assert_eq!(arg, "locs_stride", "{msg}");
    let (arg, msg) = args_error(|a| {
        a.query = QueryKind::Blocks { block_tokens: 2 };
    });
    assert_eq!(
        arg, "hot_buffer_size",
        "3 blocks of 2 tokens need 6 slots: {msg}"
    );
    let (arg, msg) = args_error(|a| {
        a.query = QueryKind::Blocks { block_tokens: 0 };
    });
    assert_eq!(arg, "sparse_block_size", "{msg}");
    let (arg, msg) = args_error(|a| a.top_k_device_locs = unsafe { BufMut::device(0x1000, 3) });
    assert_eq!(arg, "top_k_device_locs");
    assert!(msg.contains("CPU executor reads host memory"), "{msg}");
    let (arg, msg) = args_error(|a| {
        a.num_top_k = 4;
        a.top_k_stride = 4;
        a.out_stride = 4;
    });
    assert_eq!(
        arg, "top_k_tokens",
        "3 elements cannot hold a row of 4: {msg}"
    );
}

#[test]
fn swap_in_needs_enabling_and_respects_its_capacity() {
    let pool = Pool::create(
        LayerFirstLayout::new(8, 1, 8).unwrap(),
        DeviceSpec::Anon { bytes: 4 << 20 },
    )
    .unwrap();
    let mut tier = Tier::new(pool, Executor::cpu(), 1).unwrap();
    let mut b = Bare::new();
    let err = tier
        .swap_in(&b.args(), Stream::null())
        .unwrap_err()
        .to_string();
    assert!(err.contains("enable_swap_in"), "{err}");
    tier.enable_swap_in(1, 2).unwrap();
    let err = tier
        .swap_in(&b.args(), Stream::null())
        .unwrap_err()
        .to_string();
    assert!(err.contains("capacity"), "{err}");
    tier.enable_swap_in(1, 3).unwrap();
    tier.swap_in(&b.args(), Stream::null()).unwrap();
    assert_eq!(b.out, vec![7, 3, 11]);
    // counting covers the layout's layers (one here), from enabling on
    assert_eq!(tier.swap_in_counters().unwrap(), None);
    tier.enable_swap_in_counters().unwrap();
    let mut counted = b.args();
    counted.layer = Some(0);
    tier.swap_in(&counted, Stream::null()).unwrap();
    let mut past = b.args();
    past.layer = Some(1);
    assert!(tier.swap_in(&past, Stream::null()).is_err());
    let c = tier.swap_in_counters().unwrap().unwrap();
    assert_eq!((c.len(), c[0].calls, c[0].rows), (1, 1, 1), "{c:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Valid input on every path (token and block queries, linear and
    /// paged rows, one or two planes): the CPU executor, the model and
    /// SGLang's algorithm agree on outputs, slot tokens, LRU order, device
    /// buffers and the miss plan.
    #[test]
    fn valid_input_matches_the_model_and_sglang(seed in any::<u64>()) {
        let c = SwapCase::random(seed, SWAP_SMALL, CLEAN, None);
        let got = c.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, RECORD);
        prop_assert_eq!(&got.report, &None);
        prop_assert_eq!(&got, &c.expected_with(RECORD));
        prop_assert_eq!(&got, &c.sglang_with(-1, RECORD));
    }

    /// Bad input: refused and reported exactly as the model says, state and
    /// buffers changed exactly as it says.
    #[test]
    fn hostile_input_matches_the_model(seed in any::<u64>()) {
        let c = SwapCase::random(seed, SWAP_SMALL, HOSTILE, None);
        prop_assert_eq!(cpu(&c), c.expected());
    }

    #[test]
    fn padded_input_matches_the_model(seed in any::<u64>()) {
        let c = SwapCase::random(seed, SWAP_SMALL, PADDED, None);
        prop_assert_eq!(cpu(&c), c.expected());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Hot buffers of hundreds of slots, 2, 7 or 64 misses per long row.
    #[test]
    fn bigger_valid_input_matches_sglang(seed in any::<u64>()) {
        let misses = [2usize, 7, 64][(seed % 3) as usize];
        let c = SwapCase::random(seed, SWAP_MEDIUM, CLEAN, Some(misses));
        let got = cpu(&c);
        prop_assert_eq!(&got, &c.sglang(-1));
    }
}

const RECORD: SwapOptions = SwapOptions {
    skip_io: false,
    record_plan: true,
    copy: kvtier::CopyMethod::WarpVectors,
    fixed_shape: false,
    cluster_copy: false,
    cluster_plan: false,
};
const PROBE: SwapOptions = SwapOptions {
    skip_io: true,
    record_plan: true,
    copy: kvtier::CopyMethod::WarpVectors,
    fixed_shape: false,
    cluster_copy: false,
    cluster_plan: false,
};

#[test]
fn the_miss_plan_is_sglangs_miss_src_dst_count() {
    // The worked example's second query: token 6 misses, evicts slot 0 (device row 9).
    let mut second = worked_example(&[6]);
    second.lru = vec![0, 3, 1, 2];
    let got = second.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, RECORD);
    assert_eq!(got.out, vec![9]);
    assert_eq!(got.plan, Some(vec![Some(vec![(6, 9)])]));
    assert_eq!(&got.device_buffer[9 * ITEM..][..ITEM], &[6u8; ITEM]);

    // Hits only: 0 misses; a padding row keeps its count, as in SGLang.
    let mut hits = worked_example(&[4, 2, 7]);
    hits.req = vec![0, 0];
    hits.seq = vec![8, 8];
    hits.topk = vec![4, 2, 7, 1, 1, 1];
    hits.num_real = Some(1);
    let got = hits.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, RECORD);
    assert_eq!(got.plan, Some(vec![Some(vec![]), None]));
    assert_eq!(got, hits.sglang_with(-1, RECORD));
}

#[test]
fn skip_io_updates_outputs_and_state_but_moves_no_bytes() {
    let mut second = worked_example(&[6]);
    second.lru = vec![0, 3, 1, 2];
    let got = second.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, PROBE);
    assert_eq!(got.out, vec![9]);
    assert_eq!(got.tokens, vec![6, 4, 2, 5, 7]);
    assert_eq!(got.lru, vec![3, 1, 2, 0]);
    assert_eq!(got.plan, Some(vec![Some(vec![(6, 9)])]));
    assert_eq!(
        got.device_buffer, second.device_buffer,
        "skip_io leaves the device buffer alone"
    );
}

/// The worked example's buffers and arguments, for direct calls.
struct Bare {
    c: SwapCase,
    tokens: Vec<i32>,
    lru: Vec<i16>,
    dev: Vec<u8>,
    out: Vec<i32>,
    req: [i32; 1],
    seq: [i32; 1],
}

impl Bare {
    fn new() -> Self {
        let c = worked_example(&[4, 2, 7]);
        Bare {
            tokens: c.tokens.clone(),
            lru: c.lru.clone(),
            dev: c.device_buffer.clone(),
            out: vec![0; 3],
            req: [0],
            seq: [8],
            c,
        }
    }

    fn args(&mut self) -> SwapInArgs<'_> {
        SwapInArgs {
            layer: None,
            top_k_tokens: Buf::host(&self.c.topk),
            top_k_stride: 3,
            query: QueryKind::Tokens,
            device_buffer_tokens: BufMut::host(&mut self.tokens),
            tokens_stride: 5,
            device_buffer_locs: Buf::host(&self.c.locs),
            locs_stride: 5,
            lru_slots: BufMut::host(&mut self.lru),
            lru_stride: 4,
            host_cache_locs: Buf::host(&self.c.host_locs),
            host_stride: 8,
            max_tokens: 8,
            kv: KvBuffers::linear(
                ITEM as u32,
                Buf::host(&self.c.host_cache),
                BufMut::host(&mut self.dev),
            )
            .unwrap(),
            top_k_device_locs: BufMut::host(&mut self.out),
            out_stride: 3,
            req_pool_indices: IndexBuf::I32(Buf::host(&self.req)),
            seq_lens: IndexBuf::I32(Buf::host(&self.seq)),
            num_real_reqs: None,
            num_requests: 1,
            num_top_k: 3,
            hot_buffer_size: 4,
            skip_io: false,
            miss_plan: None,
        }
    }
}

#[test]
fn a_bare_engine_needs_capacity_or_a_miss_plan() {
    let mut engine = SwapInEngine::new(Executor::cpu()).unwrap();
    assert_eq!(engine.capacity(), (0, 0));
    let mut b = Bare::new();
    let err = engine
        .run(&b.args(), Stream::null())
        .unwrap_err()
        .to_string();
    assert!(err.contains("SwapInEngine::reserve"), "{err}");

    // With the caller's miss plan, no capacity is needed.
    let (mut src, mut dst, mut count) = (vec![0i64; 3], vec![0i32; 3], vec![-1i32; 1]);
    {
        let mut args = b.args();
        args.miss_plan = Some(MissPlan {
            src: BufMut::host(&mut src),
            dst: BufMut::host(&mut dst),
            stride: 3,
            capacity: 3,
            count: BufMut::host(&mut count),
        });
        engine.run(&args, Stream::null()).unwrap();
    }
    assert_eq!(b.out, vec![7, 3, 11]);
    assert_eq!(count, vec![0], "all hits");

    engine.reserve(1, 3).unwrap();
    engine.reserve(1, 2).unwrap();
    assert_eq!(engine.capacity(), (1, 3), "reserve never shrinks");
    let mut b = Bare::new();
    engine.run(&b.args(), Stream::null()).unwrap();
    engine.check().unwrap();
    assert_eq!(b.out, vec![7, 3, 11]);
    assert!(engine.reserve(0, 3).is_err());
    assert!(engine.reserve(1, kvtier::swap_in::MAX_TOP_K + 1).is_err());
}

#[test]
fn a_miss_plan_too_small_for_the_batch_is_refused() {
    let engine = SwapInEngine::new(Executor::cpu()).unwrap();
    let plan_error = |capacity: usize, rows: usize, counts: usize| -> (&'static str, String) {
        let stride = capacity;
        let mut b = Bare::new();
        let (mut src, mut dst, mut count) = (
            vec![0i64; rows * stride],
            vec![0i32; rows * stride],
            vec![0i32; counts],
        );
        let mut args = b.args();
        args.miss_plan = Some(MissPlan {
            src: BufMut::host(&mut src),
            dst: BufMut::host(&mut dst),
            stride,
            capacity,
            count: BufMut::host(&mut count),
        });
        match engine.run(&args, Stream::null()) {
            Err(Error::InvalidArgument { arg, msg }) => (arg, msg),
            other => panic!("expected an argument error, got {other:?}"),
        }
    };
    let (arg, msg) = plan_error(2, 1, 1);
    assert_eq!(arg, "miss_src", "{msg}");
    assert!(msg.contains("a row can have 3"), "{msg}");
    assert_eq!(plan_error(3, 0, 1).0, "miss_src");
    assert_eq!(plan_error(3, 1, 0).0, "miss_count");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// The miss plan and skip-IO on random valid and hostile input: exactly
    /// the model's loads, in miss order, and no bytes moved under skip-IO.
    #[test]
    fn miss_plans_and_skip_io_match_the_model(seed in any::<u64>(), hostile in any::<bool>(), skip in any::<bool>()) {
        let c = SwapCase::random(seed, SWAP_SMALL, if hostile { HOSTILE } else { CLEAN }, None);
        let opts = SwapOptions { skip_io: skip, record_plan: true, copy: kvtier::CopyMethod::WarpVectors, fixed_shape: false, cluster_copy: false, cluster_plan: false };
        let got = c.run_with(&Executor::cpu(), SwapInStrategy::PlanThenCopy, opts);
        prop_assert_eq!(&got, &c.expected_with(opts));
        if skip {
            prop_assert_eq!(&got.device_buffer, &c.device_buffer);
            prop_assert_eq!(&got.device_buffer_v, &c.device_buffer_v);
        }
    }
}

#[test]
fn a_short_token_row_resolves_only_its_first_seq_len_entries() {
    // SGLang's fast path: with seq_len 2 only entries 0 and 1 are resolved;
    // the others output -1 whatever they hold (here valid tokens).
    let mut c = worked_example(&[1, -1, 0, 0]);
    c.tokens = vec![0, 1, 2, 3, -1];
    c.seq = vec![2];
    let after = cpu(&c);
    assert_eq!(after.report, None);
    assert_eq!(after.out, vec![7, -1, -1, -1]);
    assert_eq!((&after.tokens, &after.lru), (&c.tokens, &c.lru));
    assert_eq!(after, c.expected());
    assert_eq!(
        after,
        c.sglang(123456),
        "SGLang overwrites the stale output"
    );
}

/// MiniMax-M3's block query over the worked example's state: 2 blocks of
/// 2 tokens, K and V planes.
fn block_example(blocks: &[i32], seq: i64) -> SwapCase {
    let mut c = worked_example(blocks);
    c.query = QueryKind::Blocks { block_tokens: 2 };
    c.out_stride = 2 * blocks.len();
    c.seq = vec![seq];
    c.host_cache_v = Some((0..8u8).flat_map(|r| [r + 100; ITEM]).collect());
    c.device_buffer_v = Some(vec![0xDD; 12 * ITEM]);
    c
}

#[test]
fn block_queries_resolve_each_blocks_tokens() {
    // seq_len 8: block 2 = tokens 4 (hit, slot 1) and 5 (hit, slot 3); block
    // 3 = tokens 6 (miss) and 7 (the newest, reserved slot).
    let c = block_example(&[2, 3], 8);
    let after = cpu(&c);
    assert_eq!(after.report, None);
    assert_eq!(after.out, vec![7, 5, 9, 11]);
    assert_eq!(after.tokens, vec![6, 4, 2, 5, 7]);
    assert_eq!(
        after.lru,
        vec![2, 0, 1, 3],
        "unused evictable 2, loaded 0, hits 1 and 3"
    );
    assert_eq!(&after.device_buffer[9 * ITEM..][..ITEM], &[6u8; ITEM]);
    assert_eq!(
        &after.device_buffer_v.as_ref().unwrap()[9 * ITEM..][..ITEM],
        &[106u8; ITEM],
        "V moves with K"
    );
    assert_eq!(after, c.expected());
    assert_eq!(after, c.sglang(-1));

    // A -1 block is padding.
    let c = block_example(&[-1, 2], 8);
    let after = cpu(&c);
    assert_eq!(
        (after.out.clone(), after.report.clone()),
        (vec![-1, -1, 7, 5], None)
    );
    assert_eq!(after, c.sglang(-1));

    // seq_len 7: block 3's first token is the newest, its second is past the
    // sequence (-1, nothing reported); a block id below -1 is refused.
    let c = block_example(&[3, -4], 7);
    let after = cpu(&c);
    assert_eq!(after.out, vec![11, -1, -1, -1]);
    let r = after.report.clone().expect("the bad block is reported");
    assert_eq!(r.count, 1, "{r}");
    assert!(r.to_string().contains("top_k_tokens[0][1] = -4"), "{r}");
    assert_eq!(after, c.expected());
}

#[test]
fn page_padded_items_move_value_and_scale() {
    // DeepSeek-V4's C4 layout: rows 64 to a page, the 576 B values first,
    // then the 8 B scales.
    let layout = ItemLayout::dsv4_c4();
    let mut c = worked_example(&[6]);
    c.layout = layout;
    let page = layout.page_bytes() as usize;
    c.host_cache = (0..page).map(|i| (i % 251) as u8).collect();
    c.device_buffer = vec![0xEE; page];
    let after = cpu(&c);
    assert_eq!(after.out, vec![9]);
    assert_eq!(
        item_bytes(&layout, &after.device_buffer, 9),
        item_bytes(&layout, &c.host_cache, 6)
    );
    let mut untouched = after.device_buffer.clone();
    for (at, len) in layout.pieces(9) {
        untouched[at as usize..][..len].fill(0xEE);
    }
    assert!(
        untouched.iter().all(|&b| b == 0xEE),
        "only row 9's two pieces change"
    );
    assert_eq!(after, c.expected());
}

#[test]
fn replays_match_the_model() {
    for seed in 0..200 {
        let c = ReplayCase::random(seed, seed % 2 == 1);
        assert_eq!(c.run_cpu(), c.expected(), "{c:?}");
    }
}

#[test]
fn num_real_reqs_above_the_batch_makes_every_row_real() {
    // A sub-batch of a step whose num_real_reqs counts the whole step, as
    // SGLang reads it: nothing to report.
    let mut c = worked_example(&[4, 2, 7]);
    c.num_real = Some(5);
    let after = cpu(&c);
    assert_eq!(
        (after.out.clone(), after.report.clone()),
        (vec![7, 3, 11], None)
    );
    assert_eq!(after, c.sglang(-1));
    c.num_real = Some(-1);
    let r = cpu(&c).report.expect("a negative count is reported");
    assert!(
        r.to_string().contains("num_real_reqs[0] = -1 is negative"),
        "{r}"
    );
}

#[test]
fn a_miss_plan_stride_past_the_address_space_is_refused() {
    // Two rows at a stride of half the address space: the plan's byte span
    // does not fit 64 bits, and the check says so instead of overflowing.
    let engine = SwapInEngine::new(Executor::cpu()).unwrap();
    let mut b = Bare::new();
    let topk = [4, 2, 7, 4, 2, 7];
    let (req, seq) = ([0i32, 0], [8i32, 8]);
    let mut out = [0i32; 6];
    let (mut src, mut dst, mut count) = ([0i64; 6], [0i32; 6], [0i32; 2]);
    let mut args = b.args();
    args.top_k_tokens = Buf::host(&topk);
    args.req_pool_indices = IndexBuf::I32(Buf::host(&req));
    args.seq_lens = IndexBuf::I32(Buf::host(&seq));
    args.top_k_device_locs = BufMut::host(&mut out);
    args.miss_plan = Some(MissPlan {
        src: BufMut::host(&mut src),
        dst: BufMut::host(&mut dst),
        stride: usize::MAX / 2,
        capacity: 3,
        count: BufMut::host(&mut count),
    });
    match engine.run(&args, Stream::null()) {
        Err(Error::InvalidArgument { arg, msg }) => {
            assert_eq!(arg, "miss_src", "{msg}");
            assert!(msg.contains("holds 6 elements"), "{msg}");
        }
        other => panic!("expected an argument error, got {other:?}"),
    }
    assert_eq!(count, [0, 0], "nothing ran");
}

/// Counters accumulate per layer over calls, on the layer each call names;
/// a call naming no layer counts nothing, and a layer past the table is
/// refused before anything runs.
#[test]
fn counters_accumulate_per_layer_and_refuse_a_layer_past_the_table() {
    let counted = |case: &SwapCase| case.expected().counters.unwrap();
    // a clean case that hits and misses, a hostile one with bad indices
    let a = (0..)
        .map(|seed| SwapCase::random(seed, SWAP_SMALL, CLEAN, Some(2)))
        .find(|c| counted(c).misses > 0 && counted(c).hits > 0)
        .unwrap();
    let b = (0..)
        .map(|seed| SwapCase::random(seed, SWAP_SMALL, HOSTILE, None))
        .find(|c| counted(c).bad_indices > 0 && counted(c).misses > 0)
        .unwrap();
    let mut engine = SwapInEngine::new(Executor::cpu()).unwrap();
    engine.reserve(64, 64).unwrap();
    assert_eq!(
        engine.counters().unwrap(),
        None,
        "nothing counted before enable_counters"
    );
    engine.enable_counters(3).unwrap();
    let run = |engine: &SwapInEngine, case: &SwapCase, layer: Option<u32>| {
        let mut s = case.host_state();
        let mut args = case.host_args(&mut s, SwapOptions::default());
        args.layer = layer;
        engine.run(&args, Stream::null())
    };
    let _ = run(&engine, &a, Some(0));
    let _ = run(&engine, &b, Some(2));
    let _ = run(&engine, &a, Some(0));
    let _ = run(&engine, &b, None);
    let e = run(&engine, &a, Some(3)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { arg: "layer", .. }),
        "{e}"
    );
    let got = engine.counters().unwrap().unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(got[0], counted(&a).sum(&counted(&a)));
    assert_eq!(got[1], SwapInCounters::default());
    assert_eq!(got[2], counted(&b));
    assert_eq!(
        engine.poll_counters().unwrap().unwrap(),
        got,
        "the CPU executor's poll is exact"
    );
    // again with no more layers keeps the counts; more, or none, is refused
    engine.enable_counters(2).unwrap();
    assert_eq!(engine.counters().unwrap().unwrap(), got);
    for layers in [0, 4, kvtier::swap_in::MAX_COUNTED_LAYERS + 1] {
        assert!(engine.enable_counters(layers).is_err(), "{layers}");
    }
    let hits = got[0].hits as f64;
    assert_eq!(
        got[0].hit_rate(),
        Some(hits / (hits + got[0].misses as f64))
    );
    assert_eq!(got[1].hit_rate(), None);
}
