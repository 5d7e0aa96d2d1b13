//! The fast path against the float64 reference, and the reference against finite
//! differences of a float64 forward written here from ONNX's equations.

use super::reference::{self, Grads};
use super::*;
use crate::test_util::uniform;
use crate::{RayonPool, Sequential};

thread_local! {
    /// Set by a test: this thread's element loops run the portable code, not AVX2's.
    pub(super) static PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Random inputs of one case: X, W, R, B, initial_h, dY, dY_h (scaled to keep gates alive).
pub(super) struct Case {
    pub(super) sh: GruShape,
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) r: Vec<f32>,
    pub(super) b: Vec<f32>,
    pub(super) h0: Vec<f32>,
    pub(super) dy: Vec<f32>,
    pub(super) dyh: Vec<f32>,
}

pub(super) fn case(sh: GruShape, seed: u64) -> Case {
    let mut u = uniform(seed);
    let [lx, lw, lr, lb, lh, ly] = sh.lens();
    let mut v = |n: usize, scale: f64| (0..n).map(|_| (2.0 * scale * u()) as f32).collect::<Vec<f32>>();
    Case {
        x: v(lx, 1.0),
        w: v(lw, 0.8),
        r: v(lr, 0.8),
        b: v(lb, 0.5),
        h0: v(lh, 0.8),
        dy: v(ly, 1.0),
        dyh: v(lh, 1.0),
        sh,
    }
}

/// The forward in float64: Y `[seq, dirs, batch, hidden]` (Y_h is its last step per direction).
fn forward(c: &Case, p: [&[f64]; 5], use_b: bool, use_h0: bool) -> Vec<f64> {
    let [x, w, r, b, h0] = p;
    let sh = &c.sh;
    let (tn, bn, inn, hn, dn) = (sh.seq, sh.batch, sh.input, sh.hidden, sh.direction.count());
    let mut y = vec![0.0; tn * dn * bn * hn];
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    for d in 0..dn {
        let bias = |k: usize| if use_b { b[d * 6 * hn + k] } else { 0.0 };
        let mut h: Vec<f64> = (0..bn * hn).map(|k| if use_h0 { h0[d * bn * hn + k] } else { 0.0 }).collect();
        for s in 0..tn {
            let t = if sh.direction.reversed(d) { tn - 1 - s } else { s };
            let mut hn_ = vec![0.0; bn * hn];
            for bb in 0..bn {
                let xw = |q: usize, j: usize| -> f64 {
                    (0..inn).map(|c| x[(t * bn + bb) * inn + c] * w[(d * 3 * hn + q * hn + j) * inn + c]).sum()
                };
                let hr = |q: usize, j: usize, v: &dyn Fn(usize) -> f64| -> f64 {
                    (0..hn).map(|k| v(k) * r[(d * 3 * hn + q * hn + j) * hn + k]).sum()
                };
                let hp = |k: usize| h[bb * hn + k];
                let z: Vec<f64> = (0..hn).map(|j| sig(xw(0, j) + hr(0, j, &hp) + bias(j) + bias(3 * hn + j))).collect();
                let rg: Vec<f64> =
                    (0..hn).map(|j| sig(xw(1, j) + hr(1, j, &hp) + bias(hn + j) + bias(4 * hn + j))).collect();
                for j in 0..hn {
                    let a = if sh.linear_before_reset {
                        xw(2, j) + rg[j] * (hr(2, j, &hp) + bias(5 * hn + j)) + bias(2 * hn + j)
                    } else {
                        xw(2, j) + hr(2, j, &|k| rg[k] * hp(k)) + bias(5 * hn + j) + bias(2 * hn + j)
                    };
                    hn_[bb * hn + j] = (1.0 - z[j]) * a.tanh() + z[j] * hp(j);
                }
            }
            h = hn_;
            y[(t * dn + d) * bn * hn..(t * dn + d + 1) * bn * hn].copy_from_slice(&h);
        }
    }
    y
}

