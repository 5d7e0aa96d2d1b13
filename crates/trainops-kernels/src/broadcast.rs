//! Unidirectional (numpy-style) broadcasting of an input to a target shape.

use ndarray::{ArrayView, IxDyn};

use crate::KernelError;

/// True when `from` broadcasts to `to` under ONNX's unidirectional rule: align the shapes on
/// the right; every dimension of `from` is 1 or equal to that of `to`; `from` has no more
/// dimensions than `to`.
pub fn is_unidirectional(from: &[usize], to: &[usize]) -> bool {
    from.len() <= to.len() && from.iter().rev().zip(to.iter().rev()).all(|(&f, &t)| f == t || f == 1)
}

/// `src`, of shape `from`, repeated out to shape `to` (row-major).
pub fn broadcast_to<T: Copy>(src: &[T], from: &[usize], to: &[usize]) -> Result<Vec<T>, KernelError> {
    let not = || KernelError::NotBroadcastable { from: from.to_vec(), to: to.to_vec() };
    if !is_unidirectional(from, to) {
        return Err(not());
    }
    let expected: usize = from.iter().product();
    let view = ArrayView::from_shape(IxDyn(from), src).map_err(|_| KernelError::LengthMismatch {
        what: "broadcast source",
        got: src.len(),
        expected,
    })?;
    let wide = view.broadcast(IxDyn(to)).ok_or_else(not)?;
    Ok(wide.iter().copied().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_columns() {
        let row = broadcast_to(&[1, 2, 3], &[3], &[2, 3]).unwrap();
        assert_eq!(row, [1, 2, 3, 1, 2, 3]);
        let col = broadcast_to(&[1, 2], &[2, 1], &[2, 3]).unwrap();
        assert_eq!(col, [1, 1, 1, 2, 2, 2]);
        let scalar = broadcast_to(&[9], &[], &[2, 2]).unwrap();
        assert_eq!(scalar, [9; 4]);
        assert_eq!(broadcast_to::<u8>(&[], &[0], &[3, 0]).unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn rejects_what_numpy_would_not_broadcast_one_way() {
        assert!(broadcast_to(&[1, 2], &[2], &[3]).is_err());
        assert!(broadcast_to(&[1, 2, 3, 4, 5, 6], &[2, 3], &[3]).is_err());
        assert!(broadcast_to(&[1, 2, 3], &[3, 1], &[3, 2]).is_ok());
        assert!(!is_unidirectional(&[3, 2], &[3, 1]));
    }
}
