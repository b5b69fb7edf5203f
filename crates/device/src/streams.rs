//! Streams and events on the CPU models (`sim`, `host`).
//!
//! A stream is a queue of work items; each item may name the device range it
//! uses. Work stays pending until it is completed: by a synchronize (stream,
//! event or device), or explicitly by a test through [`StreamModel::complete`].
//! An event recorded on a stream completes when every item queued before the
//! record has completed. The address-space model asks [`StreamModel::pending_use`]
//! before an unmap, so an allocator that unmaps pages still used by queued work
//! is caught.

use crate::model::IdMap;
use crate::Call;
use crate::{DeviceError, DeviceResult, Event, Rule, Stream};
use parking_lot::Mutex;
use std::collections::VecDeque;

#[derive(Debug, Default)]
struct StreamState {
    /// Sequence number of the last item submitted.
    submitted: u64,
    /// Items not yet completed: (sequence, addr, len). Invariant: sorted by sequence,
    /// every sequence > `completed`.
    pending: VecDeque<(u64, u64, u64)>,
    /// Every item with sequence <= completed has finished.
    completed: u64,
}

#[derive(Debug, Default)]
struct Inner {
    streams: IdMap<u64, StreamState>,
    next_stream: u64,
    /// event id -> (stream, sequence) of its last record, or None if never recorded.
    events: IdMap<u64, Option<(u64, u64)>>,
    next_event: u64,
    /// Whether work may be outstanding on some stream (false: every stream has
    /// completed everything submitted, so a device-wide completion is a no-op).
    busy: bool,
}

/// Streams, work items and events of a CPU model device.
#[derive(Debug)]
pub struct StreamModel {
    inner: Mutex<Inner>,
}

impl Default for StreamModel {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamModel {
    /// A model with only the default stream.
    pub fn new() -> Self {
        let mut inner = Inner {
            next_stream: 0x1000,
            next_event: 0x1,
            ..Inner::default()
        };
        inner.streams.insert(0, StreamState::default());
        StreamModel {
            inner: Mutex::new(inner),
        }
    }

    /// Creates a stream.
    pub fn create_stream(&self) -> Stream {
        let mut g = self.inner.lock();
        let id = g.next_stream;
        g.next_stream += 0x10;
        g.streams.insert(id, StreamState::default());
        Stream(id)
    }

    /// Whether the stream exists.
    pub fn has_stream(&self, stream: Stream) -> bool {
        self.inner.lock().streams.contains_key(&stream.0)
    }

    fn stream_mut(g: &mut Inner, call: Call, stream: Stream) -> DeviceResult<&mut StreamState> {
        g.streams
            .get_mut(&stream.0)
            .ok_or_else(|| DeviceError::rule(call, Rule::UnknownStream, format!("{stream}")))
    }

    /// Queues a work item on `stream` that uses `[addr, addr+len)` (len 0: no memory),
    /// as a kernel launch would. Returns its sequence number.
    pub fn submit(&self, stream: Stream, addr: u64, len: u64) -> DeviceResult<u64> {
        let mut g = self.inner.lock();
        let s = Self::stream_mut(&mut g, Call::EventRecord, stream)?;
        s.submitted += 1;
        let seq = s.submitted;
        s.pending.push_back((seq, addr, len));
        g.busy = true;
        Ok(seq)
    }

    /// Completes every item queued on `stream` (the GPU caught up).
    pub fn complete(&self, stream: Stream) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        let s = Self::stream_mut(&mut g, Call::StreamSync, stream)?;
        s.completed = s.submitted;
        s.pending.clear();
        Ok(())
    }

    /// Completes every stream's work (device-wide synchronize).
    pub fn complete_all(&self) {
        let mut g = self.inner.lock();
        if !g.busy {
            return;
        }
        for s in g.streams.values_mut() {
            s.completed = s.submitted;
            s.pending.clear();
        }
        g.busy = false;
    }

    /// Number of items still pending on `stream`.
    pub fn pending_items(&self, stream: Stream) -> usize {
        self.inner
            .lock()
            .streams
            .get(&stream.0)
            .map_or(0, |s| s.pending.len())
    }

    /// A stream with pending work that uses any byte of `[addr, addr+len)`, if one exists.
    pub fn pending_use(&self, addr: u64, len: u64) -> Option<Stream> {
        let g = self.inner.lock();
        if !g.busy {
            return None;
        }
        let end = addr.saturating_add(len);
        for (id, s) in &g.streams {
            if s.pending
                .iter()
                .any(|&(_, a, l)| l > 0 && a < end && addr < a.saturating_add(l))
            {
                return Some(Stream(*id));
            }
        }
        None
    }

    /// Creates an event (never recorded: queries as complete).
    pub fn create_event(&self) -> Event {
        let mut g = self.inner.lock();
        let id = g.next_event;
        g.next_event += 1;
        g.events.insert(id, None);
        Event(id)
    }

    /// Records `event` on `stream`: it completes once everything queued so far has.
    pub fn record(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        let seq = Self::stream_mut(&mut g, Call::EventRecord, stream)?.submitted;
        match g.events.get_mut(&event.0) {
            Some(slot) => {
                *slot = Some((stream.0, seq));
                Ok(())
            }
            None => Err(DeviceError::rule(
                Call::EventRecord,
                Rule::UnknownEvent,
                format!("{event:?}"),
            )),
        }
    }

    fn event_target(g: &Inner, call: Call, event: Event) -> DeviceResult<Option<(u64, u64)>> {
        g.events
            .get(&event.0)
            .copied()
            .ok_or_else(|| DeviceError::rule(call, Rule::UnknownEvent, format!("{event:?}")))
    }

    /// Whether the event has completed.
    pub fn query(&self, event: Event) -> DeviceResult<bool> {
        let g = self.inner.lock();
        Ok(match Self::event_target(&g, Call::EventQuery, event)? {
            None => true,
            Some((stream, seq)) => g.streams.get(&stream).is_none_or(|s| s.completed >= seq),
        })
    }

    /// Waits for the event: completes the work it depends on.
    pub fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        if let Some((stream, seq)) = Self::event_target(&g, Call::EventSync, event)? {
            if let Some(s) = g.streams.get_mut(&stream) {
                if s.completed < seq {
                    s.completed = seq;
                    while s.pending.front().is_some_and(|p| p.0 <= seq) {
                        s.pending.pop_front();
                    }
                }
            }
        }
        Ok(())
    }

    /// Destroys an event.
    pub fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        g.events.remove(&event.0).map(|_| ()).ok_or_else(|| {
            DeviceError::rule(Call::EventDestroy, Rule::UnknownEvent, format!("{event:?}"))
        })
    }

    /// Number of live (not destroyed) events.
    pub fn live_events(&self) -> usize {
        self.inner.lock().events.len()
    }
}
