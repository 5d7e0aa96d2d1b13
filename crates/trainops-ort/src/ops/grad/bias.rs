//! `com.trainops::BiasGrad(dY) -> dB` (since version 1): the sum of float32 `dY` over its
//! first `leading` axes (attribute, at least 1, at most `dY`'s rank), `dB` of `dY`'s shape
//! after them: a bias's gradient, onnxruntime's `ReduceSum` over the leading axes with
//! `keepdims` 0. The arithmetic is `trainops_kernels::grad::bias`: float64 partial sums over
//! blocks fixed by the shape, rounded once, the same bits at any thread count.

use trainops_kernels::grad::bias::bias_grad;

use super::{disjoint, float_input, shape_i64};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

const OP: &str = "BiasGrad";

/// The op as registered in `com.trainops`.
pub struct BiasGrad;

static INPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static SIGNATURE: Signature = Signature { name: c"BiasGrad", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for BiasGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let leading = info.i64_opt("leading")?.unwrap_or(1);
        if leading < 1 {
            let what = format!("expected at least 1 (the leading axes summed), got {leading}");
            return Err(Error::Attribute { op: OP, name: "leading", what });
        }
        Ok(Box::new(BiasGradKernel { leading: leading as usize }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let leading = ctx.attr_i64(c"leading").unwrap_or(1);
        let Some((_, dy)) = ctx.input(0) else { return Ok(()) };
        if leading < 1 || leading as usize > dy.len() {
            return Ok(()); // the kernel says what it expects
        }
        let dims: Vec<Option<i64>> = dy[leading as usize..].iter().map(|&d| (d >= 0).then_some(d)).collect();
        ctx.set_output(0, DType::Float, Some(&dims))
    }
}

struct BiasGradKernel {
    leading: usize,
}

impl Kernel for BiasGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let dy = float_input(ctx, OP, 0, "dY")?;
        let dims = dy.dims();
        if dims.len() < self.leading {
            let want = format!("rank >= {} (attribute leading)", self.leading);
            return Err(Error::input(OP, 0, "dY", want, format!("shape {:?}", dy.shape)));
        }
        let (lead, rest) = dims.split_at(self.leading);
        let count = |part: &[usize]| {
            trainops_kernels::shape::numel(part).ok_or_else(|| {
                Error::input(OP, 0, "dY", "dimensions whose products fit in 64 bits", format!("shape {:?}", dy.shape))
            })
        };
        let (rows, width) = (count(lead)?, count(rest)?);
        let out = io::output(ctx, OP, 0, "dB", DType::Float, &shape_i64(OP, 0, "dY", rest)?)?;
        disjoint(OP, &[("dB", &out)], &[("dY", &dy)])?;
        // SAFETY: float32 and aligned (checked); the output overlaps no input (checked).
        let (dyv, db) = unsafe { (dy.slice::<f32>(), out.slice_mut::<f32>()) };
        bias_grad(rows, width, dyv, db, &OrtPool::new(ctx)).map_err(|e| Error::kernel(OP, e))
    }
}
