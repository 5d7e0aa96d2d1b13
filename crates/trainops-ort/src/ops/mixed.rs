//! Mixed-precision training ops of `com.trainops`, after Keras' `mixed_float16` /
//! `mixed_bfloat16` policies: float32 variables, 16-bit compute, dynamic loss scaling.
//!
//! - `MixedPrecisionAdam`: inputs `R, T, loss_scale, X..., G..., V..., H...` (X/V/H float32,
//!   G float16, bfloat16 or float32); Adam's attributes and `copy_dtype` (0, 10 float16, 16
//!   bfloat16). Outputs `finite`, `X_new..., V_new..., H_new...` and, with a `copy_dtype`,
//!   `X_copy...`. `g = G / loss_scale`; when every `g` of the node is finite, Adam on `g`;
//!   otherwise every output equals its input (the step is skipped).
//! - `DynamicLossScale`: `(scale, good_steps, finite) -> (new_scale, new_good_steps)`.
//! - `AllFinite`: any number of float tensors -> one bool.

use half::{bf16, f16};
use trainops_kernels::adam::{self, AdamAttrs, AdamCoeffs};
use trainops_kernels::loss_scale::LossScaleRule;
use trainops_kernels::{mixed, Element};

use super::adam::{read_attrs, run as run_adam};
use super::common::required;
use super::optimizer::{Call, Layout};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};

/// `com.trainops::MixedPrecisionAdam` (since version 1).
pub struct MixedPrecisionAdam;

static MP_LAYOUT: Layout = Layout {
    op: "MixedPrecisionAdam",
    scalars: &["R", "T", "loss_scale"],
    groups: &["X", "G", "V", "H"],
    gradient: 1,
    rewrites: &[0, 2, 3],
    flags: &["finite"],
    weights: &[DType::Float], // mixed precision keeps float32 weights
};
static MP_INPUTS: [Formal; 4] = [
    Formal::One(None),
    Formal::One(Some(DType::Int64)),
    Formal::One(Some(DType::Float)),
    Formal::Variadic { dtype: None, min: 1 },
];
static MP_OUTPUTS: [Formal; 2] = [Formal::One(Some(DType::Bool)), Formal::Variadic { dtype: None, min: 1 }];

impl OpSpec for MixedPrecisionAdam {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature =
            Signature { name: c"MixedPrecisionAdam", inputs: &MP_INPUTS, outputs: &MP_OUTPUTS };
        &SIGNATURE
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attrs = read_attrs(info)?;
        let copy = match info.i64_opt("copy_dtype")?.unwrap_or(0) {
            0 => None,
            10 => Some(DType::Float16),
            16 => Some(DType::BFloat16),
            other => {
                let what = format!("expected 0 (no copies), 10 (float16) or 16 (bfloat16), got {other}");
                return Err(Error::Attribute { op: MP_LAYOUT.op, name: "copy_dtype", what });
            }
        };
        Ok(Box::new(MixedKernel { attrs, copy }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        MP_LAYOUT.infer(ctx)
    }
}

struct MixedKernel {
    attrs: AdamAttrs,
    copy: Option<DType>,
}

impl Kernel for MixedKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = MP_LAYOUT.prepare(ctx, self.copy)?;
        let scale = call.extra[0];
        let finite = gradients_finite(&mut call, scale);
        if finite {
            let rate = adam::adjusted_rate(call.r, call.t, self.attrs.alpha, self.attrs.beta);
            let c = AdamCoeffs::<f32>::new(&self.attrs, rate).with_loss_scale(scale);
            run_adam::<f32, f32>(&mut call, &c)?;
            run_adam::<f32, f16>(&mut call, &c)?;
            run_adam::<f32, bf16>(&mut call, &c)?;
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

/// The single element of a one-element input of type `T`.
fn one<T: TensorElem>(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<(T, Tensor)> {
    let t = required(ctx, op, index, name)?;
    if !t.aligned() {
        return Err(Error::input(op, index, name, "a buffer aligned for its type", "a misaligned one"));
    }
    if t.dtype != T::DTYPE || t.numel != 1 {
        let want = format!("a {} with exactly one element", T::DTYPE.name());
        return Err(Error::input(op, index, name, want, format!("{} with shape {:?}", t.dtype.name(), t.shape)));
    }
    // SAFETY: one element of the checked type, aligned; no output view exists yet.
    let v = unsafe { t.slice::<T>() }[0];
    Ok((v, t))
}

/// `com.trainops::DynamicLossScale` (since version 1).
pub struct DynamicLossScale;

static LS_INPUTS: [Formal; 3] =
    [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Int64)), Formal::One(Some(DType::Bool))];
static LS_OUTPUTS: [Formal; 2] = [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Int64))];

