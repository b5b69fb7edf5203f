//! Pausing a private pool, over the one pause mechanism (`../pause.rs`).
//!
//! [`Inner::pause_pool`] synchronizes the device (a kernel in flight must
//! not fault), copies the live blocks to host memory when asked, unmaps
//! every page the pool maps and releases the handles; every segment and
//! block stays (the addresses are the graph's). [`Inner::resume_pool`] maps
//! the same pages again (access for every device the allocator grants), and
//! copies the backups back; on failure it unmaps what it mapped and the
//! pool stays paused. The pool's segments are unpinned while it is paused
//! (nothing is mapped to pin) and pinned again as the pool is on resume.

use super::super::pause::{mapped_runs, MappedBack, Owner, Paused, Wait};
use super::super::Inner;
use super::err;
use crate::pools::{pool_name, PoolId};
use crate::AllocResult;
use vmmalloc_device::Device;

impl Inner {
    /// Pauses pool `id` (see the module docs); returns the bytes released.
    pub(in crate::expandable) fn pause_pool<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
        keep: bool,
    ) -> AllocResult<u64> {
        let p = self.pool_number(id)?;
        let name = pool_name(id);
        let x = self.pool_ref(p);
        if x.paused.is_some() {
            return Err(err(format!(
                "pause of pool {name}: it is paused already (nothing changed)"
            )));
        }
        if x.recording || self.pools.captures > 0 {
            return Err(err(format!(
                "pause of pool {name}: a CUDA graph capture is underway; synchronize, unmap and \
                 release are illegal during capture (nothing changed)"
            )));
        }
        let owner = Owner::Pool(&name);
        let segs = self.pool_segments(p);
        self.quiesce(dev, &segs, Wait::Device)?;
        let mut saved = Paused::default();
        if keep {
            for &s in &segs {
                self.back_up(dev, s, &mut saved, owner)?;
            }
        }
        saved.runs = mapped_runs(&self.phys, &segs);
        let runs = saved.runs.clone();
        // Commit: from here on the pool is paused.
        self.pool_mut(p).paused = Some(saved);
        for s in &segs {
            self.phys.set_pinned(*s, false);
        }
        let given = self.give_back(dev, &runs);
        match given.err {
            None => Ok(given.bytes),
            Some(e) => Err(owner.paused_but(
                given.bytes,
                &format!("some memory stayed mapped or pooled: {e}"),
            )),
        }
    }

    /// Resumes pool `id` (see the module docs); returns the bytes mapped.
    pub(in crate::expandable) fn resume_pool<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
    ) -> AllocResult<u64> {
        let p = self.pool_number(id)?;
        let name = pool_name(id);
        let Some(paused) = self.pool_ref(p).paused.as_ref() else {
            return Err(err(format!(
                "resume of pool {name}: it is not paused (nothing changed)"
            )));
        };
        let runs = paused.runs.clone();
        self.check_no_capture(dev, "resume", &[])?;
        let owner = Owner::Pool(&name);
        let mut mapped = MappedBack::default();
        let mut fail = None;
        for (s, rs) in &runs {
            // Pages left mapped by a failed pause need nothing.
            let todo: Vec<(u64, u64)> = rs
                .iter()
                .flat_map(|&(f, n)| self.table(*s).unmapped_runs(f, f + n))
                .collect();
            if todo.is_empty() {
                continue;
            }
            // Pinned while mapping: nothing reclaims the pool's own pages.
            self.phys.set_pinned(*s, true);
            if let Err(e) = self.map_back(dev, &mut mapped, *s, todo, owner) {
                fail = Some(e);
                break;
            }
        }
        if fail.is_none() {
            // The pool's fields and the physical layer's, borrowed apart.
            let paused = match self.pools.get(p) {
                Some(x) => x.paused.as_ref(),
                None => unreachable!("pool {p} is gone but still referenced"),
            };
            if let Some(Err(e)) = paused.map(|x| x.copy_back(&mut self.phys, dev)) {
                fail = Some(e.into());
            }
        }
        if let Some(e) = fail {
            self.undo_map_back(dev, &mapped);
            for (s, _) in &runs {
                self.phys.set_pinned(*s, false);
            }
            return Err(e);
        }
        let pinned = self.pool_ref(p).pinned;
        self.pool_mut(p).paused = None;
        self.set_pool_pinned(p, pinned);
        Ok(mapped.bytes)
    }
}
