#![allow(dead_code)] // each test binary uses a part
//! Engram gather cases and an independent model of their arithmetic: values
//! decoded from the e4m3 and e8m0 definitions in f64, the product rounded to
//! f32 by the language's conversion, and bf16 chosen as the nearer of the two
//! neighbouring bf16 values (ties to even), not by the kernel's bit trick.

use kvtier::engram::{EngramArgs, EngramGatherer};
use kvtier::{Buf, BufMut, Executor, IndexBuf, Stream};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// An e4m3fn byte's value (None: NaN), from its definition.
pub fn e4m3_value(b: u8) -> Option<f64> {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f64);
    if e == 15 && m == 7.0 {
        return None;
    }
    Some(if e == 0 {
        sign * (m / 8.0) * 2f64.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    })
}

/// An e8m0 byte's scale: 2^(e-127); 0 is 2^-127, 255 +inf (SGLang's Triton).
pub fn e8m0_value(e: u8) -> f64 {
    match e {
        255 => f64::INFINITY,
        e => 2f64.powi(e as i32 - 127),
    }
}

/// `x` (an f32) as bf16 bits: the nearer neighbour, ties to the even one;
/// NaN as 0x7FFF.
pub fn bf16_nearest(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FFF;
    }
    let lo = (x.to_bits() >> 16) as u16; // toward zero
    let value = |b: u16| f32::from_bits((b as u32) << 16) as f64;
    if value(lo) == x as f64 {
        return lo;
    }
    let hi = lo + 1; // away from zero (same sign)
    let (dl, dh) = ((x as f64 - value(lo)).abs(), (value(hi) - x as f64).abs());
    if dl < dh || (dl == dh && lo.is_multiple_of(2)) {
        lo
    } else {
        hi
    }
}

/// One value of the gather's output, from the definitions.
pub fn model_value(w: u8, e: u8) -> u16 {
    match e4m3_value(w) {
        None => 0x7FFF,
        Some(v) => {
            let p = v * e8m0_value(e); // exact in f64, or inf, or NaN (0 * inf)
            bf16_nearest(p as f32)
        }
    }
}

/// A gather: a table of `rows` rows of global ids `row_lo..`, ids to fetch.
#[derive(Clone, Debug)]
pub struct EngramCase {
    pub dim: u32,
    pub block: u32,
    pub rows: usize,
    pub weights: Vec<u8>,
    pub scales: Vec<u8>,
    pub ids: Vec<i64>,
    pub ids_int64: bool,
    pub row_lo: i64,
    pub row_hi: i64,
    /// Sorted reads: `ids` in the order they are read (sorted) and each
    /// one's output row (the permutation that sorted them).
    pub out_rows: Option<Vec<i32>>,
}

