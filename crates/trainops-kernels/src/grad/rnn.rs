//! Backpropagation through time for ONNX's `GRU` (layout 0, the default activations Sigmoid
//! and Tanh, `linear_before_reset` 0 or 1, any direction), float32.
//!
//! The gates come from the forward where it saved them ([`forward::gru_train`], the
//! `com.trainops::GRUTrain` op: rows of [`GATE_ROW`] `hidden` values, z, r, ĥ and the h
//! gate's recurrent term); otherwise they are recomputed from the forward's hidden states `Y`
//! (ONNX's GRU keeps none): `X W^T` for all steps in one GEMM, `H_{t-1} R^T` likewise (every
//! `H_{t-1}` is known). Then one reverse loop carries `dH` back with one GEMM per step (two with
//! `linear_before_reset` 0), and `dX`, `dW`, `dR` are again one GEMM each over all steps.
//! GEMMs are the `gemm` crate's through `grad::gemm` (its own threading off), cut into row
//! or column blocks as
//! tasks of the caller's [`Parallelism`] where large.
//!
//! Formulas (gate order z, r, h as in ONNX; `Wb`, `Rb` the two halves of `B`):
//! ```text
//! z = σ(x Wz^T + h Rz^T + Wbz + Rbz)        r = σ(x Wr^T + h Rr^T + Wbr + Rbr)
//! lbr 0: ĥ = tanh(x Wh^T + (r ⊙ h) Rh^T + Rbh + Wbh)
//! lbr 1: ĥ = tanh(x Wh^T + r ⊙ (h Rh^T + Rbh) + Wbh)
//! h' = (1 - z) ⊙ ĥ + z ⊙ h
//! ```
//! The fast path's `exp` is a polynomial (within a few float32 ulp); [`reference`](mod@reference) is the
//! plain float64 form the tests hold it to.

pub mod forward;
pub mod lstm;
pub mod reference;

use ndarray::{s, ArrayView2, ArrayViewMut2, Axis};

use super::gemm::matmul_view;
use crate::parallel::{for_each_item, Parallelism};
use crate::KernelError;

/// Runs `f` compiled for AVX2 and FMA where the CPU has them, else as portable code. The
/// element loops do the same operations either way (Rust never contracts `a * b + c`), so
/// the results are the same bits; only the vector width changes.
#[inline(always)]
fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if let Some(crate::simd::Isa::Avx2(token)) = crate::simd::Level::Avx2.isa().filter(|_| !portable_forced()) {
        // SAFETY: the token proves this CPU has AVX2 and FMA (runtime detection).
        return unsafe { wide_avx2(token, f) };
    }
    f()
}

/// Whether a test asked this thread for the portable loops (never outside tests).
#[cfg(test)]
fn portable_forced() -> bool {
    tests::PORTABLE.with(std::cell::Cell::get)
}

#[cfg(not(test))]
#[inline(always)]
fn portable_forced() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn wide_avx2<R>(_: crate::simd::Avx2, f: impl FnOnce() -> R) -> R {
    f()
}

/// Values per hidden unit in a row of saved gates: `[z | r | ĥ | e]`, each `hidden` wide,
/// where `e` is the h gate's recurrent term, `H_{t-1} Rh^T + Rbh` with
/// `linear_before_reset` 1 and `r ⊙ H_{t-1}` with 0 (what the backward needs of it).
pub const GATE_ROW: usize = 4;

/// Direction attribute of the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Time runs forward.
    Forward,
    /// Time runs backward.
    Reverse,
    /// Forward (direction 0) and reverse (direction 1).
    Bidirectional,
}

impl Direction {
    /// Number of directions (`num_directions` of ONNX).
    pub fn count(self) -> usize {
        if self == Direction::Bidirectional {
            2
        } else {
            1
        }
    }

    /// Whether direction index `d` runs backward in time.
    pub fn reversed(self, d: usize) -> bool {
        self == Direction::Reverse || (self == Direction::Bidirectional && d == 1)
    }
}

/// Sizes and attributes of one GRU node.
#[derive(Debug, Clone, Copy)]
pub struct GruShape {
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
    /// `linear_before_reset != 0`.
    pub linear_before_reset: bool,
}

