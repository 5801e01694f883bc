//! Top-k gather on the CPU executor: directed cases, argument validation,
//! and property tests against the model in tests/common.

mod common;

use common::*;
use kvtier::{
    BadIndex, BadIndexKind, Buf, BufMut, DeviceSpec, Error, Executor, GatherBatch,
    LayerFirstLayout, Pool, Stream, Tier,
};
use proptest::prelude::*;

const ENTRY: usize = 656;

/// Two regions of 3 layers × 64 tokens of 656 B, slots 0 and 1 bound to
/// them, slot 2 unbound.
fn two_requests() -> (Fixture, Tier) {
    let setup = Setup {
        layout: LayerFirstLayout::new(ENTRY as u32, 3, 64).unwrap(),
        n_regions: 2,
        bindings: vec![Some(0), Some(1), None],
    };
    setup.build(&Executor::cpu())
}

#[test]
fn gathers_the_selected_entries_of_each_request() {
    let (_fx, tier) = two_requests();
    let (slots, seq_lens) = ([1, 0], [40, 64]);
    let topk = [39, 0, 7, /* row 1 */ 63, 5, 5];
    let mut out = vec![0xEEu8; 6 * ENTRY];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq_lens), Buf::host(&topk), 3);
    tier.gather(2, &batch, BufMut::host(&mut out), Stream::null())
        .unwrap();
    let want: Vec<u8> = [(1, 39), (1, 0), (1, 7), (0, 63), (0, 5), (0, 5)]
        .iter()
        .flat_map(|&(region, token)| pattern_entry(region, 2, token, ENTRY))
        .collect();
    assert!(out == want, "output differs from the pool's entries");
}

#[test]
fn padding_rows_and_indices_are_zero_filled_silently() {
    let (_fx, tier) = two_requests();
    let (slots, seq_lens) = ([-1, 0], [i32::MAX, 10]); // a padding row's other fields are never read
    let topk = [12345, -7, /* row 1 */ -1, 9];
    let mut out = vec![0xEEu8; 4 * ENTRY];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq_lens), Buf::host(&topk), 2);
    tier.gather(0, &batch, BufMut::host(&mut out), Stream::null())
        .unwrap();
    assert!(out[..3 * ENTRY].iter().all(|&b| b == 0));
    assert_eq!(out[3 * ENTRY..], pattern_entry(0, 0, 9, ENTRY)[..]);
}

#[test]
fn bad_indices_are_zero_filled_and_reported_without_stopping_the_batch() {
    let (_fx, tier) = two_requests();
    let (slots, seq_lens) = ([0, 1], [10, 64]);
    // row 0: 10 is not < seq_len 10; -2 is below -1; row 1: fine
    let topk = [3, 10, -2, /* row 1 */ 1, 2, 63];
    let mut out = vec![0xEEu8; 6 * ENTRY];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq_lens), Buf::host(&topk), 3);
    let err = tier
        .gather(1, &batch, BufMut::host(&mut out), Stream::null())
        .unwrap_err();
    let Error::BadIndices(report) = &err else {
        panic!("{err}")
    };
    assert_eq!(report.count, 2);
    assert_eq!(
        report.first,
        vec![BadIndex {
            kind: BadIndexKind::GatherIndex,
            row: 0,
            col: 1,
            value: 10
        }]
    );
    assert!(
        err.to_string()
            .contains("topk[0][1] = 10 is outside [-1, seq_lens[0])"),
        "{err}"
    );
    assert_eq!(out[..ENTRY], pattern_entry(0, 1, 3, ENTRY)[..]);
    assert!(out[ENTRY..3 * ENTRY].iter().all(|&b| b == 0));
    let row1: Vec<u8> = [1, 2, 63]
        .iter()
        .flat_map(|&t| pattern_entry(1, 1, t, ENTRY))
        .collect();
    assert!(out[3 * ENTRY..] == row1[..]);
}

#[test]
fn bad_slots_and_lengths_refuse_the_whole_row() {
    let (_fx, tier) = two_requests();
    let (slots, seq_lens) = ([2, 7, 0, -5], [1, 1, 65, 1]); // unbound, beyond the table, too long, below -1
    let topk = [0; 4];
    let mut out = vec![0xEEu8; 4 * ENTRY];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq_lens), Buf::host(&topk), 1);
    let Err(Error::BadIndices(r)) = tier.gather(0, &batch, BufMut::host(&mut out), Stream::null())
    else {
        panic!("bad rows not reported")
    };
    assert!(out.iter().all(|&b| b == 0));
    assert_eq!(r.count, 4);
    assert_eq!(
        r.first,
        vec![
            BadIndex {
                kind: BadIndexKind::GatherSlot,
                row: 0,
                col: 0,
                value: 2
            },
            BadIndex {
                kind: BadIndexKind::GatherSeqLen,
                row: 2,
                col: 0,
                value: 65
            },
        ]
    );
}

