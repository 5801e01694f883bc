//! The Engram row gather: rows of fp8 e4m3 values with e8m0 block scales
//! (DeepSeek-V4.1's Engram tables, read a few rows per token per layer),
//! dequantized to bf16, on either executor: the CPU reference below, or
//! `kvt_engram_gather` in `kernels/engram.cu`. Both follow the contract of
//! `kvt_engram_gather_params` in `kernels/abi.h`, which is SGLang 0.5.23's
//! `engram_gather` arithmetic:
//!
//! `out[i][j] = bf16_rne(f32(e4m3(w[id - row_lo][j])) × 2^(e − 127))` for an
//! id the table holds inside `[row_lo, row_hi)`, `e` the row's scale byte of
//! `j`'s block (0 is 2^−127, 255 is +inf); +0 rows for other ids. Where
//! kvtier differs from SGLang's Triton kernel, it is safer: an id inside the
//! range asked for but past the table's rows (SGLang's shared table passes
//! `row_hi = 2^62`) reads nothing, gives a +0 row and is reported, where
//! SGLang would read past the table; NaN values come out as the canonical
//! bf16 NaN `0x7FFF`.

use crate::abi::kvt_engram_gather_params;
use crate::cuda::{DeviceErrorWord, Kernel, Stream};
use crate::error::{Result, invalid};
use crate::error_word::ErrorWord;
use crate::executor::Executor;
use crate::mem::{Buf, BufMut, Location};
use crate::swap_in::IndexBuf;

/// The widest row (values) a gather takes.
pub const MAX_DIM: u32 = 4096;
/// The most ids one call takes.
pub const MAX_IDS: u32 = i32::MAX as u32;

/// One gather's arguments: the table's bytes where the executor reads them,
/// the ids, the output.
pub struct EngramArgs<'a> {
    /// `[rows][dim]` e4m3 bytes of global rows `row_lo..row_lo + rows`;
    /// 8-byte aligned.
    pub weights: Buf<'a, u8>,
    /// `[rows][dim / block]` e8m0 bytes.
    pub scales: Buf<'a, u8>,
    /// `[n]` global row ids.
    pub ids: IndexBuf<'a>,
    /// `[n][dim]` bf16 bits; 16-byte aligned.
    pub out: BufMut<'a, u16>,
    /// `[n]`: the row of `out` id `i` goes to (None: row `i`). Sorted reads
    /// pass the ids sorted and the permutation that sorted them; it must be
    /// a permutation of `0..n` (an entry outside is skipped and reported).
    pub out_rows: Option<Buf<'a, i32>>,
    pub dim: u32,
    /// Values per scale byte (DeepSeek-V4.1: 32).
    pub block: u32,
    /// The global rows asked for: `row_lo..row_hi` (SGLang's defaults: 0 and
    /// 2^62).
    pub row_lo: i64,
    pub row_hi: i64,
}