/// Element counts of a recurrent op's X, W, R, B, initial_h and Y in layout 0 for
/// `[seq, batch, input, hidden, dirs]` and `gates` gates per direction (GRU 3, LSTM 4), every
/// product overflow-checked left to right; `names` word W, R and B in the errors.
pub(crate) fn recurrent_lens(
    [t, b, i, h, d]: [usize; 5],
    gates: usize,
    names: [&str; 3],
) -> Result<[usize; 6], KernelError> {
    let p = crate::shape::product;
    Ok([
        p("X", &[t, b, i])?,
        p(names[0], &[d, gates, h, i])?,
        p(names[1], &[d, gates, h, h])?,
        p(names[2], &[d, 2 * gates, h])?,
        p("initial_h (dirs, batch, hidden_size)", &[d, b, h])?,
        p("Y (seq, dirs, batch, hidden_size)", &[t, d, b, h])?,
    ])
}

/// Element count of the gates a training forward saves, `[dirs, seq, batch, row * hidden]`
/// for `[seq, batch, hidden, dirs]`, overflow-checked; `names` word the row and the whole.
pub(crate) fn recurrent_gates_len(
    [t, b, h, d]: [usize; 4],
    row: usize,
    names: [&str; 2],
) -> Result<usize, KernelError> {
    let row = crate::shape::product(names[0], &[row, h])?;
    crate::shape::product(names[1], &[d, t, b, row])
}

impl GruShape {
    /// Element counts of X, W, R, B, initial_h, Y (Y_h and dY_h have `initial_h`'s), for a
    /// shape [checked](Self::checked_lens) (else `usize::MAX`, which no buffer matches).
    pub fn lens(&self) -> [usize; 6] {
        self.checked_lens().unwrap_or([usize::MAX; 6])
    }

    /// [`GruShape::lens`], every product overflow-checked left to right, so that each
    /// dimension of every shape (`3 * hidden`, `6 * hidden`) fits too: `hidden_size` and
    /// the dimensions of an empty X may be anything up to `2^63 - 1`.
    pub fn checked_lens(&self) -> Result<[usize; 6], KernelError> {
        let dims = [self.seq, self.batch, self.input, self.hidden, self.direction.count()];
        recurrent_lens(
            dims,
            3,
            ["W (dirs, 3 hidden_size, input)", "R (dirs, 3 hidden_size, hidden_size)", "B (dirs, 6 hidden_size)"],
        )
    }

    /// Element count of the saved gates, `[dirs, seq, batch, GATE_ROW * hidden]` (for a
    /// checked shape; else `usize::MAX`).
    pub fn gates_len(&self) -> usize {
        self.checked_gates_len().unwrap_or(usize::MAX)
    }

    /// [`GruShape::gates_len`], overflow-checked.
    pub fn checked_gates_len(&self) -> Result<usize, KernelError> {
        let dims = [self.seq, self.batch, self.hidden, self.direction.count()];
        recurrent_gates_len(dims, GATE_ROW, ["4 hidden_size", "gates (dirs, seq, batch, 4 hidden_size)"])
    }
}

/// Inputs of the backward: the forward's inputs, its hidden states `Y` (`[seq, dirs, batch,
/// hidden]`) and the gradients of `Y` and `Y_h` (absent: zero).
#[derive(Debug, Clone, Copy)]
pub struct GruGradIn<'a> {
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
    /// The forward's output `Y`, `[seq, dirs, batch, hidden]`.
    pub y: &'a [f32],
    /// Gradient of `Y`.
    pub dy: Option<&'a [f32]>,
    /// Gradient of `Y_h`, `[dirs, batch, hidden]`.
    pub dy_h: Option<&'a [f32]>,
    /// The gates the forward saved ([`forward::gru_train`]), `[dirs, seq, batch, 4 hidden]`
    /// ([`GATE_ROW`]); absent: recomputed from `Y`.
    pub gates: Option<&'a [f32]>,
}

/// The gradients wanted (each optional), shaped as the matching inputs.
#[derive(Debug, Default)]
pub struct GruGradOut<'a> {
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
}

fn check(what: &'static str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { what, got, expected })
    }
}

