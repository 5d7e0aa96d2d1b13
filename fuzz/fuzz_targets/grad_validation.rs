//! The gradient kernels' attribute and shape validation (`trainops_kernels::grad`, which the
//! com.trainops *Grad ops call before allocating), on arbitrary attributes and shapes:
//! pads, strides, dilations, kernel sizes and hidden sizes up to `u64::MAX` (a negative int64
//! read as unsigned among them), dimensions of empty tensors that multiply past 64 bits.
//!
//! Each check is compared with the same arithmetic done here in `u128` (it must accept
//! exactly what fits, and compute the same output shape); nothing may panic. The kernels
//! themselves run only when the validated sizes are small (at most `CAP` elements per buffer,
//! `WORK` multiply-adds): their working memory is bounded by those sizes, so libFuzzer's
//! malloc limit catches any allocation sized by an attribute. With sizes beyond the cap they
//! are called with buffers of the wrong length, which they must refuse before allocating.
#![no_main]

// Only `Scrambled` of the shared helpers is used here.
#[allow(dead_code)]
mod common;

use common::Scrambled;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use trainops_kernels::grad::batchnorm::{batch_norm_train_grad, BnGrads, BnShape};
use trainops_kernels::grad::conv::{self, ConvDims, ConvError, ConvGeometry};
use trainops_kernels::grad::pool::{check_pooled, max_pool_grad, max_pool_grad_from_input, PoolGradError, Window};
use trainops_kernels::grad::rnn::forward::{gru_train, GruTrainIn, GruTrainOut};
use trainops_kernels::grad::rnn::{gru_grad, Direction, GruGradIn, GruGradOut, GruShape};
use trainops_kernels::grad::softmax::{softmax_grad, Dims, Kind};
use trainops_kernels::shape;
use trainops_kernels::{KernelError, Level};

/// Most elements a buffer made here may have.
const CAP: u128 = 4096;
/// Most multiply-adds a kernel run here may do.
const WORK: u128 = 1 << 20;
const I64_MAX: u128 = i64::MAX as u128;

/// An attribute value or dimension: mostly small, often a power of two near the limits, or
/// anything (a negative int64 read as unsigned included).
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Val {
    Small(u8),
    Pow(u8, u8),
    Any(u64),
}

impl Val {
    fn get(self) -> usize {
        match self {
            Val::Small(v) => usize::from(v % 9),
            Val::Pow(p, below) => (1u64 << (p % 64)).wrapping_sub(u64::from(below % 4)) as usize,
            Val::Any(v) => v as usize,
        }
    }
}

fn vals(v: &[Val], n: usize) -> Vec<usize> {
    v.iter().take(n).map(|x| x.get()).collect()
}

fn product(v: &[u128]) -> u128 {
    v.iter().fold(1u128, |n, &d| n.saturating_mul(d))
}

/// Deterministic float data from a seed (no allocation beyond `n`).
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32) / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[derive(Debug, Arbitrary)]
struct ConvCase {
    rank: u8,
    kernel: Vec<Val>,
    strides: Vec<Val>,
    dilations: Vec<Val>,
    pads: Vec<Val>,
    group: Val,
    batch: Val,
    channels: Val,
    out_channels: Val,
    input: Vec<Val>,
    seed: u64,
    par: u8,
}

