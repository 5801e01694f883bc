//! The gather and the writebacks (one layer; every layer of a decode token)
//! through a [`Tier`] on each executor, from pools filled alike.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

use kvtier::{
    CopyMethod, DeviceSpec, Executor, GatherBatch, LayerFirstLayout, Pool, Region, Stream, Tier,
    WritebackItems,
};

use super::snapshot::{Snapshot, Verdict, settle};
use super::{Row, run_cases};
use crate::transfer::ExecVec;

/// A pool whose regions hold random bytes (from the seed), and a tier on
/// one executor with slot `s` bound to region `bindings[s]`.
pub(super) struct Fixture {
    pub pool: Arc<Pool>,
    pub regions: Vec<Region>,
    pub tier: Tier,
}

/// The shape of a pool and its slot table.
#[derive(Clone, Debug)]
pub(super) struct PoolShape {
    pub layout: LayerFirstLayout,
    pub regions: u32,
    /// Slot → region; None leaves the slot unbound.
    pub bindings: Vec<Option<u32>>,
    pub fill_seed: u64,
}

impl PoolShape {
    pub fn build(&self, exec: &Executor) -> kvtier::Result<Fixture> {
        let device = DeviceSpec::Anon {
            bytes: Pool::device_bytes_for(&self.layout, self.regions)?,
        };
        let pool = Pool::create(self.layout, device)?;
        let mut rng = StdRng::seed_from_u64(self.fill_seed);
        let mut layer = vec![0u8; self.layout.layer_bytes() as usize];
        let mut regions = Vec::new();
        for _ in 0..self.regions {
            let region = pool.alloc_region()?;
            for l in 0..self.layout.layers() {
                rng.fill_bytes(&mut layer);
                pool.write_tokens(&region, l, 0, &layer)?;
            }
            regions.push(region);
        }
        let mut tier = Tier::new(pool.clone(), exec.clone(), self.bindings.len() as u32)?;
        for (slot, r) in self.bindings.iter().enumerate() {
            if let Some(r) = r {
                tier.bind_slot(slot as u32, &regions[*r as usize], Stream::null())?;
            }
        }
        Ok(Fixture {
            pool,
            regions,
            tier,
        })
    }

    /// A random shape: 1-3 layers, up to 700 tokens per region, up to 4
    /// regions, entries of 8 to 1160 bytes (656 and 1152 often), every
    /// region bound to one slot and one slot left unbound.
    fn random(rng: &mut StdRng) -> kvtier::Result<Self> {
        let entry = match rng.random_range(0..4) {
            0 => 656,
            1 => 1152,
            _ => 8 * rng.random_range(1..=145),
        };
        let layout =
            LayerFirstLayout::new(entry, rng.random_range(1..=3), rng.random_range(1..=700))?;
        let regions = rng.random_range(1..=4u32);
        let mut bindings: Vec<Option<u32>> = (0..regions).map(Some).collect();
        bindings.push(None);
        let turn = rng.random_range(0..bindings.len());
        bindings.rotate_left(turn);
        Ok(PoolShape {
            layout,
            regions,
            bindings,
            fill_seed: rng.next_u64(),
        })
    }

    /// Every byte of every region, layer by layer.
    fn dump(&self, fx: &Fixture, snap: &mut Snapshot) -> kvtier::Result<()> {
        let mut layer = vec![0u8; self.layout.layer_bytes() as usize];
        for (i, region) in fx.regions.iter().enumerate() {
            for l in 0..self.layout.layers() {
                fx.pool.read_tokens(region, l, 0, &mut layer)?;
                snap.add(format!("pool region {i} layer {l}"), &layer);
            }
        }
        Ok(())
    }

    /// A slot to name: mostly bound ones; with `hostile`, now and then an
    /// unbound one, one past the table, or a negative one; -1 (padding)
    /// sometimes.
    fn slot(&self, rng: &mut StdRng, hostile: bool) -> i32 {
        let n = self.bindings.len() as i32;
        match rng.random_range(0..20) {
            0 => -1,
            1 if hostile => n + rng.random_range(0..3),
            2 if hostile => -2 - rng.random_range(0..5),
            3 if hostile => rng.random_range(0..n), // may be the unbound one
            _ => {
                let bound: Vec<i32> = (0..n)
                    .filter(|&s| self.bindings[s as usize].is_some())
                    .collect();
                bound[rng.random_range(0..bound.len())]
            }
        }
    }
}

