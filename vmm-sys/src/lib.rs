//! Raw CUDA driver entry points for virtual memory management, loaded at run time.
//!
//! This crate is the bottom layer of vmmalloc and holds no logic:
//!
//! - [`types`]: `#[repr(C)]` copies of the `cuda.h` structures and the
//!   constants vmmalloc uses. Result codes stay raw `u32` ([`CUresult`]).
//! - [`Driver`]: `libcuda.so.1` (or the library named by
//!   `VMMALLOC_CUDA_LIBRARY`) opened with `libloading`, with one typed function
//!   pointer per entry point, all resolved at load time. A missing library or
//!   symbol is a [`LoadError`] naming it, never a panic.
//! - Thin wrappers on [`Driver`] (in the style of openvm's stark-backend): each
//!   driver call is a method returning `Result<T, CuError>`, with its
//!   out-parameters turned into the return value. Methods whose arguments the
//!   driver cannot validate (live handles, owned ranges) are `unsafe fn` with a
//!   `# Safety` section.
//!
//! ```no_run
//! use vmm_sys::{Driver, CUmemAllocationProp, CU_MEM_ALLOC_GRANULARITY_MINIMUM};
//! let drv = Driver::load()?;
//! drv.init(0)?;
//! let dev = drv.device_get(0)?;
//! let prop = CUmemAllocationProp::pinned_on_device(dev, 0);
//! let granularity = drv.mem_get_allocation_granularity(&prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("vmm-sys supports 64-bit targets only, as does the CUDA driver");

pub mod driver;
pub mod error;
pub mod types;

pub use driver::{version_string, Driver, DriverFns, DEFAULT_LIBRARY, LIBRARY_ENV, SYMBOLS};
pub use error::{check, CuError, LoadError};
pub use types::*;
