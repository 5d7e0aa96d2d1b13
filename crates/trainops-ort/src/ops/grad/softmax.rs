//! `com.trainops::SoftmaxGrad` and `LogSoftmaxGrad` (since version 1): `(dY, Y) -> dX`, the
//! backward of ONNX's Softmax / LogSoftmax (opset 13 and later: one axis) for float32, from
//! the forward output Y (the math: `trainops_kernels::grad::softmax`).

use trainops_kernels::grad::softmax::{softmax_grad, Dims, Kind};
use trainops_kernels::simd::detected;

use super::{axis_of, disjoint, float_input, kernel_error};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
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
        softmax_grad(detected(), self.kind, Dims::split(&shape, axis), g, v, d, &pool).map_err(|e| kernel_error(op, e))
    }
}
