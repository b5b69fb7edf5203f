//! Which host threads call the allocator, on which streams, and whether
//! their calls ever run alongside each other: what the default unpinning
//! rule (`unpin:auto`, docs/expandable.md, "Unpinning and threads") decides
//! from.
//!
//! Unpinning moves live pages during an allocating call. A thread that
//! launches work writing a live tensor at that moment loses the write. The
//! allocator cannot see kernel launches; it sees its own calls: which
//! thread makes them, on which stream, and whether one thread's call found
//! the lock held by another's. From those it keeps evidence that another
//! thread may be running alongside the caller:
//!
//! - **a thread of its own streams**: another thread that allocates only
//!   on streams the caller never allocates on (a prefetch thread copying
//!   the next batch on its own stream, a pipeline stage, an output thread).
//!   It counts while those streams hold live blocks or it called within the
//!   last [`QUIET_CALLS`] calls;
//! - **overlapping calls**: a malloc that had to wait for the lock while
//!   another thread's malloc held it;
//! - **interleaved calls**: a turn of fewer than [`MIN_TURN`] calls, at
//!   least one a malloc, by one thread between two turns of another
//!   (threads that run side by side on the same stream alternate at that
//!   grain; threads that take turns, like the forward pass on the main
//!   thread and the backward pass on autograd's device thread, do not).
//!
//! Frees alone are no evidence: a thread that finishes a step by freeing
//! tensors (autograd's device thread releasing the last buffers as the
//! main thread resumes) launches no work on live ones.
//!
//! The last two count for [`QUIET_CALLS`] calls after they were seen.
//! Threads that share a stream and never overlap or interleave (the
//! training loop) leave no evidence, so unpinning still runs there.
//!
//! Cost on the fast path: one thread-local read and two compares per call
//! when the same thread calls again on the same stream.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use vmmalloc_device::Stream;

/// Calls after which evidence of overlapping or interleaved calls no longer
/// counts, and a thread with streams of its own no longer counts unless
/// those streams hold live blocks. A training step makes hundreds to
/// thousands of calls, so a one-off (a thread finishing a free as the
/// other resumes) pauses unpinning for a few steps at most.
pub(crate) const QUIET_CALLS: u64 = 4096;

/// A turn (calls in a row by one thread) shorter than this between two
/// turns of another thread counts as interleaving. A backward pass makes
/// at least a gradient per parameter and its temporaries; two threads
/// running side by side switch every call or two.
pub(crate) const MIN_TURN: u64 = 4;

/// Threads remembered; the least recently seen one is forgotten beyond.
const MAX_THREADS: usize = 64;

/// The source of thread ids (0 is "no thread").
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

thread_local! {
    /// This thread's id, 0 until its first call.
    static ID: Cell<u32> = const { Cell::new(0) };
}

/// A small id of the calling thread, stable for its life.
#[inline]
pub(crate) fn current_thread() -> u32 {
    ID.with(|c| {
        let id = c.get();
        if id != 0 {
            return id;
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed).max(1);
        c.set(id);
        id
    })
}

/// One thread seen.
#[derive(Debug, Clone)]
struct Seen {
    /// Its id ([`current_thread`]).
    id: u32,
    /// Streams it allocated on.
    streams: Vec<Stream>,
    /// The call count at its last call.
    last_call: u64,
}

/// Evidence that two threads ran side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alongside {
    /// A malloc of `waiter` waited for the lock while `holder`'s malloc held it.
    Overlap {
        /// The thread that waited.
        waiter: u32,
        /// The thread that held the lock (or called last before it).
        holder: u32,
    },
    /// `short` made `calls` calls between two turns of `around`.
    Interleave {
        /// The thread whose turn was short.
        short: u32,
        /// Its calls in that turn.
        calls: u64,
        /// The thread whose turns it came between.
        around: u32,
    },
}

/// Why unpinning may not run now (`unpin:auto`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Another thread allocates only on streams the caller does not use.
    OwnStreams {
        /// That thread.
        thread: u32,
        /// Its streams.
        streams: Vec<Stream>,
        /// Whether those streams hold live blocks (else it called recently).
        live: bool,
    },
    /// Calls of two threads ran side by side within [`QUIET_CALLS`] calls.
    Alongside(Alongside),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::OwnStreams {
                thread,
                streams,
                live,
            } => {
                let s: Vec<String> = streams.iter().map(|s| format!("{s}")).collect();
                write!(
                    f,
                    "host thread #{thread} allocates only on {} that this thread does not use{} \
                     (a prefetch, pipeline or output thread may be launching work on live tensors)",
                    s.join(", "),
                    if *live {
                        ", and they hold live tensors"
                    } else {
                        ""
                    }
                )
            }
            Refusal::Alongside(Alongside::Overlap { waiter, holder }) => write!(
                f,
                "allocations of host threads #{waiter} and #{holder} overlapped (one waited for \
                 the allocator's lock) within the last {QUIET_CALLS} calls"
            ),
            Refusal::Alongside(Alongside::Interleave {
                short,
                calls,
                around,
            }) => write!(
                f,
                "host thread #{short} made {calls} call(s), allocating, between two turns of \
                 thread #{around} within the last {QUIET_CALLS} calls (threads running side by side)"
            ),
        }
    }
}