/// One gather: a batch of rows naming slots, lengths and top-k indices.
#[derive(Clone)]
pub(super) struct GatherCase {
    shape: PoolShape,
    layer: u32,
    k: u32,
    stride: u32,
    req_slots: Vec<i32>,
    seq_lens: Vec<i32>,
    pub topk: Vec<i32>,
}

/// A gather case's pool, tier and buffers on one executor.
pub(super) struct LoadedGather {
    fx: Fixture,
    slots: ExecVec<i32>,
    seq: ExecVec<i32>,
    pub topk: ExecVec<i32>,
    out: ExecVec<u8>,
}

impl LoadedGather {
    /// The sync point: the bad indices the kernel recorded.
    pub fn check(&self) -> kvtier::Result<()> {
        self.fx.tier.check(Stream::null())
    }
}

impl GatherCase {
    /// A random case; odd seeds are hostile.
    pub fn random(seed: u64) -> kvtier::Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let hostile = seed % 2 == 1;
        let shape = PoolShape::random(&mut rng)?;
        let tokens = shape.layout.tokens_per_region() as i32;
        let batch = rng.random_range(1..=12usize);
        let k = rng.random_range(1..=600u32);
        let stride = k + rng.random_range(0..3);
        let req_slots: Vec<i32> = (0..batch).map(|_| shape.slot(&mut rng, hostile)).collect();
        let seq_lens: Vec<i32> = (0..batch)
            .map(|_| match rng.random_range(0..20) {
                0 if hostile => tokens + rng.random_range(1..9),
                1 if hostile => -rng.random_range(1..9),
                2 => 0,
                _ => rng.random_range(1..=tokens),
            })
            .collect();
        let mut topk = vec![0i32; batch * stride as usize];
        for (b, row) in topk.chunks_mut(stride as usize).enumerate() {
            let len = seq_lens[b];
            for t in row.iter_mut() {
                *t = match rng.random_range(0..40) {
                    1 if hostile => len.max(0) + rng.random_range(0..3),
                    2 if hostile => i32::MIN + rng.random_range(0..3),
                    3 if hostile => -2,
                    draw => token_or_padding(&mut rng, len, draw == 0),
                };
            }
        }
        Ok(GatherCase {
            layer: rng.random_range(0..shape.layout.layers()),
            shape,
            k,
            stride,
            req_slots,
            seq_lens,
            topk,
        })
    }

    pub fn load(&self, exec: &Executor) -> kvtier::Result<LoadedGather> {
        let entry = self.shape.layout.entry_bytes() as usize;
        let rows = self.req_slots.len() * self.k as usize;
        Ok(LoadedGather {
            fx: self.shape.build(exec)?,
            slots: ExecVec::from_host(exec, &self.req_slots)?,
            seq: ExecVec::from_host(exec, &self.seq_lens)?,
            topk: ExecVec::from_host(exec, &self.topk)?,
            // Filled, not zeroed: every output byte must be written.
            out: ExecVec::from_host(exec, &vec![0xA5u8; rows * entry])?,
        })
    }

    /// The per-layer call, on `stream`.
    pub fn call(&self, l: &LoadedGather, stream: Stream) -> kvtier::Result<()> {
        self.call_with(l, None, stream)
    }

    /// The per-layer call with `method` (None: the one `Tier::gather`
    /// picks).
    pub fn call_with(
        &self,
        l: &LoadedGather,
        method: Option<CopyMethod>,
        stream: Stream,
    ) -> kvtier::Result<()> {
        let batch = GatherBatch {
            topk_stride: self.stride,
            ..GatherBatch::new(l.slots.buf(), l.seq.buf(), l.topk.buf(), self.k)
        };
        // SAFETY: nothing else uses `out` during the call.
        let out = unsafe { l.out.buf_mut() };
        match method {
            None => l.fx.tier.gather(self.layer, &batch, out, stream),
            Some(m) => l.fx.tier.gather_with(self.layer, &batch, out, m, stream),
        }
    }

    pub fn snapshot(
        &self,
        l: &LoadedGather,
        report: Option<kvtier::BadIndexReport>,
    ) -> kvtier::Result<Snapshot> {
        let mut snap = Snapshot::with_report(report);
        snap.add("gather output", &l.out.to_vec()?);
        Ok(snap)
    }

    /// Another top-k of this case's shape, valid for its lengths.
    pub fn redraw(&self, seed: u64) -> Vec<i32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let stride = self.stride as usize;
        let mut topk = self.topk.clone();
        for (b, row) in topk.chunks_mut(stride).enumerate() {
            let len = self.seq_lens[b];
            for t in row.iter_mut() {
                let padding = rng.random_ratio(1, 40);
                *t = token_or_padding(&mut rng, len, padding);
            }
        }
        topk
    }

    fn run(&self, exec: &Executor, method: CopyMethod) -> kvtier::Result<Snapshot> {
        let l = self.load(exec)?;
        let call = self.call_with(&l, Some(method), Stream::null());
        let report = settle(call, || l.fx.tier.check(Stream::null()))?;
        self.snapshot(&l, report)
    }
}

