//! `com.trainops::DynamicLossScale` (since version 1): `(scale, good_steps, finite) ->
//! (new_scale, new_good_steps)` by the kernels' `LossScaleRule`.

use trainops_kernels::loss_scale::LossScaleRule;

use crate::error::{Error, Result};
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

const OP: &str = "DynamicLossScale";

/// The op as registered in `com.trainops`.
pub struct DynamicLossScale;

static INPUTS: [Formal; 3] =
    [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Int64)), Formal::One(Some(DType::Bool))];
static OUTPUTS: [Formal; 2] = [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Int64))];
static SIGNATURE: Signature = Signature { name: c"DynamicLossScale", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for DynamicLossScale {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(DynamicLossScaleKernel { rule: read_rule(info)? }))
    }

    fn device_op(&'static self, info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceOp>> {
        Ok(Some(crate::ffi::device::DeviceOp::LossScale(read_rule(info)?)))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        for k in 0..2 {
            if ctx.input(k).is_some_and(|(_, shape)| !shape.is_empty()) {
                ctx.output_like_input(k, k)?;
            }
        }
        Ok(())
    }
}

/// The node's rule from its attributes, checked.
fn read_rule(info: &KernelInfo<'_>) -> Result<LossScaleRule> {
    let d = LossScaleRule::default();
    let rule = LossScaleRule {
        growth_interval: info.i64_opt("growth_interval")?.unwrap_or(d.growth_interval),
        growth_factor: info.f32_or("growth_factor", d.growth_factor)?,
        backoff_factor: info.f32_or("backoff_factor", d.backoff_factor)?,
        min_scale: info.f32_or("min_scale", d.min_scale)?,
    };
    if rule.growth_interval < 1 {
        let what = format!("expected a positive interval, got {}", rule.growth_interval);
        return Err(Error::Attribute { op: OP, name: "growth_interval", what });
    }
    for (name, v) in
        [("growth_factor", rule.growth_factor), ("backoff_factor", rule.backoff_factor), ("min_scale", rule.min_scale)]
    {
        if !v.is_finite() || v < 0.0 {
            return Err(Error::Attribute { op: OP, name, what: format!("expected a finite value >= 0, got {v}") });
        }
    }
    Ok(rule)
}

struct DynamicLossScaleKernel {
    rule: LossScaleRule,
}

impl Kernel for DynamicLossScaleKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let (scale, scale_t) = io::scalar::<f32>(ctx, OP, 0, "scale")?;
        let (good, good_t) = io::scalar::<i64>(ctx, OP, 1, "good_steps")?;
        let finite = io::exact(ctx, OP, 2, "finite", &[DType::Bool], 1, "")?.read_bool().unwrap_or(false);
        let (new_scale, new_good) = self.rule.next(scale, good, finite);
        let out_scale = io::output(ctx, OP, 0, "new_scale", DType::Float, &scale_t.shape)?;
        let out_good = io::output(ctx, OP, 1, "new_good_steps", DType::Int64, &good_t.shape)?;
        // SAFETY: single-element outputs of the checked types; the inputs were read into
        // locals already, so an output bound over an input's buffer is harmless.
        unsafe {
            out_scale.slice_mut::<f32>()[0] = new_scale;
            out_good.slice_mut::<i64>()[0] = new_good;
        }
        Ok(())
    }
}
