//! The CUDA side: driver probe, the device (primary context plus loaded
//! kernels), streams, launches, device memory, host registration and graphs.
//!
//! libcuda is loaded at run time (cudarc's `dynamic-loading`), so the binary
//! builds and starts on a machine without CUDA. Every entry point probes for
//! the library first and returns [`Error::NoDriver`] instead of letting the
//! loader panic.

mod graph;
pub mod kernels;
mod memory;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

pub use graph::CudaGraph;
pub use kernels::{BLOCK_THREADS, FatbinImage, Kernel, KernelBuild};
pub use memory::{
    DeviceBuffer, EventTimer, HostRegistration, OwnedStream, REGISTER_FLAGS, REGISTER_IOMEMORY,
    StreamEvent,
};
pub(crate) use memory::{DeviceErrorWord, DeviceSnapshot, copy_to_device_async};

use crate::error::{DriverContext, Error, Result};

/// What the machine's CUDA driver offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverStatus {
    /// libcuda could not be loaded.
    Missing,
    /// libcuda loaded but `cuInit` failed (e.g. no GPU, or a driver mismatch).
    InitFailed(String),
    /// The driver is usable.
    Ready {
        /// Driver API version, e.g. 13000 for CUDA 13.0.
        version: i32,
        /// GPUs visible to this process.
        devices: i32,
    },
}

/// Probes for libcuda and initialises it. Safe to call on any machine.
pub fn probe_driver() -> DriverStatus {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return DriverStatus::Missing;
    }
    if let Err(e) = result::init() {
        return DriverStatus::InitFailed(format!("cuInit failed: {e}"));
    }
    let mut version = 0;
    // SAFETY: the out-pointer is valid; the driver is initialised.
    unsafe { sys::cuDriverGetVersion(&mut version) };
    let devices = result::device::get_count().unwrap_or(0);
    DriverStatus::Ready { version, devices }
}

/// (binary arch, PTX arch) of a loaded function's code, e.g. (90, 90).
fn loaded_arch(f: sys::CUfunction) -> Result<(i32, i32)> {
    let attr = |a| {
        let mut v = 0;
        // SAFETY: a loaded function of the current context; the out-pointer
        // is valid.
        unsafe { sys::cuFuncGetAttribute(&mut v, a, f) }
            .result()
            .call("cuFuncGetAttribute")
            .map(|()| v)
    };
    Ok((
        attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_BINARY_VERSION)?,
        attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PTX_VERSION)?,
    ))
}

/// Fails with [`Error::NoDriver`] unless the driver is usable and has a GPU.
pub fn require_driver() -> Result<()> {
    match probe_driver() {
        DriverStatus::Missing => Err(Error::NoDriver(
            "libcuda.so could not be loaded (no NVIDIA driver on this machine); the CPU executor \
             still works"
                .into(),
        )),
        DriverStatus::InitFailed(why) => Err(Error::NoDriver(why)),
        DriverStatus::Ready { devices: 0, .. } => {
            Err(Error::NoDriver("the driver sees no GPU".into()))
        }
        DriverStatus::Ready { .. } => Ok(()),
    }
}

/// A CUDA stream by its raw handle: the engine's own stream, one kvtier
/// created ([`OwnedStream`]), or the legacy default stream ([`Stream::null`]).
/// The CPU executor ignores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(sys::CUstream);

// SAFETY: a CUstream is a driver handle that may be used from any thread.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    /// The legacy default stream (and the value to pass to the CPU executor).
    pub const fn null() -> Self {
        Stream(std::ptr::null_mut())
    }

    /// Wraps a raw stream, e.g. `torch.cuda.current_stream().cuda_stream`.
    ///
    /// # Safety
    /// `raw` must be a live stream of the device's primary context (or null)
    /// for as long as it is used.
    pub const unsafe fn from_raw(raw: sys::CUstream) -> Self {
        Stream(raw)
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::CUstream {
        self.0
    }

    /// Whether this is a default stream rather than one a caller created:
    /// null or `CU_STREAM_LEGACY` (the legacy default stream, which
    /// synchronises implicitly with the context's blocking streams) or
    /// `CU_STREAM_PER_THREAD`. Launches there are ordinary ones, never
    /// programmatic dependents.
    pub fn is_default(&self) -> bool {
        matches!(self.0 as usize, 0..=2)
    }
}

