//! `com.trainops::GRUGrad` (since version 1): the gradients of ONNX's `GRU` (layout 0,
//! default activations), float32; and what it shares with `GRUTrain` ([`super::gru_train`]):
//! the attributes and the input and overlap checks.
//!
//! Inputs `X, W, R, Y, B?, initial_h?, dY?, dY_h?, gates?` (`Y` the forward's output, all
//! steps; an absent B or initial_h is zeros as in GRU, an absent dY or dY_h is zeros;
//! `gates` the third output of a `GRUTrain` node that computed `Y`, `[dirs, seq, batch,
//! 4 hidden]`: given, the gates are read instead of recomputed). Outputs `dX?, dW?, dR?,
//! dB?, d_initial_h?`, each shaped as its input (dB and d_initial_h with GRU's shapes even
//! where B or initial_h is absent). Attributes `hidden_size` (required),
//! `linear_before_reset` (0), `direction` ("forward").

use std::sync::Mutex;

use trainops_kernels::grad::rnn::{gru_grad_with, Direction, GruGradIn, GruGradOut, GruScratch, GruShape, GATE_ROW};

use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, Signature, Tensor};
use crate::ops::io;

const OP: &str = "GRUGrad";

/// The op as registered in `com.trainops`.
pub struct GruGrad;

const F: Option<DType> = Some(DType::Float);
static INPUTS: [Formal; 9] = [
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
static OUTPUTS: [Formal; 5] =
    [Formal::Optional(F), Formal::Optional(F), Formal::Optional(F), Formal::Optional(F), Formal::Optional(F)];
static SIGNATURE: Signature = Signature { name: c"GRUGrad", inputs: &INPUTS, outputs: &OUTPUTS };

const IN_NAMES: [&str; 9] = ["X", "W", "R", "Y", "B", "initial_h", "dY", "dY_h", "gates"];
const OUT_NAMES: [&str; 5] = ["dX", "dW", "dR", "dB", "d_initial_h"];

/// The attributes both GRU ops read: `hidden_size` (required), `linear_before_reset` (0),
/// `direction` ("forward").
#[derive(Debug, Clone, Copy)]
pub(crate) struct GruAttrs {
    pub hidden: usize,
    pub lbr: bool,
    pub direction: Direction,
}

impl GruAttrs {
    pub(crate) fn read(op: &'static str, info: &KernelInfo<'_>) -> Result<Self> {
        let attr = |name, what: String| Error::Attribute { op, name, what };
        let hidden = match info.i64_opt("hidden_size")? {
            Some(h) if h >= 1 => h as usize,
            Some(h) => return Err(attr("hidden_size", format!("expected a positive size, got {h}"))),
            None => return Err(attr("hidden_size", "is required".into())),
        };
        let lbr = match info.i64_opt("linear_before_reset")?.unwrap_or(0) {
            0 => false,
            1 => true,
            v => return Err(attr("linear_before_reset", format!("expected 0 or 1, got {v}"))),
        };
        let direction = match info.string_opt("direction")?.as_deref().unwrap_or("forward") {
            "forward" => Direction::Forward,
            "reverse" => Direction::Reverse,
            "bidirectional" => Direction::Bidirectional,
            other => {
                let what = format!("expected forward, reverse or bidirectional, got '{other}'");
                return Err(attr("direction", what));
            }
        };
        Ok(GruAttrs { hidden, lbr, direction })
    }

    pub(crate) fn shape(&self, seq: usize, batch: usize, input: usize) -> GruShape {
        GruShape { seq, batch, input, hidden: self.hidden, direction: self.direction, linear_before_reset: self.lbr }
    }

    /// The node's shape over X `(seq, batch, input)`, every tensor's size checked (`3 *
    /// hidden_size`, `6 * hidden_size`, `hidden_size^2`, ... must fit, each dimension in
    /// `2^63 - 1`) before anything is sized by it: an error names `hidden_size` when it
    /// overflows on its own (over a 1 x 1 x 1 X), else X.
    pub(crate) fn checked_shape(&self, op: &'static str, x: &Tensor) -> Result<GruShape> {
        let (seq, batch, isz) = x_dims(op, x)?;
        let check = |sh: &GruShape| -> std::result::Result<(), String> {
            let lens = sh.checked_lens().and_then(|l| sh.checked_gates_len().map(|g| (l, g)));
            lens.map_err(|e| e.to_string())?;
            let (h, nd) = (sh.hidden, sh.direction.count());
            for dims in [[nd, 3 * h, sh.input, 1], [nd, 6 * h, 1, 1], [nd, sh.seq, sh.batch, GATE_ROW * h]] {
                trainops_kernels::shape::to_i64("a dimension", &dims).map_err(|e| e.to_string())?;
            }
            Ok(())
        };
        if let Err(what) = check(&self.shape(1, 1, 1)) {
            let what = format!("expected a size whose tensors fit in 64 bits, got {} ({what})", self.hidden);
            return Err(Error::Attribute { op, name: "hidden_size", what });
        }
        let sh = self.shape(seq, batch, isz);
        check(&sh).map_err(|what| {
            let want = format!("a shape whose GRU tensors (hidden_size {}) fit in 64 bits", self.hidden);
            Error::input(op, 0, "X", want, format!("shape {:?} ({what})", x.shape))
        })?;
        Ok(sh)
    }
}

impl OpSpec for GruGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(GruGradKernel { attrs: GruAttrs::read(OP, info)?, scratch: Mutex::default() }))
    }
}

