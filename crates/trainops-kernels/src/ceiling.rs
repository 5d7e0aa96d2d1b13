//! A memory-bandwidth ceiling for benchmarks: the memory traffic of an Adam step (reads
//! `x, g, v, h`, writes `x, v, h`) with the least arithmetic, `x += g; v += g; h += g`, so a
//! benchmark can report Adam as a fraction of what the memory allows in the same run. An
//! [`Optimizer`] of three streams with no attributes, so it runs exactly as Adam does.

use crate::optim::{Optimizer, Param};
use crate::simd::Level;
use crate::stream::Access;
use crate::{Compute, Element};

/// Elements per block of widened gradients (4 KiB of f32: stays in L1).
const BLOCK: usize = 1024;

/// The yardstick, streams `X, V, H` like Adam's.
#[derive(Debug, Clone, Copy)]
pub struct MemoryCeiling;

impl Optimizer<3> for MemoryCeiling {
    type Attrs = ();
    type Coeffs<C: Compute> = ();
    const STREAMS: [&'static str; 3] = ["X", "V", "H"];

    fn coeffs<C: Compute>(_: &(), _: f64, _: i64) {}

    #[inline(always)]
    fn update<C: Compute>(_: &(), [x, v, h]: [C; 3], g: C) -> [C; 3] {
        [x + g, v + g, h + g]
    }

    fn reference<X: Element, G: Element<C = X::C>>(_: &(), _: f64, _: i64, streams: [&[X]; 3], g: &[G]) -> [Vec<X>; 3] {
        streams.map(|s| s.iter().zip(g).map(|(e, g)| X::store(e.load() + g.load())).collect())
    }

    /// In place (what benchmarks measure, with IOBinding): plain slices, vectorised, the
    /// gradient widened a block at a time (a no-op copy in L1 when it is `X`).
    fn chunk<X: Element, G: Element<C = X::C>>(_level: Level, _: &(), p: Param<'_, X, G, 3>) {
        let Param { streams: [mut x, mut v, mut h], g } = p;
        match (x.access(), v.access(), h.access()) {
            (Access::InPlace(x), Access::InPlace(v), Access::InPlace(h)) => {
                let mut wide = [X::C::from_f64(0.0); BLOCK];
                for (((x, v), h), g) in
                    x.chunks_mut(BLOCK).zip(v.chunks_mut(BLOCK)).zip(h.chunks_mut(BLOCK)).zip(g.chunks(BLOCK))
                {
                    let wide = &mut wide[..g.len()];
                    G::load_slice(g, wide);
                    for (((x, v), h), &g) in x.iter_mut().zip(v.iter_mut()).zip(h.iter_mut()).zip(wide.iter()) {
                        *x = X::store(x.load() + g);
                        *v = X::store(v.load() + g);
                        *h = X::store(h.load() + g);
                    }
                }
            }
            _ => {
                for (i, &g) in g.iter().enumerate() {
                    let g = g.load();
                    x.set(i, X::store(x.get(i).load() + g));
                    v.set(i, X::store(v.get(i).load() + g));
                    h.set(i, X::store(h.get(i).load() + g));
                }
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
}
