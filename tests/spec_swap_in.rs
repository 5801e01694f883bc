//! The speculative swap-in through the Rust API on the CPU executor (the
//! Python package's tests run SGLang's own scenarios through the shim): the
//! cross-step deduplication, the miss plan, draft tokens without host I/O,
//! padding rows, the argument checks and the refusal of bad indices.

mod common;

use common::spec::*;
use kvtier::{Error, Executor, Stream, SwapInEngine};

fn engine() -> SwapInEngine {
    SwapInEngine::new(Executor::cpu()).unwrap()
}

fn sglang_case() -> SpecCase {
    SpecCase::new(1, 4096, 64, 4096, 16384, 4, 4, 2048)
}

#[test]
fn misses_are_deduplicated_across_steps_and_a_second_call_is_all_hits() {
    let mut c = sglang_case();
    let mut call = SpecCall::new(cross_step_misses(4096, 2048), 1, 4, 16384, true);
    engine()
        .run_spec(&c.args(&mut call), Stream::null())
        .unwrap();
    c.assert_outputs_hold(&call, |_| false);
    assert_eq!(c.misses(0), 782);
    assert_eq!(
        c.owned_rows(),
        SpecCase::new(1, 4096, 64, 4096, 16384, 4, 4, 2048).owned_rows()
    );
    let (src, dst, count) = call.plan.as_ref().unwrap();
    assert_eq!(count[0], 782);
    let mut hosts = src[..782].to_vec();
    hosts.sort();
    hosts.dedup();
    assert_eq!(hosts.len(), 782, "each unique miss copied once");
    assert!(dst[..782].iter().all(|&d| d >= 0));
    let mut again = SpecCall::new(cross_step_misses(4096, 2048), 1, 4, 16384, true);
    engine()
        .run_spec(&c.args(&mut again), Stream::null())
        .unwrap();
    c.assert_outputs_hold(&again, |_| false);
    assert_eq!((c.misses(0), again.plan.unwrap().2[0]), (0, 0));
}

#[test]
fn a_miss_every_step_asks_for_is_copied_once_and_rows_rotate_without_loss() {
    for scratch in [4096, 2048] {
        let mut c = SpecCase::new(1, 4096, 64, scratch, 16384, 2, 4, 2048);
        let rows = c.owned_rows();
        let step: Vec<i32> = (0..2048)
            .map(|i| if i % 2 == 0 { i } else { 8000 + i })
            .collect();
        let topk: Vec<i32> = (0..4).flat_map(|_| step.clone()).collect();
        let mut call = SpecCall::new(topk, 1, 4, 16384, true);
        engine()
            .run_spec(&c.args(&mut call), Stream::null())
            .unwrap();
        c.assert_outputs_hold(&call, |_| false);
        assert_eq!(
            (c.misses(0), call.plan.as_ref().unwrap().2[0]),
            (1024, 1024)
        );
        assert_eq!(
            &call.out[..2048],
            &call.out[3 * 2048..],
            "every step outputs the same rows"
        );
        assert_eq!(c.owned_rows(), rows);
        // admitted: the same query again is all hits
        let mut again = SpecCall::new(call.topk.clone(), 1, 4, 16384, false);
        engine()
            .run_spec(&c.args(&mut again), Stream::null())
            .unwrap();
        c.assert_outputs_hold(&again, |_| false);
        assert_eq!(c.misses(0), 0);
        assert_eq!(c.owned_rows(), rows);
    }
}

