//! The checks a node's inputs meet before any buffer is touched, on arbitrary arities,
//! element types, shapes and attributes: the optimizers' `Layout`s (the library's own, through `trainops::fuzzing`) (arity, output count,
//! names, `check_group`), `broadcastable` / `same_shape` (against a reference and against
//! the kernels' own broadcasting), the element count of a shape, `DType`, and the output-size
//! check of the shape-driven random ops (Philox, PhiloxUniform, PhiloxNormal: the one in
//! `ops/random/state.rs`, from the attribute or the input). None may panic, and each must
//! agree with arithmetic done here.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use trainops::fuzzing::{
    broadcastable, layouts, numel, output_numel, philox_output_numel, same_shape, DType, InputInfo, Layout, ShapeFrom,
};
use trainops_kernels::broadcast::broadcast_to;

/// One of the registered optimizer-shaped ops' layouts (Adam, AdamW, Adagrad, Momentum,
/// MixedPrecisionAdam, MemoryCeiling), as the library itself uses them.
fn layout(pick: u8) -> &'static Layout {
    let all = layouts();
    all[usize::from(pick) % all.len()]
}

/// A dimension: mostly small, sometimes negative (unknown or bad) or huge.
#[derive(Debug, Arbitrary)]
enum Dim {
    Small(u8),
    Any(i64),
}

