//! Top-k traces: the format read back as written, bad files reported by
//! line and never trusted, a synthetic trace's replay against the same calls
//! run as batches on one engine, and the replay's checks.

use kvtier::trace::{
    RowState, SynthSpec, Trace, TraceCall, TraceHeader, TraceRow, replay, synthesize,
};
use kvtier::{
    Buf, BufMut, Executor, IndexBuf, KvBuffers, QueryKind, Stream, SwapInArgs, SwapInCounters,
    SwapInEngine,
};

fn spec() -> SynthSpec {
    SynthSpec {
        requests: 3,
        layers: 2,
        steps: 12,
        context: 300,
        top_k: 48,
        hot: 96,
        overlap: 0.75,
        run_len: 4,
        recent: 8,
        seed: 5,
        warmup_steps: 0,
        block_tokens: 0,
        item_bytes: 0,
        outcomes: false,
        provenance: String::new(),
        index_topk_freq: 1,
    }
}

fn read(text: &str) -> kvtier::Result<Trace> {
    Trace::read(std::io::Cursor::new(text.as_bytes()))
}

#[test]
fn a_trace_reads_back_as_written() {
    let mut t = synthesize(&spec()).unwrap();
    assert!(t.header.synthetic && t.header.note.contains("not a measurement"));
    t.calls[0].rows[0].state = Some(RowState {
        tokens: (0..96)
            .map(|i| if i % 3 == 0 { -1 } else { i * 2 })
            .collect(),
        lru: (0..96i16).rev().collect(),
    });
    let mut bytes = Vec::new();
    t.write(&mut bytes).unwrap();
    assert_eq!(Trace::read(std::io::Cursor::new(bytes)).unwrap(), t);
    assert_eq!(t.layers(), 2);
    assert_eq!(t.calls.len(), 24);
    assert_eq!(
        synthesize(&spec()).unwrap(),
        synthesize(&spec()).unwrap(),
        "a seed gives one trace"
    );
}

