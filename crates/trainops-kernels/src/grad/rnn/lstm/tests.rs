//! The fast forward and backward against the float64 reference, the reference's gradients
//! against finite differences of its forward, and equal bits across SIMD levels, thread
//! counts and reused working memory.

use super::reference;
use super::*;
use crate::grad::rnn::tests::PORTABLE;
use crate::test_util::uniform;
use crate::{RayonPool, Sequential};

/// Random inputs of one case: X, W, R, B, initial_h, initial_c, dY, dY_h, dY_c.
struct Case {
    sh: LstmShape,
    x: Vec<f32>,
    w: Vec<f32>,
    r: Vec<f32>,
    b: Vec<f32>,
    h0: Vec<f32>,
    c0: Vec<f32>,
    dy: Vec<f32>,
    dyh: Vec<f32>,
    dyc: Vec<f32>,
}

fn case(sh: LstmShape, seed: u64) -> Case {
    let mut u = uniform(seed);
    let [lx, lw, lr, lb, lh, ly] = sh.lens();
    let mut v = |n: usize, scale: f64| (0..n).map(|_| (2.0 * scale * u()) as f32).collect::<Vec<f32>>();
    Case {
        x: v(lx, 1.0),
        w: v(lw, 0.7),
        r: v(lr, 0.7),
        b: v(lb, 0.5),
        h0: v(lh, 0.8),
        c0: v(lh, 1.0),
        dy: v(ly, 1.0),
        dyh: v(lh, 1.0),
        dyc: v(lh, 1.0),
        sh,
    }
}

fn shape(seq: usize, batch: usize, input: usize, hidden: usize, direction: Direction) -> LstmShape {
    LstmShape { seq, batch, input, hidden, direction }
}

const DIRS: [Direction; 3] = [Direction::Forward, Direction::Reverse, Direction::Bidirectional];

/// Which optional inputs a case gives: B, initial_h, initial_c, dY, dY_h, dY_c.
#[derive(Clone, Copy)]
struct Given([bool; 6]);
const ALL: Given = Given([true; 6]);

fn train_in(c: &Case, g: Given) -> LstmTrainIn<'_> {
    let [b, h0, c0, ..] = g.0;
    LstmTrainIn {
        x: &c.x,
        w: &c.w,
        r: &c.r,
        b: b.then_some(&c.b[..]),
        initial_h: h0.then_some(&c.h0[..]),
        initial_c: c0.then_some(&c.c0[..]),
    }
}

/// Y, Y_h, Y_c and the gates of the fast forward (NaN-filled first: all must be written).
fn forward(c: &Case, i: &LstmTrainIn<'_>, par: &dyn Parallelism) -> [Vec<f32>; 4] {
    let [_, _, _, _, lh, ly] = c.sh.lens();
    let mut out = [vec![f32::NAN; ly], vec![f32::NAN; lh], vec![f32::NAN; lh], vec![f32::NAN; c.sh.gates_len()]];
    let [y, yh, yc, g] = &mut out;
    lstm_train(&c.sh, i, LstmTrainOut { y, y_h: Some(yh), y_c: Some(yc), gates: g }, par).unwrap();
    out
}

/// The six gradients of the fast backward, given the fast forward's Y and gates.
fn backward(c: &Case, g: Given, y: &[f32], gates: &[f32], par: &dyn Parallelism) -> [Vec<f32>; 6] {
    let [_, h0, c0, dy, dyh, dyc] = g.0;
    let i = LstmGradIn {
        x: &c.x,
        w: &c.w,
        r: &c.r,
        y,
        gates,
        initial_h: h0.then_some(&c.h0[..]),
        initial_c: c0.then_some(&c.c0[..]),
        dy: dy.then_some(&c.dy[..]),
        dy_h: dyh.then_some(&c.dyh[..]),
        dy_c: dyc.then_some(&c.dyc[..]),
    };
    let [lx, lw, lr, lb, lh, _] = c.sh.lens();
    let mut out = [
        vec![f32::NAN; lx],
        vec![f32::NAN; lw],
        vec![f32::NAN; lr],
        vec![f32::NAN; lb],
        vec![f32::NAN; lh],
        vec![f32::NAN; lh],
    ];
    let [dx, dw, dr, db, dh0, dc0] = &mut out;
    let o = LstmGradOut { dx: Some(dx), dw: Some(dw), dr: Some(dr), db: Some(db), dh0: Some(dh0), dc0: Some(dc0) };
    lstm_grad(&c.sh, &i, o, par).unwrap();
    out
}

/// `|got - want| <= tol * (1 + max|want|)` element by element.
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = 1.0 + want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() <= tol * scale, "{what}[{k}]: {g} vs {w} (scale {scale})");
    }
}

