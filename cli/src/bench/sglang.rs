//! SGLang's own HiSparse kernels (the single-step swap-in of each of its
//! three paths, and the speculative swap-in), for timing beside kvtier's on
//! identical inputs: a library built by scripts/sglang-kernels.sh from the
//! pinned SGLang wheel's sources (never part of kvtier), loaded from the path
//! in `KVTIER_SGLANG_KERNELS` when it is set, used on the CUDA executor only.

use std::ffi::{CString, c_void};

use kvtier::abi::{kvt_spec_swap_in_params, kvt_swap_in_params};

use super::invalid;
use super::swap_path::SwapPath;

/// The environment variable naming the library.
pub(super) const ENV: &str = "KVTIER_SGLANG_KERNELS";

/// The thread-block size SGLang's own benchmark gives its swap-in kernel (its
/// coordinator's default is 960, which the library also holds).
const SWAP_IN_BLOCK: u32 = 1024;

type SpecFn = unsafe extern "C" fn(*const kvt_spec_swap_in_params, *mut c_void) -> i32;
type SwapInFn = unsafe extern "C" fn(*const kvt_swap_in_params, u32, *mut c_void) -> i32;

/// The loaded library's entry points (the library stays loaded for the
/// process: the handle is never closed).
pub(super) struct SglangKernels {
    spec: SpecFn,
    /// The single-step swap-in of DSA's linear rows, DeepSeek-V4's C4 rows
    /// and MiniMax-M3's K and V, in [`SwapPath`] order.
    swap_in: [SwapInFn; 3],
    pub path: String,
}

impl SglangKernels {
    /// The library `KVTIER_SGLANG_KERNELS` names; None when it is not set.
    pub fn from_env() -> kvtier::Result<Option<Self>> {
        let Ok(path) = std::env::var(ENV) else {
            return Ok(None);
        };
        let c = CString::new(path.clone()).map_err(|_| invalid(ENV, "contains a NUL byte"))?;
        // SAFETY: a C string; the library's initialisers are the CUDA
        // runtime's and the C++ runtime's.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a C string or null.
            let why = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    String::from("unknown error")
                } else {
                    std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            return Err(invalid(
                ENV,
                format!("cannot load {path}: {why} (build it with scripts/sglang-kernels.sh)"),
            ));
        }
        let symbol = |name: &str| -> kvtier::Result<*mut c_void> {
            let c = CString::new(name).expect("no NUL");
            // SAFETY: a live handle and a C string.
            let sym = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if sym.is_null() {
                return Err(invalid(
                    ENV,
                    format!(
                        "{path} has no {name} (an older build: rebuild it with scripts/sglang-kernels.sh)"
                    ),
                ));
            }
            Ok(sym)
        };
        let swap_in = |name: &str| -> kvtier::Result<SwapInFn> {
            // SAFETY: bench/sglang-kernels/swap_in_harness.cu's functions,
            // whose signature SwapInFn spells.
            Ok(unsafe { std::mem::transmute::<*mut c_void, SwapInFn>(symbol(name)?) })
        };
        let swap_in = [
            swap_in("kvt_sglang_swap_in")?,
            swap_in("kvt_sglang_swap_in_dsv4")?,
            swap_in("kvt_sglang_swap_in_m3")?,
        ];
        // SAFETY: bench/sglang-kernels/spec_harness.cu's function, whose
        // signature SpecFn spells.
        let spec = unsafe {
            std::mem::transmute::<*mut c_void, SpecFn>(symbol("kvt_sglang_spec_swap_in")?)
        };
        Ok(Some(SglangKernels {
            spec,
            swap_in,
            path,
        }))
    }

    /// Whether the library's build of SGLang's swap-in kernel for `path`
    /// serves a shape: SGLang instantiates its kernel per top-k and hot
    /// buffer, and the harness holds those of the models' defaults only
    /// ([`SglangKernels::swap_in_shapes`]); the bench leaves its line out
    /// elsewhere rather than stop.
    pub fn serves_swap_in(path: SwapPath, k: u32, hot: u32) -> bool {
        match path {
            SwapPath::Mla => k == 2048 && (hot == 4096 || hot == 8192),
            SwapPath::Dsv4C4 => (k == 512 || k == 1024) && hot == 4096,
            SwapPath::M3Kv => k == 16 && hot == 4096,
        }
    }

    /// The shapes [`SglangKernels::serves_swap_in`] takes, in words.
    pub fn swap_in_shapes(path: SwapPath) -> &'static str {
        match path {
            SwapPath::Mla => "top-k 2048 and hot 4096 or 8192",
            SwapPath::Dsv4C4 => {
                "top-k 512 or 1024 (DeepSeek-V4-Flash's and DeepSeek-V4-Pro's) and hot 4096"
            }
            SwapPath::M3Kv => "16 blocks of 128 tokens (MiniMax-M3's) and hot 4096",
        }
    }

    /// SGLang's single-step swap-in for `path` on kvtier's checked
    /// parameters (with `num_real_reqs` given), blocks of [`SWAP_IN_BLOCK`]
    /// threads, on `stream`.
    ///
    /// # Safety
    /// `p` must come from the swap-in's checks for device buffers of the
    /// current device, valid until the kernel completes.
    pub unsafe fn swap_in(
        &self,
        path: SwapPath,
        p: &kvt_swap_in_params,
        stream: kvtier::Stream,
    ) -> kvtier::Result<()> {
        let f = self.swap_in[path as usize];
        // SAFETY: per this function's contract.
        let rc = unsafe { f(p, SWAP_IN_BLOCK, stream.raw() as *mut c_void) };
        // (inside the timing: the message is made only for an error)
        if rc == 0 {
            return Ok(());
        }
        status(
            rc,
            "--swap-k/--hot",
            &format!(
                "SGLang's {} swap-in kernel is built for {} only",
                path.name(),
                Self::swap_in_shapes(path)
            ),
        )
    }

    /// SGLang's speculative swap-in on kvtier's checked parameters, on `stream`.
    ///
    /// # Safety
    /// `p` must come from the speculative swap-in's checks for device buffers
    /// of the current device, valid until the kernels complete.
    pub unsafe fn spec(
        &self,
        p: &kvt_spec_swap_in_params,
        stream: kvtier::Stream,
    ) -> kvtier::Result<()> {
        // SAFETY: per this function's contract.
        let rc = unsafe { (self.spec)(p, stream.raw() as *mut c_void) };
        status(
            rc,
            "--swap-k/--hot/--entry",
            "SGLang's speculative kernels are built for top-k 2048, hot 4096 and 576- or 656-byte items only",
        )
    }
}

/// A harness function's return code as a result.
fn status(rc: i32, arg: &'static str, shapes: &str) -> kvtier::Result<()> {
    match rc {
        0 => Ok(()),
        -1 => Err(invalid(arg, shapes.to_string())),
        -2 => Err(invalid("bench", "a layout SGLang's kernel cannot take")),
        e => Err(kvtier::Error::Pool(format!(
            "SGLang's kernel failed to launch (CUDA error {e})"
        ))),
    }
}
