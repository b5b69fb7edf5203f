//! Streams and events on the CPU models (`sim`, `host`).
//!
//! A stream is a queue of work items; each item may name the device range it
//! uses. Work stays pending until it is completed: by a synchronize (stream,
//! event or device), or explicitly by a test through [`StreamModel::complete`].
//! An event recorded on a stream completes when every item queued before the
//! record has completed. The address-space model asks [`StreamModel::pending_use`]
//! before an unmap, so an allocator that unmaps pages still used by queued work
//! is caught.
//!
//! # Stream capture
//!
//! [`StreamModel::begin_capture`] / [`StreamModel::end_capture`] model CUDA
//! graph capture (`cuStreamBeginCapture` / `cuStreamEndCapture`) so allocator
//! tests can check that nothing the real driver forbids during a capture is
//! called. The rules, from cuda.h and the CUDA Driver API reference
//! (`cuStreamBeginCapture_v2`, `cuThreadExchangeStreamCaptureMode`,
//! `cuStreamIsCapturing`, `cuEventQuery`):
//! - the legacy default stream cannot be captured
//!   (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, 900);
//! - synchronizing a capturing stream fails with 900 and invalidates its
//!   capture, and ending an invalidated capture fails with
//!   `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (901);
//! - "potentially unsafe" calls (device synchronize, `cuMemAlloc`/`cuMemFree`)
//!   fail with 900 while a capture in global mode is active on any thread, or
//!   in thread-local mode on the calling thread, and invalidate it;
//! - an event recorded on a capturing stream is a graph node, not real work:
//!   querying or synchronizing it fails with `CUDA_ERROR_CAPTURED_EVENT` (907)
//!   until it is recorded again outside a capture;
//! - ending a capture on a stream that is not capturing fails with
//!   `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED` (903).

use crate::model::IdMap;
use crate::Call;
use crate::{DeviceError, DeviceResult, Event, Rule, Stream};
use parking_lot::Mutex;
use std::collections::{HashSet, VecDeque};
use std::thread::ThreadId;

/// How a capture restricts "potentially unsafe" calls (`CUstreamCaptureMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`: prohibited on every thread (PyTorch's default).
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: prohibited on the capturing thread.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: not prohibited.
    Relaxed,
}

/// An active capture on a stream.
#[derive(Debug, Clone, Copy)]
struct Capture {
    mode: CaptureMode,
    thread: ThreadId,
    invalidated: bool,
}

#[derive(Debug, Default)]
struct StreamState {
    /// Sequence number of the last item submitted.
    submitted: u64,
    /// Items not yet completed: (sequence, addr, len). Invariant: sorted by sequence,
    /// every sequence > `completed`.
    pending: VecDeque<(u64, u64, u64)>,
    /// Every item with sequence <= completed has finished.
    completed: u64,
    /// The capture in progress, if any.
    capture: Option<Capture>,
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
    /// Number of streams with a capture in progress (0: the fast path).
    capturing: usize,
    /// Events whose last record was on a capturing stream.
    captured_events: HashSet<u64>,
    /// Extra (stream, sequence) targets of events recorded with
    /// [`StreamModel::record_joined`] (the legacy stream's implicit
    /// synchronization); empty in the common case.
    joins: IdMap<u64, Vec<(u64, u64)>>,
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

    /// Completes every item queued on `stream` (the GPU caught up). A
    /// capturing stream cannot be synchronized: `CaptureUnsupported`, and its
    /// capture is invalidated.
    pub fn complete(&self, stream: Stream) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        let s = Self::stream_mut(&mut g, Call::StreamSync, stream)?;
        if let Some(c) = &mut s.capture {
            c.invalidated = true;
            return Err(DeviceError::rule(
                Call::StreamSync,
                Rule::CaptureUnsupported,
                format!("{stream} is capturing (the capture is now invalidated)"),
            ));
        }
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
    /// On a capturing stream the record is a graph node: the event is
    /// "captured" until recorded again outside a capture.
    pub fn record(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        let s = Self::stream_mut(&mut g, Call::EventRecord, stream)?;
        let (seq, capturing) = (s.submitted, s.capture.is_some());
        match g.events.get_mut(&event.0) {
            Some(slot) => {
                if capturing {
                    g.captured_events.insert(event.0);
                } else {
                    *slot = Some((stream.0, seq));
                    if !g.captured_events.is_empty() {
                        g.captured_events.remove(&event.0);
                    }
                    if !g.joins.is_empty() {
                        g.joins.remove(&event.0);
                    }
                }
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
        let target = g
            .events
            .get(&event.0)
            .copied()
            .ok_or_else(|| DeviceError::rule(call, Rule::UnknownEvent, format!("{event:?}")))?;
        if !g.captured_events.is_empty() && g.captured_events.contains(&event.0) {
            return Err(DeviceError::rule(
                call,
                Rule::CapturedEvent,
                format!("{event:?} was last recorded in a capture"),
            ));
        }
        Ok(target)
    }

    /// Records `event` on `stream` joined with `others`: it completes once
    /// everything queued so far on all of them has (an operation on the
    /// legacy default stream waits for every blocking stream's earlier work:
    /// CUDA Driver API, "Stream synchronization behavior").
    pub fn record_joined(
        &self,
        event: Event,
        stream: Stream,
        others: &[Stream],
    ) -> DeviceResult<()> {
        self.record(event, stream)?;
        let mut g = self.inner.lock();
        if g.captured_events.contains(&event.0) {
            return Ok(());
        }
        let targets: Vec<(u64, u64)> = others
            .iter()
            .filter_map(|o| g.streams.get(&o.0).map(|s| (o.0, s.submitted)))
            .collect();
        if !targets.is_empty() {
            g.joins.insert(event.0, targets);
        }
        Ok(())
    }

    /// Whether the event has completed.
    pub fn query(&self, event: Event) -> DeviceResult<bool> {
        let g = self.inner.lock();
        let done =
            |stream: u64, seq: u64| g.streams.get(&stream).is_none_or(|s| s.completed >= seq);
        Ok(match Self::event_target(&g, Call::EventQuery, event)? {
            None => true,
            Some((stream, seq)) => {
                done(stream, seq)
                    && g.joins
                        .get(&event.0)
                        .is_none_or(|j| j.iter().all(|&(s, q)| done(s, q)))
            }
        })
    }

    /// Waits for the event: completes the work it depends on.
    pub fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        if let Some((stream, seq)) = Self::event_target(g, Call::EventSync, event)? {
            let catch_up = |streams: &mut IdMap<u64, StreamState>, stream: u64, seq: u64| {
                if let Some(s) = streams.get_mut(&stream) {
                    if s.completed < seq {
                        s.completed = seq;
                        while s.pending.front().is_some_and(|p| p.0 <= seq) {
                            s.pending.pop_front();
                        }
                    }
                }
            };
            catch_up(&mut g.streams, stream, seq);
            if let Some(j) = g.joins.get(&event.0) {
                for &(stream, seq) in j {
                    catch_up(&mut g.streams, stream, seq);
                }
            }
        }
        Ok(())
    }

    /// Destroys an event.
    pub fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        g.captured_events.remove(&event.0);
        g.joins.remove(&event.0);
        g.events.remove(&event.0).map(|_| ()).ok_or_else(|| {
            DeviceError::rule(Call::EventDestroy, Rule::UnknownEvent, format!("{event:?}"))
        })
    }

