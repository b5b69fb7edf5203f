//! What this device handed out (handles, events, streams; reserved and
//! allocated ranges), so a stale or foreign value never reaches the driver
//! (see the parent module's "Soundness of a safe API over raw handles").

use super::*;

/// A driver object in a [`Registry`].
#[derive(Debug)]
pub(super) struct Tracked {
    /// How many times the driver handed this value to us (an import may return
    /// a handle we already hold); each needs one release.
    pub(super) refs: u32,
    /// Cloned by every call that passes the value to the driver, for the
    /// duration of the call; destruction waits until this is the only copy.
    pub(super) in_use: Arc<()>,
}

/// Live handles (or events) made by this device, so a stale or foreign value
/// never reaches the driver and nothing is destroyed while in use.
#[derive(Debug, Default)]
pub(super) struct Registry {
    pub(super) live: HashMap<u64, Tracked>,
}

/// A value taken out of a [`Registry`] for destruction.
pub(super) struct Taken {
    /// Whether this was the last reference (the entry is gone).
    pub(super) last: bool,
    pub(super) in_use: Arc<()>,
}

impl Registry {
    pub(super) fn insert(&mut self, key: u64) {
        self.live
            .entry(key)
            .and_modify(|t| t.refs += 1)
            .or_insert_with(|| Tracked {
                refs: 1,
                in_use: Arc::new(()),
            });
    }

    /// A token held while the value is passed to the driver.
    pub(super) fn acquire(&self, key: u64) -> Option<Arc<()>> {
        self.live.get(&key).map(|t| Arc::clone(&t.in_use))
    }

    /// Takes one reference for destruction.
    pub(super) fn take(&mut self, key: u64) -> Option<Taken> {
        let t = self.live.get_mut(&key)?;
        if t.refs > 1 {
            t.refs -= 1;
            return Some(Taken {
                last: false,
                in_use: Arc::clone(&t.in_use),
            });
        }
        let t = self.live.remove(&key)?;
        Some(Taken {
            last: true,
            in_use: t.in_use,
        })
    }

    /// Puts back a reference whose destruction failed.
    pub(super) fn restore(&mut self, key: u64, taken: Taken) {
        match self.live.get_mut(&key) {
            Some(t) => t.refs += 1,
            None => {
                self.live.insert(
                    key,
                    Tracked {
                        refs: 1,
                        in_use: taken.in_use,
                    },
                );
            }
        }
    }
}

impl Taken {
    /// Waits until no other thread is inside a driver call with the value
    /// (only when this was the last reference; calls hold the token briefly).
    pub(super) fn wait_unused(&self) {
        if self.last {
            while Arc::strong_count(&self.in_use) > 1 {
                std::thread::yield_now();
            }
        }
    }
}

/// Virtual ranges this device reserved or allocated: `start -> len`.
#[derive(Debug, Default)]
pub(super) struct Ranges {
    pub(super) reservations: BTreeMap<u64, u64>,
    pub(super) allocs: BTreeMap<u64, u64>,
}

impl Ranges {
    /// Whether `[addr, addr+len)` lies inside one reservation or allocation.
    pub(super) fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let inside = |m: &BTreeMap<u64, u64>| {
            m.range(..=addr)
                .next_back()
                .is_some_and(|(&start, &size)| addr < start + size && end <= start + size)
        };
        inside(&self.reservations) || inside(&self.allocs)
    }
}