/// Checks every buffer's length against `sh` (shared with the reference).
pub(crate) fn check_lens(sh: &GruShape, i: &GruGradIn<'_>, o: &GruGradOut<'_>) -> Result<(), KernelError> {
    let [lx, lw, lr, lb, lh, ly] = sh.checked_lens()?;
    let lg = sh.checked_gates_len()?;
    check("X", i.x.len(), lx)?;
    check("W", i.w.len(), lw)?;
    check("R", i.r.len(), lr)?;
    check("Y", i.y.len(), ly)?;
    let opt = |v: Option<usize>, what, n| v.map_or(Ok(()), |g| check(what, g, n));
    opt(i.b.map(<[f32]>::len), "B", lb)?;
    opt(i.initial_h.map(<[f32]>::len), "initial_h", lh)?;
    opt(i.dy.map(<[f32]>::len), "dY", ly)?;
    opt(i.dy_h.map(<[f32]>::len), "dY_h", lh)?;
    opt(i.gates.map(<[f32]>::len), "gates", lg)?;
    opt(o.dx.as_deref().map(<[f32]>::len), "dX", lx)?;
    opt(o.dw.as_deref().map(<[f32]>::len), "dW", lw)?;
    opt(o.dr.as_deref().map(<[f32]>::len), "dR", lr)?;
    opt(o.db.as_deref().map(<[f32]>::len), "dB", lb)?;
    opt(o.dh0.as_deref().map(<[f32]>::len), "d_initial_h", lh)
}

/// `exp(x)` for float32 without a call: Cody-Waite reduction by ln 2 and a degree-6
/// polynomial (relative error about 2 ulp); inputs clamped to [-87, 87]. Branch-free and
/// free of libm calls (rounding by the 1.5 * 2^23 shift), so loops over it vectorise.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: x + SHIFT rounds x to an integer
    let x = x.clamp(-87.0, 87.0);
    let t = x * std::f32::consts::LOG2_E + SHIFT;
    let n = t - SHIFT;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p =
        1.0 + r * (1.0 + r * (0.5 + r * (0.166_666_67 + r * (0.041_666_66 + r * (0.008_333_452 + r * 0.001_388_89)))));
    // t's low mantissa bits hold n (|n| <= 126): 2^n is a normal float32.
    let n_bits = t.to_bits().wrapping_sub(SHIFT.to_bits());
    p * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

#[inline(always)]
fn tanh(x: f32) -> f32 {
    let e = exp_f32(2.0 * x.clamp(-9.0, 9.0));
    (e - 1.0) / (e + 1.0)
}

/// Multiply-accumulates below which a GEMM stays one task.
const GEMM_TASK_MACS: usize = 1 << 18;
/// Elements of gate math per task.
const GATE_TASK: usize = 1 << 13;

/// Fewest rows (columns) of C per task: each task packs all of B (of A) again, so a
/// task needs enough of C to make that copy small next to its multiply-adds.
const MIN_ROWS: usize = 64;
const MIN_COLS: usize = 32;

/// `C = A B + beta C`; when the product is large, C is cut into row blocks (or, for a short
/// C, column blocks) run as tasks of `par`, a power of two of them so that they share out
/// evenly over 2, 4 or 8 threads.
fn gemm(
    par: &dyn Parallelism,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    beta: f32,
    mut c: ArrayViewMut2<'_, f32>,
) {
    let (m, k) = a.dim();
    let n = b.ncols();
    if k == 0 {
        // An empty sum: C = beta C, without reading C when beta is 0.
        c.mapv_inplace(|v| if beta == 0.0 { 0.0 } else { beta * v });
        return;
    }
    let pow2 = |t: usize| if t.is_power_of_two() { t } else { t.next_power_of_two() / 2 };
    let by_work = ((m * n * k) / GEMM_TASK_MACS).clamp(1, 8);
    let row_tasks = pow2(by_work.min(m / MIN_ROWS).max(1));
    let col_tasks = pow2(by_work.min(n / MIN_COLS).max(1));
    if row_tasks > 1 {
        let rows = m.div_ceil(row_tasks);
        let items: Vec<_> = a.axis_chunks_iter(Axis(0), rows).zip(c.axis_chunks_iter_mut(Axis(0), rows)).collect();
        for_each_item(par, items, |(a, c)| matmul_view(a, b, beta, c));
    } else if col_tasks > 1 {
        let cols = n.div_ceil(col_tasks);
        let items: Vec<_> = b.axis_chunks_iter(Axis(1), cols).zip(c.axis_chunks_iter_mut(Axis(1), cols)).collect();
        for_each_item(par, items, |(b, c)| matmul_view(a, b, beta, c));
    } else {
        matmul_view(a, b, beta, c);
    }
}

