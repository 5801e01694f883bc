//! Shared by the integration tests: pools filled with a known pattern, random
//! gather and writeback cases (padding and bad indices included), a model of
//! both mechanisms written from the contract in kernels/abi.h independently of
//! the executors, and runners that drive either executor with the same case.
#![allow(dead_code)]

pub mod spec;
pub mod swap;

use std::sync::Arc;

use kvtier::abi::{
    KVT_ERR_GATHER_INDEX, KVT_ERR_GATHER_SEQ_LEN, KVT_ERR_GATHER_SLOT, KVT_ERR_WRITEBACK_SLOT,
    KVT_ERR_WRITEBACK_SRC_ROW, KVT_ERR_WRITEBACK_TOKEN,
};
use kvtier::{
    Buf, BufMut, DeviceBuffer, DeviceSpec, ErrorWord, Executor, GatherBatch, LayerFirstLayout,
    Pool, Region, Stream, Tier, WritebackItems,
};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// The bytes the pattern puts in (region, layer, token): pseudo-random, never
/// all zero, different for every entry.
pub fn pattern_entry(region: u32, layer: u32, token: u32, entry: usize) -> Vec<u8> {
    let mut x =
        ((region as u64) << 40) ^ ((layer as u64) << 28) ^ token as u64 ^ 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(entry);
    while out.len() < entry {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&(z | 1).to_le_bytes());
    }
    out
}

/// A pool whose regions are filled with the pattern.
pub struct Fixture {
    pub pool: Arc<Pool>,
    pub regions: Vec<Region>,
}

pub fn filled_pool(layout: LayerFirstLayout, n_regions: u32) -> Fixture {
    let pool = Pool::create(
        layout,
        DeviceSpec::Anon {
            bytes: Pool::device_bytes_for(&layout, n_regions).unwrap(),
        },
    )
    .unwrap();
    let entry = layout.entry_bytes() as usize;
    let regions: Vec<Region> = (0..n_regions)
        .map(|_| pool.alloc_region().unwrap())
        .collect();
    for r in &regions {
        for layer in 0..layout.layers() {
            let mut bytes = Vec::with_capacity(entry * layout.tokens_per_region() as usize);
            for t in 0..layout.tokens_per_region() {
                bytes.extend(pattern_entry(r.index(), layer, t, entry));
            }
            pool.write_tokens(r, layer, 0, &bytes).unwrap();
        }
    }
    Fixture { pool, regions }
}

/// Every byte of every region, `[region][layer][token][entry]`.
pub fn pool_contents(fx: &Fixture) -> Vec<Vec<u8>> {
    let layout = fx.pool.layout();
    fx.regions
        .iter()
        .map(|r| {
            let mut all = Vec::new();
            for layer in 0..layout.layers() {
                let mut bytes = vec![0u8; layout.layer_bytes() as usize];
                fx.pool.read_tokens(r, layer, 0, &mut bytes).unwrap();
                all.extend(bytes);
            }
            all
        })
        .collect()
}

/// Tunes how hostile a random case is.
#[derive(Clone, Copy, Debug)]
pub struct Hostility {
    /// Probability that a slot, length or index is drawn bad.
    pub bad: f64,
    /// Probability that a slot or index is padding (-1).
    pub padding: f64,
}

pub const CLEAN: Hostility = Hostility {
    bad: 0.0,
    padding: 0.0,
};
pub const PADDED: Hostility = Hostility {
    bad: 0.0,
    padding: 0.15,
};
pub const HOSTILE: Hostility = Hostility {
    bad: 0.15,
    padding: 0.1,
};

/// Size limits of a random case.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_layers: u32,
    pub max_tokens: u32,
    pub max_regions: u32,
    pub max_batch: u32,
    pub max_k: u32,
    pub max_items: u32,
}

pub const SMALL: Limits = Limits {
    max_layers: 3,
    max_tokens: 48,
    max_regions: 4,
    max_batch: 5,
    max_k: 24,
    max_items: 24,
};