/// A token of a sequence of `len` (-1, padding, when asked or when there is
/// none).
fn token_or_padding(rng: &mut StdRng, len: i32, padding: bool) -> i32 {
    if padding || len <= 0 {
        -1
    } else {
        rng.random_range(0..len)
    }
}

/// The executor under test against the CPU executor, with every copy
/// method (the CPU executor has one way): the first difference, named by its
/// method.
fn agree(
    dut: &Executor,
    run: impl Fn(&Executor, CopyMethod) -> kvtier::Result<Snapshot>,
) -> kvtier::Result<Verdict> {
    let want = run(&Executor::cpu(), CopyMethod::default())?;
    let mut verdict = Verdict::Same { note: None };
    for method in CopyMethod::ALL {
        verdict = match Snapshot::compare(&want, &run(dut, method)?) {
            Verdict::Differ(what) => return Ok(Verdict::Differ(format!("{method:?}: {what}"))),
            same => same,
        };
    }
    Ok(verdict)
}

/// Random gathers, every other one with hostile indices.
pub(super) fn gather(dut: &Executor, seed: u64, n: u64) -> Row {
    run_cases("gather (random, half hostile)", seed, n, |s| {
        let case = GatherCase::random(s)?;
        agree(dut, |e, m| case.run(e, m))
    })
}

/// Batch 64, k = 2048, 656-byte entries over 4096-token regions, and the
/// 1152-byte bf16 entry; each with its top-k rows as drawn and sorted (the
/// neighbours a sorted selection holds are the runs `CopyMethod::MergedRuns`
/// moves as blocks).
pub(super) fn gather_production_shape(dut: &Executor, seed: u64) -> Row {
    let name = "gather (batch 64, k 2048, 656 and 1152 B, +sorted)";
    run_cases(name, seed, 4, |s| {
        let mut rng = StdRng::seed_from_u64(s);
        let entry = if s % 2 == 0 { 656 } else { 1152 };
        let (batch, k, tokens) = (64usize, 2048u32, 4096u32);
        let regions = 8u32;
        let mut case = GatherCase {
            shape: PoolShape {
                layout: LayerFirstLayout::new(entry, 2, tokens)?,
                regions,
                bindings: (0..regions).map(Some).collect(),
                fill_seed: s,
            },
            layer: 1,
            k,
            stride: k,
            req_slots: (0..batch).map(|b| (b as u32 % regions) as i32).collect(),
            seq_lens: (0..batch).map(|b| tokens as i32 - b as i32).collect(),
            topk: (0..batch * k as usize)
                .map(|i| rng.random_range(0..tokens as i32 - (i / k as usize) as i32))
                .collect(),
        };
        if s % 4 >= 2 {
            for row in case.topk.chunks_mut(k as usize) {
                row.sort_unstable();
            }
        }
        agree(dut, |e, m| case.run(e, m))
    })
}

