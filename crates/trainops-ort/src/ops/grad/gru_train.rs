//! `com.trainops::GRUTrain` (since version 1): ONNX's `GRU` forward (layout 0, the default
//! activations, no `sequence_lens`), float32, that also outputs the gates its backward
//! `GRUGrad` reads instead of recomputing them.
//!
//! Inputs `X, W, R, B?, sequence_lens?, initial_h?` as GRU's (`sequence_lens` must be
//! absent). Outputs `Y?, Y_h?, gates?`: `Y` `[seq, dirs, batch, hidden]` and `Y_h`
//! `[dirs, batch, hidden]` as GRU's, `gates` `[dirs, seq, batch, 4 hidden]` (each row z, r,
//! ĥ and the h gate's recurrent term, `trainops_kernels::grad::rnn::GATE_ROW`). Attributes
//! `hidden_size` (required), `linear_before_reset` (0), `direction` ("forward"); `layout`
//! must be 0 and `clip` absent if given.

use std::sync::Mutex;

use trainops_kernels::grad::rnn::forward::{gru_train_with, GruTrainIn, GruTrainOut, GruTrainScratch};
use trainops_kernels::grad::rnn::GATE_ROW;

use super::rnn::{gru_input, outputs_disjoint, GruAttrs};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, Signature, Tensor};
use crate::ops::io;

const OP: &str = "GRUTrain";

/// The op as registered in `com.trainops`.
pub struct GruTrain;

const F: Option<DType> = Some(DType::Float);
static INPUTS: [Formal; 6] = [
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::Optional(F),
    Formal::Optional(Some(DType::Int32)),
    Formal::Optional(F),
];
static OUTPUTS: [Formal; 3] = [Formal::Optional(F), Formal::Optional(F), Formal::Optional(F)];
static SIGNATURE: Signature = Signature { name: c"GRUTrain", inputs: &INPUTS, outputs: &OUTPUTS };

const IN_NAMES: [&str; 6] = ["X", "W", "R", "B", "sequence_lens", "initial_h"];
const OUT_NAMES: [&str; 3] = ["Y", "Y_h", "gates"];

impl OpSpec for GruTrain {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attrs = GruAttrs::read(OP, info)?;
        if let Some(layout) = info.i64_opt("layout")?.filter(|&l| l != 0) {
            let what = format!("expected 0 ([seq_length, batch_size, ...]), got {layout}");
            return Err(Error::Attribute { op: OP, name: "layout", what });
        }
        if info.f32_opt("clip")?.is_some() {
            return Err(Error::Attribute { op: OP, name: "clip", what: "is not supported (leave it out)".into() });
        }
        Ok(Box::new(GruTrainKernel { attrs, scratch: Mutex::default() }))
    }
}

/// Working memory: the kernel's, and stand-ins for the outputs `Y` and `gates` where the node
/// leaves them out (the recurrence needs both).
#[derive(Default)]
struct Scratch {
    kernel: GruTrainScratch,
    y: Vec<f32>,
    gates: Vec<f32>,
}

/// `v` resized to `len` elements as a stand-in for an output the node leaves out, allocated
/// fallibly (Y and the gates may be larger than memory: an error, not an abort).
fn stand_in<'a>(v: &'a mut Vec<f32>, len: usize, what: &'static str) -> Result<&'a mut [f32]> {
    trainops_kernels::shape::resize(v, len, what).map_err(|e| Error::kernel(OP, e))?;
    Ok(v)
}

struct GruTrainKernel {
    attrs: GruAttrs,
    /// Kept between runs; a run that finds it busy (the same node run concurrently) uses
    /// its own.
    scratch: Mutex<Scratch>,
}

impl Kernel for GruTrainKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let input = |ctx: &Context<'_>, k: usize, dims: Option<&[usize]>| gru_input(ctx, OP, &IN_NAMES, 3, k, dims);
        let x = input(ctx, 0, None)?.expect("required");
        let sh = self.attrs.checked_shape(OP, &x)?;
        let (seq, batch, isz) = (sh.seq, sh.batch, sh.input);
        let (h, nd) = (self.attrs.hidden, self.attrs.direction.count());
        let w = input(ctx, 1, Some(&[nd, 3 * h, isz]))?.expect("required");
        let r = input(ctx, 2, Some(&[nd, 3 * h, h]))?.expect("required");
        let b = input(ctx, 3, Some(&[nd, 6 * h]))?;
        if ctx.input(4)?.is_some() {
            let what = "absent (every sequence has seq_length steps; use ONNX's GRU for sequence_lens)";
            return Err(Error::input(OP, 4, "sequence_lens", what, "a tensor"));
        }
        let h0 = input(ctx, 5, Some(&[nd, batch, h]))?;
        let ins = [Some(&x), Some(&w), Some(&r), b.as_ref(), h0.as_ref()];

        let dims = |v: &[usize]| v.iter().map(|&d| d as i64).collect::<Vec<_>>();
        let shapes = [dims(&[seq, nd, batch, h]), dims(&[nd, batch, h]), dims(&[nd, seq, batch, GATE_ROW * h])];
        let mut outs: Vec<Option<Tensor>> = Vec::with_capacity(3);
        for (k, shape) in shapes.iter().enumerate() {
            outs.push(io::optional_output(ctx, OP, k, OUT_NAMES[k], DType::Float, shape)?);
        }
        outputs_disjoint(OP, &ins, &outs, &OUT_NAMES)?;
        let mut own = Scratch::default();
        let mut kept = self.scratch.try_lock().ok();
        let scratch = kept.as_deref_mut().unwrap_or(&mut own);
        let Scratch { kernel, y: y_own, gates: g_own } = scratch;
        // SAFETY: every tensor was checked to be an aligned float32 buffer; the inputs are
        // only read and no output overlaps an input or another output (checked above), so
        // the mutable views are the only references to their memory.
        let (tin, y, y_h, gates) = unsafe {
            let opt = |t: &Option<Tensor>| t.as_ref().map(|t| t.slice::<f32>());
            let tin = GruTrainIn { x: x.slice(), w: w.slice(), r: r.slice(), b: opt(&b), initial_h: opt(&h0) };
            let m = |k: usize| outs[k].as_ref().map(|t| t.slice_mut::<f32>());
            (tin, m(0), m(1), m(2))
        };
        let y = match y {
            Some(y) => y,
            None => stand_in(y_own, sh.lens()[5], "GRUTrain's Y (not an output of the node)")?,
        };
        let gates = match gates {
            Some(g) => g,
            None => stand_in(g_own, sh.gates_len(), "GRUTrain's gates (not an output of the node)")?,
        };
        let pool = OrtPool::new(ctx);
        gru_train_with(&sh, &tin, GruTrainOut { y, y_h, gates }, &pool, kernel).map_err(|e| Error::kernel(OP, e))
    }
}
