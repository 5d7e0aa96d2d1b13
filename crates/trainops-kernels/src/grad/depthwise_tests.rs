//! The depthwise kernels against their scalar reference (bit for bit, every SIMD level,
//! one and several threads) and the reference against float64 sums (within the rounding
//! bound of the module text), on edge shapes and random ones.

use proptest::prelude::*;

use super::*;
use crate::parallel::{RayonPool, Sequential};
use crate::simd::available_levels;
use crate::test_util::uniform;

/// `(batch, channels, mult, [ih, iw], [kh, kw], strides, dilations, pads [t, l, b, r])`.
type Shape = (usize, usize, usize, [usize; 2], [usize; 2], [usize; 2], [usize; 2], [usize; 4]);

fn dims(s: &Shape) -> DepthwiseDims {
    let &(batch, channels, mult, input, kernel, strides, dilations, pads) = s;
    let geo = ConvGeometry {
        kernel: kernel.to_vec(),
        strides: strides.to_vec(),
        dilations: dilations.to_vec(),
        pads: pads.to_vec(),
        group: channels,
    };
    DepthwiseDims::new(&geo, batch, channels, channels * mult, &input).unwrap()
}

fn edge_shapes() -> Vec<Shape> {
    vec![
        (2, 3, 1, [5, 6], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        // Widths around the 16 lanes, and not multiples of the AVX2 / AVX-512 widths.
        (1, 2, 1, [4, 15], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (1, 2, 1, [3, 16], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (1, 2, 1, [3, 17], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (1, 2, 1, [3, 33], [3, 3], [1, 1], [1, 1], [0, 0, 0, 0]),
        (2, 3, 1, [7, 71], [5, 5], [1, 1], [1, 1], [2, 2, 2, 2]),
        // 1x1 spatial, and a 1x1 kernel.
        (2, 4, 1, [1, 1], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (2, 4, 1, [1, 1], [1, 1], [1, 1], [1, 1], [0, 0, 0, 0]),
        (2, 3, 1, [6, 9], [1, 1], [2, 2], [1, 1], [0, 0, 0, 0]),
        // Pads larger than kernel - 1 (outputs that read nothing), asymmetric pads.
        (1, 2, 1, [3, 4], [2, 2], [1, 1], [1, 1], [3, 4, 2, 5]),
        (2, 2, 1, [6, 20], [3, 3], [1, 1], [1, 1], [0, 2, 1, 0]),
        // Stride 2 (even and odd widths), stride 3, dilation 2.
        (2, 3, 1, [9, 40], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
        (2, 3, 1, [8, 37], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
        (1, 2, 1, [10, 50], [5, 5], [3, 3], [1, 1], [2, 2, 2, 2]),
        (2, 2, 1, [9, 41], [3, 3], [1, 1], [2, 2], [2, 2, 2, 2]),
        (1, 2, 1, [11, 43], [3, 3], [2, 2], [2, 2], [2, 1, 2, 1]),
        // ConvNeXt's 7x7, a channel multiplier, a kernel as large as the padded input.
        (2, 3, 1, [14, 14], [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),
        (2, 3, 2, [7, 20], [3, 3], [1, 2], [1, 1], [1, 1, 1, 1]),
        (1, 2, 3, [4, 5], [6, 7], [1, 1], [1, 1], [1, 1, 1, 1]),
        // Empty batch, and an empty input grid padded into an output.
        (0, 3, 1, [5, 5], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (2, 2, 1, [0, 5], [2, 2], [1, 1], [1, 1], [1, 1, 1, 1]),
        // Big enough for several tasks (the threaded path).
        (2, 16, 1, [48, 48], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (3, 24, 1, [40, 40], [5, 5], [2, 2], [1, 1], [2, 2, 2, 2]),
    ]
}

fn data(len: usize, seed: u64) -> Vec<f32> {
    let mut u = uniform(seed);
    (0..len).map(|_| u() as f32).collect()
}

/// The bits, every NaN as one value (which NaN an operation gives is not promised).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| if f.is_nan() { u32::MAX } else { f.to_bits() }).collect()
}

fn pools() -> Vec<(&'static str, Box<dyn Parallelism>)> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let pool: &'static rayon::ThreadPool = Box::leak(Box::new(pool));
    vec![("sequential", Box::new(Sequential)), ("3 threads", Box::new(RayonPool(Some(pool))))]
}

/// Every level and pool equals the reference bit for bit on `s`.
fn fast_is_reference(s: &Shape, seed: u64, with_bias: bool) {
    fast_is_reference_with(s, seed, with_bias, false);
}

/// [`fast_is_reference`], with infinities and NaNs among the data where `specials`.
fn fast_is_reference_with(s: &Shape, seed: u64, with_bias: bool, specials: bool) {
    let d = dims(s);
    let len = |v: Vec<usize>| v.iter().product::<usize>();
    let (mut x, mut w, mut dy) =
        (data(len(d.x_shape()), seed), data(len(d.w_shape()), seed + 1), data(len(d.y_shape()), seed + 2));
    if specials {
        for (i, v) in [&mut x, &mut w, &mut dy].into_iter().enumerate() {
            let step = 7 + 4 * i;
            for (k, e) in v.iter_mut().enumerate().skip(i).step_by(step) {
                *e = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][k % 3];
            }
        }
    }
    let b = data(d.out_channels(), seed + 3);
    let bias = with_bias.then_some(&b[..]);
    let mut y_ref = vec![f32::NAN; dy.len()];
    let mut dx_ref = vec![f32::NAN; x.len()];
    let mut dw_ref = vec![f32::NAN; w.len()];
    reference::forward(&d, &x, &w, bias, &mut y_ref);
    reference::input_grad(&d, &dy, &w, &mut dx_ref);
    reference::weight_grad(&d, &x, &dy, &mut dw_ref);
    for level in available_levels() {
        for (name, par) in pools() {
            let at = format!("{s:?} at {level:?}, {name}");
            let mut y = vec![f32::NAN; dy.len()];
            forward_at(level, &d, &x, &w, bias, &mut y, par.as_ref()).unwrap();
            assert_eq!(bits(&y), bits(&y_ref), "forward {at}");
            let mut dx = vec![f32::NAN; x.len()];
            input_grad_at(level, &d, &dy, &w, &mut dx, par.as_ref()).unwrap();
            assert_eq!(bits(&dx), bits(&dx_ref), "input gradient {at}");
            let mut dw = vec![f32::NAN; w.len()];
            weight_grad_at(level, &d, &x, &dy, &mut dw, par.as_ref()).unwrap();
            assert_eq!(bits(&dw), bits(&dw_ref), "weight gradient {at}");
        }
    }
}

#[test]
fn every_level_and_thread_count_is_the_reference_on_edge_shapes() {
    for (i, s) in edge_shapes().iter().enumerate() {
        fast_is_reference(s, 17 + i as u64, i % 2 == 0);
    }
}

/// Float64 sums of every term, and of their magnitudes, with the term count, by a
/// formulation of their own: the forward's terms visited output by output, and each term
/// `w * x * g` credited to `Y`, `dX` and `dW` at once (the convolution's definition).
struct Exact {
    y: Vec<(f64, f64, usize)>,
    dx: Vec<(f64, f64, usize)>,
    dw: Vec<(f64, f64, usize)>,
}

fn exact(d: &DepthwiseDims, x: &[f32], w: &[f32], bias: Option<&[f32]>, dy: &[f32]) -> Exact {
    let [n_, c_, ih_, iw_] = <[usize; 4]>::try_from(d.x_shape()).unwrap();
    let [_, m_, oh_, ow_] = <[usize; 4]>::try_from(d.y_shape()).unwrap();
    let [_, _, kh_, kw_] = <[usize; 4]>::try_from(d.w_shape()).unwrap();
    let mult = m_ / c_;
    let mut e =
        Exact { y: vec![(0.0, 0.0, 0); dy.len()], dx: vec![(0.0, 0.0, 0); x.len()], dw: vec![(0.0, 0.0, 0); w.len()] };
    let add = |t: &mut (f64, f64, usize), v: f64| {
        t.0 += v;
        t.1 += v.abs();
        t.2 += 1;
    };
    let geo = (d.strides, d.dilations, d.pads);
    for n in 0..n_ {
        for o in 0..m_ {
            let c = o / mult;
            for oh in 0..oh_ {
                for ow in 0..ow_ {
                    let yi = ((n * m_ + o) * oh_ + oh) * ow_ + ow;
                    for kh in 0..kh_ {
                        for kw in 0..kw_ {
                            let ih = (oh * geo.0[0] + kh * geo.1[0]) as i64 - geo.2[0] as i64;
                            let iw = (ow * geo.0[1] + kw * geo.1[1]) as i64 - geo.2[1] as i64;
                            if ih < 0 || iw < 0 || ih >= ih_ as i64 || iw >= iw_ as i64 {
                                continue;
                            }
                            let xi = ((n * c_ + c) * ih_ + ih as usize) * iw_ + iw as usize;
                            let wi = (o * kh_ + kh) * kw_ + kw;
                            let (xv, wv, g) = (f64::from(x[xi]), f64::from(w[wi]), f64::from(dy[yi]));
                            add(&mut e.y[yi], wv * xv);
                            add(&mut e.dx[xi], wv * g);
                            add(&mut e.dw[wi], g * xv);
                        }
                    }
                    if let Some(b) = bias {
                        add(&mut e.y[yi], f64::from(b[o]));
                    }
                }
            }
        }
    }
    e
}

/// `got` within `terms * eps * sum |terms|` of the exact sum (plus the rounding of each
/// product: `(terms + 1)` in all), element by element.
fn within(what: &str, got: &[f32], want: &[(f64, f64, usize)]) {
    for (i, (&g, &(sum, mag, terms))) in got.iter().zip(want).enumerate() {
        let bound = (terms as f64 + 1.0) * f64::from(f32::EPSILON) * mag;
        let err = (f64::from(g) - sum).abs();
        assert!(err <= bound, "{what}[{i}]: {g} vs exact {sum} (error {err:e}, bound {bound:e}, {terms} terms)");
    }
}

fn reference_is_exact_within_bound(s: &Shape, seed: u64) {
    let d = dims(s);
    let len = |v: Vec<usize>| v.iter().product::<usize>();
    let (x, w, dy) = (data(len(d.x_shape()), seed), data(len(d.w_shape()), seed + 1), data(len(d.y_shape()), seed + 2));
    let b = data(d.out_channels(), seed + 3);
    let e = exact(&d, &x, &w, Some(&b), &dy);
    let (mut y, mut dx, mut dw) = (vec![0f32; dy.len()], vec![0f32; x.len()], vec![0f32; w.len()]);
    reference::forward(&d, &x, &w, Some(&b), &mut y);
    reference::input_grad(&d, &dy, &w, &mut dx);
    reference::weight_grad(&d, &x, &dy, &mut dw);
    within("Y", &y, &e.y);
    within("dX", &dx, &e.dx);
    within("dW", &dw, &e.dw);
}

/// Non-finite weights or data take the general loops (which skip padded terms): still the
/// reference's bits, and a padded position never turns an infinite weight into a NaN.
#[test]
fn non_finite_values_give_the_reference_bits() {
    for (i, s) in edge_shapes().iter().enumerate() {
        fast_is_reference_with(s, 301 + i as u64, i % 2 == 1, true);
    }
    let s = (1, 1, 1, [3, 3], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]);
    let d = dims(&s);
    let (x, mut w) = (vec![1f32; 9], vec![0f32; 9]);
    w[0] = f32::INFINITY; // reads the padding at output (0, 0) only
    let mut y = vec![0f32; 9];
    forward(&d, &x, &w, None, &mut y, &Sequential).unwrap();
    assert_eq!(y[0], 0.0, "{y:?}");
    assert!(y[4].is_infinite(), "{y:?}");
}

#[test]
fn the_reference_is_the_float64_sum_within_the_rounding_bound() {
    for (i, s) in edge_shapes().iter().enumerate() {
        reference_is_exact_within_bound(s, 101 + i as u64);
    }
}

#[test]
fn bad_attributes_and_lengths_are_refused() {
    let geo = |kernel: Vec<usize>, group| ConvGeometry {
        strides: vec![1; kernel.len()],
        dilations: vec![1; kernel.len()],
        pads: vec![0; 2 * kernel.len()],
        kernel,
        group,
    };
    let e = DepthwiseDims::new(&geo(vec![3, 3], 2), 1, 4, 4, &[5, 5]).unwrap_err();
    assert!(matches!(e, ConvError::Attribute { name: "group", .. }), "{e}");
    let e = DepthwiseDims::new(&geo(vec![3], 4), 1, 4, 4, &[5]).unwrap_err();
    assert!(matches!(e, ConvError::Attribute { name: "kernel_shape", .. }), "{e}");
    let e = DepthwiseDims::new(&geo(vec![3, 3], 4), 1, 4, 6, &[5, 5]).unwrap_err();
    assert!(e.to_string().contains("multiple of the input channels"), "{e}");
    let e = DepthwiseDims::new(&geo(vec![3, 3], 4), 1, 4, 4, &[2, 5]).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    let huge = ConvGeometry { pads: vec![usize::MAX / 2, 0, usize::MAX / 2, 0], ..geo(vec![3, 3], 4) };
    assert!(matches!(DepthwiseDims::new(&huge, 1, 4, 4, &[5, 5]), Err(ConvError::Attribute { name: "pads", .. })));
    let d = DepthwiseDims::new(&geo(vec![3, 3], 4), 1, 4, 4, &[5, 5]).unwrap();
    let (x, w) = (vec![0f32; 100], vec![0f32; 36]);
    let mut y = vec![0f32; 35];
    let e = forward(&d, &x, &w, None, &mut y, &Sequential).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "Y", got: 35, expected: 36 });
    let mut dw = vec![0f32; 36];
    let e = weight_grad(&d, &x[..99], &y, &mut dw, &Sequential).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "X", got: 99, expected: 100 });
}

fn shapes() -> impl Strategy<Value = Shape> {
    (
        (0usize..3, 1usize..4, 1usize..3),
        ([1usize..9, 0usize..40], [1usize..6, 1usize..6]),
        ([1usize..4, 1usize..4], [1usize..3, 1usize..3], [0usize..5, 0usize..5, 0usize..5, 0usize..5]),
    )
        .prop_filter_map("the kernel must fit the padded input", |((n, c, m), (i, k), (s, dl, p))| {
            let fits = (0..2).all(|a| i[a] + p[a] + p[a + 2] > (k[a] - 1) * dl[a]);
            fits.then_some((n, c, m, i, k, s, dl, p))
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_shapes_are_the_reference_and_within_bound(s in shapes(), seed in any::<u64>(), bias in any::<bool>()) {
        fast_is_reference(&s, seed, bias);
        reference_is_exact_within_bound(&s, seed);
    }
}

#[test]
#[ignore = "timing, by hand: cargo test --release -p trainops-kernels depthwise_timing -- --ignored --nocapture"]
fn depthwise_timing() {
    let best = |f: &mut dyn FnMut()| {
        (0..20)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    for s in [
        (16, 16, 1, [64, 64], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1]),
        (16, 88, 1, [16, 16], [3, 3], [1, 1], [1, 1], [1, 1, 1, 1]),
        (16, 240, 1, [8, 8], [5, 5], [1, 1], [1, 1], [2, 2, 2, 2]),
        (16, 576, 1, [4, 4], [5, 5], [1, 1], [1, 1], [2, 2, 2, 2]),
        (8, 96, 1, [32, 32], [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),
        (8, 192, 1, [16, 16], [7, 7], [1, 1], [1, 1], [3, 3, 3, 3]),
    ] {
        let d = dims(&s);
        let len = |v: Vec<usize>| v.iter().product::<usize>();
        let (x, w, dy) = (data(len(d.x_shape()), 1), data(len(d.w_shape()), 2), data(len(d.y_shape()), 3));
        let (mut y, mut dx, mut dw) = (vec![0f32; dy.len()], vec![0f32; x.len()], vec![0f32; w.len()]);
        for level in available_levels() {
            let f = best(&mut || forward_at(level, &d, &x, &w, None, &mut y, &Sequential).unwrap());
            let i = best(&mut || input_grad_at(level, &d, &dy, &w, &mut dx, &Sequential).unwrap());
            let g = best(&mut || weight_grad_at(level, &d, &x, &dy, &mut dw, &Sequential).unwrap());
            println!("{s:?} {level:?}: fwd {:.0} us, dX {:.0} us, dW {:.0} us", f * 1e6, i * 1e6, g * 1e6);
        }
    }
}
