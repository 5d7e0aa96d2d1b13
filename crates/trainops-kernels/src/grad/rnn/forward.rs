//! The forward of ONNX's `GRU` that keeps what its backward needs (`com.trainops::GRUTrain`):
//! besides `Y` and `Y_h`, every step's gates as rows of [`GATE_ROW`] `hidden` values
//! (`[dirs, seq, batch, GATE_ROW hidden]`, see [`GATE_ROW`]), so that
//! [`gru_grad`](super::gru_grad) given them recomputes nothing.
//!
//! Per direction: `X W^T` for all steps in one GEMM (as the backward's recomputation), then
//! per step `H_{t-1} R^T` (one GEMM, two with `linear_before_reset` 0), the gate math of
//! the backward's recomputation on that step's rows, and `H_t = (1 - z) ⊙ ĥ + z ⊙ H_{t-1}`.
//! [`reference::gru_train`](super::reference::gru_train) is the float64 form it is held to.

use super::{check, input_gates, recurrent_gates, sized, wide, DirWeights, GruShape, GATE_ROW};
use crate::parallel::Parallelism;
use crate::KernelError;

/// Inputs of ONNX's GRU in layout 0 (without `sequence_lens`).
#[derive(Debug, Clone, Copy)]
pub struct GruTrainIn<'a> {
    /// `[seq, batch, input]`.
    pub x: &'a [f32],
    /// `[dirs, 3 hidden, input]`.
    pub w: &'a [f32],
    /// `[dirs, 3 hidden, hidden]`.
    pub r: &'a [f32],
    /// `[dirs, 6 hidden]`, absent: zeros.
    pub b: Option<&'a [f32]>,
    /// `[dirs, batch, hidden]`, absent: zeros.
    pub initial_h: Option<&'a [f32]>,
}

/// Outputs: `Y` (`[seq, dirs, batch, hidden]`), `Y_h` (`[dirs, batch, hidden]`, optional) and
/// the gates (`[dirs, seq, batch, GATE_ROW hidden]`), each overwritten.
#[derive(Debug)]
pub struct GruTrainOut<'a> {
    /// All hidden states.
    pub y: &'a mut [f32],
    /// The last hidden state of each direction.
    pub y_h: Option<&'a mut [f32]>,
    /// z, r, ĥ and the h gate's recurrent term of every step (module [`super`]'s [`GATE_ROW`]).
    pub gates: &'a mut [f32],
}

/// Working memory of [`gru_train_with`] kept between calls (contents never read before
/// being written).
#[derive(Debug, Default)]
pub struct GruTrainScratch {
    /// `[batch, 3H]`: one step's `H_{t-1} R^T`.
    gh: Vec<f32>,
    /// `[batch, H]`: the previous hidden state.
    hp: Vec<f32>,
}

/// [`gru_train_with`] with fresh working memory.
pub fn gru_train(
    sh: &GruShape,
    i: &GruTrainIn<'_>,
    o: GruTrainOut<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    gru_train_with(sh, i, o, par, &mut GruTrainScratch::default())
}

/// Checks every buffer's length against `sh` (shared with the reference).
pub(crate) fn check_train_lens(
    sh: &GruShape,
    i: &GruTrainIn<'_>,
    o: Option<&GruTrainOut<'_>>,
) -> Result<(), KernelError> {
    let [lx, lw, lr, lb, lh, ly] = sh.checked_lens()?;
    let lg = sh.checked_gates_len()?;
    check("X", i.x.len(), lx)?;
    check("W", i.w.len(), lw)?;
    check("R", i.r.len(), lr)?;
    i.b.map_or(Ok(()), |b| check("B", b.len(), lb))?;
    i.initial_h.map_or(Ok(()), |v| check("initial_h", v.len(), lh))?;
    if let Some(o) = o {
        check("Y", o.y.len(), ly)?;
        o.y_h.as_deref().map_or(Ok(()), |v| check("Y_h", v.len(), lh))?;
        check("gates", o.gates.len(), lg)?;
    }
    Ok(())
}

/// The forward of one GRU node, keeping its gates; `par` runs the GEMMs' blocks and the
/// gate math where large.
pub fn gru_train_with(
    sh: &GruShape,
    i: &GruTrainIn<'_>,
    o: GruTrainOut<'_>,
    par: &dyn Parallelism,
    scratch: &mut GruTrainScratch,
) -> Result<(), KernelError> {
    check_train_lens(sh, i, Some(&o))?;
    let (t_len, bt, isz, h) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let (dirs, lbr, g4, bh, n) = (sh.direction.count(), sh.linear_before_reset, GATE_ROW * h, bt * h, t_len * bt);
    let GruTrainOut { y, mut y_h, gates } = o;
    if bh == 0 {
        return Ok(()); // every output is empty
    }
    if t_len == 0 {
        // No steps: Y_h is the initial state (nothing is sized by the batch, which may be
        // huge beside the empty sequence).
        if let Some(yh) = y_h.as_deref_mut() {
            match i.initial_h {
                Some(h0) => yh.copy_from_slice(h0),
                None => yh.fill(0.0),
            }
        }
        return Ok(());
    }
    let x = super::view(i.x, n, isz);
    let (gh, hp) = (sized(&mut scratch.gh, bt * 3 * h), sized(&mut scratch.hp, bh));
    for d in 0..dirs {
        let dw = DirWeights::new(sh, i.w, i.r, i.b, d);
        let g = &mut gates[d * n * g4..(d + 1) * n * g4];
        input_gates(par, x, dw.w, g);
        match i.initial_h {
            Some(h0) => hp.copy_from_slice(&h0[d * bh..(d + 1) * bh]),
            None => hp.fill(0.0),
        }
        for s in 0..t_len {
            let t = if sh.direction.reversed(d) { t_len - 1 - s } else { s };
            let g_t = &mut g[t * bt * g4..(t + 1) * bt * g4];
            recurrent_gates(par, &dw, lbr, g_t, gh, hp);
            let y_t = &mut y[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
            wide(
                #[inline(always)]
                || new_state(h, g_t, hp, y_t),
            );
            hp.copy_from_slice(y_t);
        }
        if let Some(yh) = y_h.as_deref_mut() {
            yh[d * bh..(d + 1) * bh].copy_from_slice(hp);
        }
    }
    Ok(())
}

/// `H_t = (1 - z) ⊙ ĥ + z ⊙ H_{t-1}`, row by row.
#[inline(always)]
fn new_state(h: usize, g: &[f32], hp: &[f32], y: &mut [f32]) {
    for ((g, hp), y) in g.chunks_exact(GATE_ROW * h).zip(hp.chunks_exact(h)).zip(y.chunks_exact_mut(h)) {
        let (z, hh, hp, y) = (&g[..h], &g[2 * h..3 * h], &hp[..h], &mut y[..h]);
        for j in 0..h {
            y[j] = (1.0 - z[j]) * hh[j] + z[j] * hp[j];
        }
    }
}
