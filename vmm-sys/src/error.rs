//! Errors: loading the driver library, and driver calls that return an error code.

use crate::types::{result_name, CUresult};
use std::fmt;

/// The driver library or one of its entry points could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// `dlopen` of the library failed (not installed, wrong path, wrong architecture).
    #[error("{path}: {reason}")]
    Library {
        /// The path or name that was opened.
        path: String,
        /// Why it failed, as the dynamic loader said.
        reason: String,
    },
    /// The library was opened but lacks an entry point (too old a driver, or not libcuda).
    #[error(
        "{path}: missing symbol `{name}` (is this the CUDA driver library, version 11.2 or newer?)"
    )]
    Symbol {
        /// The missing entry point.
        name: &'static str,
        /// The library that lacks it.
        path: String,
    },
}

impl LoadError {
    /// The library path or name the error is about.
    pub fn path(&self) -> &str {
        match self {
            LoadError::Library { path, .. } | LoadError::Symbol { path, .. } => path,
        }
    }
}

/// A driver call returned something other than `CUDA_SUCCESS`.
///
/// `code` is the raw `CUresult`; [`crate::Driver::error_name`] and
/// [`crate::Driver::error_string`] ask the driver to describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CuError {
    /// The entry point that failed, e.g. `"cuMemCreate"`.
    pub call: &'static str,
    /// The raw result code (never 0).
    pub code: CUresult,
}

impl CuError {
    /// Whether the code is `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == crate::types::CUDA_ERROR_OUT_OF_MEMORY
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match result_name(self.code) {
            Some(name) => write!(f, "{} failed: {name} ({})", self.call, self.code),
            None => write!(f, "{} failed: CUresult {}", self.call, self.code),
        }
    }
}

impl std::error::Error for CuError {}

/// Turns a raw result into `Ok(())` or a [`CuError`] naming `call`.
#[inline]
pub fn check(call: &'static str, code: CUresult) -> Result<(), CuError> {
    if code == crate::types::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CuError { call, code })
    }
}
