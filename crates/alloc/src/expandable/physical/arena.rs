//! Address-space arenas: one large reservation cut into per-segment slices.
//! The physical layer reserves and frees them ([`Physical::take_slice`],
//! [`Physical::free_empty_arenas`]); the block layer asks for a slice per
//! segment and gives it back when the segment retires.
//!
//! Invariants: arenas do not overlap (the device chose them); `in_use` equals
//! the number of `true` entries in `used`; a slice is used by exactly one live
//! segment.

use super::observe::Owner;
use super::Physical;
use vmmalloc_device::{Device, DeviceError};

/// One `cuMemAddressReserve` of `slices_per_arena` slices.
#[derive(Debug)]
pub(crate) struct Arena {
    /// First byte.
    pub base: u64,
    /// Bytes reserved.
    pub size: u64,
    /// Which slices hold a segment.
    used: Vec<bool>,
    /// Number of used slices.
    in_use: usize,
}

/// Every arena of one allocator.
#[derive(Debug, Default)]
pub(crate) struct Arenas {
    /// Arenas in reservation order.
    pub list: Vec<Arena>,
}

impl Physical {
    /// A free slice of `slice` bytes: from an existing arena, else from a new
    /// reservation of `slices × slice` bytes. A failed reserve changes nothing.
    pub fn take_slice<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        slice: u64,
        slices: u64,
    ) -> Result<u64, DeviceError> {
        for a in &mut self.arenas.list {
            if let Some(i) = a.used.iter().position(|u| !u) {
                a.used[i] = true;
                a.in_use += 1;
                return Ok(a.base + i as u64 * slice);
            }
        }
        let size = slice * slices;
        let base = self.raw_reserve(dev, Owner::Arena, size, 0)?;
        let mut used = vec![false; slices as usize];
        used[0] = true;
        self.arenas.list.push(Arena {
            base,
            size,
            used,
            in_use: 1,
        });
        Ok(base)
    }

    /// Marks the slice at `addr` free again.
    pub fn give_back_slice(&mut self, addr: u64, slice: u64) {
        self.arenas.give_back(addr, slice);
    }

    /// The arenas (to validate).
    pub fn arenas(&self) -> &Arenas {
        &self.arenas
    }

    /// Frees every arena without a used slice (`cuMemAddressFree`). An arena
    /// whose free fails stays listed; the first error is returned.
    pub fn free_empty_arenas<D: Device + ?Sized>(&mut self, dev: &D) -> Result<(), DeviceError> {
        let mut first_err = None;
        let mut kept = Vec::with_capacity(self.arenas.list.len());
        for a in std::mem::take(&mut self.arenas.list) {
            if a.in_use == 0 {
                match self.raw_free_reservation(dev, Owner::Arena, a.base, a.size) {
                    Ok(()) => continue,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            kept.push(a);
        }
        self.arenas.list = kept;
        first_err.map_or(Ok(()), Err)
    }
}

impl Arenas {
    /// Marks the slice at `addr` free again.
    fn give_back(&mut self, addr: u64, slice: u64) {
        for a in &mut self.list {
            if addr >= a.base && addr < a.base + a.size {
                let i = ((addr - a.base) / slice) as usize;
                if a.used[i] {
                    a.used[i] = false;
                    a.in_use -= 1;
                }
                return;
            }
        }
    }

    /// Recounts the invariants; `segments` are the bases of live segments.
    pub fn check(&self, segments: &[u64], slice: u64) -> Result<(), String> {
        let mut used_total = 0;
        for a in &self.list {
            let n = a.used.iter().filter(|u| **u).count();
            if n != a.in_use {
                return Err(format!(
                    "arena {:#x}: in_use {} but {n} slices marked",
                    a.base, a.in_use
                ));
            }
            used_total += n;
            for (i, &u) in a.used.iter().enumerate() {
                let addr = a.base + i as u64 * slice;
                if u != segments.contains(&addr) {
                    return Err(format!(
                        "arena slice {addr:#x}: marked {u} but segment presence disagrees"
                    ));
                }
            }
        }
        if used_total != segments.len() {
            return Err(format!(
                "{} used slices but {} segments",
                used_total,
                segments.len()
            ));
        }
        Ok(())
    }
}
