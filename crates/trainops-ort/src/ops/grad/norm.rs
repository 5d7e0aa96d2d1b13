//! `com.trainops::LayerNormGrad` (since version 1): `(dY, X, Scale, Mean, InvStdDev) ->
//! (dX, dScale?, dBias?)`, the backward of ONNX's LayerNormalization for float32, from the
//! forward node's own `Mean` and `InvStdDev` (the math: `trainops_kernels::grad::norm`).

use trainops_kernels::grad::norm::{layer_norm_grad, LayerNormGradIn, LayerNormGradOut};
use trainops_kernels::simd::detected;

use super::{axis_of, disjoint, float_input};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

const OP: &str = "LayerNormGrad";

/// The op as registered in `com.trainops`.
pub struct LayerNormGrad;

const F: Option<DType> = Some(DType::Float);
static INPUTS: [Formal; 5] = [Formal::One(F), Formal::One(F), Formal::One(F), Formal::One(F), Formal::One(F)];
static OUTPUTS: [Formal; 3] = [Formal::One(F), Formal::Optional(F), Formal::Optional(F)];
static SIGNATURE: Signature = Signature { name: c"LayerNormGrad", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for LayerNormGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(LayerNormGradKernel { axis: info.i64_opt("axis")?.unwrap_or(-1) }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)
    }
}

struct LayerNormGradKernel {
    axis: i64,
}

impl Kernel for LayerNormGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let dy = float_input(ctx, OP, 0, "dY")?;
        let x = float_input(ctx, OP, 1, "X")?;
        let scale = float_input(ctx, OP, 2, "Scale")?;
        let mean = float_input(ctx, OP, 3, "Mean")?;
        let rstd = float_input(ctx, OP, 4, "InvStdDev")?;
        if dy.shape != x.shape {
            return Err(Error::input(OP, 0, "dY", format!("the shape of X {:?}", x.shape), format!("{:?}", dy.shape)));
        }
        let dims = x.dims();
        let axis = axis_of(OP, self.axis, dims.len(), 1, "X")?;
        // An empty X may have huge dimensions beside its zero: counts past 64 bits cannot
        // match Scale, Mean or InvStdDev (real tensors), so they are refused here.
        let count = |part: &[usize], what: &str| {
            trainops_kernels::shape::numel(part).ok_or_else(|| {
                let want = format!("dimensions {what} axis {axis} whose product fits in 64 bits");
                Error::input(OP, 1, "X", want, format!("shape {:?}", x.shape))
            })
        };
        let (rows, cols) = (count(&dims[..axis], "before")?, count(&dims[axis..], "from")?);
        if scale.numel != cols {
            let want = format!("{cols} elements (X's dimensions from axis {axis} on, {:?})", &x.shape[axis..]);
            return Err(Error::input(OP, 2, "Scale", want, format!("shape {:?}", scale.shape)));
        }
        for (k, name, t) in [(3, "Mean", &mean), (4, "InvStdDev", &rstd)] {
            if t.numel != rows {
                let want = format!("{rows} elements (one per row: X's dimensions before axis {axis})");
                return Err(Error::input(OP, k, name, want, format!("shape {:?}", t.shape)));
            }
        }
        let dx = io::output(ctx, OP, 0, "dX", DType::Float, &x.shape)?;
        let dscale = io::optional_output(ctx, OP, 1, "dScale", DType::Float, &scale.shape)?;
        let dbias = io::optional_output(ctx, OP, 2, "dBias", DType::Float, &scale.shape)?;
        let inputs = [("dY", &dy), ("X", &x), ("Scale", &scale), ("Mean", &mean), ("InvStdDev", &rstd)];
        let mut outputs = vec![("dX", &dx)];
        outputs.extend(dscale.iter().map(|t| ("dScale", t)));
        outputs.extend(dbias.iter().map(|t| ("dBias", t)));
        disjoint(OP, &outputs, &inputs)?;
        if let (Some(a), Some(b)) = (&dscale, &dbias) {
            disjoint(OP, &[("dScale", a)], &[("dBias", b)])?;
        }
        // SAFETY: float32 and aligned (checked above); the outputs overlap no input and each
        // other not (checked), and nothing else views these buffers during the call.
        let (inp, out) = unsafe {
            let inp = LayerNormGradIn {
                dy: dy.slice(),
                x: x.slice(),
                scale: scale.slice(),
                mean: mean.slice(),
                inv_std_dev: rstd.slice(),
            };
            let out = LayerNormGradOut {
                dx: dx.slice_mut(),
                dscale: dscale.as_ref().map(|t| t.slice_mut()),
                dbias: dbias.as_ref().map(|t| t.slice_mut()),
            };
            (inp, out)
        };
        let pool = OrtPool::new(ctx);
        layer_norm_grad(detected(), inp, cols, out, &pool).map_err(|e| Error::kernel(OP, e))
    }
}
