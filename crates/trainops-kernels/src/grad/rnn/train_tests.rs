//! [`forward::gru_train`] against its float64 reference, and the backward given the saved
//! gates against the backward recomputing them.

use super::forward::{gru_train, gru_train_with, GruTrainIn, GruTrainOut, GruTrainScratch};
use super::tests::{case, close, fast, inputs, shape, Case, DIRS, PORTABLE};
use super::*;
use crate::{RayonPool, Sequential};

fn train_in(c: &Case, use_b: bool, use_h0: bool) -> GruTrainIn<'_> {
    GruTrainIn { x: &c.x, w: &c.w, r: &c.r, b: use_b.then_some(&c.b[..]), initial_h: use_h0.then_some(&c.h0[..]) }
}

/// Y, Y_h and the gates of the fast path (NaN-filled first: every element must be written).
fn run(c: &Case, i: &GruTrainIn<'_>, par: &dyn Parallelism) -> [Vec<f32>; 3] {
    let [_, _, _, _, lh, ly] = c.sh.lens();
    let (mut y, mut yh, mut g) = (vec![f32::NAN; ly], vec![f32::NAN; lh], vec![f32::NAN; c.sh.gates_len()]);
    gru_train(&c.sh, i, GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut g }, par).unwrap();
    [y, yh, g]
}

fn compare(sh: GruShape, seed: u64, use_b: bool, use_h0: bool) {
    let c = case(sh, seed);
    let i = train_in(&c, use_b, use_h0);
    let want = reference::gru_train(&c.sh, &i).unwrap();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
        let [y, yh, g] = run(&c, &i, par);
        let tag = format!("{sh:?} b={use_b} h0={use_h0}");
        close(&format!("Y {tag}"), &y, &want.y, 1e-5);
        close(&format!("Y_h {tag}"), &yh, &want.y_h, 1e-5);
        close(&format!("gates {tag}"), &g, &want.gates, 1e-5);
    }
}

#[test]
fn forward_matches_reference_on_small_and_edge_sizes() {
    let mut seed = 100;
    for &(t, b, i, h) in
        &[(1, 1, 1, 1), (3, 1, 2, 1), (1, 4, 3, 5), (4, 3, 5, 7), (5, 2, 1, 3), (2, 9, 4, 17), (3, 2, 0, 4)]
    {
        for dir in DIRS {
            for lbr in [false, true] {
                seed += 1;
                compare(shape(t, b, i, h, dir, lbr), seed, true, true);
            }
        }
    }
}

#[test]
fn forward_optional_inputs_absent() {
    for lbr in [false, true] {
        for (k, &(b, h0)) in [(false, false), (true, false), (false, true)].iter().enumerate() {
            compare(shape(3, 2, 3, 4, Direction::Bidirectional, lbr), 150 + k as u64, b, h0);
        }
    }
}

#[test]
fn forward_large_enough_to_split_the_gemms() {
    for lbr in [false, true] {
        compare(shape(6, 80, 24, 40, Direction::Forward, lbr), 177, true, true);
    }
}

#[test]
fn forward_empty_sizes() {
    // No steps: Y is empty and Y_h is initial_h. No batch or no hidden units: all empty.
    for dir in DIRS {
        let c = case(shape(0, 2, 3, 4, dir, true), 9);
        let [y, yh, g] = run(&c, &train_in(&c, true, true), &Sequential);
        assert!(y.is_empty() && g.is_empty());
        assert_eq!(yh, c.h0);
        let [_, yh, _] = run(&c, &train_in(&c, true, false), &Sequential);
        assert!(yh.iter().all(|&v| v == 0.0));
        for &(t, b, h) in &[(3, 0, 4), (3, 2, 0)] {
            let c = case(shape(t, b, 3, h, dir, false), 9);
            let [y, yh, g] = run(&c, &train_in(&c, true, true), &Sequential);
            assert!(y.is_empty() && yh.is_empty() && g.is_empty());
        }
    }
}

#[test]
fn forward_portable_loops_give_the_avx2_bits() {
    for lbr in [false, true] {
        let c = case(shape(5, 3, 4, 19, Direction::Bidirectional, lbr), 31);
        let i = train_in(&c, true, true);
        let wide = run(&c, &i, &Sequential);
        PORTABLE.with(|p| p.set(true));
        let portable = run(&c, &i, &Sequential);
        PORTABLE.with(|p| p.set(false));
        for (a, b) in wide.iter().zip(&portable) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "lbr={lbr}");
        }
    }
}

