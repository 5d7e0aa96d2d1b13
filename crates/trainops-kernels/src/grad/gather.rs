//! Gather's gradient on axis 0 (a token embedding's): `out = base` (or zeros), then for each
//! index `k` in order, `out[indices[k], :] += dY[k, :]`: ONNX `ScatterND` with reduction
//! `add` and one coordinate per index, which the standard-op gradient uses. onnxruntime's
//! `ScatterND` copies its data input into the output and adds on one thread; for BERT's
//! 30522-word table that is a 94 MB fill (`ConstantOfShape`) and a 94 MB copy a step (17 ms),
//! for a tied 49152-word table 189 MB (40 ms).
//!
//! Here each task owns a block of the output's rows: it writes them (a copy of `base`, or
//! zeros) and adds, in index order, the updates of the indices that fall in its block. Each
//! row therefore gets its updates in the order of the indices, one float32 addition each,
//! as the sequential scatter adds them: the same bits at every thread count as
//! [`reference::gather_grad`], which is that sequential scatter. Every index is checked
//! (and a negative one counted from the end, as `Gather` allows) before anything is
//! written.

use crate::ceiling::stream_zero;
use crate::parallel::{for_each_item, Parallelism};
use crate::random::draw::{stream_copy_fenced, streams};
use crate::random::philox::Stores;
use crate::simd::{detected, Isa};

/// Why a gradient was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatherGradError {
    /// A buffer's length does not fit the others.
    Length {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// What it must be.
        expected: usize,
    },
    /// `indices[position]` is outside `[-rows, rows)`.
    Index {
        /// Flat position in `indices`.
        position: usize,
        /// The index found there.
        index: i64,
        /// The output's rows (the gathered axis).
        rows: usize,
    },
}

impl core::fmt::Display for GatherGradError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Length { what, got, expected } => write!(f, "{what} has {got} elements, expected {expected}"),
            Self::Index { position, index, rows } => {
                write!(
                    f,
                    "element {position} is {index}, outside [-{rows}, {rows}) (the gathered axis has {rows} rows)"
                )
            }
        }
    }
}

impl std::error::Error for GatherGradError {}

/// Bytes of the output a task writes (at least one row): blocks small enough for two
/// threads to share a 94 MB table evenly, large enough that each task's pass over the
/// indices (a compare per index) is nothing next to its rows.
const TASK_BYTES: usize = 1 << 20;

/// `out [rows x width]` = `base` (zeros when `None`) with `dy [indices.len() x width]`'s
/// rows added at `indices`, in index order; threads from `par`. Lengths and every index are
/// checked first: on an error nothing is written.
pub fn gather_grad(
    rows: usize,
    width: usize,
    indices: &[i64],
    dy: &[f32],
    base: Option<&[f32]>,
    out: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), GatherGradError> {
    let target = checks(rows, width, indices, dy, base, out)?;
    if out.is_empty() {
        return Ok(());
    }
    let per = (TASK_BYTES / (width * 4).max(1)).max(1);
    // A table larger than the caches is written with non-temporal stores (the rows the
    // updates then read back are a few per token): the random fills' choice and threshold.
    let isa = detected().isa().unwrap_or(Isa::Scalar);
    let stream = streams::<f32>(isa, Stores::Auto, out.len());
    let items: Vec<(usize, &mut [f32])> = out.chunks_mut(per * width).enumerate().collect();
    for_each_item(par, items, |(t, block)| {
        let (r0, r1) = (t * per, t * per + block.len() / width);
        match (base, stream) {
            (Some(b), true) => stream_copy_fenced(isa, &b[r0 * width..r1 * width], block),
            (Some(b), false) => block.copy_from_slice(&b[r0 * width..r1 * width]),
            (None, true) => stream_zero(block),
            (None, false) => block.fill(0.0),
        }
        for (k, &r) in target.iter().enumerate() {
            if (r0..r1).contains(&r) {
                let row = &mut block[(r - r0) * width..][..width];
                for (o, &g) in row.iter_mut().zip(&dy[k * width..][..width]) {
                    *o += g;
                }
            }
        }
    });
    Ok(())
}

/// The lengths, and each index as a row (negative ones counted from the end).
fn checks(
    rows: usize,
    width: usize,
    indices: &[i64],
    dy: &[f32],
    base: Option<&[f32]>,
    out: &[f32],
) -> Result<Vec<usize>, GatherGradError> {
    let len = |what, got: usize, a: usize| {
        let expected = a.checked_mul(width).ok_or(GatherGradError::Length { what, got, expected: usize::MAX })?;
        if got == expected {
            Ok(())
        } else {
            Err(GatherGradError::Length { what, got, expected })
        }
    };
    len("dY", dy.len(), indices.len())?;
    len("the output", out.len(), rows)?;
    if let Some(b) = base {
        len("base", b.len(), rows)?;
    }
    let n = i64::try_from(rows).unwrap_or(i64::MAX);
    indices
        .iter()
        .enumerate()
        .map(|(position, &index)| {
            let r = if index < 0 { index.checked_add(n).unwrap_or(-1) } else { index };
            if (0..n).contains(&r) {
                Ok(r as usize)
            } else {
                Err(GatherGradError::Index { position, index, rows })
            }
        })
        .collect()
}

