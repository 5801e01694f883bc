//! The `writeback` scenario: new KV entries from device KV buffers into the
//! pool, layer-first.
//!
//! * prefill: one layer of a prefill chunk (`--prefill-tokens` tokens of one
//!   request), from rows scattered over the layer's KV buffer (`"sources":
//!   "scattered"`: SGLang's `out_cache_loc` after its allocator's free list
//!   has been churned) and from consecutive rows (`"in order"`: a fresh
//!   allocation of whole pages), the runs `CopyMethod::MergedRuns` merges;
//! * decode: every layer (`--layers`) of the newest token of each request of
//!   a batch.
//!
//! Per point: kvtier's writeback (on a GPU also with its other copy methods,
//! `CopyMethod::LineAligned` and `CopyMethod::MergedRuns`; the prefill's
//! scattered source rows and the decode's one token a request hold almost no
//! runs, so the merged-runs kernel moves nearly every row alone there, and
//! every row of an in-order prefill is in a run of 8); the
//! limit (one contiguous device→host copy of the same bytes); one
//! `cudaMemcpyAsync` per entry; one copy into pinned staging, then a host
//! scatter into the pool.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use serde_json::json;

use kvtier::{
    Buf, CopyMethod, CopyPath, Executor, LayerFirstLayout, Pool, Region, Stream, Tier,
    WritebackItems,
};

use super::copy_choice::{bench_label, other_method};
use super::{Bench, Clock, Measurement, Timing, count, invalid, named};
use crate::transfer::{self, Dir, ExecVec, Staging};

const SCENARIO: &str = "writeback";

/// Tokens per decode region (the newest token is the last one).
const DECODE_TOKENS: u32 = 16;

fn chunks(b: &Bench) -> Vec<u32> {
    if b.args.prefill_tokens.is_empty() {
        vec![1024, 8192]
    } else {
        b.args.prefill_tokens.clone()
    }
}

pub(super) fn points(b: &Bench) -> kvtier::Result<u64> {
    if b.args.layers == 0 || chunks(b).contains(&0) {
        return Err(invalid(
            "--layers/--prefill-tokens",
            "need at least one layer and one token",
        ));
    }
    let entries = b.entries(&["fp8-dsa", "bf16-mla"])?.len();
    Ok((entries * (chunks(b).len() + b.batches(&[1, 8, 64]).len())) as u64)
}

pub(super) fn run(b: &Bench) -> kvtier::Result<Vec<Measurement>> {
    let mut rows = Vec::new();
    for entry in b.entries(&["fp8-dsa", "bf16-mla"])? {
        for tokens in chunks(b) {
            b.progress.set_message(format!(
                "writeback: {entry} B, prefill of {}",
                count(tokens, "token", "tokens")
            ));
            let mut point = prefill(b, entry, tokens, false)?;
            point.extend(prefill(b, entry, tokens, true)?);
            b.point_done(&point)?;
            rows.extend(point);
        }
        let batches = b.batches(&[1, 8, 64]);
        let max_batch = *batches.iter().max().expect("non-empty");
        let layout = LayerFirstLayout::new(entry, b.args.layers, DECODE_TOKENS)?;
        let pool = Pool::create(
            layout,
            b.pool_device(Pool::device_bytes_for(&layout, max_batch)?),
        )?;
        let regions: Vec<Region> = (0..max_batch)
            .map(|_| pool.alloc_region())
            .collect::<kvtier::Result<_>>()?;
        let mut tier = Tier::new(pool.clone(), b.exec.clone(), max_batch)?;
        for (slot, r) in regions.iter().enumerate() {
            tier.bind_slot(slot as u32, r, Stream::null())?;
        }
        if let Executor::Cuda(dev) = &b.exec {
            dev.synchronize_all()?;
        }
        for batch in batches {
            b.progress.set_message(format!(
                "writeback: {entry} B, decode of batch {batch}, {}",
                count(b.args.layers, "layer", "layers")
            ));
            let point = decode(b, &tier, &pool, &regions, entry, batch)?;
            b.point_done(&point)?;
            rows.extend(point);
        }
    }
    Ok(rows)
}

/// Everything a writeback point needs: items, the source rows, where each
/// entry lands in the pool.
struct Point<'a> {
    params: Vec<(&'static str, serde_json::Value)>,
    entry: usize,
    /// The source bytes (one layer's rows, or every layer's rows back to back).
    src: Vec<u8>,
    /// Per entry: (offset of its source row in `src`, its pool host address),
    /// in `src` order for the staged scatter.
    moves: Vec<(usize, u64)>,
    pool: &'a Arc<Pool>,
    /// The first pool byte the limit writes to (as many contiguous bytes).
    pool_base: u64,
}

