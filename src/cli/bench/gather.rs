//! The `gather` scenario: for each batch size, kvtier's top-k gather and a
//! contiguous copy of the same number of bytes out of the same pool memory
//! into the same output buffer (the link's limit).

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use kvtier::cuda::EventTimer;
use kvtier::{
    Buf, BufMut, CudaDevice, DeviceBuffer, DeviceSpec, Executor, GatherBatch, LayerFirstLayout,
    Pool, Region, Stream, Tier,
};

use super::{BenchArgs, Row, invalid, time_cpu, time_cuda};

pub(super) fn run(args: &BenchArgs, exec: &Executor, entry: u32) -> kvtier::Result<Vec<Row>> {
    let batches = if args.batch.is_empty() {
        vec![1, 64]
    } else {
        args.batch.clone()
    };
    if args.k == 0 || args.k > args.context {
        return Err(invalid(
            "--k",
            format!("{} must be in 1..=context ({})", args.k, args.context),
        ));
    }
    let max_batch = *batches.iter().max().unwrap();
    let layout = LayerFirstLayout::new(entry, 1, args.context)?;
    let pool_bytes = Pool::device_bytes_for(&layout, max_batch);
    let pool = Pool::create(layout, DeviceSpec::Anon { bytes: pool_bytes })?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let regions = fill_pool(&pool, max_batch, &mut rng)?;
    let mut tier = Tier::new(pool.clone(), exec.clone(), max_batch)?;
    for (slot, region) in regions.iter().enumerate() {
        tier.bind_slot(slot as u32, region, Stream::null())?;
    }
    if let Executor::Cuda(dev) = exec {
        dev.synchronize_all()?; // the timed work runs on another stream
    }
    println!(
        "gather: top-k gather, k = {}, entry {entry} B, context {} tokens, uniform distinct indices, {} \
         iterations after {} warm-up",
        args.k, args.context, args.iters, args.warmup
    );

    let mut rows = Vec::new();
    for &batch in &batches {
        let inputs = BatchInputs::draw(batch, args.k, args.context, &mut rng);
        match exec {
            Executor::Cpu => rows.extend(bench_cpu(&tier, &pool, &regions, &inputs, args)?),
            Executor::Cuda(dev) => {
                rows.extend(bench_cuda(&tier, dev, &pool, &regions, &inputs, args)?)
            }
        }
    }
    Ok(rows)
}

/// Allocates `n` regions and fills their one layer with random bytes.
fn fill_pool(pool: &Arc<Pool>, n: u32, rng: &mut StdRng) -> kvtier::Result<Vec<Region>> {
    let layout = pool.layout();
    let chunk_tokens = 4096.min(layout.tokens_per_region());
    let mut chunk = vec![0u8; chunk_tokens as usize * layout.entry_bytes() as usize];
    let mut regions = Vec::new();
    for _ in 0..n {
        let r = pool.alloc_region()?;
        let mut t = 0;
        while t < layout.tokens_per_region() {
            let tokens = chunk_tokens.min(layout.tokens_per_region() - t);
            let bytes = &mut chunk[..tokens as usize * layout.entry_bytes() as usize];
            rng.fill_bytes(bytes);
            pool.write_tokens(&r, 0, t, bytes)?;
            t += tokens;
        }
        regions.push(r);
    }
    Ok(regions)
}

/// The host-side inputs of one batch: slot per row, lengths, distinct
/// uniformly drawn top-k indices.
struct BatchInputs {
    batch: u32,
    k: u32,
    req_slots: Vec<i32>,
    seq_lens: Vec<i32>,
    topk: Vec<i32>,
}

impl BatchInputs {
    fn draw(batch: u32, k: u32, context: u32, rng: &mut StdRng) -> Self {
        let mut topk = Vec::with_capacity((batch * k) as usize);
        for _ in 0..batch {
            let picks = rand::seq::index::sample(rng, context as usize, k as usize);
            topk.extend(picks.into_iter().map(|t| t as i32));
        }
        BatchInputs {
            batch,
            k,
            req_slots: (0..batch as i32).collect(),
            seq_lens: vec![context as i32; batch as usize],
            topk,
        }
    }

    fn bytes(&self, entry: u32) -> u64 {
        self.batch as u64 * self.k as u64 * entry as u64
    }

    fn point(&self) -> String {
        format!("batch {}", self.batch)
    }

