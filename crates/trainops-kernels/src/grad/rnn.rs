//! Backpropagation through time for ONNX's `GRU` (layout 0, the default activations Sigmoid
//! and Tanh, `linear_before_reset` 0 or 1, any direction), float32.
//!
//! The gates are recomputed from the forward's hidden states `Y` (the op keeps no gates):
//! `X W^T` for all steps in one GEMM, `H_{t-1} R^T` likewise (every `H_{t-1}` is known), then
//! one reverse loop carries `dH` back with one GEMM per step (two with
//! `linear_before_reset` 0), and `dX`, `dW`, `dR` are again one GEMM each over all steps.
//! GEMMs are `matrixmultiply`'s (through `ndarray::linalg::general_mat_mul`, its own
//! threading off), split over rows as tasks of the caller's [`Parallelism`] where large.
//!
//! Formulas (gate order z, r, h as in ONNX; `Wb`, `Rb` the two halves of `B`):
//! ```text
//! z = σ(x Wz^T + h Rz^T + Wbz + Rbz)        r = σ(x Wr^T + h Rr^T + Wbr + Rbr)
//! lbr 0: ĥ = tanh(x Wh^T + (r ⊙ h) Rh^T + Rbh + Wbh)
//! lbr 1: ĥ = tanh(x Wh^T + r ⊙ (h Rh^T + Rbh) + Wbh)
//! h' = (1 - z) ⊙ ĥ + z ⊙ h
//! ```
//! The fast path's `exp` is a polynomial (within a few float32 ulp); [`reference`] is the
//! plain float64 form the tests hold it to.

pub mod reference;

use ndarray::linalg::general_mat_mul;
use ndarray::{s, ArrayView2, ArrayViewMut2, Axis};

use crate::parallel::{for_each_item, Parallelism};
use crate::KernelError;

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

impl GruShape {
    /// Element counts of X, W, R, B, initial_h, Y (Y_h and dY_h have `initial_h`'s).
    pub fn lens(&self) -> [usize; 6] {
        let (t, b, i, h, d) = (self.seq, self.batch, self.input, self.hidden, self.direction.count());
        [t * b * i, d * 3 * h * i, d * 3 * h * h, d * 6 * h, d * b * h, t * d * b * h]
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
    let [lx, lw, lr, lb, lh, ly] = sh.lens();
    check("X", i.x.len(), lx)?;
    check("W", i.w.len(), lw)?;
    check("R", i.r.len(), lr)?;
    check("Y", i.y.len(), ly)?;
    let opt = |v: Option<usize>, what, n| v.map_or(Ok(()), |g| check(what, g, n));
    opt(i.b.map(<[f32]>::len), "B", lb)?;
    opt(i.initial_h.map(<[f32]>::len), "initial_h", lh)?;
    opt(i.dy.map(<[f32]>::len), "dY", ly)?;
    opt(i.dy_h.map(<[f32]>::len), "dY_h", lh)?;
    opt(o.dx.as_deref().map(<[f32]>::len), "dX", lx)?;
    opt(o.dw.as_deref().map(<[f32]>::len), "dW", lw)?;
    opt(o.dr.as_deref().map(<[f32]>::len), "dR", lr)?;
    opt(o.db.as_deref().map(<[f32]>::len), "dB", lb)?;
    opt(o.dh0.as_deref().map(<[f32]>::len), "d_initial_h", lh)
}

/// `exp(x)` for float32 without a call: Cody-Waite reduction by ln 2 and a degree-6
/// polynomial (relative error about 2 ulp); inputs clamped to [-87, 87]. Branch-free, so
/// loops over it vectorise.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 87.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p =
        1.0 + r * (1.0 + r * (0.5 + r * (0.166_666_67 + r * (0.041_666_66 + r * (0.008_333_452 + r * 0.001_388_89)))));
    // n is in [-126, 126]: 2^n is a normal float32.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
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

/// `C = A B + beta C`, C's rows cut into tasks of `par` when the product is large.
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
        // An empty sum (matrixmultiply and ndarray may leave C as it was).
        c.mapv_inplace(|v| if beta == 0.0 { 0.0 } else { beta * v });
        return;
    }
    let tasks = ((m * n * k) / GEMM_TASK_MACS).clamp(1, 8).min(m.div_ceil(8).max(1));
    if tasks <= 1 || m == 0 {
        general_mat_mul(1.0, &a, &b, beta, &mut c);
        return;
    }
    let rows = m.div_ceil(tasks).next_multiple_of(8);
    let items: Vec<_> = a.axis_chunks_iter(Axis(0), rows).zip(c.axis_chunks_iter_mut(Axis(0), rows)).collect();
    for_each_item(par, items, |(a, mut c)| general_mat_mul(1.0, &a, &b, beta, &mut c));
}

