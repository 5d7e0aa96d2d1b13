//! `com.trainops::LSTMTrain` and `com.trainops::LSTMGrad` (since version 1): ONNX's `LSTM`
//! (layout 0, the default activations Sigmoid, Tanh, Tanh, no peepholes, `input_forget` 0,
//! no `sequence_lens`, no `clip`), float32, for training: the forward also outputs what the
//! backward reads, and the backward computes all six gradients without recomputing a gate.
//!
//! `LSTMTrain`: inputs `X, W, R, B?, sequence_lens?, initial_h?, initial_c?, P?` as LSTM's
//! (`sequence_lens` and `P` must be absent); outputs `Y?, Y_h?, Y_c?, gates?`, the first three
//! as LSTM's, `gates` `[dirs, seq, batch, 6 hidden]` (each row i, o, f, g, c_t, tanh(c_t);
//! `trainops_kernels::grad::rnn::lstm::LSTM_ROW`).
//!
//! `LSTMGrad`: inputs `X, W, R, Y, gates, initial_h?, initial_c?, dY?, dY_h?, dY_c?` (`Y` and
//! `gates` an `LSTMTrain` node's outputs; B is not needed, the gates hold it; absent initial
//! states and gradients are zeros); outputs `dX?, dW?, dR?, dB?, d_initial_h?, d_initial_c?`
//! shaped as LSTM's inputs (`dB` `[dirs, 8 hidden]`).
//!
//! Attributes of both: `hidden_size` (required), `direction` ("forward"); `layout` must be
//! 0, `input_forget` 0 and `clip` absent where given.

use std::sync::Mutex;

use trainops_kernels::grad::rnn::lstm::{
    lstm_grad_with, lstm_train_with, LstmGradIn, LstmGradOut, LstmScratch, LstmShape, LstmTrainIn, LstmTrainOut,
    LstmTrainScratch, LSTM_ROW,
};
use trainops_kernels::grad::rnn::Direction;

use super::rnn::{gru_input, outputs_disjoint, x_dims};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, Signature, Tensor};
use crate::ops::io;

const F: Option<DType> = Some(DType::Float);

/// The attributes both ops read.
#[derive(Debug, Clone, Copy)]
struct LstmAttrs {
    hidden: usize,
    direction: Direction,
}

impl LstmAttrs {
    fn read(op: &'static str, info: &KernelInfo<'_>) -> Result<Self> {
        let attr = |name, what: String| Error::Attribute { op, name, what };
        let hidden = match info.i64_opt("hidden_size")? {
            Some(h) if h >= 1 => h as usize,
            Some(h) => return Err(attr("hidden_size", format!("expected a positive size, got {h}"))),
            None => return Err(attr("hidden_size", "is required".into())),
        };
        let direction = match info.string_opt("direction")?.as_deref().unwrap_or("forward") {
            "forward" => Direction::Forward,
            "reverse" => Direction::Reverse,
            "bidirectional" => Direction::Bidirectional,
            other => {
                return Err(attr("direction", format!("expected forward, reverse or bidirectional, got '{other}'")))
            }
        };
        if let Some(layout) = info.i64_opt("layout")?.filter(|&l| l != 0) {
            return Err(attr("layout", format!("expected 0 ([seq_length, batch_size, ...]), got {layout}")));
        }
        if let Some(v) = info.i64_opt("input_forget")?.filter(|&v| v != 0) {
            return Err(attr("input_forget", format!("expected 0 (coupled gates are not supported), got {v}")));
        }
        if info.f32_opt("clip")?.is_some() {
            return Err(attr("clip", "is not supported (leave it out)".into()));
        }
        Ok(LstmAttrs { hidden, direction })
    }