#[test]
fn draft_tokens_resolve_from_the_extra_page_without_host_io() {
    let mut c = SpecCase::new(1, 4096, 64, 4096, 8192, 4, 4, 2048);
    let draft: Vec<i32> = (8188..8192).collect();
    for (i, &off) in [0usize, 7, 31, 63].iter().enumerate() {
        c.tokens[4096 + off] = draft[i];
        let row = c.locs[4096 + off] as usize;
        c.device[row * 4..][..4].copy_from_slice(&c.host[draft[i] as usize * 4..][..4]);
        c.host_locs[draft[i] as usize] = -1;
    }
    let mut topk = Vec::new();
    for d in &draft {
        topk.extend(0..2047);
        topk.push(*d);
    }
    let mut call = SpecCall::new(topk, 1, 4, 0, false);
    call.seq = draft.iter().map(|d| d + 1).collect();
    engine()
        .run_spec(&c.args(&mut call), Stream::null())
        .unwrap();
    c.assert_outputs_hold(&call, |_| false);
    assert_eq!(c.misses(0), 0);
}

#[test]
fn padding_rows_output_zero_and_record_no_misses() {
    let mut c = SpecCase::new(2, 4096, 64, 4096, 8192, 1, 4, 2048);
    let topk: Vec<i32> = (0..8).flat_map(|_| 0..2048).collect();
    let mut call = SpecCall::new(topk, 2, 4, 8192, true);
    call.num_real = [1];
    call.plan.as_mut().unwrap().2.fill(123);
    let before = c.cache_policy.clone();
    engine()
        .run_spec(&c.args(&mut call), Stream::null())
        .unwrap();
    assert!(call.out[8192..].iter().all(|&o| o == 0));
    assert_eq!(call.plan.as_ref().unwrap().2, vec![0, 0]);
    assert_eq!(
        c.cache_policy[1], before[1],
        "the padding row's CLOCK is untouched"
    );
}

#[test]
fn bad_indices_are_refused_reported_and_never_read() {
    let mut c = SpecCase::new(2, 4096, 64, 4096, 8192, 2, 2, 2048);
    let mut topk: Vec<i32> = (0..4).flat_map(|_| 0..2048).collect();
    topk[5] = 1 << 30; // far past the host table
    topk[6] = -3;
    let mut call = SpecCall::new(topk, 2, 2, 8192, false);
    call.seq[2] = 9000; // row 1's second step: past max_tokens
    let err = engine()
        .run_spec(&c.args(&mut call), Stream::null())
        .unwrap_err();
    let Error::BadIndices(report) = err else {
        panic!("{err}")
    };
    assert_eq!(report.count, 3, "{report}");
    assert_eq!((call.out[5], call.out[6]), (-1, -1));
    assert!(
        call.out[4096..].iter().all(|&o| o == -1),
        "a refused row outputs -1"
    );
    c.assert_outputs_hold(&call, |i| i == 5 || i == 6 || i >= 4096);
    // two rows naming one request: the second is refused
    let topk: Vec<i32> = (0..4).flat_map(|_| 0..2048).collect();
    let mut call = SpecCall::new(topk, 2, 2, 8192, false);
    call.req = vec![1, 1];
    assert!(
        engine()
            .run_spec(&c.args(&mut call), Stream::null())
            .is_err()
    );
    assert!(call.out[4096..].iter().all(|&o| o == -1));
}

#[test]
fn arguments_are_checked_before_anything_runs() {
    let refused = |edit: &dyn Fn(&mut kvtier::SpecSwapInArgs<'_>), arg: &str| {
        let mut c = SpecCase::new(1, 4096, 64, 4096, 8192, 1, 2, 2048);
        let mut call = SpecCall::new((0..2).flat_map(|_| 0..2048).collect(), 1, 2, 8192, false);
        let before = c.scratch_state.clone();
        let mut a = c.args(&mut call);
        edit(&mut a);
        let e = engine().run_spec(&a, Stream::null()).unwrap_err();
        assert!(e.to_string().contains(arg), "{arg}: {e}");

        assert_eq!(c.scratch_state, before, "{arg}: nothing ran");
        assert!(call.out.iter().all(|&o| o == -7));
    };
    refused(&|a| a.num_steps = 5, "num_steps");
    refused(&|a| a.num_steps = 1, "num_steps");
    refused(&|a| a.num_top_k = 512, "num_top_k");
    refused(&|a| a.state.hash_size = 6000, "cache_index");
    refused(&|a| a.state.state_stride += 1, "scratch_state");
    refused(&|a| a.state.state_width = 100, "scratch_state");
    refused(&|a| a.state.policy_rows = 1, "cache_policy");
    refused(&|a| a.state.scratch_capacity = 0, "scratch_locs");
    refused(&|a| a.hot_buffer_size = 1, "hot_buffer_size");
    refused(&|a| a.num_requests = 2, "cache_index");
    refused(&|a| a.max_tokens = 9000, "host_stride");
}

