//! Memory where an executor addresses it ([`ExecVec`], [`Staging`]), shared
//! by the benchmark and the selftest, and the benchmark baselines' data
//! movement: what a user would do instead of kvtier's kernels. On the CUDA
//! executor these are copy-engine transfers (`cuMemcpy*Async`) and host
//! loops; on the CPU executor the same shapes with `memcpy`.

use std::cell::UnsafeCell;

use memmap2::MmapMut;

use kvtier::cuda::{HostRegistration, REGISTER_FLAGS};
use kvtier::{Buf, BufMut, DeviceBuffer, Executor, Location, Stream};

/// A buffer where the executor reads and writes it: a host vector for the
/// CPU executor (in an `UnsafeCell`: methods write it through raw
/// addresses), device memory for the CUDA executor.
pub(crate) enum ExecVec<T: Copy> {
    Host(UnsafeCell<Vec<T>>),
    Device(DeviceBuffer<T>),
}

impl<T: Copy + Default> ExecVec<T> {
    pub fn from_host(exec: &Executor, data: &[T]) -> kvtier::Result<Self> {
        Ok(match exec {
            Executor::Cpu => ExecVec::Host(UnsafeCell::new(data.to_vec())),
            Executor::Cuda(dev) => ExecVec::Device(DeviceBuffer::from_host(dev, data)?),
        })
    }

    pub fn zeroed(exec: &Executor, len: usize) -> kvtier::Result<Self> {
        Ok(match exec {
            Executor::Cpu => ExecVec::Host(UnsafeCell::new(vec![T::default(); len])),
            Executor::Cuda(dev) => ExecVec::Device(DeviceBuffer::zeroed(dev, len)?),
        })
    }

    /// Its address as the executor addresses it.
    pub fn addr(&self) -> u64 {
        match self {
            // SAFETY: only the pointer is taken; its length never changes.
            ExecVec::Host(v) => unsafe { (*v.get()).as_mut_ptr() as u64 },
            ExecVec::Device(d) => d.device_ptr(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            // SAFETY: as in `addr`.
            ExecVec::Host(v) => unsafe { (*v.get()).len() },
            ExecVec::Device(d) => d.len(),
        }
    }

    fn location(&self) -> Location {
        match self {
            ExecVec::Host(_) => Location::Host,
            ExecVec::Device(_) => Location::Device,
        }
    }

    pub fn buf(&self) -> Buf<'_, T> {
        // SAFETY: the memory is this buffer's, alive as long as the borrow.
        unsafe { Buf::from_raw(self.addr(), self.len(), self.location()) }
    }

    /// A writable view.
    ///
    /// # Safety
    /// Nothing else reads or writes the buffer while the view is used (the
    /// benchmark runs one method at a time).
    pub unsafe fn buf_mut(&self) -> BufMut<'_, T> {
        // SAFETY: per this function's contract.
        unsafe { BufMut::from_raw(self.addr(), self.len(), self.location()) }
    }

    /// `len` elements from `start`, on the host (waits for the device).
    pub fn read(&self, start: usize, len: usize) -> kvtier::Result<Vec<T>> {
        match self {
            // SAFETY: no method is writing while the benchmark reads.
            ExecVec::Host(v) => Ok(unsafe { &*v.get() }[start..][..len].to_vec()),
            ExecVec::Device(d) => d.read(start, len),
        }
    }

    /// Overwrites the whole buffer with `data` (of its length) and waits
    /// for the copy; through a shared reference, because views of the
    /// buffer (a captured graph's, a registration's) outlive the write.
    ///
    /// # Safety
    /// Nothing reads or writes the buffer meanwhile (no call is running).
    pub unsafe fn write(&self, data: &[T]) -> kvtier::Result<()> {
        assert_eq!(data.len(), self.len(), "a write of the whole buffer");
        // SAFETY: per this function's contract.
        unsafe { self.write_at(0, data) }
    }

    /// [`ExecVec::write`] of `data` from element `start` on.
    ///
    /// # Safety
    /// As for [`ExecVec::write`].
    pub unsafe fn write_at(&self, start: usize, data: &[T]) -> kvtier::Result<()> {
        assert!(
            start <= self.len() && data.len() <= self.len() - start,
            "a write inside the buffer"
        );
        match self {
            ExecVec::Host(v) => {
                // SAFETY: per this function's contract; the range is checked.
                unsafe { (&mut *v.get())[start..][..data.len()].copy_from_slice(data) };
                Ok(())
            }
            ExecVec::Device(d) => {
                let dev = d.device();
                // SAFETY: the range is inside the buffer; the source is
                // pageable host memory, valid until the wait below.
                unsafe {
                    dev.copy_host_to_device_async(
                        d.device_ptr() + (start * std::mem::size_of::<T>()) as u64,
                        data.as_ptr() as *const u8,
                        std::mem::size_of_val(data),
                        Stream::null(),
                    )?
                };
                dev.synchronize_all()
            }
        }
    }

    pub fn to_vec(&self) -> kvtier::Result<Vec<T>> {
        self.read(0, self.len())
    }
}

/// Copies `bytes` bytes between two buffers on the executor's side (device to
/// device for the CUDA executor, in stream order).
///
/// # Safety
/// Both ranges are valid for `bytes` bytes as the executor addresses them.
pub(crate) unsafe fn copy_within(
    exec: &Executor,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: Stream,
) -> kvtier::Result<()> {
    // SAFETY: per this function's contract.
    unsafe {
        match exec {
            Executor::Cpu => {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes);
                Ok(())
            }
            Executor::Cuda(dev) => dev.copy_device_to_device_async(dst, src, bytes, stream),
        }
    }
}

/// Which way the bytes go on the CUDA executor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    /// Pool (host) to device: fetches.
    HostToDevice,
    /// Device to pool (host): writebacks.
    DeviceToHost,
}

