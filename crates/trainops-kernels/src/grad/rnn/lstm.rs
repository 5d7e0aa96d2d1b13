//! ONNX's `LSTM` for training (layout 0, the default activations Sigmoid, Tanh, Tanh, no
//! peepholes, `input_forget` 0, any direction), float32: the forward keeping what the
//! backward needs ([`lstm_train`], the `com.trainops::LSTMTrain` op) and backpropagation
//! through time reading it ([`lstm_grad`], `com.trainops::LSTMGrad`).
//!
//! Formulas (gate order i, o, f, c as in ONNX; `Wb`, `Rb` the two halves of `B`):
//! ```text
//! i = σ(x Wi^T + h Ri^T + Wbi + Rbi)   o = σ(x Wo^T + h Ro^T + Wbo + Rbo)
//! f = σ(x Wf^T + h Rf^T + Wbf + Rbf)   g = tanh(x Wc^T + h Rc^T + Wbc + Rbc)
//! c' = f ⊙ c + i ⊙ g                     h' = o ⊙ tanh(c')
//! ```
//! The forward saves per step and batch row [`LSTM_ROW`] `hidden` values, `[i | o | f | g |
//! c' | tanh(c')]`; the backward then needs no transcendental function and no GEMM but one
//! `[batch, 4H] x [4H, H]` product per step. Per direction the forward runs `X W^T` for all
//! steps in one product and `H_{t-1} R^T` per step; the backward carries `dH` and `dC` back
//! through time and then forms `dX`, `dW`, `dR` in one product each over all steps, `dB` as
//! column sums. Every product is `panel`'s: the shared operand packed once per call
//! (`R^T` or `R` for all steps: no packing per step, which made the `gemm` crate's per-step
//! products 1.6x slower here), an FMA microkernel per SIMD level with the same bits at each.
//! The element loops run under the same AVX2 dispatch as GRU's (equal bits either way); the
//! products split into column blocks on the caller's [`Parallelism`] (equal bits at any
//! thread count). [`reference`](mod@reference) is the plain float64 form the tests hold
//! both to.

mod panel;
pub mod reference;

use ndarray::s;

use self::panel::{gemm_packed, Packed};
use super::{
    check, column_sums, portable_forced, recurrent_gates_len, recurrent_lens, sigmoid, sized, tanh, view_mut, wide,
    Direction, GATE_TASK,
};
use crate::parallel::{for_each_item, Parallelism};
use crate::KernelError;

/// Values per hidden unit in a row of saved gates: `[i | o | f | g | c_t | tanh(c_t)]`, each
/// `hidden` wide (the four gates after their activations, then the new cell state).
pub const LSTM_ROW: usize = 6;

/// Sizes and attributes of one LSTM node.
#[derive(Debug, Clone, Copy)]
pub struct LstmShape {
    /// Sequence length.
    pub seq: usize,
    /// Batch size.
    pub batch: usize,
    /// Input size.
    pub input: usize,
    /// Hidden size.
    pub hidden: usize,
    /// The direction attribute.
    pub direction: Direction,
}

impl LstmShape {
    /// Element counts of X, W, R, B, initial_h (initial_c, Y_h, Y_c have its count), Y, for
    /// a shape [checked](Self::checked_lens) (else `usize::MAX`, which no buffer matches).
    pub fn lens(&self) -> [usize; 6] {
        self.checked_lens().unwrap_or([usize::MAX; 6])
    }

    /// [`LstmShape::lens`], every product overflow-checked left to right (so `4 *
    /// hidden_size` and `8 * hidden_size` fit too).
    pub fn checked_lens(&self) -> Result<[usize; 6], KernelError> {
        let dims = [self.seq, self.batch, self.input, self.hidden, self.direction.count()];
        recurrent_lens(
            dims,
            4,
            ["W (dirs, 4 hidden_size, input)", "R (dirs, 4 hidden_size, hidden_size)", "B (dirs, 8 hidden_size)"],
        )
    }

    /// Element count of the saved gates, `[dirs, seq, batch, LSTM_ROW * hidden]` (for a
    /// checked shape; else `usize::MAX`).
    pub fn gates_len(&self) -> usize {
        self.checked_gates_len().unwrap_or(usize::MAX)
    }