impl OpSpec for DynamicLossScale {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = Signature { name: c"DynamicLossScale", inputs: &LS_INPUTS, outputs: &LS_OUTPUTS };
        &SIGNATURE
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let d = LossScaleRule::default();
        let rule = LossScaleRule {
            growth_interval: info.i64_opt("growth_interval")?.unwrap_or(d.growth_interval),
            growth_factor: info.f32_or("growth_factor", d.growth_factor)?,
            backoff_factor: info.f32_or("backoff_factor", d.backoff_factor)?,
            min_scale: info.f32_or("min_scale", d.min_scale)?,
        };
        let op = "DynamicLossScale";
        if rule.growth_interval < 1 {
            let what = format!("expected a positive interval, got {}", rule.growth_interval);
            return Err(Error::Attribute { op, name: "growth_interval", what });
        }
        for (name, v) in [
            ("growth_factor", rule.growth_factor),
            ("backoff_factor", rule.backoff_factor),
            ("min_scale", rule.min_scale),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(Error::Attribute { op, name, what: format!("expected a finite value >= 0, got {v}") });
            }
        }
        Ok(Box::new(LossScaleKernel { rule }))
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

struct LossScaleKernel {
    rule: LossScaleRule,
}

impl Kernel for LossScaleKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = "DynamicLossScale";
        let (scale, scale_t) = one::<f32>(ctx, op, 0, "scale")?;
        let (good, good_t) = one::<i64>(ctx, op, 1, "good_steps")?;
        let finite_t = required(ctx, op, 2, "finite")?;
        let finite = finite_t.read_bool().ok_or_else(|| {
            let got = format!("{} with shape {:?}", finite_t.dtype.name(), finite_t.shape);
            Error::input(op, 2, "finite", "a tensor(bool) with exactly one element", got)
        })?;
        let (new_scale, new_good) = self.rule.next(scale, good, finite);
        let out_scale = ctx.output(0, &scale_t.shape)?;
        let out_good = ctx.output(1, &good_t.shape)?;
        for (index, t, dtype) in [(0, &out_scale, DType::Float), (1, &out_good, DType::Int64)] {
            if t.dtype != dtype || t.numel != 1 || !t.aligned() {
                let name = ["new_scale", "new_good_steps"][index].to_owned();
                let got = format!("a {} buffer of {} elements", t.dtype.name(), t.numel);
                return Err(Error::Output { op, index, name, expected: format!("one aligned {}", dtype.name()), got });
            }
        }
        // SAFETY: single-element outputs of the checked types; the inputs were read into
        // locals already, so an output bound over an input's buffer is harmless.
        unsafe {
            out_scale.slice_mut::<f32>()[0] = new_scale;
            out_good.slice_mut::<i64>()[0] = new_good;
        }
        Ok(())
    }
}

/// `com.trainops::AllFinite` (since version 1).
pub struct AllFinite;

static AF_INPUTS: [Formal; 1] = [Formal::Variadic { dtype: None, min: 1 }];
static AF_OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Bool))];

impl OpSpec for AllFinite {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = Signature { name: c"AllFinite", inputs: &AF_INPUTS, outputs: &AF_OUTPUTS };
        &SIGNATURE
    }

    fn create(&self, _info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(AllFiniteKernel))
    }
}

struct AllFiniteKernel;

/// True when every tensor of type `T` among `inputs` is finite.
fn finite_of<T: TensorElem + Element>(inputs: &[Tensor], pool: &OrtPool<'_, '_>) -> bool {
    // SAFETY: types checked by the filter; inputs are never written, and the output (a
    // single bool) is written only after this returns.
    let slices: Vec<&[T]> = inputs.iter().filter(|t| t.dtype == T::DTYPE).map(|t| unsafe { t.slice::<T>() }).collect();
    slices.is_empty() || mixed::all_finite(&slices, None, pool)
}

impl Kernel for AllFiniteKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = "AllFinite";
        let count = ctx.input_count()?;
        let inputs = (0..count).map(|k| required(ctx, op, k, &format!("X_{}", k + 1))).collect::<Result<Vec<_>>>()?;
        for (k, t) in inputs.iter().enumerate() {
            let name = format!("X_{}", k + 1);
            if !matches!(t.dtype, DType::Float | DType::Double | DType::Float16 | DType::BFloat16) {
                let want = "tensor(float), tensor(double), tensor(float16) or tensor(bfloat16)";
                return Err(Error::input(op, k, name, want, t.dtype.name()));
            }
            if !t.aligned() {
                return Err(Error::input(op, k, name, "a buffer aligned for its type", "a misaligned one"));
            }
        }
        let finite = {
            let pool = OrtPool::new(ctx);
            finite_of::<f32>(&inputs, &pool)
                && finite_of::<f64>(&inputs, &pool)
                && finite_of::<f16>(&inputs, &pool)
                && finite_of::<bf16>(&inputs, &pool)
        };
        let out = ctx.output(0, &[])?;
        if out.dtype != DType::Bool || out.numel != 1 {
            let got = format!("a {} buffer of {} elements", out.dtype.name(), out.numel);
            let expected = "one tensor(bool)".to_owned();
            return Err(Error::Output { op, index: 0, name: "finite".into(), expected, got });
        }
        // SAFETY: one bool, checked; every input was read already.
        unsafe { out.slice_mut::<bool>()[0] = finite };
        Ok(())
    }
}
