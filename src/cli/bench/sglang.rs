//! SGLang's own HiSparse kernels, for timing beside kvtier's on identical
//! inputs: a library built by scripts/sglang-kernels.sh from the pinned
//! SGLang wheel's sources (never part of kvtier), loaded from the path in
//! `KVTIER_SGLANG_KERNELS` when it is set, on the CUDA executor only.

use std::ffi::{CString, c_void};

use kvtier::abi::kvt_spec_swap_in_params;

use super::invalid;

/// The environment variable naming the library.
pub(super) const ENV: &str = "KVTIER_SGLANG_KERNELS";

type SpecFn = unsafe extern "C" fn(*const kvt_spec_swap_in_params, *mut c_void) -> i32;

/// The loaded library's entry points (the library stays loaded for the
/// process: the handle is never closed).
pub(super) struct SglangKernels {
    spec: SpecFn,
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
        let name = CString::new("kvt_sglang_spec_swap_in").unwrap();
        // SAFETY: a live handle and a C string.
        let sym = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if sym.is_null() {
            return Err(invalid(
                ENV,
                format!("{path} has no kvt_sglang_spec_swap_in"),
            ));
        }
        // SAFETY: the symbol is bench/sglang-kernels/spec_harness.cu's
        // function, whose signature SpecFn spells.
        let spec = unsafe { std::mem::transmute::<*mut c_void, SpecFn>(sym) };
        Ok(Some(SglangKernels { spec, path }))
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
        match rc {
            0 => Ok(()),
            -1 => Err(invalid(
                "--swap-k/--hot/--entry",
                "SGLang's kernels are built for top-k 2048, hot 4096 and 576- or 656-byte items only",
            )),
            -2 => Err(invalid(
                "spec-swap-in",
                "a layout SGLang's kernel cannot take",
            )),
            e => Err(kvtier::Error::Pool(format!(
                "SGLang's speculative kernel failed to launch (CUDA error {e})"
            ))),
        }
    }
}
