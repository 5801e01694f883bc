//! Layer-first writeback on the CPU executor: directed cases, argument
//! validation, round trips through gather, and property tests against the
//! model in tests/common.

mod common;

use common::*;
use kvtier::{
    BadIndex, BadIndexKind, Buf, BufMut, Error, Executor, GatherBatch, LayerFirstLayout, Stream,
    Tier, WritebackItems,
};
use proptest::prelude::*;

const ENTRY: usize = 584; // odd multiple of 8: entries alternate between 0 and 8 mod 16

fn setup() -> (Fixture, Tier) {
    let setup = Setup {
        layout: LayerFirstLayout::new(ENTRY as u32, 4, 32).unwrap(),
        n_regions: 3,
        bindings: vec![Some(2), Some(0), None, Some(1)],
    };
    setup.build(&Executor::cpu())
}

fn rows(n: usize, seed: u8) -> Vec<u8> {
    (0..n * ENTRY)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn entry_of(fx: &Fixture, region: usize, layer: u32, token: u32) -> Vec<u8> {
    let mut e = vec![0u8; ENTRY];
    fx.pool
        .read_tokens(&fx.regions[region], layer, token, &mut e)
        .unwrap();
    e
}

#[test]
fn one_layer_lands_at_pool_request_layer_token() {
    let (fx, tier) = setup();
    let src = rows(5, 1);
    let (slots, tokens, src_rows) = ([0, 3, 1], [31, 0, 17], [4i64, 0, 2]);
    let items = WritebackItems {
        slots: Buf::host(&slots),
        tokens: Buf::host(&tokens),
        src_rows: Buf::host(&src_rows),
    };
    tier.writeback_layer(2, &items, Buf::host(&src), Stream::null())
        .unwrap();
    assert_eq!(entry_of(&fx, 2, 2, 31), src[4 * ENTRY..5 * ENTRY]);
    assert_eq!(entry_of(&fx, 1, 2, 0), src[..ENTRY]);
    assert_eq!(entry_of(&fx, 0, 2, 17), src[2 * ENTRY..3 * ENTRY]);
    // neighbours and other layers untouched
    assert_eq!(entry_of(&fx, 2, 2, 30), pattern_entry(2, 2, 30, ENTRY));
    assert_eq!(entry_of(&fx, 2, 1, 31), pattern_entry(2, 1, 31, ENTRY));
    assert_eq!(entry_of(&fx, 2, 3, 31), pattern_entry(2, 3, 31, ENTRY));
}

#[test]
fn decode_token_goes_to_every_layer_in_one_call() {
    let (fx, tier) = setup();
    let layers: Vec<Vec<u8>> = (0..4).map(|l| rows(3, 10 + l)).collect();
    let bufs: Vec<Buf<u8>> = layers.iter().map(|b| Buf::host(b)).collect();
    let kv = tier.register_kv_layers(&bufs).unwrap();
    assert_eq!((kv.layers(), kv.rows()), (4, 3));
    // the newest token of two requests, plus a padding row
    let (slots, tokens, src_rows) = ([1, -1, 0], [9, 0, 20], [2i64, 77, 0]);
    let items = WritebackItems {
        slots: Buf::host(&slots),
        tokens: Buf::host(&tokens),
        src_rows: Buf::host(&src_rows),
    };
    tier.writeback_all_layers(&items, &kv, Stream::null())
        .unwrap();
    for l in 0..4u32 {
        let src = &layers[l as usize];
        assert_eq!(
            entry_of(&fx, 0, l, 9),
            src[2 * ENTRY..3 * ENTRY],
            "layer {l}"
        );
        assert_eq!(entry_of(&fx, 2, l, 20), src[..ENTRY], "layer {l}");
    }
}

#[test]
fn written_entries_gather_back_unchanged() {
    let (_fx, tier) = setup();
    let src = rows(4, 99);
    let (slots, tokens, src_rows) = ([3, 3, 3, 3], [0, 1, 2, 3], [3i64, 2, 1, 0]);
    let items = WritebackItems {
        slots: Buf::host(&slots),
        tokens: Buf::host(&tokens),
        src_rows: Buf::host(&src_rows),
    };
    tier.writeback_layer(1, &items, Buf::host(&src), Stream::null())
        .unwrap();
    let (req, seq, topk) = ([3], [4], [3, 2, 1, 0]);
    let mut out = vec![0u8; 4 * ENTRY];
    let batch = GatherBatch::new(Buf::host(&req), Buf::host(&seq), Buf::host(&topk), 4);
    tier.gather(1, &batch, BufMut::host(&mut out), Stream::null())
        .unwrap();
    assert!(
        out == src,
        "gathering tokens 3,2,1,0 returns source rows 0,1,2,3"
    );
}

#[test]
fn bad_items_are_skipped_and_reported() {
    let (fx, tier) = setup();
    let src = rows(2, 5);
    // ok, unbound slot, token past capacity, negative source row, source row past the end
    let (slots, tokens, src_rows) = (
        [0, 2, 0, 0, 0],
        [1, 1, 32, 2, 3],
        [0i64, 0, 0, -1, i64::MAX],
    );
    let items = WritebackItems {
        slots: Buf::host(&slots),
        tokens: Buf::host(&tokens),
        src_rows: Buf::host(&src_rows),
    };
    let err = tier
        .writeback_layer(0, &items, Buf::host(&src), Stream::null())
        .unwrap_err();
    let Error::BadIndices(r) = &err else {
        panic!("{err}")
    };
    assert_eq!(r.count, 4);
    assert_eq!(
        r.first,
        vec![
            BadIndex {
                kind: BadIndexKind::WritebackSlot,
                row: 1,
                col: 0,
                value: 2
            },
            BadIndex {
                kind: BadIndexKind::WritebackToken,
                row: 2,
                col: 0,
                value: 32
            },
            BadIndex {
                kind: BadIndexKind::WritebackSrcRow,
                row: 3,
                col: 0,
                value: -1
            },
        ]
    );
    assert_eq!(
        entry_of(&fx, 2, 0, 1),
        src[..ENTRY],
        "the good item still landed"
    );
    for t in [2, 3] {
        assert_eq!(
            entry_of(&fx, 2, 0, t),
            pattern_entry(2, 0, t, ENTRY),
            "token {t} untouched"
        );
    }
}

fn argument_error(res: kvtier::Result<impl std::fmt::Debug>) -> &'static str {
    match res {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected an argument error, got {other:?}"),
    }
}