/// The sequential scatter: the output is `base` (or zeros), then each update added in
/// index order, element by element; for tests.
pub mod reference {
    /// See the module; panics on an index out of range (tests only).
    pub fn gather_grad(rows: usize, width: usize, indices: &[i64], dy: &[f32], base: Option<&[f32]>) -> Vec<f32> {
        let mut out = base.map_or_else(|| vec![0f32; rows * width], <[f32]>::to_vec);
        for (k, &i) in indices.iter().enumerate() {
            let r = if i < 0 { i + rows as i64 } else { i } as usize;
            for j in 0..width {
                out[r * width + j] += dy[k * width + j];
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::{RayonPool, Sequential};
    use crate::test_util::uniform;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut u = uniform(seed);
        (0..len).map(|_| (8.0 * u()) as f32).collect()
    }

    /// Every shape below, with and without a base, repeated and negative indices, at one
    /// thread and two: the sequential scatter bit for bit.
    #[test]
    fn is_the_sequential_scatter_at_any_thread_count() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let two = RayonPool(Some(&pool));
        let pars: [&dyn Parallelism; 2] = [&Sequential, &two];
        // (rows, width, indices): rows past one task's block (1 MiB / 4 / width rows), a
        // width of one, no indices, every row hit many times, a table past the streaming threshold
        // (written with non-temporal stores; the Vec's start need not be a line's).
        for (rows, width, count) in
            [(1, 1, 3), (7, 5, 20), (300, 1, 1000), (3000, 96, 700), (40, 20000, 90), (5, 3, 0), (1100, 1001, 900)]
        {
            let mut next = uniform((rows * 31 + width) as u64);
            let indices: Vec<i64> = (0..count)
                .map(|k| {
                    let r = ((next() + 0.5) * rows as f64) as i64 % rows as i64;
                    if k % 3 == 0 {
                        r - rows as i64
                    } else {
                        r
                    }
                })
                .collect();
            let dy = data(count * width, 7);
            let base = data(rows * width, 9);
            for b in [None, Some(&base[..])] {
                let want = reference::gather_grad(rows, width, &indices, &dy, b);
                for par in pars {
                    let mut out = vec![f32::NAN; rows * width];
                    gather_grad(rows, width, &indices, &dy, b, &mut out, par).unwrap();
                    assert!(out.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{rows}x{width}, {count}");
                }
            }
        }
    }

    /// The sum of a row's updates against float64: within one rounding per update.
    #[test]
    fn repeated_rows_sum_their_updates() {
        let (rows, width) = (4, 3);
        let indices = [1i64, -3, 1, 2, 1];
        let dy = data(indices.len() * width, 3);
        let mut out = vec![0f32; rows * width];
        gather_grad(rows, width, &indices, &dy, None, &mut out, &Sequential).unwrap();
        for j in 0..width {
            let exact: f64 = [0usize, 1, 2, 4].iter().map(|&k| f64::from(dy[k * width + j])).sum();
            let bound = 4.0
                * f64::from(f32::EPSILON)
                * [0usize, 1, 2, 4].iter().map(|&k| f64::from(dy[k * width + j]).abs()).sum::<f64>();
            assert!((f64::from(out[width + j]) - exact).abs() <= bound);
            assert_eq!(out[j], 0.0);
            assert_eq!(out[2 * width + j], dy[3 * width + j]);
        }
    }

    #[test]
    fn bad_input_is_refused_before_anything_is_written() {
        let mut out = vec![5f32; 6];
        let e = gather_grad(3, 2, &[0, 3], &[0.0; 4], None, &mut out, &Sequential).unwrap_err();
        assert_eq!(e.to_string(), "element 1 is 3, outside [-3, 3) (the gathered axis has 3 rows)");
        let e = gather_grad(3, 2, &[-4], &[0.0; 2], None, &mut out, &Sequential).unwrap_err();
        assert_eq!(e, GatherGradError::Index { position: 0, index: -4, rows: 3 });
        let e = gather_grad(3, 2, &[i64::MIN], &[0.0; 2], None, &mut out, &Sequential).unwrap_err();
        assert_eq!(e, GatherGradError::Index { position: 0, index: i64::MIN, rows: 3 });
        let e = gather_grad(3, 2, &[0], &[0.0; 3], None, &mut out, &Sequential).unwrap_err();
        assert_eq!(e.to_string(), "dY has 3 elements, expected 2");
        let e = gather_grad(3, 2, &[0], &[0.0; 2], Some(&[0.0; 5]), &mut out, &Sequential).unwrap_err();
        assert_eq!(e.to_string(), "base has 5 elements, expected 6");
        assert!(out.iter().all(|&v| v == 5.0));
        // No rows: every index is out of range; none: the output is empty.
        assert!(gather_grad(0, 2, &[0], &[0.0; 2], None, &mut [], &Sequential).is_err());
        gather_grad(0, 2, &[], &[], None, &mut [], &Sequential).unwrap();
    }
}