    /// The node's shape over X, every tensor's size checked before anything is sized by it.
    fn checked_shape(&self, op: &'static str, x: &Tensor) -> Result<LstmShape> {
        let (seq, batch, input) = x_dims(op, x)?;
        let shape = |seq, batch, input| LstmShape { seq, batch, input, hidden: self.hidden, direction: self.direction };
        let check = |sh: &LstmShape| -> std::result::Result<(), String> {
            sh.checked_lens().and_then(|_| sh.checked_gates_len()).map_err(|e| e.to_string())?;
            let (h, nd) = (sh.hidden, sh.direction.count());
            for dims in [[nd, 4 * h, sh.input, 1], [nd, 8 * h, 1, 1], [nd, sh.seq, sh.batch, LSTM_ROW * h]] {
                trainops_kernels::shape::to_i64("a dimension", &dims).map_err(|e| e.to_string())?;
            }
            Ok(())
        };
        if let Err(what) = check(&shape(1, 1, 1)) {
            let what = format!("expected a size whose tensors fit in 64 bits, got {} ({what})", self.hidden);
            return Err(Error::Attribute { op, name: "hidden_size", what });
        }
        let sh = shape(seq, batch, input);
        check(&sh).map_err(|what| {
            let want = format!("a shape whose LSTM tensors (hidden_size {}) fit in 64 bits", self.hidden);
            Error::input(op, 0, "X", want, format!("shape {:?} ({what})", x.shape))
        })?;
        Ok(sh)
    }
}

fn dims(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&d| d as i64).collect()
}

/// The outputs `names` of shapes `shapes` that the node has.
fn outputs(
    ctx: &mut Context<'_>,
    op: &'static str,
    names: &[&str],
    shapes: &[Vec<i64>],
) -> Result<Vec<Option<Tensor>>> {
    let mut outs = Vec::with_capacity(shapes.len());
    for (k, shape) in shapes.iter().enumerate() {
        outs.push(io::optional_output(ctx, op, k, names[k], DType::Float, shape)?);
    }
    Ok(outs)
}

// -- LSTMTrain ---------------------------------------------------------------------------------

const TRAIN: &str = "LSTMTrain";

/// `LSTMTrain` as registered in `com.trainops`.
pub struct LstmTrain;

static TRAIN_INPUTS: [Formal; 8] = [
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::Optional(F),
    Formal::Optional(Some(DType::Int32)),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
];
static TRAIN_OUTPUTS: [Formal; 4] =
    [Formal::Optional(F), Formal::Optional(F), Formal::Optional(F), Formal::Optional(F)];
static TRAIN_SIGNATURE: Signature = Signature { name: c"LSTMTrain", inputs: &TRAIN_INPUTS, outputs: &TRAIN_OUTPUTS };
const TRAIN_IN: [&str; 8] = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"];
const TRAIN_OUT: [&str; 4] = ["Y", "Y_h", "Y_c", "gates"];

impl OpSpec for LstmTrain {
    fn signature(&self) -> &Signature {
        &TRAIN_SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(LstmTrainKernel { attrs: LstmAttrs::read(TRAIN, info)?, scratch: Mutex::default() }))
    }
}

/// Working memory: the kernel's, and stand-ins for `Y` and `gates` where the node leaves
/// them out (the recurrence needs both).
#[derive(Default)]
struct TrainScratch {
    kernel: LstmTrainScratch,
    y: Vec<f32>,
    gates: Vec<f32>,
}

struct LstmTrainKernel {
    attrs: LstmAttrs,
    /// Kept between runs; a run that finds it busy uses its own.
    scratch: Mutex<TrainScratch>,
}

/// `v` resized to `len` as a stand-in for an output the node leaves out (fallibly: Y and
/// the gates may exceed memory, an error rather than an abort).
fn stand_in<'a>(v: &'a mut Vec<f32>, len: usize, what: &'static str) -> Result<&'a mut [f32]> {
    trainops_kernels::shape::resize(v, len, what).map_err(|e| Error::kernel(TRAIN, e))?;
    Ok(v)
}