/// Page-aligned host memory, registered with the GPU for the CUDA executor
/// (so that copies from and to it are asynchronous, as pinned staging is).
pub(crate) struct Staging {
    // Dropped first: unregister before unmapping.
    _registration: Option<HostRegistration>,
    map: MmapMut,
}

impl Staging {
    pub fn new(exec: &Executor, bytes: usize) -> kvtier::Result<Self> {
        let mut map = MmapMut::map_anon(bytes.max(1)).map_err(|source| kvtier::Error::Io {
            context: format!("mapping {bytes} B of staging memory"),
            source,
        })?;
        // Touch every page: the first iteration should not pay the faults.
        map.fill(0);
        let registration = match exec {
            Executor::Cpu => None,
            // SAFETY: the mapping lives as long as the registration (field order).
            Executor::Cuda(dev) => Some(unsafe {
                HostRegistration::register(dev, map.as_mut_ptr(), map.len(), REGISTER_FLAGS)?
            }),
        };
        Ok(Staging {
            _registration: registration,
            map,
        })
    }

    pub fn ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The memory, for the host to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The address kernels use for byte 0 (the host address for the CPU
    /// executor).
    pub fn exec_addr(&self) -> u64 {
        match &self._registration {
            Some(r) => r.device_addr(),
            None => self.map.as_ptr() as u64,
        }
    }
}

/// One contiguous copy of `bytes` bytes: the link's limit.
///
/// # Safety
/// Both ranges are valid for `bytes` bytes as the executor addresses them
/// (host memory for the CPU; for CUDA the host side registered and the
/// device side device memory), until the copy completes.
pub(crate) unsafe fn contiguous(
    exec: &Executor,
    dir: Dir,
    src: u64,
    dst: u64,
    bytes: usize,
    stream: Stream,
) -> kvtier::Result<()> {
    // SAFETY: per this function's contract.
    unsafe {
        match (exec, dir) {
            (Executor::Cpu, _) => {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes);
                Ok(())
            }
            (Executor::Cuda(dev), Dir::HostToDevice) => {
                dev.copy_host_to_device_async(dst, src as *const u8, bytes, stream)
            }
            (Executor::Cuda(dev), Dir::DeviceToHost) => {
                dev.copy_device_to_host_async(dst as *mut u8, src, bytes, stream)
            }
        }
    }
}

/// One copy call per entry: what DMA-only systems do (`cudaMemcpyAsync` per
/// entry; `memcpy` per entry on the CPU executor).
///
/// # Safety
/// As for [`contiguous`], for every (source, destination) pair and `entry`
/// bytes.
pub(crate) unsafe fn per_entry(
    exec: &Executor,
    dir: Dir,
    pairs: &[(u64, u64)],
    entry: usize,
    stream: Stream,
) -> kvtier::Result<()> {
    for &(src, dst) in pairs {
        // SAFETY: per this function's contract.
        unsafe { contiguous(exec, dir, src, dst, entry, stream)? };
    }
    Ok(())
}

/// The host gathers the entries into staging, then one copy takes staging to
/// `dst` (host to device on the CUDA executor).
///
/// # Safety
/// Every source is host memory holding `entry` bytes, the staging holds
/// `sources.len() * entry` bytes, and `dst` is valid for as many as the
/// executor addresses it, until the copy completes.
pub(crate) unsafe fn staged_gather(
    exec: &Executor,
    sources: &[u64],
    staging: &mut Staging,
    dst: u64,
    entry: usize,
    stream: Stream,
) -> kvtier::Result<()> {
    // SAFETY: per this function's contract.
    unsafe { staged_gather_runs(exec, &[(sources, entry)], staging, dst, stream) }
}

/// [`staged_gather`] of runs of sources, the sources of a run `len` bytes
/// each (the pieces of rows whose parts lie apart): gathered one run after
/// the other, then one copy.
///
/// # Safety
/// Every source is host memory holding its run's bytes, the staging holds
/// all of them, and `dst` is valid for as many as the executor addresses
/// it, until the copy completes.
pub(crate) unsafe fn staged_gather_runs(
    exec: &Executor,
    runs: &[(&[u64], usize)],
    staging: &mut Staging,
    dst: u64,
    stream: Stream,
) -> kvtier::Result<()> {
    let base = staging.ptr();
    let mut at = 0usize;
    for &(sources, len) in runs {
        for &src in sources {
            // SAFETY: per this function's contract.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, base.add(at), len) };
            at += len;
        }
    }
    // SAFETY: per this function's contract.
    unsafe { contiguous(exec, Dir::HostToDevice, base as u64, dst, at, stream) }
}

/// One copy takes `src` into staging (device to host on the CUDA executor,
/// waited for), then the host scatters the entries to their destinations.
///
/// # Safety
/// `src` holds `dests.len() * entry` bytes as the executor addresses it, the
/// staging as many, and every destination is host memory of `entry` bytes.
pub(crate) unsafe fn staged_scatter(
    exec: &Executor,
    src: u64,
    staging: &mut Staging,
    dests: &[u64],
    entry: usize,
    stream: Stream,
) -> kvtier::Result<()> {
    let base = staging.ptr();
    // SAFETY: per this function's contract.
    unsafe {
        contiguous(
            exec,
            Dir::DeviceToHost,
            src,
            base as u64,
            dests.len() * entry,
            stream,
        )?
    };
    if let Executor::Cuda(dev) = exec {
        dev.synchronize(stream)?;
    }
    for (i, &dst) in dests.iter().enumerate() {
        // SAFETY: per this function's contract.
        unsafe { std::ptr::copy_nonoverlapping(base.add(i * entry), dst as *mut u8, entry) };
    }
    Ok(())
}