    /// Number of live (not destroyed) events.
    pub fn live_events(&self) -> usize {
        self.inner.lock().events.len()
    }

    // -- Stream capture -------------------------------------------------------

    /// `cuStreamBeginCapture`: starts capturing `stream` in `mode`. The legacy
    /// default stream cannot be captured, nor a stream already capturing
    /// (`CaptureUnsupported`, 900).
    pub fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        let s = Self::stream_mut(&mut g, Call::StreamSync, stream)?;
        if stream == Stream::DEFAULT {
            return Err(DeviceError::rule(
                Call::StreamSync,
                Rule::CaptureUnsupported,
                "the legacy default stream cannot be captured",
            ));
        }
        if s.capture.is_some() {
            return Err(DeviceError::rule(
                Call::StreamSync,
                Rule::CaptureUnsupported,
                format!("{stream} is already capturing"),
            ));
        }
        s.capture = Some(Capture {
            mode,
            thread: std::thread::current().id(),
            invalidated: false,
        });
        g.capturing += 1;
        Ok(())
    }

    /// `cuStreamEndCapture`: ends the capture on `stream`. `NotCapturing`
    /// (903) when none was begun; `CaptureInvalidated` (901) when a forbidden
    /// call invalidated it (the capture is over either way).
    pub fn end_capture(&self, stream: Stream) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        let s = Self::stream_mut(&mut g, Call::StreamSync, stream)?;
        let Some(c) = s.capture.take() else {
            return Err(DeviceError::rule(
                Call::StreamSync,
                Rule::NotCapturing,
                format!("{stream} is not capturing"),
            ));
        };
        g.capturing -= 1;
        if c.invalidated {
            return Err(DeviceError::rule(
                Call::StreamSync,
                Rule::CaptureInvalidated,
                format!("the capture on {stream} was invalidated by a forbidden call"),
            ));
        }
        Ok(())
    }

    /// `cuStreamIsCapturing`: whether `stream` is capturing (an invalidated
    /// capture still counts until it is ended).
    pub fn is_capturing(&self, stream: Stream) -> DeviceResult<bool> {
        let g = self.inner.lock();
        g.streams
            .get(&stream.0)
            .map(|s| s.capture.is_some())
            .ok_or_else(|| {
                DeviceError::rule(Call::StreamSync, Rule::UnknownStream, format!("{stream}"))
            })
    }

    /// Whether the capture state of `stream` is invalidated (false when it is
    /// not capturing).
    pub fn capture_invalidated(&self, stream: Stream) -> bool {
        self.inner
            .lock()
            .streams
            .get(&stream.0)
            .and_then(|s| s.capture)
            .is_some_and(|c| c.invalidated)
    }

    /// Fails `call`, a "potentially unsafe" call (device synchronize,
    /// `cuMemAlloc`, `cuMemFree`), with `CaptureUnsupported` when a capture
    /// forbids it for the calling thread (global mode on any thread,
    /// thread-local mode on this one), invalidating those captures.
    pub fn check_unsafe_call(&self, call: Call) -> DeviceResult<()> {
        let mut g = self.inner.lock();
        if g.capturing == 0 {
            return Ok(());
        }
        let me = std::thread::current().id();
        let mut hit = None;
        for (id, s) in g.streams.iter_mut() {
            if let Some(c) = &mut s.capture {
                let forbids = match c.mode {
                    CaptureMode::Global => true,
                    CaptureMode::ThreadLocal => c.thread == me,
                    CaptureMode::Relaxed => false,
                };
                if forbids {
                    c.invalidated = true;
                    hit.get_or_insert(*id);
                }
            }
        }
        match hit {
            None => Ok(()),
            Some(id) => Err(DeviceError::rule(
                call,
                Rule::CaptureUnsupported,
                format!(
                    "{} is capturing in a mode that forbids this call (the capture is now invalidated)",
                    Stream(id)
                ),
            )),
        }
    }
}