fn view<'a>(v: &'a [f32], rows: usize, cols: usize) -> ArrayView2<'a, f32> {
    ArrayView2::from_shape((rows, cols), &v[..rows * cols]).expect("lengths checked")
}

fn view_mut<'a>(v: &'a mut [f32], rows: usize, cols: usize) -> ArrayViewMut2<'a, f32> {
    ArrayViewMut2::from_shape((rows, cols), &mut v[..rows * cols]).expect("lengths checked")
}

/// The gradients of one GRU node's inputs (see the module's formulas). Every output given
/// is overwritten; `par` runs the large GEMMs' row blocks and the gate recomputation.
pub fn gru_grad(
    sh: &GruShape,
    i: &GruGradIn<'_>,
    mut o: GruGradOut<'_>,
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check_lens(sh, i, &o)?;
    let (bt, h) = (sh.batch, sh.hidden);
    let dirs = sh.direction.count();
    if h == 0 || bt == 0 {
        // Nothing flows: every gradient is zero (X's too when hidden is 0).
        for out in [o.dx, o.dw, o.dr, o.db, o.dh0].into_iter().flatten() {
            out.fill(0.0);
        }
        return Ok(());
    }
    for d in 0..dirs {
        one_direction(sh, i, &mut o, d, par);
    }
    Ok(())
}

/// Scratch of one direction: recomputed gates and the gate pre-activations' gradients.
struct Work {
    /// `[n, 3H]`: z, r, ĥ.
    g: Vec<f32>,
    /// `[n, 3H]`: lbr 1: `H_{t-1} R^T + Rb` (its h part is used); lbr 0: columns 2H.. hold
    /// `(r ⊙ H_{t-1}) Rh^T`.
    gh: Vec<f32>,
    /// `[n, H]` previous hidden states.
    hp: Vec<f32>,
    /// `[n, H]` lbr 0: `r ⊙ H_{t-1}`.
    rh: Vec<f32>,
}