struct GruGradKernel {
    attrs: GruAttrs,
    /// Working memory kept between runs (no allocation or page faults per step); a run that
    /// finds it busy (the same node run concurrently) uses its own.
    scratch: Mutex<GruScratch>,
}

/// Input `k` of `op` (named `names[k]`; the first `required` must be present, absent
/// optional ones are `None`), checked to be float32 of `dims`.
pub(crate) fn gru_input(
    ctx: &Context<'_>,
    op: &'static str,
    names: &[&str],
    required: usize,
    k: usize,
    dims: Option<&[usize]>,
) -> Result<Option<Tensor>> {
    let Some(t) = ctx.input(k)? else {
        return if k < required { Err(Error::input(op, k, names[k], "a tensor", "no input")) } else { Ok(None) };
    };
    let shape_ok = dims.is_none_or(|d| t.dims() == d);
    if t.dtype != DType::Float || !shape_ok {
        let want = match dims {
            Some(d) => format!("tensor(float) of shape {d:?}"),
            None => "tensor(float)".into(),
        };
        return Err(Error::input(op, k, names[k], want, format!("{} of shape {:?}", t.dtype.name(), t.shape)));
    }
    if !t.aligned() {
        return Err(Error::input(op, k, names[k], "a buffer aligned for its type", "a misaligned one"));
    }
    Ok(Some(t))
}

/// X, checked to be rank 3 (layout 0): `(seq, batch, input)`.
pub(crate) fn x_dims(op: &'static str, x: &Tensor) -> Result<(usize, usize, usize)> {
    match x.dims()[..] {
        [seq, batch, input] => Ok((seq, batch, input)),
        _ => {
            let got = format!("shape {:?}", x.shape);
            Err(Error::input(op, 0, "X", "rank 3, [seq_length, batch_size, input_size] (layout 0)", got))
        }
    }
}