fn same_bits(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    for (k, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.len(), b.len(), "{what} output {k}");
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{what} output {k}");
    }
}

/// Fast forward and backward against the reference (float32 against float64: the tolerance
/// covers a few ulp per operation over a few steps, as GRU's tests), at 1 and 3 threads.
fn compare(sh: LstmShape, seed: u64, g: Given) {
    let c = case(sh, seed);
    let i = train_in(&c, g);
    let want = reference::lstm_train(&c.sh, &i).unwrap();
    let [_, _, _, dy, dyh, dyc] = g.0;
    let pick = |on: bool, v: &'_ [f32]| on.then_some(v).map(|v| v.to_vec());
    let (dyv, dyhv, dycv) = (pick(dy, &c.dy), pick(dyh, &c.dyh), pick(dyc, &c.dyc));
    let wg = reference::lstm_grad(&c.sh, &i, dyv.as_deref(), dyhv.as_deref(), dycv.as_deref()).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let tag = format!("{sh:?} given {:?}", g.0);
    let mut first: Option<[Vec<f32>; 10]> = None;
    for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
        let [y, yh, yc, gates] = forward(&c, &i, par);
        close(&format!("Y {tag}"), &y, &want.y, 1e-5);
        close(&format!("Y_h {tag}"), &yh, &want.y_h, 1e-5);
        close(&format!("Y_c {tag}"), &yc, &want.y_c, 1e-5);
        close(&format!("gates {tag}"), &gates, &want.gates, 1e-5);
        let [dx, dw, dr, db, dh0, dc0] = backward(&c, g, &y, &gates, par);
        for (name, got, want) in [
            ("dX", &dx, &wg.dx),
            ("dW", &dw, &wg.dw),
            ("dR", &dr, &wg.dr),
            ("dB", &db, &wg.db),
            ("dh0", &dh0, &wg.dh0),
            ("dc0", &dc0, &wg.dc0),
        ] {
            close(&format!("{name} {tag}"), got, want, 3e-5);
        }
        let all = [y, yh, yc, gates, dx, dw, dr, db, dh0, dc0];
        match &first {
            None => first = Some(all),
            Some(f) => same_bits(&format!("threads {tag}"), f, &all),
        }
    }
}

#[test]
fn matches_reference_on_small_and_edge_sizes() {
    let mut seed = 1;
    for &(t, b, i, h) in
        &[(1, 1, 1, 1), (3, 1, 2, 1), (1, 4, 3, 5), (4, 3, 5, 7), (5, 2, 1, 3), (2, 9, 4, 17), (3, 2, 0, 4)]
    {
        for dir in DIRS {
            seed += 1;
            compare(shape(t, b, i, h, dir), seed, ALL);
        }
    }
}

#[test]
fn optional_inputs_absent() {
    let cases = [
        [false, false, false, true, false, false],
        [true, false, true, false, true, false],
        [false, true, false, true, false, true],
        [true, true, true, false, false, true],
    ];
    for (k, g) in cases.into_iter().enumerate() {
        compare(shape(3, 2, 3, 4, Direction::Bidirectional), 50 + k as u64, Given(g));
    }
}

#[test]
fn large_enough_to_split_the_gemms() {
    // seq * batch rows and the per-step GEMMs above the task size: blocks on the pool.
    compare(shape(6, 80, 24, 40, Direction::Bidirectional), 77, ALL);
    // A step's backward product in three column blocks, the last a partial panel.
    compare(shape(5, 40, 16, 72, Direction::Bidirectional), 78, ALL);
}

#[test]
fn empty_sizes() {
    for dir in DIRS {
        // No steps: Y_h, Y_c are the initial states; dY_h, dY_c flow to them.
        let c = case(shape(0, 2, 3, 4, dir), 9);
        let [y, yh, yc, g] = forward(&c, &train_in(&c, ALL), &Sequential);
        assert!(y.is_empty() && g.is_empty());
        assert_eq!((yh, yc), (c.h0.clone(), c.c0.clone()));
        let [dx, dw, dr, db, dh0, dc0] = backward(&c, ALL, &y, &g, &Sequential);
        assert!(dx.is_empty() && [dw, dr, db].iter().all(|v| v.iter().all(|&e| e == 0.0)));
        assert_eq!((dh0, dc0), (c.dyh.clone(), c.dyc.clone()));
        // No batch rows or no hidden units: outputs empty, gradients zero.
        for &(t, b, h) in &[(3, 0, 4), (3, 2, 0)] {
            let c = case(shape(t, b, 3, h, dir), 9);
            let [y, yh, yc, g] = forward(&c, &train_in(&c, ALL), &Sequential);
            assert!(y.is_empty() && yh.is_empty() && yc.is_empty() && g.is_empty());
            let grads = backward(&c, ALL, &y, &g, &Sequential);
            assert!(grads.iter().all(|v| v.iter().all(|&e| e == 0.0)));
        }
    }
}

