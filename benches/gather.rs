//! criterion benchmarks of the per-layer calls: top-k gather and decode
//! writeback on the CPU executor, and the gather kernel timed with CUDA
//! events when a GPU is present (skipped with a message otherwise).

use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvtier::cuda::EventTimer;
use kvtier::{
    Buf, BufMut, DeviceBuffer, DeviceSpec, Executor, GatherBatch, LayerFirstLayout, Pool, Region,
    Stream, Tier, WritebackItems,
};

const ENTRY: u32 = 656;
const CONTEXT: u32 = 8192;
const K: u32 = 2048;

fn pool(requests: u32, layers: u32) -> (Arc<Pool>, Vec<Region>) {
    let layout = LayerFirstLayout::new(ENTRY, layers, CONTEXT).unwrap();
    let pool = Pool::create(
        layout,
        DeviceSpec::Anon {
            bytes: Pool::device_bytes_for(&layout, requests).unwrap(),
        },
    )
    .unwrap();
    let regions: Vec<Region> = (0..requests)
        .map(|_| pool.alloc_region().unwrap())
        .collect();
    // Touch every page with data: untouched anonymous memory reads as the
    // shared zero page, which would flatter the CPU executor.
    let layer: Vec<u8> = (0..layout.layer_bytes())
        .map(|i| (i * 131 % 251) as u8)
        .collect();
    for r in &regions {
        for l in 0..layers {
            pool.write_tokens(r, l, 0, &layer).unwrap();
        }
    }
    (pool, regions)
}

fn tier(pool: &Arc<Pool>, regions: &[Region], exec: Executor) -> Tier {
    let mut tier = Tier::new(pool.clone(), exec, regions.len() as u32).unwrap();
    for (s, r) in regions.iter().enumerate() {
        tier.bind_slot(s as u32, r, Stream::null()).unwrap();
    }
    if let Executor::Cuda(dev) = tier.executor() {
        dev.synchronize_all().unwrap(); // the timed work runs on another stream
    }
    tier
}

/// Spread-out, distinct indices (a multiplicative hash of the position).
fn topk(batch: u32) -> Vec<i32> {
    (0..batch * K)
        .map(|i| ((i % K) as u64 * 2_654_435_761 % CONTEXT as u64) as i32)
        .collect()
}

fn cpu_gather(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_gather_k2048_656B");
    for batch in [1u32, 8] {
        let (pool, regions) = pool(batch, 1);
        let tier = tier(&pool, &regions, Executor::cpu());
        let (slots, seq, idx) = (
            (0..batch as i32).collect::<Vec<_>>(),
            vec![CONTEXT as i32; batch as usize],
            topk(batch),
        );
        let mut out = vec![0u8; (batch * K * ENTRY) as usize];
        g.throughput(Throughput::Bytes(out.len() as u64));
        g.bench_function(BenchmarkId::from_parameter(batch), |b| {
            b.iter(|| {
                let batch =
                    GatherBatch::new(Buf::host(&slots), Buf::host(&seq), Buf::host(&idx), K);
                tier.gather(0, &batch, BufMut::host(&mut out), Stream::null())
                    .unwrap()
            })
        });
    }
    g.finish();
}

fn cpu_decode_writeback(c: &mut Criterion) {
    let (batch, layers) = (64u32, 61u32);
    let (pool, regions) = pool(batch, layers);
    let tier = tier(&pool, &regions, Executor::cpu());
    let kv: Vec<Vec<u8>> = (0..layers)
        .map(|_| vec![1u8; (batch * ENTRY) as usize])
        .collect();
    let bufs: Vec<Buf<u8>> = kv.iter().map(|b| Buf::host(b)).collect();
    let kv = tier.register_kv_layers(&bufs).unwrap();
    let slots: Vec<i32> = (0..batch as i32).collect();
    let tokens = vec![CONTEXT as i32 - 1; batch as usize];
    let rows: Vec<i64> = (0..batch as i64).collect();
    let mut g = c.benchmark_group("cpu_writeback_all_layers");
    g.throughput(Throughput::Bytes((batch * layers * ENTRY) as u64));
    g.bench_function("decode_batch64_61layers", |b| {
        b.iter(|| {
            let items = WritebackItems {
                slots: Buf::host(&slots),
                tokens: Buf::host(&tokens),
                src_rows: Buf::host(&rows),
            };
            tier.writeback_all_layers(&items, &kv, Stream::null())
                .unwrap()
        })
    });
    g.finish();
}

fn gpu_gather(c: &mut Criterion) {
    let exec = match Executor::cuda(0) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("gpu_gather: skipped ({e})");
            return;
        }
    };
    let Executor::Cuda(dev) = &exec else {
        unreachable!()
    };
    let mut g = c.benchmark_group("gpu_gather_k2048_656B");
    for batch in [1u32, 64] {
        let (pool, regions) = pool(batch, 1);
        let tier = tier(&pool, &regions, exec.clone());
        let slots = DeviceBuffer::from_host(dev, &(0..batch as i32).collect::<Vec<_>>()).unwrap();
        let seq = DeviceBuffer::from_host(dev, &vec![CONTEXT as i32; batch as usize]).unwrap();
        let idx = DeviceBuffer::from_host(dev, &topk(batch)).unwrap();
        let mut out = DeviceBuffer::<u8>::zeroed(dev, (batch * K * ENTRY) as usize).unwrap();
        let stream = dev.create_stream().unwrap();
        let timer = EventTimer::new(dev).unwrap();
        g.throughput(Throughput::Bytes(out.len() as u64));
        g.bench_function(BenchmarkId::from_parameter(batch), |b| {
            b.iter_custom(|iters| {
                timer.start(stream.stream()).unwrap();
                for _ in 0..iters {
                    let batch = GatherBatch::new(slots.as_buf(), seq.as_buf(), idx.as_buf(), K);
                    tier.gather(0, &batch, out.as_buf_mut(), stream.stream())
                        .unwrap();
                }
                timer.stop(stream.stream()).unwrap();
                Duration::from_secs_f64(timer.elapsed_us().unwrap() * 1e-6)
            })
        });
        tier.check(stream.stream()).unwrap();
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(3)).without_plots();
    targets = cpu_gather, cpu_decode_writeback, gpu_gather
}
criterion_main!(benches);