/// One writeback: items naming slots, tokens and source rows.
#[derive(Clone)]
pub(super) struct WritebackCase {
    shape: PoolShape,
    all_layers: bool,
    layer: u32,
    src_rows_total: usize,
    src_seed: u64,
    slots: Vec<i32>,
    tokens: Vec<i32>,
    src_rows: Vec<i64>,
}

/// A writeback case's pool, tier and buffers on one executor.
pub(super) struct LoadedWriteback {
    fx: Fixture,
    pub sources: Vec<ExecVec<u8>>,
    slots: ExecVec<i32>,
    tokens: ExecVec<i32>,
    rows: ExecVec<i64>,
}

impl LoadedWriteback {
    /// The sync point: the bad indices the kernel recorded.
    pub fn check(&self) -> kvtier::Result<()> {
        self.fx.tier.check(Stream::null())
    }
}

impl WritebackCase {
    /// A random case; odd seeds are hostile.
    pub fn random(seed: u64, all_layers: bool) -> kvtier::Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let hostile = seed % 2 == 1;
        let shape = PoolShape::random(&mut rng)?;
        let tokens_per_region = shape.layout.tokens_per_region() as i32;
        let src_rows_total = rng.random_range(1..=300usize);
        let n = rng.random_range(1..=300usize);
        let mut taken = std::collections::HashSet::new();
        let (mut slots, mut tokens, mut src_rows) = (vec![], vec![], vec![]);
        for _ in 0..n {
            let slot = shape.slot(&mut rng, hostile);
            let token = match rng.random_range(0..30) {
                0 if hostile => tokens_per_region + rng.random_range(0..3),
                1 if hostile => -1 - rng.random_range(0..3),
                _ => rng.random_range(0..tokens_per_region),
            };
            let row = match rng.random_range(0..30) {
                0 if hostile => src_rows_total as i64 + rng.random_range(0..3),
                1 if hostile => -1,
                _ => rng.random_range(0..src_rows_total as i64),
            };
            // Two items writing one entry would race on a GPU (either may
            // land last): one writer per entry, the others made padding.
            let target = shape
                .bindings
                .get(slot as usize)
                .copied()
                .flatten()
                .map(|r| (r, token));
            let slot = match target {
                Some(t) if !taken.insert(t) => -1,
                _ => slot,
            };
            slots.push(slot);
            tokens.push(token);
            src_rows.push(row);
        }
        Ok(WritebackCase {
            layer: rng.random_range(0..shape.layout.layers()),
            shape,
            all_layers,
            src_rows_total,
            src_seed: rng.next_u64(),
            slots,
            tokens,
            src_rows,
        })
    }

    /// The source rows of every buffer, drawn from `seed`.
    pub fn sources(&self, seed: u64) -> Vec<Vec<u8>> {
        let entry = self.shape.layout.entry_bytes() as usize;
        let mut rng = StdRng::seed_from_u64(seed);
        let buffers = if self.all_layers {
            self.shape.layout.layers()
        } else {
            1
        };
        (0..buffers)
            .map(|_| {
                let mut bytes = vec![0u8; self.src_rows_total * entry];
                rng.fill_bytes(&mut bytes);
                bytes
            })
            .collect()
    }

    pub fn load(&self, exec: &Executor) -> kvtier::Result<LoadedWriteback> {
        Ok(LoadedWriteback {
            fx: self.shape.build(exec)?,
            sources: self
                .sources(self.src_seed)
                .iter()
                .map(|b| ExecVec::from_host(exec, b))
                .collect::<kvtier::Result<_>>()?,
            slots: ExecVec::from_host(exec, &self.slots)?,
            tokens: ExecVec::from_host(exec, &self.tokens)?,
            rows: ExecVec::from_host(exec, &self.src_rows)?,
        })
    }

    /// The per-layer call (or the decode step's all-layer call), on
    /// `stream`; `kv` is the registration of every layer's source.
    pub fn call(
        &self,
        l: &LoadedWriteback,
        kv: Option<&kvtier::KvLayers<'_>>,
        stream: Stream,
    ) -> kvtier::Result<()> {
        self.call_with(l, kv, CopyMethod::default(), stream)
    }

    /// The call with `method` (`call`: the default, as `Tier::writeback_layer`
    /// and `Tier::writeback_all_layers` take).
    fn call_with(
        &self,
        l: &LoadedWriteback,
        kv: Option<&kvtier::KvLayers<'_>>,
        method: CopyMethod,
        stream: Stream,
    ) -> kvtier::Result<()> {
        let items = WritebackItems {
            slots: l.slots.buf(),
            tokens: l.tokens.buf(),
            src_rows: l.rows.buf(),
        };
        let tier = &l.fx.tier;
        match kv {
            Some(kv) => tier.writeback_all_layers_with(&items, kv, method, stream),
            None => {
                tier.writeback_layer_with(self.layer, &items, l.sources[0].buf(), method, stream)
            }
        }
    }

    /// Registers every layer's source (the all-layer writeback only).
    pub fn register<'a>(
        &self,
        l: &'a LoadedWriteback,
    ) -> kvtier::Result<Option<kvtier::KvLayers<'a>>> {
        if !self.all_layers {
            return Ok(None);
        }
        let bufs: Vec<_> = l.sources.iter().map(|s| s.buf()).collect();
        l.fx.tier.register_kv_layers(&bufs).map(Some)
    }

    pub fn snapshot(
        &self,
        l: &LoadedWriteback,
        report: Option<kvtier::BadIndexReport>,
    ) -> kvtier::Result<Snapshot> {
        let mut snap = Snapshot::with_report(report);
        self.shape.dump(&l.fx, &mut snap)?;
        Ok(snap)
    }

    fn run(&self, exec: &Executor, method: CopyMethod) -> kvtier::Result<Snapshot> {
        let l = self.load(exec)?;
        let kv = self.register(&l)?;
        let call = self.call_with(&l, kv.as_ref(), method, Stream::null());
        let report = settle(call, || l.fx.tier.check(Stream::null()))?;
        self.snapshot(&l, report)
    }
}

