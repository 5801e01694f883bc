//! DeepSeek-V4.1's Engram gather.

use cudarc::driver::sys::CUstream;

use super::convert::*;
use super::handles::*;
use super::types::*;

/// # Safety
/// `out` is null or valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_create(exec: i32, out: *mut *mut KvtEngram) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        unsafe {
            put(out, || {
                executor(exec)
                    .and_then(crate::engram::EngramGatherer::new)
                    .map(|gatherer| KvtEngram {
                        tag: KvtEngram::TAG,
                        gatherer,
                    })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_engram_gather` in `bindings/kvtier.h` describes them;
/// every buffer in `args` addresses what it claims.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_gather(
    engram: *const KvtEngram,
    args: *const KvtEngramArgs,
    stream_: CUstream,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer and buffer.
        let e = unsafe { handle(engram, "engram")? };
        let a = unsafe { arg_ref(args, "args")? };
        let loc = e.gatherer.executor().location();
        let args = unsafe {
            crate::engram::EngramArgs {
                weights: buf(&a.weights, "weights", loc)?,
                scales: buf(&a.scales, "scales", loc)?,
                ids: index_buf(&a.ids, a.ids_type, "ids", loc)?,
                out: buf_mut(&a.out, "out", loc)?,
                out_rows: optional_buf(&a.out_rows, "out_rows", loc)?,
                dim: a.dim,
                block: a.block,
                row_lo: a.row_lo,
                row_hi: a.row_hi,
            }
        };
        e.gatherer.gather(&args, stream(stream_))
    })
}

/// # Safety
/// `engram` is null or a live `kvt_engram`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_check(engram: *const KvtEngram) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        unsafe { handle(engram, "engram")? }.gatherer.check()
    })
}

/// # Safety
/// `engram` is null or a live `kvt_engram`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_engram_destroy(engram: *mut KvtEngram) {
    // SAFETY: the header's contract.
    unsafe { release(engram, "engram") }
}
