//! RAII types over driver resources: device allocations, host memory
//! registered for device access, streams and timing events.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::{CudaDevice, Stream};
use crate::error::{DriverContext, Result};
use crate::mem::{Buf, BufMut};

/// A device allocation of `len` elements of `T` (set-up and test code; the
/// per-layer path never allocates).
pub struct DeviceBuffer<T: Copy> {
    dev: Arc<CudaDevice>,
    ptr: sys::CUdeviceptr,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Copy> DeviceBuffer<T> {
    /// `len` zeroed elements.
    pub fn zeroed(dev: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        let _bound = dev.bind()?;
        let bytes = len * size_of::<T>();
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: plain allocation followed by a full memset, waited for
            // (cuMemsetD8 may return before it has run).
            unsafe {
                let ptr = result::malloc_sync(bytes).call("cuMemAlloc")?;
                result::memset_d8_sync(ptr, 0, bytes).call("cuMemsetD8")?;
                result::ctx::synchronize().call("cuCtxSynchronize")?;
                ptr
            }
        };
        Ok(DeviceBuffer {
            dev: dev.clone(),
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// A copy of `data` on the device.
    pub fn from_host(dev: &Arc<CudaDevice>, data: &[T]) -> Result<Self> {
        let mut b = Self::zeroed(dev, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// Overwrites the buffer's first `data.len()` elements; the copy has
    /// landed when this returns (a plain cuMemcpyHtoD from pageable memory
    /// may return before its DMA completes, so this also waits for the
    /// context).
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        assert!(
            data.len() <= self.len,
            "copy of {} elements into a buffer of {}",
            data.len(),
            self.len
        );
        if data.is_empty() {
            return Ok(());
        }
        let _bound = self.dev.bind()?;
        // SAFETY: the allocation holds at least data.len() elements.
        unsafe { result::memcpy_htod_sync(self.ptr, data) }.call("cuMemcpyHtoD")?;
        result::ctx::synchronize().call("cuCtxSynchronize")
    }

    /// Overwrites the buffer's first `data.len()` elements, in stream order.
    /// The source may be reused once this returns: the copy is from pageable
    /// memory, which the driver stages before returning.
    pub fn copy_from_host_async(&mut self, data: &[T], stream: Stream) -> Result<()> {
        assert!(
            data.len() <= self.len,
            "copy of {} elements into a buffer of {}",
            data.len(),
            self.len
        );
        copy_to_device_async(&self.dev, self.ptr, data, stream)
    }

    /// The buffer's contents (synchronous; waits for all work on the device).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.read(0, self.len)
    }

    /// Elements `start..start + len` (synchronous; waits for all work on the device).
    pub fn read(&self, start: usize, len: usize) -> Result<Vec<T>> {
        assert!(
            start + len <= self.len,
            "read {start}..{} of {}",
            start + len,
            self.len
        );
        let mut v = Vec::with_capacity(len);
        if len > 0 {
            let _bound = self.dev.bind()?;
            result::ctx::synchronize().call("cuCtxSynchronize")?;
            // SAFETY: copies len elements from within the allocation into the
            // vector's capacity, then marks them initialised.
            unsafe {
                sys::cuMemcpyDtoH_v2(
                    v.as_mut_ptr() as *mut c_void,
                    self.ptr + (start * size_of::<T>()) as u64,
                    len * size_of::<T>(),
                )
                .result()
                .call("cuMemcpyDtoH")?;
                v.set_len(len);
            }
        }
        Ok(v)
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A read view for kvtier calls.
    pub fn as_buf(&self) -> Buf<'_, T> {
        // SAFETY: the allocation lives as long as the borrow of self.
        unsafe { Buf::device(self.ptr, self.len) }
    }

    /// A write view for kvtier calls.
    pub fn as_buf_mut(&mut self) -> BufMut<'_, T> {
        // SAFETY: the allocation lives as long as the exclusive borrow of self.
        unsafe { BufMut::device(self.ptr, self.len) }
    }

    /// A read view of elements `start..start + len`.
    pub fn slice(&self, start: usize, len: usize) -> Buf<'_, T> {
        assert!(
            start + len <= self.len,
            "slice {start}..{} of {}",
            start + len,
            self.len
        );
        // SAFETY: within the allocation, which outlives the borrow.
        unsafe { Buf::device(self.ptr + (start * size_of::<T>()) as u64, len) }
    }

    /// A write view of elements `start..start + len`.
    pub fn slice_mut(&mut self, start: usize, len: usize) -> BufMut<'_, T> {
        assert!(
            start + len <= self.len,
            "slice {start}..{} of {}",
            start + len,
            self.len
        );
        // SAFETY: within the allocation, exclusively borrowed.
        unsafe { BufMut::device(self.ptr + (start * size_of::<T>()) as u64, len) }
    }
}

