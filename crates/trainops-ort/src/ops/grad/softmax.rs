//! `com.trainops::SoftmaxGrad` and `LogSoftmaxGrad` (since version 1): `(dY, Y) -> dX`, the
//! backward of ONNX's Softmax / LogSoftmax (opset 13 and later: one axis) for float32, from
//! the forward output Y; `SoftmaxCrossEntropyLossGrad`: the backward of
//! SoftmaxCrossEntropyLoss without weights, [N, C] scores; `SoftmaxCrossEntropy`: its
//! forward, without the log-probabilities (the math: `trainops_kernels::grad::softmax`).

use trainops_kernels::grad::softmax::{cross_entropy_grad, cross_entropy_loss, softmax_grad, Dims, Kind, LossScale};
use trainops_kernels::simd::detected;

use super::{axis_of, disjoint, float_input};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};
use crate::ops::io;

/// One of the two ops, as registered in `com.trainops`.
pub struct SoftmaxGradOp {
    kind: Kind,
    signature: Signature,
}

const F: Option<DType> = Some(DType::Float);
static INPUTS: [Formal; 2] = [Formal::One(F), Formal::One(F)];
static OUTPUTS: [Formal; 1] = [Formal::One(F)];

/// `com.trainops::SoftmaxGrad`: `dX = Y (dY - sum(dY Y, axis))`.
pub static SOFTMAX_GRAD: SoftmaxGradOp = SoftmaxGradOp {
    kind: Kind::Softmax,
    signature: Signature { name: c"SoftmaxGrad", inputs: &INPUTS, outputs: &OUTPUTS },
};

/// `com.trainops::LogSoftmaxGrad`: `dX = dY - exp(Y) sum(dY, axis)`.
pub static LOG_SOFTMAX_GRAD: SoftmaxGradOp = SoftmaxGradOp {
    kind: Kind::LogSoftmax,
    signature: Signature { name: c"LogSoftmaxGrad", inputs: &INPUTS, outputs: &OUTPUTS },
};

impl OpSpec for SoftmaxGradOp {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(SoftmaxGradKernel { op: self.op(), kind: self.kind, axis: info.i64_opt("axis")?.unwrap_or(-1) }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)
    }
}

struct SoftmaxGradKernel {
    op: &'static str,
    kind: Kind,
    axis: i64,
}

impl Kernel for SoftmaxGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = self.op;
        let dy = float_input(ctx, op, 0, "dY")?;
        let y = float_input(ctx, op, 1, "Y")?;
        if dy.shape != y.shape {
            return Err(Error::input(op, 0, "dY", format!("the shape of Y {:?}", y.shape), format!("{:?}", dy.shape)));
        }
        let shape = y.dims();
        let axis = axis_of(op, self.axis, shape.len(), 1, "Y")?;
        let dx = io::output(ctx, op, 0, "dX", DType::Float, &y.shape)?;
        disjoint(op, &[("dX", &dx)], &[("dY", &dy), ("Y", &y)])?;
        // SAFETY: float32 and aligned (checked); dX overlaps neither input (checked), and
        // nothing else views these buffers during the call.
        let (g, v, d) = unsafe { (dy.slice::<f32>(), y.slice::<f32>(), dx.slice_mut::<f32>()) };
        let pool = OrtPool::new(ctx);
        // A count past usize splits only an empty tensor (huge dimensions beside a zero):
        // its dX is empty, nothing to do.
        let Some(dims) = Dims::split(&shape, axis) else { return Ok(()) };
        softmax_grad(detected(), self.kind, dims, g, v, d, &pool).map_err(|e| Error::kernel(op, e))
    }
}

/// `com.trainops::SoftmaxCrossEntropyLossGrad`: `(dY, scores[N, C], labels[N]) -> dScores`,
/// the backward of SoftmaxCrossEntropyLoss without class weights (attributes `reduction`,
/// `ignore_index` as the forward node's).
pub struct SoftmaxCrossEntropyLossGrad;

static SCE_INPUTS: [Formal; 3] = [Formal::One(F), Formal::One(F), Formal::One(None)];
static SCE_SIGNATURE: Signature =
    Signature { name: c"SoftmaxCrossEntropyLossGrad", inputs: &SCE_INPUTS, outputs: &OUTPUTS };
const SCE: &str = "SoftmaxCrossEntropyLossGrad";

/// The forward node's reduction.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reduction {
    None,
    Sum,
    Mean,
}

