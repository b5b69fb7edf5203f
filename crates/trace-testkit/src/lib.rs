//! Test and bench scaffolding of `vmmalloc-trace`, kept out of the library
//! (issue 42): used only as a dev-dependency of `vmmalloc-trace` (its tests
//! `reader_equivalence` and `reader_limits`, the `snapshot_read` bench and
//! the `synth_snapshot` example).
//!
//! - [`synth`]: writes synthetic PyTorch memory snapshots of any size, byte
//!   for byte as Python's pickler would;
//! - [`legacy`]: the snapshot reader before the pull parser (serde-pickle's
//!   value tree), the oracle the streaming reader is compared with and the
//!   `old` side of the `snapshot_read` bench.
#![warn(missing_docs)]

pub mod legacy;
pub mod synth;