impl<T: Copy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: allocated by cuMemAlloc in this context; freed once.
            unsafe {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// Copies `data` to device address `dst` in stream order from pageable
/// memory (the driver stages it before returning, so `data` may be dropped).
pub(crate) fn copy_to_device_async<T>(
    dev: &CudaDevice,
    dst: u64,
    data: &[T],
    stream: Stream,
) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let _bound = dev.bind()?;
    // SAFETY: the caller passes a device range of at least size_of_val(data) bytes.
    unsafe { result::memcpy_htod_async(dst, data, stream.raw()) }.call("cuMemcpyHtoDAsync")
}

/// Flags kvtier registers pool memory with: portable (every context sees the
/// registration) and device-mapped (kernels address it directly).
pub const REGISTER_FLAGS: u32 =
    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;

/// `CU_MEMHOSTREGISTER_IOMEMORY`: the range is I/O memory (a PCIe BAR mapped
/// into the process) rather than system RAM. CXL memory, as a devdax device
/// or a NUMA node, is system RAM with struct pages and needs no flag; with
/// this one such a registration would likely fail or map it uncached
/// (docs/registration.md). Add it to `PoolOptions::register_flags` only for
/// a device that really is a BAR.
pub const REGISTER_IOMEMORY: u32 = sys::CU_MEMHOSTREGISTER_IOMEMORY;

/// Host memory registered with the driver (`cuMemHostRegister`) so that GPU
/// kernels load from and store to it over the link; unregistered on drop.
pub struct HostRegistration {
    dev: Arc<CudaDevice>,
    host: *mut c_void,
    len: usize,
    device_addr: u64,
}

// SAFETY: the registration is a driver-side record about a host range; the
// raw pointer is only handed back to the driver.
unsafe impl Send for HostRegistration {}
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `host` with `flags` (see [`REGISTER_FLAGS`])
    /// and looks up the address kernels use for byte 0.
    ///
    /// # Safety
    /// `host..host + len` must be mapped for as long as the registration
    /// lives, and must not already be registered.
    pub unsafe fn register(
        dev: &Arc<CudaDevice>,
        host: *mut u8,
        len: usize,
        flags: u32,
    ) -> Result<Self> {
        let _bound = dev.bind()?;
        // SAFETY: per this function's contract.
        unsafe { sys::cuMemHostRegister_v2(host as *mut c_void, len, flags) }
            .result()
            .call("cuMemHostRegister")?;
        // From here on, Drop unregisters, also if the lookup below fails.
        let mut reg = HostRegistration {
            dev: dev.clone(),
            host: host as *mut c_void,
            len,
            device_addr: 0,
        };
        // SAFETY: `host` was just registered with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut reg.device_addr, host as *mut c_void, 0) }
            .result()
            .call("cuMemHostGetDevicePointer")?;
        Ok(reg)
    }

    /// The device address of the first registered byte.
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }

    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: registered by `register` and not unregistered since.
            unsafe {
                let _ = sys::cuMemHostUnregister(self.host);
            }
        }
    }
}

/// A stream created by kvtier, destroyed on drop.
pub struct OwnedStream {
    dev: Arc<CudaDevice>,
    raw: sys::CUstream,
}

// SAFETY: driver stream handles are thread-safe.
unsafe impl Send for OwnedStream {}
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub(crate) fn new(dev: Arc<CudaDevice>) -> Result<Self> {
        let _bound = dev.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .call("cuStreamCreate")?;
        Ok(OwnedStream { dev, raw })
    }

    /// The stream, to pass to kvtier calls.
    pub fn stream(&self) -> Stream {
        // SAFETY: live until self drops.
        unsafe { Stream::from_raw(self.raw) }
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize(self.stream())
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: created by `new`, destroyed once.
            unsafe {
                let _ = result::stream::synchronize(self.raw);
                let _ = result::stream::destroy(self.raw);
            }
        }
    }
}

/// A pair of CUDA events timing work enqueued between `start` and `stop`.
pub struct EventTimer {
    dev: Arc<CudaDevice>,
    start: sys::CUevent,
    stop: sys::CUevent,
}

