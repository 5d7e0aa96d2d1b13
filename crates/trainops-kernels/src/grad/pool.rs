//! MaxPool's gradient: `gx = 0; gx[indices[i]] += gy[i]` for every output element `i`, where
//! `indices` is ONNX MaxPool's `Indices` output (`storage_order` 0: the flat index of the
//! chosen element in the whole input tensor). Overlapping windows add up.
//!
//! Output plane `p` (batch `n`, channel `c`) only ever points into input plane `p`, so the
//! planes are independent: the fast path runs groups of whole planes as tasks on the caller's
//! [`Parallelism`], each adding in the order of the reference, so the result equals the
//! scalar reference bit for bit. An index outside its own plane is an error (it cannot come
//! from MaxPool), reported for the first such element.

use std::sync::Mutex;

use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::Parallelism;

/// Why [`max_pool_grad`] refused its inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolGradError {
    /// A buffer's length does not fit the plane counts.
    Length {
        /// Which buffer (`indices`, `gy`, `gx`).
        what: &'static str,
        /// Its length.
        got: usize,
        /// What it must be.
        expected: usize,
    },
    /// `indices[position]` is not an element of the input plane its output element is in.
    Index {
        /// Flat position in `gy` / `indices`.
        position: usize,
        /// The index found there.
        index: i64,
        /// The plane's first flat input index.
        start: usize,
        /// One past the plane's last.
        end: usize,
    },
}

impl core::fmt::Display for PoolGradError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Length { what, got, expected } => write!(f, "{what} has {got} elements, expected {expected}"),
            Self::Index { position, index, start, end } => write!(
                f,
                "element {position} is {index}, outside its (batch, channel) plane of the input, [{start}, {end})"
            ),
        }
    }
}

impl std::error::Error for PoolGradError {}

/// Whole planes: `planes` output planes of `out` elements each, and their input planes.
struct Planes<'a> {
    gy: &'a [f32],
    indices: &'a [i64],
    gx: &'a mut [f32],
    first: usize,
    out: usize,
    inp: usize,
}

impl Splittable for Planes<'_> {
    fn len(&self) -> usize {
        self.gx.len().checked_div(self.inp).unwrap_or(0).max(self.gy.len().checked_div(self.out).unwrap_or(0))
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (gy0, gy1) = self.gy.split_at(mid * self.out);
        let (i0, i1) = self.indices.split_at(mid * self.out);
        let (gx0, gx1) = self.gx.split_at_mut(mid * self.inp);
        let (out, inp) = (self.out, self.inp);
        (
            Planes { gy: gy0, indices: i0, gx: gx0, first: self.first, out, inp },
            Planes { gy: gy1, indices: i1, gx: gx1, first: self.first + mid, out, inp },
        )
    }
}

impl Planes<'_> {
    /// Zeroes the input planes and adds every gradient in; the first bad element's error.
    fn run(self) -> Result<(), PoolGradError> {
        self.gx.fill(0.0);
        if self.out == 0 {
            return Ok(());
        }
        let planes = self.gy.chunks_exact(self.out).zip(self.indices.chunks_exact(self.out));
        for (k, (gx, (gy, idx))) in self.gx.chunks_exact_mut(self.inp.max(1)).zip(planes).enumerate() {
            let p = self.first + k;
            let start = p * self.inp;
            for (j, (&g, &i)) in gy.iter().zip(idx).enumerate() {
                // One unsigned compare catches both ends (a negative index wraps high).
                let local = (i as u64).wrapping_sub(start as u64);
                if local >= self.inp as u64 {
                    return Err(PoolGradError::Index {
                        position: p * self.out + j,
                        index: i,
                        start,
                        end: start + self.inp,
                    });
                }
                gx[local as usize] += g;
            }
        }
        if self.inp == 0 && !self.gy.is_empty() {
            let (p, start) = (self.first, self.first * self.inp);
            return Err(PoolGradError::Index { position: p * self.out, index: self.indices[0], start, end: start });
        }
        Ok(())
    }
}

fn check(gy: &[f32], indices: &[i64], planes: usize, gx: &[f32]) -> Result<(usize, usize), PoolGradError> {
    if indices.len() != gy.len() {
        return Err(PoolGradError::Length { what: "indices", got: indices.len(), expected: gy.len() });
    }
    let out = gy.len().checked_div(planes).unwrap_or(0);
    let inp = gx.len().checked_div(planes).unwrap_or(0);
    if out * planes != gy.len() {
        return Err(PoolGradError::Length { what: "gy", got: gy.len(), expected: out * planes });
    }
    if inp * planes != gx.len() {
        return Err(PoolGradError::Length { what: "gx", got: gx.len(), expected: inp * planes });
    }
    Ok((out, inp))
}

