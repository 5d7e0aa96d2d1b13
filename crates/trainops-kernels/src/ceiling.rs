//! A memory-bandwidth ceiling for benchmarks: the memory traffic of an Adam step (reads
//! `x, g, v, h`, writes `x, v, h`) with the least arithmetic, `x += g; v += g; h += g`, so a
//! benchmark can report Adam as a fraction of what the memory allows in the same run.

use crate::adam::{AdamTensor, CHUNK, SERIAL_BELOW};
use crate::stream::Access;
use crate::{run_chunked, Compute, Element, Parallelism};

/// Elements per block of widened gradients (4 KiB of f32: stays in L1).
const BLOCK: usize = 1024;

/// Adds `g` to `x`, `v` and `h` of every tensor, split like an Adam step (gradients may be
/// narrower than the weights, as in mixed precision).
pub fn touch<T: Element, G: Element<C = T::C>>(tensors: Vec<AdamTensor<'_, T, G>>, par: &dyn Parallelism) {
    run_chunked(tensors, par, CHUNK, SERIAL_BELOW, |t| {
        let AdamTensor { mut x, g, mut v, mut h } = t;
        match (x.access(), v.access(), h.access()) {
            // The case benchmarks measure (IOBinding in place): plain slices, vectorised; the
            // gradient is widened a block at a time (a no-op copy in L1 when it is `T`).
            (Access::InPlace(x), Access::InPlace(v), Access::InPlace(h)) => {
                let mut wide = [T::C::from_f64(0.0); BLOCK];
                for (((x, v), h), g) in
                    x.chunks_mut(BLOCK).zip(v.chunks_mut(BLOCK)).zip(h.chunks_mut(BLOCK)).zip(g.chunks(BLOCK))
                {
                    let wide = &mut wide[..g.len()];
                    G::load_slice(g, wide);
                    for (((x, v), h), &g) in x.iter_mut().zip(v.iter_mut()).zip(h.iter_mut()).zip(wide.iter()) {
                        *x = T::store(x.load() + g);
                        *v = T::store(v.load() + g);
                        *h = T::store(h.load() + g);
                    }
                }
            }
            _ => {
                for (i, &g) in g.iter().enumerate() {
                    let g = g.load();
                    x.set(i, T::store(x.get(i).load() + g));
                    v.set(i, T::store(v.get(i).load() + g));
                    h.set(i, T::store(h.get(i).load() + g));
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{InOut, RayonPool};

    #[test]
    fn adds_the_gradient_in_place_and_out_of_place() {
        let n = 3 * CHUNK + 5;
        let (mut x, g, mut v, mut h) = (vec![1.0f32; n], vec![0.5f32; n], vec![2.0f32; n], vec![3.0f32; n]);
        let t = AdamTensor::new(InOut::in_place(&mut x), &g, InOut::in_place(&mut v), InOut::in_place(&mut h));
        touch(vec![t.unwrap()], &RayonPool(None));
        assert!(x.iter().all(|&e| e == 1.5) && v.iter().all(|&e| e == 2.5) && h.iter().all(|&e| e == 3.5));
        let (src, mut a, mut b, mut c) = (vec![1.0f64; 9], vec![0.0; 9], vec![0.0; 9], vec![0.0; 9]);
        let gs = vec![2.0f64; 9];
        let t = AdamTensor::new(
            InOut::split(&src, &mut a).unwrap(),
            &gs,
            InOut::split(&src, &mut b).unwrap(),
            InOut::split(&src, &mut c).unwrap(),
        );
        touch(vec![t.unwrap()], &crate::Sequential);
        assert_eq!((a[8], b[0], c[4], src[0]), (3.0, 3.0, 3.0, 1.0));
    }
}