/// Entry sizes the tests draw from: the named formats, odd multiples of 8
/// (so entries alternate between 0 and 8 modulo 16), and random ones.
pub fn draw_entry(rng: &mut StdRng) -> u32 {
    const SIZES: [u32; 8] = [8, 16, 24, 40, 584, 656, 1152, 2056];
    if rng.random_bool(0.75) {
        SIZES[rng.random_range(0..SIZES.len())]
    } else {
        8 * rng.random_range(1..=300)
    }
}

/// The pool and slot table a case runs against.
#[derive(Clone, Debug)]
pub struct Setup {
    pub layout: LayerFirstLayout,
    pub n_regions: u32,
    /// Region bound to each slot (several slots may share one), or unbound.
    pub bindings: Vec<Option<u32>>,
}

impl Setup {
    pub fn random(rng: &mut StdRng, lim: Limits) -> Self {
        let layout = LayerFirstLayout::new(
            draw_entry(rng),
            rng.random_range(1..=lim.max_layers),
            rng.random_range(1..=lim.max_tokens),
        )
        .unwrap();
        let n_regions = rng.random_range(1..=lim.max_regions);
        let num_slots = rng.random_range(1..=6);
        let bindings = (0..num_slots)
            .map(|_| rng.random_bool(0.8).then(|| rng.random_range(0..n_regions)))
            .collect();
        Setup {
            layout,
            n_regions,
            bindings,
        }
    }

    pub fn num_slots(&self) -> u32 {
        self.bindings.len() as u32
    }

    /// The region a slot value resolves to, if it is a bound slot.
    pub fn region_of(&self, slot: i32) -> Option<u32> {
        usize::try_from(slot)
            .ok()
            .and_then(|s| self.bindings.get(s).copied().flatten())
    }

    /// A pattern-filled pool and a tier over it with the bindings applied.
    pub fn build(&self, exec: &Executor) -> (Fixture, Tier) {
        let fx = filled_pool(self.layout, self.n_regions);
        let mut tier = Tier::new(fx.pool.clone(), exec.clone(), self.num_slots()).unwrap();
        for (slot, b) in self.bindings.iter().enumerate() {
            if let Some(r) = b {
                tier.bind_slot(slot as u32, &fx.regions[*r as usize], Stream::null())
                    .unwrap();
            }
        }
        if let Executor::Cuda(dev) = exec {
            // The bindings went out on the null stream; the cases run on
            // their own non-blocking streams.
            dev.synchronize_all().unwrap();
        }
        (fx, tier)
    }

    fn draw_slot(&self, rng: &mut StdRng, h: Hostility) -> i32 {
        let x: f64 = rng.random();
        if x < h.padding {
            -1
        } else if x < h.padding + h.bad {
            let unbound: Vec<usize> = (0..self.bindings.len())
                .filter(|&s| self.bindings[s].is_none())
                .collect();
            match rng.random_range(0..4) {
                0 => self.num_slots() as i32 + rng.random_range(0..3),
                1 => -2 - rng.random_range(0..5),
                2 if !unbound.is_empty() => unbound[rng.random_range(0..unbound.len())] as i32,
                _ => i32::MIN,
            }
        } else {
            let bound: Vec<usize> = (0..self.bindings.len())
                .filter(|&s| self.bindings[s].is_some())
                .collect();
            if bound.is_empty() {
                -1
            } else {
                bound[rng.random_range(0..bound.len())] as i32
            }
        }
    }
}

/// A random gather case.
#[derive(Clone, Debug)]
pub struct GatherCase {
    pub setup: Setup,
    pub layer: u32,
    pub req_slots: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub topk: Vec<i32>,
    pub k: u32,
    pub topk_stride: u32,
    /// Output placed 0 or 8 bytes past a 16-byte boundary.
    pub out_offset: usize,
}

