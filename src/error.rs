//! The crate's error type.

use crate::error_word::{BadIndexReport, ErrorWord};
use cudarc::driver::DriverError;

/// Everything that can go wrong in kvtier, with a message that names the
/// argument or resource at fault and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A public entry point refused an argument before anything ran.
    #[error("invalid argument `{arg}`: {msg}")]
    InvalidArgument { arg: &'static str, msg: String },

    /// The library was built without a CUDA compiler, so the CUDA executor has no kernels.
    #[error("{0}")]
    KernelsNotBuilt(&'static str),

    /// libcuda could not be loaded or initialised, or there is no GPU.
    #[error("no usable CUDA driver: {0}")]
    NoDriver(String),

    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {err}")]
    Driver {
        call: &'static str,
        err: DriverError,
    },

    /// Kernels (or the CPU executor) refused entries with bad indices; the
    /// entries were zero-filled (gather) or skipped (writeback).
    #[error("{0}")]
    BadIndices(BadIndexReport),

    /// The pool refused a request (full, foreign region, too small a device).
    #[error("pool: {0}")]
    Pool(String),

    /// An I/O call on a pool device failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(arg: &'static str, msg: impl Into<String>) -> Error {
    Error::InvalidArgument {
        arg,
        msg: msg.into(),
    }
}

/// Attaches the driver call's name to a cudarc result.
pub(crate) trait DriverContext<T> {
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|err| Error::Driver { call, err })
    }
}

// Here, not in error_word.rs, so that the error word needs nothing of the
// error type (dependencies point one way: error -> error_word).
impl ErrorWord {
    /// Ok when clear, else [`Error::BadIndices`] with the decoded report.
    pub fn into_result(self) -> Result<()> {
        if self.is_clear() {
            Ok(())
        } else {
            Err(Error::BadIndices(BadIndexReport::decode(&self)))
        }
    }
}