/// The convolution's output shape by its definition in `u128`, or `None` where the kernels
/// must refuse (an attribute out of range, a kernel that does not fit, a size past 64 bits).
fn conv_reference(g: &ConvGeometry, n: usize, c: usize, m: usize, input: &[usize]) -> Option<Vec<u128>> {
    let d = g.kernel.len();
    let w = |v: &usize| *v as u128;
    if d == 0 || g.strides.len() != d || g.dilations.len() != d || g.pads.len() != 2 * d || input.len() != d {
        return None;
    }
    let lists = [&g.kernel, &g.strides, &g.dilations, &g.pads];
    if lists.iter().any(|l| l.iter().any(|v| w(v) > I64_MAX)) || [&g.kernel, &g.strides, &g.dilations].iter().any(|l| l.contains(&0)) {
        return None;
    }
    if g.group == 0 || w(&g.group) > I64_MAX || c % g.group != 0 || m % g.group != 0 {
        return None;
    }
    let mut out = Vec::new();
    for j in 0..d {
        let padded = w(&input[j]) + w(&g.pads[j]) + w(&g.pads[j + d]);
        let span = (w(&g.kernel[j]) - 1) * w(&g.dilations[j]);
        if padded > I64_MAX || span >= I64_MAX || span + 1 > padded {
            return None;
        }
        out.push((padded - span - 1) / w(&g.strides[j]) + 1);
    }
    let cg = (c / g.group) as u128;
    let kernel: Vec<u128> = g.kernel.iter().map(w).collect();
    let inp: Vec<u128> = input.iter().map(w).collect();
    let (kl, ol) = (product(&kernel), product(&out));
    let count = |dims: &[u128]| if dims.contains(&0) { 0 } else { product(dims) };
    let x: Vec<u128> = [n as u128, c as u128].into_iter().chain(inp.iter().copied()).collect();
    let y: Vec<u128> = [n as u128, m as u128].into_iter().chain(out.iter().copied()).collect();
    let wt: Vec<u128> = [m as u128, cg].into_iter().chain(kernel.iter().copied()).collect();
    let fits = |dims: &[u128]| count(dims) <= u64::MAX as u128 && dims.iter().all(|&v| v <= I64_MAX);
    let col = cg.saturating_mul(kl).saturating_mul(ol.saturating_add(256 + 16));
    if kl > u64::MAX as u128 || count(&inp) > u64::MAX as u128 || ol.saturating_add(256 + 16) > u64::MAX as u128 {
        return None;
    }
    if !fits(&x) || !fits(&y) || !fits(&wt) || cg * kl > u64::MAX as u128 || col > u64::MAX as u128 {
        return None;
    }
    Some(out)
}