    /// Checks the first and last output rows against the pool (a benchmark
    /// that moves the wrong bytes measures nothing).
    fn verify(&self, pool: &Pool, regions: &[Region], out: &[u8]) -> kvtier::Result<()> {
        let entry = pool.layout().entry_bytes() as usize;
        for r in [0, (self.batch * self.k) as usize - 1] {
            let (b, token) = (r / self.k as usize, self.topk[r] as u32);
            let mut want = vec![0u8; entry];
            pool.read_tokens(&regions[self.req_slots[b] as usize], 0, token, &mut want)?;
            if out[r * entry..][..entry] != want[..] {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: gathered row {r} differs from the pool"
                )));
            }
        }
        Ok(())
    }
}

fn bench_cpu(
    tier: &Tier,
    pool: &Pool,
    regions: &[Region],
    inp: &BatchInputs,
    args: &BenchArgs,
) -> kvtier::Result<Vec<Row>> {
    let bytes = inp.bytes(pool.layout().entry_bytes());
    let mut out = vec![0u8; bytes as usize];
    let src = pool.region_host_addr(&regions[0])? as *const u8;
    let gather = time_cpu(
        args,
        &mut out,
        |_| {},
        |out| {
            let batch = GatherBatch::new(
                Buf::host(&inp.req_slots),
                Buf::host(&inp.seq_lens),
                Buf::host(&inp.topk),
                inp.k,
            );
            tier.gather(0, &batch, BufMut::host(out), Stream::null())
        },
    )?;
    inp.verify(pool, regions, &out)?;
    let limit = time_cpu(
        args,
        &mut out,
        |_| {},
        |out| {
            // SAFETY: the pool holds batch regions of context >= k tokens
            // each, contiguous from region 0, so `bytes` bytes are mapped.
            unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), bytes as usize) };
            Ok(())
        },
    )?;
    Ok(vec![
        Row {
            point: inp.point(),
            method: "kvtier gather (CPU executor)",
            bytes,
            median_us: gather.0,
            p99_us: gather.1,
            limit: false,
        },
        Row {
            point: inp.point(),
            method: "contiguous memcpy (limit)",
            bytes,
            median_us: limit.0,
            p99_us: limit.1,
            limit: true,
        },
    ])
}

fn bench_cuda(
    tier: &Tier,
    dev: &Arc<CudaDevice>,
    pool: &Pool,
    regions: &[Region],
    inp: &BatchInputs,
    args: &BenchArgs,
) -> kvtier::Result<Vec<Row>> {
    let bytes = inp.bytes(pool.layout().entry_bytes());
    let stream = dev.create_stream()?;
    let slots = DeviceBuffer::from_host(dev, &inp.req_slots)?;
    let seq_lens = DeviceBuffer::from_host(dev, &inp.seq_lens)?;
    let topk = DeviceBuffer::from_host(dev, &inp.topk)?;
    let mut out = DeviceBuffer::<u8>::zeroed(dev, bytes as usize)?;
    let src = pool.region_host_addr(&regions[0])?;
    let timer = EventTimer::new(dev)?;
    let no_reset = |_: Stream| Ok(());

    let gather = time_cuda(args, &timer, stream.stream(), no_reset, |s| {
        let batch = GatherBatch::new(slots.as_buf(), seq_lens.as_buf(), topk.as_buf(), inp.k);
        tier.gather(0, &batch, out.as_buf_mut(), s)
    })?;
    tier.check(stream.stream())?;
    inp.verify(pool, regions, &out.to_vec()?)?;
    let dst = out.device_ptr();
    let limit = time_cuda(args, &timer, stream.stream(), no_reset, |s| {
        // SAFETY: `src` is registered pool memory holding at least `bytes`
        // bytes (batch regions of context >= k tokens); `dst` holds `bytes`.
        unsafe { dev.copy_host_to_device_async(dst, src as *const u8, bytes as usize, s) }
    })?;
    Ok(vec![
        Row {
            point: inp.point(),
            method: "kvtier gather",
            bytes,
            median_us: gather.0,
            p99_us: gather.1,
            limit: false,
        },
        Row {
            point: inp.point(),
            method: "contiguous H2D copy (limit)",
            bytes,
            median_us: limit.0,
            p99_us: limit.1,
            limit: true,
        },
    ])
}
