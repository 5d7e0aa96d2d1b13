//! Mixed-precision helpers: one finiteness verdict across many gradients (each optionally
//! divided by a loss scale first), and 16-bit copies of weights.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::{Compute, Element, Parallelism};

/// A read-only piece of one tensor.
struct Piece<'a, G>(&'a [G]);

impl<G: Sync> Splittable for Piece<'_, G> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at(mid);
        (Piece(a), Piece(b))
    }
}

/// Elements checked between looks at the shared verdict (a branch-free inner loop).
const BLOCK: usize = 1024;

/// True when every element of every tensor is finite, after division by `loss_scale` when
/// one is given (`G / loss_scale` in the compute type may overflow where `G` does not).
/// Stops early once any piece found a non-finite value; the verdict never depends on `par`.
pub fn all_finite<G: Element>(tensors: &[&[G]], loss_scale: Option<G::C>, par: &dyn Parallelism) -> bool {
    // Dividing by a finite scale of at least 1 cannot overflow (|g / s| <= |g|, and rounding
    // is monotonic) and keeps infinities and NaN, so then the verdict on `G` is the verdict
    // on `G / s`, without a division per element (which bound the check by the divider).
    let one = G::C::from_f64(1.0);
    let loss_scale = loss_scale.filter(|&s| !(s >= one && s.is_finite()));
    let verdict = AtomicBool::new(true);
    let work = tensors.iter().map(|t| Piece(t)).collect();
    run_chunked(work, par, CHUNK, SERIAL_BELOW, |p| {
        // Each block widened first with the type's slice conversion (vectorised for 16-bit
        // types; element by element, `half`'s scalar conversion kept the check at a third
        // of the memory's speed), then checked branch-free.
        let mut wide = [G::C::from_f64(0.0); BLOCK];
        for block in p.0.chunks(BLOCK) {
            if !verdict.load(Ordering::Relaxed) {
                return;
            }
            let wide = &mut wide[..block.len()];
            G::load_slice(block, wide);
            let finite = match loss_scale {
                Some(s) => wide.iter().fold(true, |ok, &g| ok & (g / s).is_finite()),
                None => wide.iter().fold(true, |ok, &g| ok & g.is_finite()),
            };
            if !finite {
                verdict.store(false, Ordering::Relaxed);
                return;
            }
        }
    });
    verdict.into_inner()
}

/// A source and its converted copy.
struct CastPair<'a, A, B>(&'a [A], &'a mut [B]);

impl<A: Sync, B: Send> Splittable for CastPair<'_, A, B> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_at(mid);
        let (b0, b1) = self.1.split_at_mut(mid);
        (CastPair(a0, b0), CastPair(a1, b1))
    }
}

/// Writes every `src[i]` converted to `B` (round-to-nearest-even) into `dst[i]`, for each
/// pair. Panics when a pair's lengths differ.
pub fn cast<A, B>(pairs: Vec<(&[A], &mut [B])>, par: &dyn Parallelism)
where
    A: Element,
    B: Element<C = A::C>,
{
    let work: Vec<CastPair<'_, A, B>> = pairs
        .into_iter()
        .map(|(a, b)| {
            assert_eq!(a.len(), b.len(), "cast: source and destination lengths differ");
            CastPair(a, b)
        })
        .collect();
    run_chunked(work, par, CHUNK, SERIAL_BELOW, |CastPair(a, b)| {
        for (d, s) in b.iter_mut().zip(a) {
            *d = B::store(s.load());
        }
    });
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::{RayonPool, Sequential};

    #[test]
    fn one_verdict_across_tensors_and_threads() {
        let n = 3 * CHUNK + 7;
        let clean = vec![f16::from_f32(1.5); n];
        let mut dirty = clean.clone();
        dirty[2 * CHUNK + 3] = f16::INFINITY;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
            assert!(all_finite(&[&clean, &clean], None, par));
            assert!(!all_finite(&[&clean, &dirty], None, par));
            assert!(!all_finite(&[&dirty[..10], &clean[..], &dirty[..]], Some(2.0), par));
            assert!(all_finite::<f16>(&[], None, par));
            assert!(all_finite::<f16>(&[&[]], Some(0.5), par));
        }
        // Finite gradients that overflow once unscaled, and NaN from 0 / 0.
        let big = [f32::MAX / 2.0, 1.0];
        assert!(all_finite(&[&big[..]], Some(1.0), &Sequential));
        assert!(!all_finite(&[&big[..]], Some(0.25), &Sequential));
        assert!(!all_finite(&[&[0.0f32][..]], Some(0.0), &Sequential));
        assert!(!all_finite(&[&[bf16::NAN][..]], None, &Sequential));
        // Scales of at least 1 skip the division; every other scale divides.
        for s in [1.0f32, 1.5, 65536.0, f32::MAX] {
            assert!(all_finite(&[&big[..], &[f32::MAX, -f32::MAX][..]], Some(s), &Sequential));
            assert!(!all_finite(&[&[1.0, f32::INFINITY][..]], Some(s), &Sequential));
            assert!(!all_finite(&[&[f32::NAN][..]], Some(s), &Sequential));
        }
        for s in [f32::INFINITY, f32::NAN, 0.5, -1.0, -0.0] {
            let want = [f32::MAX, 1.0, 0.0].iter().all(|&g| (g / s).is_finite());
            assert_eq!(all_finite(&[&[f32::MAX, 1.0, 0.0][..]], Some(s), &Sequential), want, "{s}");
        }
    }

    #[test]
    fn casts_round_to_nearest_even() {
        let n = 2 * CHUNK + 5;
        let src: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32) * 1e-4).collect();
        let mut a = vec![f16::ZERO; n];
        let mut b = vec![bf16::ZERO; n];
        cast(vec![(&src[..], &mut a[..])], &RayonPool(None));
        cast(vec![(&src[..], &mut b[..])], &Sequential);
        for i in 0..n {
            assert_eq!(a[i], f16::from_f32(src[i]));
            assert_eq!(b[i], bf16::from_f32(src[i]));
        }
        // 1 + 2^-11 lies halfway between two float16 values: ties go to the even one.
        let mut tie = [f16::ZERO];
        cast(vec![(&[1.0f32 + 2f32.powi(-11)][..], &mut tie[..])], &Sequential);
        assert_eq!(tie[0].to_bits(), f16::ONE.to_bits());
    }
}