/// MaxPool's gradient into `gx` (the input's `N*C` planes of `gx.len() / planes` elements),
/// from `gy` and `indices` (`planes` output planes of `gy.len() / planes` elements).
pub fn max_pool_grad(
    gy: &[f32],
    indices: &[i64],
    planes: usize,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), PoolGradError> {
    let (out, inp) = check(gy, indices, planes, gx)?;
    if planes == 0 {
        return Ok(());
    }
    // Work is counted in planes: a task holds about CHUNK elements of gy and gx together.
    let per_plane = (out + inp).max(1);
    let chunk = (CHUNK / per_plane).max(1);
    let serial_below = SERIAL_BELOW.div_ceil(per_plane);
    let first_error: Mutex<Option<PoolGradError>> = Mutex::new(None);
    let work = Planes { gy, indices, gx, first: 0, out, inp };
    run_chunked(vec![work], par, chunk, serial_below, |w| {
        if let Err(e) = w.run() {
            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
            let earlier = |a: &PoolGradError, b: &PoolGradError| match (a, b) {
                (PoolGradError::Index { position: x, .. }, PoolGradError::Index { position: y, .. }) => x < y,
                _ => false,
            };
            if slot.as_ref().is_none_or(|s| earlier(&e, s)) {
                *slot = Some(e);
            }
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The plain scalar reference, straight from the definition, for the tests.
pub mod reference {
    /// `gx` of `len` zeros with `gy[i]` added at `indices[i]`, in order; `None` for an index
    /// outside `0..len` (the reference does not check planes).
    pub fn max_pool_grad(gy: &[f32], indices: &[i64], len: usize) -> Option<Vec<f32>> {
        let mut gx = vec![0.0f32; len];
        for (&g, &i) in gy.iter().zip(indices) {
            *gx.get_mut(usize::try_from(i).ok()?)? += g;
        }
        Some(gx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::uniform;
    use crate::{RayonPool, Sequential};

    /// Indices as MaxPool would make them for random windows: each output element of plane
    /// `p` points at a random element of input plane `p` (repeats included: overlap).
    fn case(planes: usize, out: usize, inp: usize, seed: u64) -> (Vec<f32>, Vec<i64>) {
        let mut u = uniform(seed);
        let gy = (0..planes * out).map(|_| (u() * 8.0) as f32).collect();
        let idx = (0..planes * out)
            .map(|k| ((k / out) * inp + ((u() + 0.5) * inp as f64) as usize % inp.max(1)) as i64)
            .collect();
        (gy, idx)
    }

    #[test]
    fn equals_reference_bit_for_bit() {
        let shapes =
            [(0, 0, 0), (1, 1, 1), (1, 0, 4), (3, 1, 4), (2, 7, 9), (5, 16, 64), (64, 256, 1024), (7, 4096, 16384)];
        for (seed, &(planes, out, inp)) in shapes.iter().enumerate() {
            let (gy, idx) = case(planes, out, inp, seed as u64);
            let want = reference::max_pool_grad(&gy, &idx, planes * inp).unwrap();
            for par in [&Sequential as &dyn Parallelism, &RayonPool(None)] {
                let mut gx = vec![f32::NAN; planes * inp];
                max_pool_grad(&gy, &idx, planes, &mut gx, par).unwrap();
                let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(b(&gx), b(&want), "{planes}x{out}->{inp}");
            }
        }
    }

    #[test]
    fn overlapping_windows_add() {
        // 1-D, kernel 3, stride 1 over [1, 5, 2, 4]: maxima at 1, 1 -> gx[1] = gy0 + gy1.
        let mut gx = [9.0; 4];
        max_pool_grad(&[0.5, 0.25], &[1, 1], 1, &mut gx, &Sequential).unwrap();
        assert_eq!(gx, [0.0, 0.75, 0.0, 0.0]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut gx = [0.0; 8];
        // Plane 1 is [4, 8): index 3 belongs to plane 0.
        let e = max_pool_grad(&[1.0, 1.0], &[0, 3], 2, &mut gx, &Sequential).unwrap_err();
        assert_eq!(e, PoolGradError::Index { position: 1, index: 3, start: 4, end: 8 });
        assert!(max_pool_grad(&[1.0, 1.0], &[0, -1], 1, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad(&[1.0, 1.0], &[0], 1, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad(&[1.0, 1.0, 1.0], &[0, 1, 2], 2, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad(&[1.0], &[0], 1, &mut [], &Sequential).is_err());
        // Many tasks, several bad: the first is reported.
        let (gy, mut idx) = case(64, 256, 1024, 9);
        idx[12_000] = -5;
        idx[3_000] = 1 << 40;
        let mut gx = vec![0.0; 64 * 1024];
        let e = max_pool_grad(&gy, &idx, 64, &mut gx, &RayonPool(None)).unwrap_err();
        assert!(matches!(e, PoolGradError::Index { position: 3_000, .. }), "{e}");
    }
}
