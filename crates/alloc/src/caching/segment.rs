//! PyTorch's `struct ExpandableSegment`: one virtual reservation of 1⅛ × device
//! memory, grown and shrunk one page (`segment_size_`: 2 MiB small pool,
//! 20 MiB large pool) at a time, each page its own physical allocation.
//!
//! Driver calls per operation, as in PyTorch:
//! - `map`: one `cuMemCreate` per page, one `cuMemMap` per page, then one
//!   `cuMemSetAccess` over the whole newly mapped range (`mapAndSetAccess`);
//! - `unmap` (`unmapHandles`): one `cuStreamSynchronize` of the segment's stream,
//!   then per page `cuMemUnmap` + `cuMemRelease`;
//! - destruction: `cuMemAddressFree` of the reservation.
//!
//! Unlike PyTorch, which throws on a non-out-of-memory driver error, every
//! failure leaves the segment and the device consistent: a failed `map` is rolled
//! back; a failed `unmap` reports the pages it did unmap.

use super::calls::Calls;
use vmmalloc_device::{Device, DeviceError, DeviceResult, PhysHandle, Stream};

/// One expandable segment. Invariant: `handles[i]` is `Some` iff page `i` is
/// mapped and accessible; `handles` has no trailing `None` (`trimHandles`).
#[derive(Debug)]
pub(crate) struct ExpandableSegment {
    /// The segment's id, as its driver calls name their owner.
    pub id: u32,
    /// The stream the segment serves (`stream_`).
    pub stream: Stream,
    /// Start of the reservation (`ptr_`).
    pub ptr: u64,
    /// Page size (`segment_size_`).
    pub segment_size: u64,
    /// Pages in the reservation (`max_handles_`).
    pub max_handles: u64,
    /// Physical page per slot (`handles_`).
    pub handles: Vec<Option<PhysHandle>>,
}

/// The outcome of [`ExpandableSegment::unmap`] when a driver call failed midway:
/// the range actually unmapped, and the error.
pub(crate) struct PartialUnmap {
    pub ptr: u64,
    pub size: u64,
    pub error: DeviceError,
}

impl ExpandableSegment {
    /// Reserves `segment_size × ceil((total + total/8) / segment_size)` bytes
    /// (the constructor: "enough address space for 1 1/8 the total memory").
    pub fn new<D: Device>(
        dev: &D,
        c: &mut Calls,
        id: u32,
        stream: Stream,
        segment_size: u64,
    ) -> DeviceResult<Self> {
        let total = dev.caps().total_memory;
        let max_handles = (total + total / 8).div_ceil(segment_size).max(1);
        let ptr = c.reserve(dev, id, segment_size * max_handles, 0)?;
        Ok(ExpandableSegment {
            id,
            stream,
            ptr,
            segment_size,
            max_handles,
            handles: Vec::new(),
        })
    }

    /// Bytes of address space (`size()`).
    pub fn size(&self) -> u64 {
        self.max_handles * self.segment_size
    }

    /// Pages currently mapped.
    pub fn mapped_pages(&self) -> u64 {
        self.handles.iter().filter(|h| h.is_some()).count() as u64
    }

    /// `segmentLeft`: the page holding `p`.
    fn segment_left(&self, p: u64) -> u64 {
        (p - self.ptr) / self.segment_size
    }

    /// `segmentRight`: the first page boundary at or after `p`.
    fn segment_right(&self, p: u64) -> u64 {
        (p - self.ptr).div_ceil(self.segment_size)
    }

    fn trim_handles(&mut self) {
        while matches!(self.handles.last(), Some(None)) {
            self.handles.pop();
        }
    }

