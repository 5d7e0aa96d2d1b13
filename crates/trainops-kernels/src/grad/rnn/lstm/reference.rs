//! The plain forms of [`super::lstm_train`] and [`super::lstm_grad`]: straight loops in
//! float64, one time step, one batch row and one element at a time, written from ONNX's LSTM
//! equations. The backward recomputes the forward itself (from X, W, R, B and the initial
//! states), so it shares nothing with the fast path's saved gates.

// Index loops on purpose: they mirror the subscripts of the equations.
#![allow(clippy::needless_range_loop)]

use super::{check_train_lens, LstmShape, LstmTrainIn, LSTM_ROW};
use crate::KernelError;

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Outputs of the forward in float64, shaped as [`lstm_train`](super::lstm_train)'s.
#[derive(Debug, Clone, Default)]
pub struct Forward {
    /// `[seq, dirs, batch, hidden]`.
    pub y: Vec<f64>,
    /// `[dirs, batch, hidden]`.
    pub y_h: Vec<f64>,
    /// `[dirs, batch, hidden]`.
    pub y_c: Vec<f64>,
    /// `[dirs, seq, batch, LSTM_ROW hidden]`: i, o, f, g, c, tanh(c).
    pub gates: Vec<f64>,
}

/// The gradients of X, W, R, B, initial_h and initial_c, in float64.
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
    /// Of initial_c.
    pub dc0: Vec<f64>,
}

/// ONNX's LSTM forward with the gates kept (the spec of [`lstm_train`](super::lstm_train)).
pub fn lstm_train(sh: &LstmShape, i: &LstmTrainIn<'_>) -> Result<Forward, KernelError> {
    check_train_lens(sh, i, None)?;
    let (tn, bn, inn, hn) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let dn = sh.direction.count();
    let [_, _, _, _, lh, ly] = sh.lens();
    let g6 = LSTM_ROW * hn;
    let mut out =
        Forward { y: vec![0.0; ly], y_h: vec![0.0; lh], y_c: vec![0.0; lh], gates: vec![0.0; sh.gates_len()] };
    let f = |v: f32| f64::from(v);
    for d in 0..dn {
        let w = |row: usize, col: usize| f(i.w[(d * 4 * hn + row) * inn + col]);
        let r = |row: usize, col: usize| f(i.r[(d * 4 * hn + row) * hn + col]);
        let bias = |k: usize| i.b.map_or(0.0, |b| f(b[d * 8 * hn + k]));
        let init =
            |v: Option<&[f32]>| (0..bn * hn).map(|k| v.map_or(0.0, |v| f(v[d * bn * hn + k]))).collect::<Vec<_>>();
        let (mut h, mut c) = (init(i.initial_h), init(i.initial_c));
        for s in 0..tn {
            let t = if sh.direction.reversed(d) { tn - 1 - s } else { s };
            let (mut hnext, mut cnext) = (vec![0.0; bn * hn], vec![0.0; bn * hn]);
            for b in 0..bn {
                let row = ((d * tn + t) * bn + b) * g6;
                for j in 0..hn {
                    // Pre-activations of the gates i, o, f, c (q = 0..4).
                    let mut a = [0.0f64; 4];
                    for (q, a) in a.iter_mut().enumerate() {
                        *a = bias(q * hn + j) + bias(4 * hn + q * hn + j);
                        for k in 0..inn {
                            *a += f(i.x[(t * bn + b) * inn + k]) * w(q * hn + j, k);
                        }
                        for k in 0..hn {
                            *a += h[b * hn + k] * r(q * hn + j, k);
                        }
                    }
                    let (ig, og, fg, gg) = (sig(a[0]), sig(a[1]), sig(a[2]), a[3].tanh());
                    let cn = fg * c[b * hn + j] + ig * gg;
                    let tc = cn.tanh();
                    cnext[b * hn + j] = cn;
                    hnext[b * hn + j] = og * tc;
                    for (q, v) in [ig, og, fg, gg, cn, tc].into_iter().enumerate() {
                        out.gates[row + q * hn + j] = v;
                    }
                }
            }
            h = hnext;
            c = cnext;
            out.y[(t * dn + d) * bn * hn..(t * dn + d + 1) * bn * hn].copy_from_slice(&h);
        }
        out.y_h[d * bn * hn..(d + 1) * bn * hn].copy_from_slice(&h);
        out.y_c[d * bn * hn..(d + 1) * bn * hn].copy_from_slice(&c);
    }
    Ok(out)
}