/// The record of calling threads.
#[derive(Debug, Default)]
pub(crate) struct Threads {
    /// Calls so far (malloc and free).
    calls: u64,
    /// The thread of the last call (0: none yet).
    last: u32,
    /// Whether the last call was a malloc.
    last_malloc: bool,
    /// Mallocs in the current turn.
    turn_mallocs: u64,
    /// The stream of the last malloc, when `last` made it.
    last_stream: Option<Stream>,
    /// Index in `seen` of `last`.
    last_idx: usize,
    /// Calls in the current turn (by `last`, in a row).
    turn: u64,
    /// The thread of the turn before the current one (0: none).
    before: u32,
    /// Threads seen.
    seen: Vec<Seen>,
    /// The latest evidence of threads running side by side, with the call
    /// count when it was seen.
    alongside: Option<(u64, Alongside)>,
}

impl Threads {
    /// Notes a call by the current thread; `stream` for a malloc.
    #[inline]
    pub fn call(&mut self, stream: Option<Stream>) {
        let me = current_thread();
        self.calls += 1;
        self.last_malloc = stream.is_some();
        if me == self.last {
            self.turn += 1;
            self.turn_mallocs += u64::from(stream.is_some());
            self.seen[self.last_idx].last_call = self.calls;
            if let Some(s) = stream {
                if self.last_stream != Some(s) {
                    self.note_stream(s);
                }
            }
            return;
        }
        self.switch(me, stream);
    }

    /// A call by another thread than the last one's.
    #[cold]
    fn switch(&mut self, me: u32, stream: Option<Stream>) {
        if self.before == me && self.last != 0 && self.turn < MIN_TURN && self.turn_mallocs > 0 {
            self.alongside = Some((
                self.calls,
                Alongside::Interleave {
                    short: self.last,
                    calls: self.turn,
                    around: me,
                },
            ));
        }
        self.before = self.last;
        self.last = me;
        self.turn = 1;
        self.turn_mallocs = u64::from(stream.is_some());
        self.last_stream = None;
        self.last_idx = match self.seen.iter().position(|t| t.id == me) {
            Some(i) => i,
            None => {
                if self.seen.len() >= MAX_THREADS {
                    let oldest = (0..self.seen.len())
                        .min_by_key(|&i| self.seen[i].last_call)
                        .expect("MAX_THREADS > 0");
                    self.seen.swap_remove(oldest);
                }
                self.seen.push(Seen {
                    id: me,
                    streams: Vec::new(),
                    last_call: 0,
                });
                self.seen.len() - 1
            }
        };
        self.seen[self.last_idx].last_call = self.calls;
        if let Some(s) = stream {
            self.note_stream(s);
        }
    }

    /// Records that the last caller allocated on `s`.
    #[cold]
    fn note_stream(&mut self, s: Stream) {
        let t = &mut self.seen[self.last_idx];
        if !t.streams.contains(&s) {
            t.streams.push(s);
        }
        self.last_stream = Some(s);
    }

    /// Notes that the current thread's call (a malloc when `malloc`)
    /// waited for the lock: it ran alongside the thread that called last.
    /// Evidence when both calls are mallocs.
    #[cold]
    pub fn overlapped(&mut self, malloc: bool) {
        let me = current_thread();
        if malloc && self.last_malloc && self.last != 0 && self.last != me {
            self.alongside = Some((
                self.calls,
                Alongside::Overlap {
                    waiter: me,
                    holder: self.last,
                },
            ));
        }
    }

