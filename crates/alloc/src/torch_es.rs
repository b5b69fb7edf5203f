//! PyTorch's expandable segments (placeholder until the replica lands).
use crate::caching::CachingConfig;
use crate::*;
use vmmalloc_device::Device;

/// The torch-es replica.
pub struct TorchEsAllocator<D> {
    _d: D,
}

impl<D: Device> TorchEsAllocator<D> {
    /// Creates the allocator.
    pub fn new(device: D, _config: CachingConfig) -> AllocResult<Self> {
        Ok(Self { _d: device })
    }
}

impl<D: Device> Allocator for TorchEsAllocator<D> {
    fn name(&self) -> &'static str { "torch-es" }
    fn malloc(&self, size: u64, _stream: Stream) -> AllocResult<Allocation> { Err(AllocError::InvalidSize { size, reason: "not implemented".into() }) }
    fn free(&self, ptr: u64) -> AllocResult<()> { Err(AllocError::InvalidPointer { ptr }) }
    fn record_stream(&self, ptr: u64, _stream: Stream) -> AllocResult<()> { Err(AllocError::InvalidPointer { ptr }) }
    fn empty_cache(&self) -> AllocResult<()> { Ok(()) }
    fn set_memory_fraction(&self, _fraction: f64) -> AllocResult<()> { Ok(()) }
    fn stats(&self) -> Stats { Stats::default() }
    fn reset_peak_stats(&self) {}
    fn snapshot(&self) -> Snapshot { Snapshot::default() }
    fn validate(&self) -> Result<(), String> { Ok(()) }
}