fn one_direction(sh: &GruShape, i: &GruGradIn<'_>, o: &mut GruGradOut<'_>, d: usize, par: &dyn Parallelism) {
    let (t_len, bt, isz, h) = (sh.seq, sh.batch, sh.input, sh.hidden);
    let (dirs, lbr, rev) = (sh.direction.count(), sh.linear_before_reset, sh.direction.reversed(d));
    let (g3, n, bh) = (3 * h, t_len * bt, bt * h);
    let w = view(&i.w[d * g3 * isz..], g3, isz);
    let r = view(&i.r[d * g3 * h..], g3, h);
    let zero_b = vec![0.0f32; 6 * h];
    let bias = i.b.map_or(&zero_b[..], |b| &b[d * 6 * h..(d + 1) * 6 * h]);
    let y_at = |t: usize| &i.y[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];

    // 1. Previous hidden states, gates recomputed for every step.
    let mut wk = Work { g: vec![0.0; n * g3], gh: vec![0.0; n * g3], hp: vec![0.0; n * h], rh: Vec::new() };
    for t in 0..t_len {
        let prev = if rev { (t + 1 < t_len).then_some(t + 1) } else { t.checked_sub(1) };
        let dst = &mut wk.hp[t * bh..(t + 1) * bh];
        match (prev, i.initial_h) {
            (Some(p), _) => dst.copy_from_slice(y_at(p)),
            (None, Some(h0)) => dst.copy_from_slice(&h0[d * bh..(d + 1) * bh]),
            (None, None) => dst.fill(0.0),
        }
    }
    let x = view(i.x, n, isz);
    gemm(par, x, w.t(), 0.0, view_mut(&mut wk.g, n, g3));
    let hpv = view(&wk.hp, n, h);
    if lbr {
        gemm(par, hpv, r.t(), 0.0, view_mut(&mut wk.gh, n, g3));
        gates(par, &mut wk, h, bias, lbr, Pass::All);
    } else {
        let mut ghv = view_mut(&mut wk.gh, n, g3);
        gemm(par, hpv, r.slice(s![..2 * h, ..]).t(), 0.0, ghv.slice_mut(s![.., ..2 * h]));
        wk.rh = vec![0.0; n * h];
        gates(par, &mut wk, h, bias, lbr, Pass::ZR);
        let mut ghv = view_mut(&mut wk.gh, n, g3);
        gemm(par, view(&wk.rh, n, h), r.slice(s![2 * h.., ..]).t(), 0.0, ghv.slice_mut(s![.., 2 * h..]));
        gates(par, &mut wk, h, bias, lbr, Pass::H);
    }

    // 2. Backward through time: da (for X, W, Wb; and R, Rb with lbr 0), dar (R, Rb, lbr 1).
    let mut da = vec![0.0f32; n * g3];
    let mut dar = if lbr { vec![0.0f32; n * g3] } else { Vec::new() };
    let mut dh = match i.dy_h {
        Some(g) => g[d * bh..(d + 1) * bh].to_vec(),
        None => vec![0.0; bh],
    };
    let mut dhn = vec![0.0f32; bh];
    let mut drh = if lbr { Vec::new() } else { vec![0.0f32; bh] };
    for step in (0..t_len).rev() {
        let t = if rev { t_len - 1 - step } else { step };
        if let Some(dy) = i.dy {
            let dyt = &dy[(t * dirs + d) * bh..(t * dirs + d + 1) * bh];
            dh.iter_mut().zip(dyt).for_each(|(a, b)| *a += b);
        }
        let rows = t * bt..(t + 1) * bt;
        let g = &wk.g[rows.start * g3..rows.end * g3];
        let hp = &wk.hp[rows.start * h..rows.end * h];
        let da_t = &mut da[rows.start * g3..rows.end * g3];
        if lbr {
            let gh = &wk.gh[rows.start * g3..rows.end * g3];
            let dar_t = &mut dar[rows.start * g3..rows.end * g3];
            for b in 0..bt {
                let (gb, ghb) = (&g[b * g3..(b + 1) * g3], &gh[b * g3 + 2 * h..(b + 1) * g3]);
                let (dab, darb) = (&mut da_t[b * g3..(b + 1) * g3], &mut dar_t[b * g3..(b + 1) * g3]);
                let (dhb, hpb, dhnb) = (&dh[b * h..(b + 1) * h], &hp[b * h..(b + 1) * h], &mut dhn[b * h..(b + 1) * h]);
                for j in 0..h {
                    let (z, rg, hh, hr) = (gb[j], gb[h + j], gb[2 * h + j], ghb[j]);
                    let dhj = dhb[j];
                    let da_h = dhj * (1.0 - z) * (1.0 - hh * hh);
                    let da_z = dhj * (hpb[j] - hh) * z * (1.0 - z);
                    let da_r = da_h * hr * rg * (1.0 - rg);
                    dab[j] = da_z;
                    dab[h + j] = da_r;
                    dab[2 * h + j] = da_h;
                    darb[j] = da_z;
                    darb[h + j] = da_r;
                    darb[2 * h + j] = da_h * rg;
                    dhnb[j] = dhj * z;
                }
            }
            gemm(par, view(dar_t, bt, g3), r, 1.0, view_mut(&mut dhn, bt, h));
        } else {
            for b in 0..bt {
                let (gb, dab) = (&g[b * g3..(b + 1) * g3], &mut da_t[b * g3..(b + 1) * g3]);
                for j in 0..h {
                    let (z, hh, dhj) = (gb[j], gb[2 * h + j], dh[b * h + j]);
                    dab[j] = dhj * (hp[b * h + j] - hh) * z * (1.0 - z);
                    dab[2 * h + j] = dhj * (1.0 - z) * (1.0 - hh * hh);
                }
            }
            let dav = view(da_t, bt, g3);
            gemm(par, dav.slice(s![.., 2 * h..]), r.slice(s![2 * h.., ..]), 0.0, view_mut(&mut drh, bt, h));
            for b in 0..bt {
                let (gb, dab) = (&g[b * g3..(b + 1) * g3], &mut da_t[b * g3..(b + 1) * g3]);
                for j in 0..h {
                    let (z, rg, k) = (gb[j], gb[h + j], b * h + j);
                    dab[h + j] = drh[k] * hp[k] * rg * (1.0 - rg);
                    dhn[k] = dh[k] * z + drh[k] * rg;
                }
            }
            let dav = view(da_t, bt, g3);
            gemm(par, dav.slice(s![.., ..2 * h]), r.slice(s![..2 * h, ..]), 1.0, view_mut(&mut dhn, bt, h));
        }
        std::mem::swap(&mut dh, &mut dhn);
    }
    if let Some(dh0) = o.dh0.as_deref_mut() {
        dh0[d * bh..(d + 1) * bh].copy_from_slice(&dh);
    }

    // 3. The weights' and the input's gradients over all steps at once.
    let dav = view(&da, n, g3);
    if let Some(dx) = o.dx.as_deref_mut() {
        gemm(par, dav, w, if d == 0 { 0.0 } else { 1.0 }, view_mut(dx, n, isz));
    }
    if let Some(dw) = o.dw.as_deref_mut() {
        gemm(par, dav.t(), x, 0.0, view_mut(&mut dw[d * g3 * isz..], g3, isz));
    }
    let hpv = view(&wk.hp, n, h);
    if let Some(dr) = o.dr.as_deref_mut() {
        let mut drv = view_mut(&mut dr[d * g3 * h..], g3, h);
        if lbr {
            gemm(par, view(&dar, n, g3).t(), hpv, 0.0, drv);
        } else {
            gemm(par, dav.slice(s![.., ..2 * h]).t(), hpv, 0.0, drv.slice_mut(s![..2 * h, ..]));
            gemm(par, dav.slice(s![.., 2 * h..]).t(), view(&wk.rh, n, h), 0.0, drv.slice_mut(s![2 * h.., ..]));
        }
    }
    if let Some(db) = o.db.as_deref_mut() {
        let db = &mut db[d * 6 * h..(d + 1) * 6 * h];
        let (dwb, drb) = db.split_at_mut(g3);
        column_sums(&da, g3, dwb);
        column_sums(if lbr { &dar } else { &da }, g3, drb);
    }
}

