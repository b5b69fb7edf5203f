//! Allocation traces for the research comparison: one event model, readers for
//! PyTorch memory snapshots and a plain text format, and generators of
//! realistic workloads.
//!
//! - [`model`]: [`Trace`], [`DeviceTrace`] (checked, with the dense replay view
//!   [`DeviceTrace::replay_ops`] and [`DeviceTrace::peak_live_bytes`]), [`Event`], [`Op`];
//! - [`pytorch`]: `torch.cuda.memory._dump_snapshot` pickles (protocols 2–5,
//!   PyTorch 2.0 to current schema), streamed through a pull parser so that
//!   snapshots of any size are read in about their own size of memory, with
//!   the allocations live before recording reconstructed ([`reconstruct`])
//!   (the synthetic snapshot writer and the old reader, test and bench
//!   scaffolding, are in the dev-only crate `vmmalloc-trace-testkit`);
//! - [`text`]: the `vmmalloc-trace 1` text format (docs/trace-format.md);
//! - [`workloads`]: `train-varlen`, `serve-kv`, `frag-adversary`;
//! - [`input`]: [`load_path`] (format detection) and [`Input`] (a path or a workload name).
//!
//! Bad input is an error naming the file, line, device and event index
//! ([`TraceError`]), or a counted warning ([`DeviceTrace::warnings`]) where a
//! real snapshot is merely incomplete; never a panic.
#![warn(missing_docs)]

mod error;
pub mod input;
pub mod model;
pub mod pytorch;
pub mod reconstruct;
mod regions;
pub mod replay;
pub mod text;
pub mod workloads;

pub use error::{ErrorKind, Result, TraceError};
pub use input::{load_path, Input};
pub use model::{
    Alloc, Block, BlockState, DeviceTrace, DeviceTraceParts, Event, EventKind, Op, Segment, Trace,
    MAX_SIZE,
};
pub use workloads::{workload_by_name, WORKLOADS};
