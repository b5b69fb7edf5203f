//! The address-space model shared by the `sim` and `host` backends.
//!
//! It is the driver's bookkeeping, checked: reservations, physical allocations,
//! handles, mappings with their access state, and plain allocations. Every
//! method validates its arguments against the rules of DESIGN.md ("Driver rules
//! the models enforce") and returns the error the driver would, leaving the
//! model unchanged on error. Backends choose addresses (the `host` backend gets
//! them from `mmap`, `sim` from [`AddressSpace::find_free_va`]) and call the
//! model before doing anything irreversible.
//!
//! Invariants (checked by [`AddressSpace::check`]):
//! - reservations do not overlap; every mapping lies inside one reservation;
//!   mappings do not overlap;
//! - an allocation's `refs` = live handles naming it + mappings of it;
//!   an allocation with `refs == 0` no longer exists;
//! - `physical_used` = sum of live allocation sizes + plain allocation charges
//!   <= `capacity`.

use crate::{round_up, Call, DeviceError, DeviceResult, PhysHandle, Rule};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

/// Where the `sim` device places virtual addresses (like a GPU's VA window).
pub const VA_BASE: u64 = 0x7000_0000_0000;
/// End of the simulated virtual address space (47-bit user space).
pub const VA_END: u64 = 0x7fff_0000_0000;
/// Plain allocations are charged in multiples of this many bytes.
pub const PLAIN_ALLOC_UNIT: u64 = 512;

#[derive(Debug, Clone)]
struct Mapping {
    size: u64,
    alloc: u64,
    accessible: bool,
}

#[derive(Debug, Clone)]
struct Allocation {
    size: u64,
    /// Live handles naming this allocation + mappings of it.
    refs: u32,
    /// Host-located (`cuMemCreate` with a host NUMA location): charged to
    /// `host_used`, not to the device's `physical_used`.
    on_host: bool,
    /// Imported from another process ([`AddressSpace::import_foreign`]):
    /// its memory is charged to the process that created it, not here.
    foreign: bool,
}

/// A hash map keyed by ids or addresses (FxHash: one multiply per key; keys
/// are never attacker-chosen).
pub(crate) type IdMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// A count of the model's live objects, to prove that nothing leaked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LiveCounts {
    /// Reservations not yet freed.
    pub reservations: usize,
    /// Handles not yet released.
    pub handles: usize,
    /// Mappings not yet unmapped.
    pub mappings: usize,
    /// Plain allocations not yet freed.
    pub plain_allocs: usize,
    /// Bytes of physical memory in use (allocations + plain allocations).
    pub physical_bytes: u64,
    /// Bytes of host-located physical allocations (spill; not device memory).
    pub host_bytes: u64,
}

impl LiveCounts {
    /// Whether everything has been given back.
    pub fn is_empty(&self) -> bool {
        *self == LiveCounts::default()
    }
}

/// The checked address-space model. Not thread-safe by itself: backends hold it
/// under a lock.
#[derive(Debug)]
pub struct AddressSpace {
    granularity: u64,
    capacity: u64,
    /// start -> size
    reservations: BTreeMap<u64, u64>,
    /// start -> mapping
    mappings: BTreeMap<u64, Mapping>,
    /// handle id -> allocation id
    handles: IdMap<u64, u64>,
    /// allocation id -> allocation
    allocations: IdMap<u64, Allocation>,
    /// plain allocation address -> (size, charged bytes)
    plain: IdMap<u64, (u64, u64)>,
    /// The plain allocations' addresses in order, for [`AddressSpace::check_accessible`];
    /// `None` after a plain allocation changed (rebuilt on demand: `cuMemAlloc` and
    /// `cuMemFree` stay O(1), accessibility checks are rare).
    plain_order: RefCell<Option<Vec<u64>>>,
    /// The free gaps of the VA window `[VA_BASE, VA_END)` between the occupied
    /// virtual ranges (reservations and plain allocations, the latter rounded up
    /// to the granularity), while those ranges are disjoint and inside the
    /// window, as they always are on `sim`: first fit in O(log n).
    /// `None` once a backend recorded a range outside the window or overlapping
    /// another (possible through the public methods, e.g. on `host`); from then
    /// on `va` lists the occupied ranges and [`AddressSpace::find_free_va`]
    /// scans it.
    gaps: Option<gaps::Gaps>,
    /// Every occupied virtual range (reservations and plain allocations):
    /// start -> length. Only kept while `gaps` is `None`.
    va: BTreeMap<u64, u64>,
    physical_used: u64,
    /// Bytes of host-located allocations, and their limit (host memory a
    /// process may pin; `u64::MAX` = no limit).
    host_used: u64,
    host_capacity: u64,
    next_id: u64,
}

