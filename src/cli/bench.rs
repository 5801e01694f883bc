//! `kvtier bench`: the top-k fetch microbenchmark (first version).
//!
//! For each batch size, kvtier's gather of `k` entries per request and a
//! contiguous copy of the same number of bytes out of the same pool memory
//! into the same output buffer are timed side by side, in one run; the copy is
//! the limit of the link (the copy engine over PCIe on a GPU, memcpy on the
//! CPU executor). Without a GPU the CPU executor runs and the table says so.

use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use kvtier::cuda::{EventTimer, OwnedStream};
use kvtier::{
    Buf, BufMut, CudaDevice, DeviceBuffer, DeviceSpec, EntryFormat, Executor, GatherBatch,
    LayerFirstLayout, Pool, Region, Stream, Tier,
};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Entries fetched per request and layer.
    #[arg(long, default_value_t = 2048)]
    k: u32,
    /// Entry format: fp8-dsa (656 B), bf16-mla (1152 B) or a byte count.
    #[arg(long, default_value = "fp8-dsa")]
    entry: String,
    /// Batch sizes (requests per gather), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 64])]
    batch: Vec<u32>,
    /// Tokens of context per request; top-k indices are drawn from it.
    #[arg(long, default_value_t = 32768)]
    context: u32,
    /// Timed iterations per measurement.
    #[arg(long, default_value_t = 50)]
    iters: u32,
    /// Untimed warm-up iterations per measurement.
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// Executor: auto (CUDA when a GPU and the kernels are there), cpu or cuda.
    #[arg(long, default_value = "auto")]
    executor: String,
    /// GPU ordinal for the CUDA executor.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// A short run (context 4096, 10 iterations) for smoke tests and CI.
    #[arg(long)]
    quick: bool,
    /// Seed of the index and data generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// One timed method at one batch size.
struct Row {
    batch: u32,
    method: &'static str,
    bytes: u64,
    median_us: f64,
    p99_us: f64,
}

pub fn run(mut args: BenchArgs) -> kvtier::Result<()> {
    if args.quick {
        args.context = args.context.min(4096);
        args.iters = args.iters.min(10);
        args.warmup = args.warmup.min(2);
    }
    let entry = args.entry.parse::<EntryFormat>()?.bytes();
    if args.k == 0 || args.k > args.context {
        return Err(invalid(
            "--k",
            format!("{} must be in 1..=context ({})", args.k, args.context),
        ));
    }
    if args.iters == 0 || args.batch.is_empty() || args.batch.contains(&0) {
        return Err(invalid(
            "--iters/--batch",
            "need at least one iteration and batch sizes >= 1",
        ));
    }
    let (exec, why_cpu) = choose_executor(&args)?;
    let max_batch = *args.batch.iter().max().unwrap();

    let layout = LayerFirstLayout::new(entry, 1, args.context)?;
    let pool_bytes = layout
        .region_bytes()
        .next_multiple_of(kvtier::pool::REGION_ALIGN)
        * max_batch as u64;
    let pool = Pool::create(layout, DeviceSpec::Anon { bytes: pool_bytes })?;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let regions = fill_pool(&pool, max_batch, &mut rng)?;
    let mut tier = Tier::new(pool.clone(), exec.clone(), max_batch)?;
    for (slot, region) in regions.iter().enumerate() {
        tier.bind_slot(slot as u32, region, Stream::null())?;
    }
    if let Executor::Cuda(dev) = &exec {
        dev.synchronize_all()?; // the timed work runs on another stream
    }

    println!(
        "kvtier bench: top-k gather, k = {}, entry {entry} B, context {} tokens, {} iterations after {} warm-up",
        args.k, args.context, args.iters, args.warmup
    );
    match &why_cpu {
        Some(why) => {
            println!("executor: CPU executor (no CUDA executor: {why}); the limit is a host memcpy")
        }
        None => println!(
            "executor: {}; the limit is a host-to-device copy by the copy engine",
            exec.describe()
        ),
    }
    println!();

    let mut rows = Vec::new();
    for &batch in &args.batch {
        let inputs = BatchInputs::draw(batch, args.k, args.context, &mut rng);
        match &exec {
            Executor::Cpu => rows.extend(bench_cpu(&tier, &pool, &regions, &inputs, &args)?),
            Executor::Cuda(dev) => {
                rows.extend(bench_cuda(&tier, dev, &pool, &regions, &inputs, &args)?)
            }
        }
    }
    print_table(&rows);
    Ok(())
}