/// All six gradients of one LSTM node for the loss `sum(dY Y) + sum(dY_h Y_h) + sum(dY_c
/// Y_c)` (absent gradients zero), the forward recomputed here in float64.
pub fn lstm_grad(
    sh: &LstmShape,
    i: &LstmTrainIn<'_>,
    dy: Option<&[f32]>,
    dy_h: Option<&[f32]>,
    dy_c: Option<&[f32]>,
) -> Result<Grads, KernelError> {
    let fw = lstm_train(sh, i)?;
    let (tn, bn, inn, hn) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let dn = sh.direction.count();
    let [lx, lw, lr, lb, lh, ly] = sh.lens();
    for (what, v, n) in [("dY", dy, ly), ("dY_h", dy_h, lh), ("dY_c", dy_c, lh)] {
        if let Some(v) = v.filter(|v| v.len() != n) {
            return Err(KernelError::LengthMismatch { what, got: v.len(), expected: n });
        }
    }
    let g6 = LSTM_ROW * hn;
    let f = |v: f32| f64::from(v);
    let mut g = Grads {
        dx: vec![0.0; lx],
        dw: vec![0.0; lw],
        dr: vec![0.0; lr],
        db: vec![0.0; lb],
        dh0: vec![0.0; lh],
        dc0: vec![0.0; lh],
    };
    for d in 0..dn {
        let w = |row: usize, col: usize| f(i.w[(d * 4 * hn + row) * inn + col]);
        let r = |row: usize, col: usize| f(i.r[(d * 4 * hn + row) * hn + col]);
        let rev = sh.direction.reversed(d);
        let time = |s: usize| if rev { tn - 1 - s } else { s };
        let gate = |t: usize, b: usize, q: usize, j: usize| fw.gates[((d * tn + t) * bn + b) * g6 + q * hn + j];
        let state0 = |v: Option<&[f32]>, b: usize, j: usize| v.map_or(0.0, |v| f(v[(d * bn + b) * hn + j]));
        let hprev = |s: usize, b: usize, j: usize| {
            if s == 0 {
                state0(i.initial_h, b, j)
            } else {
                fw.y[((time(s - 1) * dn + d) * bn + b) * hn + j]
            }
        };
        let cprev =
            |s: usize, b: usize, j: usize| if s == 0 { state0(i.initial_c, b, j) } else { gate(time(s - 1), b, 4, j) };
        let grad0 =
            |v: Option<&[f32]>| (0..bn * hn).map(|k| v.map_or(0.0, |v| f(v[d * bn * hn + k]))).collect::<Vec<_>>();
        let (mut dh, mut dc) = (grad0(dy_h), grad0(dy_c));
        for s in (0..tn).rev() {
            let t = time(s);
            let (mut dhp, mut dcp) = (vec![0.0; bn * hn], vec![0.0; bn * hn]);
            for b in 0..bn {
                let mut da = vec![[0.0f64; 4]; hn];
                for j in 0..hn {
                    let dhj = dh[b * hn + j] + dy.map_or(0.0, |v| f(v[((t * dn + d) * bn + b) * hn + j]));
                    let (ig, og, fg, gg, tc) =
                        (gate(t, b, 0, j), gate(t, b, 1, j), gate(t, b, 2, j), gate(t, b, 3, j), gate(t, b, 5, j));
                    // h = o tanh(c): dC gains dH o (1 - tanh(c)^2); c = f c_prev + i g.
                    let dcj = dc[b * hn + j] + dhj * og * (1.0 - tc * tc);
                    da[j] = [
                        dcj * gg * ig * (1.0 - ig),
                        dhj * tc * og * (1.0 - og),
                        dcj * cprev(s, b, j) * fg * (1.0 - fg),
                        dcj * ig * (1.0 - gg * gg),
                    ];
                    dcp[b * hn + j] = dcj * fg;
                }
                for q in 0..4 {
                    for j in 0..hn {
                        let (a, row) = (da[j][q], q * hn + j);
                        for k in 0..hn {
                            dhp[b * hn + k] += a * r(row, k);
                            g.dr[(d * 4 * hn + row) * hn + k] += a * hprev(s, b, k);
                        }
                        for k in 0..inn {
                            g.dx[(t * bn + b) * inn + k] += a * w(row, k);
                            g.dw[(d * 4 * hn + row) * inn + k] += a * f(i.x[(t * bn + b) * inn + k]);
                        }
                        g.db[d * 8 * hn + row] += a;
                        g.db[d * 8 * hn + 4 * hn + row] += a;
                    }
                }
            }
            dh = dhp;
            dc = dcp;
        }
        g.dh0[d * bn * hn..(d + 1) * bn * hn].copy_from_slice(&dh);
        g.dc0[d * bn * hn..(d + 1) * bn * hn].copy_from_slice(&dc);
    }
    Ok(g)
}