/// Checks `a` for an executor reading `want` memory and builds the kernel's
/// parameters (the error word's address filled by the caller).
fn plan(a: &EngramArgs<'_>, want: Location) -> Result<kvt_engram_gather_params> {
    let (dim, block) = (a.dim, a.block);
    if !dim.is_power_of_two() || !(8..=MAX_DIM).contains(&dim) {
        return Err(invalid(
            "dim",
            format!("{dim} is not a power of two in 8..={MAX_DIM}"),
        ));
    }
    if block == 0 || dim % block != 0 {
        return Err(invalid(
            "block_size",
            format!("{block} does not divide dim {dim}"),
        ));
    }
    if a.row_lo < 0 || a.row_hi < a.row_lo {
        return Err(invalid(
            "row_lo/row_hi",
            format!(
                "rows {}..{} are not a range of row ids (0 <= row_lo <= row_hi)",
                a.row_lo, a.row_hi
            ),
        ));
    }
    let n = a.ids.len();
    if n > MAX_IDS as usize {
        return Err(invalid("ids", format!("{n} ids; at most {MAX_IDS} a call")));
    }
    if !a.weights.len().is_multiple_of(dim as usize) {
        return Err(invalid(
            "weights",
            format!("{} bytes are not whole rows of {dim}", a.weights.len()),
        ));
    }
    let rows = (a.weights.len() / dim as usize) as u64;
    let per_row = (dim / block) as usize;
    if a.scales.len() < rows as usize * per_row {
        return Err(invalid(
            "scales",
            format!(
                "{} bytes; {rows} rows of {per_row} scales need {}",
                a.scales.len(),
                rows as usize * per_row
            ),
        ));
    }
    let touches = if n == 0 { 0 } else { rows as usize };
    a.ids.check("ids", want, n)?;
    if let Some(r) = &a.out_rows {
        r.check_aligned("out_rows", want, 4, n)?;
    }
    a.out.check_aligned("out", want, 16, n * dim as usize)?;
    a.weights
        .check_aligned("weights", want, 8, touches * dim as usize)?;
    a.scales
        .check_aligned("scales", want, 1, touches * per_row)?;
    Ok(kvt_engram_gather_params {
        weights: a.weights.addr(),
        scales: a.scales.addr(),
        ids: a.ids.addr(),
        out: a.out.addr(),
        out_rows: a.out_rows.as_ref().map_or(0, |r| r.addr()),
        error: 0,
        row_lo: a.row_lo,
        row_hi: a.row_hi,
        rows,
        n: n as u32,
        dim,
        block,
        ids_int64: a.ids.is_i64() as u32,
    })
}

/// A word's report in the Engram gather's terms.
fn engram_result(r: Result<()>) -> Result<()> {
    r.map_err(|e| match e {
        crate::Error::BadIndices(report) => crate::Error::BadIndices(report.as_engram()),
        other => other,
    })
}

/// An e4m3fn byte as fp32, exactly (bias 7, no infinities, 0x7F and 0xFF
/// NaN, exponent 0 subnormal).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = ((b & 0x80) as u32) << 24;
    let (e, m) = (((b >> 3) & 0xF) as u32, (b & 0x7) as u32);
    if e == 0xF && m == 0x7 {
        return f32::from_bits(0x7FC0_0000 | sign);
    }
    if e == 0 {
        return f32::from_bits((m as f32 * 0.001_953_125).to_bits() | sign);
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

/// Every e4m3 byte's value, for the CPU executor's inner loop.
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// 2^(e − 127) for an e8m0 byte; 0 is 2^−127 (no flush), 255 +inf.
pub fn e8m0_scale(e: u8) -> f32 {
    f32::from_bits(if e == 0 {
        0x0040_0000
    } else {
        (e as u32) << 23
    })
}

/// fp32 to bf16 bits, round to nearest even; NaN to 0x7FFF.
pub fn bf16_rne(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7FFF_FFFF > 0x7F80_0000 {
        return 0x7FFF;
    }
    ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) as u16
}

