//! The `swap-in` scenario: the HiSparse grid (batch × hot buffer × misses per
//! request, K = `--k`, items of `--entry` bytes). Per point, kvtier's swap-in
//! (plan per request, one copy over every miss of the batch), the
//! one-block-per-request design SGLang uses (same planning, copies inside
//! each request's block), and a contiguous copy of the missed bytes (the
//! limit), each from the same state, restored untimed before every call.

use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use kvtier::cuda::EventTimer;
use kvtier::{
    Buf, BufMut, CudaDevice, DeviceBuffer, DeviceSpec, Executor, IndexBuf, LayerFirstLayout, Pool,
    Region, Stream, SwapInArgs, SwapInStrategy, Tier,
};

use super::{BenchArgs, Row, invalid, time_cpu, time_cuda};

pub(super) fn run(args: &BenchArgs, exec: &Executor, item: u32) -> kvtier::Result<Vec<Row>> {
    let batches = match (args.batch.is_empty(), args.quick) {
        (false, _) => args.batch.clone(),
        (true, false) => vec![1, 16, 64, 256],
        (true, true) => vec![1, 16],
    };
    let hots: Vec<u32> = if args.quick {
        vec![*args.hot.iter().min().unwrap_or(&4096)]
    } else {
        args.hot.clone()
    };
    let k = args.k;
    for &hot in &hots {
        if k == 0 || k > hot {
            return Err(invalid("--k", format!("{k} must be in 1..=hot ({hot})")));
        }
    }
    if let Some(&m) = args.misses.iter().find(|&&m| m > k) {
        return Err(invalid("--misses", format!("{m} exceeds k = {k}")));
    }
    println!(
        "swap-in: HiSparse LRU swap-in, K = {k}, item {item} B, every request a long sequence (context = \
         hot + 2K), {} iterations after {} warm-up, state restored before each",
        args.iters, args.warmup
    );
    let max_batch = *batches.iter().max().unwrap();
    let mut rows = Vec::new();
    for &hot in &hots {
        let state = State::build(args.seed ^ hot as u64, max_batch, hot, k, item, exec)?;
        for &batch in &batches {
            for &misses in &args.misses {
                let q = state.queries(batch, misses, args.seed);
                let point = format!("batch {batch}, hot {hot}, {misses} misses");
                rows.extend(match exec {
                    Executor::Cpu => state.bench_cpu(&q, point, args)?,
                    Executor::Cuda(dev) => state.bench_cuda(dev, &q, point, args)?,
                });
            }
        }
    }
    Ok(rows)
}

/// Per-request HiSparse state for `requests` long requests, host cache rows
/// in a pool (registered for the GPU), and the device buffer.
struct State {
    requests: u32,
    hot: u32,
    k: u32,
    item: u32,
    context: u32,
    tokens: Vec<i32>,    // [requests][hot + 1]
    locs: Vec<i32>,      // [requests][hot + 1]
    lru: Vec<i16>,       // [requests][hot]
    host_locs: Vec<i64>, // [requests][context]
    pool: Arc<Pool>,
    host_region: Region,
    tier: Tier,
}

/// One batch's queries and its row metadata.
struct Queries {
    batch: u32,
    misses: u32,
    topk: Vec<i32>,
    req: Vec<i32>,
    seq: Vec<i32>,
}

impl State {
    fn build(
        seed: u64,
        requests: u32,
        hot: u32,
        k: u32,
        item: u32,
        exec: &Executor,
    ) -> kvtier::Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let context = hot + 2 * k;
        let (r, h, c) = (requests as usize, hot as usize, context as usize);
        let mut tokens = vec![-1i32; r * (h + 1)];
        let mut lru = vec![0i16; r * h];
        let mut resident: Vec<i32> = (0..context as i32 - 1).collect();
        for req in 0..r {
            resident.shuffle(&mut rng);
            tokens[req * (h + 1)..][..h].copy_from_slice(&resident[..h]);
            tokens[req * (h + 1) + h] = context as i32 - 1;
            let mut order: Vec<i16> = (0..hot as i16).collect();
            order.shuffle(&mut rng);
            lru[req * h..][..h].copy_from_slice(&order);
        }
        let locs: Vec<i32> = (0..(r * (h + 1)) as i32).collect();
        let host_locs: Vec<i64> = (0..(r * c) as i64).collect();