/// The caller's context [`CudaDevice::bind`] replaced, made current again on
/// drop.
#[must_use = "the device's context is current only while this lives: keep it for the call"]
pub(crate) struct Bound {
    /// The caller's context to restore; None when there is none to restore
    /// (the device's was current already, or no context was).
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: the context that was current on this thread before the
            // call, which its owner keeps alive.
            let _ = unsafe { result::ctx::set_current(previous) };
        }
    }
}

impl Default for Stream {
    fn default() -> Self {
        Stream::null()
    }
}

/// One GPU: its primary context (the one torch and other engines use, so
/// their pointers and streams are valid here), the loaded kernels, and the
/// properties launches are sized by.
pub struct CudaDevice {
    // Field order matters for Drop: the module is unloaded (in Drop::drop)
    // while `ctx` is still retained.
    kernels: kernels::Kernels,
    ctx: Arc<CudaContext>,
    name: String,
    compute_capability: (i32, i32),
    sm_count: u32,
    /// Kernels may be launched as programmatic dependents: an sm_90 or
    /// later GPU running code compiled for compute_90 or later (which holds
    /// the kernels' `griddepcontrol.wait`).
    dependent_launch: bool,
    /// The loaded kernels have the bulk-copy engine (`cp.async.bulk`): the
    /// same condition, code for compute_90 or later on an sm_90 or later GPU.
    bulk_copy: bool,
    /// Kernels may be launched in thread-block clusters
    /// ([`CudaDevice::launch_clustered`]): the same condition again.
    cluster_launch: bool,
    /// Shared memory of one SM, and what the driver reserves of it for each
    /// resident block: how many blocks of a given dynamic size fit an SM.
    smem_per_sm: usize,
    smem_reserved_per_block: usize,
}