#[test]
fn forward_scratch_reuse_and_thread_count_do_not_change_bits() {
    let c = case(shape(6, 80, 24, 40, Direction::Bidirectional, true), 5);
    let i = train_in(&c, true, true);
    let once = run(&c, &i, &Sequential);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let mut scratch = GruTrainScratch::default();
    for _ in 0..2 {
        let [_, _, _, _, lh, ly] = c.sh.lens();
        let (mut y, mut yh, mut g) = (vec![0.0; ly], vec![0.0; lh], vec![0.0; c.sh.gates_len()]);
        let o = GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut g };
        gru_train_with(&c.sh, &i, o, &RayonPool(Some(&pool)), &mut scratch).unwrap();
        for (a, b) in once.iter().zip([&y, &yh, &g]) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}

/// The backward given the forward's gates against the backward recomputing them from the
/// forward's Y: equal within `tol` (the recomputation's `H_{t-1} R^T` is one GEMM over all
/// steps, the forward's one per step; the `gemm` crate may sum in another order, observed
/// about 1.6e-7 of the largest gradient).
fn saved_vs_recomputed(sh: GruShape, seed: u64, tol: f32) -> f32 {
    let c = case(sh, seed);
    let [y, _, g] = run(&c, &train_in(&c, true, true), &Sequential);
    let mut plain = inputs(&c, &y, true, true, true, true);
    let recomputed = fast(&c, &plain, &Sequential);
    plain.gates = Some(&g);
    let saved = fast(&c, &plain, &Sequential);
    let mut worst = 0.0f32;
    for (a, b) in recomputed.iter().zip(&saved) {
        let scale = 1.0 + a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs() / scale);
        }
    }
    assert!(worst <= tol, "{sh:?}: saved gates vs recomputed differ by {worst} (relative to the largest)");
    worst
}

#[test]
fn backward_with_saved_gates_matches_recomputation() {
    let mut seed = 300;
    for &(t, b, i, h) in &[(1, 1, 1, 1), (4, 3, 5, 7), (2, 9, 4, 17), (16, 16, 32, 64)] {
        for dir in DIRS {
            for lbr in [false, true] {
                seed += 1;
                saved_vs_recomputed(shape(t, b, i, h, dir, lbr), seed, 2e-6);
            }
        }
    }
}

#[test]
fn backward_with_saved_gates_matches_reference() {
    // The reference recomputes from Y in float64: the saved gates lead to the same gradients.
    for lbr in [false, true] {
        let c = case(shape(4, 3, 5, 7, Direction::Bidirectional, lbr), 41);
        let [y, _, g] = run(&c, &train_in(&c, true, true), &Sequential);
        let mut i = inputs(&c, &y, true, true, true, true);
        let want = reference::gru_grad(&c.sh, &i).unwrap();
        i.gates = Some(&g);
        let [dx, dw, dr, db, dh0] = fast(&c, &i, &Sequential);
        for (name, got, want) in
            [("dX", dx, want.dx), ("dW", dw, want.dw), ("dR", dr, want.dr), ("dB", db, want.db), ("dh0", dh0, want.dh0)]
        {
            close(&format!("{name} lbr={lbr}"), &got, &want, 2e-5);
        }
    }
}

#[test]
fn wrong_lengths_are_errors() {
    let c = case(shape(2, 2, 3, 4, Direction::Forward, false), 3);
    let mut i = train_in(&c, true, true);
    let [_, _, _, _, lh, ly] = c.sh.lens();
    let (mut y, mut yh, mut g) = (vec![0.0; ly], vec![0.0; lh], vec![0.0; c.sh.gates_len()]);
    let mut short = vec![0.0; c.sh.gates_len() - 1];
    let o = GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut short };
    let err = gru_train(&c.sh, &i, o, &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "gates", got: 63, expected: 64 });
    i.r = &c.r[1..];
    let o = GruTrainOut { y: &mut y, y_h: Some(&mut yh), gates: &mut g };
    assert!(matches!(gru_train(&c.sh, &i, o, &Sequential), Err(KernelError::LengthMismatch { what: "R", .. })));
    assert!(reference::gru_train(&c.sh, &i).is_err());
    // The backward checks the saved gates' length too.
    let yv = vec![0.0; ly];
    let mut gi = inputs(&c, &yv, true, true, true, true);
    gi.gates = Some(&short);
    let err = gru_grad(&c.sh, &gi, GruGradOut::default(), &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "gates", got: 63, expected: 64 });
}