/// Handles the maps of a new [`AddressSpace`] have room for before they
/// first grow (a replay creates hundreds to thousands of handles; growing
/// rehashes every entry).
const INITIAL_HANDLES: usize = 1024;

impl AddressSpace {
    /// A model of a device with `capacity` bytes of physical memory and the given
    /// allocation granularity (a power of two).
    pub fn new(capacity: u64, granularity: u64) -> Self {
        assert!(
            granularity.is_power_of_two(),
            "granularity must be a power of two"
        );
        AddressSpace {
            granularity,
            capacity,
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            handles: IdMap::with_capacity_and_hasher(INITIAL_HANDLES, Default::default()),
            allocations: IdMap::with_capacity_and_hasher(INITIAL_HANDLES, Default::default()),
            plain: IdMap::default(),
            plain_order: RefCell::new(None),
            gaps: Some(gaps::Gaps::new(VA_BASE, VA_END)),
            va: BTreeMap::new(),
            physical_used: 0,
            host_used: 0,
            host_capacity: u64::MAX,
            next_id: 1,
        }
    }

    /// Allocation granularity.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Physical capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of physical memory not in use.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.physical_used
    }

    /// Bytes of physical memory in use.
    pub fn physical_used(&self) -> u64 {
        self.physical_used
    }

    /// Counts of live objects.
    pub fn live(&self) -> LiveCounts {
        LiveCounts {
            reservations: self.reservations.len(),
            handles: self.handles.len(),
            mappings: self.mappings.len(),
            plain_allocs: self.plain.len(),
            physical_bytes: self.physical_used,
            host_bytes: self.host_used,
        }
    }

    fn aligned(&self, call: Call, what: &str, value: u64) -> DeviceResult<()> {
        if !value.is_multiple_of(self.granularity) {
            return Err(DeviceError::rule(
                call,
                Rule::Misaligned,
                format!(
                    "{what} {value:#x} is not a multiple of the granularity {:#x}",
                    self.granularity
                ),
            ));
        }
        Ok(())
    }

    fn positive(call: Call, size: u64) -> DeviceResult<()> {
        if size == 0 {
            return Err(DeviceError::rule(call, Rule::ZeroSize, "size 0"));
        }
        Ok(())
    }

    /// A range whose end overflows `u64` cannot be mapped.
    fn in_address_space(call: Call, addr: u64, size: u64) -> DeviceResult<()> {
        if addr.checked_add(size).is_none() {
            return Err(DeviceError::rule(
                call,
                Rule::NotMapped,
                format!("[{addr:#x}, +{size:#x}) overflows the address space"),
            ));
        }
        Ok(())
    }

    fn oom(&self, call: Call, requested: u64) -> DeviceError {
        DeviceError::OutOfMemory {
            call,
            requested,
            free: self.free_bytes(),
            total: self.capacity,
        }
    }

    /// Checks the arguments of a reserve (size and alignment).
    pub fn check_reserve(&self, size: u64, align: u64) -> DeviceResult<()> {
        Self::positive(Call::Reserve, size)?;
        self.aligned(Call::Reserve, "size", size)?;
        if align != 0 && (!align.is_power_of_two() || !align.is_multiple_of(self.granularity)) {
            return Err(DeviceError::rule(
                Call::Reserve,
                Rule::Misaligned,
                format!("alignment {align:#x} is not a power-of-two multiple of the granularity"),
            ));
        }
        Ok(())
    }

    /// Finds a free virtual range of `size` bytes aligned to `align` (0 =
    /// granularity) in the simulated VA window, first fit.
    pub fn find_free_va(&self, size: u64, align: u64) -> DeviceResult<u64> {
        self.check_reserve(size, align)?;
        let align = if align == 0 { self.granularity } else { align };
        if let Some(gaps) = &self.gaps {
            // The lowest gap where the aligned range fits; the last gap (if it
            // ends at VA_END) is the space after every occupied range.
            let mut after = None;
            while let Some((start, end)) = gaps.first_fit(after, size) {
                let candidate = round_up(start, align);
                if candidate.checked_add(size).is_some_and(|e| e <= end) {
                    return Ok(candidate);
                }
                after = Some(start);
            }
            let tail = match gaps.last() {
                Some((start, end)) if end == VA_END => start,
                _ => VA_END,
            };
            let candidate = round_up(tail, align);
            return Err(DeviceError::OutOfMemory {
                call: Call::Reserve,
                requested: size,
                free: VA_END.saturating_sub(candidate),
                total: VA_END - VA_BASE,
            });
        }
        let mut cursor = VA_BASE;
        for (&start, &len) in &self.va {
            let candidate = round_up(cursor, align);
            if candidate.checked_add(size).is_some_and(|end| end <= start) {
                return Ok(candidate);
            }
            cursor = cursor.max(start + len);
        }
        let candidate = round_up(cursor, align);
        match candidate.checked_add(size) {
            Some(end) if end <= VA_END => Ok(candidate),
            _ => Err(DeviceError::OutOfMemory {
                call: Call::Reserve,
                requested: size,
                free: VA_END.saturating_sub(candidate),
                total: VA_END - VA_BASE,
            }),
        }
    }

    /// Records a reservation of `[addr, addr+size)` chosen by the backend.
    pub fn reserve(&mut self, addr: u64, size: u64, align: u64) -> DeviceResult<()> {
        self.check_reserve(size, align)?;
        self.aligned(Call::Reserve, "address", addr)?;
        if align != 0 && !addr.is_multiple_of(align) {
            return Err(DeviceError::rule(
                Call::Reserve,
                Rule::Misaligned,
                "address not aligned as requested",
            ));
        }
        if self.overlapping_reservation(addr, size).is_some() {
            return Err(DeviceError::rule(
                Call::Reserve,
                Rule::AlreadyMapped,
                "range overlaps a reservation",
            ));
        }
        self.reservations.insert(addr, size);
        self.va_insert(addr, size);
        Ok(())
    }

    /// Marks `[start, start+len)` occupied in the VA index.
    fn va_insert(&mut self, start: u64, len: u64) {
        if let Some(gaps) = &mut self.gaps {
            let end = start
                .checked_add(len)
                .filter(|&e| start >= VA_BASE && e <= VA_END);
            if end.is_some_and(|end| gaps.carve(start, end)) {
                return;
            }
            self.switch_to_scan();
        }
        self.va.insert(start, len);
    }

    /// Frees `[start, start+len)` (an occupied range recorded by `va_insert`) in the VA index.
    fn va_remove(&mut self, start: u64, len: u64) {
        let Some(gaps) = &mut self.gaps else {
            self.va.remove(&start);
            return;
        };
        gaps.release(start, start + len);
    }

    /// The occupied ranges, as `va_insert` recorded them: reservations and plain
    /// allocations rounded up to the granularity.
    fn occupied(&self) -> BTreeMap<u64, u64> {
        let mut va: BTreeMap<u64, u64> = self.reservations.clone();
        for (&p, &(size, _)) in &self.plain {
            va.insert(p, round_up(size, self.granularity));
        }
        va
    }

    /// Leaves the gap index for the list of occupied ranges (a range outside the
    /// window or overlapping another is being recorded).
    fn switch_to_scan(&mut self) {
        self.va = self.occupied();
        self.gaps = None;
    }

    fn overlapping_reservation(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let end = addr + size;
        if let Some((&s, &l)) = self.reservations.range(..end).next_back() {
            if s + l > addr {
                return Some((s, l));
            }
        }
        None
    }

    /// Checks and removes a reservation (`cuMemAddressFree`): exactly a reserved
    /// range, with nothing mapped in it.
    pub fn free_reservation(&mut self, addr: u64, size: u64) -> DeviceResult<()> {
        match self.reservations.get(&addr) {
            Some(&len) if len == size => {}
            _ => {
                return Err(DeviceError::rule(
                    Call::AddressFree,
                    Rule::NotAReservation,
                    format!("[{addr:#x}, +{size:#x}) was not returned by reserve"),
                ))
            }
        }
        if self.mappings.range(addr..addr + size).next().is_some() {
            return Err(DeviceError::rule(
                Call::AddressFree,
                Rule::ReservationInUse,
                format!("[{addr:#x}, +{size:#x}) still has mappings"),
            ));
        }
        self.reservations.remove(&addr);
        self.va_remove(addr, size);
        Ok(())
    }

    /// Creates a physical allocation and a handle to it (`cuMemCreate`).
    pub fn create(&mut self, size: u64) -> DeviceResult<PhysHandle> {
        Self::positive(Call::Create, size)?;
        self.aligned(Call::Create, "size", size)?;
        if size > self.free_bytes() {
            return Err(self.oom(Call::Create, size));
        }
        self.physical_used += size;
        Ok(self.insert_allocation(size, false))
    }

    /// Records a new physical allocation of `size` bytes (on the host or the
    /// device) with one handle to it; returns the handle.
    fn insert_allocation(&mut self, size: u64, on_host: bool) -> PhysHandle {
        self.insert_allocation_of(size, on_host, false)
    }

    /// [`Self::insert_allocation`], `foreign` for an import from another process.
    fn insert_allocation_of(&mut self, size: u64, on_host: bool, foreign: bool) -> PhysHandle {
        let alloc = self.next_id;
        let handle = self.next_id + 1;
        self.next_id += 2;
        self.allocations.insert(
            alloc,
            Allocation {
                size,
                refs: 1,
                on_host,
                foreign,
            },
        );
        self.handles.insert(handle, alloc);
        PhysHandle(handle)
    }

    /// Creates a host-located physical allocation and a handle to it
    /// (`cuMemCreate` with `CUmemLocation{CU_MEM_LOCATION_TYPE_HOST_NUMA, node}`,
    /// CUDA 12.2+): mapped and accessed like device memory, charged to the
    /// host limit ([`AddressSpace::set_host_capacity`]), never to the device.
    pub fn create_on_host(&mut self, size: u64) -> DeviceResult<PhysHandle> {
        Self::positive(Call::Create, size)?;
        self.aligned(Call::Create, "size", size)?;
        if size > self.host_capacity - self.host_used {
            return Err(DeviceError::OutOfMemory {
                call: Call::Create,
                requested: size,
                free: self.host_capacity - self.host_used,
                total: self.host_capacity,
            });
        }
        self.host_used += size;
        Ok(self.insert_allocation(size, true))
    }

    /// Limits host-located allocations to `bytes` in all.
    pub fn set_host_capacity(&mut self, bytes: u64) {
        self.host_capacity = bytes;
    }

    /// Bytes of host-located allocations in use.
    pub fn host_used(&self) -> u64 {
        self.host_used
    }

    /// Whether `handle` names a host-located allocation.
    pub fn is_on_host(&self, handle: PhysHandle) -> bool {
        self.handles
            .get(&handle.0)
            .is_some_and(|a| self.allocations[a].on_host)
    }

    /// The allocation a handle names (its identity across export/import).
    pub fn allocation_of(&self, call: Call, handle: PhysHandle) -> DeviceResult<u64> {
        self.handles.get(&handle.0).copied().ok_or_else(|| {
            DeviceError::rule(call, Rule::UnknownHandle, format!("handle {:#x}", handle.0))
        })
    }

    /// Size of the allocation behind a handle.
    pub fn handle_size(&self, call: Call, handle: PhysHandle) -> DeviceResult<u64> {
        let a = self.allocation_of(call, handle)?;
        Ok(self.allocations[&a].size)
    }

    /// A new handle to an existing allocation (`cuMemImportFromShareableHandle`).
    pub fn import(&mut self, alloc: u64) -> DeviceResult<PhysHandle> {
        let a = self.allocations.get_mut(&alloc).ok_or_else(|| {
            DeviceError::rule(
                Call::Import,
                Rule::UnknownShareableHandle,
                format!("allocation {alloc:#x} is gone"),
            )
        })?;
        a.refs += 1;
        let handle = self.next_id;
        self.next_id += 1;
        self.handles.insert(handle, alloc);
        Ok(PhysHandle(handle))
    }

    /// A handle to an allocation another process created and exported
    /// (`cuMemImportFromShareableHandle` of a descriptor this device did not
    /// export): `size` bytes, mappable like any handle, charged to no
    /// capacity of this device (the producer's device holds the memory; on a
    /// real GPU `cuMemGetInfo` counts it once, for the whole device).
    pub fn import_foreign(&mut self, size: u64) -> DeviceResult<PhysHandle> {
        Self::positive(Call::Import, size)?;
        self.aligned(Call::Import, "size", size)?;
        Ok(self.insert_allocation_of(size, false, true))
    }

    fn drop_ref(&mut self, alloc: u64) {
        let a = self
            .allocations
            .get_mut(&alloc)
            .expect("model invariant: ref to live allocation");
        a.refs -= 1;
        if a.refs == 0 {
            if a.foreign {
                // Charged to the producer.
            } else if a.on_host {
                self.host_used -= a.size;
            } else {
                self.physical_used -= a.size;
            }
            self.allocations.remove(&alloc);
        }
    }

    /// Releases a handle (`cuMemRelease`). Returns `Some(size)` if the physical
    /// memory went back to the device now, `None` if mappings still hold it.
    pub fn release(&mut self, handle: PhysHandle) -> DeviceResult<Option<u64>> {
        let alloc = self.allocation_of(Call::Release, handle)?;
        self.handles.remove(&handle.0);
        let size = self.allocations[&alloc].size;
        self.drop_ref(alloc);
        Ok((!self.allocations.contains_key(&alloc)).then_some(size))
    }

    /// Checks a map of the whole of `handle` at `[addr, addr+size)`.
    pub fn check_map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<u64> {
        Self::positive(Call::Map, size)?;
        self.aligned(Call::Map, "address", addr)?;
        self.aligned(Call::Map, "size", size)?;
        if addr.checked_add(size).is_none() {
            return Err(DeviceError::rule(
                Call::Map,
                Rule::OutsideReservation,
                format!("[{addr:#x}, +{size:#x}) overflows the address space"),
            ));
        }
        let alloc = self.allocation_of(Call::Map, handle)?;
        let hsize = self.allocations[&alloc].size;
        if size != hsize {
            return Err(DeviceError::rule(
                Call::Map,
                Rule::PartialHandleMap,
                format!("size {size:#x} but the handle is {hsize:#x} bytes"),
            ));
        }
        match self.overlapping_reservation(addr, size) {
            Some((s, l)) if s <= addr && addr + size <= s + l => {}
            _ => {
                return Err(DeviceError::rule(
                    Call::Map,
                    Rule::OutsideReservation,
                    format!("[{addr:#x}, +{size:#x}) is not inside one reservation"),
                ))
            }
        }
        if let Some((s, _)) = self.overlapping_mapping(addr, size) {
            return Err(DeviceError::rule(
                Call::Map,
                Rule::AlreadyMapped,
                format!("[{addr:#x}, +{size:#x}) overlaps the mapping at {s:#x}"),
            ));
        }
        Ok(alloc)
    }

    fn overlapping_mapping(&self, addr: u64, size: u64) -> Option<(u64, u64)> {
        let end = addr + size;
        let mut it = self.mappings.range(..end).rev();
        it.next()
            .and_then(|(&s, m)| (s + m.size > addr).then_some((s, m.size)))
    }

    /// Records a map (after [`AddressSpace::check_map`] succeeded and the backend did it).
    pub fn map(&mut self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        let alloc = self.check_map(addr, size, handle)?;
        self.allocations.get_mut(&alloc).expect("checked").refs += 1;
        self.mappings.insert(
            addr,
            Mapping {
                size,
                alloc,
                accessible: false,
            },
        );
        Ok(())
    }

    /// The mappings overlapping `[addr, addr+size)` as (start, size, accessible), in order.
    fn mappings_in(
        &self,
        addr: u64,
        size: u64,
    ) -> impl Iterator<Item = (u64, u64, bool)> + Clone + '_ {
        let end = addr + size;
        let straddling = self
            .mappings
            .range(..addr)
            .next_back()
            .filter(|(&s, m)| s + m.size > addr)
            .map(|(&s, m)| (s, m.size, m.accessible));
        straddling.into_iter().chain(
            self.mappings
                .range(addr..end)
                .map(|(&s, m)| (s, m.size, m.accessible)),
        )
    }

    /// How many mappings (physical handles mapped) overlap `[addr, addr+size)`:
    /// what a `cuMemUnmap` or `cuMemSetAccess` over that range acts on.
    /// O(log n + k) for k mappings; 0 for an empty or overflowing range.
    pub fn mappings_covered(&self, addr: u64, size: u64) -> u64 {
        if size == 0 || addr.checked_add(size).is_none() {
            return 0;
        }
        self.mappings_in(addr, size).count() as u64
    }

    /// Whether `[addr, addr+size)` is covered without gaps by the given ordered mappings.
    fn covered(addr: u64, size: u64, maps: impl Iterator<Item = (u64, u64, bool)>) -> bool {
        let mut cursor = addr;
        for (s, l, _) in maps {
            if s > cursor {
                return false;
            }
            cursor = cursor.max(s + l);
        }
        cursor >= addr + size
    }

    /// Checks an unmap: aligned, fully mapped, whole mappings only.
    pub fn check_unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        Self::positive(Call::Unmap, size)?;
        self.aligned(Call::Unmap, "address", addr)?;
        self.aligned(Call::Unmap, "size", size)?;
        Self::in_address_space(Call::Unmap, addr, size)?;
        let maps = self.mappings_in(addr, size);
        if !Self::covered(addr, size, maps.clone()) {
            return Err(DeviceError::rule(
                Call::Unmap,
                Rule::NotMapped,
                format!("[{addr:#x}, +{size:#x}) is not fully mapped"),
            ));
        }
        if let Some((s, l, _)) = maps
            .clone()
            .find(|&(s, l, _)| s < addr || s + l > addr + size)
        {
            return Err(DeviceError::rule(
                Call::Unmap,
                Rule::PartialUnmap,
                format!("[{addr:#x}, +{size:#x}) cuts the mapping [{s:#x}, +{l:#x})"),
            ));
        }
        Ok(())
    }

    /// Records an unmap (after [`AddressSpace::check_unmap`]). Returns the bytes of
    /// physical memory that went back to the device (released handles).
    pub fn unmap(&mut self, addr: u64, size: u64) -> DeviceResult<u64> {
        self.unmap_counted(addr, size).map(|(bytes, _)| bytes)
    }

    /// [`AddressSpace::unmap`], also returning how many mappings (handles) it removed.
    pub fn unmap_counted(&mut self, addr: u64, size: u64) -> DeviceResult<(u64, u64)> {
        self.check_unmap(addr, size)?;
        let before = self.physical_used;
        let mut removed = 0;
        while let Some((&s, _)) = self.mappings.range(addr..addr + size).next() {
            let m = self.mappings.remove(&s).expect("listed");
            self.drop_ref(m.alloc);
            removed += 1;
        }
        Ok((before - self.physical_used, removed))
    }

    /// Checks a set-access: aligned, fully mapped.
    pub fn check_set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        Self::positive(Call::SetAccess, size)?;
        self.aligned(Call::SetAccess, "address", addr)?;
        self.aligned(Call::SetAccess, "size", size)?;
        Self::in_address_space(Call::SetAccess, addr, size)?;
        if !Self::covered(addr, size, self.mappings_in(addr, size)) {
            return Err(DeviceError::rule(
                Call::SetAccess,
                Rule::NotMapped,
                format!("[{addr:#x}, +{size:#x}) is not fully mapped"),
            ));
        }
        Ok(())
    }

    /// Records a set-access: the mappings overlapping the range become accessible.
    pub fn set_access(&mut self, addr: u64, size: u64) -> DeviceResult<()> {
        self.check_set_access(addr, size)?;
        if let Some((&s, m)) = self.mappings.range_mut(..addr).next_back() {
            if s + m.size > addr {
                m.accessible = true;
            }
        }
        for (_, m) in self.mappings.range_mut(addr..addr + size) {
            m.accessible = true;
        }
        Ok(())
    }

    /// Checks that `[addr, addr+len)` may be read or written by the device: every
    /// byte mapped and accessible, or inside one plain allocation.
    pub fn check_accessible(&self, call: Call, addr: u64, len: u64) -> DeviceResult<()> {
        if len == 0 {
            return Ok(());
        }
        let end = addr.checked_add(len).ok_or_else(|| {
            DeviceError::rule(
                call,
                Rule::NotAccessible,
                format!("range at {addr:#x} overflows"),
            )
        })?;
        // The plain allocation with the greatest address <= addr, if it holds the range.
        let below = {
            let mut order = self.plain_order.borrow_mut();
            let order = order.get_or_insert_with(|| {
                let mut v: Vec<u64> = self.plain.keys().copied().collect();
                v.sort_unstable();
                v
            });
            order
                .partition_point(|&p| p <= addr)
                .checked_sub(1)
                .map(|i| order[i])
        };
        if let Some(p) = below {
            if end <= p + self.plain[&p].0 {
                return Ok(());
            }
        }
        let maps = self.mappings_in(addr, len);
        if Self::covered(addr, len, maps.clone()) && maps.clone().all(|m| m.2) {
            return Ok(());
        }
        Err(DeviceError::rule(
            call,
            Rule::NotAccessible,
            format!("[{addr:#x}, +{len:#x}) is not mapped and accessible"),
        ))
    }

    /// Whether every byte of the range is mapped and accessible (for allocator validation).
    pub fn is_accessible(&self, addr: u64, len: u64) -> bool {
        self.check_accessible(Call::CopyDtoH, addr, len).is_ok()
    }

    /// Charges a plain allocation; the backend then records it at an address
    /// with [`AddressSpace::record_plain`].
    pub fn check_plain(&self, size: u64) -> DeviceResult<u64> {
        Self::positive(Call::Alloc, size)?;
        let charged = round_up(size, PLAIN_ALLOC_UNIT);
        if charged > self.free_bytes() {
            return Err(self.oom(Call::Alloc, size));
        }
        Ok(charged)
    }

    /// Records a plain allocation at `addr`.
    pub fn record_plain(&mut self, addr: u64, size: u64) -> DeviceResult<()> {
        let charged = self.check_plain(size)?;
        self.plain.insert(addr, (size, charged));
        *self.plain_order.get_mut() = None;
        self.va_insert(addr, round_up(size, self.granularity));
        self.physical_used += charged;
        Ok(())
    }

    /// Finds an address for a plain allocation in the simulated VA window
    /// (plain allocations live in their own reservations there).
    pub fn find_plain_va(&self, size: u64) -> DeviceResult<u64> {
        let rounded = round_up(size.max(1), self.granularity);
        self.find_free_va(rounded, 0)
    }

    /// Size of a plain allocation.
    pub fn plain_size(&self, addr: u64) -> DeviceResult<u64> {
        self.plain.get(&addr).map(|p| p.0).ok_or_else(|| {
            DeviceError::rule(Call::Free, Rule::UnknownPointer, format!("{addr:#x}"))
        })
    }

    /// Removes a plain allocation (`cuMemFree`); returns its size.
    pub fn free_plain(&mut self, addr: u64) -> DeviceResult<u64> {
        let (size, charged) = self.plain.remove(&addr).ok_or_else(|| {
            DeviceError::rule(Call::Free, Rule::UnknownPointer, format!("{addr:#x}"))
        })?;
        *self.plain_order.get_mut() = None;
        self.va_remove(addr, round_up(size, self.granularity));
        self.physical_used -= charged;
        Ok(size)
    }

    /// Checks every invariant of the model; returns a description of the first broken one.
    pub fn check(&self) -> Result<(), String> {
        let mut prev_end = 0;
        for (&s, &l) in &self.reservations {
            if s < prev_end {
                return Err(format!("reservation {s:#x} overlaps the previous one"));
            }
            prev_end = s + l;
        }
        let mut prev_end = 0;
        let mut refs: HashMap<u64, u32> = HashMap::new();
        for (&s, m) in &self.mappings {
            if s < prev_end {
                return Err(format!("mapping {s:#x} overlaps the previous one"));
            }
            prev_end = s + m.size;
            match self.overlapping_reservation(s, m.size) {
                Some((rs, rl)) if rs <= s && s + m.size <= rs + rl => {}
                _ => return Err(format!("mapping {s:#x} is outside every reservation")),
            }
            *refs.entry(m.alloc).or_default() += 1;
        }
        for a in self.handles.values() {
            *refs.entry(*a).or_default() += 1;
        }
        let mut used = 0;
        let mut host = 0;
        for (id, a) in &self.allocations {
            if refs.get(id).copied().unwrap_or(0) != a.refs || a.refs == 0 {
                return Err(format!(
                    "allocation {id:#x} has refs {} but {} holders",
                    a.refs,
                    refs.get(id).copied().unwrap_or(0)
                ));
            }
            if a.foreign {
                // Charged to the producer.
            } else if a.on_host {
                host += a.size;
            } else {
                used += a.size;
            }
        }
        if host != self.host_used || host > self.host_capacity {
            return Err(format!(
                "host use {} != recount {host} (host capacity {})",
                self.host_used, self.host_capacity
            ));
        }
        used += self.plain.values().map(|p| p.1).sum::<u64>();
        if used != self.physical_used || used > self.capacity {
            return Err(format!(
                "physical use {} != recount {used} (capacity {})",
                self.physical_used, self.capacity
            ));
        }
        if let Some(gaps) = &self.gaps {
            gaps.check()?;
            let mut want = Vec::new();
            let mut cursor = VA_BASE;
            for (&s, &l) in &self.occupied() {
                if s < cursor || s + l > VA_END {
                    return Err(format!(
                        "occupied range {s:#x} overlaps another or leaves the VA window"
                    ));
                }
                if s > cursor {
                    want.push((cursor, s));
                }
                cursor = s + l;
            }
            if cursor < VA_END {
                want.push((cursor, VA_END));
            }
            if gaps.to_vec() != want {
                return Err("the free-VA index disagrees with the occupied ranges".into());
            }
        }
        Ok(())
    }
}

/// The free gaps of the simulated VA window (a treap; see the module).
mod gaps;
