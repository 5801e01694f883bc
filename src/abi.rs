//! The kernel ABI: Rust mirrors of the structs in `kernels/abi.h`, generated
//! by bindgen into `bindings/abi.rs` (see `scripts/regen-bindings.sh`). The
//! generated layout assertions fail the build if a struct drifts.
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    missing_docs,
    clippy::all
)]

include!("../bindings/abi.rs");
