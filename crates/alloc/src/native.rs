//! `native`: one device allocation per request, freed at once — the lower
//! bound on memory and the upper bound on driver cost.

use crate::caching::IntMap;
use crate::stats::StatType;
use crate::{
    AllocError, AllocResult, Allocation, Allocator, BlockInfo, BlockState, OomReport, SegmentInfo,
    Snapshot, Stats, StreamUsage,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use vmmalloc_device::{Device, Stream};

struct Live {
    requested: u64,
    stream: Stream,
}

struct State {
    /// Live allocations by address (unordered: sort for address order).
    live: IntMap<u64, Live>,
    stats: Stats,
    /// Bytes charged per live allocation, as the device charges plain allocations.
    held: u64,
    limit: Option<u64>,
}

/// One `Device::alloc` per `malloc`, one `Device::free` per `free`.
pub struct NativeAllocator<D: Device> {
    device: D,
    state: Mutex<State>,
}

impl<D: Device> NativeAllocator<D> {
    /// Creates the allocator.
    pub fn new(device: D) -> AllocResult<Self> {
        Ok(NativeAllocator {
            device,
            state: Mutex::new(State {
                live: IntMap::default(),
                stats: Stats {
                    max_split_size: i64::MAX,
                    ..Stats::default()
                },
                held: 0,
                limit: None,
            }),
        })
    }

    fn charge(size: u64) -> u64 {
        vmmalloc_device::round_up(size, vmmalloc_device::model::PLAIN_ALLOC_UNIT)
    }

    /// The live allocations in address order.
    fn sorted(st: &State) -> Vec<(u64, &Live)> {
        let mut v: Vec<(u64, &Live)> = st.live.iter().map(|(&p, l)| (p, l)).collect();
        v.sort_unstable_by_key(|e| e.0);
        v
    }

    fn oom(&self, st: &State, size: u64, device_free: u64) -> AllocError {
        let mut per: HashMap<Stream, u64> = HashMap::new();
        for l in st.live.values() {
            *per.entry(l.stream).or_default() += Self::charge(l.requested);
        }
        let mut per_stream: Vec<StreamUsage> = per
            .into_iter()
            .map(|(stream, live)| StreamUsage {
                stream,
                live,
                cached: 0,
            })
            .collect();
        per_stream.sort_by_key(|s| s.stream);
        let total = self.device.caps().total_memory;
        AllocError::OutOfMemory(Box::new(OomReport {
            policy: "native",
            device: self.device.caps().ordinal,
            requested: size,
            rounded: Self::charge(size),
            capacity: total,
            allowed: st.limit.filter(|&l| l < total),
            device_free,
            live: st.held,
            cached: 0,
            pooled: 0,
            largest_free: 0,
            per_stream,
            hint: "native caches nothing: the live tensors alone exceed the device.".into(),
            caching: None,
        }))
    }
}

impl<D: Device> Allocator for NativeAllocator<D> {
    fn name(&self) -> &'static str {
        "native"
    }

    fn malloc(&self, size: u64, stream: Stream) -> AllocResult<Allocation> {
        if size == 0 {
            return Err(AllocError::InvalidSize {
                size,
                reason: "size must be positive".into(),
            });
        }
        let mut st = self.state.lock();
        let charged = Self::charge(size);
        if st.limit.is_some_and(|l| st.held + charged > l) {
            st.stats.num_ooms += 1;
            let free = self.device.mem_info().map(|m| m.free).unwrap_or(0);
            return Err(self.oom(&st, size, free));
        }
        let ptr = match self.device.alloc(size) {
            Ok(p) => p,
            Err(e) if e.is_out_of_memory() => {
                st.stats.num_ooms += 1;
                let free = match &e {
                    vmmalloc_device::DeviceError::OutOfMemory { free, .. } => *free,
                    _ => 0,
                };
                return Err(self.oom(&st, size, free));
            }
            Err(e) => return Err(e.into()),
        };
        st.stats.driver_calls.add(vmmalloc_device::Call::Alloc);
        let pool = StatType::for_size(size);
        let s = &mut st.stats;
        s.num_device_alloc += 1;
        s.allocation.update(pool, 1);
        s.segment.update(pool, 1);
        s.active.update(pool, 1);
        s.allocated_bytes.update(pool, charged as i64);
        s.reserved_bytes.update(pool, charged as i64);
        s.active_bytes.update(pool, charged as i64);
        s.requested_bytes.update(pool, size as i64);
        st.held += charged;
        st.live.insert(
            ptr,
            Live {
                requested: size,
                stream,
            },
        );
        Ok(Allocation {
            ptr,
            requested: size,
            size: charged,
            stream,
        })
    }

    fn free(&self, ptr: u64) -> AllocResult<()> {
        let mut st = self.state.lock();
        let requested = match st.live.get(&ptr) {
            Some(l) => l.requested,
            None => return Err(AllocError::InvalidPointer { ptr }),
        };
        // cuMemFree synchronizes implicitly, so no event is needed for stream safety.
        self.device.free(ptr)?;
        st.live.remove(&ptr);
        st.stats.driver_calls.add(vmmalloc_device::Call::Free);
        let charged = Self::charge(requested);
        let pool = StatType::for_size(requested);
        let s = &mut st.stats;
        s.num_device_free += 1;
        s.allocation.update(pool, -1);
        s.segment.update(pool, -1);
        s.active.update(pool, -1);
        s.allocated_bytes.update(pool, -(charged as i64));
        s.reserved_bytes.update(pool, -(charged as i64));
        s.active_bytes.update(pool, -(charged as i64));
        s.requested_bytes.update(pool, -(requested as i64));
        st.held -= charged;
        Ok(())
    }

    fn record_stream(&self, ptr: u64, _stream: Stream) -> AllocResult<()> {
        // Nothing to do: the free synchronizes the device.
        if self.state.lock().live.contains_key(&ptr) {
            Ok(())
        } else {
            Err(AllocError::InvalidPointer { ptr })
        }
    }

    fn empty_cache(&self) -> AllocResult<()> {
        Ok(())
    }

    fn set_memory_fraction(&self, fraction: f64) -> AllocResult<()> {
        // PyTorch accepts 0 to 1 inclusive (torch/cuda/memory.py,
        // `set_per_process_memory_fraction`: "if fraction < 0 or fraction > 1:
        // raise ValueError"); 0 allows nothing.
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidOption(format!(
                "memory fraction {fraction} is not in [0, 1]"
            )));
        }
        self.state.lock().limit = Some((self.device.caps().total_memory as f64 * fraction) as u64);
        Ok(())
    }

    fn stats(&self) -> Stats {
        self.state.lock().stats.clone()
    }

    fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peak();
    }

    fn snapshot(&self) -> Snapshot {
        let st = self.state.lock();
        let segments = Self::sorted(&st)
            .into_iter()
            .map(|(ptr, l)| {
                let size = Self::charge(l.requested);
                SegmentInfo {
                    address: ptr,
                    total_size: size,
                    stream: l.stream,
                    segment_type: if l.requested <= 1 << 20 {
                        "small"
                    } else {
                        "large"
                    },
                    allocated_size: size,
                    active_size: size,
                    requested_size: l.requested,
                    is_expandable: false,
                    pool: (0, 0),
                    blocks: vec![BlockInfo {
                        address: ptr,
                        size,
                        requested_size: l.requested,
                        state: BlockState::ActiveAllocated,
                    }],
                }
            })
            .collect();
        Snapshot {
            device: self.device.caps().ordinal,
            segments,
            mapped_bytes: st.held,
            pooled_bytes: 0,
        }
    }

    fn validate(&self) -> Result<(), String> {
        let st = self.state.lock();
        let mut end = 0;
        let mut held = 0;
        let mut requested = 0;
        for (p, l) in Self::sorted(&st) {
            if p < end {
                return Err(format!("allocation {p:#x} overlaps the previous one"));
            }
            end = p + l.requested;
            held += Self::charge(l.requested);
            requested += l.requested;
            if let Some(i) = self.device.introspect() {
                if !i.is_accessible(p, l.requested) {
                    return Err(format!("allocation {p:#x} is not accessible on the device"));
                }
            }
        }
        let s = &st.stats;
        if held != st.held
            || s.allocated_bytes.all().current != held as i64
            || s.requested_bytes.all().current != requested as i64
            || s.allocation.all().current != st.live.len() as i64
        {
            return Err(format!(
                "stats disagree with a recount: held {} vs {held}, allocated {} , requested {} vs {requested}",
                st.held,
                s.allocated_bytes.all().current,
                s.requested_bytes.all().current
            ));
        }
        if let Some(i) = self.device.introspect() {
            let live = i.live();
            if live.plain_allocs < st.live.len() {
                return Err(format!(
                    "device has {} plain allocations, allocator {}",
                    live.plain_allocs,
                    st.live.len()
                ));
            }
        }
        Ok(())
    }
}