impl EventTimer {
    /// Two timing events on `dev`.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self> {
        let _bound = dev.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = result::event::create(flags).call("cuEventCreate")?;
        let stop = result::event::create(flags).call("cuEventCreate")?;
        Ok(EventTimer {
            dev: dev.clone(),
            start,
            stop,
        })
    }

    /// Records the start event on `stream`.
    pub fn start(&self, stream: Stream) -> Result<()> {
        let _bound = self.dev.bind()?;
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.start, stream.raw()) }.call("cuEventRecord")
    }

    /// Records the stop event on `stream`.
    pub fn stop(&self, stream: Stream) -> Result<()> {
        let _bound = self.dev.bind()?;
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.stop, stream.raw()) }.call("cuEventRecord")
    }

    /// Waits for the stop event and returns the elapsed time in microseconds.
    pub fn elapsed_us(&self) -> Result<f64> {
        let _bound = self.dev.bind()?;
        // SAFETY: both events were recorded.
        unsafe {
            result::event::synchronize(self.stop).call("cuEventSynchronize")?;
            Ok(
                result::event::elapsed(self.start, self.stop).call("cuEventElapsedTime")? as f64
                    * 1000.0,
            )
        }
    }
}

impl Drop for EventTimer {
    fn drop(&mut self) {
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: created by `new`, destroyed once.
            unsafe {
                let _ = result::event::destroy(self.start);
                let _ = result::event::destroy(self.stop);
            }
        }
    }
}

/// An event that orders work between two streams (no timing): recorded on
/// one, waited for on another; both are captured into a CUDA graph as the
/// edge between its branches, as an engine forks a side stream off its
/// decode step and joins it again.
pub struct StreamEvent {
    dev: Arc<CudaDevice>,
    raw: sys::CUevent,
}

impl StreamEvent {
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Self> {
        let _bound = dev.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .call("cuEventCreate")?;
        Ok(StreamEvent {
            dev: dev.clone(),
            raw,
        })
    }

