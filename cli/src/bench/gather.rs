//! The `gather` scenario: the top-k fetch of one layer for a batch, over the
//! grid k × entry size × batch × context × index distribution. Per point,
//! five methods move the same useful bytes out of the same pool memory:
//!
//! 1. kvtier's gather kernel (or the CPU executor); on a GPU also with its
//!    other copy methods, line-aligned (`CopyMethod::LineAligned`) and
//!    merged runs (`CopyMethod::MergedRuns`, whose runs the `locality`
//!    indices hold);
//! 2. the limit: one contiguous copy of as many bytes;
//! 3. one `cudaMemcpyAsync` per entry;
//! 4. a host gather into pinned staging, then one copy;
//! 5. the full-context fetch: each request's whole layer copied contiguously
//!    (it moves `context / k` times the bytes).

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use serde_json::json;

use kvtier::pool::PoolOptions;
use kvtier::{
    CopyMethod, CopyPath, Executor, GatherBatch, LayerFirstLayout, Pool, Region, Stream, Tier,
};

use super::copy_choice::{bench_label, other_method};
use super::{Bench, Clock, Indices, Measurement, PoolPages, Timing, invalid, named};
use crate::transfer::{self, Dir, ExecVec, Staging};

const SCENARIO: &str = "gather";

struct Grid {
    entries: Vec<u32>,
    contexts: Vec<u32>,
    batches: Vec<u32>,
    ks: Vec<u32>,
    indices: Vec<Indices>,
    /// Pages of each pool; `given`: named on the command line (then a
    /// parameter of every point).
    pages: Vec<PoolPages>,
    pages_given: bool,
}

fn grid(b: &Bench) -> kvtier::Result<Grid> {
    let a = b.args;
    let or = |v: &Vec<u32>, d: &[u32]| if v.is_empty() { d.to_vec() } else { v.clone() };
    let g = Grid {
        entries: b.entries(&["fp8-dsa", "bf16-mla"])?,
        contexts: or(&a.context, &[32768, 131072]),
        batches: b.batches(&[1, 8, 64]),
        ks: or(&a.k, &[256, 512, 1024, 2048]),
        indices: if a.indices.is_empty() {
            vec![Indices::Uniform, Indices::Locality]
        } else {
            a.indices.clone()
        },
        pages: if a.host_pages.is_empty() {
            vec![PoolPages::Base]
        } else {
            a.host_pages.clone()
        },
        pages_given: !a.host_pages.is_empty(),
    };
    let min_context = *g.contexts.iter().min().expect("non-empty");
    if let Some(&k) = g.ks.iter().find(|&&k| k == 0 || k > min_context) {
        return Err(invalid(
            "--k",
            format!("{k} must be in 1..=context ({min_context})"),
        ));
    }
    Ok(g)
}

pub(super) fn points(b: &Bench) -> kvtier::Result<u64> {
    let g = grid(b)?;
    Ok((g.entries.len()
        * g.contexts.len()
        * g.pages.len()
        * g.batches.len()
        * g.ks.len()
        * g.indices.len()) as u64)
}