impl Dim {
    fn get(&self) -> i64 {
        match self {
            Dim::Small(d) => i64::from(*d % 6),
            Dim::Any(d) => *d,
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    dtype: i32,
    common_dtype: bool,
    shape: Vec<Dim>,
    /// Reuse the weights' shape (so that equal shapes are common).
    like_x: bool,
}

#[derive(Debug, Arbitrary)]
struct Case {
    layout: u8,
    inputs: u16,
    outputs: u16,
    copies: bool,
    group: Vec<Input>,
    from: Vec<Dim>,
    to: Vec<Dim>,
    philox: Vec<Dim>,
    attribute: bool,
}

fn dims(v: &[Dim]) -> Vec<i64> {
    v.iter().take(8).map(Dim::get).collect()
}

/// The exact element count, or None when a dimension is negative.
fn exact_count(shape: &[i64]) -> Option<u128> {
    let mut n: u128 = 1;
    for &d in shape {
        if d < 0 {
            return None;
        }
        n = n.saturating_mul(d as u128);
    }
    if shape.contains(&0) {
        Some(0)
    } else {
        Some(n)
    }
}

/// numpy's one-way broadcasting of known (non-negative) dimensions.
fn reference_broadcastable(from: &[i64], to: &[i64]) -> bool {
    from.len() <= to.len() && from.iter().rev().zip(to.iter().rev()).all(|(&f, &t)| f == t || f == 1)
}

fuzz_target!(|case: Case| {
    let l = layout(case.layout);
    let (s, k) = (l.scalars.len(), l.groups.len());
    let inputs = usize::from(case.inputs % 512);

    // Arity: n from scalars + k n, n >= 1.
    match l.arity(inputs) {
        Ok(n) => {
            assert!(n >= 1 && inputs == s + k * n);
            // Every name of the node can be formed.
            for j in 0..inputs {
                assert!(!l.input_name(j, n).is_empty());
            }
            let outs = l.flags.len() + (l.rewrites.len() + usize::from(case.copies)) * n;
            for o in 0..outs {
                assert!(!l.output_name(o, n).is_empty());
            }
            let r = l.check_outputs(usize::from(case.outputs), n, case.copies);
            assert_eq!(r.is_ok(), usize::from(case.outputs) == outs);
            if let Err(e) = r {
                assert!(e.to_string().starts_with(l.op), "{e}");
            }
            // One tensor group with arbitrary types and shapes.
            let x_shape = case.group.first().map(|g| dims(&g.shape)).unwrap_or_default();
            let sigs: Vec<InputInfo> = (0..k)
                .map(|g| {
                    let d = case.group.get(g);
                    let dtype = match d {
                        Some(d) if !d.common_dtype => DType::from_raw(d.dtype),
                        _ => DType::Float,
                    };
                    let shape = match d {
                        Some(d) if !d.like_x => dims(&d.shape),
                        _ => x_shape.clone(),
                    };
                    InputInfo { dtype, shape }
                })
                .collect();
            let i = usize::from(case.outputs) % n;
            for shapes in [false, true] {
                match l.check_group(n, i, &sigs, shapes) {
                    Ok(()) => {
                        let x = &sigs[0];
                        assert!(l.weights.contains(&x.dtype), "{:?} weights accepted by {}", x.dtype, l.op);
                        if shapes {
                            for (g, sig) in sigs.iter().enumerate().skip(1) {
                                if g == l.gradient {
                                    assert!(broadcastable(&sig.shape, &x.shape));
                                } else {
                                    assert!(same_shape(&sig.shape, &x.shape));
                                }
                            }
                        }
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        assert!(msg.starts_with(&format!("{}: input ", l.op)), "{msg}");
                        assert!(msg.contains("expected"), "{msg}");
                    }
                }
            }
        }
        Err(e) => {
            assert!(inputs < s + k || (inputs - s) % k != 0);
            assert!(e.to_string().starts_with(&format!("{}: expected {s} + {k}n inputs", l.op)), "{e}");
        }
    }

    // Broadcasting: the check layer, the reference and the kernels agree on known shapes.
    let (from, to) = (dims(&case.from), dims(&case.to));
    let b = broadcastable(&from, &to);
    let known = from.iter().chain(&to).all(|&d| d >= 0);
    if known {
        assert_eq!(b, reference_broadcastable(&from, &to), "{from:?} -> {to:?}");
        assert_eq!(same_shape(&from, &to), from == to);
        // The kernels build an ndarray view, which (like numpy and ONNX Runtime) refuses a
        // shape whose non-zero dimensions multiply past isize::MAX even with a zero among them.
        let fits = |s: &[i64]| s.iter().filter(|&&d| d != 0).try_fold(1i64, |n, &d| n.checked_mul(d)).is_some();
        let small = |s: &[i64]| fits(s) && exact_count(s).is_some_and(|n| n <= 4096);
        if small(&from) && small(&to) {
            let f: Vec<usize> = from.iter().map(|&d| d as usize).collect();
            let t: Vec<usize> = to.iter().map(|&d| d as usize).collect();
            let src = vec![1u8; exact_count(&from).unwrap() as usize];
            let wide = broadcast_to(&src, &f, &t);
            assert_eq!(wide.is_ok(), b, "kernels and checks disagree: {from:?} -> {to:?}");
            if let Ok(w) = wide {
                assert_eq!(w.len() as u128, exact_count(&to).unwrap());
            }
        }
    } else {
        // Unknown dimensions never make a known mismatch pass the rank test.
        if from.len() > to.len() {
            assert!(!b);
        }
    }

    // Element counts: exact, or None (negative, or more than usize holds).
    let n = numel(&to);
    match exact_count(&to) {
        None => assert_eq!(n, None),
        Some(c) if c <= usize::MAX as u128 => assert_eq!(n, Some(c as usize), "{to:?}"),
        Some(_) => assert_eq!(n, None, "{to:?}"),
    }

    // Element types: round trip, and a name for every value.
    let d = DType::from_raw(case.layout as i32 - 64);
    assert_eq!(DType::from_raw(d.raw()), d);
    assert!(d.name().starts_with("tensor("));

    // Philox's output size: Ok exactly when every dimension is >= 0 and the count <= 2^31.
    let p = dims(&case.philox);
    let got = philox_output_numel(&p, case.attribute);
    match exact_count(&p) {
        Some(c) if c <= 1 << 31 => assert_eq!(got.ok(), Some(c as usize), "{p:?}"),
        _ => {
            let msg = got.expect_err("accepted a negative or too large shape").to_string();
            let head = if case.attribute { "Philox: attribute 'shape'" } else { "Philox: input 1 (shape)" };
            assert!(msg.starts_with(head), "{msg}");
        }
    }
    // The distributions share the check, under their own names in the messages.
    let from = if case.attribute { ShapeFrom::Attribute } else { ShapeFrom::Input };
    for op in ["PhiloxUniform", "PhiloxNormal"] {
        let got = output_numel(op, &p, from);
        match exact_count(&p) {
            Some(c) if c <= 1 << 31 => assert_eq!(got.ok(), Some(c as usize), "{op} {p:?}"),
            _ => {
                let msg = got.expect_err("accepted a negative or too large shape").to_string();
                let head = if case.attribute { "attribute 'shape'" } else { "input 1 (shape)" };
                assert!(msg.starts_with(&format!("{op}: {head}")), "{msg}");
                assert!(msg.contains("expected non-negative dimensions"), "{msg}");
            }
        }
    }
});