fn fuzz_conv(case: &ConvCase) {
    let d = usize::from(case.rank % 4);
    let geo = ConvGeometry {
        kernel: vals(&case.kernel, d),
        strides: vals(&case.strides, d),
        dilations: vals(&case.dilations, d),
        pads: vals(&case.pads, 2 * d),
        group: case.group.get(),
    };
    let (n, c, m) = (case.batch.get(), case.channels.get(), case.out_channels.get());
    let input = vals(&case.input, d);
    let want = conv_reference(&geo, n, c, m, &input);
    let dims = match ConvDims::new(&geo, n, c, m, &input) {
        Ok(dims) => dims,
        Err(e) => {
            assert!(want.is_none(), "{geo:?} {n} {c} {m} {input:?}: refused ({e}), the reference says {want:?}");
            if let ConvError::Attribute { name, .. } = e {
                assert!(["kernel_shape", "strides", "dilations", "pads", "group"].contains(&name));
            }
            return;
        }
    };
    let want = want.unwrap_or_else(|| panic!("{geo:?} {n} {c} {m} {input:?}: accepted, the reference refuses"));
    let (xs, ys, ws) = (dims.x_shape(), dims.y_shape(), dims.w_shape());
    assert_eq!(ys[2..].iter().map(|&v| v as u128).collect::<Vec<_>>(), want);
    let len = |s: &[usize]| shape::numel(s).expect("checked") as u128;
    let (xl, yl, wl) = (len(&xs), len(&ys), len(&ws));
    let (kl, ol) = (product(&geo.kernel.iter().map(|&v| v as u128).collect::<Vec<_>>()), product(&want));
    let cg = (c / geo.group) as u128;
    let work = (n as u128).saturating_mul(m as u128).saturating_mul(cg).saturating_mul(kl).saturating_mul(ol);
    let par = Scrambled(case.par);
    if xl <= CAP && yl <= CAP && wl <= CAP && work <= WORK && kl.saturating_mul(ol) <= CAP * 16 {
        let (x, dy, w) = (data(xl as usize, case.seed), data(yl as usize, case.seed ^ 1), data(wl as usize, case.seed ^ 2));
        let mut dw = vec![f32::NAN; wl as usize];
        conv::weight_grad(&dims, &x, &dy, &mut dw, &par).expect("validated sizes run");
        let mut dx = vec![f32::NAN; xl as usize];
        conv::input_grad(&dims, &dy, &w, &mut dx, &par).expect("validated sizes run");
        // Against the float64 definition, within the float32 summation bound.
        let eps = f64::from(f32::EPSILON);
        let (rw, mw) = conv::reference::weight_grad(&dims, &x, &dy);
        let terms = (n as f64) * ol as f64;
        for ((&g, &r), &mg) in dw.iter().zip(&rw).zip(&mw) {
            assert!((f64::from(g) - r).abs() <= terms * eps * mg + f64::MIN_POSITIVE, "dW {g} vs {r}");
        }
        let (rx, mx) = conv::reference::input_grad(&dims, &dy, &w);
        let terms = (m / geo.group) as f64 * kl as f64;
        for ((&g, &r), &mg) in dx.iter().zip(&rx).zip(&mx) {
            assert!((f64::from(g) - r).abs() <= terms * eps * mg + f64::MIN_POSITIVE, "dX {g} vs {r}");
        }
    } else {
        // Sizes past the cap: buffers of the wrong length are refused before anything is
        // allocated (or, all three empty, there is nothing to do).
        let short = [0f32; 1];
        let r = conv::weight_grad(&dims, &short, &short, &mut [0f32; 1], &par);
        assert!(matches!(r, Err(KernelError::LengthMismatch { .. })) || (xl, yl, wl) == (1, 1, 1));
        let r = conv::input_grad(&dims, &[], &[], &mut [], &par);
        assert!(r.is_err() || (xl, yl, wl) == (0, 0, 0) || (yl == 0 && wl == 0 && xl == 0));
    }
}

#[derive(Debug, Arbitrary)]
struct PoolCase {
    rank: u8,
    kernel: Vec<Val>,
    strides: Vec<Val>,
    dilations: Vec<Val>,
    pads: Vec<Val>,
    input: Vec<Val>,
    output: Vec<Val>,
    planes: u8,
    ceil_mode: Option<bool>,
    use_reference_sizes: bool,
    seed: u64,
    par: u8,
}

/// MaxPool's (floor, ceil) output sizes in `u128`, or `None` where the kernels must refuse.
fn pool_reference(w: &Window, pad_end: &[usize], input: &[usize]) -> Option<Vec<(u128, u128)>> {
    let n = w.kernel.len();
    let big = |l: &[usize]| l.iter().any(|&v| v as u128 > I64_MAX);
    if !(1..=3).contains(&n) || [&w.strides, &w.dilations, &w.pad_begin].iter().any(|l| l.len() != n) {
        return None;
    }
    if [&w.kernel, &w.strides, &w.dilations].iter().any(|l| l.contains(&0)) || big(&w.kernel) || big(&w.strides) {
        return None;
    }
    if big(&w.dilations) || big(&w.pad_begin) || pad_end.len() != n || big(pad_end) || input.len() != n {
        return None;
    }
    (0..n)
        .map(|j| {
            let padded = input[j] as u128 + w.pad_begin[j] as u128 + pad_end[j] as u128;
            let span = (w.kernel[j] as u128 - 1) * w.dilations[j] as u128;
            if padded > I64_MAX || span >= I64_MAX || span + 1 > padded {
                return None;
            }
            let (rest, s) = (padded - span - 1, w.strides[j] as u128);
            Some((rest / s + 1, rest.div_ceil(s) + 1))
        })
        .collect()
}

