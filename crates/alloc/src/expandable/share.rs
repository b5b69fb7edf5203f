//! The shared budget plugged into the physical layer (issue 33, part 2;
//! docs/share.md): [`SharedBudget`] implements the layer's `Budget` over a
//! [`Member`] of a group, and [`AllocatorGiveBack`] is what the member's
//! poller calls when the allocator holds more than its cap.
//!
//! The budget's limit is the smallest of the local one (the memory
//! fraction) and the member's view of the group (its cap, and what the
//! other members leave of the total), so the block layer plans within it
//! as it plans within a memory fraction: above a lowered cap it serves
//! requests by reclaiming its own free pages and creates nothing new.

use super::physical::budget::{Budget, Charge, LocalBudget};
use super::{ExpandableAllocator, Inner};
use crate::pressure::PressureFn;
use crate::share::{GiveBack, Member};
use crate::{AllocError, AllocResult, Allocator};
use std::sync::{Arc, Weak};
use vmmalloc_device::{Call, Device, DeviceError};

/// The physical layer's budget when the allocator is a member of a group.
#[derive(Debug)]
pub(crate) struct SharedBudget {
    /// The memory fraction's limit, and the pages charged.
    local: LocalBudget,
    /// The membership charged before every create.
    member: Arc<Member>,
    /// Bytes of one page.
    page: u64,
    /// Pages credited and kept for replacements while a swap runs
    /// ([`Budget::begin_keep`]); `None` outside one.
    kept: Option<u64>,
}

impl Budget for SharedBudget {
    fn limit_pages(&self) -> u64 {
        self.local
            .limit_pages()
            .min(self.member.limit() / self.page)
    }

    fn fraction(&self) -> f64 {
        self.local.fraction()
    }

    fn set_fraction(&mut self, fraction: f64, limit_pages: u64) {
        self.local.set_fraction(fraction, limit_pages)
    }

    fn room(&self, held: u64) -> u64 {
        self.limit_pages().saturating_sub(held)
    }

    fn fits(&self, held: u64) -> bool {
        held <= self.limit_pages()
    }

    fn charge(&mut self, pages: u64, page: u64, kind: Charge) -> Result<(), DeviceError> {
        self.local.charge(pages, page, kind)?;
        let mut pages_to_charge = pages;
        if let (Charge::Replace, Some(kept)) = (kind, self.kept.as_mut()) {
            let take = (*kept).min(pages);
            *kept -= take;
            pages_to_charge -= take;
            if pages_to_charge == 0 {
                return Ok(());
            }
        }
        if let Err(r) = self
            .member
            .charge(pages_to_charge * page, kind == Charge::Grow)
        {
            self.local.credit(pages);
            return Err(DeviceError::OutOfMemory {
                call: Call::Create,
                requested: pages * page,
                free: r.info.total.saturating_sub(r.info.used),
                total: r.info.total,
            });
        }
        Ok(())
    }

    fn credit(&mut self, pages: u64) {
        self.local.credit(pages);
        match self.kept.as_mut() {
            Some(kept) => *kept += pages,
            None => self.member.credit(pages * self.page),
        }
    }

    fn begin_keep(&mut self) {
        self.kept.get_or_insert(0);
    }

    fn end_keep(&mut self) {
        if let Some(kept) = self.kept.take() {
            if kept > 0 {
                self.member.credit(kept * self.page);
            }
        }
    }

    fn charged(&self) -> u64 {
        self.local.charged()
    }

    fn explain(&self) -> Option<String> {
        Some(self.member.explain())
    }

    fn recheck(&mut self) -> bool {
        // The plan may have used a view up to `VIEW_FRESH` old (1 ms,
        // `share/mod.rs`): another member may have given back since. The
        // reap reads the file again whether or not anyone died, so the
        // limit is worth another plan when it grew (or dead members' bytes
        // came back). An error is the member's to log (once per change,
        // `share/member.rs`).
        let before = self.member.limit_as_read();
        let reaped = self.member.reap_dead().is_ok_and(|n| n > 0);
        reaped || self.member.limit_as_read() > before
    }
}

impl<D: Device> ExpandableAllocator<D> {
    /// Makes `member`'s group this allocator's budget: from now on every
    /// create is charged to the group first. Must come before the first
    /// allocation ([`AllocError::InvalidOption`] once memory is held).
    pub fn join_share(&self, member: Arc<Member>) -> AllocResult<()> {
        self.call("join_share", |i, _| {
            if i.phys.held_pages() > 0 {
                return Err(AllocError::InvalidOption(format!(
                    "share:{}: join a shared budget before the first allocation ({} bytes held)",
                    member.name(),
                    i.phys.held_pages() * i.layout.page
                )));
            }
            let local = LocalBudget::new(i.phys.fraction(), i.phys.limit_pages());
            let page = i.layout.page;
            i.phys.set_budget(Box::new(SharedBudget {
                local,
                member,
                page,
                kept: None,
            }));
            Ok(())
        })
    }