impl GatherCase {
    pub fn random(seed: u64, lim: Limits, h: Hostility) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let setup = Setup::random(&mut rng, lim);
        let tokens = setup.layout.tokens_per_region() as i32;
        let layer = rng.random_range(0..setup.layout.layers());
        let batch = rng.random_range(0..=lim.max_batch);
        let k = rng.random_range(0..=lim.max_k);
        let topk_stride = k + rng.random_range(0..=2);
        let req_slots: Vec<i32> = (0..batch).map(|_| setup.draw_slot(&mut rng, h)).collect();
        let seq_lens: Vec<i32> = (0..batch)
            .map(|_| {
                if rng.random_bool(h.bad) {
                    [-1, tokens + 1, i32::MAX, i32::MIN][rng.random_range(0..4)]
                } else {
                    rng.random_range(0..=tokens)
                }
            })
            .collect();
        let mut topk = vec![0i32; batch as usize * topk_stride as usize];
        for b in 0..batch as usize {
            for j in 0..topk_stride as usize {
                let seq = seq_lens[b].clamp(0, tokens);
                let x: f64 = rng.random();
                topk[b * topk_stride as usize + j] = if j >= k as usize {
                    // stride padding: never read; garbage on purpose
                    i32::MIN + rng.random_range(0..100)
                } else if x < h.padding || (seq == 0 && x >= h.padding + h.bad) {
                    // padding; also the only valid value when seq_len is 0
                    -1
                } else if x < h.padding + h.bad {
                    [seq, seq + rng.random_range(0..1000), -2, i32::MIN, i32::MAX]
                        [rng.random_range(0..5)]
                } else {
                    rng.random_range(0..seq)
                };
            }
        }
        let out_offset = if rng.random_bool(0.5) { 0 } else { 8 };
        GatherCase {
            setup,
            layer,
            req_slots,
            seq_lens,
            topk,
            k,
            topk_stride,
            out_offset,
        }
    }

    /// A random case whose top-k rows are sorted runs of neighbouring tokens
    /// (lengths from `draw_run`; with `h`, runs broken in the middle by
    /// padding or bad indices), half the valid rows holding a full region so
    /// that runs end at its last entry, a quarter of the runs placed to end
    /// at the row's last token.
    pub fn with_runs(seed: u64, lim: Limits, h: Hostility) -> Self {
        let mut case = GatherCase::random(seed, lim, h);
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7275_6e73);
        let tokens = case.setup.layout.tokens_per_region() as i32;
        let (k, stride) = (case.k as usize, case.topk_stride as usize);
        for b in 0..case.batch() {
            if (0..=tokens).contains(&case.seq_lens[b]) && rng.random_bool(0.5) {
                case.seq_lens[b] = tokens;
            }
            let seq = case.seq_lens[b].clamp(0, tokens);
            let mut j = 0;
            while j < k {
                let len = draw_run(&mut rng).min(k - j);
                let start = if seq == 0 {
                    0
                } else if rng.random_bool(0.25) {
                    (seq - len as i32).max(0)
                } else {
                    rng.random_range(0..seq)
                };
                let mut skip = 0;
                for m in 0..len {
                    // a near-run: a token skipped, the rest of the run shifted
                    if rng.random_bool(0.1) {
                        skip += 1;
                    }
                    let t = start + m as i32 + skip;
                    let x: f64 = rng.random();
                    case.topk[b * stride + j + m] = if seq == 0 || t >= seq || x < h.padding {
                        -1
                    } else if x < h.padding + h.bad {
                        [seq, -2, i32::MAX, i32::MIN][rng.random_range(0..4)]
                    } else {
                        t
                    };
                }
                j += len;
            }
        }
        case
    }

    pub fn batch(&self) -> usize {
        self.req_slots.len()
    }

    pub fn out_bytes(&self) -> usize {
        self.batch() * self.k as usize * self.setup.layout.entry_bytes() as usize
    }

    /// The model: expected output and error word.
    pub fn expected(&self) -> (Vec<u8>, ErrorWord) {
        let entry = self.setup.layout.entry_bytes() as usize;
        let tokens = self.setup.layout.tokens_per_region() as i32;
        let mut out = Vec::with_capacity(self.out_bytes());
        let mut err = ErrorWord::clear();
        for b in 0..self.batch() {
            for j in 0..self.k as usize {
                let pos = ((b as u32) << 16) | j as u32;
                let slot = self.req_slots[b];
                let seq = self.seq_lens[b];
                let t = self.topk[b * self.topk_stride as usize + j];
                let row = if slot == -1 {
                    None
                } else if let Some(region) = self.setup.region_of(slot) {
                    if !(0..=tokens).contains(&seq) {
                        err.report(KVT_ERR_GATHER_SEQ_LEN, pos, seq as i64);
                        None
                    } else if t == -1 {
                        None
                    } else if t < 0 || t >= seq {
                        err.report(KVT_ERR_GATHER_INDEX, pos, t as i64);
                        None
                    } else {
                        Some(pattern_entry(region, self.layer, t as u32, entry))
                    }
                } else {
                    err.report(KVT_ERR_GATHER_SLOT, pos, slot as i64);
                    None
                };
                out.extend(row.unwrap_or_else(|| vec![0; entry]));
            }
        }
        (out, err)
    }

    /// Runs the case on `exec`: (output bytes, the call's result, including
    /// bad indices reported at the sync point for the CUDA executor).
    pub fn run(&self, exec: &Executor) -> (Vec<u8>, kvtier::Result<()>) {
        self.run_with(exec, kvtier::CopyMethod::default())
    }

    /// [`GatherCase::run`] with a copy method for the CUDA executor.
    pub fn run_with(
        &self,
        exec: &Executor,
        method: kvtier::CopyMethod,
    ) -> (Vec<u8>, kvtier::Result<()>) {
        let (_fx, tier) = self.setup.build(exec);
        let n = self.out_bytes();
        match exec {
            Executor::Cpu => {
                // u128 storage is 16-byte aligned; garbage shows missed writes.
                let mut storage =
                    vec![u128::from_le_bytes([0xAB; 16]); (n + self.out_offset).div_ceil(16) + 1];
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(
                        (storage.as_mut_ptr() as *mut u8).add(self.out_offset),
                        n,
                    )
                };
                let batch = GatherBatch {
                    req_slots: Buf::host(&self.req_slots),
                    seq_lens: Buf::host(&self.seq_lens),
                    topk: Buf::host(&self.topk),
                    k: self.k,
                    topk_stride: self.topk_stride,
                };
                let res = tier.gather_with(
                    self.layer,
                    &batch,
                    BufMut::host(bytes),
                    method,
                    Stream::null(),
                );
                (bytes.to_vec(), res)
            }
            Executor::Cuda(dev) => {
                let stream = dev.create_stream().unwrap();
                let slots = DeviceBuffer::from_host(dev, &self.req_slots).unwrap();
                let seq = DeviceBuffer::from_host(dev, &self.seq_lens).unwrap();
                let topk = DeviceBuffer::from_host(dev, &self.topk).unwrap();
                let mut out = DeviceBuffer::from_host(dev, &vec![0xABu8; n + 16]).unwrap();
                let batch = GatherBatch {
                    req_slots: slots.as_buf(),
                    seq_lens: seq.as_buf(),
                    topk: topk.as_buf(),
                    k: self.k,
                    topk_stride: self.topk_stride,
                };
                let res = tier
                    .gather_with(
                        self.layer,
                        &batch,
                        out.slice_mut(self.out_offset, n),
                        method,
                        stream.stream(),
                    )
                    .and_then(|_| tier.check(stream.stream()));
                let bytes = out.to_vec().unwrap()[self.out_offset..][..n].to_vec();
                (bytes, res)
            }
        }
    }
}