impl EngramCase {
    /// Random tables (edge bytes over-represented) and ids in, around and
    /// past the range; `hostile` adds ids far outside and ranges past the
    /// table.
    pub fn random(seed: u64, hostile: bool) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let dim = [8u32, 16, 64, 256, 512][rng.random_range(0..5)];
        let block = [1u32, 2, 8, 32, dim][rng.random_range(0..5)].min(dim);
        let rows = rng.random_range(1..40usize);
        let edge_w = [0x00u8, 0x80, 0x7F, 0xFF, 0x01, 0x81, 0x7E, 0xFE, 0x08, 0x07];
        let edge_e = [0u8, 1, 2, 126, 127, 128, 200, 254, 255];
        let weights = (0..rows * dim as usize)
            .map(|_| {
                if rng.random_bool(0.2) {
                    edge_w[rng.random_range(0..edge_w.len())]
                } else {
                    rng.random()
                }
            })
            .collect();
        let scales = (0..rows * (dim / block) as usize)
            .map(|_| {
                if rng.random_bool(0.3) {
                    edge_e[rng.random_range(0..edge_e.len())]
                } else {
                    rng.random_range(100..150)
                }
            })
            .collect();
        let row_lo = if rng.random_bool(0.5) {
            0
        } else {
            rng.random_range(0..1000)
        };
        let row_hi = match rng.random_range(0..3) {
            0 => row_lo + rows as i64,                       // exactly the table
            1 => row_lo + rng.random_range(0..=rows as i64), // part of it
            _ if hostile => 1i64 << 62,                      // SGLang's default: past it
            _ => row_lo + rows as i64,
        };
        let n = rng.random_range(0..60usize);
        let mut ids: Vec<i64> = (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 if hostile => rng.random_range(i64::MIN / 2..0),
                1 if hostile => row_lo + rows as i64 + rng.random_range(0..1000),
                2 => row_lo - 1,
                3 => row_hi,
                _ => row_lo + rng.random_range(0..rows as i64),
            })
            .collect();
        // a third of the cases read sorted, as SGLang's sort_ids does
        let out_rows = rng.random_bool(1.0 / 3.0).then(|| {
            let mut order: Vec<i32> = (0..n as i32).collect();
            order.sort_by_key(|&i| ids[i as usize]);
            ids = order.iter().map(|&i| ids[i as usize]).collect();
            order
        });
        EngramCase {
            dim,
            block,
            rows,
            weights,
            scales,
            ids,
            ids_int64: rng.random_bool(0.5) || hostile,
            row_lo,
            row_hi,
            out_rows,
        }
    }

    /// The output row of the `i`-th id read.
    pub fn out_row(&self, i: usize) -> usize {
        self.out_rows.as_ref().map_or(i, |r| r[i] as usize)
    }

    /// What the gather must write, and the (position, id) it must report.
    pub fn expected(&self) -> (Vec<u16>, Vec<(u32, i64)>) {
        let dim = self.dim as usize;
        let per_row = dim / self.block as usize;
        let end = self.row_hi.min(self.row_lo + self.rows as i64);
        let mut out = vec![0u16; self.ids.len() * dim];
        let mut bad = Vec::new();
        for (i, &id) in self.ids.iter().enumerate() {
            if id >= self.row_lo && id < end {
                let r = (id - self.row_lo) as usize;
                let o = self.out_row(i);
                for j in 0..dim {
                    out[o * dim + j] = model_value(
                        self.weights[r * dim + j],
                        self.scales[r * per_row + j / self.block as usize],
                    );
                }
            } else if id >= end && id < self.row_hi {
                // reported at its place in the caller's order
                bad.push((self.out_row(i) as u32, id));
            }
        }
        (out, bad)
    }

    /// The ids as the kernel reads them (int32 cases keep theirs in range).
    pub fn ids32(&self) -> Vec<i32> {
        self.ids
            .iter()
            .map(|&x| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
            .collect()
    }

    /// Runs the case on the CPU executor: the output, and the error.
    pub fn run_cpu(&self) -> (Vec<u16>, kvtier::Result<()>) {
        let g = EngramGatherer::new(Executor::cpu()).unwrap();
        let mut out = vec![0xABABu16; self.ids.len() * self.dim as usize + 8];
        // 16-byte aligned view
        let skip = (16 - (out.as_ptr() as usize % 16)) % 16 / 2;
        let n = self.ids.len() * self.dim as usize;
        let (ids64, ids32) = (self.ids.clone(), self.ids32());
        let weights = aligned8(&self.weights);
        let r = g.gather(
            &EngramArgs {
                weights: Buf::host(&weights.0[weights.1..][..self.weights.len()]),
                scales: Buf::host(&self.scales),
                ids: if self.ids_int64 {
                    IndexBuf::I64(Buf::host(&ids64))
                } else {
                    IndexBuf::I32(Buf::host(&ids32))
                },
                out: BufMut::host(&mut out[skip..skip + n]),
                out_rows: self.out_rows.as_deref().map(Buf::host),
                dim: self.dim,
                block: self.block,
                row_lo: self.row_lo,
                row_hi: self.row_hi,
            },
            Stream::null(),
        );
        (out[skip..skip + n].to_vec(), r)
    }
}

/// `bytes` copied to an 8-byte aligned place: (storage, offset of the copy).
pub fn aligned8(bytes: &[u8]) -> (Vec<u8>, usize) {
    let mut v = vec![0u8; bytes.len() + 8];
    let off = (8 - (v.as_ptr() as usize % 8)) % 8;
    v[off..off + bytes.len()].copy_from_slice(bytes);
    (v, off)
}

#[allow(dead_code)]
pub fn cases(n: u64, hostile: bool) -> impl Iterator<Item = EngramCase> {
    (0..n).map(move |s| EngramCase::random(s * 7919 + hostile as u64, hostile))
}
