//! Spill's state: the host-located handles the layer holds (`spill:true`;
//! the decisions are the block layer's `spill.rs`).
//!
//! Invariants (checked by `validate`): `spilled_pages` is the sum of the
//! mapped chunks whose handle is in `host`; every handle in `host` is mapped
//! or in `host_free`; no host handle is pooled.

use std::collections::HashSet;
use vmmalloc_device::PhysHandle;

/// Spill state of one allocator.
#[derive(Debug, Default)]
pub(crate) struct SpillState {
    /// `spill:true`.
    pub enabled: bool,
    /// Host-located handles alive (mapped, or waiting in `host_free`).
    pub host: HashSet<u64>,
    /// Unmapped host handles to release.
    pub host_free: Vec<PhysHandle>,
    /// Pages of mapped host chunks (segments and growable regions).
    pub spilled_pages: u64,
    /// The most bytes of host chunks mapped at once (`spilled_bytes_peak`).
    pub spilled_peak_bytes: u64,
}