/// MaxPool's gradient by brute force over every window step (small kernels only): the first
/// strict maximum (from below every finite value) of each window gets its gradient.
fn pool_brute_force(gy: &[f32], x: &[f32], planes: usize, inp: &[usize], out: &[usize], w: &Window) -> Vec<f32> {
    let (il, ol) = (inp.iter().product::<usize>(), out.iter().product::<usize>());
    let mut gx = vec![0f32; planes * il];
    for p in 0..planes {
        let mut oc = vec![0usize; out.len()];
        for j in 0..ol {
            let mut rem = j;
            for a in (0..out.len()).rev() {
                oc[a] = rem % out[a];
                rem /= out[a];
            }
            let (mut best, mut at) = (f32::MIN, None);
            let steps: usize = w.kernel.iter().product();
            for s in 0..steps {
                let (mut rem, mut flat, mut inside) = (s, 0usize, true);
                let mut ks = vec![0usize; out.len()];
                for a in (0..out.len()).rev() {
                    ks[a] = rem % w.kernel[a];
                    rem /= w.kernel[a];
                }
                for a in 0..out.len() {
                    let pos = oc[a] as i128 * w.strides[a] as i128 + ks[a] as i128 * w.dilations[a] as i128
                        - w.pad_begin[a] as i128;
                    inside &= (0..inp[a] as i128).contains(&pos);
                    flat = flat * inp[a] + if inside { pos as usize } else { 0 };
                }
                if inside && x[p * il + flat] > best {
                    best = x[p * il + flat];
                    at = Some(flat);
                }
            }
            if let Some(at) = at {
                gx[p * il + at] += gy[p * ol + j];
            }
        }
    }
    gx
}