/// Random writebacks of one layer, or of every layer at once.
pub(super) fn writeback(dut: &Executor, seed: u64, n: u64, all_layers: bool) -> Row {
    let name = if all_layers {
        "writeback, every layer (random, half hostile)"
    } else {
        "writeback, one layer (random, half hostile)"
    };
    run_cases(name, seed, n, |s| {
        let case = WritebackCase::random(s, all_layers)?;
        agree(dut, |e, m| case.run(e, m))
    })
}

#[cfg(test)]
mod tests {
    //! The generators make the cases they claim to (see swap_in's tests).
    use super::*;

    fn refused(snap: &Snapshot) -> bool {
        snap.report.is_some()
    }

    /// Even seeds (clean) refuse nothing; most odd ones (hostile) refuse
    /// something.
    fn clean_or_hostile(run: impl Fn(u64) -> Snapshot) {
        let mut hostile_refused = 0;
        for seed in 0..30 {
            let snap = run(seed);
            if seed % 2 == 0 {
                assert!(!refused(&snap), "seed {seed}: {:?}", snap.report);
            } else {
                hostile_refused += refused(&snap) as u32;
            }
        }
        assert!(hostile_refused >= 12, "{hostile_refused} of 15");
    }

    #[test]
    fn gather_cases_are_clean_or_hostile_as_drawn() {
        let cpu = Executor::cpu();
        let m = CopyMethod::default();
        clean_or_hostile(|seed| GatherCase::random(seed).unwrap().run(&cpu, m).unwrap());
        // Redrawn queries stay valid.
        let case = GatherCase::random(4).unwrap();
        let again = GatherCase {
            topk: case.redraw(9),
            ..case.clone()
        };
        assert!(!refused(&again.run(&cpu, m).unwrap()));
    }

    #[test]
    fn writeback_cases_are_clean_or_hostile_as_drawn() {
        let cpu = Executor::cpu();
        for all_layers in [false, true] {
            clean_or_hostile(|seed| {
                WritebackCase::random(seed, all_layers)
                    .unwrap()
                    .run(&cpu, CopyMethod::default())
                    .unwrap()
            });
        }
    }
}
