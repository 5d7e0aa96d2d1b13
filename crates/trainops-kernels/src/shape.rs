//! Shape arithmetic that cannot overflow, and working memory that cannot abort.
//!
//! Attributes (pads, strides, dilations, kernel sizes, hidden sizes) and the dimensions of
//! empty tensors (`[0, 2^40, 2^40]` is a valid, empty tensor) can be anything up to
//! `i64::MAX`: a product or sum of them may wrap, and a buffer sized by them may be larger
//! than any machine. Every kernel and its runtime glue therefore turns dimensions into sizes
//! through this module, before it allocates anything:
//!
//! - [`numel`] / [`count`]: element counts, checked (`None` / [`KernelError::Overflow`]);
//! - [`mul`], [`add`]: one checked step, naming what it computes;
//! - [`to_i64`]: dimensions an ONNX shape can hold (each at most `i64::MAX`);
//! - [`zeroed`] / [`resize`] / [`reserve`]: working memory allocated fallibly, so that a size the
//!   machine cannot hold is an error ([`KernelError::Allocation`]) rather than an abort.
//!
//! The rule the kernels follow: nothing sized by an attribute is allocated until the
//! tensors that size must match (an input, or an output the runtime has allocated) have
//! been checked against it.

use crate::KernelError;

/// The largest dimension or attribute value ONNX can express (int64): what the window
/// arithmetic of the convolution and pooling gradients accepts, in signed integers.
pub const MAX_DIM: usize = i64::MAX as usize;

/// The element count of a tensor of dimensions `dims`: `Some(0)` when a dimension is 0
/// (whatever the others are), `None` when the product does not fit in `usize`.
pub fn numel(dims: &[usize]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// [`numel`], or an overflow error naming `what` (e.g. `"the output of ConvWeightGrad"`).
pub fn count(what: &str, dims: &[usize]) -> Result<usize, KernelError> {
    numel(dims).ok_or_else(|| overflow(format!("{what}: the product of the dimensions {dims:?}")))
}

/// The product of `dims` taken left to right with every step checked: unlike [`numel`], a
/// zero does not excuse an earlier overflow (for sizes of single dimensions, e.g. `3 *
/// hidden_size`, that must fit on their own).
pub fn product(what: &str, dims: &[usize]) -> Result<usize, KernelError> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| overflow(format!("{what}: the product of {dims:?}")))
}

/// `a * b`, or an overflow error naming `what`.
pub fn mul(what: &str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b).ok_or_else(|| overflow(format!("{what}: {a} * {b}")))
}

/// `a + b`, or an overflow error naming `what`.
pub fn add(what: &str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_add(b).ok_or_else(|| overflow(format!("{what}: {a} + {b}")))
}

/// `dims` as an ONNX shape: each at most `i64::MAX`, else an overflow error naming `what`.
pub fn to_i64(what: &str, dims: &[usize]) -> Result<Vec<i64>, KernelError> {
    dims.iter()
        .map(|&d| i64::try_from(d).map_err(|_| overflow(format!("{what}: dimension {d} of {dims:?} exceeds 2^63 - 1"))))
        .collect()
}

fn overflow(what: String) -> KernelError {
    KernelError::Overflow { what }
}

fn allocation<T>(what: &'static str, len: usize) -> KernelError {
    let bytes = (len as u128) * (size_of::<T>() as u128);
    KernelError::Allocation { what, bytes }
}

/// `len` copies of `T::default()`, or [`KernelError::Allocation`] when the memory cannot be
/// had (no abort).
pub fn zeroed<T: Clone + Default>(what: &'static str, len: usize) -> Result<Vec<T>, KernelError> {
    let mut v = Vec::new();
    resize(&mut v, len, what)?;
    Ok(v)
}

/// Room for `additional` more elements in `v` (as `Vec::reserve`), or
/// [`KernelError::Allocation`] for those elements when the memory cannot be had.
pub fn reserve<T>(v: &mut Vec<T>, additional: usize, what: &'static str) -> Result<(), KernelError> {
    v.try_reserve(additional).map_err(|_| allocation::<T>(what, additional))
}

/// `v.resize(len, T::default())`, growing fallibly: [`KernelError::Allocation`] when the
/// memory cannot be had, `v` unchanged.
pub fn resize<T: Clone + Default>(v: &mut Vec<T>, len: usize, what: &'static str) -> Result<(), KernelError> {
    if len > v.len() {
        v.try_reserve_exact(len - v.len()).map_err(|_| allocation::<T>(what, len))?;
    }
    v.resize(len, T::default());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_checked_and_zero_wins() {
        assert_eq!(numel(&[]), Some(1));
        assert_eq!(numel(&[2, 3, 4]), Some(24));
        assert_eq!(numel(&[1 << 40, 1 << 40, 0]), Some(0));
        assert_eq!(numel(&[1 << 40, 1 << 40]), None);
        let e = count("X", &[1 << 40, 1 << 40]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("size overflow: X: the product of the dimensions [{}, {}]", 1u64 << 40, 1u64 << 40)
        );
        // `product` does not let a later zero hide an overflow.
        assert!(product("6 hidden", &[6, 1 << 62, 0]).is_err());
        assert_eq!(product("p", &[3, 4, 0]).unwrap(), 0);
        assert!(mul("m", usize::MAX, 2).is_err() && add("a", usize::MAX, 1).is_err());
        assert_eq!(to_i64("s", &[1, 2]).unwrap(), vec![1i64, 2]);
        assert!(to_i64("s", &[1 << 63]).unwrap_err().to_string().contains("exceeds 2^63 - 1"));
    }

    #[test]
    fn impossible_allocations_are_errors_not_aborts() {
        let e = zeroed::<f32>("the padded input", usize::MAX / 2).unwrap_err();
        assert_eq!(e, KernelError::Allocation { what: "the padded input", bytes: (usize::MAX / 2) as u128 * 4 });
        let mut v = vec![1.0f32; 3];
        assert!(resize(&mut v, 1 << 62, "scratch").is_err());
        assert_eq!(v, [1.0; 3]);
        resize(&mut v, 5, "scratch").unwrap();
        assert_eq!(v, [1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(zeroed::<u8>("x", 4).unwrap(), [0; 4]);
    }
}