#[test]
fn reference_matches_finite_differences() {
    // loss = sum(dY Y) + sum(dY_h Y_h) + sum(dY_c Y_c) from the reference's float64 forward,
    // perturbing float64 copies of the inputs (the reference reads float32: a shim below).
    for dir in DIRS {
        let c = case(shape(3, 2, 2, 3, dir), 21);
        let g = reference::lstm_grad(&c.sh, &train_in(&c, ALL), Some(&c.dy), Some(&c.dyh), Some(&c.dyc)).unwrap();
        let base: [Vec<f64>; 6] =
            [&c.x, &c.w, &c.r, &c.b, &c.h0, &c.c0].map(|v| v.iter().map(|&e| f64::from(e)).collect());
        let loss = |p: &[Vec<f64>; 6]| -> f64 {
            let fw = forward64(&c.sh, p);
            let dot = |a: &[f64], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * f64::from(*y)).sum::<f64>();
            dot(&fw.y, &c.dy) + dot(&fw.y_h, &c.dyh) + dot(&fw.y_c, &c.dyc)
        };
        for (q, want) in [&g.dx, &g.dw, &g.dr, &g.db, &g.dh0, &g.dc0].into_iter().enumerate() {
            for k in 0..base[q].len() {
                let (mut up, mut down) = (base.clone(), base.clone());
                up[q][k] += 1e-6;
                down[q][k] -= 1e-6;
                let fd = (loss(&up) - loss(&down)) / 2e-6;
                assert!((fd - want[k]).abs() < 1e-6 * (1.0 + fd.abs()), "{dir:?} input {q}[{k}]: {fd} vs {}", want[k]);
            }
        }
    }
}

/// The reference forward on float64 inputs (X, W, R, B, initial_h, initial_c), written out
/// again here so that finite differences can perturb below float32's resolution.
fn forward64(sh: &LstmShape, p: &[Vec<f64>; 6]) -> reference::Forward {
    let [x, w, r, b, h0, c0] = p;
    let (tn, bn, inn, hn, dn) = (sh.seq, sh.batch, sh.input, sh.hidden, sh.direction.count());
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let mut out = reference::Forward { y: vec![0.0; tn * dn * bn * hn], y_h: vec![], y_c: vec![], gates: vec![] };
    for d in 0..dn {
        let mut h = h0[d * bn * hn..(d + 1) * bn * hn].to_vec();
        let mut c = c0[d * bn * hn..(d + 1) * bn * hn].to_vec();
        for s in 0..tn {
            let t = if sh.direction.reversed(d) { tn - 1 - s } else { s };
            let (mut hn_, mut cn_) = (vec![0.0; bn * hn], vec![0.0; bn * hn]);
            for bb in 0..bn {
                for j in 0..hn {
                    let a = |q: usize| -> f64 {
                        let row = d * 4 * hn + q * hn + j;
                        let xw: f64 = (0..inn).map(|k| x[(t * bn + bb) * inn + k] * w[row * inn + k]).sum();
                        let hr: f64 = (0..hn).map(|k| h[bb * hn + k] * r[row * hn + k]).sum();
                        xw + hr + b[d * 8 * hn + q * hn + j] + b[d * 8 * hn + 4 * hn + q * hn + j]
                    };
                    let cn = sig(a(2)) * c[bb * hn + j] + sig(a(0)) * a(3).tanh();
                    cn_[bb * hn + j] = cn;
                    hn_[bb * hn + j] = sig(a(1)) * cn.tanh();
                }
            }
            h = hn_;
            c = cn_;
            out.y[(t * dn + d) * bn * hn..(t * dn + d + 1) * bn * hn].copy_from_slice(&h);
        }
        out.y_h.extend(h);
        out.y_c.extend(c);
    }
    out
}

#[test]
fn portable_element_loops_give_the_avx2_bits() {
    let c = case(shape(5, 3, 4, 19, Direction::Bidirectional), 31);
    let i = train_in(&c, ALL);
    let run = || {
        let f = forward(&c, &i, &Sequential);
        let g = backward(&c, ALL, &f[0], &f[3], &Sequential);
        f.into_iter().chain(g).collect::<Vec<_>>()
    };
    let wide = run();
    PORTABLE.with(|p| p.set(true));
    let portable = run();
    PORTABLE.with(|p| p.set(false));
    same_bits("portable vs AVX2", &wide, &portable);
}