fn view<'a>(v: &'a [f32], rows: usize, cols: usize) -> ArrayView2<'a, f32> {
    ArrayView2::from_shape((rows, cols), &v[..rows * cols]).expect("lengths checked")
}

fn view_mut<'a>(v: &'a mut [f32], rows: usize, cols: usize) -> ArrayViewMut2<'a, f32> {
    ArrayViewMut2::from_shape((rows, cols), &mut v[..rows * cols]).expect("lengths checked")
}

/// Working memory of [`gru_grad_with`], kept by the caller between calls so that repeated
/// steps neither allocate nor fault in fresh pages. Every buffer is rewritten before it is
/// read, so its contents between calls do not matter.
#[derive(Debug, Default)]
pub struct GruScratch {
    /// `[n, GATE_ROW H]`: the recomputed gates (unused when the forward's are given).
    g: Vec<f32>,
    /// `[n, 3H]`: `H_{t-1} R^T` (lbr 0: its z, r parts and `(r ⊙ H_{t-1}) Rh^T`).
    gh: Vec<f32>,
    /// `[n, H]` previous hidden states.
    hp: Vec<f32>,
    /// `[n, 3H]` gradients of the gate pre-activations (X, W, Wb; R and Rb with lbr 0).
    da: Vec<f32>,
    /// `[n, 3H]` lbr 1: as `da` with the h part times r (R, Rb).
    dar: Vec<f32>,
    /// `[batch, H]` the carried `dH`, the next one, and lbr 0's `d(r ⊙ H_{t-1})`.
    dh: Vec<f32>,
    dhn: Vec<f32>,
    drh: Vec<f32>,
}

/// `v` with exactly `n` elements (old contents kept, new ones zero).
fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    v
}

/// The gradients of one GRU node's inputs (see the module's formulas). Every output given
/// is overwritten; `par` runs the large GEMMs' row blocks and the gate recomputation.
pub fn gru_grad(sh: &GruShape, i: &GruGradIn<'_>, o: GruGradOut<'_>, par: &dyn Parallelism) -> Result<(), KernelError> {
    gru_grad_with(sh, i, o, par, &mut GruScratch::default())
}

/// [`gru_grad`] with the caller's working memory.
pub fn gru_grad_with(
    sh: &GruShape,
    i: &GruGradIn<'_>,
    mut o: GruGradOut<'_>,
    par: &dyn Parallelism,
    scratch: &mut GruScratch,
) -> Result<(), KernelError> {
    check_lens(sh, i, &o)?;
    if sh.seq == 0 {
        // No steps: dY_h flows straight to initial_h, nothing else (and no working memory
        // is sized by the batch, which may be huge beside the empty sequence).
        for out in [o.dx, o.dw, o.dr, o.db].into_iter().flatten() {
            out.fill(0.0);
        }
        if let Some(dh0) = o.dh0 {
            match i.dy_h {
                Some(g) => dh0.copy_from_slice(g),
                None => dh0.fill(0.0),
            }
        }
        return Ok(());
    }
    if sh.hidden == 0 || sh.batch == 0 {
        // Nothing flows: every gradient is zero (X's too when hidden is 0).
        for out in [o.dx, o.dw, o.dr, o.db, o.dh0].into_iter().flatten() {
            out.fill(0.0);
        }
        return Ok(());
    }
    for d in 0..sh.direction.count() {
        one_direction(sh, i, &mut o, d, par, scratch);
    }
    Ok(())
}

/// One direction's weights, as views, and its bias (`[6H]`, zeros when absent); `rt` is
/// `R^T` row-major (`[H, 3H]`): the `gemm` crate multiplies by it faster than by the
/// transposed view of R (measured 15 against 18 µs for the bench's 64 x 64 x 192 step).
pub(crate) struct DirWeights<'a> {
    pub w: ArrayView2<'a, f32>,
    pub r: ArrayView2<'a, f32>,
    pub rt: Vec<f32>,
    pub bias: std::borrow::Cow<'a, [f32]>,
}