/// An error unless every output is disjoint from every input and every other output (the
/// kernels read the inputs while writing the outputs; a caller's binding could share them).
pub(crate) fn outputs_disjoint(
    op: &'static str,
    ins: &[Option<&Tensor>],
    outs: &[Option<Tensor>],
    out_names: &[&str],
) -> Result<()> {
    for (k, o) in outs.iter().enumerate() {
        let Some(o) = o.as_ref().filter(|o| o.numel > 0) else { continue };
        let ob = o.bytes();
        let others = outs.iter().enumerate().filter(|&(j, _)| j != k).filter_map(|(_, p)| p.as_ref());
        let hit = ins.iter().flatten().copied().chain(others).find(|t| {
            let tb = t.bytes();
            t.numel > 0 && tb.start < ob.end && ob.start < tb.end
        });
        if hit.is_some() {
            let what = format!("output {k} ({}) overlaps another input or output of the node", out_names[k]);
            return Err(Error::Aliasing { op, what });
        }
    }
    Ok(())
}

impl Kernel for GruGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let input = |ctx: &Context<'_>, k: usize, dims: Option<&[usize]>| gru_input(ctx, OP, &IN_NAMES, 4, k, dims);
        let x = input(ctx, 0, None)?.expect("required");
        let sh = self.attrs.checked_shape(OP, &x)?;
        let (seq, batch, isz) = (sh.seq, sh.batch, sh.input);
        let (h, nd) = (self.attrs.hidden, self.attrs.direction.count());
        let w = input(ctx, 1, Some(&[nd, 3 * h, isz]))?.expect("required");
        let r = input(ctx, 2, Some(&[nd, 3 * h, h]))?.expect("required");
        let y = input(ctx, 3, Some(&[seq, nd, batch, h]))?.expect("required");
        let b = input(ctx, 4, Some(&[nd, 6 * h]))?;
        let h0 = input(ctx, 5, Some(&[nd, batch, h]))?;
        let dy = input(ctx, 6, Some(&[seq, nd, batch, h]))?;
        let dyh = input(ctx, 7, Some(&[nd, batch, h]))?;
        let gates = input(ctx, 8, Some(&[nd, seq, batch, GATE_ROW * h]))?;
        let ins = [
            Some(&x),
            Some(&w),
            Some(&r),
            Some(&y),
            b.as_ref(),
            h0.as_ref(),
            dy.as_ref(),
            dyh.as_ref(),
            gates.as_ref(),
        ];

        let dims = |v: &[usize]| v.iter().map(|&d| d as i64).collect::<Vec<_>>();
        let shapes = [
            x.shape.clone(),
            dims(&[nd, 3 * h, isz]),
            dims(&[nd, 3 * h, h]),
            dims(&[nd, 6 * h]),
            dims(&[nd, batch, h]),
        ];
        let mut outs: Vec<Option<Tensor>> = Vec::with_capacity(5);
        for (k, shape) in shapes.iter().enumerate() {
            outs.push(io::optional_output(ctx, OP, k, OUT_NAMES[k], DType::Float, shape)?);
        }
        outputs_disjoint(OP, &ins, &outs, &OUT_NAMES)?;
        // SAFETY: every tensor was checked to be an aligned float32 buffer; the inputs are
        // only read and no output overlaps an input or another output (checked above), so
        // the mutable views are the only references to their memory.
        let (gin, gout) = unsafe {
            let opt = |t: &Option<Tensor>| t.as_ref().map(|t| t.slice::<f32>());
            let gin = GruGradIn {
                x: x.slice(),
                w: w.slice(),
                r: r.slice(),
                b: opt(&b),
                initial_h: opt(&h0),
                y: y.slice(),
                dy: opt(&dy),
                dy_h: opt(&dyh),
                gates: opt(&gates),
            };
            let m = |k: usize| outs[k].as_ref().map(|t| t.slice_mut::<f32>());
            (gin, GruGradOut { dx: m(0), dw: m(1), dr: m(2), db: m(3), dh0: m(4) })
        };
        let pool = OrtPool::new(ctx);
        let mut own = GruScratch::default();
        let mut kept = self.scratch.try_lock().ok();
        let scratch = kept.as_deref_mut().unwrap_or(&mut own);
        gru_grad_with(&sh, &gin, gout, &pool, scratch).map_err(|e| Error::kernel(OP, e))
    }
}