impl OpSpec for SoftmaxCrossEntropyLossGrad {
    fn signature(&self) -> &Signature {
        &SCE_SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let reduction = Reduction::parse(SCE, info.string_opt("reduction")?)?;
        Ok(Box::new(SceGradKernel { reduction, ignore: info.i64_opt("ignore_index")? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)
    }
}

impl Reduction {
    fn parse(op: &'static str, value: Option<String>) -> Result<Self> {
        match value.as_deref().unwrap_or("mean") {
            "none" => Ok(Reduction::None),
            "sum" => Ok(Reduction::Sum),
            "mean" => Ok(Reduction::Mean),
            other => {
                let what = format!("expected one of none, sum, mean, got {other:?}");
                Err(Error::Attribute { op, name: "reduction", what })
            }
        }
    }
}

/// Checks a cross-entropy node's `scores` ([N, C]) and `labels` (int64 [N], each in `[0,
/// C)` or `ignore`); returns `(N, C, labels)`.
fn scores_and_labels<'t>(
    op: &'static str,
    scores: &Tensor,
    labels_t: &'t Tensor,
    at: (usize, usize),
    ignore: Option<i64>,
) -> Result<(usize, usize, &'t [i64])> {
    if scores.shape.len() != 2 {
        return Err(Error::input(op, at.0, "scores", "a 2-D tensor [N, C]", format!("shape {:?}", scores.shape)));
    }
    let (rows, classes) = (scores.dims()[0], scores.dims()[1]);
    if labels_t.numel != rows || labels_t.shape.len() != 1 || !labels_t.aligned() {
        let want = format!("an aligned 1-D tensor of {rows} labels (scores' first dimension)");
        return Err(Error::input(op, at.1, "labels", want, format!("shape {:?}", labels_t.shape)));
    }
    let labels: &[i64] = match labels_t.dtype {
        // SAFETY: int64 (the match), aligned (checked); inputs are never written (the
        // outputs overlap none: each caller checks before its kernel writes).
        DType::Int64 => unsafe { labels_t.slice::<i64>() },
        other => return Err(Error::input(op, at.1, "labels", "tensor(int64)", other.name())),
    };
    if let Some(bad) = labels.iter().find(|&&l| Some(l) != ignore && !(0..classes as i64).contains(&l)) {
        let want = format!("labels in [0, {classes}) or ignore_index");
        return Err(Error::input(op, at.1, "labels", want, format!("label {bad}")));
    }
    Ok((rows, classes, labels))
}

struct SceGradKernel {
    reduction: Reduction,
    ignore: Option<i64>,
}

impl Kernel for SceGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let dy = float_input(ctx, SCE, 0, "dY")?;
        let scores = float_input(ctx, SCE, 1, "scores")?;
        let labels_t = io::required(ctx, SCE, 2, "labels")?;
        let (rows, classes, labels) = scores_and_labels(SCE, &scores, &labels_t, (1, 2), self.ignore)?;
        let want_dy = if self.reduction == Reduction::None { rows } else { 1 };
        if dy.numel != want_dy {
            let want = format!("{want_dy} element(s) (the loss' gradient)");
            return Err(Error::input(SCE, 0, "dY", want, format!("shape {:?}", dy.shape)));
        }
        let dx = io::output(ctx, SCE, 0, "dScores", DType::Float, &scores.shape)?;
        disjoint(SCE, &[("dScores", &dx)], &[("dY", &dy), ("scores", &scores), ("labels", &labels_t)])?;
        // SAFETY: float32 and aligned (checked); the output overlaps no input (checked).
        let (g, x, d) = unsafe { (dy.slice::<f32>(), scores.slice::<f32>(), dx.slice_mut::<f32>()) };
        let scale = match self.reduction {
            Reduction::None => LossScale::EachRow(g),
            Reduction::Sum => LossScale::Sum(g[0]),
            Reduction::Mean => LossScale::Mean(g[0]),
        };
        let pool = OrtPool::new(ctx);
        cross_entropy_grad(detected(), x, classes, labels, self.ignore, scale, d, &pool)
            .map_err(|e| Error::kernel(SCE, e))
    }
}

/// `com.trainops::SoftmaxCrossEntropy`: `(scores[N, C], labels[N]) -> loss`, ONNX's
/// SoftmaxCrossEntropyLoss without class weights and without its `log_prob` output
/// (attributes `reduction`, `ignore_index` as ONNX's): the CPU step's loss on a threaded
/// kernel that keeps no `[N, C]` log-probabilities.
pub struct SoftmaxCrossEntropy;

static CE_INPUTS: [Formal; 2] = [Formal::One(F), Formal::One(None)];
static CE_SIGNATURE: Signature = Signature { name: c"SoftmaxCrossEntropy", inputs: &CE_INPUTS, outputs: &OUTPUTS };
const CE: &str = "SoftmaxCrossEntropy";

impl OpSpec for SoftmaxCrossEntropy {
    fn signature(&self) -> &Signature {
        &CE_SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let reduction = Reduction::parse(CE, info.string_opt("reduction")?)?;
        Ok(Box::new(CeKernel { reduction, ignore: info.i64_opt("ignore_index")? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        if ctx.attr_string(c"reduction").as_deref() == Some("none") {
            let rows = ctx.input(0).and_then(|(_, dims)| dims.first().copied()).filter(|&d| d >= 0);
            ctx.set_output(0, DType::Float, Some(&[rows]))
        } else {
            ctx.set_output(0, DType::Float, Some(&[]))
        }
    }
}

struct CeKernel {
    reduction: Reduction,
    ignore: Option<i64>,
}

impl Kernel for CeKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let scores = float_input(ctx, CE, 0, "scores")?;
        let labels_t = io::required(ctx, CE, 1, "labels")?;
        let (rows, classes, labels) = scores_and_labels(CE, &scores, &labels_t, (0, 1), self.ignore)?;
        let mut per_row = vec![0f32; rows];
        // SAFETY: float32 and aligned (checked by float_input).
        let x = unsafe { scores.slice::<f32>() };
        let pool = OrtPool::new(ctx);
        let (sum, count) = cross_entropy_loss(detected(), x, classes, labels, self.ignore, &mut per_row, &pool)
            .map_err(|e| Error::kernel(CE, e))?;
        let shape: &[i64] = if self.reduction == Reduction::None { &[rows as i64] } else { &[] };
        let out = io::output(ctx, CE, 0, "loss", DType::Float, shape)?;
        disjoint(CE, &[("loss", &out)], &[("scores", &scores), ("labels", &labels_t)])?;
        // SAFETY: float32 and aligned (the output was just made so); it overlaps no input
        // (checked).
        let y = unsafe { out.slice_mut::<f32>() };
        match self.reduction {
            Reduction::None => y.copy_from_slice(&per_row),
            Reduction::Sum => y[0] = sum as f32,
            // all rows ignored: 0/0, NaN, as the standard form's ReduceSum / ReduceSum
            Reduction::Mean => y[0] = (sum / count as f64) as f32,
        }
        Ok(())
    }
}