impl Kernel for LstmTrainKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let input = |ctx: &Context<'_>, k: usize, d: Option<&[usize]>| gru_input(ctx, TRAIN, &TRAIN_IN, 3, k, d);
        let x = input(ctx, 0, None)?.expect("required");
        let sh = self.attrs.checked_shape(TRAIN, &x)?;
        let (seq, batch, isz, h, nd) = (sh.seq, sh.batch, sh.input, sh.hidden, sh.direction.count());
        let w = input(ctx, 1, Some(&[nd, 4 * h, isz]))?.expect("required");
        let r = input(ctx, 2, Some(&[nd, 4 * h, h]))?.expect("required");
        let b = input(ctx, 3, Some(&[nd, 8 * h]))?;
        if ctx.input(4)?.is_some() {
            let what = "absent (every sequence has seq_length steps; use ONNX's LSTM for sequence_lens)";
            return Err(Error::input(TRAIN, 4, "sequence_lens", what, "a tensor"));
        }
        let h0 = input(ctx, 5, Some(&[nd, batch, h]))?;
        let c0 = input(ctx, 6, Some(&[nd, batch, h]))?;
        if ctx.input(7)?.is_some() {
            let what = "absent (peepholes are not supported; use ONNX's LSTM for P)";
            return Err(Error::input(TRAIN, 7, "P", what, "a tensor"));
        }
        let ins = [Some(&x), Some(&w), Some(&r), b.as_ref(), h0.as_ref(), c0.as_ref()];
        let shapes = [
            dims(&[seq, nd, batch, h]),
            dims(&[nd, batch, h]),
            dims(&[nd, batch, h]),
            dims(&[nd, seq, batch, LSTM_ROW * h]),
        ];
        let outs = outputs(ctx, TRAIN, &TRAIN_OUT, &shapes)?;
        outputs_disjoint(TRAIN, &ins, &outs, &TRAIN_OUT)?;
        let mut own = TrainScratch::default();
        let mut kept = self.scratch.try_lock().ok();
        let TrainScratch { kernel, y: y_own, gates: g_own } = kept.as_deref_mut().unwrap_or(&mut own);
        // SAFETY: every tensor was checked to be an aligned float32 buffer; the inputs are
        // only read and no output overlaps an input or another output (checked above).
        let (tin, y, y_h, y_c, gates) = unsafe {
            let opt = |t: &Option<Tensor>| t.as_ref().map(|t| t.slice::<f32>());
            let tin = LstmTrainIn {
                x: x.slice(),
                w: w.slice(),
                r: r.slice(),
                b: opt(&b),
                initial_h: opt(&h0),
                initial_c: opt(&c0),
            };
            let m = |k: usize| outs[k].as_ref().map(|t| t.slice_mut::<f32>());
            (tin, m(0), m(1), m(2), m(3))
        };
        let y = match y {
            Some(y) => y,
            None => stand_in(y_own, sh.lens()[5], "LSTMTrain's Y (not an output of the node)")?,
        };
        let gates = match gates {
            Some(g) => g,
            None => stand_in(g_own, sh.gates_len(), "LSTMTrain's gates (not an output of the node)")?,
        };
        let pool = OrtPool::new(ctx);
        lstm_train_with(&sh, &tin, LstmTrainOut { y, y_h, y_c, gates }, &pool, kernel)
            .map_err(|e| Error::kernel(TRAIN, e))
    }
}

// -- LSTMGrad ----------------------------------------------------------------------------------

const GRAD: &str = "LSTMGrad";

/// `LSTMGrad` as registered in `com.trainops`.
pub struct LstmGrad;