fn fuzz_pool(case: &PoolCase) {
    let n = usize::from(case.rank % 4).max(usize::from(case.rank % 5 == 4) * 4);
    let pads = vals(&case.pads, 2 * n);
    let w = Window {
        kernel: vals(&case.kernel, n),
        strides: vals(&case.strides, n),
        dilations: vals(&case.dilations, n),
        pad_begin: pads.iter().take(n).copied().collect(),
    };
    let pad_end: Vec<usize> = pads.iter().skip(n).copied().collect();
    let input = vals(&case.input, n);
    let want = pool_reference(&w, &pad_end, &input);
    let sizes = match w.output_sizes(&pad_end, &input) {
        Ok(s) => s,
        Err(e) => {
            assert!(want.is_none(), "{w:?} {pad_end:?} {input:?}: refused ({e}), the reference says {want:?}");
            assert!(matches!(e, PoolGradError::Window { .. } | PoolGradError::Shape(_)), "{e}");
            return;
        }
    };
    let want = want.unwrap_or_else(|| panic!("{w:?} {pad_end:?} {input:?}: accepted, the reference refuses"));
    assert_eq!(sizes.iter().map(|&(f, c)| (f as u128, c as u128)).collect::<Vec<_>>(), want);
    let output: Vec<usize> = if case.use_reference_sizes {
        sizes.iter().zip(vals(&case.output, n)).map(|(&(f, c), v)| if v % 2 == 0 { f } else { c }).collect()
    } else {
        vals(&case.output, n)
    };
    let pooled = check_pooled(&w, &pad_end, &input, &output, case.ceil_mode);
    if let Ok(()) = pooled {
        for (j, (&o, &(f, c))) in output.iter().zip(&sizes).enumerate() {
            match case.ceil_mode {
                Some(false) => assert_eq!(o, f, "dimension {j}"),
                _ => assert!(o == f || o == c, "dimension {j}: {o} not in ({f}, {c})"),
            }
        }
    }
    // The kernel on small planes (any output sizes are safe for it).
    let planes = usize::from(case.planes % 4);
    let (il, ol) = (product(&input.iter().map(|&v| v as u128).collect::<Vec<_>>()), product(&output.iter().map(|&v| v as u128).collect::<Vec<_>>()));
    let par = Scrambled(case.par);
    if output.len() == n && il * planes as u128 <= CAP && ol * planes as u128 <= CAP && output.iter().all(|&o| (o as u128) <= CAP) {
        let (il, ol) = (il as usize, ol as usize);
        let (x, gy) = (data(planes * il, case.seed), data(planes * ol, case.seed ^ 3));
        let mut gx = vec![f32::NAN; planes * il];
        max_pool_grad_from_input(&gy, &x, planes, &input, &output, &w, &mut gx, &par).expect("small planes run");
        let steps = product(&w.kernel.iter().map(|&v| v as u128).collect::<Vec<_>>());
        if steps * ol as u128 * planes as u128 <= 1 << 16 {
            let want = pool_brute_force(&gy, &x, planes, &input, &output, &w);
            assert!(gx.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{gx:?} vs {want:?}");
        }
        // The Indices route on indices inside their planes agrees with a scatter.
        let idx: Vec<i64> = (0..planes * ol).map(|k| ((k / ol.max(1)) * il + k % il.max(1)) as i64).collect();
        let mut gx2 = vec![f32::NAN; planes * il];
        let r = max_pool_grad(&gy, &idx, planes, &mut gx2, &par);
        assert!(r.is_ok() || il == 0, "{r:?}");
    } else {
        // Huge planes: the wrong lengths are refused before anything is allocated.
        let r = max_pool_grad_from_input(&[0.0], &[0.0], 3, &input, &output, &w, &mut [0.0], &par);
        assert!(r.is_err());
    }
}

#[derive(Debug, Arbitrary)]
struct ShapeCase {
    dims: Vec<Val>,
    axis: u8,
    seq: Val,
    batch: Val,
    input: Val,
    hidden: Val,
    direction: u8,
    lbr: bool,
    seed: u64,
    par: u8,
}

fn fuzz_shapes(case: &ShapeCase) {
    let dims = vals(&case.dims, 6);
    let wide: Vec<u128> = dims.iter().map(|&v| v as u128).collect();
    let total = if wide.contains(&0) { 0 } else { product(&wide) };
    let par = Scrambled(case.par);
    // Element counts.
    match shape::numel(&dims) {
        Some(c) => assert_eq!(c as u128, total),
        None => assert!(total > u64::MAX as u128),
    }
    // BatchNorm's [N, C, S...].
    match BnShape::of(&dims) {
        Some(sh) => {
            assert!(dims.len() >= 2 && total <= u64::MAX as u128);
            assert_eq!(sh.len() as u128, total);
            if total <= CAP && sh.c as u128 <= CAP {
                let (x, dy, scale) = (data(sh.len(), case.seed), data(sh.len(), case.seed ^ 5), data(sh.c, 7));
                let (mut dx, mut ds, mut db) = (vec![0.0; sh.len()], vec![0.0; sh.c], vec![0.0; sh.c]);
                let out = BnGrads { dx: Some(&mut dx), dscale: Some(&mut ds), dbias: Some(&mut db) };
                batch_norm_train_grad(&dy, &x, &scale, 1e-5, sh, out, &par).expect("small shapes run");
            } else {
                let out = BnGrads { dx: None, dscale: Some(&mut [0.0]), dbias: None };
                let r = batch_norm_train_grad(&[], &[], &[0.0], 1e-5, sh, out, &par);
                assert!(r.is_err() || (sh.c == 1 && total == 0));
            }
        }
        None => assert!(dims.len() < 2 || total > u64::MAX as u128 || {
            let s = &wide[2..];
            !s.contains(&0) && product(s) > u64::MAX as u128
        }),
    }
    // Softmax's [outer, n, inner].
    if !dims.is_empty() {
        let axis = usize::from(case.axis) % dims.len();
        if let Some(d) = Dims::split(&dims, axis) {
            assert!(total <= u64::MAX as u128);
            if total <= CAP {
                let (dy, y) = (data(total as usize, case.seed), data(total as usize, case.seed ^ 9));
                let mut dx = vec![0.0; total as usize];
                softmax_grad(Level::Scalar, Kind::Softmax, d, &dy, &y, &mut dx, &par).expect("small shapes run");
            } else {
                assert!(softmax_grad(Level::Scalar, Kind::LogSoftmax, d, &[0.0], &[0.0], &mut [0.0], &par).is_err());
            }
        }
    }
    // GRU: every tensor's size, left to right (each dimension must fit on its own).
    let direction = [Direction::Forward, Direction::Reverse, Direction::Bidirectional][usize::from(case.direction % 3)];
    let sh = GruShape {
        seq: case.seq.get(),
        batch: case.batch.get(),
        input: case.input.get(),
        hidden: case.hidden.get(),
        direction,
        linear_before_reset: case.lbr,
    };
    let (t, b, i, h, d) = (sh.seq as u128, sh.batch as u128, sh.input as u128, sh.hidden as u128, direction.count() as u128);
    let ltr = |v: &[u128]| v.iter().try_fold(1u128, |n, &x| Some(n * x).filter(|&p| p <= u64::MAX as u128));
    let want = [ltr(&[t, b, i]), ltr(&[d, 3, h, i]), ltr(&[d, 3, h, h]), ltr(&[d, 6, h]), ltr(&[d, b, h]), ltr(&[t, d, b, h])];
    let gates = ltr(&[4, h]).and_then(|g| ltr(&[d, t, b, g]));
    match (sh.checked_lens(), sh.checked_gates_len()) {
        (Ok(lens), Ok(g)) => {
            assert!(want.iter().zip(lens).all(|(w, l)| *w == Some(l as u128)) && gates == Some(g as u128));
            let [lx, lw, lr, lb, lh, ly] = lens;
            let work = product(&[t, b, i + h, h, 3, d]);
            if lens.iter().all(|&l| l as u128 <= CAP) && g as u128 <= CAP && work <= WORK {
                let (x, w, r) = (data(lx, case.seed), data(lw, 11), data(lr, 12));
                let (b_, h0) = (data(lb, 13), data(lh, 14));
                let (mut y, mut yh, mut gs) = (vec![0.0; ly], vec![0.0; lh], vec![0.0; g]);
                let tin = GruTrainIn { x: &x, w: &w, r: &r, b: Some(&b_), initial_h: Some(&h0) };
                gru_train(&sh, &tin, GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut gs }, &par)
                    .expect("small shapes run");
                let dy = data(ly, 15);
                let gin = GruGradIn { x: &x, w: &w, r: &r, b: Some(&b_), initial_h: Some(&h0), y: &y, dy: Some(&dy), dy_h: None, gates: Some(&gs) };
                let (mut dx, mut dw) = (vec![0.0; lx], vec![0.0; lw]);
                gru_grad(&sh, &gin, GruGradOut { dx: Some(&mut dx), dw: Some(&mut dw), ..Default::default() }, &par)
                    .expect("small shapes run");
            } else {
                let gin = GruGradIn { x: &[0.0], w: &[], r: &[], b: None, initial_h: None, y: &[], dy: None, dy_h: None, gates: None };
                let r = gru_grad(&sh, &gin, GruGradOut::default(), &par);
                assert!(r.is_err() || lx == 1);
            }
        }
        (lens, g) => assert!(
            want.iter().any(Option::is_none) || gates.is_none(),
            "{sh:?}: refused ({lens:?}, {g:?}), the reference says {want:?} {gates:?}"
        ),
    }
}

#[derive(Debug, Arbitrary)]
enum Case {
    Conv(ConvCase),
    Pool(PoolCase),
    Shapes(ShapeCase),
}

fuzz_target!(|case: Case| {
    match &case {
        Case::Conv(c) => fuzz_conv(c),
        Case::Pool(c) => fuzz_pool(c),
        Case::Shapes(c) => fuzz_shapes(c),
    }
});
