//! criterion benchmarks of the host-side work on or near the per-layer path:
//! argument validation and planning of a call (measured on calls that move a
//! single entry, so the checks dominate), the per-rank placement decision,
//! and region allocation in the pool's shared metadata.

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kvtier::pool::RoundRobinPlacement;
use kvtier::{
    Buf, BufMut, DeviceSpec, Executor, GatherBatch, IndexBuf, KvBuffers, LayerFirstLayout, Pool,
    QueryKind, Stream, SwapInArgs, SwapInEngine, Tier, WritebackItems,
};

fn small_pool(regions: u32) -> std::sync::Arc<Pool> {
    let layout = LayerFirstLayout::new(656, 61, 64).unwrap();
    Pool::create(
        layout,
        DeviceSpec::Anon {
            bytes: Pool::device_bytes_for(&layout, regions).unwrap(),
        },
    )
    .unwrap()
}

/// A gather and a writeback of one entry: validation, planning, one copy.
fn call_overhead(c: &mut Criterion) {
    let pool = small_pool(1);
    let region = pool.alloc_region().unwrap();
    let mut tier = Tier::new(pool.clone(), Executor::cpu(), 8).unwrap();
    tier.bind_slot(3, &region, Stream::null()).unwrap();
    let (slots, seq, topk) = ([3i32], [64i32], [17i32]);
    let mut out = vec![0u8; 656];
    c.bench_function("gather_call_one_entry", |b| {
        b.iter(|| {
            let batch = GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&topk), 1);
            tier.gather(7, &batch, BufMut::host(&mut out), Stream::null())
                .unwrap()
        })
    });
    let (tokens, rows) = ([5i32], [0i64]);
    let src = vec![1u8; 656];
    c.bench_function("writeback_layer_call_one_entry", |b| {
        b.iter(|| {
            let items = WritebackItems {
                slots: Buf::host(&slots),
                tokens: Buf::host(&tokens),
                src_rows: Buf::host(&rows),
            };
            tier.writeback_layer(7, &items, Buf::host(&src), Stream::null())
                .unwrap()
        })
    });
}

/// A swap-in of one request whose query is one hit: the checks and the plan.
fn swap_in_overhead(c: &mut Criterion) {
    let mut engine = SwapInEngine::new(Executor::cpu()).unwrap();
    engine.reserve(1, 1).unwrap();
    let hot = 4usize;
    let mut tokens = vec![1i32, 4, 2, 5, 7];
    let locs = vec![9i32, 7, 3, 5, 11];
    let mut lru = vec![0i16, 1, 2, 3];
    let host_locs: Vec<i64> = (0..8).collect();
    let host_cache = vec![0u8; 8 * 656];
    let mut device_buffer = vec![0u8; 12 * 656];
    let (query, req, seq) = ([4i32], [0i32], [8i32]);
    let mut out = [0i32];
    c.bench_function("swap_in_call_one_hit", |b| {
        b.iter(|| {
            let a = SwapInArgs {
                layer: None,
                top_k_tokens: Buf::host(&query),
                top_k_stride: 1,
                query: QueryKind::Tokens,
                device_buffer_tokens: BufMut::host(&mut tokens),
                tokens_stride: hot + 1,
                device_buffer_locs: Buf::host(&locs),
                locs_stride: hot + 1,
                lru_slots: BufMut::host(&mut lru),
                lru_stride: hot,
                host_cache_locs: Buf::host(&host_locs),
                host_stride: 8,
                max_tokens: 8,
                kv: KvBuffers::linear(
                    656,
                    Buf::host(&host_cache),
                    BufMut::host(&mut device_buffer),
                )
                .unwrap(),
                top_k_device_locs: BufMut::host(&mut out),
                out_stride: 1,
                req_pool_indices: IndexBuf::I32(Buf::host(&req)),
                seq_lens: IndexBuf::I32(Buf::host(&seq)),
                num_real_reqs: None,
                num_requests: 1,
                num_top_k: 1,
                hot_buffer_size: hot as u32,
                skip_io: false,
                miss_plan: None,
            };
            engine.run(&a, Stream::null()).unwrap()
        })
    });
}

/// The per-rank round-robin decision, 8 ranks over 3 devices, one full.
fn interleaving(c: &mut Criterion) {
    let mut p = RoundRobinPlacement::new(5, 8, 3).unwrap();
    c.bench_function("round_robin_next", |b| b.iter(|| p.next(|d| d != 1)));
}

/// Allocating and freeing a region: compare-and-swap on the shared region
/// table, and the client bookkeeping.
fn pool_allocation(c: &mut Criterion) {
    let pool = small_pool(64);
    let held: Vec<_> = (0..48).map(|_| pool.alloc_region().unwrap()).collect();
    c.bench_function("alloc_and_free_region_48_of_64_taken", |b| {
        b.iter(|| {
            let r = pool.alloc_region().unwrap();
            pool.free_region(r).unwrap()
        })
    });
    drop(held);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(2)).without_plots();
    targets = call_overhead, swap_in_overhead, interleaving, pool_allocation
}
criterion_main!(benches);
