//! `PhiloxNormal`: Box-Muller on pairs of uniforms, TensorFlow's `BoxMullerFloat` (two words
//! a pair, float32 uniforms) for float, float16 and bfloat16 outputs and `BoxMullerDouble`
//! (four words a pair) for double; `output = z * scale + mean`.
//!
//! `ln`, `sqrt`, `sin` and `cos` are evaluated in float64 from the contract's `u1` and `v1`,
//! so each `z` is the float64 formula rounded to the output type (well inside the contract's
//! tolerance); the same code runs at every level, only Philox's words come from SIMD.

use core::f64::consts::PI;

use super::convert::{f32_of, f64_of, Half};
use super::draw::{fill_piece, split_out, Output, Words, SUB};
use super::philox::{self, reference as philox_ref, Level, Stores};
use crate::Parallelism;

/// `BoxMullerFloat` on words `x0, x1`: `(z0, z1)` in float32.
#[inline]
pub fn box_muller_f32(x0: u32, x1: u32) -> (f32, f32) {
    let u1 = f32_of(x0).max(1.0e-7);
    let v1 = (2.0 * PI * f64::from(f32_of(x1))) as f32;
    let r = (-2.0 * f64::from(u1).ln()).sqrt();
    let (s, c) = f64::from(v1).sin_cos();
    ((r * s) as f32, (r * c) as f32)
}

/// `BoxMullerDouble` on words `x[0..4]`: `(z0, z1)`.
#[inline]
pub fn box_muller_f64(x: &[u32]) -> (f64, f64) {
    let u1 = f64_of(x[0], x[1]).max(1.0e-7);
    let v1 = 2.0 * PI * f64_of(x[2], x[3]);
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = v1.sin_cos();
    (r * s, r * c)
}

fn words_kind(out: &Output<'_>) -> Words {
    if matches!(out, Output::F64(_)) {
        Words::PairsOfFour
    } else {
        Words::PairsOfTwo
    }
}

/// Words consumed by an output: `2 * ceil(n / 2)`, or `4 * ceil(n / 2)` for double.
pub fn words_for(out: &Output<'_>) -> usize {
    words_kind(out).of(out.len())
}

/// Fills `out` from `state` at the [`philox::detected`] level; returns the next state.
pub fn fill(state: &[u32; 6], mean: f32, scale: f32, out: Output<'_>, par: &dyn Parallelism) -> [u32; 6] {
    fill_with(philox::detected(), state, mean, scale, out, par)
}

/// [`fill`] at a given level (for Philox's words).
///
/// # Panics
///
/// When `level` is not available on this CPU.
pub fn fill_with(
    level: Level,
    state: &[u32; 6],
    mean: f32,
    scale: f32,
    out: Output<'_>,
    par: &dyn Parallelism,
) -> [u32; 6] {
    let isa = level.isa().unwrap_or_else(|| panic!("normal: {level:?} is not available on this CPU"));
    let words = words_kind(&out);
    let auto = Stores::Auto;
    match out {
        Output::F32(o) => split_out(isa, auto, state, o, words, par, |s, p, stream| {
            fill_piece(level, stream, s, p, words, |w, o| pairs_f32(w, o, mean, scale));
        }),
        Output::F16(o) => {
            split_out(isa, auto, state, o, words, par, |s, p, stream| half_piece(level, stream, s, p, mean, scale))
        }
        Output::BF16(o) => {
            split_out(isa, auto, state, o, words, par, |s, p, stream| half_piece(level, stream, s, p, mean, scale))
        }
        Output::F64(o) => {
            let (mean, scale) = (f64::from(mean), f64::from(scale));
            split_out(isa, auto, state, o, words, par, |s, p, stream| {
                fill_piece(level, stream, s, p, words, |w, o| {
                    for (o, x) in o.chunks_mut(2).zip(w.chunks_exact(4)) {
                        let (z0, z1) = box_muller_f64(x);
                        o[0] = z0 * scale + mean;
                        if let Some(o1) = o.get_mut(1) {
                            *o1 = z1 * scale + mean;
                        }
                    }
                });
            })
        }
    }
}

fn pairs_f32(words: &[u32], out: &mut [f32], mean: f32, scale: f32) {
    for (o, x) in out.chunks_mut(2).zip(words.chunks_exact(2)) {
        let (z0, z1) = box_muller_f32(x[0], x[1]);
        o[0] = z0 * scale + mean;
        if let Some(o1) = o.get_mut(1) {
            *o1 = z1 * scale + mean;
        }
    }
}

fn half_piece<H: Half + Default>(level: Level, stream: bool, state: &[u32; 6], out: &mut [H], mean: f32, scale: f32) {
    let mut tmp = [0f32; SUB];
    fill_piece(level, stream, state, out, Words::PairsOfTwo, |w, o| {
        let t = &mut tmp[..o.len()];
        pairs_f32(w, t, mean, scale);
        H::store(t, o);
    });
}

/// The contract's float64 values `z` (before `scale` and `mean`) of `n` elements, on
/// Philox's scalar reference, for tests; and the next state.
pub fn reference_z(state: &[u32; 6], n: usize, double: bool) -> (Vec<f64>, [u32; 6]) {
    let per_pair = if double { 4 } else { 2 };
    let mut words = vec![0u32; per_pair * n.div_ceil(2)];
    let next = philox_ref::fill(state, &mut words);
    let mut z = Vec::with_capacity(n);
    for x in words.chunks_exact(per_pair) {
        let (u1, v1) = if double {
            (f64_of(x[0], x[1]).max(1.0e-7), 2.0 * PI * f64_of(x[2], x[3]))
        } else {
            (f64::from(f32_of(x[0]).max(1.0e-7)), f64::from((2.0 * PI * f64::from(f32_of(x[1]))) as f32))
        };
        let r = (-2.0 * u1.ln()).sqrt();
        z.push(r * v1.sin());
        z.push(r * v1.cos());
    }
    z.truncate(n);
    (z, next)
}
