//! The two executors that run kvtier's plans with one semantics.

use std::sync::Arc;

use crate::cuda::CudaDevice;
use crate::error::Result;
use crate::mem::Location;

/// Where a [`crate::Tier`]'s work runs.
#[derive(Clone, Debug)]
pub enum Executor {
    /// Plain Rust over host memory: the reference every kernel is tested
    /// against, and the executor on machines without a GPU. Calls complete
    /// before they return and report bad indices immediately.
    Cpu,
    /// The CUDA kernels, enqueued on the caller's stream. Bad indices are
    /// reported at the next [`crate::Tier::check`].
    Cuda(Arc<CudaDevice>),
}

impl Executor {
    /// The CPU executor.
    pub fn cpu() -> Self {
        Executor::Cpu
    }

    /// The CUDA executor on GPU `ordinal` (probes the driver; fails plainly
    /// when there is none or the kernels were not built).
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Executor::Cuda(CudaDevice::open(ordinal)?))
    }

    /// Where this executor's argument buffers must live.
    pub fn location(&self) -> Location {
        match self {
            Executor::Cpu => Location::Host,
            Executor::Cuda(_) => Location::Device,
        }
    }

    /// A short description, e.g. `CPU` or `CUDA (NVIDIA H100 80GB HBM3, sm_90)`.
    pub fn describe(&self) -> String {
        match self {
            Executor::Cpu => "CPU".to_string(),
            Executor::Cuda(d) => {
                let (ma, mi) = d.compute_capability();
                format!("CUDA ({}, sm_{ma}{mi})", d.name())
            }
        }
    }
}