fn invalid(arg: &'static str, msg: impl Into<String>) -> kvtier::Error {
    kvtier::Error::InvalidArgument {
        arg,
        msg: msg.into(),
    }
}

fn choose_executor(args: &BenchArgs) -> kvtier::Result<(Executor, Option<String>)> {
    match args.executor.as_str() {
        "cpu" => Ok((Executor::cpu(), Some("--executor cpu was given".into()))),
        "cuda" => Ok((Executor::cuda(args.device)?, None)),
        "auto" => match Executor::cuda(args.device) {
            Ok(e) => Ok((e, None)),
            Err(e) => Ok((Executor::cpu(), Some(e.to_string()))),
        },
        other => Err(invalid(
            "--executor",
            format!("{other:?} is not auto, cpu or cuda"),
        )),
    }
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

    /// Checks output row `r` against the pool (a benchmark that moves the
    /// wrong bytes measures nothing).
    fn verify_row(
        &self,
        pool: &Pool,
        regions: &[Region],
        out: &[u8],
        r: usize,
    ) -> kvtier::Result<()> {
        let entry = pool.layout().entry_bytes() as usize;
        let (b, token) = (r / self.k as usize, self.topk[r] as u32);
        let mut want = vec![0u8; entry];
        pool.read_tokens(&regions[self.req_slots[b] as usize], 0, token, &mut want)?;
        if out[r * entry..][..entry] != want[..] {
            return Err(kvtier::Error::Pool(format!(
                "benchmark self-check failed: row {r} differs from the pool"
            )));
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
    let entry = pool.layout().entry_bytes();
    let bytes = inp.bytes(entry);
    let mut out = vec![0u8; bytes as usize];
    let src = pool.region_host_addr(&regions[0])? as *const u8;

    let gather = time_cpu(args, || {
        let batch = GatherBatch::new(
            Buf::host(&inp.req_slots),
            Buf::host(&inp.seq_lens),
            Buf::host(&inp.topk),
            inp.k,
        );
        tier.gather(0, &batch, BufMut::host(&mut out), Stream::null())
    })?;
    for r in [0, (inp.batch * inp.k) as usize - 1] {
        inp.verify_row(pool, regions, &out, r)?;
    }
    let limit = time_cpu(args, || {
        // SAFETY: the pool holds batch regions of context >= k tokens each,
        // contiguous from region 0, so `bytes` bytes from its base are mapped.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), bytes as usize) };
        Ok(())
    })?;
    Ok(vec![
        Row {
            batch: inp.batch,
            method: "kvtier gather (CPU executor)",
            bytes,
            median_us: gather.0,
            p99_us: gather.1,
        },
        Row {
            batch: inp.batch,
            method: "contiguous memcpy (limit)",
            bytes,
            median_us: limit.0,
            p99_us: limit.1,
        },
    ])
}

fn time_cpu(
    args: &BenchArgs,
    mut f: impl FnMut() -> kvtier::Result<()>,
) -> kvtier::Result<(f64, f64)> {
    for _ in 0..args.warmup {
        f()?;
    }
    let mut samples = Vec::with_capacity(args.iters as usize);
    for _ in 0..args.iters {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median_p99(samples))
}

fn bench_cuda(
    tier: &Tier,
    dev: &Arc<CudaDevice>,
    pool: &Pool,
    regions: &[Region],
    inp: &BatchInputs,
    args: &BenchArgs,
) -> kvtier::Result<Vec<Row>> {
    let entry = pool.layout().entry_bytes();
    let bytes = inp.bytes(entry);
    let stream: OwnedStream = dev.create_stream()?;
    let slots = DeviceBuffer::from_host(dev, &inp.req_slots)?;
    let seq_lens = DeviceBuffer::from_host(dev, &inp.seq_lens)?;
    let topk = DeviceBuffer::from_host(dev, &inp.topk)?;
    let mut out = DeviceBuffer::<u8>::zeroed(dev, bytes as usize)?;
    let src = pool.region_host_addr(&regions[0])?;
    let timer = EventTimer::new(dev)?;

    let gather = time_cuda(args, &timer, stream.stream(), |s| {
        let batch = GatherBatch::new(slots.as_buf(), seq_lens.as_buf(), topk.as_buf(), inp.k);
        tier.gather(0, &batch, out.as_buf_mut(), s)
    })?;
    tier.check(stream.stream())?;
    let host_out = out.to_vec()?;
    for r in [0, (inp.batch * inp.k) as usize - 1] {
        inp.verify_row(pool, regions, &host_out, r)?;
    }
    let dst = out.device_ptr();
    let limit = time_cuda(args, &timer, stream.stream(), |s| {
        // SAFETY: `src` is registered pool memory holding at least `bytes`
        // bytes (batch regions of context >= k tokens); `dst` holds `bytes`.
        unsafe { dev.copy_host_to_device_async(dst, src as *const u8, bytes as usize, s) }
    })?;
    Ok(vec![
        Row {
            batch: inp.batch,
            method: "kvtier gather",
            bytes,
            median_us: gather.0,
            p99_us: gather.1,
        },
        Row {
            batch: inp.batch,
            method: "contiguous H2D copy (limit)",
            bytes,
            median_us: limit.0,
            p99_us: limit.1,
        },
    ])
}

fn time_cuda(
    args: &BenchArgs,
    timer: &EventTimer,
    stream: Stream,
    mut f: impl FnMut(Stream) -> kvtier::Result<()>,
) -> kvtier::Result<(f64, f64)> {
    for _ in 0..args.warmup {
        f(stream)?;
    }
    let mut samples = Vec::with_capacity(args.iters as usize);
    for _ in 0..args.iters {
        timer.start(stream)?;
        f(stream)?;
        timer.stop(stream)?;
        samples.push(timer.elapsed_us()?);
    }
    Ok(median_p99(samples))
}

/// (median, p99) of the samples, nearest-rank.
fn median_p99(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let p99 = samples[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1];
    (samples[n / 2], p99)
}

fn print_table(rows: &[Row]) {
    println!(
        "{:>6}  {:<30} {:>10} {:>11} {:>11} {:>9} {:>9}",
        "batch", "method", "bytes", "median µs", "p99 µs", "GB/s", "vs limit"
    );
    for group in rows.chunk_by(|a, b| a.batch == b.batch) {
        let limit = group
            .iter()
            .find(|r| r.method.contains("limit"))
            .map(|r| r.median_us);
        for r in group {
            let gbps = r.bytes as f64 / r.median_us / 1e3;
            let ratio = limit.map(|l| l / r.median_us).unwrap_or(f64::NAN);
            println!(
                "{:>6}  {:<30} {:>10} {:>11.1} {:>11.1} {:>9.2} {:>9.2}",
                r.batch,
                r.method,
                format_size_decimal(r.bytes),
                r.median_us,
                r.p99_us,
                gbps,
                ratio
            );
        }
    }
    println!(
        "\nvs limit = limit's median time / this method's median time (1.00 = as fast as the contiguous copy)"
    );
}

fn format_size_decimal(bytes: u64) -> String {
    if bytes >= 1_000_000 {
        format!("{:.2} MB", bytes as f64 / 1e6)
    } else {
        format!("{:.1} KB", bytes as f64 / 1e3)
    }
}
