//! Stream safety for blocks used on several streams (`record_stream`).
//!
//! At `free`, one event is recorded on each extra stream; the block stays
//! pending until all of them completed (polled with `query_event` at the next
//! `malloc`, as PyTorch's `process_events`), then it becomes free on its own
//! stream. Events are pooled: created once, reused, destroyed on drop.
//! A block never used on another stream costs no device call at all.

use super::blocks::BlockState;
use super::Inner;
use crate::AllocResult;
use vmmalloc_device::{Device, DeviceResult, Event};

/// An event a pending-free block waits for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pending {
    /// The event recorded at free.
    pub event: Event,
    /// The block.
    pub block: u32,
}

/// The event pool and the blocks waiting for events.
#[derive(Debug, Default)]
pub(crate) struct Events {
    /// Created events not in use.
    pub free: Vec<Event>,
    /// Recorded events and their blocks.
    pub pending: Vec<Pending>,
}

impl Inner {
    /// An event from the pool, or a new one.
    fn get_event<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<Event> {
        if let Some(e) = self.events.free.pop() {
            return Ok(e);
        }
        self.phys.create_event(dev)
    }

    /// Records an event on every extra stream of block `idx` (being freed).
    /// A stream whose event cannot be recorded is synchronized instead.
    /// Returns the number of events recorded; on error nothing changed.
    pub(super) fn record_free_events<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        idx: u32,
    ) -> AllocResult<u32> {
        let Some(streams) = self.slab[idx].streams.take() else {
            return Ok(0);
        };
        let mut recorded: Vec<Event> = Vec::with_capacity(streams.len());
        for &s in streams.iter() {
            let ok = match self.get_event(dev) {
                Ok(ev) => match self.phys.record_event(dev, ev, s) {
                    Ok(()) => {
                        recorded.push(ev);
                        true
                    }
                    Err(_) => {
                        self.events.free.push(ev);
                        false
                    }
                },
                Err(_) => false,
            };
            if !ok {
                // Another route to safety: wait for the stream now.
                if let Err(e) = self.phys.sync_stream(dev, s) {
                    // Roll back: the block stays allocated with its streams.
                    self.events.free.extend(recorded);
                    self.slab[idx].streams = Some(streams);
                    return Err(e.into());
                }
                self.stats.num_stream_syncs += 1;
            }
        }
        let n = recorded.len() as u32;
        for event in recorded {
            self.events.pending.push(Pending { event, block: idx });
        }
        self.slab[idx].pending_events = n;
        Ok(n)
    }

    /// One of block's events completed; the block becomes free after its last.
    pub(super) fn event_done(&mut self, i: usize) {
        let p = self.events.pending.swap_remove(i);
        self.events.free.push(p.event);
        let b = &mut self.slab[p.block];
        b.pending_events -= 1;
        if b.pending_events == 0 && b.state == BlockState::PendingFree {
            self.free_block(p.block);
        }
    }

    /// Polls pending events; frees the blocks whose events all completed.
    pub(super) fn process_events<D: Device + ?Sized>(&mut self, dev: &D) {
        let mut i = 0;
        while i < self.events.pending.len() {
            let ev = self.events.pending[i].event;
            match self.phys.query_event(dev, ev) {
                Ok(true) => self.event_done(i),
                _ => i += 1,
            }
        }
    }

    /// Waits for every pending event (event syncs, not a device sync).
    pub(super) fn sync_pending<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<()> {
        let mut first_err = None;
        let mut i = 0;
        while i < self.events.pending.len() {
            let ev = self.events.pending[i].event;
            match self.phys.sync_event(dev, ev) {
                Ok(()) => {
                    self.stats.num_stream_syncs += 1;
                    self.event_done(i);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                    i += 1;
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// `cuCtxSynchronize`, counted; every stream counts as waited for.
    pub(super) fn synchronize_device<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<()> {
        self.phys.sync_device(dev)?;
        self.stats.num_sync_all_streams += 1;
        let tick = self.tick;
        for e in &mut self.streams {
            e.synced_at = tick;
        }
        Ok(())
    }
}