    /// Why unpinning may not run in the current thread's call, if any
    /// (`unpin:auto`); `live(stream)` says whether a stream's segments hold
    /// live blocks.
    pub fn refusal(&self, live: impl Fn(Stream) -> bool) -> Option<Refusal> {
        if let Some((at, a)) = self.alongside {
            if at + QUIET_CALLS > self.calls {
                return Some(Refusal::Alongside(a));
            }
        }
        let me = current_thread();
        let mine: &[Stream] = self
            .seen
            .iter()
            .find(|t| t.id == me)
            .map_or(&[], |t| &t.streams);
        for t in &self.seen {
            if t.id == me || t.streams.is_empty() || t.streams.iter().any(|s| mine.contains(s)) {
                continue;
            }
            let is_live = t.streams.iter().any(|&s| live(s));
            if is_live || t.last_call + QUIET_CALLS > self.calls {
                return Some(Refusal::OwnStreams {
                    thread: t.id,
                    streams: t.streams.clone(),
                    live: is_live,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a new thread (a distinct thread id) and waits for it.
    fn on_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| s.spawn(f).join().unwrap())
    }

    #[test]
    fn one_thread_leaves_no_evidence() {
        let mut t = Threads::default();
        for i in 0..10_000u64 {
            t.call(Some(Stream(i % 3)));
            t.call(None);
        }
        assert_eq!(t.refusal(|_| true), None);
    }

    #[test]
    fn long_turns_on_a_shared_stream_are_taking_turns() {
        let mut t = Threads::default();
        for _ in 0..5 {
            for _ in 0..10 {
                t.call(Some(Stream::DEFAULT));
            }
            on_thread(|| {
                for _ in 0..10 {
                    t.call(Some(Stream::DEFAULT));
                }
                assert_eq!(t.refusal(|_| true), None);
            });
        }
        assert_eq!(t.refusal(|_| true), None);
    }

    #[test]
    fn short_turns_between_turns_of_another_interleave_and_expire() {
        let mut t = Threads::default();
        for _ in 0..10 {
            t.call(Some(Stream::DEFAULT));
        }
        on_thread(|| t.call(Some(Stream::DEFAULT)));
        assert_eq!(
            t.refusal(|_| false),
            None,
            "not yet: the main thread must resume"
        );
        t.call(None);
        let r = t.refusal(|_| false).expect("interleaved");
        assert!(matches!(
            r,
            Refusal::Alongside(Alongside::Interleave { calls: 1, .. })
        ));
        assert!(r.to_string().contains("between two turns"), "{r}");
        for _ in 0..QUIET_CALLS {
            t.call(None);
        }
        assert_eq!(t.refusal(|_| false), None, "expired");
    }

    #[test]
    fn a_thread_of_its_own_streams_counts_while_they_hold_live_blocks() {
        let mut t = Threads::default();
        on_thread(|| t.call(Some(Stream(7))));
        for _ in 0..10 {
            t.call(Some(Stream::DEFAULT));
        }
        let r = t.refusal(|s| s == Stream(7)).expect("own streams");
        assert!(matches!(r, Refusal::OwnStreams { live: true, .. }));
        for _ in 0..QUIET_CALLS {
            t.call(None);
        }
        assert!(t.refusal(|s| s == Stream(7)).is_some(), "live blocks");
        assert_eq!(t.refusal(|_| false), None, "idle, nothing live: gone");
        // A thread that shares a stream with the caller is a partner.
        let mut u = Threads::default();
        on_thread(|| {
            for s in [Stream(7), Stream::DEFAULT, Stream(7), Stream(7)] {
                u.call(Some(s));
            }
        });
        for _ in 0..4 {
            u.call(Some(Stream::DEFAULT));
        }
        assert_eq!(u.refusal(|_| true), None);
    }

    #[test]
    fn overlapping_mallocs_are_evidence() {
        let mut t = Threads::default();
        t.call(Some(Stream::DEFAULT));
        t.overlapped(true);
        assert_eq!(t.refusal(|_| false), None, "a thread cannot overlap itself");
        on_thread(|| {
            t.overlapped(false);
            assert!(
                !matches!(t.refusal(|_| false), Some(Refusal::Alongside(_))),
                "a free is no evidence"
            );
            t.overlapped(true);
            let r = t.refusal(|_| false).expect("overlap");
            assert!(r.to_string().contains("overlapped"), "{r}");
        });
        let mut u = Threads::default();
        u.call(None);
        on_thread(|| u.overlapped(true));
        assert_eq!(u.refusal(|_| false), None, "the holder freed");
    }

    #[test]
    fn a_trailing_free_between_turns_is_no_evidence() {
        let mut t = Threads::default();
        for _ in 0..10 {
            t.call(Some(Stream::DEFAULT));
        }
        on_thread(|| t.call(None));
        t.call(Some(Stream::DEFAULT));
        assert_eq!(t.refusal(|_| false), None);
    }
}
