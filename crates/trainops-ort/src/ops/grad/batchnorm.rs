//! `com.trainops::BatchNormTrainGrad` (since version 1): `(dY, X, scale; epsilon) -> (dX,
//! dScale, dBias)`, the backward of ONNX BatchNormalization with `training_mode=1` (batch
//! statistics over every axis but 1, recomputed from `X`); each output optional. float32.
//!
//! `com.trainops::BatchNormTrain` (since version 1): `(X, scale, B, input_mean, input_var;
//! epsilon, momentum) -> (Y, running_mean?, running_var?)`, ONNX BatchNormalization with
//! `training_mode=1` itself (the same inputs, outputs and attributes) on a kernel that
//! spreads the channels over the session's threads (onnxruntime's runs on one). float32.

use trainops_kernels::grad::batchnorm::forward::{batch_norm_train, BnOutputs, BnParams};
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

const FORWARD: &str = "BatchNormTrain";

/// The forward op as registered in `com.trainops`.
pub struct BatchNormTrain;

static F_INPUTS: [Formal; 5] = [Formal::One(Some(DType::Float)); 5];
static F_OUTPUTS: [Formal; 3] =
    [Formal::One(Some(DType::Float)), Formal::Optional(Some(DType::Float)), Formal::Optional(Some(DType::Float))];
static F_SIGNATURE: Signature = Signature { name: c"BatchNormTrain", inputs: &F_INPUTS, outputs: &F_OUTPUTS };

impl OpSpec for BatchNormTrain {
    fn signature(&self) -> &Signature {
        &F_SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let epsilon = info.f32_or("epsilon", 1e-5)?;
        if !epsilon.is_finite() || epsilon < 0.0 {
            let what = format!("expected a finite value >= 0, got {epsilon}");
            return Err(Error::Attribute { op: FORWARD, name: "epsilon", what });
        }
        let momentum = info.f32_or("momentum", 0.9)?;
        if !momentum.is_finite() {
            let what = format!("expected a finite value, got {momentum}");
            return Err(Error::Attribute { op: FORWARD, name: "momentum", what });
        }
        Ok(Box::new(BatchNormTrainKernel { epsilon, momentum }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 0)?;
        ctx.output_like_input(1, 1)?;
        ctx.output_like_input(2, 1)
    }
}

struct BatchNormTrainKernel {
    epsilon: f32,
    momentum: f32,
}

impl Kernel for BatchNormTrainKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        const NAMES: [&str; 5] = ["X", "scale", "B", "input_mean", "input_var"];
        let x = float_input(ctx, FORWARD, 0, NAMES[0])?;
        let got = |t: &Tensor| format!("shape {:?}", t.shape);
        let shape = BnShape::of(&x.dims())
            .ok_or_else(|| Error::input(FORWARD, 0, "X", "a tensor of rank >= 2 ([N, C, ...])", got(&x)))?;
        if shape.n == 0 || shape.s == 0 {
            let what = "at least one element per channel (the batch statistics of none are undefined)";
            return Err(Error::input(FORWARD, 0, "X", what, got(&x)));
        }
        let mut per_channel = Vec::with_capacity(4);
        for (k, &name) in NAMES.iter().enumerate().skip(1) {
            let t = float_input(ctx, FORWARD, k, name)?;
            if t.shape != [x.shape[1]] {
                let want = format!("shape [{}] (C, dimension 1 of X)", x.shape[1]);
                return Err(Error::input(FORWARD, k, name, want, got(&t)));
            }
            per_channel.push(t);
        }
        let y = io::output(ctx, FORWARD, 0, "Y", DType::Float, &x.shape)?;
        let stat = &per_channel[0].shape;
        let mean = io::optional_output(ctx, FORWARD, 1, "running_mean", DType::Float, stat)?;
        let var = io::optional_output(ctx, FORWARD, 2, "running_var", DType::Float, stat)?;
        let present: Vec<(&str, &Tensor)> =
            [("Y", Some(&y)), ("running_mean", mean.as_ref()), ("running_var", var.as_ref())]
                .into_iter()
                .filter_map(|(n, t)| t.map(|t| (n, t)))
                .collect();
        let inputs: Vec<(&str, &Tensor)> = NAMES.iter().copied().zip(std::iter::once(&x).chain(&per_channel)).collect();
        // Views of the inputs and outputs coexist below: no output may share bytes with an
        // input or with another output (onnxruntime's own kernel writes the running
        // statistics over inputs 3 and 4; this one never does).
        disjoint(FORWARD, &present, &inputs)?;
        for k in 1..present.len() {
            disjoint(FORWARD, &present[k..=k], &present[..k])?;
        }
        // SAFETY: checked float32 and aligned; the inputs are only read.
        let (x_s, [scale, bias, input_mean, input_var]) =
            unsafe { (x.slice::<f32>(), [0, 1, 2, 3].map(|k| per_channel[k].slice::<f32>())) };
        let params = BnParams { scale, bias, input_mean, input_var, epsilon: self.epsilon, momentum: self.momentum };
        // SAFETY: as above; every output buffer is disjoint from every other view (checked
        // above) and viewed once.
        let out = unsafe {
            BnOutputs {
                y: y.slice_mut::<f32>(),
                running_mean: mean.as_ref().map(|t| t.slice_mut::<f32>()),
                running_var: var.as_ref().map(|t| t.slice_mut::<f32>()),
            }
        };
        let pool = OrtPool::new(ctx);
        batch_norm_train(x_s, params, shape, out, &pool).map_err(|e| Error::kernel(FORWARD, e))
    }
}