#[test]
fn arguments_are_checked_before_anything_runs() {
    let (fx, tier) = setup();
    let src = rows(2, 0);
    let (slots, tokens, src_rows) = ([0, 1], [0, 0], [0i64, 1]);
    let items = WritebackItems {
        slots: Buf::host(&slots),
        tokens: Buf::host(&tokens),
        src_rows: Buf::host(&src_rows),
    };
    assert_eq!(
        argument_error(tier.writeback_layer(4, &items, Buf::host(&src), Stream::null())),
        "layer"
    );
    assert_eq!(
        argument_error(tier.writeback_layer(
            0,
            &items,
            Buf::host(&src[..ENTRY - 8]),
            Stream::null()
        )),
        "src"
    );
    let src_words = vec![0u64; 2 * ENTRY / 8 + 1];
    let src_bytes: &[u8] =
        unsafe { std::slice::from_raw_parts(src_words.as_ptr() as *const u8, 2 * ENTRY + 8) };
    assert_eq!(
        argument_error(tier.writeback_layer(0, &items, Buf::host(&src_bytes[4..]), Stream::null())),
        "src",
        "a 4-byte-aligned source is refused"
    );
    let short = WritebackItems {
        tokens: Buf::host(&tokens[..1]),
        ..items
    };
    assert_eq!(
        argument_error(tier.writeback_layer(0, &short, Buf::host(&src), Stream::null())),
        "tokens"
    );
    let short = WritebackItems {
        src_rows: Buf::host(&src_rows[..1]),
        ..items
    };
    assert_eq!(
        argument_error(tier.writeback_layer(0, &short, Buf::host(&src), Stream::null())),
        "src_rows"
    );

    let layers: Vec<Vec<u8>> = (0..4).map(|_| rows(2, 0)).collect();
    let three: Vec<Buf<u8>> = layers[..3].iter().map(|b| Buf::host(b)).collect();
    assert_eq!(argument_error(tier.register_kv_layers(&three)), "layers");
    let mut uneven: Vec<Buf<u8>> = layers.iter().map(|b| Buf::host(b)).collect();
    uneven[2] = Buf::host(&layers[2][..ENTRY]);
    assert_eq!(argument_error(tier.register_kv_layers(&uneven)), "layers");
    let (_fx2, other) = self::setup();
    let all: Vec<Buf<u8>> = layers.iter().map(|b| Buf::host(b)).collect();
    let kv = other.register_kv_layers(&all).unwrap();
    assert_eq!(
        argument_error(tier.writeback_all_layers(&items, &kv, Stream::null())),
        "kv"
    );
    assert_eq!(
        pool_contents(&fx),
        pristine(&fx),
        "a refused call wrote the pool"
    );
}

/// The pattern contents of a fixture's regions.
fn pristine(fx: &Fixture) -> Vec<Vec<u8>> {
    let l = fx.pool.layout();
    fx.regions
        .iter()
        .map(|r| {
            (0..l.layers())
                .flat_map(|layer| {
                    (0..l.tokens_per_region())
                        .flat_map(move |t| pattern_entry(r.index(), layer, t, ENTRY))
                })
                .collect()
        })
        .collect()
}

fn check_against_model(case: &WritebackCase) {
    let (want_pool, want_err) = case.expected();
    let (pool, res) = case.run(&Executor::cpu());
    assert!(
        pool == want_pool,
        "pool differs from the model for {case:?}"
    );
    assert_eq!(reported(&res), expected_report(&want_err), "{case:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn clean_writebacks_match_the_model(seed in any::<u64>()) {
        let case = WritebackCase::random(seed, SMALL, CLEAN, false);
        check_against_model(&case);
        prop_assert!(case.expected().1.is_clear());
    }

    #[test]
    fn hostile_writebacks_match_the_model(seed in any::<u64>()) {
        check_against_model(&WritebackCase::random(seed, SMALL, HOSTILE, false));
    }
}
