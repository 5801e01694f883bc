//! The kernels compiled by build.rs: the embedded fatbin, what it holds, and
//! the registry of kernel functions loaded from it.

use std::ffi::CString;

use cudarc::driver::{result, sys};

#[cfg(not(kvtier_kernels))]
use crate::error::Error;
use crate::error::{DriverContext, Result};

include!(concat!(env!("OUT_DIR"), "/kernels_info.rs"));

/// How this build of kvtier got its kernels.
#[derive(Clone, Copy, Debug)]
pub enum KernelBuild {
    /// build.rs compiled `kernels/*.cu` into the embedded fatbin.
    Built {
        /// The compiler and its CUDA version, e.g. `NVRTC 12.9` (the pinned
        /// PyPI wheels, packed by nvFatbin) or `nvcc V13.0.88`.
        compiler: &'static str,
        /// The library or executable that compiled them.
        path: &'static str,
        /// The compiler's CUDA version as `cuDriverGetVersion` writes
        /// versions (12090 for 12.9).
        cuda: i32,
        /// Architectures with SASS in the fatbin.
        sass: &'static [&'static str],
        /// The virtual architecture of the PTX fallback.
        ptx: &'static str,
    },
    /// build.rs found no CUDA compiler; the reason says how to get one.
    NotBuilt { reason: &'static str },
}

impl KernelBuild {
    /// The compiler that built the kernels (`NVRTC 12.9`, `nvcc V13.0.88`);
    /// None when none were built.
    pub fn compiler(&self) -> Option<&'static str> {
        match self {
            KernelBuild::Built { compiler, .. } => Some(compiler),
            KernelBuild::NotBuilt { .. } => None,
        }
    }

    /// The CUDA version a driver must support to load the SASS (13000 for
    /// 13.0): the compiler's major version. Within a major version, CUDA's
    /// minor-version compatibility lets a driver of that major release run
    /// SASS built by any of its minors. None when the kernels were not
    /// built or the version cannot be read.
    pub fn driver_needed(&self) -> Option<i32> {
        match self {
            KernelBuild::Built { cuda, .. } if *cuda >= 1000 => Some(cuda / 1000 * 1000),
            _ => None,
        }
    }

    /// The CUDA version a driver must support to compile the PTX fallback,
    /// which a GPU without SASS in the fatbin runs: the compiler's own
    /// version (a driver JIT-compiles no PTX newer than itself).
    pub fn ptx_driver_needed(&self) -> Option<i32> {
        match self {
            KernelBuild::Built { cuda, .. } if *cuda >= 1000 => Some(*cuda),
            _ => None,
        }
    }
}

/// The oldest NVIDIA driver branch whose CUDA version is at least `cuda`
/// (as `cuDriverGetVersion` gives it), where known: the first branch of
/// each CUDA release (NVIDIA's CUDA toolkit release notes).
pub fn driver_branch_for(cuda: i32) -> Option<u32> {
    const BRANCHES: [(i32, u32); 11] = [
        (11080, 520),
        (12000, 525),
        (12010, 530),
        (12020, 535),
        (12030, 545),
        (12040, 550),
        (12050, 555),
        (12060, 560),
        (12080, 570),
        (12090, 575),
        (13000, 580),
    ];
    if cuda < 11000 {
        return None;
    }
    if cuda < 11080 {
        return Some(450);
    }
    BRANCHES
        .iter()
        .find(|(version, _)| *version >= cuda)
        .map(|(_, branch)| *branch)
}

/// "CUDA 13.0 or newer (NVIDIA driver R580 or later)".
pub fn describe_requirement(cuda: i32) -> String {
    let branch = driver_branch_for(cuda)
        .map_or(String::new(), |b| format!(" (NVIDIA driver R{b} or later)"));
    format!(
        "a driver for CUDA {}.{} or newer{branch}",
        cuda / 1000,
        (cuda % 1000) / 10
    )
}

/// Why a driver that supports CUDA `driver` (as `cuDriverGetVersion` gives
/// it) cannot load kernels of `build`, in one line; None when it can.
pub fn driver_too_old(driver: i32, build: &KernelBuild) -> Option<String> {
    let needed = build.driver_needed()?;
    (driver < needed).then(|| {
        let (compiler, ptx) = match build {
            KernelBuild::Built { compiler, ptx, .. } => (*compiler, *ptx),
            KernelBuild::NotBuilt { .. } => ("", ""),
        };
        format!(
            "this machine's CUDA driver supports CUDA {}.{}; kvtier's kernels were built by {compiler} \
             (SASS and {ptx} PTX) and need {}: update the driver, or use a kvtier built with an older CUDA \
             compiler (the CPU executor works either way)",
            driver / 1000,
            (driver % 1000) / 10,
            describe_requirement(needed)
        )
    })
}

