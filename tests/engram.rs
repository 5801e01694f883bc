//! The Engram gather on the CPU executor against an independent model of
//! SGLang's arithmetic, on every byte pair, random tables and hostile input.

#[path = "common/engram.rs"]
mod engram_model;

use engram_model::{EngramCase, aligned8, cases, model_value};
use kvtier::engram::{EngramArgs, EngramGatherer};
use kvtier::{Buf, BufMut, Error, Executor, IndexBuf, Stream};

#[test]
fn every_e4m3_byte_times_every_e8m0_byte_is_the_models_bf16() {
    // 256 rows: row e has scale byte e (one block per row) and the weight
    // bytes 0..=255, so the table holds every (weight, scale) pair
    let weights: Vec<u8> = (0..256 * 256).map(|i| (i % 256) as u8).collect();
    let scales: Vec<u8> = (0..=255u8).collect();
    let case = EngramCase {
        dim: 256,
        block: 256,
        rows: 256,
        weights,
        scales,
        ids: (0..256).collect(),
        ids_int64: false,
        row_lo: 0,
        row_hi: 256,
        out_rows: None,
    };
    let (out, r) = case.run_cpu();
    r.unwrap();
    for e in 0..256usize {
        for w in 0..256usize {
            assert_eq!(
                out[e * 256 + w],
                model_value(w as u8, e as u8),
                "e4m3 {w:#04x} x e8m0 {e}"
            );
        }
    }
    // the named edges: -0 stays -0, NaN bytes are the canonical NaN, scale
    // 0 is 2^-127 (not zero), 255 is +inf (0 x inf is NaN)
    assert_eq!(out[127 * 256 + 0x80], 0x8000);
    assert_eq!(out[127 * 256 + 0x7F], 0x7FFF);
    assert_eq!(out[127 * 256 + 0xFF], 0x7FFF);
    assert_eq!(out[127 * 256 + 0x38], 0x3F80); // 1.0 x 2^0
    assert_ne!(out[0x38], 0); // 1.0 x 2^-127: a bf16 subnormal, not flushed
    assert_eq!(out[255 * 256 + 0x38], 0x7F80); // +inf
    assert_eq!(out[255 * 256], 0x7FFF); // 0 x inf
}

#[test]
fn random_tables_and_ids_match_the_model_and_ids_past_the_table_are_reported() {
    for hostile in [false, true] {
        for case in cases(150, hostile) {
            let (out, r) = case.run_cpu();
            let (want, bad) = case.expected();
            assert!(out == want, "output differs from the model for {case:?}");
            // the report keeps the lowest position of each kind
            match (bad.iter().min_by_key(|b| b.0), r) {
                (None, Ok(())) => {}
                (Some(&(pos, id)), Err(Error::BadIndices(rep))) => {
                    assert_eq!(rep.count as usize, bad.len(), "{case:?}");
                    // named for what it is: ids[i], the id (clamped to i32)
                    let first = rep.first.first().expect("an entry");
                    assert_eq!(
                        (first.kind, first.row, first.value),
                        (
                            kvtier::error_word::BadIndexKind::EngramId,
                            pos,
                            id.clamp(i32::MIN as i64, i32::MAX as i64) as i32
                        ),
                        "{case:?}"
                    );
                    let text = Error::BadIndices(rep.clone()).to_string();
                    assert!(
                        text.contains(&format!("ids[{pos}] = ")) && text.contains("past the table"),
                        "{text}"
                    );
                }
                (b, r) => panic!("expected {b:?}, got {r:?} for {case:?}"),
            }
        }
    }
}

#[test]
fn bad_arguments_are_refused_before_anything_is_written() {
    let weights = aligned8(&[0x38u8; 64]);
    let w = &weights.0[weights.1..][..64];
    let scales = [127u8; 2];
    let ids = [0i32, 1];
    let g = EngramGatherer::new(Executor::cpu()).unwrap();
    let mut store = [0u16; 80];
    let skip = (16 - (store.as_ptr() as usize % 16)) % 16 / 2;
    let run = |dim: u32, block: u32, lo: i64, hi: i64, w: &[u8], out: &mut [u16]| {
        g.gather(
            &EngramArgs {
                weights: Buf::host(w),
                scales: Buf::host(&scales),
                ids: IndexBuf::I32(Buf::host(&ids)),
                out: BufMut::host(out),
                out_rows: None,
                dim,
                block,
                row_lo: lo,
                row_hi: hi,
            },
            Stream::null(),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };
    let ok = run(32, 32, 0, 2, w, &mut store[skip..skip + 64]);
    assert_eq!(ok, "");
    for (dim, block, lo, hi, want) in [
        (24, 8, 0, 2, "power of two"),
        (4, 4, 0, 2, "power of two"),
        (32, 5, 0, 2, "does not divide"),
        (32, 0, 0, 2, "does not divide"),
        (32, 32, -1, 2, "row_lo"),
        (32, 32, 5, 2, "row_lo"),
        (64, 64, 0, 2, "whole rows"),
    ] {
        let e = run(dim, block, lo, hi, &w[..48], &mut store[skip..skip + 64]);
        assert!(e.contains(want), "dim {dim} block {block}: {e}");
    }
    // scales too short for the rows
    let e = run(32, 8, 0, 2, w, &mut store[skip..skip + 64]);
    assert!(e.contains("scales"), "{e}");
    // misaligned output, output too short
    let e = run(32, 32, 0, 2, w, &mut store[skip + 1..skip + 65]);
    assert!(e.contains("out") && e.contains("aligned"), "{e}");
    let e = run(32, 32, 0, 2, w, &mut store[skip..skip + 63]);
    assert!(e.contains("out"), "{e}");
    // misaligned weights
    let e = run(
        32,
        32,
        0,
        2,
        &weights.0[weights.1 + 1..][..64],
        &mut store[skip..skip + 64],
    );
    assert!(e.contains("weights") && e.contains("aligned"), "{e}");
}
