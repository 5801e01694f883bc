//! CUDA graphs of kvtier's per-layer calls: captured from a stream once,
//! replayed many times. Engines capture their decode step with their own
//! tools (torch's `CUDAGraph`); this is the same capture from Rust, for
//! `kvtier selftest` and for engines without one.

use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CudaDevice, OwnedStream, Stream};
use crate::error::{DriverContext, Result, invalid};

/// An instantiated CUDA graph, replayable on any stream of its device;
/// destroyed on drop.
pub struct CudaGraph {
    dev: Arc<CudaDevice>,
    exec: sys::CUgraphExec,
}

/// A captured graph, needed only until it is instantiated (the executable
/// graph does not refer to it) and destroyed when dropped, on every path.
struct CapturedGraph(sys::CUgraph);

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: made by a capture, destroyed once.
            let _ = unsafe { sys::cuGraphDestroy(self.0) };
        }
    }
}

// SAFETY: graph handles are driver objects usable from any thread (launches
// of one graph must not overlap, which `launch` leaves to the caller as
// stream order).
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Captures what `record` enqueues on `stream` and instantiates it.
    ///
    /// The capture is global (`CU_STREAM_CAPTURE_MODE_GLOBAL`): while it
    /// lasts, a call from any thread that is not allowed in a graph (a
    /// synchronous copy, an allocation, a stream or context synchronisation)
    /// fails, and so does the capture. That is the check that a call is
    /// capturable: it enqueues on the stream it is given and does nothing
    /// else on the device. Nothing runs until [`CudaGraph::launch`].
    pub fn capture(
        dev: &Arc<CudaDevice>,
        stream: &OwnedStream,
        record: impl FnOnce(Stream) -> Result<()>,
    ) -> Result<Self> {
        let _bound = dev.bind()?;
        let s = stream.stream();
        // SAFETY: `s` is a live stream of this device (OwnedStream).
        unsafe {
            sys::cuStreamBeginCapture_v2(
                s.raw(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        }
        .result()
        .call("cuStreamBeginCapture")?;
        // A panic in `record` is caught so that the capture still ends.
        let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| record(s)));
        let mut graph = CapturedGraph(ptr::null_mut());
        // Always ends the capture, so that a failed `record` leaves the
        // stream usable.
        // SAFETY: the stream is capturing; the out-pointer is valid.
        let ended = unsafe { sys::cuStreamEndCapture(s.raw(), &mut graph.0) }
            .result()
            .call("cuStreamEndCapture");
        recorded.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        ended?;
        if graph.0.is_null() {
            return Err(invalid("record", "the capture produced no graph"));
        }
        let mut exec: sys::CUgraphExec = ptr::null_mut();
        // SAFETY: `graph` is a valid graph; the out-pointer is valid.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0) }
            .result()
            .call("cuGraphInstantiateWithFlags")?;
        Ok(CudaGraph {
            dev: dev.clone(),
            exec,
        })
    }

    /// Enqueues one replay on `stream`.
    pub fn launch(&self, stream: Stream) -> Result<()> {
        let _bound = self.dev.bind()?;
        // SAFETY: `exec` is an instantiated graph of this device; `stream` a
        // live stream of its context (Stream's contract).
        unsafe { sys::cuGraphLaunch(self.exec, stream.raw()) }
            .result()
            .call("cuGraphLaunch")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if let Ok(_bound) = self.dev.bind() {
            // SAFETY: made by `capture`, destroyed once; a replay still
            // running keeps its resources until it completes (driver rule).
            let _ = unsafe { sys::cuGraphExecDestroy(self.exec) };
        }
    }
}