#[cfg(kvtier_kernels)]
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kvtier.fatbin"));

/// The embedded fatbin, or `KernelsNotBuilt`.
pub fn fatbin() -> Result<&'static [u8]> {
    #[cfg(kvtier_kernels)]
    {
        Ok(FATBIN)
    }
    #[cfg(not(kvtier_kernels))]
    {
        match BUILD {
            KernelBuild::NotBuilt { reason } => Err(Error::KernelsNotBuilt(reason)),
            KernelBuild::Built { .. } => {
                unreachable!("kernels_info.rs and the kvtier_kernels cfg disagree")
            }
        }
    }
}

/// One image in a fatbin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FatbinImage {
    /// Machine code (SASS) for `sm_<arch>`.
    Sass { arch: u32 },
    /// PTX for `compute_<arch>`, JIT-compiled by the driver on newer GPUs.
    Ptx { arch: u32 },
}

/// Lists the images of a fatbin container, by reading its headers
/// (magic 0xBA55ED50; per entry: kind 1 = PTX, 2 = ELF; SM version at +28).
pub fn fatbin_images(fatbin: &[u8]) -> Result<Vec<FatbinImage>> {
    let bad = |why: &str| crate::error::invalid("fatbin", format!("is malformed: {why}"));
    let u16_at = |o: usize| {
        fatbin
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |o: usize| {
        fatbin
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let u64_at = |o: usize| {
        fatbin
            .get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    };
    if u32_at(0) != Some(0xBA55_ED50) {
        return Err(bad("no fatbin magic"));
    }
    let header = u16_at(6).ok_or_else(|| bad("short header"))? as usize;
    let size = u64_at(8).ok_or_else(|| bad("short header"))? as usize;
    let end = header
        .checked_add(size)
        .filter(|&e| e <= fatbin.len())
        .ok_or_else(|| bad("size"))?;
    let mut images = Vec::new();
    let mut off = header;
    while off < end {
        let kind = u16_at(off).ok_or_else(|| bad("short entry"))?;
        let entry_header = u32_at(off + 4).ok_or_else(|| bad("short entry"))? as usize;
        let payload = u32_at(off + 8).ok_or_else(|| bad("short entry"))? as usize;
        let arch = u32_at(off + 28).ok_or_else(|| bad("short entry"))?;
        match kind {
            1 => images.push(FatbinImage::Ptx { arch }),
            2 => images.push(FatbinImage::Sass { arch }),
            _ => {}
        }
        if entry_header == 0 {
            return Err(bad("zero-sized entry header"));
        }
        off += entry_header + payload;
    }
    Ok(images)
}

/// The kernels kvtier launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Gather = 0,
    Writeback = 1,
    SwapInPlan = 2,
    SwapInCopy = 3,
    SpecSwapIn = 4,
    SwapInFewMissPlan = 5,
    ErrorTake = 6,
    EngramGather = 7,
    SwapInCompactPlan = 8,
    GatherLineAligned = 9,
    WritebackLineAligned = 10,
    SwapInFewMiss512Plan = 11,
    SwapInCopyLineAligned = 12,
    GatherMergedRuns = 13,
    WritebackMergedRuns = 14,
    SwapInFewMissLinesPlan = 15,
    GatherBulkRuns = 16,
    WritebackBulkRuns = 17,
    SwapInCopyBulk = 18,
    SwapInFewMissK2048H4096Plan = 19,
    SwapInFewMissK2048H8192Plan = 20,
    SwapInFewMissClusterPlan = 21,
    SwapInSplitPlan = 22,
    SwapInFewMissK2048H4096LinesPlan = 23,
    SwapInFewMissK2048H8192LinesPlan = 24,
}

const KERNELS: usize = 25;

impl Kernel {
    const ALL: [Kernel; KERNELS] = [
        Kernel::Gather,
        Kernel::Writeback,
        Kernel::SwapInPlan,
        Kernel::SwapInCopy,
        Kernel::SpecSwapIn,
        Kernel::SwapInFewMissPlan,
        Kernel::ErrorTake,
        Kernel::EngramGather,
        Kernel::SwapInCompactPlan,
        Kernel::GatherLineAligned,
        Kernel::WritebackLineAligned,
        Kernel::SwapInFewMiss512Plan,
        Kernel::SwapInCopyLineAligned,
        Kernel::GatherMergedRuns,
        Kernel::WritebackMergedRuns,
        Kernel::SwapInFewMissLinesPlan,
        Kernel::GatherBulkRuns,
        Kernel::WritebackBulkRuns,
        Kernel::SwapInCopyBulk,
        Kernel::SwapInFewMissK2048H4096Plan,
        Kernel::SwapInFewMissK2048H8192Plan,
        Kernel::SwapInFewMissClusterPlan,
        Kernel::SwapInSplitPlan,
        Kernel::SwapInFewMissK2048H4096LinesPlan,
        Kernel::SwapInFewMissK2048H8192LinesPlan,
    ];

    /// The kernel's symbol in the fatbin.
    pub fn symbol(self) -> &'static str {
        match self {
            Kernel::Gather => "kvt_gather",
            Kernel::Writeback => "kvt_writeback",
            Kernel::SwapInPlan => "kvt_swap_in_plan",
            Kernel::SwapInCopy => "kvt_swap_in_copy",
            Kernel::SpecSwapIn => "kvt_spec_swap_in",
            Kernel::SwapInFewMissPlan => "kvt_swap_in_few_miss_plan",
            Kernel::ErrorTake => "kvt_error_take",
            Kernel::EngramGather => "kvt_engram_gather",
            Kernel::SwapInCompactPlan => "kvt_swap_in_compact_plan",
            Kernel::GatherLineAligned => "kvt_gather_line_aligned",
            Kernel::WritebackLineAligned => "kvt_writeback_line_aligned",
            Kernel::SwapInFewMiss512Plan => "kvt_swap_in_few_miss_512_plan",
            Kernel::SwapInCopyLineAligned => "kvt_swap_in_copy_line_aligned",
            Kernel::GatherMergedRuns => "kvt_gather_merged_runs",
            Kernel::WritebackMergedRuns => "kvt_writeback_merged_runs",
            Kernel::SwapInFewMissLinesPlan => "kvt_swap_in_few_miss_lines_plan",
            Kernel::GatherBulkRuns => "kvt_gather_bulk_runs",
            Kernel::WritebackBulkRuns => "kvt_writeback_bulk_runs",
            Kernel::SwapInCopyBulk => "kvt_swap_in_copy_bulk",
            Kernel::SwapInFewMissK2048H4096Plan => "kvt_swap_in_few_miss_k2048_h4096_plan",
            Kernel::SwapInFewMissK2048H8192Plan => "kvt_swap_in_few_miss_k2048_h8192_plan",
            Kernel::SwapInFewMissClusterPlan => "kvt_swap_in_few_miss_cluster_plan",
            Kernel::SwapInSplitPlan => "kvt_swap_in_split_plan",
            Kernel::SwapInFewMissK2048H4096LinesPlan => {
                "kvt_swap_in_few_miss_k2048_h4096_lines_plan"
            }
            Kernel::SwapInFewMissK2048H8192LinesPlan => {
                "kvt_swap_in_few_miss_k2048_h8192_lines_plan"
            }
        }
    }

    /// Threads per block the kernel is written for.
    pub fn block_threads(self) -> u32 {
        match self {
            Kernel::SwapInPlan => crate::abi::KVT_SWAP_PLAN_THREADS,
            Kernel::SpecSwapIn => crate::abi::KVT_SPEC_THREADS,
            Kernel::SwapInFewMissPlan
            | Kernel::SwapInFewMissLinesPlan
            | Kernel::SwapInFewMissK2048H4096Plan
            | Kernel::SwapInFewMissK2048H8192Plan
            | Kernel::SwapInFewMissK2048H4096LinesPlan
            | Kernel::SwapInFewMissK2048H8192LinesPlan
            | Kernel::SwapInFewMissClusterPlan
            | Kernel::SwapInSplitPlan => crate::abi::KVT_SWAP_FEW_MISS_THREADS,
            Kernel::SwapInCompactPlan => crate::abi::KVT_SWAP_COMPACT_THREADS,
            Kernel::SwapInFewMiss512Plan => crate::abi::KVT_SWAP_FEW_MISS_512_THREADS,
            Kernel::ErrorTake => 32,
            _ => BLOCK_THREADS,
        }
    }

    /// Kernels that take more dynamic shared memory than the default 48 KiB.
    fn wants_large_smem(self) -> bool {
        matches!(
            self,
            Kernel::SwapInPlan
                | Kernel::SwapInCopy
                | Kernel::SwapInCopyLineAligned
                | Kernel::SwapInFewMissPlan
                | Kernel::SwapInCompactPlan
                | Kernel::SwapInFewMiss512Plan
                | Kernel::SwapInFewMissLinesPlan
                | Kernel::SwapInFewMissK2048H4096Plan
                | Kernel::SwapInFewMissK2048H8192Plan
                | Kernel::SwapInFewMissK2048H4096LinesPlan
                | Kernel::SwapInFewMissK2048H8192LinesPlan
                | Kernel::SwapInFewMissClusterPlan
                | Kernel::SwapInSplitPlan
                | Kernel::GatherBulkRuns
                | Kernel::WritebackBulkRuns
                | Kernel::SwapInCopyBulk
        )
    }
}