    /// [`LstmShape::gates_len`], overflow-checked.
    pub fn checked_gates_len(&self) -> Result<usize, KernelError> {
        let dims = [self.seq, self.batch, self.hidden, self.direction.count()];
        recurrent_gates_len(dims, LSTM_ROW, ["6 hidden_size", "gates (dirs, seq, batch, 6 hidden_size)"])
    }
}

/// Inputs of ONNX's LSTM in layout 0 (without `sequence_lens` and `P`).
#[derive(Debug, Clone, Copy)]
pub struct LstmTrainIn<'a> {
    /// `[seq, batch, input]`.
    pub x: &'a [f32],
    /// `[dirs, 4 hidden, input]`.
    pub w: &'a [f32],
    /// `[dirs, 4 hidden, hidden]`.
    pub r: &'a [f32],
    /// `[dirs, 8 hidden]`, absent: zeros.
    pub b: Option<&'a [f32]>,
    /// `[dirs, batch, hidden]`, absent: zeros.
    pub initial_h: Option<&'a [f32]>,
    /// `[dirs, batch, hidden]`, absent: zeros.
    pub initial_c: Option<&'a [f32]>,
}

/// Outputs of the forward, each overwritten: `Y` `[seq, dirs, batch, hidden]`, `Y_h` and
/// `Y_c` `[dirs, batch, hidden]` (optional), the gates `[dirs, seq, batch, LSTM_ROW hidden]`.
#[derive(Debug)]
pub struct LstmTrainOut<'a> {
    /// All hidden states.
    pub y: &'a mut [f32],
    /// The last hidden state of each direction.
    pub y_h: Option<&'a mut [f32]>,
    /// The last cell state of each direction.
    pub y_c: Option<&'a mut [f32]>,
    /// See [`LSTM_ROW`].
    pub gates: &'a mut [f32],
}

/// Inputs of the backward: the forward's X, W, R, initial states, its `Y` and saved gates,
/// and the gradients of `Y`, `Y_h`, `Y_c` (absent: zero). B is not needed (the gates hold it).
#[derive(Debug, Clone, Copy)]
pub struct LstmGradIn<'a> {
    /// `[seq, batch, input]`.
    pub x: &'a [f32],
    /// `[dirs, 4 hidden, input]`.
    pub w: &'a [f32],
    /// `[dirs, 4 hidden, hidden]`.
    pub r: &'a [f32],
    /// The forward's `Y`, `[seq, dirs, batch, hidden]`.
    pub y: &'a [f32],
    /// The forward's gates ([`LSTM_ROW`]), `[dirs, seq, batch, 6 hidden]`.
    pub gates: &'a [f32],
    /// `[dirs, batch, hidden]`, absent: zeros.
    pub initial_h: Option<&'a [f32]>,
    /// `[dirs, batch, hidden]`, absent: zeros.
    pub initial_c: Option<&'a [f32]>,
    /// Gradient of `Y`.
    pub dy: Option<&'a [f32]>,
    /// Gradient of `Y_h`.
    pub dy_h: Option<&'a [f32]>,
    /// Gradient of `Y_c`.
    pub dy_c: Option<&'a [f32]>,
}

/// The gradients wanted (each optional), shaped as the matching inputs (`dB` `[dirs, 8
/// hidden]`).
#[derive(Debug, Default)]
pub struct LstmGradOut<'a> {
    /// Of X.
    pub dx: Option<&'a mut [f32]>,
    /// Of W.
    pub dw: Option<&'a mut [f32]>,
    /// Of R.
    pub dr: Option<&'a mut [f32]>,
    /// Of B.
    pub db: Option<&'a mut [f32]>,
    /// Of initial_h.
    pub dh0: Option<&'a mut [f32]>,
    /// Of initial_c.
    pub dc0: Option<&'a mut [f32]>,
}

fn opt(v: Option<usize>, what: &'static str, n: usize) -> Result<(), KernelError> {
    v.map_or(Ok(()), |g| check(what, g, n))
}