impl<'a> DirWeights<'a> {
    pub(crate) fn new(sh: &GruShape, w: &'a [f32], r: &'a [f32], b: Option<&'a [f32]>, d: usize) -> Self {
        let (g3, isz, h) = (3 * sh.hidden, sh.input, sh.hidden);
        let r = view(&r[d * g3 * h..], g3, h);
        DirWeights {
            w: view(&w[d * g3 * isz..], g3, isz),
            rt: r.t().iter().copied().collect(),
            r,
            bias: match b {
                Some(b) => std::borrow::Cow::Borrowed(&b[d * 6 * h..(d + 1) * 6 * h]),
                None => std::borrow::Cow::Owned(vec![0.0; 6 * h]),
            },
        }
    }
}

/// `X W^T` of every row into the z, r, ĥ columns of the gate rows `g` (`[n, GATE_ROW H]`).
pub(crate) fn input_gates(par: &dyn Parallelism, x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>, g: &mut [f32]) {
    let (n, g3) = (x.nrows(), w.nrows());
    let gv = view_mut(g, n, g3 / 3 * GATE_ROW);
    gemm(par, x, w.t(), 0.0, gv.slice_move(s![.., ..g3]));
}

/// The gates of rows `g` (holding `X W^T` from [`input_gates`]) whose previous hidden states
/// are `hp` (`[rows, H]`): `gh` (`[rows, 3H]`) takes `H_{t-1} R^T`. The forward runs it on
/// one step's rows, the backward's recomputation on all steps at once.
pub(crate) fn recurrent_gates(
    par: &dyn Parallelism,
    dw: &DirWeights<'_>,
    lbr: bool,
    g: &mut [f32],
    gh: &mut [f32],
    hp: &[f32],
) {
    let h = dw.r.ncols();
    let rows = hp.len() / h.max(1);
    let rt = view(&dw.rt, h, 3 * h);
    if lbr {
        gemm(par, view(hp, rows, h), rt, 0.0, view_mut(gh, rows, 3 * h));
        gates(par, g, gh, hp, h, &dw.bias, lbr, Pass::All);
    } else {
        let ghv = view_mut(gh, rows, 3 * h);
        gemm(par, view(hp, rows, h), rt.slice(s![.., ..2 * h]), 0.0, ghv.slice_move(s![.., ..2 * h]));
        gates(par, g, gh, hp, h, &dw.bias, lbr, Pass::ZR);
        // r ⊙ H_{t-1}, the gate rows' last part, times Rh^T.
        let rh = view(g, rows, GATE_ROW * h);
        let ghv = view_mut(gh, rows, 3 * h);
        gemm(par, rh.slice(s![.., 3 * h..]), rt.slice(s![.., 2 * h..]), 0.0, ghv.slice_move(s![.., 2 * h..]));
        gates(par, g, gh, hp, h, &dw.bias, lbr, Pass::H);
    }
}