fn to64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&e| f64::from(e)).collect()
}

fn y32(c: &Case, use_b: bool, use_h0: bool) -> Vec<f32> {
    let y = forward(c, [&to64(&c.x), &to64(&c.w), &to64(&c.r), &to64(&c.b), &to64(&c.h0)], use_b, use_h0);
    y.iter().map(|&v| v as f32).collect()
}

pub(super) fn inputs<'a>(c: &'a Case, y: &'a [f32], use_b: bool, use_h0: bool, dy: bool, dyh: bool) -> GruGradIn<'a> {
    GruGradIn {
        x: &c.x,
        w: &c.w,
        r: &c.r,
        b: use_b.then_some(&c.b[..]),
        initial_h: use_h0.then_some(&c.h0[..]),
        y,
        dy: dy.then_some(&c.dy[..]),
        dy_h: dyh.then_some(&c.dyh[..]),
        gates: None,
    }
}

pub(super) fn fast(c: &Case, i: &GruGradIn<'_>, par: &dyn Parallelism) -> [Vec<f32>; 5] {
    let [lx, lw, lr, lb, lh, _] = c.sh.lens();
    // NaN-filled: every element must be written.
    let mut out = [vec![f32::NAN; lx], vec![f32::NAN; lw], vec![f32::NAN; lr], vec![f32::NAN; lb], vec![f32::NAN; lh]];
    let [dx, dw, dr, db, dh0] = &mut out;
    let o = GruGradOut { dx: Some(dx), dw: Some(dw), dr: Some(dr), db: Some(db), dh0: Some(dh0) };
    gru_grad(&c.sh, i, o, par).unwrap();
    out
}

/// `|got - want| <= tol * (1 + max|want|)` element by element.
pub(super) fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = 1.0 + want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() <= tol * scale, "{what}[{k}]: {g} vs {w} (scale {scale})");
    }
}

pub(super) fn shape(
    seq: usize,
    batch: usize,
    input: usize,
    hidden: usize,
    direction: Direction,
    lbr: bool,
) -> GruShape {
    GruShape { seq, batch, input, hidden, direction, linear_before_reset: lbr }
}

fn compare(sh: GruShape, seed: u64, use_b: bool, use_h0: bool, dy: bool, dyh: bool) {
    let c = case(sh, seed);
    let y = y32(&c, use_b, use_h0);
    let i = inputs(&c, &y, use_b, use_h0, dy, dyh);
    let want: Grads = reference::gru_grad(&c.sh, &i).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
        let [dx, dw, dr, db, dh0] = fast(&c, &i, par);
        let tag = format!("{sh:?} b={use_b} h0={use_h0} dy={dy} dyh={dyh}");
        close(&format!("dX {tag}"), &dx, &want.dx, 2e-5);
        close(&format!("dW {tag}"), &dw, &want.dw, 2e-5);
        close(&format!("dR {tag}"), &dr, &want.dr, 2e-5);
        close(&format!("dB {tag}"), &db, &want.db, 2e-5);
        close(&format!("dh0 {tag}"), &dh0, &want.dh0, 2e-5);
    }
}

pub(super) const DIRS: [Direction; 3] = [Direction::Forward, Direction::Reverse, Direction::Bidirectional];

#[test]
fn fast_matches_reference_on_small_and_edge_sizes() {
    let mut seed = 1;
    for &(t, b, i, h) in &[(1, 1, 1, 1), (3, 1, 2, 1), (1, 4, 3, 5), (4, 3, 5, 7), (5, 2, 1, 3), (2, 9, 4, 17)] {
        for dir in DIRS {
            for lbr in [false, true] {
                seed += 1;
                compare(shape(t, b, i, h, dir, lbr), seed, true, true, true, true);
            }
        }
    }
}

