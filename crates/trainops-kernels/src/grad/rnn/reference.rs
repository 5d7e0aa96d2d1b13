//! The plain forms of [`super::gru_grad`] and [`super::forward::gru_train`]: straight loops in float64, one time step and one
//! element at a time, written from ONNX's GRU equations (the spec the fast path is held to).

// Index loops on purpose: they mirror the subscripts of the equations.
#![allow(clippy::needless_range_loop)]

use super::forward::{check_train_lens, GruTrainIn};
use super::{check_lens, GruGradIn, GruGradOut, GruShape, GATE_ROW};
use crate::KernelError;

/// The gradients of X, W, R, B and initial_h, in float64, each shaped as its input.
#[derive(Debug, Clone, Default)]
pub struct Grads {
    /// Of X.
    pub dx: Vec<f64>,
    /// Of W.
    pub dw: Vec<f64>,
    /// Of R.
    pub dr: Vec<f64>,
    /// Of B.
    pub db: Vec<f64>,
    /// Of initial_h.
    pub dh0: Vec<f64>,
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// All five gradients of one GRU node (see [`super::gru_grad`] for the inputs).
pub fn gru_grad(sh: &GruShape, i: &GruGradIn<'_>) -> Result<Grads, KernelError> {
    check_lens(sh, i, &GruGradOut::default())?;
    let (tn, bn, inn, hn) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let dn = sh.direction.count();
    let [lx, lw, lr, lb, lh, _] = sh.lens();
    let mut g =
        Grads { dx: vec![0.0; lx], dw: vec![0.0; lw], dr: vec![0.0; lr], db: vec![0.0; lb], dh0: vec![0.0; lh] };
    let f = |v: f32| f64::from(v);
    for d in 0..dn {
        let w = |row: usize, col: usize| f(i.w[(d * 3 * hn + row) * inn + col]);
        let r = |row: usize, col: usize| f(i.r[(d * 3 * hn + row) * hn + col]);
        let bias = |k: usize| i.b.map_or(0.0, |b| f(b[d * 6 * hn + k]));
        let y = |t: usize, b: usize, j: usize| f(i.y[((t * dn + d) * bn + b) * hn + j]);
        let h0 = |b: usize, j: usize| i.initial_h.map_or(0.0, |v| f(v[(d * bn + b) * hn + j]));
        let rev = sh.direction.reversed(d);
        let time = |s: usize| if rev { tn - 1 - s } else { s };
        // dH carried back: starts as dY_h.
        let mut dh: Vec<f64> = (0..bn * hn).map(|k| i.dy_h.map_or(0.0, |v| f(v[d * bn * hn + k]))).collect();
        for s in (0..tn).rev() {
            let t = time(s);
            let hp = |b: usize, j: usize| if s == 0 { h0(b, j) } else { y(time(s - 1), b, j) };
            let x = |b: usize, c: usize| f(i.x[(t * bn + b) * inn + c]);
            let mut dprev = vec![0.0; bn * hn];
            for b in 0..bn {
                // Recompute the gates of this step.
                let (mut z, mut rg, mut hh, mut hr) = (vec![0.0; hn], vec![0.0; hn], vec![0.0; hn], vec![0.0; hn]);
                for j in 0..hn {
                    let (mut az, mut ar) = (bias(j) + bias(3 * hn + j), bias(hn + j) + bias(4 * hn + j));
                    for c in 0..inn {
                        az += x(b, c) * w(j, c);
                        ar += x(b, c) * w(hn + j, c);
                    }
                    for k in 0..hn {
                        az += hp(b, k) * r(j, k);
                        ar += hp(b, k) * r(hn + j, k);
                    }
                    z[j] = sig(az);
                    rg[j] = sig(ar);
                }
                for j in 0..hn {
                    let mut a = bias(2 * hn + j);
                    for c in 0..inn {
                        a += x(b, c) * w(2 * hn + j, c);
                    }
                    let mut rec = bias(5 * hn + j);
                    for k in 0..hn {
                        rec += if sh.linear_before_reset { hp(b, k) } else { rg[k] * hp(b, k) } * r(2 * hn + j, k);
                    }
                    hr[j] = rec;
                    hh[j] = (a + if sh.linear_before_reset { rg[j] * rec } else { rec }).tanh();
                }
                // dY of this step joins the carried dH.
                let dhb: Vec<f64> = (0..hn)
                    .map(|j| dh[b * hn + j] + i.dy.map_or(0.0, |v| f(v[((t * dn + d) * bn + b) * hn + j])))
                    .collect();
                let da_z: Vec<f64> = (0..hn).map(|j| dhb[j] * (hp(b, j) - hh[j]) * z[j] * (1.0 - z[j])).collect();
                let da_h: Vec<f64> = (0..hn).map(|j| dhb[j] * (1.0 - z[j]) * (1.0 - hh[j] * hh[j])).collect();
                // d(recurrent part of the h gate) and dA_r.
                let mut da_r = vec![0.0; hn];
                let mut d_rec = vec![0.0; hn]; // gradient of `rec` (lbr 1) or of `r ⊙ hp` (lbr 0)
                if sh.linear_before_reset {
                    for j in 0..hn {
                        d_rec[j] = da_h[j] * rg[j];
                        da_r[j] = da_h[j] * hr[j] * rg[j] * (1.0 - rg[j]);
                    }
                } else {
                    for k in 0..hn {
                        d_rec[k] = (0..hn).map(|j| da_h[j] * r(2 * hn + j, k)).sum();
                        da_r[k] = d_rec[k] * hp(b, k) * rg[k] * (1.0 - rg[k]);
                    }
                }
                for j in 0..hn {
                    dprev[b * hn + j] += dhb[j] * z[j];
                    for k in 0..hn {
                        dprev[b * hn + k] += da_z[j] * r(j, k) + da_r[j] * r(hn + j, k);
                    }
                    if sh.linear_before_reset {
                        for k in 0..hn {
                            dprev[b * hn + k] += d_rec[j] * r(2 * hn + j, k);
                        }
                    } else {
                        dprev[b * hn + j] += d_rec[j] * rg[j];
                    }
                }
                // Parameter and input gradients of this step.
                let das = [&da_z, &da_r, &da_h];
                for (q, da) in das.iter().enumerate() {
                    for j in 0..hn {
                        let row = q * hn + j;
                        for c in 0..inn {
                            g.dw[(d * 3 * hn + row) * inn + c] += da[j] * x(b, c);
                            g.dx[(t * bn + b) * inn + c] += da[j] * w(row, c);
                        }
                        g.db[d * 6 * hn + row] += da[j];
                        let dar = if q == 2 && sh.linear_before_reset { d_rec[j] } else { da[j] };
                        g.db[d * 6 * hn + 3 * hn + row] += dar;
                        for k in 0..hn {
                            let v = if q < 2 || sh.linear_before_reset { hp(b, k) } else { rg[k] * hp(b, k) };
                            g.dr[(d * 3 * hn + row) * hn + k] += dar * v;
                        }
                    }
                }
            }
            dh = dprev;
        }
        g.dh0[d * bn * hn..(d + 1) * bn * hn].copy_from_slice(&dh);
    }
    Ok(g)
}

/// Outputs of the forward in float64: `Y`, `Y_h` and the gates, shaped as
/// [`gru_train`](super::forward::gru_train)'s.
#[derive(Debug, Clone, Default)]
pub struct Forward {
    /// `[seq, dirs, batch, hidden]`.
    pub y: Vec<f64>,
    /// `[dirs, batch, hidden]`.
    pub y_h: Vec<f64>,
    /// `[dirs, seq, batch, GATE_ROW hidden]`: z, r, ĥ, e.
    pub gates: Vec<f64>,
}

/// ONNX's GRU forward, one step, one row and one element at a time, with the gates kept
/// (the spec of [`gru_train`](super::forward::gru_train)).
pub fn gru_train(sh: &GruShape, i: &GruTrainIn<'_>) -> Result<Forward, KernelError> {
    check_train_lens(sh, i, None)?;
    let (tn, bn, inn, hn) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let dn = sh.direction.count();
    let [_, _, _, _, lh, ly] = sh.lens();
    let g4 = GATE_ROW * hn;
    let mut out = Forward { y: vec![0.0; ly], y_h: vec![0.0; lh], gates: vec![0.0; sh.gates_len()] };
    let f = |v: f32| f64::from(v);
    for d in 0..dn {
        let w = |row: usize, col: usize| f(i.w[(d * 3 * hn + row) * inn + col]);
        let r = |row: usize, col: usize| f(i.r[(d * 3 * hn + row) * hn + col]);
        let bias = |k: usize| i.b.map_or(0.0, |b| f(b[d * 6 * hn + k]));
        let mut h: Vec<f64> = (0..bn * hn).map(|k| i.initial_h.map_or(0.0, |v| f(v[d * bn * hn + k]))).collect();
        for s in 0..tn {
            let t = if sh.direction.reversed(d) { tn - 1 - s } else { s };
            let mut next = vec![0.0; bn * hn];
            for b in 0..bn {
                let x = |c: usize| f(i.x[(t * bn + b) * inn + c]);
                let hp = |k: usize| h[b * hn + k];
                let row = ((d * tn + t) * bn + b) * g4;
                let (mut z, mut rg) = (vec![0.0; hn], vec![0.0; hn]);
                for j in 0..hn {
                    let (mut az, mut ar) = (bias(j) + bias(3 * hn + j), bias(hn + j) + bias(4 * hn + j));
                    for c in 0..inn {
                        az += x(c) * w(j, c);
                        ar += x(c) * w(hn + j, c);
                    }
                    for k in 0..hn {
                        az += hp(k) * r(j, k);
                        ar += hp(k) * r(hn + j, k);
                    }
                    z[j] = sig(az);
                    rg[j] = sig(ar);
                }
                for j in 0..hn {
                    let mut a = bias(2 * hn + j);
                    for c in 0..inn {
                        a += x(c) * w(2 * hn + j, c);
                    }
                    let mut rec = bias(5 * hn + j);
                    for k in 0..hn {
                        rec += if sh.linear_before_reset { hp(k) } else { rg[k] * hp(k) } * r(2 * hn + j, k);
                    }
                    let hh = (a + if sh.linear_before_reset { rg[j] * rec } else { rec }).tanh();
                    next[b * hn + j] = (1.0 - z[j]) * hh + z[j] * hp(j);
                    let e = if sh.linear_before_reset { rec } else { rg[j] * hp(j) };
                    for (q, v) in [z[j], rg[j], hh, e].into_iter().enumerate() {
                        out.gates[row + q * hn + j] = v;
                    }
                }
            }
            h = next;
            out.y[(t * dn + d) * bn * hn..(t * dn + d + 1) * bn * hn].copy_from_slice(&h);
        }
        out.y_h[d * bn * hn..(d + 1) * bn * hn].copy_from_slice(&h);
    }
    Ok(out)
}