impl Point<'_> {
    fn bytes(&self) -> usize {
        self.moves.len() * self.entry
    }

    /// Checks the first and last entries landed where they belong.
    fn verify(&self, method: &str) -> kvtier::Result<()> {
        for &(off, addr) in [self.moves.first(), self.moves.last()]
            .into_iter()
            .flatten()
        {
            // SAFETY: `addr` is an entry of a live pool region.
            let got = unsafe { std::slice::from_raw_parts(addr as *const u8, self.entry) };
            if got != &self.src[off..][..self.entry] {
                return Err(kvtier::Error::Pool(format!(
                    "benchmark self-check failed: {method} wrote the wrong bytes"
                )));
            }
        }
        let _ = self.pool;
        Ok(())
    }

    /// Writes other bytes over the entries `verify` checks, so that it sees
    /// what the method after it wrote.
    fn spoil(&self) {
        for &(off, addr) in [self.moves.first(), self.moves.last()]
            .into_iter()
            .flatten()
        {
            let other: Vec<u8> = self.src[off..][..self.entry].iter().map(|b| !b).collect();
            // SAFETY: `addr` is an entry of a live pool region; no call runs.
            unsafe { std::ptr::copy_nonoverlapping(other.as_ptr(), addr as *mut u8, self.entry) };
        }
    }

    /// Times the methods on the source at `src` (the executor's copy of
    /// `self.src`); `kvtier_call` runs kvtier's writeback from it with a
    /// copy method (on a GPU each method is timed).
    fn measure(
        &self,
        b: &Bench,
        src: u64,
        kvtier_call: impl Fn(CopyMethod, Stream) -> kvtier::Result<()>,
    ) -> kvtier::Result<Vec<Measurement>> {
        let bytes = self.bytes();
        let exec = &b.exec;
        let clock = Clock::new(exec)?;
        let mut staging = Staging::new(exec, bytes)?;
        let dests: Vec<u64> = self.moves.iter().map(|&(_, addr)| addr).collect();
        let pairs: Vec<(u64, u64)> = self
            .moves
            .iter()
            .map(|&(off, addr)| (src + off as u64, addr))
            .collect();
        let none = |_: Stream| Ok(());
        let kv = b.time(&clock, Timing::Device, none, |s| {
            kvtier_call(CopyMethod::WarpVectors, s)
        })?;
        clock.sync()?;
        self.verify("the kvtier writeback")?;
        // The other copy methods, on a GPU (the CPU executor has one way).
        let mut others = Vec::new();
        if let Executor::Cuda(_) = exec {
            for method in CopyMethod::ALL {
                let Some((name, what)) = other_method(CopyPath::Writeback, method) else {
                    continue;
                };
                self.spoil();
                let t = b.time(&clock, Timing::Device, none, |s| kvtier_call(method, s))?;
                clock.sync()?;
                self.verify(&what)?;
                others.push((name, t));
            }
        }
        // SAFETY (all three): the source is `src` (at least `bytes`, device
        // memory for the CUDA executor), the destinations pool entries (and
        // `bytes` contiguous pool bytes from `pool_base`), registered for the
        // CUDA executor.
        let limit = b.time(&clock, Timing::Device, none, |s| unsafe {
            transfer::contiguous(exec, Dir::DeviceToHost, src, self.pool_base, bytes, s)
        })?;
        let each = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            transfer::per_entry(exec, Dir::DeviceToHost, &pairs, self.entry, s)
        })?;
        self.verify("a copy per entry")?;
        let staged = b.time(&clock, Timing::HostDriven, none, |s| unsafe {
            transfer::staged_scatter(exec, src, &mut staging, &dests, self.entry, s)
        })?;
        self.verify("the staged scatter")?;
        let row = |cpu, cuda, t, limit| {
            Measurement::new(
                SCENARIO,
                named(exec, cpu, cuda),
                &self.params,
                bytes,
                t,
                limit,
            )
        };
        let mut rows = vec![row(
            "kvtier writeback (CPU executor)",
            bench_label(CopyPath::Writeback, CopyMethod::WarpVectors),
            kv,
            false,
        )];
        for (name, t) in others {
            rows.push(row("", name, t, false));
        }
        rows.extend([
            row(
                "contiguous memcpy (limit)",
                "contiguous D2H copy (limit)",
                limit,
                true,
            ),
            row("per-entry memcpy", "cudaMemcpyAsync per entry", each, false),
            row(
                "one memcpy to staging + host scatter",
                "one D2H copy to pinned staging + host scatter",
                staged,
                false,
            ),
        ]);
        Ok(rows)
    }
}