#[test]
fn a_bad_trace_is_reported_by_line() {
    let header = r#"{"kvtier_trace": 1, "hot": 4}"#;
    let row = |r: &str| format!("{header}\n{{\"layer\": 0, \"rows\": [{r}]}}\n");
    for (text, says) in [
        (String::new(), "empty"),
        ("not json".into(), "line 1"),
        (r#"{"kvtier_trace": 2, "hot": 4}"#.into(), "version 1"),
        (r#"{"kvtier_trace": 1, "hot": 0}"#.into(), "`hot` is 0"),
        (r#"{"kvtier_trace": 1, "hot": 99999999}"#.into(), "`hot`"),
        (format!("{header}\n{{\"layer\": 0}}\n"), "line 2: `rows`"),
        (
            format!("{header}\n{{\"layer\": 9999, \"rows\": []}}\n"),
            "`layer`",
        ),
        (
            format!("{header}\n[1,2\n{{\"layer\": 0, \"rows\": []}}\n"),
            "line 2: not JSON",
        ),
        (row(r#"{"req": 0, "seq": 5, "topk": []}"#), "a query of 0"),
        (row(r#"{"req": -1, "seq": 5, "topk": [1]}"#), "`req`"),
        (row(r#"{"req": 0, "seq": 5, "topk": [1, "x"]}"#), "`topk`"),
        (
            row(r#"{"req": 0, "seq": 5, "topk": [3000000000]}"#),
            "`topk`",
        ),
        (
            row(r#"{"req": 0, "seq": 5, "topk": [1], "state": {"tokens": [1], "lru": [0]}}"#),
            "4 slots",
        ),
        (
            row(
                r#"{"req": 0, "seq": 5, "topk": [1], "state": {"tokens": [1,2,3,4], "lru": [0,1,2,70000]}}"#,
            ),
            "`lru`",
        ),
        (
            row(&format!(
                r#"{{"req": 0, "seq": 5, "topk": [{}]}}"#,
                vec!["1"; 5000].join(",")
            )),
            "5000 columns",
        ),
    ] {
        let e = read(&text).unwrap_err().to_string();
        assert!(e.contains(says), "{text:?}: {e}");
    }
}

/// The synthetic calls run as batches (every request row of a call at once)
/// on one engine whose state persists, from empty hot buffers.
fn batched(t: &Trace, hot: u32) -> Vec<SwapInCounters> {
    let h = hot as usize;
    let r = t
        .calls
        .iter()
        .flat_map(|c| &c.rows)
        .map(|x| x.req)
        .max()
        .unwrap() as usize
        + 1;
    let max_seq = t
        .calls
        .iter()
        .flat_map(|c| &c.rows)
        .map(|x| x.seq)
        .max()
        .unwrap() as usize;
    let mut engine = SwapInEngine::new(Executor::cpu()).unwrap();
    engine.reserve(r as u32, 64).unwrap();
    engine.enable_counters(t.layers()).unwrap();
    let mut state: Vec<(Vec<i32>, Vec<i16>)> = (0..t.layers())
        .map(|_| {
            (
                vec![-1; r * h],
                (0..r).flat_map(|_| 0..hot as i16).collect(),
            )
        })
        .collect();
    let locs: Vec<i32> = (0..(r * (h + 1)) as i32).collect();
    let host_locs: Vec<i64> = (0..r).flat_map(|_| 0..max_seq as i64).collect();
    let host = vec![0u8; max_seq * 8];
    let mut dev = vec![0u8; r * (h + 1) * 8];
    for c in &t.calls {
        let k = c.rows[0].topk.len();
        let topk: Vec<i32> = c.rows.iter().flat_map(|x| x.topk.clone()).collect();
        let req: Vec<i32> = c.rows.iter().map(|x| x.req as i32).collect();
        let seq: Vec<i32> = c.rows.iter().map(|x| x.seq as i32).collect();
        let mut out = vec![0i32; c.rows.len() * k];
        let (tokens, lru) = &mut state[c.layer as usize];
        let args = SwapInArgs {
            top_k_tokens: Buf::host(&topk),
            top_k_stride: k,
            query: QueryKind::Tokens,
            device_buffer_tokens: BufMut::host(tokens),
            tokens_stride: h,
            device_buffer_locs: Buf::host(&locs),
            locs_stride: h + 1,
            lru_slots: BufMut::host(lru),
            lru_stride: h,
            host_cache_locs: Buf::host(&host_locs),
            host_stride: max_seq,
            max_tokens: max_seq as u32,
            kv: KvBuffers::linear(8, Buf::host(&host), BufMut::host(&mut dev)).unwrap(),
            top_k_device_locs: BufMut::host(&mut out),
            out_stride: k,
            req_pool_indices: IndexBuf::I32(Buf::host(&req)),
            seq_lens: IndexBuf::I32(Buf::host(&seq)),
            num_real_reqs: None,
            num_requests: r as u32,
            num_top_k: k as u32,
            hot_buffer_size: hot,
            skip_io: true,
            layer: Some(c.layer),
            miss_plan: None,
        };
        engine.run(&args, Stream::null()).unwrap();
    }
    engine.counters().unwrap().unwrap()
}

#[test]
fn a_replay_row_by_row_counts_what_the_batched_calls_count() {
    let t = synthesize(&spec()).unwrap();
    for hot in [48, 96, 200] {
        let replayed = replay(&t, hot).unwrap();
        let ran = batched(&t, hot);
        assert_eq!(replayed, ran, "HOT {hot}");
        assert!(
            ran.iter()
                .all(|c| c.misses > 0 && c.hits > 0 && c.calls == 12 && c.rows == 36),
            "{ran:?}"
        );
    }
    // more slots never miss more here (the LRU keeps a superset)
    let misses = |hot| {
        replay(&t, hot)
            .unwrap()
            .iter()
            .map(|c| c.misses)
            .sum::<u64>()
    };
    assert!(misses(48) >= misses(96) && misses(96) >= misses(200));
}

#[test]
fn a_recorded_state_is_used_at_its_size_and_fitted_at_others() {
    // one request, long from the start: its first call names tokens 10 and
    // 11, which the recorded state holds (10 most recently used)
    let header = TraceHeader {
        hot: 4,
        block_tokens: 0,
        item_bytes: 656,
        synthetic: false,
        note: String::new(),
        truncated: false,
        warmup_steps: 0,
        index_topk_freq: 1,
        layers: 0,
    };
    let state = RowState {
        tokens: vec![11, 10, 3, -1],
        lru: vec![3, 2, 0, 1],
    };
    let call = |topk: Vec<i32>, seq, state| TraceCall {
        layer: 0,
        rows: vec![TraceRow {
            req: 7,
            seq,
            topk,
            state,
            misses: None,
        }],
    };
    let t = Trace {
        header,
        calls: vec![
            call(vec![10, 11], 20, Some(state)),
            call(vec![10, 12], 21, None),
        ],
    };
    // at 4: both hit, then 10 hits and 12 misses
    let c = replay(&t, 4).unwrap()[0];
    assert_eq!(
        (c.calls, c.rows, c.hits, c.misses, c.bytes),
        (2, 2, 3, 1, 656)
    );
    // a query of 2 entries does not fit 1 slot: refused up front
    assert!(
        replay(&t, 1)
            .unwrap_err()
            .to_string()
            .contains("cannot hold")
    );
    // at 2: 11 and 10 kept; both hit, then 10 hits and 12 misses
    let c = replay(&t, 2).unwrap()[0];
    assert_eq!((c.hits, c.misses), (3, 1));
    assert!(replay(&t, 0).is_err() && replay(&t, kvtier::swap_in::MAX_HOT + 1).is_err());
}

#[test]
fn synth_refuses_what_it_cannot_make() {
    for bad in [
        SynthSpec {
            requests: 0,
            ..spec()
        },
        SynthSpec {
            top_k: 400,
            ..spec()
        },
        SynthSpec {
            overlap: 1.5,
            ..spec()
        },
        SynthSpec {
            recent: 49,
            ..spec()
        },
        SynthSpec {
            run_len: 0,
            ..spec()
        },
    ] {
        assert!(synthesize(&bad).is_err(), "{bad:?}");
    }
}

/// At another size a row's own replayed history wins over the states the
/// recorder took on the way (it takes one at every call while a request is
/// short at the recorded size): states after a row's first call change
/// nothing there, and they still rule at the recorded size.
#[test]
fn at_another_size_a_rows_history_continues_past_recorded_states() {
    let synth = synthesize(&spec()).unwrap();
    let state = |seq: u32| RowState {
        tokens: (0..400)
            .map(|t| if t < seq as i32 { t } else { -1 })
            .collect(),
        lru: (0..400i16).collect(),
    };
    let recorded = |every_call: bool| {
        let mut t = synth.clone();
        t.header.hot = 400; // a size above the context: short throughout
        let mut first = std::collections::HashSet::new();
        for c in &mut t.calls {
            for r in &mut c.rows {
                let new = first.insert((c.layer, r.req));
                r.state = (every_call || new).then(|| state(r.seq));
            }
        }
        t
    };
    let (all, once) = (recorded(true), recorded(false));
    for hot in [96, 200] {
        assert_eq!(
            replay(&all, hot).unwrap(),
            replay(&once, hot).unwrap(),
            "HOT {hot}"
        );
    }
    // at the recorded size the states are the truth: all short, all hits
    let c = replay(&all, 400).unwrap();
    assert!(c.iter().all(|c| c.misses == 0), "{c:?}");
}

/// A recording cut off mid-line (a server killed while it wrote) keeps the
/// calls before the cut and says it was cut; a broken line before the last
/// is still an error.
#[test]
fn a_cut_off_last_line_is_dropped_and_said() {
    let header = r#"{"kvtier_trace": 1, "hot": 4}"#;
    let call = r#"{"layer": 0, "rows": [{"req": 0, "seq": 9, "topk": [1, 2]}]}"#;
    let t = read(&format!("{header}\n{call}\n{{\"layer\": 0, \"ro")).unwrap();
    assert!(t.header.truncated && t.calls.len() == 1);
    assert!(
        !read(&format!("{header}\n{call}\n"))
            .unwrap()
            .header
            .truncated
    );
    let e = read(&format!("{header}\n{{\"layer\": 0, \"ro\n{call}\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 2: not JSON"), "{e}");
}
