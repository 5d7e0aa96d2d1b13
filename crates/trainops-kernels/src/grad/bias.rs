//! A bias's gradient: `dB[j] = sum_r dY[r, j]`, the sum of `dY` over its leading axes laid
//! flat as `rows` rows of `width` (a linear layer's bias over a batch of tokens, a
//! convolution's over samples and positions in channels-last layout).
//!
//! onnxruntime's `ReduceSum` over the leading axes ran at 8 GB/s on one thread and gained
//! 1.1-1.2x from a second (ConvNeXt's `[8, 32, 32, 384]`: 1.5 ms, 11.5 ms of its step).
//! Here the rows are cut into blocks of 1024 and the columns into blocks of 512 (a function
//! of the shape alone); each task sums its block's columns in float64 over its rows in
//! order (the loads widened, the adds vectorised), and the blocks' partial sums are added
//! in row-block order in float64 and rounded once. So the result
//! does not depend on the thread count, and each element is within `u |s| + 2 rows 2^-53
//! sum_r |dY[r, j]|` of the exact sum `s` (`u = 2^-24`): the float32 rounding of a float64
//! sum of at most `rows + rows / ROW_BLOCK` additions, each rounding at `2^-53` relative.

use crate::error::KernelError;
use crate::parallel::{for_each_item, Parallelism};
use crate::shape;

/// Rows per block: a block's partial sums are one float64 per column.
const ROW_BLOCK: usize = 1024;
/// Columns per block: 2 KiB of float32 per row of a block, a few lines of each row.
const COL_BLOCK: usize = 512;

/// `db[j] = sum_r dy[r * width + j]` (see the module); threads from `par`. Lengths are
/// checked first; the partial sums are allocated fallibly.
pub fn bias_grad(
    rows: usize,
    width: usize,
    dy: &[f32],
    db: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    let expected = shape::count("dY", &[rows, width])?;
    if dy.len() != expected {
        return Err(KernelError::LengthMismatch { what: "dY", got: dy.len(), expected });
    }
    if db.len() != width {
        return Err(KernelError::LengthMismatch { what: "dB", got: db.len(), expected: width });
    }
    let row_blocks = rows.div_ceil(ROW_BLOCK).max(1);
    let mut partial =
        shape::zeroed::<f64>("BiasGrad's partial sums", shape::mul("BiasGrad's partial sums", row_blocks, width)?)?;
    // Tasks: (row block, column block), each writing its columns of its row block's sums.
    let mut items = Vec::new();
    for (rb, sums) in partial.chunks_mut(width.max(1)).enumerate() {
        for (cb, cols) in sums.chunks_mut(COL_BLOCK).enumerate() {
            items.push((rb, cb * COL_BLOCK, cols));
        }
    }
    for_each_item(par, items, |(rb, c0, cols)| {
        let r1 = rows.min((rb + 1) * ROW_BLOCK);
        for r in rb * ROW_BLOCK..r1 {
            let row = &dy[r * width + c0..][..cols.len()];
            for (s, &v) in cols.iter_mut().zip(row) {
                *s += f64::from(v);
            }
        }
    });
    for (j, out) in db.iter_mut().enumerate() {
        *out = partial.iter().skip(j).step_by(width).sum::<f64>() as f32;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::{RayonPool, Sequential};
    use crate::test_util::uniform;

    /// Against float64 within the stated bound, and bit for bit at 1 and 2 threads, on
    /// shapes around the blocks.
    #[test]
    fn within_the_bound_at_any_thread_count() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let two = RayonPool(Some(&pool));
        for (rows, width) in
            [(0, 3), (1, 1), (5, 7), (1023, 513), (1024, 512), (1025, 511), (3000, 96), (2, 1100), (7, 0)]
        {
            let mut u = uniform((rows * 7 + width) as u64);
            let dy: Vec<f32> = (0..rows * width).map(|_| (100.0 * u()) as f32).collect();
            let (mut one, mut both) = (vec![f32::NAN; width], vec![f32::NAN; width]);
            bias_grad(rows, width, &dy, &mut one, &Sequential).unwrap();
            bias_grad(rows, width, &dy, &mut both, &two).unwrap();
            assert!(one.iter().zip(&both).all(|(a, b)| a.to_bits() == b.to_bits()), "{rows}x{width}");
            for j in 0..width {
                let col = (0..rows).map(|r| f64::from(dy[r * width + j]));
                let (s, abs) = col.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
                let bound = 2f64.powi(-24) * s.abs() + rows as f64 * 2f64.powi(-53) * abs * 2.0;
                assert!((f64::from(one[j]) - s).abs() <= bound, "{rows}x{width} column {j}: {} vs {s}", one[j]);
            }
        }
    }

    /// Large terms that cancel leave their small remainder exactly (float64 partial sums:
    /// a float32 running sum at 3e7 has a spacing of 2).
    #[test]
    fn large_cancelling_sums_keep_their_small_remainder() {
        let rows = 4097;
        let dy: Vec<f32> = (0..rows)
            .map(|r| {
                if r == rows - 1 {
                    1.0
                } else if r % 2 == 0 {
                    3.0e7
                } else {
                    -3.0e7 + 0.5
                }
            })
            .collect();
        let mut db = [0f32];
        bias_grad(rows, 1, &dy, &mut db, &Sequential).unwrap();
        let exact: f64 = dy.iter().map(|&v| f64::from(v)).sum();
        assert_eq!(f64::from(db[0]), exact);
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let mut db = [0f32; 3];
        assert!(bias_grad(2, 3, &[0.0; 5], &mut db, &Sequential).is_err());
        assert!(bias_grad(2, 3, &[0.0; 6], &mut db[..2], &Sequential).is_err());
        assert!(bias_grad(usize::MAX, 3, &[], &mut db, &Sequential).is_err());
    }
}