#[test]
fn buffers_that_share_memory_are_refused() {
    let mut c = SpecCase::new(1, 4096, 64, 4096, 8192, 1, 2, 2048);
    let mut call = SpecCall::new((0..2).flat_map(|_| 0..2048).collect(), 1, 2, 8192, false);
    let alias = c.scratch_state.as_mut_ptr() as u64;
    let mut a = c.args(&mut call);
    // SAFETY: the output aliases the state's miss table (the check refuses it
    // before anything is written).
    a.top_k_device_locs =
        unsafe { kvtier::BufMut::from_raw(alias + 4 * 20480, 4096, kvtier::Location::Host) };
    let e = engine().run_spec(&a, Stream::null()).unwrap_err();
    assert!(e.to_string().contains("shares memory"), "{e}");
}

#[test]
fn a_miss_table_holding_this_calls_epoch_is_not_trusted() {
    // with the scratch overflowing (SGLang's sizing: 4096 = 8192 - hot), so
    // that every resolution path runs
    let mut c = SpecCase::new(1, 4096, 64, 4096, 16384, 2, 4, 2048);
    let topk: Vec<i32> = (4096..4096 + 8192).collect();
    plant_foreign_cells(&mut c, &topk);
    let rows = c.owned_rows();
    let mut call = SpecCall::new(topk, 1, 4, 16384, true);
    engine()
        .run_spec(&c.args(&mut call), Stream::null())
        .unwrap();
    c.assert_outputs_hold(&call, |_| false);
    assert_eq!(
        (c.misses(0), call.plan.as_ref().unwrap().2[0]),
        (8192, 8192)
    );
    assert_eq!(c.owned_rows(), rows);
}

#[test]
fn strides_past_the_address_space_are_refused() {
    let mut c = SpecCase::new(2, 4096, 64, 4096, 8192, 1, 2, 2048);
    let mut call = SpecCall::new((0..4).flat_map(|_| 0..2048).collect(), 2, 2, 8192, false);
    for edit in [
        &|a: &mut kvtier::SpecSwapInArgs<'_>| a.state.bank_stride = usize::MAX - 7,
        &|a: &mut kvtier::SpecSwapInArgs<'_>| a.state.index_stride = 1 << 63,
        &|a: &mut kvtier::SpecSwapInArgs<'_>| a.tokens_stride = usize::MAX,
    ] as [&dyn Fn(&mut kvtier::SpecSwapInArgs<'_>); 3]
    {
        let mut a = c.args(&mut call);
        edit(&mut a);
        assert!(engine().run_spec(&a, Stream::null()).is_err());
    }
    assert!(call.out.iter().all(|&o| o == -7), "nothing ran");
}

#[test]
fn stale_hash_entries_are_taken_over_not_carried() {
    let mut c = SpecCase::new(1, 4096, 64, 4096, 16384, 1, 4, 2048);
    plant_stale_entries(&mut c);
    let mut call = SpecCall::new(cross_step_misses(4096, 2048), 1, 4, 16384, false);
    engine()
        .run_spec(&c.args(&mut call), Stream::null())
        .unwrap();
    c.assert_outputs_hold(&call, |_| false);
    assert!(
        !c.degraded(0),
        "782 insertions into a hash full of stale entries gave up"
    );
    c.assert_consistent();
}