pub(super) fn run(b: &Bench) -> kvtier::Result<Vec<Measurement>> {
    let g = grid(b)?;
    let budget = b.pool_budget()?;
    let max_batch = *g.batches.iter().max().expect("non-empty");
    let mut rows = Vec::new();
    for (&entry, &context, &pages) in g
        .entries
        .iter()
        .flat_map(|e| g.contexts.iter().map(move |c| (e, c)))
        .flat_map(|(e, c)| g.pages.iter().map(move |p| (e, c, p)))
    {
        let layout = LayerFirstLayout::new(entry, 1, context)?;
        // Distinct regions within the memory budget; rows beyond share them.
        let fit = (budget / layout.region_bytes().max(1)).max(1);
        let distinct = (max_batch as u64).min(fit) as u32;
        let options = PoolOptions {
            host_pages: pages.host_pages(),
            ..PoolOptions::default()
        };
        let device = b.pool_device(Pool::device_bytes_for(&layout, distinct)?);
        let pool = Pool::create_on(layout, vec![device], options)?;
        let mut rng = StdRng::seed_from_u64(b.args.seed ^ ((entry as u64) << 32) ^ context as u64);
        let regions = fill_pool(&pool, distinct, &mut rng)?;
        if g.pages_given {
            // What the kernel gave (the filled regions are touched).
            let huge = pool.huge_page_bytes()?;
            let filled = distinct as u64 * layout.region_bytes();
            b.progress.suspend(|| {
                println!(
                    "gather pool ({entry} B, context {context}, {} pages): huge pages back {} of its \
                     mapping ({} of regions filled)",
                    pages.name(),
                    super::count(huge, "byte", "bytes"),
                    super::count(filled, "byte", "bytes"),
                )
            });
        }
        let mut tier = Tier::new(pool.clone(), b.exec.clone(), max_batch)?;
        for slot in 0..max_batch {
            tier.bind_slot(slot, &regions[(slot % distinct) as usize], Stream::null())?;
        }
        if let Executor::Cuda(dev) = &b.exec {
            dev.synchronize_all()?; // the timed work runs on another stream
        }
        let setup = Setup {
            tier: &tier,
            pool: &pool,
            regions: &regions,
            entry,
            context,
            distinct,
            pages: g.pages_given.then_some(pages),
        };
        for &batch in &g.batches {
            for &k in &g.ks {
                for &indices in &g.indices {
                    b.progress.set_message(format!(
                        "gather: {entry} B, context {context}, batch {batch}, k {k}, {}",
                        indices.name()
                    ));
                    let inp = Inputs::draw(batch, k, context, indices, &mut rng);
                    let point = setup.measure(b, &inp)?;
                    b.point_done(&point)?;
                    rows.extend(point);
                }
            }
        }
    }
    Ok(rows)
}

/// Allocates `n` regions and fills their one layer with random bytes (touching
/// every page: untouched anonymous memory reads as the zero page).
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

/// One batch's host-side inputs: slot per row, lengths, top-k indices.
struct Inputs {
    batch: u32,
    k: u32,
    indices: Indices,
    req_slots: Vec<i32>,
    seq_lens: Vec<i32>,
    topk: Vec<i32>,
}

impl Inputs {
    fn draw(batch: u32, k: u32, context: u32, indices: Indices, rng: &mut StdRng) -> Self {
        let mut topk = Vec::with_capacity((batch * k) as usize);
        for _ in 0..batch {
            match indices {
                Indices::Uniform => {
                    let picks = rand::seq::index::sample(rng, context as usize, k as usize);
                    topk.extend(picks.into_iter().map(|t| t as i32));
                }
                Indices::Locality => {
                    // Runs of 1..=32 neighbours at uniform starts, distinct tokens.
                    let mut taken = vec![false; context as usize];
                    let mut row = Vec::with_capacity(k as usize);
                    while row.len() < k as usize {
                        let start = rng.random_range(0..context);
                        let len = rng.random_range(1..=32u32);
                        for t in start..(start + len).min(context) {
                            if row.len() < k as usize && !taken[t as usize] {
                                taken[t as usize] = true;
                                row.push(t as i32);
                            }
                        }
                    }
                    topk.extend(row);
                }
            }
        }
        Inputs {
            batch,
            k,
            indices,
            req_slots: (0..batch as i32).collect(),
            seq_lens: vec![context as i32; batch as usize],
            topk,
        }
    }
}

struct Setup<'a> {
    tier: &'a Tier,
    pool: &'a Arc<Pool>,
    regions: &'a [Region],
    entry: u32,
    context: u32,
    distinct: u32,
    /// The pool's pages, where `--host-pages` named them.
    pages: Option<PoolPages>,
}