    /// Bytes held above the budget's limit (a lowered cap), 0 within it.
    pub fn over_budget(&self) -> u64 {
        self.read("over_budget", |i| {
            let held = i.phys.held_pages();
            held.saturating_sub(i.phys.limit_pages()) * i.layout.page
        })
    }

    /// Gives back cached memory while the allocator holds more than its
    /// budget: pooled chunks first (largest first), then, if still above,
    /// every cached page (`empty_cache`), then, if still above, the free
    /// pages of chunks that live blocks hold in part (unpinning: their live
    /// pages move to chunks of their own at the same addresses), as the
    /// `unpin` option allows it for the calling thread. The poller is a
    /// thread of its own: under `unpin:auto` it never moves live pages
    /// while another thread may be launching work on them (`threads.rs`),
    /// so those pages stay until they are freed or an allocation of the
    /// member's own thread unpins them; under `unpin:always` it moves them.
    /// Live tensors are never freed. Returns the bytes given back.
    pub fn give_back_over_budget(&self) -> AllocResult<u64> {
        self.call("give_back_over_budget", |i, d| {
            let before = i.phys.held_pages();
            let release = |i: &mut Inner| -> AllocResult<()> {
                while i.phys.over_limit(i.mapped_pages(), 0) {
                    if i.phys.release_largest(d)? == 0 {
                        break;
                    }
                }
                Ok(())
            };
            release(i)?;
            if i.phys.over_limit(i.mapped_pages(), 0) {
                i.empty_cache(d)?;
            }
            if i.phys.over_limit(i.mapped_pages(), 0)
                && i.unpin != super::UnpinMode::Never
                && i.unpin_refusal().is_none()
            {
                let want = i.phys.held_pages().saturating_sub(i.phys.limit_pages());
                if i.unpin(d, want, None) > 0 {
                    release(i)?;
                }
            }
            Ok(before.saturating_sub(i.phys.held_pages()) * i.layout.page)
        })
    }
}

/// What a member's poller runs when its allocator is above its cap, in
/// order (issue 33): give back cached pages at once; if still above, the
/// pressure callback (a serving engine drops KV blocks, then the freed
/// pages go back); if still above and opted in, pause (sleep) the tagged
/// memory named in `sleep_tags`. Nothing live is revoked otherwise: the
/// member stays "deferred" until its tensors are freed.
pub struct AllocatorGiveBack<D: Device> {
    /// The allocator (weak: the poller must not keep it alive).
    pub alloc: Weak<ExpandableAllocator<D>>,
    /// The pressure callback, `(bytes wanted, device) -> bytes freed`.
    pub pressure: Option<Arc<PressureFn>>,
    /// Tags to pause when nothing else gives back enough (opt-in).
    pub sleep_tags: Vec<String>,
    /// Whether pausing keeps a host copy of the tags' live bytes.
    pub sleep_backup: bool,
}

impl<D: Device> GiveBack for AllocatorGiveBack<D> {
    fn give_back(&self, _excess: u64) -> u64 {
        let Some(a) = self.alloc.upgrade() else {
            return 0;
        };
        let log = |what: &str, e: AllocError| eprintln!("vmmalloc: share: {what}: {e}");
        let mut freed = a.give_back_over_budget().unwrap_or_else(|e| {
            log("giving back cached memory", e);
            0
        });
        let over = a.over_budget();
        if over > 0 {
            if let Some(cb) = &self.pressure {
                let ordinal = a.device().caps().ordinal as i32;
                if cb(over, ordinal) > 0 {
                    freed += a.give_back_over_budget().unwrap_or(0);
                }
            }
        }
        if a.over_budget() > 0 && !self.sleep_tags.is_empty() {
            match crate::Sleep::pause(&*a, &self.sleep_tags, self.sleep_backup) {
                Ok(b) => freed += b,
                Err(e) => log("pausing the opted-in tags", e),
            }
        }
        freed
    }

    fn cached(&self) -> u64 {
        let Some(a) = self.alloc.upgrade() else {
            return 0;
        };
        let s = a.stats();
        let reserved = s.reserved_bytes.0[0].current.max(0) as u64;
        let allocated = s.allocated_bytes.0[0].current.max(0) as u64;
        reserved.saturating_sub(allocated) + s.pages_pooled * a.page_size()
    }
}