#[test]
fn optional_inputs_absent() {
    for lbr in [false, true] {
        for (k, &(b, h0, dy, dyh)) in
            [(false, false, true, false), (true, false, false, true), (false, true, true, true)].iter().enumerate()
        {
            compare(shape(3, 2, 3, 4, Direction::Bidirectional, lbr), 50 + k as u64, b, h0, dy, dyh);
        }
    }
}

#[test]
fn large_enough_to_split_the_gemms() {
    // seq * batch rows and the per-step GEMM both above GEMM_TASK_MACS: tasks on the pool.
    for lbr in [false, true] {
        compare(shape(6, 40, 24, 33, Direction::Forward, lbr), 77, true, true, true, true);
    }
}

#[test]
fn empty_sizes_give_zero_gradients() {
    for &(t, b, i, h) in &[(0, 2, 3, 4), (3, 0, 3, 4), (3, 2, 0, 4), (3, 2, 3, 0)] {
        let c = case(shape(t, b, i, h, Direction::Bidirectional, true), 9);
        let y = y32(&c, true, true);
        let inp = inputs(&c, &y, true, true, true, true);
        let want = reference::gru_grad(&c.sh, &inp).unwrap();
        let [dx, dw, dr, db, dh0] = fast(&c, &inp, &Sequential);
        for (name, got, want) in [
            ("dX", &dx, &want.dx),
            ("dW", &dw, &want.dw),
            ("dR", &dr, &want.dr),
            ("dB", &db, &want.db),
            ("dh0", &dh0, &want.dh0),
        ] {
            close(&format!("{name} {t} {b} {i} {h}"), got, want, 1e-6);
        }
    }
}

#[test]
fn reference_matches_finite_differences() {
    // loss = sum(dY * Y) + sum(dY_h * Y_h), Y from the float64 forward above.
    for dir in DIRS {
        for lbr in [false, true] {
            let c = case(shape(3, 2, 2, 3, dir, lbr), 21);
            let y = y32(&c, true, true);
            let g = reference::gru_grad(&c.sh, &inputs(&c, &y, true, true, true, true)).unwrap();
            let (dn, bh) = (dir.count(), c.sh.batch * c.sh.hidden);
            let loss = |p: &[Vec<f64>; 5]| -> f64 {
                let y = forward(&c, [&p[0], &p[1], &p[2], &p[3], &p[4]], true, true);
                let mut l: f64 = y.iter().zip(&c.dy).map(|(a, b)| a * f64::from(*b)).sum();
                for d in 0..dn {
                    let last = if dir.reversed(d) { 0 } else { c.sh.seq - 1 };
                    let yh = &y[(last * dn + d) * bh..(last * dn + d + 1) * bh];
                    l += yh.iter().zip(&c.dyh[d * bh..]).map(|(a, b)| a * f64::from(*b)).sum::<f64>();
                }
                l
            };
            let base = [to64(&c.x), to64(&c.w), to64(&c.r), to64(&c.b), to64(&c.h0)];
            for (q, want) in [&g.dx, &g.dw, &g.dr, &g.db, &g.dh0].into_iter().enumerate() {
                for k in 0..base[q].len() {
                    let (mut up, mut down) = (base.clone(), base.clone());
                    up[q][k] += 1e-6;
                    down[q][k] -= 1e-6;
                    let fd = (loss(&up) - loss(&down)) / 2e-6;
                    assert!(
                        (fd - want[k]).abs() < 1e-6 * (1.0 + fd.abs()),
                        "{dir:?} lbr={lbr} input {q}[{k}]: {fd} vs {}",
                        want[k]
                    );
                }
            }
        }
    }
}

#[test]
fn wrong_lengths_are_errors() {
    let c = case(shape(2, 2, 3, 4, Direction::Forward, false), 3);
    let y = y32(&c, true, true);
    let mut i = inputs(&c, &y, true, true, true, true);
    i.r = &c.r[1..];
    let err = gru_grad(&c.sh, &i, GruGradOut::default(), &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "R", got: 47, expected: 48 });
    let i = inputs(&c, &y, true, true, true, true);
    let mut dx = vec![0.0; 5];
    let o = GruGradOut { dx: Some(&mut dx), ..GruGradOut::default() };
    assert!(matches!(gru_grad(&c.sh, &i, o, &Sequential), Err(KernelError::LengthMismatch { what: "dX", .. })));
    assert!(reference::gru_grad(&shape(2, 2, 3, 5, Direction::Forward, false), &i).is_err());
}