        // The host cache, row j filled with a byte pattern of j, in the pool.
        let host_rows = r * c;
        let layout = LayerFirstLayout::new(item, 1, host_rows as u32)?;
        let pool = Pool::create(
            layout,
            DeviceSpec::Anon {
                bytes: Pool::device_bytes_for(&layout, 1),
            },
        )?;
        let host_region = pool.alloc_region()?;
        let chunk = 4096usize;
        let mut bytes = vec![0u8; chunk * item as usize];
        for first in (0..host_rows).step_by(chunk) {
            let n = chunk.min(host_rows - first);
            for (i, row) in bytes.chunks_mut(item as usize).take(n).enumerate() {
                row.fill(row_pattern(first + i));
            }
            pool.write_tokens(&host_region, 0, first as u32, &bytes[..n * item as usize])?;
        }
        let mut tier = Tier::new(pool.clone(), exec.clone(), 1)?;
        tier.enable_swap_in(requests, k)?;
        Ok(State {
            requests,
            hot,
            k,
            item,
            context,
            tokens,
            locs,
            lru,
            host_locs,
            pool,
            host_region,
            tier,
        })
    }

    fn device_rows(&self) -> usize {
        self.requests as usize * (self.hot as usize + 1)
    }

    /// Per request: K - misses resident tokens and `misses` absent ones.
    fn queries(&self, batch: u32, misses: u32, seed: u64) -> Queries {
        let mut rng = StdRng::seed_from_u64(seed ^ ((batch as u64) << 32) ^ misses as u64);
        let (h, k) = (self.hot as usize, self.k as usize);
        let mut topk = Vec::with_capacity(batch as usize * k);
        for req in 0..batch as usize {
            let mut resident: Vec<i32> = self.tokens[req * (h + 1)..][..h].to_vec();
            resident.shuffle(&mut rng);
            let present: std::collections::HashSet<i32> = resident.iter().copied().collect();
            let mut absent: Vec<i32> = (0..self.context as i32 - 1)
                .filter(|t| !present.contains(t))
                .collect();
            absent.shuffle(&mut rng);
            let mut q: Vec<i32> = resident[..k - misses as usize].to_vec();
            q.extend(&absent[..misses as usize]);
            q.shuffle(&mut rng);
            topk.extend(q);
        }
        Queries {
            batch,
            misses,
            topk,
            req: (0..batch as i32).collect(),
            seq: vec![self.context as i32; batch as usize],
        }
    }

    fn missed_bytes(&self, q: &Queries) -> u64 {
        q.batch as u64 * q.misses as u64 * self.item as u64
    }

    /// Checks one loaded row of the first request: the device row the first
    /// miss was given holds that token's host row.
    fn verify(
        &self,
        q: &Queries,
        out: &[i32],
        row_of: impl Fn(usize) -> kvtier::Result<Vec<u8>>,
    ) -> kvtier::Result<()> {
        if q.misses == 0 || q.batch == 0 {
            return Ok(());
        }
        let h = self.hot as usize;
        let present: std::collections::HashSet<i32> = self.tokens[..h].iter().copied().collect();
        let i = (0..self.k as usize)
            .find(|&i| !present.contains(&q.topk[i]))
            .expect("a miss in row 0");
        let want = row_pattern(self.host_locs[q.topk[i] as usize] as usize);
        let got = row_of(out[i] as usize)?;
        if got.iter().any(|&b| b != want) {
            return Err(kvtier::Error::Pool(
                "benchmark self-check failed: a loaded row differs from its host row".into(),
            ));
        }
        Ok(())
    }

    fn bench_cpu(&self, q: &Queries, point: String, args: &BenchArgs) -> kvtier::Result<Vec<Row>> {
        let (h, k, item) = (self.hot as usize, self.k as usize, self.item as usize);
        let host_ptr = self.pool.region_host_addr(&self.host_region)?;
        let host_len = self.host_locs.len() * item;
        // SAFETY: the region holds host_rows rows of `item` bytes and lives in self.pool.
        let host_cache = unsafe { std::slice::from_raw_parts(host_ptr as *const u8, host_len) };
        // What a call mutates: slot tokens, LRU order, device buffer, output.
        let mut st = (
            self.tokens.clone(),
            self.lru.clone(),
            vec![0u8; self.device_rows() * item],
            vec![0i32; q.batch as usize * k],
        );
        let reset = |st: &mut (Vec<i32>, Vec<i16>, Vec<u8>, Vec<i32>)| {
            st.0.copy_from_slice(&self.tokens);
            st.1.copy_from_slice(&self.lru);
        };
        let swap = time_cpu(args, &mut st, reset, |(t, l, device_buffer, out)| {
            let a = SwapInArgs {
                top_k_tokens: Buf::host(&q.topk),
                top_k_stride: k,
                device_buffer_tokens: BufMut::host(t),
                device_buffer_locs: Buf::host(&self.locs),
                buffer_stride: h + 1,
                lru_slots: BufMut::host(l),
                lru_stride: h,
                host_cache_locs: Buf::host(&self.host_locs),
                host_stride: self.context as usize,
                max_tokens: self.context,
                host_cache: Buf::host(host_cache),
                device_buffer: BufMut::host(device_buffer),
                top_k_device_locs: BufMut::host(out),
                out_stride: k,
                req_pool_indices: IndexBuf::I32(Buf::host(&q.req)),
                seq_lens: IndexBuf::I32(Buf::host(&q.seq)),
                num_real_reqs: None,
                num_requests: self.requests,
                num_top_k: self.k,
                hot_buffer_size: self.hot,
                item_size_bytes: self.item,
                skip_io: false,
                miss_plan: None,
            };
            self.tier.swap_in(&a, Stream::null())
        })?;
        let (_, _, device_buffer, out) = &st;
        self.verify(q, out, |row| {
            Ok(device_buffer[row * item..][..item].to_vec())
        })?;
        let bytes = self.missed_bytes(q);
        let limit = time_cpu(
            args,
            &mut st.2,
            |_| {},
            |device_buffer| {
                device_buffer[..bytes as usize].copy_from_slice(&host_cache[..bytes as usize]);
                Ok(())
            },
        )?;
        Ok(vec![
            Row {
                point: point.clone(),
                method: "kvtier swap-in (CPU executor)",
                bytes,
                median_us: swap.0,
                p99_us: swap.1,
                limit: false,
            },
            Row {
                point,
                method: "contiguous memcpy of misses (limit)",
                bytes,
                median_us: limit.0,
                p99_us: limit.1,
                limit: true,
            },
        ])
    }

    fn bench_cuda(
        &self,
        dev: &Arc<CudaDevice>,
        q: &Queries,
        point: String,
        args: &BenchArgs,
    ) -> kvtier::Result<Vec<Row>> {
        let (h, k, item) = (self.hot as usize, self.k as usize, self.item as usize);
        let stream = dev.create_stream()?;
        let timer = EventTimer::new(dev)?;
        let pristine_tokens = DeviceBuffer::from_host(dev, &self.tokens)?;
        let pristine_lru = DeviceBuffer::from_host(dev, &self.lru)?;
        let tokens = DeviceBuffer::from_host(dev, &self.tokens)?;
        let lru = DeviceBuffer::from_host(dev, &self.lru)?;
        let locs = DeviceBuffer::from_host(dev, &self.locs)?;
        let host_locs = DeviceBuffer::from_host(dev, &self.host_locs)?;
        let topk = DeviceBuffer::from_host(dev, &q.topk)?;
        let req = DeviceBuffer::from_host(dev, &q.req)?;
        let seq = DeviceBuffer::from_host(dev, &q.seq)?;
        let device_buffer = DeviceBuffer::<u8>::zeroed(dev, self.device_rows() * item)?;
        let out = DeviceBuffer::<i32>::zeroed(dev, q.batch as usize * k)?;
        let host_base = self.pool.region_device_addr(&self.host_region, dev)?;
        let host_len = self.host_locs.len() * item;
        let (tok_dst, lru_dst) = (tokens.device_ptr(), lru.device_ptr());
        let reset = |s: Stream| -> kvtier::Result<()> {
            // SAFETY: device copies between buffers of equal length, in stream order.
            unsafe {
                dev.copy_device_to_device_async(
                    tok_dst,
                    pristine_tokens.device_ptr(),
                    4 * self.tokens.len(),
                    s,
                )?;
                dev.copy_device_to_device_async(
                    lru_dst,
                    pristine_lru.device_ptr(),
                    2 * self.lru.len(),
                    s,
                )
            }
        };

        let time_strategy = |strategy: SwapInStrategy| -> kvtier::Result<((f64, f64), Vec<i32>)> {
            let t = time_cuda(args, &timer, stream.stream(), reset, |s| {
                // SAFETY: the buffers below live until after the timing's synchronisation.
                let a = unsafe {
                    SwapInArgs {
                        top_k_tokens: topk.as_buf(),
                        top_k_stride: k,
                        device_buffer_tokens: BufMut::device(tok_dst, self.tokens.len()),
                        device_buffer_locs: locs.as_buf(),
                        buffer_stride: h + 1,
                        lru_slots: BufMut::device(lru_dst, self.lru.len()),
                        lru_stride: h,
                        host_cache_locs: host_locs.as_buf(),
                        host_stride: self.context as usize,
                        max_tokens: self.context,
                        host_cache: Buf::device(host_base, host_len),
                        device_buffer: BufMut::device(
                            device_buffer.device_ptr(),
                            device_buffer.len(),
                        ),
                        top_k_device_locs: BufMut::device(out.device_ptr(), out.len()),
                        out_stride: k,
                        req_pool_indices: IndexBuf::I32(req.as_buf()),
                        seq_lens: IndexBuf::I32(seq.as_buf()),
                        num_real_reqs: None,
                        num_requests: self.requests,
                        num_top_k: self.k,
                        hot_buffer_size: self.hot,
                        item_size_bytes: self.item,
                        skip_io: false,
                        miss_plan: None,
                    }
                };
                self.tier.swap_in_with(&a, strategy, s)
            })?;
            self.tier.check(stream.stream())?;
            Ok((t, out.to_vec()?))
        };
        let (swap, out_kvtier) = time_strategy(SwapInStrategy::PlanThenCopy)?;
        self.verify(q, &out_kvtier, |row| device_buffer.read(row * item, item))?;
        let (baseline, out_baseline) = time_strategy(SwapInStrategy::OneBlockPerRequest)?;
        if out_kvtier != out_baseline {
            return Err(kvtier::Error::Pool(
                "benchmark self-check failed: the two designs gave different page tables".into(),
            ));
        }
        let bytes = self.missed_bytes(q);
        let dst = device_buffer.device_ptr();
        let limit = time_cuda(
            args,
            &timer,
            stream.stream(),
            |_| Ok(()),
            |s| {
                // SAFETY: `bytes` fit both the registered host cache and the device buffer.
                unsafe {
                    dev.copy_host_to_device_async(
                        dst,
                        self.pool.region_host_addr(&self.host_region)? as *const u8,
                        bytes as usize,
                        s,
                    )
                }
            },
        )?;

        Ok(vec![
            Row {
                point: point.clone(),
                method: "kvtier swap-in (plan + wide copy)",
                bytes,
                median_us: swap.0,
                p99_us: swap.1,
                limit: false,
            },
            Row {
                point: point.clone(),
                method: "one block per request (SGLang)",
                bytes,
                median_us: baseline.0,
                p99_us: baseline.1,
                limit: false,
            },
            Row {
                point,
                method: "contiguous H2D copy of misses (limit)",
                bytes,
                median_us: limit.0,
                p99_us: limit.1,
                limit: true,
            },
        ])
    }
}

/// The byte every byte of host row `row` holds.
fn row_pattern(row: usize) -> u8 {
    (row.wrapping_mul(2_654_435_761) >> 7) as u8
}
