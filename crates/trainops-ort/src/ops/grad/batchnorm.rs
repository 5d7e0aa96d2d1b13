//! `com.trainops::BatchNormTrainGrad` (since version 1): `(dY, X, scale; epsilon) -> (dX,
//! dScale, dBias)`, the backward of ONNX BatchNormalization with `training_mode=1` (batch
//! statistics over every axis but 1, recomputed from `X`); each output optional. float32.

use trainops_kernels::grad::batchnorm::{batch_norm_train_grad, BnGrads, BnShape};

use super::{disjoint, float_input};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};
use crate::ops::io;

const OP: &str = "BatchNormTrainGrad";

/// The op as registered in `com.trainops`.
pub struct BatchNormTrainGrad;

static INPUTS: [Formal; 3] = [Formal::One(Some(DType::Float)); 3];
static OUTPUTS: [Formal; 3] = [Formal::Optional(Some(DType::Float)); 3];
static SIGNATURE: Signature = Signature { name: c"BatchNormTrainGrad", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for BatchNormTrainGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let epsilon = info.f32_or("epsilon", 1e-5)?;
        if !epsilon.is_finite() || epsilon < 0.0 {
            let what = format!("expected a finite value >= 0, got {epsilon}");
            return Err(Error::Attribute { op: OP, name: "epsilon", what });
        }
        Ok(Box::new(BatchNormTrainGradKernel { epsilon }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)?;
        ctx.output_like_input(1, 2)?;
        ctx.output_like_input(2, 2)
    }
}

struct BatchNormTrainGradKernel {
    epsilon: f32,
}

/// The inputs, checked against each other: `X` of rank >= 2, `dY` shaped as `X`, `scale`
/// of shape `[C]`.
fn read_inputs(ctx: &Context<'_>) -> Result<(Tensor, Tensor, Tensor, BnShape)> {
    let dy = float_input(ctx, OP, 0, "dY")?;
    let x = float_input(ctx, OP, 1, "X")?;
    let scale = float_input(ctx, OP, 2, "scale")?;
    let got = |t: &Tensor| format!("shape {:?}", t.shape);
    let shape = BnShape::of(&x.dims())
        .ok_or_else(|| Error::input(OP, 1, "X", "a tensor of rank >= 2 ([N, C, ...])", got(&x)))?;
    if dy.shape != x.shape {
        return Err(Error::input(OP, 0, "dY", format!("the shape of X, {:?}", x.shape), got(&dy)));
    }
    if scale.shape != [x.shape[1]] {
        return Err(Error::input(OP, 2, "scale", format!("shape [{}] (C, dimension 1 of X)", x.shape[1]), got(&scale)));
    }
    Ok((dy, x, scale, shape))
}

impl Kernel for BatchNormTrainGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let (dy, x, scale, shape) = read_inputs(ctx)?;
        let dx = io::optional_output(ctx, OP, 0, "dX", DType::Float, &x.shape)?;
        let dscale = io::optional_output(ctx, OP, 1, "dScale", DType::Float, &scale.shape)?;
        let dbias = io::optional_output(ctx, OP, 2, "dBias", DType::Float, &scale.shape)?;
        let present: Vec<(&str, &Tensor)> = [("dX", &dx), ("dScale", &dscale), ("dBias", &dbias)]
            .into_iter()
            .filter_map(|(n, t)| t.as_ref().map(|t| (n, t)))
            .collect();
        // Views of the inputs and outputs coexist below: no output may share bytes with an
        // input or with another output (the runtime allocates them apart; a caller binding
        // one buffer twice is refused).
        disjoint(OP, &present, &[("dY", &dy), ("X", &x), ("scale", &scale)])?;
        for k in 1..present.len() {
            disjoint(OP, &present[k..=k], &present[..k])?;
        }
        // SAFETY: checked float32 and aligned; the inputs are only read, and every output
        // view is of a buffer disjoint from every other view (checked above).
        let (dy_s, x_s, scale_s) = unsafe { (dy.slice::<f32>(), x.slice::<f32>(), scale.slice::<f32>()) };
        // SAFETY: as above; each output buffer is viewed once.
        let out = unsafe {
            BnGrads {
                dx: dx.as_ref().map(|t| t.slice_mut::<f32>()),
                dscale: dscale.as_ref().map(|t| t.slice_mut::<f32>()),
                dbias: dbias.as_ref().map(|t| t.slice_mut::<f32>()),
            }
        };
        let pool = OrtPool::new(ctx);
        batch_norm_train_grad(dy_s, x_s, scale_s, self.epsilon, shape, out, &pool).map_err(|e| Error::kernel(OP, e))
    }
}