/// Joins `member` to `alloc` ([`ExpandableAllocator::join_share`]) and
/// starts its poller ([`Member::serve`]) with `give_back`.
pub fn join_and_serve<D: Device + 'static>(
    alloc: &Arc<ExpandableAllocator<D>>,
    member: &Arc<Member>,
    give_back: AllocatorGiveBack<D>,
) -> AllocResult<()> {
    alloc.join_share(Arc::clone(member))?;
    member
        .serve(Arc::new(give_back))
        .map_err(|e| AllocError::InvalidOption(format!("share: cannot start the poller: {e}")))
}

/// Builds the expandable policy over `device` as a member of `member`'s
/// group (`VMMALLOC_CONF=share:NAME`): the allocator is made, joined
/// ([`ExpandableAllocator::join_share`]) and its poller started with an
/// [`AllocatorGiveBack`] whose pressure step calls `pressure` (read at each
/// give-back, so a callback set later is used). Returns the allocator and
/// the same allocator as the policy object the rest of the code uses.
pub fn build_shared(
    device: Arc<dyn Device>,
    config: super::ExpandableConfig,
    member: &Arc<Member>,
    pressure: Option<Arc<PressureFn>>,
) -> AllocResult<Arc<ExpandableAllocator<Arc<dyn Device>>>> {
    let alloc = Arc::new(ExpandableAllocator::new(device, config)?);
    let give_back = AllocatorGiveBack {
        alloc: Arc::downgrade(&alloc),
        pressure,
        sleep_tags: Vec::new(),
        sleep_backup: false,
    };
    join_and_serve(&alloc, member, give_back)?;
    Ok(alloc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::{JoinOptions, DEFAULT_POLL, NO_CAP};

    const PAGE: u64 = 2 << 20;

    /// Unpinning in place releases a chunk and creates its replacements:
    /// while the budget keeps the credit, the group never sees the bytes
    /// free, so no other member can take them in between.
    /// A group of 64 pages in a private folder named after `name`: this
    /// member's budget (its fraction allows all 64) and another member.
    fn group_of_two(name: &str) -> (std::path::PathBuf, SharedBudget, Arc<Member>, Arc<Member>) {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("vmmalloc-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        let p = d.join(name);
        let _ = std::fs::remove_file(&p);
        let opts = JoinOptions {
            total: 64 * PAGE,
            cap: NO_CAP,
            poll: DEFAULT_POLL,
        };
        let member = Member::join_path("g", &p, opts.clone()).unwrap();
        let other = Member::join_path("g", &p, opts).unwrap();
        let b = SharedBudget {
            local: LocalBudget::new(1.0, 64),
            member: Arc::clone(&member),
            page: PAGE,
            kept: None,
        };
        (d, b, member, other)
    }

    #[test]
    fn a_kept_credit_is_never_free_for_the_group_until_the_swap_ends() {
        let (d, mut b, member, other) = group_of_two("keep");
        b.charge(10, PAGE, Charge::Grow).unwrap();
        other.charge(54 * PAGE, true).unwrap();
        b.begin_keep();
        b.credit(10); // the old chunk's release
        assert_eq!(member.used(), 10 * PAGE, "kept, not given back");
        assert!(other.charge(PAGE, true).is_err(), "nothing free meanwhile");
        b.charge(3, PAGE, Charge::Replace).unwrap();
        b.charge(4, PAGE, Charge::Replace).unwrap();
        assert_eq!(member.used(), 10 * PAGE);
        b.end_keep();
        assert_eq!(member.used(), 7 * PAGE, "what was not taken goes back");
        assert_eq!(b.charged(), 7);
        other.charge(3 * PAGE, true).unwrap();
        // Without a keep, a replacement is charged (never refused).
        b.charge(1, PAGE, Charge::Replace).unwrap();
        assert_eq!(member.used(), 8 * PAGE);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A view read less than 1 ms ago is used as it is; when another
    /// member gave back in between, the check made before an out-of-memory
    /// reads the group again and asks for another plan (the race behind a
    /// CI failure of share_procs: P1 gave back, P2's view was still fresh).
    #[test]
    fn a_give_back_within_the_fresh_view_is_seen_by_the_recheck() {
        let (d, mut b, member, other) = group_of_two("recheck");
        other.charge(64 * PAGE, true).unwrap();
        member.refresh().unwrap();
        assert_eq!(member.limit_as_read(), 0);
        other.credit(32 * PAGE);
        assert_eq!(member.limit_as_read(), 0, "the view is as last read");
        assert!(b.recheck(), "the limit grew: plan again");
        assert_eq!(b.limit_pages(), 32);
        assert!(!b.recheck(), "nothing changed since");
        b.charge(32, PAGE, Charge::Grow).unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }
}