impl Setup<'_> {
    fn region_of(&self, row: usize) -> &Region {
        &self.regions[row % self.distinct as usize]
    }

    /// Host address of the entry of top-k position `i` (row-major over the batch).
    fn source_of(&self, inp: &Inputs, i: usize) -> kvtier::Result<u64> {
        let row = i / inp.k as usize;
        let base = self.pool.region_host_addr(self.region_of(row))?;
        Ok(base + inp.topk[i] as u64 * self.entry as u64)
    }

    /// Checks the first and last gathered entries against the pool (a
    /// benchmark that moves the wrong bytes measures nothing).
    fn verify(&self, method: &str, inp: &Inputs, out: &[u8]) -> kvtier::Result<()> {
        let entry = self.entry as usize;
        for i in [0, (inp.batch * inp.k) as usize - 1] {
            let mut want = vec![0u8; entry];
            let region = self.region_of(i / inp.k as usize);
            self.pool
                .read_tokens(region, 0, inp.topk[i] as u32, &mut want)?;
            if out[i * entry..][..entry] != want[..] {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: {method} put the wrong bytes in entry {i}"
                )));
            }
        }
        Ok(())
    }

    fn params(&self, inp: &Inputs) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("k", json!(inp.k)),
            ("entry", json!(self.entry)),
            ("batch", json!(inp.batch)),
            ("context", json!(self.context)),
            ("indices", json!(inp.indices.name())),
            ("distinct_regions", json!(self.distinct.min(inp.batch))),
        ]
        .into_iter()
        .chain(self.pages.map(|p| ("host_pages", json!(p.name()))))
        .collect()
    }

    fn measure(&self, b: &Bench, inp: &Inputs) -> kvtier::Result<Vec<Measurement>> {
        let entry = self.entry as usize;
        let useful = inp.batch as usize * inp.k as usize * entry;
        let layer_bytes = self.context as usize * entry;
        let full = inp.batch as usize * layer_bytes;
        let sources: Vec<u64> = (0..(inp.batch * inp.k) as usize)
            .map(|i| self.source_of(inp, i))
            .collect::<kvtier::Result<_>>()?;
        let region_bases: Vec<u64> = (0..inp.batch as usize)
            .map(|r| self.pool.region_host_addr(self.region_of(r)))
            .collect::<kvtier::Result<_>>()?;
        let first = self.pool.region_host_addr(&self.regions[0])?;
        // The limit reads `useful` contiguous bytes from the first region on.
        if useful as u64 > self.distinct as u64 * self.pool.region_stride() {
            return Err(invalid(
                "--pool-memory",
                format!(
                    "too small for the limit's {} of contiguous memory; raise it",
                    super::count(useful as u64, "byte", "bytes")
                ),
            ));
        }
        let mut staging = Staging::new(&b.exec, useful)?;
        let params = self.params(inp);
        let exec = &b.exec;
        let clock = Clock::new(exec)?;
        let slots = ExecVec::from_host(exec, &inp.req_slots)?;
        let seq_lens = ExecVec::from_host(exec, &inp.seq_lens)?;
        let topk = ExecVec::from_host(exec, &inp.topk)?;
        let out = ExecVec::<u8>::zeroed(exec, useful)?;
        let layer = ExecVec::<u8>::zeroed(exec, layer_bytes)?;
        let none = |_: Stream| Ok(());

        let kv = b.time(&clock, Timing::Device, none, |s| {
            let batch = GatherBatch::new(slots.buf(), seq_lens.buf(), topk.buf(), inp.k);
            // SAFETY: one method runs at a time.
            let out = unsafe { out.buf_mut() };
            // the method every run has timed under this name (the default
            // gather takes it at entries of whole 128-byte lines only)
            self.tier
                .gather_with(0, &batch, out, CopyMethod::WarpVectors, s)
        })?;
        self.tier.check(clock.stream())?;
        self.verify("the kvtier gather", inp, &out.to_vec()?)?;
        // The other copy methods, on a GPU (the CPU executor has one way).
        let mut others = Vec::new();
        if let Executor::Cuda(_) = exec {
            for method in CopyMethod::ALL {
                let Some((name, what)) = other_method(CopyPath::Gather, method) else {
                    continue;
                };
                // Other bytes first, untimed, so that the check below sees
                // what this method wrote.
                // SAFETY: no method is running; the length is the buffer's.
                unsafe { out.write(&vec![0x5Au8; useful])? };
                let t = b.time(&clock, Timing::Device, none, |s| {
                    let batch = GatherBatch::new(slots.buf(), seq_lens.buf(), topk.buf(), inp.k);
                    // SAFETY: one method runs at a time.
                    let out = unsafe { out.buf_mut() };
                    self.tier.gather_with(0, &batch, out, method, s)
                })?;
                self.tier.check(clock.stream())?;
                self.verify(&what, inp, &out.to_vec()?)?;
                others.push((name, t));
            }
        }
        let dst = out.addr();
        // SAFETY (all four): the sources are pool entries of `entry` bytes
        // (registered for the CUDA executor), `first` starts at least
        // `useful` of them (checked above), and the destinations are `out`
        // and `layer`, of the sizes copied.
        let limit = b.time(&clock, Timing::Device, none, |s| unsafe {
            transfer::contiguous(exec, Dir::HostToDevice, first, dst, useful, s)
        })?;
        // The floor of a small gather (the copy-path goal at batch 1, k 256
        // is judged against it), on a GPU: a gather launch that moves
        // nothing (one row of padding: a launch, three index reads and one
        // zeroed row), then the limit's copy, in one timing.
        let floor = match exec {
            Executor::Cuda(_) => {
                let pad_slots = ExecVec::from_host(exec, &[-1i32])?;
                let pad_lens = ExecVec::from_host(exec, &[0i32])?;
                let pad_topk = ExecVec::from_host(exec, &[-1i32])?;
                let pad_out = ExecVec::<u8>::zeroed(exec, entry)?;
                Some(b.time(&clock, Timing::Device, none, |s| {
                    let batch =
                        GatherBatch::new(pad_slots.buf(), pad_lens.buf(), pad_topk.buf(), 1);
                    // SAFETY: nothing else uses pad_out.
                    let o = unsafe { pad_out.buf_mut() };
                    self.tier
                        .gather_with(0, &batch, o, CopyMethod::WarpVectors, s)?;
                    // SAFETY: as the limit's copy below.
                    unsafe { transfer::contiguous(exec, Dir::HostToDevice, first, dst, useful, s) }
                })?)
            }
            Executor::Cpu => None,
        };
        let pairs: Vec<(u64, u64)> = (sources.iter().enumerate())
            .map(|(i, &src)| (src, dst + (i * entry) as u64))
            .collect();
        let each = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            transfer::per_entry(exec, Dir::HostToDevice, &pairs, entry, s)
        })?;
        self.verify("a copy per entry", inp, &out.to_vec()?)?;
        let staged = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            transfer::staged_gather(exec, &sources, &mut staging, dst, entry, s)
        })?;
        self.verify("the staged gather", inp, &out.to_vec()?)?;
        let whole = b.time(&clock, Timing::Device, none, |s| unsafe {
            for &base in &region_bases {
                transfer::contiguous(exec, Dir::HostToDevice, base, layer.addr(), layer_bytes, s)?;
            }
            Ok(())
        })?;
        let row = |cpu, cuda, bytes, t, limit| {
            Measurement::new(SCENARIO, named(exec, cpu, cuda), &params, bytes, t, limit)
        };
        let mut rows = vec![row(
            "kvtier gather (CPU executor)",
            bench_label(CopyPath::Gather, CopyMethod::WarpVectors),
            useful,
            kv,
            false,
        )];
        for (name, t) in others {
            rows.push(row("", name, useful, t, false));
        }
        if let Some(t) = floor {
            rows.push(row(
                "",
                "floor: an empty gather launch + the contiguous H2D copy",
                useful,
                t,
                false,
            ));
        }
        rows.extend([
            row(
                "contiguous memcpy (limit)",
                "contiguous H2D copy (limit)",
                useful,
                limit,
                true,
            ),
            row(
                "per-entry memcpy",
                "cudaMemcpyAsync per entry",
                useful,
                each,
                false,
            ),
            row(
                "host gather to staging + one memcpy",
                "host gather to pinned staging + one H2D copy",
                useful,
                staged,
                false,
            ),
            row(
                "full-context fetch (memcpy per request)",
                "full-context fetch (one H2D copy per request)",
                full,
                whole,
                false,
            ),
        ]);
        Ok(rows)
    }
}
