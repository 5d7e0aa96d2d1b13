//! `com.trainops::MixedPrecisionAdam` (since version 1): Adam on `G / loss_scale` when every
//! unscaled gradient of the node is finite, else a skipped step; see `super`.

use half::{bf16, f16};
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::Optimizer;

use crate::error::{Error, Result};
use crate::ffi::device::{CoeffFn, DeviceOp, MixedAdamStep};
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::optim::attrs;
use crate::ops::optim::call::Call;
use crate::ops::optim::layout::Layout;
use crate::ops::optim::run;

/// The op as registered in `com.trainops`.
pub struct MixedPrecisionAdam;

/// Its variadic layout: `loss_scale` after `R, T`, and the `finite` flag first.
pub static LAYOUT: Layout = Layout {
    op: "MixedPrecisionAdam",
    scalars: &["R", "T", "loss_scale"],
    groups: &["X", "G", "V", "H"],
    gradient: 1,
    rewrites: &[0, 2, 3],
    flags: &["finite"],
    weights: &[DType::Float], // mixed precision keeps float32 weights
};
static INPUTS: [Formal; 4] = [
    Formal::One(None),
    Formal::One(Some(DType::Int64)),
    Formal::One(Some(DType::Float)),
    Formal::Variadic { dtype: None, min: 1 },
];
static OUTPUTS: [Formal; 2] = [Formal::One(Some(DType::Bool)), Formal::Variadic { dtype: None, min: 1 }];
static SIGNATURE: Signature = Signature { name: c"MixedPrecisionAdam", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for MixedPrecisionAdam {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let (attrs, copy) = read_node(info)?;
        Ok(Box::new(MixedPrecisionAdamKernel { attrs, copy }))
    }

    fn device_op(&'static self, info: &KernelInfo<'_>) -> Result<Option<DeviceOp>> {
        let (attrs, copy) = read_node(info)?;
        let coeffs: CoeffFn = Box::new(move |r, t| {
            let c = Adam::coeffs::<f32>(&attrs, r, t);
            (vec![c.norm, c.alpha, c.one_minus_alpha, c.beta, c.one_minus_beta, c.epsilon, c.rate, c.keep], None)
        });
        Ok(Some(DeviceOp::MixedAdam(MixedAdamStep { coeffs, copy })))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        LAYOUT.infer(ctx)
    }
}

/// Adam's attributes and `copy_dtype` of a node.
fn read_node(info: &KernelInfo<'_>) -> Result<(AdamAttrs, Option<DType>)> {
    let attrs = attrs::read::<AdamAttrs>(LAYOUT.op, info)?;
    let copy = match info.i64_opt("copy_dtype")?.unwrap_or(0) {
        0 => None,
        10 => Some(DType::Float16),
        16 => Some(DType::BFloat16),
        other => {
            let what = format!("expected 0 (no copies), 10 (float16) or 16 (bfloat16), got {other}");
            return Err(Error::Attribute { op: LAYOUT.op, name: "copy_dtype", what });
        }
    };
    Ok((attrs, copy))
}

struct MixedPrecisionAdamKernel {
    attrs: AdamAttrs,
    copy: Option<DType>,
}

impl Kernel for MixedPrecisionAdamKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = Call::prepare(&LAYOUT, ctx, self.copy)?;
        let scale = call.extra[0];
        let finite = gradients_finite(&mut call, scale);
        if finite {
            let c = Adam::coeffs::<f32>(&self.attrs, call.r, call.t).with_loss_scale(scale);
            run::<Adam, f32, f32, 3>(&mut call, &c)?;
            run::<Adam, f32, f16, 3>(&mut call, &c)?;
            run::<Adam, f32, bf16, 3>(&mut call, &c)?;
        } else {
            call.keep_inputs::<f32, f32, 3>()?;
            call.keep_inputs::<f32, f16, 3>()?;
            call.keep_inputs::<f32, bf16, 3>()?;
        }
        match self.copy {
            Some(DType::Float16) => call.cast_copies::<f32, f16>()?,
            Some(DType::BFloat16) => call.cast_copies::<f32, bf16>()?,
            _ => {}
        }
        call.set_flag(0, finite);
        call.check_all_handled()
    }
}

/// One verdict over every gradient of the node, each divided by `scale` first.
fn gradients_finite(call: &mut Call<'_, '_>, scale: f32) -> bool {
    call.gradients_finite::<f32, f32>(Some(scale))
        && call.gradients_finite::<f32, f16>(Some(scale))
        && call.gradients_finite::<f32, bf16>(Some(scale))
}