/// Threads per block for every kernel; equals `KVT_BLOCK_THREADS` in
/// `kernels/common.cuh`.
pub const BLOCK_THREADS: u32 = 256;

/// The loaded module and its functions (a small registry, one entry per
/// [`Kernel`]), with each function's resident blocks per SM.
pub(crate) struct Kernels {
    pub(crate) module: sys::CUmodule,
    functions: [sys::CUfunction; KERNELS],
    blocks_per_sm: [u32; KERNELS],
    /// Dynamic shared memory per block the large-smem kernels may use.
    max_dynamic_smem: usize,
}

// SAFETY: module and function handles are plain driver handles, usable from any
// thread once their context is current.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the embedded fatbin into the current context; `smem_optin` is
    /// the device's opt-in limit of shared memory per block.
    pub(crate) fn load(smem_optin: usize) -> Result<Self> {
        let image = fatbin()?;
        // Said in one line before cuModuleLoadData fails with a bare
        // CUDA_ERROR_UNSUPPORTED_PTX_VERSION / NO_BINARY_FOR_GPU.
        if let super::DriverStatus::Ready { version, .. } = super::probe_driver()
            && let Some(why) = driver_too_old(version, &BUILD)
        {
            return Err(crate::error::Error::NoDriver(why));
        }
        // cuModuleLoadData wants an aligned image; include_bytes! gives none.
        let mut aligned = vec![0u64; image.len().div_ceil(8)];
        // SAFETY: `aligned` holds at least image.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                image.as_ptr(),
                aligned.as_mut_ptr() as *mut u8,
                image.len(),
            )
        };
        // SAFETY: a well-formed fatbin produced by build.rs; a context is current.
        let module = unsafe { result::module::load_data(aligned.as_ptr() as *const _) }
            .call("cuModuleLoadData")?;
        let mut kernels = Kernels {
            module,
            functions: [std::ptr::null_mut(); KERNELS],
            blocks_per_sm: [0; KERNELS],
            max_dynamic_smem: smem_optin,
        };
        for k in Kernel::ALL {
            let name = CString::new(k.symbol()).unwrap();
            // SAFETY: the module was just loaded and is not unloaded while `kernels` lives.
            let f = unsafe { result::module::get_function(module, name) }
                .call("cuModuleGetFunction")?;
            if k.wants_large_smem() {
                // SAFETY: `f` is a function of the loaded module.
                unsafe {
                    result::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem_optin as i32,
                    )
                }
                .call("cuFuncSetAttribute")?;
            }
            if matches!(
                k,
                Kernel::SwapInCompactPlan | Kernel::GatherBulkRuns | Kernel::WritebackBulkRuns
            ) {
                // Two blocks of the compact planner share an SM only with
                // the most of the SM's L1/shared split given to shared
                // memory (2 x 74 KiB at top-k 2048 over a hot buffer of
                // 8192), and the bulk kernels' blocks are as many as their
                // stages fit (launch_bulk counts the whole of it); the
                // driver takes the preference as a hint.
                // SAFETY: `f` is a function of the loaded module.
                unsafe {
                    result::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        100,
                    )
                }
                .call("cuFuncSetAttribute")?;
            }
            // SAFETY: `f` is a function of the loaded module.
            let blocks = unsafe {
                result::occupancy::max_active_block_per_multiprocessor(
                    f,
                    k.block_threads() as i32,
                    0,
                )
            }
            .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
            kernels.functions[k as usize] = f;
            kernels.blocks_per_sm[k as usize] = blocks.max(1) as u32;
        }
        Ok(kernels)
    }

    pub(crate) fn function(&self, k: Kernel) -> sys::CUfunction {
        self.functions[k as usize]
    }

    pub(crate) fn blocks_per_sm(&self, k: Kernel) -> u32 {
        self.blocks_per_sm[k as usize]
    }

    pub(crate) fn max_dynamic_smem(&self) -> usize {
        self.max_dynamic_smem
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_fatbin_matches_the_build() {
        match BUILD {
            KernelBuild::Built { sass, ptx, .. } => {
                let images = fatbin_images(fatbin().unwrap()).unwrap();
                // every build but one restricted by KVTIER_ARCHS (build.rs)
                if option_env!("KVTIER_ARCHS").is_none() {
                    for s in ["sm_80", "sm_90"] {
                        assert!(sass.contains(&s), "{sass:?}");
                    }
                }
                for s in sass {
                    let arch: u32 = s.trim_start_matches("sm_").parse().unwrap();
                    assert!(
                        images.contains(&FatbinImage::Sass { arch }),
                        "{images:?} lacks {s}"
                    );
                }
                let arch: u32 = ptx.trim_start_matches("compute_").parse().unwrap();
                assert!(
                    images.contains(&FatbinImage::Ptx { arch }),
                    "{images:?} lacks PTX {ptx}"
                );
            }
            KernelBuild::NotBuilt { reason } => {
                assert!(std::env::var("KVTIER_REQUIRE_KERNELS").as_deref() != Ok("1"));
                let err = fatbin().unwrap_err().to_string();
                assert!(err.contains("nvcc") && err == reason, "{err}");
            }
        }
    }

    #[test]
    fn fatbin_parser_rejects_garbage() {
        assert!(fatbin_images(b"not a fatbin").is_err());
        let mut truncated = vec![0x50, 0xED, 0x55, 0xBA, 1, 0, 16, 0];
        truncated.extend_from_slice(&1000u64.to_le_bytes());
        assert!(fatbin_images(&truncated).is_err());
    }

    #[test]
    fn a_driver_older_than_the_kernels_is_said_in_one_line() {
        let built = |compiler: &'static str, cuda: i32| KernelBuild::Built {
            compiler,
            path: "/x",
            cuda,
            sass: &["sm_80", "sm_90", "sm_100"],
            ptx: "compute_100",
        };
        let cuda13 = built("nvcc V13.0.88", 13000);
        assert_eq!(cuda13.driver_needed(), Some(13000));
        // a stubbed R570 driver (CUDA 12.8) against kernels built by nvcc 13.0
        let why = driver_too_old(12080, &cuda13).expect("too old");
        assert!(!why.contains('\n'), "{why}");
        assert!(
            why.contains("supports CUDA 12.8")
                && why.contains("nvcc V13.0.88")
                && why.contains("CUDA 13.0 or newer (NVIDIA driver R580 or later)"),
            "{why}"
        );
        assert_eq!(driver_too_old(13000, &cuda13), None);
        assert_eq!(driver_too_old(13020, &cuda13), None);
        // kernels of a CUDA 12 compiler load on any CUDA 12 driver (minor-version compatibility);
        // their PTX, for GPUs without SASS here, needs the compiler's own version
        let cuda12 = built("NVRTC 12.9", 12090);
        assert_eq!(cuda12.driver_needed(), Some(12000));
        assert_eq!(cuda12.ptx_driver_needed(), Some(12090));
        assert_eq!(
            describe_requirement(12090),
            "a driver for CUDA 12.9 or newer (NVIDIA driver R575 or later)"
        );
        assert_eq!(driver_branch_for(12000), Some(525));
        assert_eq!(driver_branch_for(12070), Some(570));
        assert_eq!(driver_branch_for(13010), None);
        assert_eq!(driver_too_old(12000, &cuda12), None);
        assert!(
            driver_too_old(11080, &cuda12)
                .unwrap()
                .contains("built by NVRTC 12.9")
        );
        assert!(
            driver_too_old(11080, &cuda12)
                .unwrap()
                .contains("R525 or later")
        );
        assert_eq!(
            driver_too_old(0, &KernelBuild::NotBuilt { reason: "no nvcc" }),
            None
        );
    }
}
