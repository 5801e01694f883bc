//! The C ABI (`bindings/kvtier.h`): opaque handles over [`Pool`], [`Region`],
//! [`Tier`] and [`SwapInEngine`], a status code from every call and a
//! thread-local message for the last failure.
//!
//! Every entry point checks its pointers before it dereferences them, runs
//! its body under `catch_unwind` (a panic becomes [`KVT_INTERNAL_ERROR`], it
//! never unwinds into C), and builds its buffers through the same checked
//! argument types the Rust API uses. The structs here are `#[repr(C)]`
//! mirrors of the header's; `tests/ffi.rs` compiles a C program against the
//! header and compares every size and offset.

//!
//! One file per area: `types` (the argument structs), `handles` (handles,
//! status, the last error), `convert` (argument structs into the library's
//! types), then the entry points of `pool`, `prefix` (the prefix store),
//! `swap_in`, `tier`, `table` and `engram`.

mod convert;
mod engram;
mod handles;
mod pool;
mod prefix;
mod swap_in;
mod table;
mod tier;
mod types;

pub use engram::*;
pub use handles::*;
pub use pool::*;
pub use prefix::*;
pub use swap_in::*;
pub use table::*;
pub use tier::*;
pub use types::*;