    /// Records the event on `stream`: the point a [`StreamEvent::wait`] waits for.
    pub fn record(&self, stream: Stream) -> Result<()> {
        let _bound = self.dev.bind()?;
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.raw, stream.raw()) }.call("cuEventRecord")
    }

    /// Makes the work enqueued on `stream` from now on wait for the last
    /// recording of the event.
    pub fn wait(&self, stream: Stream) -> Result<()> {
        let _bound = self.dev.bind()?;
        // SAFETY: live event and stream.
        unsafe {
            result::stream::wait_event(
                stream.raw(),
                self.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .call("cuStreamWaitEvent")
    }
}

impl Drop for StreamEvent {
    fn drop(&mut self) {
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: created by `new`, destroyed once.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}

/// The device-side error word the kernels report into, and beside it the
/// word a take moves it into (so a take allocates nothing).
pub(crate) struct DeviceErrorWord {
    dev: Arc<CudaDevice>,
    /// `[the word, what the last take moved out of it]`.
    words: DeviceBuffer<crate::error_word::ErrorWord>,
}

impl DeviceErrorWord {
    /// A clear word on `dev`.
    pub(crate) fn new(dev: &Arc<CudaDevice>) -> Result<Self> {
        use crate::error_word::ErrorWord;
        Ok(DeviceErrorWord {
            dev: dev.clone(),
            words: DeviceBuffer::from_host(dev, &[ErrorWord::clear(), ErrorWord::clear()])?,
        })
    }

    /// The word's device address, for the kernels' parameters.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.words.device_ptr()
    }

    /// Takes the word: waits for the whole context (so every kernel launched
    /// before the call has reported), then moves the word into its staging
    /// twin and clears it with `kvt_error_take`'s atomic exchanges, and reads
    /// what was taken. A report that a kernel launched meanwhile on another
    /// stream makes is not lost (an earlier read-then-reset could wipe it):
    /// each of its updates is in what this take returns or stays for the next.
    pub(crate) fn take(&self) -> Result<crate::error_word::ErrorWord> {
        self.dev.synchronize_all()?;
        let params = crate::abi::kvt_error_take_params {
            word: self.words.device_ptr(),
            out: self.words.device_ptr()
                + std::mem::size_of::<crate::error_word::ErrorWord>() as u64,
        };
        // SAFETY: both addresses are this buffer's two words, live until the
        // read below, which waits for the launch.
        unsafe {
            self.dev.launch(
                super::Kernel::ErrorTake,
                1,
                super::Kernel::ErrorTake.block_threads(),
                0,
                &params,
                Stream::null(),
            )?
        };
        Ok(self.words.read(1, 1)?[0])
    }
}

/// A watch on device memory that never waits: each [`poll`] returns the
/// snapshot the previous poll started, if the copy has landed, and starts the
/// next one, a copy of `len` elements into pinned host memory on a stream of
/// its own. The memory is only read (kernels keep adding to it), so a
/// snapshot may be a little behind but is never lost. The copy reads the
/// elements while kernels may be updating them, so one snapshot need not be
/// consistent across elements (an error word's `count` may include a report
/// whose `first` entry it misses, a counter a call that another lacks); the
/// next snapshot has both. Used for the error word (the engine's `check`
/// still takes and clears it) and the swap-in counters.
///
/// [`poll`]: DeviceSnapshot::poll
pub(crate) struct DeviceSnapshot<T: Copy> {
    dev: Arc<CudaDevice>,
    stream: OwnedStream,
    event: sys::CUevent,
    /// `len` pinned elements the copies land in.
    host: *mut T,
    len: usize,
    /// The epoch the snapshot in flight was started in, if one is.
    in_flight: Option<u64>,
}

// SAFETY: driver handles are thread-safe; `host` is only touched through
// &mut self.
unsafe impl<T: Copy> Send for DeviceSnapshot<T> {}
unsafe impl<T: Copy> Sync for DeviceSnapshot<T> {}

impl<T: Copy> DeviceSnapshot<T> {
    /// A watch that copies `len` (at least 1) elements per poll.
    pub(crate) fn new(dev: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        assert!(len > 0, "a snapshot of nothing");
        let _bound = dev.bind()?;
        let stream = OwnedStream::new(dev.clone())?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .call("cuEventCreate")?;
        // SAFETY: a fresh pinned allocation of `len` elements, only read
        // after a copy has filled it.
        let host = unsafe {
            result::malloc_host(len * std::mem::size_of::<T>(), 0).call("cuMemHostAlloc")? as *mut T
        };
        Ok(DeviceSnapshot {
            dev: dev.clone(),
            stream,
            event,
            host,
            len,
            in_flight: None,
        })
    }

    /// The snapshot of the `len` elements at device address `src` the
    /// previous poll started, once it has landed (None while it is in
    /// flight, and on the first poll); starts the next. `epoch` counts the
    /// resets of the memory (an error word's `check`): a snapshot started in
    /// an earlier epoch holds what the reset took away, so it is dropped (a
    /// stale report would otherwise surface again after the check).
    ///
    /// # Safety
    /// `src` holds `len` elements of `T` on this watch's device and stays
    /// allocated until the watch drops (which waits for the copy).
    pub(crate) unsafe fn poll(&mut self, src: u64, epoch: u64) -> Result<Option<Vec<T>>> {
        let _bound = self.dev.bind()?;
        let mut landed = None;
        if let Some(started) = self.in_flight {
            // SAFETY: a live event, recorded after the copy.
            match unsafe { result::event::query(self.event) } {
                Ok(()) => {
                    // SAFETY: the copy into `host` has completed.
                    let v = unsafe { std::slice::from_raw_parts(self.host, self.len).to_vec() };
                    landed = (started == epoch).then_some(v);
                    self.in_flight = None;
                }
                // Still in flight (a stale one is dropped once it lands).
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => return Ok(None),
                Err(e) => {
                    return Err(crate::error::Error::Driver {
                        call: "cuEventQuery",
                        err: e,
                    });
                }
            }
        }
        // SAFETY: `host` is `len` pinned elements no copy is writing now;
        // `src` holds `len` elements, per this function's contract.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.host, self.len);
            result::memcpy_dtoh_async(dst, src, self.stream.stream().raw())
                .call("cuMemcpyDtoHAsync")?;
            result::event::record(self.event, self.stream.stream().raw()).call("cuEventRecord")?;
        }
        self.in_flight = Some(epoch);
        Ok(landed)
    }
}

impl<T: Copy> Drop for DeviceSnapshot<T> {
    fn drop(&mut self) {
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: the copy is waited for before its target is freed.
            unsafe {
                let _ = result::stream::synchronize(self.stream.stream().raw());
                let _ = result::event::destroy(self.event);
                let _ = result::free_host(self.host as *mut c_void);
            }
        }
    }
}