/// Checks the forward's buffers against `sh` (shared with the reference).
pub(crate) fn check_train_lens(
    sh: &LstmShape,
    i: &LstmTrainIn<'_>,
    o: Option<&LstmTrainOut<'_>>,
) -> Result<(), KernelError> {
    let [lx, lw, lr, lb, lh, ly] = sh.checked_lens()?;
    let lg = sh.checked_gates_len()?;
    check("X", i.x.len(), lx)?;
    check("W", i.w.len(), lw)?;
    check("R", i.r.len(), lr)?;
    opt(i.b.map(<[f32]>::len), "B", lb)?;
    opt(i.initial_h.map(<[f32]>::len), "initial_h", lh)?;
    opt(i.initial_c.map(<[f32]>::len), "initial_c", lh)?;
    if let Some(o) = o {
        check("Y", o.y.len(), ly)?;
        opt(o.y_h.as_deref().map(<[f32]>::len), "Y_h", lh)?;
        opt(o.y_c.as_deref().map(<[f32]>::len), "Y_c", lh)?;
        check("gates", o.gates.len(), lg)?;
    }
    Ok(())
}

/// Checks the backward's buffers against `sh`.
pub(crate) fn check_grad_lens(sh: &LstmShape, i: &LstmGradIn<'_>, o: &LstmGradOut<'_>) -> Result<(), KernelError> {
    let [lx, lw, lr, lb, lh, ly] = sh.checked_lens()?;
    let lg = sh.checked_gates_len()?;
    check("X", i.x.len(), lx)?;
    check("W", i.w.len(), lw)?;
    check("R", i.r.len(), lr)?;
    check("Y", i.y.len(), ly)?;
    check("gates", i.gates.len(), lg)?;
    opt(i.initial_h.map(<[f32]>::len), "initial_h", lh)?;
    opt(i.initial_c.map(<[f32]>::len), "initial_c", lh)?;
    opt(i.dy.map(<[f32]>::len), "dY", ly)?;
    opt(i.dy_h.map(<[f32]>::len), "dY_h", lh)?;
    opt(i.dy_c.map(<[f32]>::len), "dY_c", lh)?;
    opt(o.dx.as_deref().map(<[f32]>::len), "dX", lx)?;
    opt(o.dw.as_deref().map(<[f32]>::len), "dW", lw)?;
    opt(o.dr.as_deref().map(<[f32]>::len), "dR", lr)?;
    opt(o.db.as_deref().map(<[f32]>::len), "dB", lb)?;
    opt(o.dh0.as_deref().map(<[f32]>::len), "d_initial_h", lh)?;
    opt(o.dc0.as_deref().map(<[f32]>::len), "d_initial_c", lh)
}

/// Working memory of [`lstm_train_with`] kept between calls (never read before written).
#[derive(Debug, Default)]
pub struct LstmTrainScratch {
    /// `[batch, 4H]`: one step's `H_{t-1} R^T`.
    gh: Vec<f32>,
    /// `[batch, H]`: the previous hidden and cell states.
    hp: Vec<f32>,
    cp: Vec<f32>,
    /// `R^T` of one direction, packed for the steps' products.
    rp: Packed,
    /// `W^T` of one direction, packed for `X W^T`.
    wp: Packed,
}

/// The instruction set of the packed products (portable when a test asks for it).
fn isa() -> crate::simd::Isa {
    let level = if portable_forced() { crate::simd::Level::Scalar } else { crate::simd::detected() };
    level.isa().unwrap_or(crate::simd::Isa::Scalar)
}

/// [`lstm_train_with`] with fresh working memory.
pub fn lstm_train(
    sh: &LstmShape,
    i: &LstmTrainIn<'_>,
    o: LstmTrainOut<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    lstm_train_with(sh, i, o, par, &mut LstmTrainScratch::default())
}

/// Copies direction `d`'s part of an optional `[dirs, batch, hidden]` state into `dst`
/// (zeros when absent).
fn initial(dst: &mut [f32], src: Option<&[f32]>, d: usize) {
    let n = dst.len();
    match src {
        Some(v) => dst.copy_from_slice(&v[d * n..(d + 1) * n]),
        None => dst.fill(0.0),
    }
}

