//! Size classes for the free-block indexes (the caching replicas' free
//! blocks and the expandable free index): eight classes per power of two,
//! in size order, and a bitmap of the non-empty ones so that a best-fit
//! search skips empty classes a word at a time.

/// Sub-class bits: `1 << SUB_BITS` classes per power of two (the bits after
/// the leading one).
const SUB_BITS: u32 = 3;

/// Number of size classes (every `u64` size has one).
pub(crate) const CLASSES: usize = 64 << SUB_BITS;

/// The size class of `size`: non-decreasing in `size`.
#[inline]
pub(crate) fn class_of(size: u64) -> usize {
    if size < 1 << SUB_BITS {
        return size as usize;
    }
    let log = 63 - size.leading_zeros();
    let sub = (size >> (log - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    (((log - SUB_BITS + 1) as usize) << SUB_BITS) + sub as usize
}

/// One bit per size class: set iff the class is non-empty.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClassBits([u64; CLASSES / 64]);

impl ClassBits {
    /// Records whether class `c` is non-empty.
    #[inline]
    pub(crate) fn set(&mut self, c: usize, nonempty: bool) {
        if nonempty {
            self.0[c / 64] |= 1 << (c % 64);
        } else {
            self.0[c / 64] &= !(1 << (c % 64));
        }
    }

    /// The first non-empty class >= `from`, if any.
    #[inline]
    pub(crate) fn next(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        let mut bits = *self.0.get(w)? & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            bits = *self.0.get(w)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_monotonic() {
        let mut last = 0;
        for s in (0..1u64 << 16).chain((16..64).map(|b| 1u64 << b)) {
            let c = class_of(s);
            assert!(c >= last, "class of {s}");
            last = c;
        }
        assert!(class_of(u64::MAX) < CLASSES);
    }

    #[test]
    fn next_finds_the_first_set_bit_at_or_after() {
        let mut b = ClassBits::default();
        assert_eq!(b.next(0), None);
        b.set(5, true);
        b.set(130, true);
        b.set(CLASSES - 1, true);
        assert_eq!(b.next(0), Some(5));
        assert_eq!(b.next(5), Some(5));
        assert_eq!(b.next(6), Some(130));
        assert_eq!(b.next(131), Some(CLASSES - 1));
        assert_eq!(b.next(CLASSES), None);
        b.set(130, false);
        assert_eq!(b.next(6), Some(CLASSES - 1));
    }
}