#[test]
fn scratch_reuse_and_thread_count_do_not_change_bits() {
    for sh in [shape(6, 80, 24, 40, Direction::Bidirectional), shape(5, 40, 16, 72, Direction::Reverse)] {
        reuse_and_threads(sh);
    }
}

fn reuse_and_threads(sh: LstmShape) {
    let c = case(sh, 5);
    let i = train_in(&c, ALL);
    let f1 = forward(&c, &i, &Sequential);
    let g1 = backward(&c, ALL, &f1[0], &f1[3], &Sequential);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let (mut fs, mut gs) = (LstmTrainScratch::default(), LstmScratch::default());
    let [lx, lw, lr, lb, lh, ly] = c.sh.lens();
    for _ in 0..2 {
        let mut f = [vec![0.0; ly], vec![0.0; lh], vec![0.0; lh], vec![0.0; c.sh.gates_len()]];
        let [y, yh, yc, g] = &mut f;
        let o = LstmTrainOut { y, y_h: Some(yh), y_c: Some(yc), gates: g };
        lstm_train_with(&c.sh, &i, o, &RayonPool(Some(&pool)), &mut fs).unwrap();
        same_bits("forward", &f1, &f);
        let gi = LstmGradIn {
            x: &c.x,
            w: &c.w,
            r: &c.r,
            y: &f[0],
            gates: &f[3],
            initial_h: Some(&c.h0),
            initial_c: Some(&c.c0),
            dy: Some(&c.dy),
            dy_h: Some(&c.dyh),
            dy_c: Some(&c.dyc),
        };
        let mut g = [vec![0.0; lx], vec![0.0; lw], vec![0.0; lr], vec![0.0; lb], vec![0.0; lh], vec![0.0; lh]];
        let [dx, dw, dr, db, dh0, dc0] = &mut g;
        let o = LstmGradOut { dx: Some(dx), dw: Some(dw), dr: Some(dr), db: Some(db), dh0: Some(dh0), dc0: Some(dc0) };
        lstm_grad_with(&c.sh, &gi, o, &RayonPool(Some(&pool)), &mut gs).unwrap();
        same_bits("backward", &g1, &g);
    }
}

#[test]
fn wrong_lengths_and_huge_sizes_are_errors() {
    let c = case(shape(2, 2, 3, 4, Direction::Forward), 3);
    let mut i = train_in(&c, ALL);
    let [_, _, _, _, lh, ly] = c.sh.lens();
    let (mut y, mut g) = (vec![0.0; ly], vec![0.0; c.sh.gates_len()]);
    let mut short = vec![0.0; c.sh.gates_len() - 1];
    let o = LstmTrainOut { y: &mut y, y_h: None, y_c: None, gates: &mut short };
    let err = lstm_train(&c.sh, &i, o, &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "gates", got: 95, expected: 96 });
    i.initial_c = Some(&c.c0[1..]);
    let o = LstmTrainOut { y: &mut y, y_h: None, y_c: None, gates: &mut g };
    assert!(matches!(
        lstm_train(&c.sh, &i, o, &Sequential),
        Err(KernelError::LengthMismatch { what: "initial_c", .. })
    ));
    assert!(reference::lstm_train(&c.sh, &i).is_err());
    let gi = LstmGradIn {
        x: &c.x,
        w: &c.w,
        r: &c.r,
        y: &y,
        gates: &g,
        initial_h: None,
        initial_c: None,
        dy: None,
        dy_h: None,
        dy_c: Some(&c.dyc[..lh - 1]),
    };
    let err = lstm_grad(&c.sh, &gi, LstmGradOut::default(), &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "dY_c", got: 7, expected: 8 });
    // 4 * 2^62 overflows: an error naming the tensor, never a wrapped length.
    let e = shape(1, 1, 1, 1 << 62, Direction::Forward).checked_lens().unwrap_err();
    assert!(matches!(&e, KernelError::Overflow { what } if what.starts_with("W (dirs, 4 hidden_size")), "{e}");
    assert_eq!(shape(1, 1, 1, 1 << 62, Direction::Forward).lens(), [usize::MAX; 6]);
}

/// The tiled, threaded transpose against the definition, on shapes with partial tiles,
/// single rows and columns, and tasks of several column blocks.
#[test]
fn transpose_matches_the_definition() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for &(rows, cols) in &[(1, 1), (1, 37), (37, 1), (17, 33), (16, 16), (1024, 48), (5, 1000), (4100, 70), (0, 5)] {
        let src: Vec<f32> = (0..rows * cols).map(|q| q as f32).collect();
        for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
            let mut dst = vec![-1.0f32; rows * cols];
            transpose(par, &src, rows, cols, &mut dst);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(dst[c * rows + r], src[r * cols + c], "{rows}x{cols} at ({r}, {c})");
                }
            }
        }
    }
}