/// The forward of one LSTM node, keeping its gates; `par` runs the GEMMs' blocks and the
/// gate math where large.
pub fn lstm_train_with(
    sh: &LstmShape,
    i: &LstmTrainIn<'_>,
    o: LstmTrainOut<'_>,
    par: &dyn Parallelism,
    scratch: &mut LstmTrainScratch,
) -> Result<(), KernelError> {
    check_train_lens(sh, i, Some(&o))?;
    let (t_len, bt, isz, h) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let (dirs, g4, g6, bh, n) = (sh.direction.count(), 4 * h, LSTM_ROW * h, bt * h, t_len * bt);
    let LstmTrainOut { y, mut y_h, mut y_c, gates } = o;
    if bh == 0 {
        return Ok(()); // every output is empty
    }
    if t_len == 0 {
        // No steps: the last states are the initial ones (nothing sized by the batch).
        for (out, src) in [(y_h.as_deref_mut(), i.initial_h), (y_c.as_deref_mut(), i.initial_c)] {
            if let Some(out) = out {
                match src {
                    Some(v) => out.copy_from_slice(v),
                    None => out.fill(0.0),
                }
            }
        }
        return Ok(());
    }
    let LstmTrainScratch { gh, hp, cp, rp, wp } = scratch;
    let isa = isa();
    let (gh, hp, cp) = (sized(gh, bt * g4), sized(hp, bh), sized(cp, bh));
    for d in 0..dirs {
        // Packed from R's rows (a copy of R^T first, element by element through ndarray,
        // took 0.8-1.9 ms of the bench LSTM's forward per layer).
        rp.pack_t(par, &i.r[d * g4 * h..], h, g4, h);
        // Both halves of the bias summed once (zeros when absent).
        let bias: Vec<f32> = match i.b {
            Some(b) => {
                let b = &b[d * 8 * h..(d + 1) * 8 * h];
                b[..g4].iter().zip(&b[g4..]).map(|(p, q)| p + q).collect()
            }
            None => vec![0.0; g4],
        };
        let g = &mut gates[d * n * g6..(d + 1) * n * g6];
        wp.pack_t(par, &i.w[d * g4 * isz..], isz, g4, isz);
        gemm_packed(par, isa, i.x, (isz, 1), wp, view_mut(g, n, g6).slice_move(s![.., ..g4]), false);
        initial(hp, i.initial_h, d);
        initial(cp, i.initial_c, d);
        for s_ in 0..t_len {
            let t = if sh.direction.reversed(d) { t_len - 1 - s_ } else { s_ };
            gemm_packed(par, isa, hp, (h, 1), rp, view_mut(gh, bt, g4), false);
            let g_t = &mut g[t * bt * g6..(t + 1) * bt * g6];
            let y_t = &mut y[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
            cells(par, h, g_t, gh, &bias, cp, y_t);
            hp.copy_from_slice(y_t);
        }
        if let Some(yh) = y_h.as_deref_mut() {
            yh[d * bh..(d + 1) * bh].copy_from_slice(hp);
        }
        if let Some(yc) = y_c.as_deref_mut() {
            yc[d * bh..(d + 1) * bh].copy_from_slice(cp);
        }
    }
    Ok(())
}

/// One step's gate math, in row blocks run as tasks of `par`: the pre-activations `g`
/// (`[rows, LSTM_ROW H]`, first `4H` from `X W^T`) plus `gh` (`H_{t-1} R^T`) and `bias` become
/// the saved row; `cp` (`c_{t-1}`) becomes `c_t` and `y` takes `h_t`.
fn cells(par: &dyn Parallelism, h: usize, g: &mut [f32], gh: &[f32], bias: &[f32], cp: &mut [f32], y: &mut [f32]) {
    let (g4, g6) = (4 * h, LSTM_ROW * h);
    let rows = (GATE_TASK / g6).max(1);
    let items: Vec<_> = g
        .chunks_mut(rows * g6)
        .zip(gh.chunks(rows * g4))
        .zip(cp.chunks_mut(rows * h).zip(y.chunks_mut(rows * h)))
        .collect();
    for_each_item(par, items, |((g, gh), (cp, y))| {
        wide(
            #[inline(always)]
            || {
                for ((gr, ghr), (cr, yr)) in g
                    .chunks_exact_mut(g6)
                    .zip(gh.chunks_exact(g4))
                    .zip(cp.chunks_exact_mut(h).zip(y.chunks_exact_mut(h)))
                {
                    // Activations in place, each gate in its own loop (so each vectorises).
                    let (act, state) = gr.split_at_mut(g4);
                    for ((a, b), c) in act[..3 * h].iter_mut().zip(&ghr[..3 * h]).zip(&bias[..3 * h]) {
                        *a = sigmoid(*a + b + c);
                    }
                    for ((a, b), c) in act[3 * h..].iter_mut().zip(&ghr[3 * h..]).zip(&bias[3 * h..]) {
                        *a = tanh(*a + b + c);
                    }
                    let (ig, rest) = act.split_at(h);
                    let (og, rest) = rest.split_at(h);
                    let (fg, gg) = rest.split_at(h);
                    let (cn, tc) = state.split_at_mut(h);
                    let (ig, og, fg, gg, cn, tc, cr, yr) = (
                        &ig[..h],
                        &og[..h],
                        &fg[..h],
                        &gg[..h],
                        &mut cn[..h],
                        &mut tc[..h],
                        &mut cr[..h],
                        &mut yr[..h],
                    );
                    for j in 0..h {
                        let c = fg[j] * cr[j] + ig[j] * gg[j];
                        cn[j] = c;
                        cr[j] = c;
                    }
                    for j in 0..h {
                        tc[j] = tanh(cn[j]);
                    }
                    for j in 0..h {
                        yr[j] = og[j] * tc[j];
                    }
                }
            },
        )
    });
}

/// Working memory of [`lstm_grad_with`], kept by the caller between calls.
#[derive(Debug, Default)]
pub struct LstmScratch {
    /// `[n, H]` previous hidden states.
    hp: Vec<f32>,
    /// `[n, 4H]` gradients of the gate pre-activations.
    da: Vec<f32>,
    /// `[batch, H]`: the carried `dH`, the next one, the carried `dC`, and `c_{t-1}`.
    dh: Vec<f32>,
    dhn: Vec<f32>,
    dc: Vec<f32>,
    cp: Vec<f32>,
    /// R of one direction, packed for the steps' products (then W, X, H_{t-1} in turn).
    rp: Packed,
    /// `[4H, n]`: dA transposed.
    dat: Vec<f32>,
}

/// Side of the square tiles [`transpose`] moves through a local buffer.
const TILE: usize = 16;

/// `dst = src^T` for a row-major `[rows, cols]` `src`: tasks of `par` take blocks of `src`'s
/// columns (`dst`'s rows), and each moves 16 x 16 tiles through a local buffer, reading
/// whole rows of a tile and writing whole cache lines of its transpose. The LSTM's `[1024,
/// 1024]` dA, read back from memory after the steps, took 3.7-4.3 ms element by element on
/// one thread in the step; tiled 1.4-3.0 ms on one thread, 0.9-1.3 on two.
fn transpose(par: &dyn Parallelism, src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    if rows == 0 || cols == 0 {
        return;
    }
    // About 64 Ki elements per task, whole tiles.
    let per = ((1usize << 16) / rows).max(1).next_multiple_of(TILE).min(cols.next_multiple_of(TILE));
    let items: Vec<_> = dst.chunks_mut(per * rows).enumerate().collect();
    for_each_item(par, items, |(q, block)| {
        let c0 = q * per;
        let width = block.len() / rows;
        let mut tile = [[0.0f32; TILE]; TILE];
        for r0 in (0..rows).step_by(TILE) {
            let h = TILE.min(rows - r0);
            for cb in (0..width).step_by(TILE) {
                let w = TILE.min(width - cb);
                for (i, line) in tile[..h].iter_mut().enumerate() {
                    line[..w].copy_from_slice(&src[(r0 + i) * cols + c0 + cb..][..w]);
                }
                for j in 0..w {
                    let out = &mut block[(cb + j) * rows + r0..][..h];
                    for (o, line) in out.iter_mut().zip(&tile[..h]) {
                        *o = line[j];
                    }
                }
            }
        }
    });
}

/// The gradients of one LSTM node's inputs given its forward's gates. Every output given is
/// overwritten.
pub fn lstm_grad(
    sh: &LstmShape,
    i: &LstmGradIn<'_>,
    o: LstmGradOut<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    lstm_grad_with(sh, i, o, par, &mut LstmScratch::default())
}

/// [`lstm_grad`] with the caller's working memory.
pub fn lstm_grad_with(
    sh: &LstmShape,
    i: &LstmGradIn<'_>,
    mut o: LstmGradOut<'_>,
    par: &dyn Parallelism,
    scratch: &mut LstmScratch,
) -> Result<(), KernelError> {
    check_grad_lens(sh, i, &o)?;
    if sh.seq == 0 {
        // No steps: dY_h and dY_c flow straight to the initial states.
        for out in [o.dx, o.dw, o.dr, o.db].into_iter().flatten() {
            out.fill(0.0);
        }
        for (out, g) in [(o.dh0, i.dy_h), (o.dc0, i.dy_c)] {
            if let Some(out) = out {
                match g {
                    Some(g) => out.copy_from_slice(g),
                    None => out.fill(0.0),
                }
            }
        }
        return Ok(());
    }
    if sh.hidden == 0 || sh.batch == 0 {
        for out in [o.dx, o.dw, o.dr, o.db, o.dh0, o.dc0].into_iter().flatten() {
            out.fill(0.0);
        }
        return Ok(());
    }
    for d in 0..sh.direction.count() {
        one_direction(sh, i, &mut o, d, par, scratch);
    }
    Ok(())
}

fn one_direction(
    sh: &LstmShape,
    i: &LstmGradIn<'_>,
    o: &mut LstmGradOut<'_>,
    d: usize,
    par: &dyn Parallelism,
    wk: &mut LstmScratch,
) {
    let (t_len, bt, isz, h) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let (dirs, rev) = (sh.direction.count(), sh.direction.reversed(d));
    let (g4, g6, n, bh) = (4 * h, LSTM_ROW * h, t_len * bt, bt * h);
    let g = &i.gates[d * n * g6..(d + 1) * n * g6];
    let y_at = |t: usize| &i.y[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
    let prev = |t: usize| if rev { (t + 1 < t_len).then_some(t + 1) } else { t.checked_sub(1) };
    let LstmScratch { hp, da, dh, dhn, dc, cp, rp, dat } = wk;
    rp.pack(par, &i.r[d * g4 * h..], g4, h, h);
    let isa = isa();
    let (hp, da) = (sized(hp, n * h), sized(da, n * g4));
    let (dh, dhn, dc, cp) = (sized(dh, bh), sized(dhn, bh), sized(dc, bh), sized(cp, bh));

    // 1. Previous hidden states of every step.
    for t in 0..t_len {
        let dst = &mut hp[t * bh..(t + 1) * bh];
        match prev(t) {
            Some(p) => dst.copy_from_slice(y_at(p)),
            None => initial(dst, i.initial_h, d),
        }
    }

    // 2. Backward through time.
    initial(dh, i.dy_h, d);
    initial(dc, i.dy_c, d);
    let (mut dh, mut dhn) = (dh, dhn);
    for step in (0..t_len).rev() {
        let t = if rev { t_len - 1 - step } else { step };
        if let Some(dy) = i.dy {
            let dyt = &dy[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
            dh.iter_mut().zip(dyt).for_each(|(a, b)| *a += b);
        }
        match prev(t) {
            Some(p) => {
                let rows = g[p * bt * g6..(p + 1) * bt * g6].chunks_exact(g6);
                for (dst, row) in cp.chunks_exact_mut(h).zip(rows) {
                    dst.copy_from_slice(&row[g4..g4 + h]);
                }
            }
            None => initial(cp, i.initial_c, d),
        }
        let g_t = &g[t * bt * g6..(t + 1) * bt * g6];
        let da_t = &mut da[t * bt * g4..(t + 1) * bt * g4];
        // The step's gate gradients in row blocks run as tasks, as the forward's `cells`
        // (each row alone: the same bits however the rows are cut).
        let rows = (GATE_TASK / g6).max(1);
        let items: Vec<_> = g_t
            .chunks(rows * g6)
            .zip(cp.chunks(rows * h).zip(dh.chunks(rows * h)))
            .zip(dc.chunks_mut(rows * h).zip(da_t.chunks_mut(rows * g4)))
            .collect();
        for_each_item(par, items, |((g_r, (cp_r, dh_r)), (dc_r, da_r))| {
            wide(
                #[inline(always)]
                || step_cells(h, g_r, cp_r, dh_r, dc_r, da_r),
            );
        });
        gemm_packed(par, isa, da_t, (g4, 1), rp, view_mut(dhn, bt, h), false);
        std::mem::swap(&mut dh, &mut dhn);
    }
    if let Some(dh0) = o.dh0.as_deref_mut() {
        dh0[d * bh..(d + 1) * bh].copy_from_slice(dh);
    }
    if let Some(dc0) = o.dc0.as_deref_mut() {
        dc0[d * bh..(d + 1) * bh].copy_from_slice(dc);
    }

    // 3. The weights' and the input's gradients over all steps at once.
    // All through the packed products (as the steps'): dX = dA W; dW = dA^T X and dR =
    // dA^T H_{t-1} from dA transposed once.
    if let Some(dx) = o.dx.as_deref_mut() {
        rp.pack(par, &i.w[d * g4 * isz..], g4, isz, isz);
        gemm_packed(par, isa, da, (g4, 1), rp, view_mut(dx, n, isz), d != 0);
    }
    if o.dw.is_some() || o.dr.is_some() {
        // dA^T copied once (reading it in place, strides (1, 4H), was 1.3x slower: a new
        // page every step of the sums).
        let dat = sized(dat, g4 * n);
        transpose(par, da, n, g4, dat);
        if let Some(dw) = o.dw.as_deref_mut() {
            rp.pack(par, i.x, n, isz, isz);
            gemm_packed(par, isa, dat, (n, 1), rp, view_mut(&mut dw[d * g4 * isz..], g4, isz), false);
        }
        if let Some(dr) = o.dr.as_deref_mut() {
            rp.pack(par, hp, n, h, h);
            gemm_packed(par, isa, dat, (n, 1), rp, view_mut(&mut dr[d * g4 * h..], g4, h), false);
        }
    }
    if let Some(db) = o.db.as_deref_mut() {
        let db = &mut db[d * 8 * h..(d + 1) * 8 * h];
        let (dwb, drb) = db.split_at_mut(g4);
        wide(
            #[inline(always)]
            || column_sums(da, g4, dwb),
        );
        drb.copy_from_slice(dwb);
    }
}

/// One step's gate gradients, row by row: with `dC = dC_carried + dH ⊙ o ⊙ (1 - tanh(c)^2)`,
/// `da = [dC ⊙ g ⊙ σ'(i), dH ⊙ tanh(c) ⊙ σ'(o), dC ⊙ c_{t-1} ⊙ σ'(f), dC ⊙ i ⊙ (1 - g^2)]`
/// and the carried `dC` becomes `dC ⊙ f`.
#[inline(always)]
fn step_cells(h: usize, g: &[f32], cp: &[f32], dh: &[f32], dc: &mut [f32], da: &mut [f32]) {
    let (g4, g6) = (4 * h, LSTM_ROW * h);
    let ins = g.chunks_exact(g6).zip(cp.chunks_exact(h).zip(dh.chunks_exact(h)));
    for ((g, (cp, dh)), (dc, da)) in ins.zip(dc.chunks_exact_mut(h).zip(da.chunks_exact_mut(g4))) {
        let (ig, rest) = g.split_at(h);
        let (og, rest) = rest.split_at(h);
        let (fg, rest) = rest.split_at(h);
        let (gg, rest) = rest.split_at(h);
        let tc = &rest[h..2 * h];
        let (da_i, rest) = da.split_at_mut(h);
        let (da_o, rest) = rest.split_at_mut(h);
        let (da_f, da_g) = rest.split_at_mut(h);
        // Every slice cut to h: no bounds checks in the loop, so it vectorises.
        let (ig, og, fg, gg, tc, cp, dh) = (&ig[..h], &og[..h], &fg[..h], &gg[..h], &tc[..h], &cp[..h], &dh[..h]);
        let (dc, da_i, da_o, da_f, da_g) =
            (&mut dc[..h], &mut da_i[..h], &mut da_o[..h], &mut da_f[..h], &mut da_g[..h]);
        // One output a loop (each vectorises; one loop over all of them did not), the same
        // operations in the same order as the formulas above.
        for j in 0..h {
            dc[j] += dh[j] * og[j] * (1.0 - tc[j] * tc[j]);
        }
        for j in 0..h {
            da_i[j] = dc[j] * gg[j] * ig[j] * (1.0 - ig[j]);
        }
        for j in 0..h {
            da_o[j] = dh[j] * tc[j] * og[j] * (1.0 - og[j]);
        }
        for j in 0..h {
            da_f[j] = dc[j] * cp[j] * fg[j] * (1.0 - fg[j]);
        }
        for j in 0..h {
            da_g[j] = dc[j] * ig[j] * (1.0 - gg[j] * gg[j]);
        }
        for j in 0..h {
            dc[j] *= fg[j];
        }
    }
}

#[cfg(test)]
mod tests;
