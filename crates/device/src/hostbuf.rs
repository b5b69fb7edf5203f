//! Host memory for copies to and from a device: [`HostBuffer`].
//!
//! Pageable memory (an ordinary heap allocation) makes `cuMemcpyDtoH` /
//! `cuMemcpyHtoD` stage through a driver bounce buffer; page-locked
//! ("pinned") memory from `cuMemHostAlloc` is copied by DMA directly, at
//! about twice the PCIe throughput (CUDA C Programming Guide, "Page-Locked
//! Host Memory"; CUDA C Best Practices Guide, "Pinned Memory"). A device
//! hands out either through [`crate::Device::alloc_host_buffer`].

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Frees a pinned buffer's memory (given its address); run once, on drop.
pub type PinnedFree = Box<dyn FnOnce(NonNull<u8>) + Send>;

/// Page-locked memory owned by a [`HostBuffer`].
struct Pinned {
    ptr: NonNull<u8>,
    len: usize,
    free: Option<PinnedFree>,
}

// SAFETY: a `Pinned` owns its memory exclusively (contract of
// `HostBuffer::pinned`), like a `Vec<u8>`; its `free` closure is `Send`.
unsafe impl Send for Pinned {}
// SAFETY: through `&Pinned` only shared reads of the bytes are possible; the
// `free` closure is never touched through a shared reference (only in `drop`,
// which has `&mut self`).
unsafe impl Sync for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(free) = self.free.take() {
            free(self.ptr);
        }
    }
}

enum Repr {
    Heap(Vec<u8>),
    Pinned(Pinned),
}

/// A byte buffer in host memory, page-locked ([`HostBuffer::is_pinned`]) or
/// ordinary heap memory; dereferences to `[u8]`. Pinned memory goes back to
/// the driver when the buffer is dropped.
pub struct HostBuffer {
    repr: Repr,
}

impl HostBuffer {
    /// `len` zeroed bytes of ordinary (pageable) heap memory, `None` if the
    /// host has no memory for them. No memset pass: `alloc_zeroed` maps zero
    /// pages, which the first write faults in.
    pub fn heap(len: u64) -> Option<HostBuffer> {
        let n = usize::try_from(len).ok()?;
        if n == 0 {
            return Some(HostBuffer::from_vec(Vec::new()));
        }
        let layout = std::alloc::Layout::array::<u8>(n).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return None;
        }
        // SAFETY: `p` was allocated by the global allocator with the layout of
        // `[u8; n]` (what `Vec<u8>` with capacity `n` uses), and its `n` bytes
        // are initialised (zeroed).
        Some(HostBuffer::from_vec(unsafe {
            Vec::from_raw_parts(p, n, n)
        }))
    }

    /// A pageable buffer holding `v`.
    pub fn from_vec(v: Vec<u8>) -> HostBuffer {
        HostBuffer {
            repr: Repr::Heap(v),
        }
    }

    /// A pinned buffer over `len` bytes at `ptr`, released by `free(ptr)`
    /// when the buffer is dropped.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` is initialised memory, readable and writable, owned
    /// by the returned buffer alone until `free` runs, and `free` releases it.
    pub unsafe fn pinned(ptr: NonNull<u8>, len: usize, free: PinnedFree) -> HostBuffer {
        HostBuffer {
            repr: Repr::Pinned(Pinned {
                ptr,
                len,
                free: Some(free),
            }),
        }
    }

    /// Whether the memory is page-locked (from the driver), not pageable.
    pub fn is_pinned(&self) -> bool {
        matches!(self.repr, Repr::Pinned(_))
    }
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.repr {
            Repr::Heap(v) => v,
            // SAFETY: valid, initialised and owned for `len` bytes (contract
            // of `HostBuffer::pinned`); the borrow of `self` keeps it alive.
            Repr::Pinned(p) => unsafe { std::slice::from_raw_parts(p.ptr.as_ptr(), p.len) },
        }
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.repr {
            Repr::Heap(v) => v,
            // SAFETY: as in `deref`, and `&mut self` makes the access unique.
            Repr::Pinned(p) => unsafe { std::slice::from_raw_parts_mut(p.ptr.as_ptr(), p.len) },
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn heap_buffers_are_zeroed_and_pageable() {
        let mut b = HostBuffer::heap(4096).unwrap();
        assert!(!b.is_pinned());
        assert_eq!(b.len(), 4096);
        assert!(b.iter().all(|&x| x == 0));
        b[7] = 9;
        assert_eq!(b[7], 9);
        assert_eq!(HostBuffer::heap(0).unwrap().len(), 0);
        assert!(HostBuffer::heap(u64::MAX).is_none());
    }

    #[test]
    fn pinned_buffers_are_freed_once_on_drop() {
        let freed = Arc::new(AtomicUsize::new(0));
        let mut v = vec![0u8; 64].into_boxed_slice();
        let ptr = NonNull::new(v.as_mut_ptr()).unwrap();
        let f2 = Arc::clone(&freed);
        let addr = ptr.as_ptr() as usize;
        // SAFETY: `v` outlives the buffer and nothing else touches it meanwhile.
        let mut b = unsafe {
            HostBuffer::pinned(
                ptr,
                64,
                Box::new(move |p| {
                    assert_eq!(p.as_ptr() as usize, addr);
                    f2.fetch_add(1, Ordering::SeqCst);
                }),
            )
        };
        assert!(b.is_pinned());
        b[3] = 5;
        assert_eq!(b[3], 5);
        drop(b);
        assert_eq!(freed.load(Ordering::SeqCst), 1);
        assert_eq!(v[3], 5);
    }
}