#[test]
fn strided_topk_reads_only_the_first_k_columns() {
    let (_fx, tier) = two_requests();
    let (slots, seq_lens) = ([0, 1], [64, 64]);
    let topk = [4, 5, i32::MIN, /* row 1 */ 6, 7, i32::MIN];
    let mut out = vec![0u8; 4 * ENTRY];
    let batch = GatherBatch {
        topk_stride: 3,
        ..GatherBatch::new(Buf::host(&slots), Buf::host(&seq_lens), Buf::host(&topk), 2)
    };
    tier.gather(0, &batch, BufMut::host(&mut out), Stream::null())
        .unwrap();
    let want: Vec<u8> = [(0, 4), (0, 5), (1, 6), (1, 7)]
        .iter()
        .flat_map(|&(r, t)| pattern_entry(r, 0, t, ENTRY))
        .collect();
    assert!(out == want);
}

#[test]
fn empty_batches_do_nothing() {
    let (_fx, tier) = two_requests();
    let none: [i32; 0] = [];
    let batch = GatherBatch::new(Buf::host(&none), Buf::host(&none), Buf::host(&none), 2048);
    tier.gather(0, &batch, BufMut::host(&mut []), Stream::null())
        .unwrap();
    let (slots, seq) = ([0], [5]);
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&none), 0);
    tier.gather(0, &batch, BufMut::host(&mut []), Stream::null())
        .unwrap();
}

fn argument_error(res: kvtier::Result<()>) -> (&'static str, String) {
    match res {
        Err(Error::InvalidArgument { arg, msg }) => (arg, msg),
        other => panic!("expected an argument error, got {other:?}"),
    }
}

#[test]
fn arguments_are_checked_before_anything_runs() {
    let (_fx, tier) = two_requests();
    let (slots, seq) = ([0, 1], [64, 64]);
    let topk = [0i32; 4];
    let mut out = vec![0u8; 4 * ENTRY];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&topk), 2);
    let go = |layer, b: &GatherBatch<'_>, out: &mut [u8]| {
        tier.gather(layer, b, BufMut::host(out), Stream::null())
    };

    assert_eq!(argument_error(go(3, &batch, &mut out)).0, "layer");
    assert_eq!(
        argument_error(go(0, &batch, &mut out[..4 * ENTRY - 8])).0,
        "out"
    );
    let (arg, msg) = argument_error(go(0, &batch, &mut out[4..4 + 3 * ENTRY]));
    assert_eq!(arg, "out");
    assert!(msg.contains("8-byte aligned"), "{msg}");
    let short = GatherBatch::new(Buf::host(&slots), Buf::host(&seq[..1]), Buf::host(&topk), 2);
    assert_eq!(argument_error(go(0, &short, &mut out)).0, "seq_lens");
    let short = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&topk[..3]), 2);
    assert_eq!(argument_error(go(0, &short, &mut out)).0, "topk");
    let narrow = GatherBatch {
        topk_stride: 1,
        ..batch
    };
    assert_eq!(argument_error(go(0, &narrow, &mut out)).0, "topk_stride");
    // device memory handed to the CPU executor
    let dev_topk = unsafe { Buf::<i32>::device(0x1000, 4) };
    let wrong = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), dev_topk, 2);
    let (arg, msg) = argument_error(go(0, &wrong, &mut out));
    assert_eq!(arg, "topk");
    assert!(msg.contains("CPU executor reads host memory"), "{msg}");
    assert!(out.iter().all(|&b| b == 0), "a refused call wrote output");
}

#[test]
fn slot_binding_is_checked() {
    let (fx, mut tier) = two_requests();
    let err = tier
        .bind_slot(3, &fx.regions[0], Stream::null())
        .unwrap_err();
    assert!(
        err.to_string().contains("beyond the tier's 3 slots"),
        "{err}"
    );
    let other = Pool::create(
        LayerFirstLayout::new(8, 1, 8).unwrap(),
        DeviceSpec::Anon { bytes: 4 << 20 },
    )
    .unwrap();
    let foreign = other.alloc_region().unwrap();
    assert!(tier.bind_slot(0, &foreign, Stream::null()).is_err());
    // unbinding makes the slot's rows refused
    tier.unbind_slot(0, Stream::null()).unwrap();
    let (slots, seq, topk) = ([0], [1], [0]);
    let mut out = vec![0u8; ENTRY];
    let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&topk), 1);
    let Err(Error::BadIndices(r)) = tier.gather(0, &batch, BufMut::host(&mut out), Stream::null())
    else {
        panic!("unbound slot not reported")
    };
    assert!(r.has(BadIndexKind::GatherSlot));
}

fn check_against_model(case: &GatherCase) {
    let (want_out, want_err) = case.expected();
    let (out, res) = case.run(&Executor::cpu());
    assert!(
        out == want_out,
        "output differs from the model for {case:?}"
    );
    assert_eq!(reported(&res), expected_report(&want_err), "{case:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn clean_batches_match_the_model(seed in any::<u64>()) {
        let case = GatherCase::random(seed, SMALL, CLEAN);
        check_against_model(&case);
        prop_assert!(case.expected().1.is_clear());
    }

    #[test]
    fn padded_batches_match_the_model(seed in any::<u64>()) {
        check_against_model(&GatherCase::random(seed, SMALL, PADDED));
    }

    #[test]
    fn hostile_batches_match_the_model(seed in any::<u64>()) {
        check_against_model(&GatherCase::random(seed, SMALL, HOSTILE));
    }
}