impl CudaDevice {
    /// Opens GPU `ordinal`: probes the driver, retains the primary context and
    /// loads the embedded kernels. Fails with [`Error::NoDriver`] or
    /// [`Error::KernelsNotBuilt`] where those are missing.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        // The driver first: on a machine without a GPU, missing kernels are
        // not the reason to give.
        require_driver()?;
        kernels::fatbin()?;
        let count = result::device::get_count().call("cuDeviceGetCount")?;
        if ordinal >= count as usize {
            return Err(crate::error::invalid(
                "ordinal",
                format!("GPU {ordinal} does not exist; this machine has {count}"),
            ));
        }
        // cudarc makes the primary context current while it opens it, and
        // the kernels load into it; a context of the caller's own is current
        // again when this returns.
        let _restore = Bound {
            previous: result::ctx::get_current()
                .call("cuCtxGetCurrent")?
                .filter(|c| !c.is_null()),
        };
        let ctx = CudaContext::new(ordinal).call("cuDevicePrimaryCtxRetain")?;
        let name = ctx.name().call("cuDeviceGetName")?;
        let compute_capability = ctx.compute_capability().call("cuDeviceGetAttribute")?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .call("cuDeviceGetAttribute")? as u32;
        let smem_optin = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .call("cuDeviceGetAttribute")? as usize;
        let smem_per_sm = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )
            .call("cuDeviceGetAttribute")? as usize;
        let smem_reserved_per_block = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
            )
            .call("cuDeviceGetAttribute")? as usize;
        let kernels = kernels::Kernels::load(smem_optin)?;
        let (_, ptx) = loaded_arch(kernels.function(Kernel::SwapInCopy))?;
        Ok(Arc::new(CudaDevice {
            kernels,
            ctx,
            name,
            compute_capability,
            sm_count,
            dependent_launch: compute_capability.0 >= 9 && ptx >= 90,
            bulk_copy: compute_capability.0 >= 9 && ptx >= 90,
            cluster_launch: compute_capability.0 >= 9 && ptx >= 90,
            smem_per_sm,
            smem_reserved_per_block,
        }))
    }

    /// The GPU's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Whether kernels that wait for their predecessor (the swap-in's copy
    /// kernel) are launched as programmatic dependents, scheduled while the
    /// kernel before them finishes (sm_90 and later).
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch
    }

    /// Whether `CopyMethod::BulkRuns` runs its own kernel here (sm_90 and
    /// later); elsewhere a call of it runs `MergedRuns`.
    pub fn bulk_copy(&self) -> bool {
        self.bulk_copy
    }

    /// Whether kernels may be launched in thread-block clusters (sm_90 and
    /// later, code for compute_90 or later); elsewhere the swap-in's cluster
    /// build is not launched.
    pub fn cluster_launch(&self) -> bool {
        self.cluster_launch
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Blocks of `kernel` an SM holds at once with `smem` bytes of dynamic
    /// shared memory each, as the driver reports it.
    pub(crate) fn resident_blocks(&self, kernel: Kernel, smem: usize) -> Result<u32> {
        // SAFETY: a function of the loaded module, queried only.
        let blocks = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                self.kernels.function(kernel),
                kernel.block_threads() as i32,
                smem,
            )
        }
        .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
        Ok(blocks.max(0) as u32)
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The GPU's PCI bus id, e.g. `0000:1B:00.0`.
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.ctx.cu_device())
        }
        .result()
        .call("cuDeviceGetPCIBusId")?;
        // SAFETY: NUL-terminated within the buffer.
        let id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(id.to_string_lossy().into_owned())
    }

    /// The NUMA node the GPU hangs off (from sysfs), where the machine says.
    pub fn numa_node(&self) -> Option<u32> {
        let id = self.pci_bus_id().ok()?.to_lowercase();
        let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?;
        text.trim()
            .parse::<i64>()
            .ok()
            .and_then(|n| u32::try_from(n).ok())
    }

    /// What the driver loaded for the kernels, from the gather kernel's
    /// attributes: (binary arch, PTX arch), e.g. (90, 90) for sm_90 SASS.
    /// A binary arch the fatbin has no SASS for means the driver compiled
    /// the PTX at load time.
    pub fn loaded_kernel_arch(&self) -> Result<(i32, i32)> {
        let _bound = self.bind()?;
        loaded_arch(self.kernels.function(Kernel::Gather))
    }

    /// Makes the device's context current on the calling thread (engines call
    /// kvtier from threads that may have another context current).
    /// Makes the device's context current on the calling thread for as long
    /// as the returned guard lives. A context of the caller's own that was
    /// current before is current again when it drops, so such a caller keeps
    /// it; where none was, the device's stays current (later calls then
    /// switch nothing, as with torch's primary context, which is this one).
    pub(crate) fn bind(&self) -> Result<Bound> {
        let current = result::ctx::get_current().call("cuCtxGetCurrent")?;
        if current == Some(self.ctx.cu_ctx()) {
            return Ok(Bound { previous: None });
        }
        self.ctx.bind_to_thread().call("cuCtxSetCurrent")?;
        Ok(Bound {
            previous: current.filter(|c| !c.is_null()),
        })
    }

    /// A new non-blocking stream.
    pub fn create_stream(self: &Arc<Self>) -> Result<OwnedStream> {
        OwnedStream::new(self.clone())
    }

    /// Waits for all work on `stream`.
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: `stream` is a live stream of this context (Stream's contract).
        unsafe { result::stream::synchronize(stream.raw()) }.call("cuStreamSynchronize")
    }

    /// Waits for all work in the device's context, on every stream.
    pub fn synchronize_all(&self) -> Result<()> {
        let _bound = self.bind()?;
        result::ctx::synchronize().call("cuCtxSynchronize")
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        let _bound = self.bind()?;
        let (free, total) = result::mem_get_info().call("cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    /// Enqueues a copy of `bytes` bytes from host memory to device memory on
    /// `stream` (the copy engine; the benchmark's limit).
    ///
    /// # Safety
    /// `src..src + bytes` must be host memory (registered or pinned for the
    /// copy to be asynchronous) and `dst..dst + bytes` device memory of this
    /// device, both valid until the copy completes.
    pub unsafe fn copy_host_to_device_async(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream.raw()) }
            .result()
            .call("cuMemcpyHtoDAsync")
    }

    /// Enqueues a copy of `bytes` bytes from device memory to host memory on
    /// `stream` (the copy engine; the writeback benchmark's limit).
    ///
    /// # Safety
    /// `src..src + bytes` must be device memory of this device and
    /// `dst..dst + bytes` host memory (registered or pinned for the copy to be
    /// asynchronous), both valid until the copy completes.
    pub unsafe fn copy_device_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream.raw()) }
            .result()
            .call("cuMemcpyDtoHAsync")
    }

    /// Enqueues a device-to-device copy of `bytes` bytes on `stream`.
    ///
    /// # Safety
    /// Both ranges must be device memory of this device, valid until the copy
    /// completes.
    pub unsafe fn copy_device_to_device_async(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: per this function's contract.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.raw()) }
            .call("cuMemcpyDtoDAsync")
    }

    /// Enqueues setting `bytes` bytes of device memory to `value` on
    /// `stream` (the benchmark's stand-in for a layer's compute: it keeps the
    /// SMs and HBM busy for a time measured alone).
    ///
    /// # Safety
    /// `dst..dst + bytes` must be device memory of this device, valid until
    /// the set completes.
    pub unsafe fn memset_async(
        &self,
        dst: u64,
        value: u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: per this function's contract.
        unsafe { result::memset_d8_async(dst, value, bytes, stream.raw()) }.call("cuMemsetD8Async")
    }

    /// The device address of host memory that is page-locked and mapped for
    /// this GPU (pinned, or registered with `cuMemHostRegister` /
    /// `cudaHostRegister`), e.g. a pinned torch tensor's `data_ptr()`.
    /// Memory that is not gets a clear error instead of a kernel fault.
    pub fn mapped_host_address(&self, host: u64) -> Result<u64> {
        let _bound = self.bind()?;
        let mut device = 0;
        // SAFETY: the driver only looks the address up.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(crate::error::invalid(
                "host_cache",
                format!(
                    "host memory at {host:#x} is not page-locked and mapped for GPU {} ({r:?}): pin it \
                     or register it (cudaHostRegister) first",
                    self.ordinal()
                ),
            ));
        }
        Ok(device)
    }

    /// Grid size for a kernel that runs one warp per work row over `rows`
    /// rows with a grid-stride loop: enough blocks to cover the rows, capped at
    /// what is resident at once.
    pub(crate) fn grid_for_rows(&self, kernel: Kernel, rows: u64) -> u32 {
        let warps_per_block = (kernel.block_threads() / 32) as u64;
        let needed = rows.div_ceil(warps_per_block);
        let resident = self.sm_count as u64 * self.kernels.blocks_per_sm(kernel) as u64;
        needed.min(resident).max(1) as u32
    }

    /// Launches a kernel of the `BulkRuns` copy method (one warp a group of
    /// `groups` groups, grid-stride) with `smem` bytes of dynamic shared
    /// memory a block, on at most as many blocks as are resident at once:
    /// what registers allow and what the SM's shared memory holds at that
    /// size (its blocks take the whole carveout). `None` where the GPU has
    /// no bulk-copy engine or a block's stages exceed a block's shared
    /// memory; the caller then runs its merged-runs kernel.
    ///
    /// # Safety
    /// As for [`CudaDevice::launch`]; `kernel` carves `smem` bytes.
    pub(crate) unsafe fn launch_bulk<P>(
        &self,
        kernel: Kernel,
        groups: u64,
        smem: u64,
        params: &P,
        stream: Stream,
    ) -> Option<Result<()>> {
        if !self.bulk_copy || smem > self.max_dynamic_smem() as u64 {
            return None;
        }
        let fit =
            (self.smem_per_sm as u64 / (smem + self.smem_reserved_per_block as u64)).max(1) as u32;
        let grid = self
            .grid_for_rows(kernel, groups)
            .min(self.sm_count * fit)
            .max(1);
        // SAFETY: per this function's contract.
        Some(unsafe { self.launch(kernel, grid, BLOCK_THREADS, smem as u32, params, stream) })
    }

    /// Dynamic shared memory per block the swap-in kernels may use.
    pub fn max_dynamic_smem(&self) -> usize {
        self.kernels.max_dynamic_smem()
    }

    /// Launches `kernel` on `grid` blocks of `block` threads with `smem` bytes
    /// of dynamic shared memory, its parameter struct passed by value.
    ///
    /// # Safety
    /// `params` must be the struct `kernel` takes, and every address in it
    /// must satisfy that kernel's contract (see `kernels/abi.h`) until the
    /// launch completes on `stream`; `block` and `smem` must be what the
    /// kernel expects.
    pub(crate) unsafe fn launch<P>(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        smem: u32,
        params: &P,
        stream: Stream,
    ) -> Result<()> {
        let _bound = self.bind()?;
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: per this function's contract; cuLaunchKernel copies the
        // parameter bytes before returning.
        unsafe {
            result::launch_kernel(
                self.kernels.function(kernel),
                (grid, 1, 1),
                (block, 1, 1),
                smem,
                stream.raw(),
                &mut args,
            )
        }
        .call("cuLaunchKernel")
    }

    /// [`CudaDevice::launch`] as a programmatic dependent of the kernel
    /// before it on `stream` (sm_90 and later: programmatic stream
    /// serialization), so that it is scheduled while that kernel finishes
    /// instead of after it; the kernel must begin with
    /// `kvt::grid_dependency_wait()` (`kernels/common.cuh`), which holds it
    /// until the previous kernel has completed and its writes are visible.
    /// Before sm_90, with code compiled for an older arch (which lacks the
    /// wait), or on the legacy default stream, an ordinary launch.
    ///
    /// # Safety
    /// As for [`CudaDevice::launch`], and `kernel` waits as said above.
    pub(crate) unsafe fn launch_dependent<P>(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        smem: u32,
        params: &P,
        stream: Stream,
    ) -> Result<()> {
        // The legacy default stream keeps its implicit synchronisation with
        // other streams: ordinary launches there.
        if !self.dependent_launch() || stream.is_default() {
            // SAFETY: per this function's contract.
            return unsafe { self.launch(kernel, grid, block, smem, params, stream) };
        }
        // SAFETY: a zeroed union is a valid value; one field is set.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        // SAFETY: per this function's contract.
        unsafe { self.launch_with(kernel, grid, block, smem, attr, params, stream) }
    }

    /// [`CudaDevice::launch`] in thread-block clusters: `clusters` of
    /// `cluster` blocks each (a grid of their product). The blocks of a
    /// cluster are scheduled together, on SMs of one GPC, and may wait for
    /// each other at a cluster barrier (`kvt::cluster_sync`,
    /// `kernels/common.cuh`).
    ///
    /// # Safety
    /// As for [`CudaDevice::launch`]; [`CudaDevice::cluster_launch`] holds,
    /// and `kernel` is written for clusters of `cluster` blocks.
    pub(crate) unsafe fn launch_clustered<P>(
        &self,
        kernel: Kernel,
        (clusters, cluster): (u32, u32),
        block: u32,
        smem: u32,
        params: &P,
        stream: Stream,
    ) -> Result<()> {
        debug_assert!(self.cluster_launch && cluster > 0);
        let grid = clusters.checked_mul(cluster).ok_or_else(|| {
            crate::error::invalid(
                "batch",
                format!("{clusters} clusters of {cluster} blocks are too many"),
            )
        })?;
        // SAFETY: a zeroed union is a valid value; one field is set.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.clusterDim.x = cluster;
        value.clusterDim.y = 1;
        value.clusterDim.z = 1;
        let attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value,
        };
        // SAFETY: per this function's contract.
        unsafe { self.launch_with(kernel, grid, block, smem, attr, params, stream) }
    }

    /// [`CudaDevice::launch`] with one launch attribute (`cuLaunchKernelEx`):
    /// what the dependent and the clustered launches share.
    ///
    /// # Safety
    /// As for [`CudaDevice::launch`], and `attr` is one the kernel is
    /// written for.
    #[allow(clippy::too_many_arguments)] // the launch's own parts, as cuLaunchKernelEx takes them
    unsafe fn launch_with<P>(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        smem: u32,
        mut attr: sys::CUlaunchAttribute,
        params: &P,
        stream: Stream,
    ) -> Result<()> {
        let _bound = self.bind()?;
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.raw(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: per this function's contract; the config, its attribute
        // and the parameter bytes are read before cuLaunchKernelEx returns.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.kernels.function(kernel),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .call("cuLaunchKernelEx")
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Ok(_bound) = self.bind() {
            // SAFETY: the module was loaded in this context and nothing uses it
            // any more (every user holds an Arc<CudaDevice>).
            unsafe {
                let _ = result::module::unload(self.kernels.module);
            }
        }
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::Stream;

    #[test]
    fn default_streams_are_told_from_created_ones() {
        // SAFETY: the handles are only compared, never used.
        let raw = |v: usize| unsafe { Stream::from_raw(v as super::sys::CUstream) };
        for (handle, default) in [
            (0, true),
            (1, true),
            (2, true),
            (3, false),
            (0x7f00_0000_1000, false),
        ] {
            assert_eq!(raw(handle).is_default(), default, "{handle:#x}");
        }
        assert!(Stream::null().is_default());
    }
}
