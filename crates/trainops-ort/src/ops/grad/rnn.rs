//! `com.trainops::GRUGrad` (since version 1): the gradients of ONNX's `GRU` (layout 0,
//! default activations), float32.
//!
//! Inputs `X, W, R, Y, B?, initial_h?, dY?, dY_h?` (`Y` the forward's output, all steps;
//! an absent B or initial_h is zeros as in GRU, an absent dY or dY_h is zeros). Outputs
//! `dX?, dW?, dR?, dB?, d_initial_h?`, each shaped as its input (dB and d_initial_h with
//! GRU's shapes even where B or initial_h is absent). Attributes `hidden_size` (required),
//! `linear_before_reset` (0), `direction` ("forward").

use std::sync::Mutex;

use trainops_kernels::grad::rnn::{gru_grad_with, Direction, GruGradIn, GruGradOut, GruScratch, GruShape};

use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, Signature, Tensor};
use crate::ops::io;

const OP: &str = "GRUGrad";

/// The op as registered in `com.trainops`.
pub struct GruGrad;

const F: Option<DType> = Some(DType::Float);
static INPUTS: [Formal; 8] = [
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::One(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
    Formal::Optional(F),
];
static OUTPUTS: [Formal; 5] =
    [Formal::Optional(F), Formal::Optional(F), Formal::Optional(F), Formal::Optional(F), Formal::Optional(F)];
static SIGNATURE: Signature = Signature { name: c"GRUGrad", inputs: &INPUTS, outputs: &OUTPUTS };

const IN_NAMES: [&str; 8] = ["X", "W", "R", "Y", "B", "initial_h", "dY", "dY_h"];
const OUT_NAMES: [&str; 5] = ["dX", "dW", "dR", "dB", "d_initial_h"];

impl OpSpec for GruGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attr = |name, what: String| Error::Attribute { op: OP, name, what };
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
        Ok(Box::new(GruGradKernel { hidden, lbr, direction, scratch: Mutex::default() }))
    }
}

struct GruGradKernel {
    hidden: usize,
    lbr: bool,
    direction: Direction,
    /// Working memory kept between runs (no allocation or page faults per step); a run that
    /// finds it busy (the same node run concurrently) uses its own.
    scratch: Mutex<GruScratch>,
}

/// Input `k` (absent optional inputs are `None`), checked to be float32 of `dims`.
fn input(ctx: &Context<'_>, k: usize, dims: Option<&[usize]>) -> Result<Option<Tensor>> {
    let Some(t) = ctx.input(k)? else {
        return match k {
            0..4 => Err(Error::input(OP, k, IN_NAMES[k], "a tensor", "no input")),
            _ => Ok(None),
        };
    };
    let shape_ok = dims.is_none_or(|d| t.dims() == d);
    if t.dtype != DType::Float || !shape_ok {
        let want = match dims {
            Some(d) => format!("tensor(float) of shape {d:?}"),
            None => "tensor(float)".into(),
        };
        return Err(Error::input(OP, k, IN_NAMES[k], want, format!("{} of shape {:?}", t.dtype.name(), t.shape)));
    }
    if !t.aligned() {
        return Err(Error::input(OP, k, IN_NAMES[k], "a buffer aligned for its type", "a misaligned one"));
    }
    Ok(Some(t))
}

impl Kernel for GruGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let x = input(ctx, 0, None)?.expect("required");
        let xd = x.dims();
        if xd.len() != 3 {
            let got = format!("shape {:?}", x.shape);
            return Err(Error::input(OP, 0, "X", "rank 3, [seq_length, batch_size, input_size] (layout 0)", got));
        }
        let (seq, batch, isz, h, nd) = (xd[0], xd[1], xd[2], self.hidden, self.direction.count());
        let w = input(ctx, 1, Some(&[nd, 3 * h, isz]))?.expect("required");
        let r = input(ctx, 2, Some(&[nd, 3 * h, h]))?.expect("required");
        let y = input(ctx, 3, Some(&[seq, nd, batch, h]))?.expect("required");
        let b = input(ctx, 4, Some(&[nd, 6 * h]))?;
        let h0 = input(ctx, 5, Some(&[nd, batch, h]))?;
        let dy = input(ctx, 6, Some(&[seq, nd, batch, h]))?;
        let dyh = input(ctx, 7, Some(&[nd, batch, h]))?;
        let ins = [Some(&x), Some(&w), Some(&r), Some(&y), b.as_ref(), h0.as_ref(), dy.as_ref(), dyh.as_ref()];

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
        // The inputs are read while the outputs are written: no output may share their memory.
        for (k, o) in outs.iter().enumerate() {
            let Some(o) = o.as_ref().filter(|o| o.numel > 0) else { continue };
            let ob = o.bytes();
            let others = outs.iter().enumerate().filter(|&(j, _)| j != k).filter_map(|(_, p)| p.as_ref());
            let hit = ins.iter().flatten().copied().chain(others).find(|t| {
                let tb = t.bytes();
                t.numel > 0 && tb.start < ob.end && ob.start < tb.end
            });
            if hit.is_some() {
                let what = format!("output {k} ({}) overlaps another input or output of the node", OUT_NAMES[k]);
                return Err(Error::Aliasing { op: OP, what });
            }
        }
        let sh =
            GruShape { seq, batch, input: isz, hidden: h, direction: self.direction, linear_before_reset: self.lbr };
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
            };
            let m = |k: usize| outs[k].as_ref().map(|t| t.slice_mut::<f32>());
            (gin, GruGradOut { dx: m(0), dw: m(1), dr: m(2), db: m(3), dh0: m(4) })
        };
        let pool = OrtPool::new(ctx);
        let mut own = GruScratch::default();
        let mut kept = self.scratch.try_lock().ok();
        let scratch = kept.as_deref_mut().unwrap_or(&mut own);
        gru_grad_with(&sh, &gin, gout, &pool, scratch).map_err(|e| Error::Runtime {
            op: OP,
            call: "gru_grad",
            message: e.to_string(),
        })
    }
}