static GRAD_INPUTS: [Formal; 10] = [
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
];
static GRAD_OUTPUTS: [Formal; 6] = [
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
];
static GRAD_SIGNATURE: Signature = Signature { name: c"LSTMGrad", inputs: &GRAD_INPUTS, outputs: &GRAD_OUTPUTS };
const GRAD_IN: [&str; 10] = ["X", "W", "R", "Y", "gates", "initial_h", "initial_c", "dY", "dY_h", "dY_c"];
const GRAD_OUT: [&str; 6] = ["dX", "dW", "dR", "dB", "d_initial_h", "d_initial_c"];

impl OpSpec for LstmGrad {
    fn signature(&self) -> &Signature {
        &GRAD_SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(LstmGradKernel { attrs: LstmAttrs::read(GRAD, info)?, scratch: Mutex::default() }))
    }
}

struct LstmGradKernel {
    attrs: LstmAttrs,
    /// Working memory kept between runs; a run that finds it busy uses its own.
    scratch: Mutex<LstmScratch>,
}

impl Kernel for LstmGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let input = |ctx: &Context<'_>, k: usize, d: Option<&[usize]>| gru_input(ctx, GRAD, &GRAD_IN, 5, k, d);
        let x = input(ctx, 0, None)?.expect("required");
        let sh = self.attrs.checked_shape(GRAD, &x)?;
        let (seq, batch, isz, h, nd) = (sh.seq, sh.batch, sh.input, sh.hidden, sh.direction.count());
        let state = [nd, batch, h];
        let w = input(ctx, 1, Some(&[nd, 4 * h, isz]))?.expect("required");
        let r = input(ctx, 2, Some(&[nd, 4 * h, h]))?.expect("required");
        let y = input(ctx, 3, Some(&[seq, nd, batch, h]))?.expect("required");
        let gates = input(ctx, 4, Some(&[nd, seq, batch, LSTM_ROW * h]))?.expect("required");
        let h0 = input(ctx, 5, Some(&state))?;
        let c0 = input(ctx, 6, Some(&state))?;
        let dy = input(ctx, 7, Some(&[seq, nd, batch, h]))?;
        let dyh = input(ctx, 8, Some(&state))?;
        let dyc = input(ctx, 9, Some(&state))?;
        let ins = [
            Some(&x),
            Some(&w),
            Some(&r),
            Some(&y),
            Some(&gates),
            h0.as_ref(),
            c0.as_ref(),
            dy.as_ref(),
            dyh.as_ref(),
            dyc.as_ref(),
        ];
        let shapes = [
            x.shape.clone(),
            dims(&[nd, 4 * h, isz]),
            dims(&[nd, 4 * h, h]),
            dims(&[nd, 8 * h]),
            dims(&state),
            dims(&state),
        ];
        let outs = outputs(ctx, GRAD, &GRAD_OUT, &shapes)?;
        outputs_disjoint(GRAD, &ins, &outs, &GRAD_OUT)?;
        // SAFETY: as in LSTMTrain: aligned float32 buffers, outputs disjoint from everything.
        let (gin, gout) = unsafe {
            let opt = |t: &Option<Tensor>| t.as_ref().map(|t| t.slice::<f32>());
            let gin = LstmGradIn {
                x: x.slice(),
                w: w.slice(),
                r: r.slice(),
                y: y.slice(),
                gates: gates.slice(),
                initial_h: opt(&h0),
                initial_c: opt(&c0),
                dy: opt(&dy),
                dy_h: opt(&dyh),
                dy_c: opt(&dyc),
            };
            let m = |k: usize| outs[k].as_ref().map(|t| t.slice_mut::<f32>());
            (gin, LstmGradOut { dx: m(0), dw: m(1), dr: m(2), db: m(3), dh0: m(4), dc0: m(5) })
        };
        let pool = OrtPool::new(ctx);
        let mut own = LstmScratch::default();
        let mut kept = self.scratch.try_lock().ok();
        let scratch = kept.as_deref_mut().unwrap_or(&mut own);
        lstm_grad_with(&sh, &gin, gout, &pool, scratch).map_err(|e| Error::kernel(GRAD, e))
    }
}
