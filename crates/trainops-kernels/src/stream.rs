//! [`InOut`]: one tensor that is read and rewritten, either in place or from a separate
//! source buffer into a destination buffer.
//!
//! ONNX Runtime may hand a kernel an output buffer that is the very buffer of its input
//! (IOBinding of `X_new` to `X`). Turning that into a `&[T]` and a `&mut [T]` at once would be
//! undefined behaviour, so a stream keeps a read pointer and a write pointer instead, built
//! only from references that cannot overlap: one `&mut [T]` (in place) or a `&[T]` and a
//! disjoint `&mut [T]`. Element `i` is always read before element `i` is written.

use core::marker::PhantomData;

use crate::KernelError;

/// A tensor that is read from `src` and written to `dst`, where `src` is either `dst` itself
/// or a separate buffer of the same length.
pub struct InOut<'a, T> {
    src: *const T,
    dst: *mut T,
    len: usize,
    _borrow: PhantomData<(&'a [T], &'a mut [T])>,
}

// SAFETY: an `InOut` is a unique borrow of `dst` plus a shared borrow of `src` (the same
// rights as `(&[T], &mut [T])`), so it may move to another thread when `T` may.
unsafe impl<T: Send + Sync> Send for InOut<'_, T> {}

impl<'a, T: Copy> InOut<'a, T> {
    /// Updates `buf` in place.
    pub fn in_place(buf: &'a mut [T]) -> Self {
        Self { src: buf.as_ptr(), dst: buf.as_mut_ptr(), len: buf.len(), _borrow: PhantomData }
    }

    /// Reads `src`, writes `dst`; the borrow rules guarantee that they do not overlap.
    pub fn split(src: &'a [T], dst: &'a mut [T]) -> Result<Self, KernelError> {
        if src.len() != dst.len() {
            return Err(KernelError::LengthMismatch { what: "output", got: dst.len(), expected: src.len() });
        }
        Ok(Self { src: src.as_ptr(), dst: dst.as_mut_ptr(), len: dst.len(), _borrow: PhantomData })
    }

    /// Number of elements.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no elements.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element `i` of the source. Panics when `i` is out of bounds.
    #[inline(always)]
    pub fn get(&self, i: usize) -> T {
        assert!(i < self.len);
        // SAFETY: `i < len` and `src` is valid for `len` reads for `'a` (it came from a slice);
        // a write through `dst` to the same element only ever follows this read.
        unsafe { self.src.add(i).read() }
    }

    /// Writes element `i` of the destination. Panics when `i` is out of bounds.
    #[inline(always)]
    pub fn set(&mut self, i: usize, v: T) {
        assert!(i < self.len);
        // SAFETY: `i < len`, `dst` is uniquely borrowed for `'a` and valid for `len` writes.
        unsafe { self.dst.add(i).write(v) }
    }

    /// Splits into `[0, mid)` and `[mid, len)`, like `split_at_mut`. Panics when `mid > len`.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        assert!(mid <= self.len);
        let tail = Self {
            src: self.src.wrapping_add(mid),
            dst: self.dst.wrapping_add(mid),
            len: self.len - mid,
            _borrow: PhantomData,
        };
        (Self { len: mid, ..self }, tail)
    }

    /// The stream as plain slices: one when it is updated in place, else the source and the
    /// (non-overlapping) destination.
    pub fn access(&mut self) -> Access<'_, T> {
        if self.len == 0 {
            return Access::InPlace(&mut []);
        }
        if core::ptr::eq(self.src, self.dst) {
            // SAFETY: in place, `dst` is the unique borrow of `len` elements it came from.
            Access::InPlace(unsafe { core::slice::from_raw_parts_mut(self.dst, self.len) })
        } else {
            // SAFETY: built by `split` from a `&[T]` and a `&mut [T]` of `len` elements each,
            // which the borrow rules kept disjoint.
            unsafe {
                Access::Split(
                    core::slice::from_raw_parts(self.src, self.len),
                    core::slice::from_raw_parts_mut(self.dst, self.len),
                )
            }
        }
    }

    /// The raw read and write pointers, for SIMD kernels: `len()` elements each; `src` may
    /// equal `dst`, and then each element must be read before it is written.
    #[inline(always)]
    pub fn as_ptrs(&mut self) -> (*const T, *mut T) {
        (self.src, self.dst)
    }
}

/// A stream's memory as slices (see [`InOut::access`]).
pub enum Access<'s, T> {
    /// Read and rewritten in place.
    InPlace(&'s mut [T]),
    /// Read from the first, written to the second.
    Split(&'s [T], &'s mut [T]),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_reads_then_writes_the_same_buffer() {
        let mut buf = [1.0f32, 2.0, 3.0];
        let mut s = InOut::in_place(&mut buf);
        for i in 0..s.len() {
            let v = s.get(i);
            s.set(i, v * 10.0);
        }
        assert_eq!(buf, [10.0, 20.0, 30.0]);
    }

    #[test]
    fn split_leaves_the_source_alone() {
        let src = [1.0f64, 2.0];
        let mut dst = [0.0f64; 2];
        let mut s = InOut::split(&src, &mut dst).unwrap();
        for i in 0..2 {
            let v = s.get(i);
            s.set(i, v + 1.0);
        }
        assert_eq!(src, [1.0, 2.0]);
        assert_eq!(dst, [2.0, 3.0]);
        assert!(InOut::split(&src, &mut [0.0f64; 3]).is_err());
    }

    #[test]
    fn split_at_covers_both_halves() {
        let mut buf = [0u32; 5];
        let (mut a, mut b) = InOut::in_place(&mut buf).split_at(2);
        assert_eq!((a.len(), b.len()), (2, 3));
        a.set(1, 7);
        b.set(0, 8);
        assert_eq!(buf, [0, 7, 8, 0, 0]);
    }
}