impl<D: Device> Drop for NativeAllocator<D> {
    /// Gives every live allocation back to the device (errors are logged, not raised).
    fn drop(&mut self) {
        let st = self.state.get_mut();
        for (ptr, _) in Self::sorted(st) {
            if let Err(e) = self.device.free(ptr) {
                eprintln!("vmmalloc: native: freeing {ptr:#x} on drop failed: {e}");
            }
        }
        st.live.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use vmmalloc_device::sim::SimDevice;
    use vmmalloc_device::{GIB, MIB};

    #[test]
    fn one_device_call_per_request_and_exact_memory() {
        let dev = Arc::new(SimDevice::with_capacity(GIB));
        let a = NativeAllocator::new(dev.clone()).unwrap();
        let x = a.malloc(3 * MIB + 1, Stream::DEFAULT).unwrap();
        let y = a.malloc(100, Stream::DEFAULT).unwrap();
        a.validate().unwrap();
        assert_eq!(
            a.stats().allocated_bytes.all().current as u64,
            3 * MIB + 512 + 512
        );
        a.free(x.ptr).unwrap();
        assert!(a.free(x.ptr).is_err(), "double free is reported");
        a.free(y.ptr).unwrap();
        a.validate().unwrap();
        let c = dev.counts();
        assert_eq!(c.get(vmmalloc_device::Call::Alloc), 2);
        assert_eq!(c.get(vmmalloc_device::Call::Free), 2);
        assert!(vmmalloc_device::Introspect::live(&*dev).is_empty());
    }

    #[test]
    fn out_of_memory_is_explained() {
        let dev = Arc::new(SimDevice::with_capacity(8 * MIB));
        let a = NativeAllocator::new(dev).unwrap();
        let _x = a.malloc(6 * MIB, Stream::DEFAULT).unwrap();
        let e = a.malloc(4 * MIB, Stream::DEFAULT).unwrap_err();
        assert!(e.is_out_of_memory());
        assert!(e.to_string().contains("Tried to allocate 4.00 MiB"), "{e}");
        assert_eq!(a.stats().num_ooms, 1);
        a.validate().unwrap();
    }
}
