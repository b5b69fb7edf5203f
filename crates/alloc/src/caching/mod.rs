//! `caching`: a faithful replica of PyTorch's CUDA caching allocator
//! (`c10/cuda/CUDACachingAllocator.cpp`, class `DeviceCachingAllocator`), the
//! research baseline.
//!
//! Requests are rounded ([`sizes::round_size`]) and served best-fit by
//! (stream, size, address) from a small (≤ 1 MiB) or large pool
//! ([`sizes::get_pool`]); a miss `cudaMalloc`s ([`Device::alloc`]) a segment of
//! [`sizes::get_allocation_size`] bytes, which is split ([`sizes::should_split`])
//! and merged again on free. A failed `cudaMalloc` frees cached oversize blocks
//! and retries, then frees every cached segment and retries once more
//! (`num_alloc_retries`), then raises out-of-memory (`num_ooms`).
//! [`CachingConfig::parse`] reads `PYTORCH_CUDA_ALLOC_CONF` syntax.
//!
//! The same engine, with `expandable_segments` on, is the `torch-es` baseline
//! ([`crate::torch_es`]). docs/baselines.md lists the PyTorch functions mirrored
//! and where we knowingly differ.
//!
//! # Locking
//! One mutex around all state, held across driver calls (PyTorch's
//! `release_lock_on_cudamalloc` is accepted but not honoured).

mod block;
mod calls;
pub mod config;
mod engine;
mod inspect;
mod release;
mod segment;
pub mod sizes;

pub(crate) use block::IntMap;
pub use config::CachingConfig;

use crate::{AllocResult, Allocation, Allocator, Snapshot, Stats};
use engine::State;
use parking_lot::Mutex;
use vmmalloc_device::{Device, Stream};

/// PyTorch's `DeviceCachingAllocator` over any [`Device`], in plain
/// (`cudaMalloc`) or expandable-segment mode. [`CachingAllocator`] and
/// [`crate::torch_es::TorchEsAllocator`] fix the mode.
pub struct DeviceCachingAllocator<D: Device> {
    device: D,
    name: &'static str,
    state: Mutex<State>,
}

impl<D: Device> DeviceCachingAllocator<D> {
    /// An allocator over `device`; `expandable` selects `expandable_segments:True`
    /// behaviour regardless of `config.expandable_segments`.
    pub fn with_mode(device: D, config: CachingConfig, expandable: bool) -> AllocResult<Self> {
        if expandable {
            let g = device.caps().granularity;
            if g == 0 || !sizes::K_SMALL_BUFFER.is_multiple_of(g) {
                return Err(crate::AllocError::InvalidOption(format!(
                    "torch-es maps 2 MiB and 20 MiB pages, which the device granularity {g:#x} does not divide"
                )));
            }
        }
        Ok(DeviceCachingAllocator {
            device,
            name: if expandable { "torch-es" } else { "caching" },
            state: Mutex::new(State::new(config, expandable)),
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The options in force.
    pub fn config(&self) -> CachingConfig {
        self.state.lock().config.clone()
    }

    /// Whether this allocator runs in expandable-segment mode.
    pub fn is_expandable(&self) -> bool {
        self.state.lock().expandable
    }

    /// `cacheInfo`: the largest free cached block, in bytes.
    pub fn cache_info(&self) -> u64 {
        let st = self.state.lock();
        [&st.small_blocks, &st.large_blocks]
            .iter()
            .flat_map(|p| p.blocks.iter().map(|k| k.1))
            .max()
            .unwrap_or(0)
    }
}

impl<D: Device> Allocator for DeviceCachingAllocator<D> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn malloc(&self, size: u64, stream: Stream) -> AllocResult<Allocation> {
        self.state
            .lock()
            .malloc(&self.device, self.name, size, stream)
    }
    fn free(&self, ptr: u64) -> AllocResult<()> {
        self.state.lock().free(&self.device, ptr)
    }
    fn record_stream(&self, ptr: u64, stream: Stream) -> AllocResult<()> {
        self.state.lock().record_stream(ptr, stream)
    }
    /// `emptyCache` = `release_cached_blocks`.
    fn empty_cache(&self) -> AllocResult<()> {
        self.state
            .lock()
            .release_cached_blocks(&self.device)
            .map(|_| ())
    }
    fn set_memory_fraction(&self, fraction: f64) -> AllocResult<()> {
        self.state
            .lock()
            .set_memory_fraction(&self.device, fraction)
    }
    fn stats(&self) -> Stats {
        self.state.lock().stats_view()
    }
    fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peak();
    }
    fn snapshot(&self) -> Snapshot {
        self.state.lock().snapshot(&self.device)
    }
    fn validate(&self) -> Result<(), String> {
        self.state.lock().validate(&self.device)
    }
}

impl<D: Device> Drop for DeviceCachingAllocator<D> {
    /// Gives every segment, page, reservation and event back to the device,
    /// live allocations included (errors are logged, not raised).
    fn drop(&mut self) {
        let name = self.name;
        self.state.get_mut().teardown(&self.device, name);
    }
}

/// Implements [`Allocator`] for a newtype over [`DeviceCachingAllocator`].
macro_rules! delegate_allocator {
    ($ty:ident) => {
        impl<D: vmmalloc_device::Device> $crate::Allocator for $ty<D> {
            fn name(&self) -> &'static str {
                self.0.name()
            }
            fn malloc(
                &self,
                size: u64,
                stream: $crate::Stream,
            ) -> $crate::AllocResult<$crate::Allocation> {
                self.0.malloc(size, stream)
            }
            fn free(&self, ptr: u64) -> $crate::AllocResult<()> {
                self.0.free(ptr)
            }
            fn record_stream(&self, ptr: u64, stream: $crate::Stream) -> $crate::AllocResult<()> {
                self.0.record_stream(ptr, stream)
            }
            fn empty_cache(&self) -> $crate::AllocResult<()> {
                self.0.empty_cache()
            }
            fn set_memory_fraction(&self, fraction: f64) -> $crate::AllocResult<()> {
                self.0.set_memory_fraction(fraction)
            }
            fn stats(&self) -> $crate::Stats {
                self.0.stats()
            }
            fn reset_peak_stats(&self) {
                self.0.reset_peak_stats()
            }
            fn snapshot(&self) -> $crate::Snapshot {
                self.0.snapshot()
            }
            fn validate(&self) -> Result<(), String> {
                self.0.validate()
            }
        }

        impl<D: vmmalloc_device::Device> std::ops::Deref for $ty<D> {
            type Target = $crate::caching::DeviceCachingAllocator<D>;
            fn deref(&self) -> &Self::Target {
                &self.0
            }
        }
    };
}
pub(crate) use delegate_allocator;

/// The `caching` policy: PyTorch's caching allocator with plain `cudaMalloc`
/// segments (`expandable_segments:False`, whatever the config says).
pub struct CachingAllocator<D: Device>(DeviceCachingAllocator<D>);

impl<D: Device> CachingAllocator<D> {
    /// Creates the allocator over `device` with PyTorch's options `config`.
    pub fn new(device: D, config: CachingConfig) -> AllocResult<Self> {
        Ok(CachingAllocator(DeviceCachingAllocator::with_mode(
            device, config, false,
        )?))
    }
}

delegate_allocator!(CachingAllocator);
