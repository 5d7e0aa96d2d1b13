//! A memory-bandwidth ceiling for benchmarks: the memory traffic of an optimizer step with
//! `N` rewritten streams (Adam's `x, v, h`: reads `x, g, v, h`, writes `x, v, h`; Adagrad's
//! and Momentum's two) with the least arithmetic, `s += g` for every stream `s`, so that a
//! benchmark can report an optimizer as a fraction of what the memory allows in the same run.
//! An [`Optimizer`] of two and of three streams with no attributes, so it runs exactly as the
//! optimizers do.

use crate::optim::{Optimizer, Param};
use crate::simd::Level;
use crate::stream::Access;
use crate::{Compute, Element};

/// Elements per block of widened gradients (4 KiB of f32: stays in L1).
const BLOCK: usize = 1024;

/// The yardstick: streams `X, V, H` like Adam's, or `X, H` like Adagrad's (Momentum's
/// `X, V` move the same bytes).
#[derive(Debug, Clone, Copy)]
pub struct MemoryCeiling;

/// The streams' names: Adam's for three, Adagrad's for two.
const fn names<const N: usize>() -> [&'static str; N] {
    let mut a = ["S"; N];
    if N > 0 {
        a[0] = "X";
    }
    if N == 2 {
        a[1] = "H";
    }
    if N == 3 {
        a[1] = "V";
        a[2] = "H";
    }
    a
}

macro_rules! ceiling {
    ($n:literal) => {
        impl Optimizer<$n> for MemoryCeiling {
            type Attrs = ();
            type Coeffs<C: Compute> = ();
            const STREAMS: [&'static str; $n] = names::<$n>();

            fn coeffs<C: Compute>(_: &(), _: f64, _: i64) {}

            #[inline(always)]
            fn update<C: Compute>(_: &(), s: [C; $n], g: C) -> [C; $n] {
                s.map(|e| e + g)
            }

            fn reference<X: Element, G: Element<C = X::C>>(
                _: &(),
                _: f64,
                _: i64,
                streams: [&[X]; $n],
                g: &[G],
            ) -> [Vec<X>; $n] {
                streams.map(|s| s.iter().zip(g).map(|(e, g)| X::store(e.load() + g.load())).collect())
            }

            fn chunk<X: Element, G: Element<C = X::C>>(_level: Level, _: &(), p: Param<'_, X, G, $n>) {
                chunk(p)
            }
        }
    };
}
ceiling!(2);
ceiling!(3);

/// In place (what benchmarks measure, with IOBinding): plain slices, vectorised, the
/// gradient widened a block at a time (a no-op copy in L1 when it is `X`), then each stream's
/// block rewritten; out of place, element by element.
fn chunk<X: Element, G: Element<C = X::C>, const N: usize>(p: Param<'_, X, G, N>) {
    let Param { mut streams, g } = p;
    let mut access = streams.each_mut().map(|s| s.access());
    if access.iter().all(|a| matches!(a, Access::InPlace(_))) {
        let mut wide = [X::C::from_f64(0.0); BLOCK];
        for (b, g) in g.chunks(BLOCK).enumerate() {
            let wide = &mut wide[..g.len()];
            G::load_slice(g, wide);
            for a in access.iter_mut() {
                let Access::InPlace(s) = a else { unreachable!("all in place") };
                for (e, &g) in s[b * BLOCK..b * BLOCK + wide.len()].iter_mut().zip(wide.iter()) {
                    *e = X::store(e.load() + g);
                }
            }
        }
    } else {
        for (i, &g) in g.iter().enumerate() {
            let g = g.load();
            for s in streams.iter_mut() {
                let e = s.get(i).load();
                s.set(i, X::store(e + g));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::CHUNK;
    use crate::{InOut, RayonPool};

    #[test]
    fn adds_the_gradient_in_place_and_out_of_place() {
        let n = 3 * CHUNK + 5;
        let (mut x, g, mut v, mut h) = (vec![1.0f32; n], vec![0.5f32; n], vec![2.0f32; n], vec![3.0f32; n]);
        let t = MemoryCeiling::param([InOut::in_place(&mut x), InOut::in_place(&mut v), InOut::in_place(&mut h)], &g);
        MemoryCeiling::step(&(), vec![t.unwrap()], &RayonPool(None));
        assert!(x.iter().all(|&e| e == 1.5) && v.iter().all(|&e| e == 2.5) && h.iter().all(|&e| e == 3.5));
        let (src, mut a, mut b, mut c) = (vec![1.0f64; 9], vec![0.0; 9], vec![0.0; 9], vec![0.0; 9]);
        let gs = vec![2.0f64; 9];
        let t = MemoryCeiling::param(
            [
                InOut::split(&src, &mut a).unwrap(),
                InOut::split(&src, &mut b).unwrap(),
                InOut::split(&src, &mut c).unwrap(),
            ],
            &gs,
        );
        MemoryCeiling::step(&(), vec![t.unwrap()], &crate::Sequential);
        assert_eq!((a[8], b[0], c[4], src[0]), (3.0, 3.0, 3.0, 1.0));
    }

    #[test]
    fn two_streams_in_place_and_out_of_place_match_the_reference() {
        let n = 2 * CHUNK + 1029;
        let (x, h, g): (Vec<f32>, Vec<f32>, Vec<f32>) =
            (0..n).map(|i| (i as f32, 0.5 * i as f32, 0.25 * (i % 7) as f32)).collect();
        let want = <MemoryCeiling as Optimizer<2>>::reference(&(), 0.0, 0, [&x, &h], &g);
        let (mut xi, mut hi) = (x.clone(), h.clone());
        let t = MemoryCeiling::param([InOut::in_place(&mut xi), InOut::in_place(&mut hi)], &g).unwrap();
        MemoryCeiling::step(&(), vec![t], &RayonPool(None));
        assert_eq!([xi, hi], want);
        let (mut xo, mut ho) = (vec![0f32; n], vec![0f32; n]);
        let t = MemoryCeiling::param([InOut::split(&x, &mut xo).unwrap(), InOut::split(&h, &mut ho).unwrap()], &g);
        MemoryCeiling::step(&(), vec![t.unwrap()], &crate::Sequential);
        assert_eq!([xo, ho], want);
        assert_eq!(<MemoryCeiling as Optimizer<2>>::STREAMS, ["X", "H"]);
        assert_eq!(<MemoryCeiling as Optimizer<3>>::STREAMS, ["X", "V", "H"]);
    }
}