/// Which layers a writeback case writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritebackMode {
    /// `writeback_layer(layer, ..)` from one source buffer.
    Layer(u32),
    /// `writeback_all_layers(..)` from one source buffer per layer.
    AllLayers,
}

/// Makes every item whose destination (region, token) an earlier item
/// already writes padding (slot -1): the kernel leaves such races
/// unspecified.
fn drop_repeated_destinations(setup: &Setup, slots: &mut [i32], tokens: &[i32]) {
    let mut seen = std::collections::HashSet::new();
    for i in 0..slots.len() {
        if let Some(region) = setup.region_of(slots[i])
            && !seen.insert((region, tokens[i]))
        {
            slots[i] = -1;
        }
    }
}

/// Lengths of the runs of neighbours the run-heavy cases draw: 1 to 32, so
/// that runs shorter than, as long as and longer than a warp's group of
/// `CopyMethod::RUN_ROWS` rows all occur, starting anywhere in a group.
fn draw_run(rng: &mut StdRng) -> usize {
    rng.random_range(1..=32)
}

/// A random writeback case.
#[derive(Clone)]
pub struct WritebackCase {
    pub setup: Setup,
    pub mode: WritebackMode,
    pub slots: Vec<i32>,
    pub tokens: Vec<i32>,
    pub src_rows: Vec<i64>,
    /// Source buffers: one (Layer) or one per layer (AllLayers), each
    /// `rows × entry_bytes` random bytes.
    pub src: Vec<Vec<u8>>,
    pub rows: u64,
}