/// `out[j] = sum_i m[i, j]` of a row-major `[rows, cols]` matrix.
fn column_sums(m: &[f32], cols: usize, out: &mut [f32]) {
    out.fill(0.0);
    for row in m.chunks_exact(cols) {
        out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
    }
}

/// Which gates [`gates`] computes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// z, r, ĥ (lbr 1).
    All,
    /// z, r and `r ⊙ H_{t-1}` (lbr 0, before the `Rh` GEMM).
    ZR,
    /// ĥ (lbr 0, after it).
    H,
}

/// Pre-activations in `g` (from `X W^T`) and `gh` to gate values in `g`, in row blocks run
/// as tasks of `par`.
fn gates(par: &dyn Parallelism, wk: &mut Work, h: usize, bias: &[f32], lbr: bool, pass: Pass) {
    let g3 = 3 * h;
    let rows = (GATE_TASK / g3).max(1);
    let n = wk.hp.len() / h;
    let rh_rows: Vec<&mut [f32]> = if wk.rh.is_empty() {
        (0..n.div_ceil(rows)).map(|_| &mut [][..]).collect()
    } else {
        wk.rh.chunks_mut(rows * h).collect()
    };
    let items: Vec<_> =
        wk.g.chunks_mut(rows * g3).zip(wk.gh.chunks_mut(rows * g3)).zip(wk.hp.chunks(rows * h)).zip(rh_rows).collect();
    let (wb, rb) = bias.split_at(g3);
    for_each_item(par, items, |(((g, gh), hp), rh)| {
        for (k, (gr, ghr)) in g.chunks_exact_mut(g3).zip(gh.chunks_exact_mut(g3)).enumerate() {
            let (gz, rest) = gr.split_at_mut(h);
            let (gr_, gh_) = rest.split_at_mut(h);
            if pass != Pass::H {
                for j in 0..h {
                    gz[j] = sigmoid(gz[j] + ghr[j] + wb[j] + rb[j]);
                    gr_[j] = sigmoid(gr_[j] + ghr[h + j] + wb[h + j] + rb[h + j]);
                }
            }
            if pass == Pass::ZR {
                let (hpk, rhk) = (&hp[k * h..(k + 1) * h], &mut rh[k * h..(k + 1) * h]);
                for j in 0..h {
                    rhk[j] = gr_[j] * hpk[j];
                }
                continue;
            }
            let ghh = &mut ghr[2 * h..];
            for j in 0..h {
                let a = if lbr {
                    ghh[j] += rb[2 * h + j]; // kept: the backward's `H_{t-1} Rh^T + Rbh`
                    gh_[j] + wb[2 * h + j] + gr_[j] * ghh[j]
                } else {
                    gh_[j] + wb[2 * h + j] + ghh[j] + rb[2 * h + j]
                };
                gh_[j] = tanh(a);
            }
        }
    });
}

#[cfg(test)]
mod tests;