#[test]
fn exp_and_activations_are_close() {
    let mut x = -100.0f32;
    while x < 100.0 {
        let e = f64::from(exp_f32(x));
        let want = f64::from(x.clamp(-87.0, 87.0)).exp();
        assert!((e - want).abs() <= 4e-7 * want, "exp({x}) = {e} vs {want}");
        assert!((f64::from(sigmoid(x)) - 1.0 / (1.0 + (-f64::from(x)).exp())).abs() < 2e-7, "sigmoid({x})");
        assert!((f64::from(tanh(x)) - f64::from(x).tanh()).abs() < 3e-7, "tanh({x})");
        x += 0.0137;
    }
}

#[test]
fn portable_element_loops_give_the_avx2_bits() {
    // The same operations either way (no contraction into FMA): equal bits.
    for lbr in [false, true] {
        let c = case(shape(5, 3, 4, 19, Direction::Bidirectional, lbr), 31);
        let y = y32(&c, true, true);
        let i = inputs(&c, &y, true, true, true, true);
        let wide = fast(&c, &i, &Sequential);
        PORTABLE.with(|p| p.set(true));
        let portable = fast(&c, &i, &Sequential);
        PORTABLE.with(|p| p.set(false));
        for (a, b) in wide.iter().zip(&portable) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "lbr={lbr}");
        }
    }
}

/// `hidden_size` and an empty X's dimensions may be anything up to 2^63 - 1: the counts are
/// checked (an error naming the tensor, never a wrapped length), and an empty sequence
/// sizes nothing by its huge batch.
#[test]
fn huge_sizes_are_checked_and_empty_sequences_allocate_nothing() {
    let sh = |seq, batch, input, hidden| GruShape {
        seq,
        batch,
        input,
        hidden,
        direction: Direction::Forward,
        linear_before_reset: false,
    };
    // 3 * 2^62 * 2^62 overflows (R), and 4 * 2^62 (a row of the gates).
    let e = sh(1, 1, 1, 1 << 62).checked_lens().unwrap_err();
    assert!(
        matches!(&e, KernelError::Overflow { what } if what.starts_with("R (dirs, 3 hidden_size, hidden_size)")),
        "{e}"
    );
    assert!(sh(1, 1, 0, 1 << 62).checked_gates_len().is_err());
    assert_eq!(sh(1, 1, 1, 1 << 62).lens(), [usize::MAX; 6]);
    let huge = sh(0, 1 << 40, 0, 2);
    let (x, w, r, dyh) = (vec![], vec![], vec![0.5; 12], vec![]);
    let i =
        GruGradIn { x: &x, w: &w, r: &r, b: None, initial_h: None, y: &[], dy: None, dy_h: Some(&dyh), gates: None };
    // dY_h for 2^40 rows cannot be given: a length error, before anything is allocated.
    let e = gru_grad(&huge, &i, GruGradOut::default(), &Sequential).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "dY_h", got: 0, expected: 1 << 41 });
    let i = GruGradIn { dy_h: None, ..i };
    let mut dr = vec![f32::NAN; 12];
    gru_grad(&huge, &i, GruGradOut { dr: Some(&mut dr), ..Default::default() }, &Sequential).unwrap();
    assert_eq!(dr, [0.0; 12]);
    let ti = forward::GruTrainIn { x: &x, w: &w, r: &r, b: None, initial_h: None };
    forward::gru_train(&huge, &ti, forward::GruTrainOut { y: &mut [], y_h: None, gates: &mut [] }, &Sequential)
        .unwrap();
}