fn one_direction(
    sh: &GruShape,
    i: &GruGradIn<'_>,
    o: &mut GruGradOut<'_>,
    d: usize,
    par: &dyn Parallelism,
    wk: &mut GruScratch,
) {
    let (t_len, bt, isz, h) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let (dirs, lbr, rev) = (sh.direction.count(), sh.linear_before_reset, sh.direction.reversed(d));
    let (g3, g4, n, bh) = (3 * h, GATE_ROW * h, t_len * bt, bt * h);
    let dwt = DirWeights::new(sh, i.w, i.r, i.b, d);
    let (w, r) = (dwt.w, dwt.r);
    let y_at = |t: usize| &i.y[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
    let GruScratch { g, gh, hp, da, dar, dh, dhn, drh } = wk;
    let hp = sized(hp, n * h);
    let (da, dar) = (sized(da, n * g3), sized(dar, if lbr { n * g3 } else { 0 }));
    let (dh, dhn, drh) = (sized(dh, bh), sized(dhn, bh), sized(drh, if lbr { 0 } else { bh }));

    // 1. Previous hidden states; the gates, saved by the forward or recomputed for every step.
    for t in 0..t_len {
        let prev = if rev { (t + 1 < t_len).then_some(t + 1) } else { t.checked_sub(1) };
        let dst = &mut hp[t * bh..(t + 1) * bh];
        match (prev, i.initial_h) {
            (Some(p), _) => dst.copy_from_slice(y_at(p)),
            (None, Some(h0)) => dst.copy_from_slice(&h0[d * bh..(d + 1) * bh]),
            (None, None) => dst.fill(0.0),
        }
    }
    let x = view(i.x, n, isz);
    let g: &[f32] = match i.gates {
        Some(saved) => &saved[d * n * g4..(d + 1) * n * g4],
        None => {
            let (g, gh) = (sized(g, n * g4), sized(gh, n * g3));
            input_gates(par, x, w, g);
            recurrent_gates(par, &dwt, lbr, g, gh, hp);
            g
        }
    };

    // 2. Backward through time.
    match i.dy_h {
        Some(v) => dh.copy_from_slice(&v[d * bh..(d + 1) * bh]),
        None => dh.fill(0.0),
    }
    let (mut dh, mut dhn) = (dh, dhn);
    for step in (0..t_len).rev() {
        let t = if rev { t_len - 1 - step } else { step };
        if let Some(dy) = i.dy {
            let dyt = &dy[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
            dh.iter_mut().zip(dyt).for_each(|(a, b)| *a += b);
        }
        let rows = t * bt..(t + 1) * bt;
        let g_t = &g[rows.start * g4..rows.end * g4];
        let hp_t = &hp[rows.start * h..rows.end * h];
        let da_t = &mut da[rows.start * g3..rows.end * g3];
        if lbr {
            let dar_t = &mut dar[rows.start * g3..rows.end * g3];
            wide(
                #[inline(always)]
                || step_lbr(h, g_t, hp_t, dh, da_t, dar_t, dhn),
            );
            gemm(par, view(dar_t, bt, g3), r, 1.0, view_mut(dhn, bt, h));
        } else {
            wide(
                #[inline(always)]
                || step_zh(h, g_t, hp_t, dh, da_t),
            );
            let dav = view(da_t, bt, g3);
            gemm(par, dav.slice(s![.., 2 * h..]), r.slice(s![2 * h.., ..]), 0.0, view_mut(drh, bt, h));
            wide(
                #[inline(always)]
                || step_r(h, g_t, hp_t, dh, drh, da_t, dhn),
            );
            let dav = view(da_t, bt, g3);
            gemm(par, dav.slice(s![.., ..2 * h]), r.slice(s![..2 * h, ..]), 1.0, view_mut(dhn, bt, h));
        }
        std::mem::swap(&mut dh, &mut dhn);
    }
    if let Some(dh0) = o.dh0.as_deref_mut() {
        dh0[d * bh..(d + 1) * bh].copy_from_slice(dh);
    }

    // 3. The weights' and the input's gradients over all steps at once.
    let dav = view(da, n, g3);
    if let Some(dx) = o.dx.as_deref_mut() {
        gemm(par, dav, w, if d == 0 { 0.0 } else { 1.0 }, view_mut(dx, n, isz));
    }
    if let Some(dw) = o.dw.as_deref_mut() {
        gemm(par, dav.t(), x, 0.0, view_mut(&mut dw[d * g3 * isz..], g3, isz));
    }
    let hpv = view(hp, n, h);
    if let Some(dr) = o.dr.as_deref_mut() {
        let mut drv = view_mut(&mut dr[d * g3 * h..], g3, h);
        if lbr {
            gemm(par, view(dar, n, g3).t(), hpv, 0.0, drv);
        } else {
            let rh = view(g, n, g4);
            gemm(par, dav.slice(s![.., ..2 * h]).t(), hpv, 0.0, drv.slice_mut(s![..2 * h, ..]));
            gemm(par, dav.slice(s![.., 2 * h..]).t(), rh.slice(s![.., 3 * h..]), 0.0, drv.slice_mut(s![2 * h.., ..]));
        }
    }
    if let Some(db) = o.db.as_deref_mut() {
        let db = &mut db[d * 6 * h..(d + 1) * 6 * h];
        let (dwb, drb) = db.split_at_mut(g3);
        wide(
            #[inline(always)]
            || column_sums(da, g3, dwb),
        );
        wide(
            #[inline(always)]
            || column_sums(if lbr { dar } else { da }, g3, drb),
        );
    }
}

/// One step's gate gradients with `linear_before_reset` 1, row by row: `da = [dA_z, dA_r,
/// dA_h]`, `dar = [dA_z, dA_r, dA_h ⊙ r]`, `dhn = dH ⊙ z` (the GEMM with R adds the rest).
#[inline(always)]
fn step_lbr(h: usize, g: &[f32], hp: &[f32], dh: &[f32], da: &mut [f32], dar: &mut [f32], dhn: &mut [f32]) {
    let (g3, g4) = (3 * h, GATE_ROW * h);
    let rows = g.chunks_exact(g4).zip(hp.chunks_exact(h).zip(dh.chunks_exact(h)));
    let outs = da.chunks_exact_mut(g3).zip(dar.chunks_exact_mut(g3)).zip(dhn.chunks_exact_mut(h));
    for ((g, (hp, dh)), ((da, dar), dhn)) in rows.zip(outs) {
        let (z, rest) = g.split_at(h);
        let (rg, rest) = rest.split_at(h);
        let (hh, hr) = rest.split_at(h);
        let (da_z, rest) = da.split_at_mut(h);
        let (da_r, da_h) = rest.split_at_mut(h);
        let (dar_z, rest) = dar.split_at_mut(h);
        let (dar_r, dar_h) = rest.split_at_mut(h);
        // Every slice cut to h: no bounds checks in the loop, so it vectorises.
        let (z, rg, hh, hr, hp, dh) = (&z[..h], &rg[..h], &hh[..h], &hr[..h], &hp[..h], &dh[..h]);
        let (da_z, da_r, da_h) = (&mut da_z[..h], &mut da_r[..h], &mut da_h[..h]);
        let (dar_z, dar_r, dar_h, dhn) = (&mut dar_z[..h], &mut dar_r[..h], &mut dar_h[..h], &mut dhn[..h]);
        for j in 0..h {
            let (z, rg, hh, dhj) = (z[j], rg[j], hh[j], dh[j]);
            let ah = dhj * (1.0 - z) * (1.0 - hh * hh);
            let az = dhj * (hp[j] - hh) * z * (1.0 - z);
            let ar = ah * hr[j] * rg * (1.0 - rg);
            da_z[j] = az;
            da_r[j] = ar;
            da_h[j] = ah;
            dar_z[j] = az;
            dar_r[j] = ar;
            dar_h[j] = ah * rg;
            dhn[j] = dhj * z;
        }
    }
}

/// `linear_before_reset` 0, first half of a step: `dA_z` and `dA_h` into `da`.
#[inline(always)]
fn step_zh(h: usize, g: &[f32], hp: &[f32], dh: &[f32], da: &mut [f32]) {
    let (g3, g4) = (3 * h, GATE_ROW * h);
    for ((g, da), (hp, dh)) in
        g.chunks_exact(g4).zip(da.chunks_exact_mut(g3)).zip(hp.chunks_exact(h).zip(dh.chunks_exact(h)))
    {
        let (z, rest) = g.split_at(h);
        let hh = &rest[h..2 * h];
        let (da_z, rest) = da.split_at_mut(h);
        let da_h = &mut rest[h..];
        let (z, hh, hp, dh, da_z, da_h) = (&z[..h], &hh[..h], &hp[..h], &dh[..h], &mut da_z[..h], &mut da_h[..h]);
        for j in 0..h {
            da_z[j] = dh[j] * (hp[j] - hh[j]) * z[j] * (1.0 - z[j]);
            da_h[j] = dh[j] * (1.0 - z[j]) * (1.0 - hh[j] * hh[j]);
        }
    }
}

/// `linear_before_reset` 0, second half: with `drh = dA_h Rh`, `dA_r` into `da` and
/// `dhn = dH ⊙ z + drh ⊙ r` (the GEMM with `R_zr` adds the rest).
#[inline(always)]
fn step_r(h: usize, g: &[f32], hp: &[f32], dh: &[f32], drh: &[f32], da: &mut [f32], dhn: &mut [f32]) {
    let (g3, g4) = (3 * h, GATE_ROW * h);
    let ins = g.chunks_exact(g4).zip(hp.chunks_exact(h)).zip(dh.chunks_exact(h).zip(drh.chunks_exact(h)));
    for (((g, hp), (dh, drh)), (da, dhn)) in ins.zip(da.chunks_exact_mut(g3).zip(dhn.chunks_exact_mut(h))) {
        let (z, rest) = g.split_at(h);
        let rg = &rest[..h];
        let da_r = &mut da[h..2 * h];
        let (z, rg, hp, dh, drh, dhn) = (&z[..h], &rg[..h], &hp[..h], &dh[..h], &drh[..h], &mut dhn[..h]);
        for j in 0..h {
            da_r[j] = drh[j] * hp[j] * rg[j] * (1.0 - rg[j]);
            dhn[j] = dh[j] * z[j] + drh[j] * rg[j];
        }
    }
}

/// `out[j] = sum_i m[i, j]` of a row-major `[rows, cols]` matrix.
#[inline(always)]
fn column_sums(m: &[f32], cols: usize, out: &mut [f32]) {
    out.fill(0.0);
    for row in m.chunks_exact(cols) {
        out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
    }
}

/// Which gates [`gates`] computes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// z, r, ĥ and `e = H_{t-1} Rh^T + Rbh` (lbr 1).
    All,
    /// z, r and `e = r ⊙ H_{t-1}` (lbr 0, before the `Rh` GEMM).
    ZR,
    /// ĥ (lbr 0, after it).
    H,
}

/// Pre-activations in `g` (`[rows, GATE_ROW H]`, from `X W^T`) and `gh` (`[rows, 3H]`, from
/// `H_{t-1} R^T`) to gate values in `g`, in row blocks run as tasks of `par`.
#[allow(clippy::too_many_arguments)]
fn gates(par: &dyn Parallelism, g: &mut [f32], gh: &[f32], hp: &[f32], h: usize, bias: &[f32], lbr: bool, pass: Pass) {
    let (g3, g4) = (3 * h, GATE_ROW * h);
    let rows = (GATE_TASK / g4).max(1);
    let items: Vec<_> = g.chunks_mut(rows * g4).zip(gh.chunks(rows * g3)).zip(hp.chunks(rows * h)).collect();
    let (wb, rb) = bias.split_at(g3);
    // Both biases of z and r, and Wbh, summed once.
    let bzr: Vec<f32> = wb[..2 * h].iter().zip(&rb[..2 * h]).map(|(a, b)| a + b).collect();
    let (wbh, rbh) = (&wb[2 * h..], &rb[2 * h..]);
    for_each_item(par, items, |((g, gh), hp)| {
        wide(
            #[inline(always)]
            || {
                for ((gr, ghr), hpk) in g.chunks_exact_mut(g4).zip(gh.chunks_exact(g3)).zip(hp.chunks_exact(h)) {
                    let (gzr, rest) = gr.split_at_mut(2 * h);
                    let (gh_, e) = rest.split_at_mut(h);
                    let (ghzr, ghh) = ghr.split_at(2 * h);
                    if pass != Pass::H {
                        for ((a, b), c) in gzr.iter_mut().zip(ghzr).zip(&bzr) {
                            *a = sigmoid(*a + b + c);
                        }
                    }
                    if pass == Pass::ZR {
                        for ((o, r), p) in e.iter_mut().zip(&gzr[h..]).zip(hpk) {
                            *o = r * p;
                        }
                        continue;
                    }
                    let rg = &gzr[h..2 * h];
                    let (gh_, e, ghh, wbh, rbh) = (&mut gh_[..h], &mut e[..h], &ghh[..h], &wbh[..h], &rbh[..h]);
                    if lbr {
                        // Two loops: the fused one did not vectorise (the writes to e and
                        // ĥ were not known apart), five times slower.
                        for j in 0..h {
                            e[j] = ghh[j] + rbh[j]; // kept: the backward's `H_{t-1} Rh^T + Rbh`
                        }
                        let e = &e[..h];
                        for j in 0..h {
                            gh_[j] = tanh(gh_[j] + wbh[j] + rg[j] * e[j]);
                        }
                    } else {
                        for j in 0..h {
                            gh_[j] = tanh(gh_[j] + wbh[j] + ghh[j] + rbh[j]);
                        }
                    }
                }
            },
        )
    });
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod train_tests;