impl std::fmt::Debug for WritebackCase {
    /// Everything but the source bytes, which are random and long.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritebackCase")
            .field("setup", &self.setup)
            .field("mode", &self.mode)
            .field("slots", &self.slots)
            .field("tokens", &self.tokens)
            .field("src_rows", &self.src_rows)
            .field(
                "src",
                &format_args!("{} buffers of {} rows", self.src.len(), self.rows),
            )
            .finish()
    }
}

impl WritebackCase {
    /// With `unique`, no two valid items share a destination (the kernel
    /// leaves such races unspecified; GPU comparisons need it).
    pub fn random(seed: u64, lim: Limits, h: Hostility, unique: bool) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let setup = Setup::random(&mut rng, lim);
        let layout = setup.layout;
        let entry = layout.entry_bytes() as usize;
        let tokens = layout.tokens_per_region() as i32;
        let mode = if rng.random_bool(0.5) {
            WritebackMode::Layer(rng.random_range(0..layout.layers()))
        } else {
            WritebackMode::AllLayers
        };
        let rows = rng.random_range(1..=16u64);
        let n = rng.random_range(0..=lim.max_items);
        let mut slots: Vec<i32> = (0..n).map(|_| setup.draw_slot(&mut rng, h)).collect();
        let item_tokens: Vec<i32> = (0..n)
            .map(|_| {
                if rng.random_bool(h.bad) {
                    [-1, tokens, i32::MIN, i32::MAX][rng.random_range(0..4)]
                } else {
                    rng.random_range(0..tokens)
                }
            })
            .collect();
        let src_rows: Vec<i64> = (0..n)
            .map(|_| {
                if rng.random_bool(h.bad) {
                    [-1, rows as i64, i64::MAX, i64::MIN, 1 << 40][rng.random_range(0..5)]
                } else {
                    rng.random_range(0..rows as i64)
                }
            })
            .collect();
        if unique {
            drop_repeated_destinations(&setup, &mut slots, &item_tokens);
        }
        let buffers = match mode {
            WritebackMode::Layer(_) => 1,
            WritebackMode::AllLayers => layout.layers() as usize,
        };
        let src = (0..buffers)
            .map(|_| {
                let mut b = vec![0u8; rows as usize * entry];
                rng.fill_bytes(&mut b);
                b
            })
            .collect();
        WritebackCase {
            setup,
            mode,
            slots,
            tokens: item_tokens,
            src_rows,
            src,
            rows,
        }
    }

    /// A random case whose items are runs (lengths from `draw_run`) of one
    /// slot with consecutive tokens and consecutive source rows, as a
    /// prefill's chunk writes; with `h`, runs broken in the middle by
    /// padding or bad tokens and rows. A quarter of the runs end at the
    /// region's last token, a quarter at the source's last row. With
    /// `unique`, as [`WritebackCase::random`].
    pub fn with_runs(seed: u64, lim: Limits, h: Hostility, unique: bool) -> Self {
        let mut case = WritebackCase::random(seed, lim, h, false);
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7275_6e73);
        let entry = case.setup.layout.entry_bytes() as usize;
        let tokens = case.setup.layout.tokens_per_region() as i32;
        case.rows = rng.random_range(1..=64u64);
        for b in case.src.iter_mut() {
            b.resize(case.rows as usize * entry, 0);
            rng.fill_bytes(b);
        }
        let rows = case.rows as i64;
        let n = case.slots.len();
        let mut i = 0;
        while i < n {
            let len = draw_run(&mut rng).min(n - i);
            let slot = case.slots[i];
            let token0 = if rng.random_bool(0.25) {
                (tokens - len as i32).max(0)
            } else {
                rng.random_range(0..tokens)
            };
            let row0 = if rng.random_bool(0.25) {
                (rows - len as i64).max(0)
            } else {
                rng.random_range(0..rows)
            };
            // near-runs: a token or a source row skipped (the rest of the
            // run shifted), or the run moved on to another slot
            let (mut slot, mut t_skip, mut r_skip) = (slot, 0, 0);
            for m in 0..len {
                match rng.random_range(0..30) {
                    0 => t_skip += 1,
                    1 => r_skip += 1,
                    2 => slot = (slot + 1).rem_euclid(case.setup.num_slots() as i32),
                    _ => {}
                }
                let x: f64 = rng.random();
                let (t, r) = (token0 + m as i32 + t_skip, row0 + m as i64 + r_skip);
                case.slots[i + m] = if x < h.padding { -1 } else { slot };
                // past the region or the source: the next item is refused
                case.tokens[i + m] = if x >= h.padding && x < h.padding + h.bad / 2.0 {
                    [-1, tokens, i32::MAX][rng.random_range(0..3)]
                } else {
                    t
                };
                case.src_rows[i + m] = if x >= h.padding + h.bad / 2.0 && x < h.padding + h.bad {
                    [-1, rows, i64::MAX][rng.random_range(0..3)]
                } else {
                    r
                };
            }
            i += len;
        }
        if unique {
            drop_repeated_destinations(&case.setup, &mut case.slots, &case.tokens);
        }
        case
    }

    fn layers(&self) -> Vec<u32> {
        match self.mode {
            WritebackMode::Layer(l) => vec![l],
            WritebackMode::AllLayers => (0..self.setup.layout.layers()).collect(),
        }
    }

    /// The model: expected contents of every region, and the error word.
    /// Items apply in order, layer by layer (later items win on the CPU).
    pub fn expected(&self) -> (Vec<Vec<u8>>, ErrorWord) {
        let layout = self.setup.layout;
        let entry = layout.entry_bytes() as usize;
        let mut regions: Vec<Vec<u8>> = (0..self.setup.n_regions)
            .map(|r| {
                let mut all = Vec::new();
                for l in 0..layout.layers() {
                    for t in 0..layout.tokens_per_region() {
                        all.extend(pattern_entry(r, l, t, entry));
                    }
                }
                all
            })
            .collect();
        let mut err = ErrorWord::clear();
        for (li, layer) in self.layers().into_iter().enumerate() {
            for i in 0..self.slots.len() {
                let slot = self.slots[i];
                if slot == -1 {
                    continue;
                }
                let Some(region) = self.setup.region_of(slot) else {
                    err.report(KVT_ERR_WRITEBACK_SLOT, i as u32, slot as i64);
                    continue;
                };
                let t = self.tokens[i];
                if t < 0 || t as u32 >= layout.tokens_per_region() {
                    err.report(KVT_ERR_WRITEBACK_TOKEN, i as u32, t as i64);
                    continue;
                }
                let row = self.src_rows[i];
                if row < 0 || row as u64 >= self.rows {
                    err.report(KVT_ERR_WRITEBACK_SRC_ROW, i as u32, row);
                    continue;
                }
                let dst =
                    (layer as usize * layout.tokens_per_region() as usize + t as usize) * entry;
                let src = &self.src[li][row as usize * entry..][..entry];
                regions[region as usize][dst..dst + entry].copy_from_slice(src);
            }
        }
        (regions, err)
    }

    /// Runs the case on `exec`: (region contents afterwards, the result).
    pub fn run(&self, exec: &Executor) -> (Vec<Vec<u8>>, kvtier::Result<()>) {
        self.run_with(exec, kvtier::CopyMethod::default())
    }

    /// [`WritebackCase::run`] with a copy method for the CUDA executor.
    pub fn run_with(
        &self,
        exec: &Executor,
        method: kvtier::CopyMethod,
    ) -> (Vec<Vec<u8>>, kvtier::Result<()>) {
        let (fx, tier) = self.setup.build(exec);
        let res = match exec {
            Executor::Cpu => {
                let items = WritebackItems {
                    slots: Buf::host(&self.slots),
                    tokens: Buf::host(&self.tokens),
                    src_rows: Buf::host(&self.src_rows),
                };
                match self.mode {
                    WritebackMode::Layer(l) => {
                        tier.writeback_layer(l, &items, Buf::host(&self.src[0]), Stream::null())
                    }
                    WritebackMode::AllLayers => {
                        let bufs: Vec<Buf<u8>> = self.src.iter().map(|b| Buf::host(b)).collect();
                        let kv = tier.register_kv_layers(&bufs).unwrap();
                        tier.writeback_all_layers(&items, &kv, Stream::null())
                    }
                }
            }
            Executor::Cuda(dev) => {
                let stream = dev.create_stream().unwrap();
                let slots = DeviceBuffer::from_host(dev, &self.slots).unwrap();
                let tokens = DeviceBuffer::from_host(dev, &self.tokens).unwrap();
                let rows = DeviceBuffer::from_host(dev, &self.src_rows).unwrap();
                let src: Vec<DeviceBuffer<u8>> = self
                    .src
                    .iter()
                    .map(|b| DeviceBuffer::from_host(dev, b).unwrap())
                    .collect();
                let items = WritebackItems {
                    slots: slots.as_buf(),
                    tokens: tokens.as_buf(),
                    src_rows: rows.as_buf(),
                };
                let launched = match self.mode {
                    WritebackMode::Layer(l) => tier.writeback_layer_with(
                        l,
                        &items,
                        src[0].as_buf(),
                        method,
                        stream.stream(),
                    ),
                    WritebackMode::AllLayers => {
                        let bufs: Vec<Buf<u8>> = src.iter().map(|b| b.as_buf()).collect();
                        let kv = tier.register_kv_layers(&bufs).unwrap();
                        tier.writeback_all_layers_with(&items, &kv, method, stream.stream())
                    }
                };
                launched.and_then(|_| tier.check(stream.stream()))
            }
        };
        (pool_contents(&fx), res)
    }
}

/// The error word a call reported (clear when it succeeded); panics on any
/// error other than bad indices.
pub fn reported(res: &kvtier::Result<()>) -> Option<kvtier::BadIndexReport> {
    match res {
        Ok(()) => None,
        Err(kvtier::Error::BadIndices(r)) => Some(r.clone()),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// The report an expected error word decodes to.
pub fn expected_report(word: &ErrorWord) -> Option<kvtier::BadIndexReport> {
    (!word.is_clear()).then(|| kvtier::BadIndexReport::decode(word))
}