    /// `map`: backs `[ptr, ptr+size)` (`ptr` page-aligned) with new pages.
    /// Returns the page-rounded range mapped; `Ok(None)` when `cuMemCreate` runs
    /// out of memory (PyTorch's "size 0 indicates OOM"), after releasing the pages
    /// created so far. Any other driver error is rolled back and returned.
    pub fn map<D: Device>(
        &mut self,
        dev: &D,
        c: &mut Calls,
        ptr: u64,
        size: u64,
    ) -> DeviceResult<Option<(u64, u64)>> {
        let begin = self.segment_left(ptr);
        let end = self.segment_right(ptr + size).min(self.max_handles);
        debug_assert_eq!(
            self.ptr + begin * self.segment_size,
            ptr,
            "map must start on a page"
        );
        if begin >= end {
            return Ok(None);
        }
        while (self.handles.len() as u64) < end {
            self.handles.push(None);
        }
        let mut created: Vec<PhysHandle> = Vec::new();
        for i in begin..end {
            debug_assert!(
                self.handles[i as usize].is_none(),
                "page {i} already mapped"
            );
            match c.create(dev, self.segment_size) {
                Ok(h) => created.push(h),
                Err(e) => {
                    for h in created {
                        c.release(dev, h, self.segment_size);
                    }
                    self.trim_handles();
                    return if e.is_out_of_memory() {
                        Ok(None)
                    } else {
                        Err(e)
                    };
                }
            }
        }
        // mapAndSetAccess
        let mut mapped = 0usize;
        let mut failure = None;
        for (k, &h) in created.iter().enumerate() {
            let addr = self.ptr + (begin + k as u64) * self.segment_size;
            if let Err(e) = c.map(dev, self.id, addr, self.segment_size, h) {
                failure = Some(e);
                break;
            }
            mapped += 1;
        }
        if failure.is_none() {
            if let Err(e) = c.set_access(
                dev,
                self.id,
                self.ptr + begin * self.segment_size,
                (end - begin) * self.segment_size,
            ) {
                failure = Some(e);
            }
        }
        if let Some(e) = failure {
            for k in 0..mapped {
                let addr = self.ptr + (begin + k as u64) * self.segment_size;
                if let Err(ue) = c.unmap(dev, self.id, addr, self.segment_size) {
                    c.note_failure(&ue);
                }
            }
            for h in created {
                c.release(dev, h, self.segment_size);
            }
            self.trim_handles();
            return Err(e);
        }
        for (k, h) in created.into_iter().enumerate() {
            self.handles[(begin + k as u64) as usize] = Some(h);
        }
        Ok(Some((
            self.ptr + begin * self.segment_size,
            (end - begin) * self.segment_size,
        )))
    }

    /// `unmap`: unmaps and releases every page lying entirely inside
    /// `[ptr, ptr+size)`, after synchronizing the segment's stream
    /// (`unmapHandles`). Returns the range unmapped (size 0 if no whole page).
    pub fn unmap<D: Device>(
        &mut self,
        dev: &D,
        c: &mut Calls,
        ptr: u64,
        size: u64,
    ) -> Result<(u64, u64), PartialUnmap> {
        let begin = self.segment_right(ptr);
        let end = self.segment_left(ptr + size);
        if begin >= end {
            return Ok((ptr, 0));
        }
        let start = self.ptr + begin * self.segment_size;
        // "unlike cudaFree, MemUnmap and MemRelease do not appear to synchronize
        // in all cases, so we have to wait for the stream to finish".
        if let Err(error) = c.observers.sync_stream(dev, self.stream) {
            return Err(PartialUnmap {
                ptr: start,
                size: 0,
                error,
            });
        }
        for i in begin..end {
            let addr = self.ptr + i * self.segment_size;
            let Some(h) = self.handles.get(i as usize).copied().flatten() else {
                continue;
            };
            if let Err(error) = c.unmap(dev, self.id, addr, self.segment_size) {
                self.trim_handles();
                return Err(PartialUnmap {
                    ptr: start,
                    size: (i - begin) * self.segment_size,
                    error,
                });
            }
            self.handles[i as usize] = None;
            c.release(dev, h, self.segment_size);
        }
        self.trim_handles();
        Ok((start, (end - begin) * self.segment_size))
    }

    /// Unmaps and releases every mapped page without touching the stream state,
    /// then frees the reservation (`~ExpandableSegment`, used on teardown after
    /// a device synchronize). Errors are logged.
    pub fn destroy<D: Device>(&mut self, dev: &D, c: &mut Calls) {
        for i in 0..self.handles.len() {
            if let Some(h) = self.handles[i].take() {
                let addr = self.ptr + i as u64 * self.segment_size;
                if let Err(e) = c.unmap(dev, self.id, addr, self.segment_size) {
                    eprintln!("vmmalloc: torch-es: unmapping {addr:#x} on teardown failed: {e}");
                }
                c.release(dev, h, self.segment_size);
            }
        }
        self.handles.clear();
        if let Err(e) = c.free_reservation(dev, self.id, self.ptr, self.size()) {
            eprintln!(
                "vmmalloc: torch-es: freeing the reservation {:#x} on teardown failed: {e}",
                self.ptr
            );
        }
    }
}