/// The CPU reference of `kvt_engram_gather`: the same outputs and error word.
///
/// # Safety
/// Every address in `p` must be host memory of the lengths [`plan`] checked.
unsafe fn run_cpu(p: &kvt_engram_gather_params) -> ErrorWord {
    let mut err = ErrorWord::clear();
    let (n, dim) = (p.n as usize, p.dim as usize);
    if n == 0 {
        return err;
    }
    let per_row = dim / p.block as usize;
    // SAFETY: lengths checked by `plan`, per this function's contract.
    let (weights, scales, out) = unsafe {
        (
            std::slice::from_raw_parts(p.weights as *const u8, p.rows as usize * dim),
            std::slice::from_raw_parts(p.scales as *const u8, p.rows as usize * per_row),
            std::slice::from_raw_parts_mut(p.out as *mut u16, n * dim),
        )
    };
    let row_end = p
        .row_hi
        .min(p.row_lo.saturating_add(p.rows.min(i64::MAX as u64) as i64));
    for i in 0..n {
        // SAFETY: `i < n` ids of the checked width.
        let id = unsafe {
            if p.ids_int64 != 0 {
                *(p.ids as *const i64).add(i)
            } else {
                *(p.ids as *const i32).add(i) as i64
            }
        };
        let mut out_row = i as i64;
        if p.out_rows != 0 {
            // SAFETY: `i < n` entries, checked by `plan`.
            out_row = unsafe { *(p.out_rows as *const i32).add(i) } as i64;
            if !(0..n as i64).contains(&out_row) {
                err.report(crate::abi::KVT_ERR_GATHER_SLOT, i as u32, out_row);
                continue;
            }
        }
        let o = &mut out[out_row as usize * dim..][..dim];
        if id < p.row_lo || id >= row_end {
            o.fill(0);
            if id >= row_end && id < p.row_hi {
                // the id's place in the caller's order (sorted reads: its
                // out row), as the kernel reports it
                err.report(crate::abi::KVT_ERR_GATHER_INDEX, out_row as u32, id);
            }
            continue;
        }
        let row = (id - p.row_lo) as usize;
        let (w, s) = (
            &weights[row * dim..][..dim],
            &scales[row * per_row..][..per_row],
        );
        let lut = e4m3_table();
        for ((o, w), &e) in o
            .chunks_mut(p.block as usize)
            .zip(w.chunks(p.block as usize))
            .zip(s)
        {
            let scale = e8m0_scale(e);
            for (v, &b) in o.iter_mut().zip(w) {
                *v = bf16_rne(lut[b as usize] * scale);
            }
        }
    }
    err
}

/// Runs Engram gathers on one executor and owns the error word they report
/// into.
pub struct EngramGatherer {
    exec: Executor,
    error: Option<DeviceErrorWord>,
}

impl EngramGatherer {
    /// A gatherer on `exec` (the CUDA executor's allocates its error word).
    pub fn new(exec: Executor) -> Result<Self> {
        let error = match &exec {
            Executor::Cpu => None,
            Executor::Cuda(dev) => Some(DeviceErrorWord::new(dev)?),
        };
        Ok(EngramGatherer { exec, error })
    }

    /// The executor it runs on.
    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// Gathers `a.ids`' rows into `a.out`: on the CPU executor now (an id
    /// past the table is an [`crate::Error::BadIndices`] once every row is
    /// written), on the CUDA executor enqueued on `stream` (no host sync,
    /// capturable in a CUDA graph; ids past the table are recorded for
    /// [`EngramGatherer::check`]).
    pub fn gather(&self, a: &EngramArgs<'_>, stream: Stream) -> Result<()> {
        match (&self.exec, &self.error) {
            (Executor::Cpu, _) => {
                let p = plan(a, Location::Host)?;
                // SAFETY: host buffers of the lengths `plan` checked.
                engram_result(unsafe { run_cpu(&p) }.into_result())
            }
            (Executor::Cuda(dev), Some(error)) => {
                let mut p = plan(a, Location::Device)?;
                if p.n == 0 {
                    return Ok(());
                }
                p.error = error.device_ptr();
                let grid = dev.grid_for_rows(Kernel::EngramGather, p.n as u64);
                let threads = Kernel::EngramGather.block_threads();
                // SAFETY: device buffers of the lengths `plan` checked, which
                // the caller keeps alive until the kernel completes.
                unsafe { dev.launch(Kernel::EngramGather, grid, threads, 0, &p, stream) }
            }
            (Executor::Cuda(_), None) => unreachable!("made with its error word"),
        }
    }

    /// The ids past the table that gathers since the last check recorded
    /// (the CUDA executor waits for the device; the CPU executor reported
    /// them at once).
    pub fn check(&self) -> Result<()> {
        match &self.error {
            Some(e) => engram_result(e.take()?.into_result()),
            None => Ok(()),
        }
    }
}