/// One layer of a prefill chunk: token t of one request from row
/// `src_rows[t]` of the layer's KV buffer (a random permutation, or with
/// `in_order` row t).
fn prefill(b: &Bench, entry: u32, tokens: u32, in_order: bool) -> kvtier::Result<Vec<Measurement>> {
    let layout = LayerFirstLayout::new(entry, 1, tokens)?;
    let pool = Pool::create(layout, b.pool_device(Pool::device_bytes_for(&layout, 1)?))?;
    let region = pool.alloc_region()?;
    let mut tier = Tier::new(pool.clone(), b.exec.clone(), 1)?;
    tier.bind_slot(0, &region, Stream::null())?;
    if let Executor::Cuda(dev) = &b.exec {
        dev.synchronize_all()?;
    }
    let mut rng = StdRng::seed_from_u64(b.args.seed ^ ((entry as u64) << 32) ^ tokens as u64);
    let e = entry as usize;
    let mut src = vec![0u8; tokens as usize * e];
    rng.fill_bytes(&mut src);
    let mut src_rows: Vec<i64> = (0..tokens as i64).collect();
    if !in_order {
        src_rows.shuffle(&mut rng);
    }
    let slots = vec![0i32; tokens as usize];
    let toks: Vec<i32> = (0..tokens as i32).collect();
    let base = pool.region_host_addr(&region)?;
    // In source order: source row r goes to the token t with src_rows[t] = r.
    let mut moves = vec![(0usize, 0u64); tokens as usize];
    for (t, &r) in src_rows.iter().enumerate() {
        moves[r as usize] = (r as usize * e, base + (t * e) as u64);
    }
    let point = Point {
        params: vec![
            ("phase", json!("prefill")),
            (
                "sources",
                json!(if in_order { "in order" } else { "scattered" }),
            ),
            ("tokens", json!(tokens)),
            ("layers", json!(1)),
            ("entry", json!(entry)),
        ],
        entry: e,
        src,
        moves,
        pool: &pool,
        pool_base: base,
    };
    let items = Items::new(&b.exec, &slots, &toks, &src_rows)?;
    let source = ExecVec::from_host(&b.exec, &point.src)?;
    point.measure(b, source.addr(), |method, s| {
        tier.writeback_layer_with(0, &items.items(), source.buf(), method, s)
    })
}

/// Every layer of the newest token of each of `batch` requests: item b takes
/// row b of every layer's KV buffer (layers back to back in one allocation).
fn decode(
    b: &Bench,
    tier: &Tier,
    pool: &Arc<Pool>,
    regions: &[Region],
    entry: u32,
    batch: u32,
) -> kvtier::Result<Vec<Measurement>> {
    let (e, layers) = (entry as usize, b.args.layers as usize);
    let mut rng = StdRng::seed_from_u64(b.args.seed ^ ((entry as u64) << 32) ^ batch as u64);
    let layer_len = batch as usize * e;
    let mut src = vec![0u8; layers * layer_len];
    rng.fill_bytes(&mut src);
    let layout = pool.layout();
    let mut moves = Vec::with_capacity(layers * batch as usize);
    for l in 0..layers {
        let at = layout.entry_offset(l as u32, DECODE_TOKENS - 1)?;
        for (r, region) in regions.iter().take(batch as usize).enumerate() {
            moves.push((l * layer_len + r * e, pool.region_host_addr(region)? + at));
        }
    }
    let slots: Vec<i32> = (0..batch as i32).collect();
    let toks = vec![DECODE_TOKENS as i32 - 1; batch as usize];
    let src_rows: Vec<i64> = (0..batch as i64).collect();
    let point = Point {
        params: vec![
            ("phase", json!("decode")),
            ("batch", json!(batch)),
            ("layers", json!(layers)),
            ("entry", json!(entry)),
        ],
        entry: e,
        src,
        moves,
        pool,
        pool_base: pool.region_host_addr(&regions[0])?,
    };
    let items = Items::new(&b.exec, &slots, &toks, &src_rows)?;
    let source = ExecVec::from_host(&b.exec, &point.src)?;
    let (src, loc) = (source.addr(), b.exec.location());
    // SAFETY: the layers lie back to back in `source`, which outlives `kv`.
    // Registering is set-up work, outside the timing.
    let bufs: Vec<Buf<u8>> = (0..layers)
        .map(|l| unsafe { Buf::from_raw(src + (l * layer_len) as u64, layer_len, loc) })
        .collect();
    let kv = tier.register_kv_layers(&bufs)?;
    point.measure(b, src, |method, s| {
        tier.writeback_all_layers_with(&items.items(), &kv, method, s)
    })
}

/// The item lists where the executor reads them.
struct Items {
    slots: ExecVec<i32>,
    tokens: ExecVec<i32>,
    rows: ExecVec<i64>,
}

impl Items {
    fn new(exec: &Executor, slots: &[i32], tokens: &[i32], rows: &[i64]) -> kvtier::Result<Self> {
        Ok(Items {
            slots: ExecVec::from_host(exec, slots)?,
            tokens: ExecVec::from_host(exec, tokens)?,
            rows: ExecVec::from_host(exec, rows)?,
        })
    }

    fn items(&self) -> WritebackItems<'_> {
        WritebackItems {
            slots: self.slots.buf(),
            tokens: self.tokens.buf(),
            src_rows: self.rows.buf(),
        }
    }
}
