//! `com.trainops::DepthwiseConv` and `com.trainops::DepthwiseConvGrad` (since version 1):
//! ONNX `Conv` with `group` equal to the input channels (2-d, NCHW, float32) and its
//! gradients, by the kernels' `grad::depthwise` (direct loops over the width).
//!
//! - `DepthwiseConv(X, W, B?) -> Y`: `X [N, C, H, W]`, `W [C*mult, 1, kh, kw]`, `B [C*mult]`.
//! - `DepthwiseConvGrad(dY, X, W) -> (dX?, dW?)`: each output optional.
//!
//! Attributes as `Conv`'s, resolved: `kernel_shape` (default `W`'s), `strides` and
//! `dilations` (default 1s), `pads` (begins then ends, default 0s; no `auto_pad`), `group`
//! (required: the input channels). Every size the attributes imply is checked by
//! `DepthwiseDims::new` before anything is allocated; an error names the attribute or the
//! input and what was expected.

use trainops_kernels::grad::conv::{ConvError, ConvGeometry};
use trainops_kernels::grad::depthwise::{forward, input_grad, weight_grad, DepthwiseDims};

use super::{disjoint, shape_i64};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};
use crate::ops::io;

/// `DepthwiseConv` as registered in `com.trainops`.
pub struct DepthwiseConv;
/// `DepthwiseConvGrad` as registered in `com.trainops`.
pub struct DepthwiseConvGrad;

static FORWARD_INPUTS: [Formal; 3] =
    [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Float)), Formal::Optional(Some(DType::Float))];
static FORWARD_OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static GRAD_INPUTS: [Formal; 3] = [Formal::One(Some(DType::Float)); 3];
static GRAD_OUTPUTS: [Formal; 2] = [Formal::Optional(Some(DType::Float)); 2];
static FORWARD_SIG: Signature =
    Signature { name: c"DepthwiseConv", inputs: &FORWARD_INPUTS, outputs: &FORWARD_OUTPUTS };
static GRAD_SIG: Signature = Signature { name: c"DepthwiseConvGrad", inputs: &GRAD_INPUTS, outputs: &GRAD_OUTPUTS };

/// The node's attributes; lists left out are the defaults for a 2-d kernel.
#[derive(Debug, Clone)]
struct Attrs {
    op: &'static str,
    kernel: Option<Vec<usize>>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    pads: Vec<usize>,
    group: usize,
}

fn read_attrs(op: &'static str, info: &KernelInfo<'_>) -> Result<Attrs> {
    let list = |name: &'static str, min: i64| -> Result<Option<Vec<usize>>> {
        let Some(v) = info.i64s_opt(name)? else { return Ok(None) };
        if let Some(bad) = v.iter().find(|&&e| e < min) {
            let what = format!("expected values >= {min}, got {bad} in {v:?}");
            return Err(Error::Attribute { op, name, what });
        }
        Ok(Some(v.into_iter().map(|e| e as usize).collect()))
    };
    if info.string_opt("auto_pad").ok().flatten().is_some_and(|s| s != "NOTSET") {
        let what = "auto_pad is not supported: give explicit pads".to_owned();
        return Err(Error::Attribute { op, name: "auto_pad", what });
    }
    let group = info.i64_opt("group")?.ok_or_else(|| Error::Attribute {
        op,
        name: "group",
        what: "required (the input channels: one filter group per channel)".to_owned(),
    })?;
    if group < 1 {
        return Err(Error::Attribute { op, name: "group", what: format!("expected a positive value, got {group}") });
    }
    let attrs = Attrs {
        op,
        kernel: list("kernel_shape", 1)?,
        strides: list("strides", 1)?.unwrap_or_else(|| vec![1, 1]),
        dilations: list("dilations", 1)?.unwrap_or_else(|| vec![1, 1]),
        pads: list("pads", 0)?.unwrap_or_else(|| vec![0; 4]),
        group: group as usize,
    };
    attrs.geometry(attrs.kernel.clone().unwrap_or_else(|| vec![1, 1]))?;
    Ok(attrs)
}

impl Attrs {
    /// The geometry for `kernel`, checked (2-d, every list of its length, positive values).
    fn geometry(&self, kernel: Vec<usize>) -> Result<ConvGeometry> {
        let geo = ConvGeometry {
            strides: self.strides.clone(),
            dilations: self.dilations.clone(),
            pads: self.pads.clone(),
            group: self.group,
            kernel,
        };
        geo.check().map_err(|e| conv_error(self.op, e, (0, "X"), &[]))?;
        if geo.kernel.len() != 2 {
            let what = format!("must have 2 values (a 2-d depthwise convolution), got {:?}", geo.kernel);
            return Err(Error::Attribute { op: self.op, name: "kernel_shape", what });
        }
        Ok(geo)
    }

    /// The dims of the convolution of `x` (input `x_at`) with `w` (input `w_at`), each
    /// shape checked against the attributes.
    fn dims(&self, x: &Tensor, x_at: usize, w: &Tensor, w_at: usize) -> Result<DepthwiseDims> {
        let op = self.op;
        let (xs, ws) = (x.dims(), w.dims());
        if xs.len() != 4 {
            let want = "a tensor(float) of rank 4 (N, C, H, W)";
            return Err(Error::input(op, x_at, "X", want, format!("shape {:?}", x.shape)));
        }
        if ws.len() != 4 || ws[1] != 1 {
            let want = "a tensor(float) of shape [C * mult, 1, kh, kw]";
            return Err(Error::input(op, w_at, "W", want, format!("shape {:?}", w.shape)));
        }
        let geo = self.geometry(self.kernel.clone().unwrap_or_else(|| ws[2..].to_vec()))?;
        let d =
            DepthwiseDims::new(&geo, xs[0], xs[1], ws[0], &xs[2..]).map_err(|e| conv_error(op, e, (x_at, "X"), &xs))?;
        if ws != d.w_shape() {
            let want = format!("shape {:?} (C * mult, 1, kernel_shape)", d.w_shape());
            return Err(Error::input(op, w_at, "W", want, format!("{:?}", w.shape)));
        }
        Ok(d)
    }
}

/// A refusal of the kernels' checks as the op's error: an attribute by name, a shape as
/// input `at` (`shape` its shape).
fn conv_error(op: &'static str, e: ConvError, at: (usize, &str), shape: &[usize]) -> Error {
    match e {
        ConvError::Attribute { name, what } => Error::Attribute { op, name, what },
        ConvError::Shape(what) => {
            Error::input(op, at.0, at.1, format!("a shape that fits the convolution: {what}"), format!("{shape:?}"))
        }
    }
}

/// Input `index`: present, float32, aligned.
fn input(ctx: &Context<'_>, op: &'static str, index: usize, name: &str) -> Result<Tensor> {
    super::float_input(ctx, op, index, name)
}

/// The inferred `[N, M, oh, ow]` where the attributes and `X`'s spatial sizes are known.
fn infer_output(ctx: &ShapeInfer<'_>) -> Option<Vec<Option<i64>>> {
    let (_, x) = ctx.input(0)?;
    let (_, w) = ctx.input(1)?;
    if x.len() != 4 || w.len() != 4 {
        return None;
    }
    let known = |d: i64| (d >= 0).then_some(d);
    let kernel = ctx.attr_i64s(c"kernel_shape").unwrap_or_else(|| w[2..].to_vec());
    let strides = ctx.attr_i64s(c"strides").unwrap_or_else(|| vec![1, 1]);
    let dil = ctx.attr_i64s(c"dilations").unwrap_or_else(|| vec![1, 1]);
    let pads = ctx.attr_i64s(c"pads").unwrap_or_else(|| vec![0; 4]);
    if kernel.len() != 2 || strides.len() != 2 || dil.len() != 2 || pads.len() != 4 {
        return None; // the kernel refuses the node when it is created
    }
    let spatial = |a: usize| -> Option<i64> {
        let (i, k, s, d) = (known(x[2 + a])?, known(kernel[a])?, strides[a], dil[a]);
        let span =
            i.checked_add(pads[a])?.checked_add(pads[a + 2])?.checked_sub(k.checked_sub(1)?.checked_mul(d)? + 1)?;
        (s >= 1 && span >= 0 && pads[a] >= 0 && pads[a + 2] >= 0).then(|| span / s + 1)
    };
    Some(vec![known(x[0]), known(w[0]), spatial(0), spatial(1)])
}

impl OpSpec for DepthwiseConv {
    fn signature(&self) -> &Signature {
        &FORWARD_SIG
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(ForwardKernel { attrs: read_attrs(self.op(), info)? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let dims = infer_output(ctx);
        ctx.set_output(0, DType::Float, dims.as_deref())
    }
}

struct ForwardKernel {
    attrs: Attrs,
}

impl Kernel for ForwardKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        const OP: &str = "DepthwiseConv";
        let x = input(ctx, OP, 0, "X")?;
        let w = input(ctx, OP, 1, "W")?;
        let b = if ctx.input_count()? > 2 { ctx.input(2)? } else { None };
        let d = self.attrs.dims(&x, 0, &w, 1)?;
        if let Some(b) = &b {
            if b.dtype != DType::Float || b.dims() != [d.out_channels()] || !b.aligned() {
                let want = format!("an aligned tensor(float) of shape [{}] (W's dimension 0)", d.out_channels());
                return Err(Error::input(OP, 2, "B", want, format!("{} with shape {:?}", b.dtype.name(), b.shape)));
            }
        }
        let y_shape = shape_i64(OP, 0, "X", &d.y_shape())?;
        let out = io::output(ctx, OP, 0, "Y", DType::Float, &y_shape)?;
        let mut inputs = vec![("X", &x), ("W", &w)];
        if let Some(b) = &b {
            inputs.push(("B", b));
        }
        disjoint(OP, &[("Y", &out)], &inputs)?;
        // SAFETY: float32, aligned and of the checked lengths; the inputs are only read,
        // and the output shares no byte with them (checked above).
        let (xv, wv, bv, y) = unsafe {
            (x.slice::<f32>(), w.slice::<f32>(), b.as_ref().map(|b| b.slice::<f32>()), out.slice_mut::<f32>())
        };
        let pool = OrtPool::new(ctx);
        forward(&d, xv, wv, bv, y, &pool).map_err(|e| Error::kernel(OP, e))
    }
}

impl OpSpec for DepthwiseConvGrad {
    fn signature(&self) -> &Signature {
        &GRAD_SIG
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(GradKernel { attrs: read_attrs(self.op(), info)? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)?;
        ctx.output_like_input(1, 2)
    }
}

struct GradKernel {
    attrs: Attrs,
}

impl Kernel for GradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        const OP: &str = "DepthwiseConvGrad";
        let dy = input(ctx, OP, 0, "dY")?;
        let x = input(ctx, OP, 1, "X")?;
        let w = input(ctx, OP, 2, "W")?;
        let d = self.attrs.dims(&x, 1, &w, 2)?;
        if dy.dims() != d.y_shape() {
            let want = format!("shape {:?} (the convolution's output on X)", d.y_shape());
            return Err(Error::input(OP, 0, "dY", want, format!("{:?}", dy.shape)));
        }
        let dx = io::optional_output(ctx, OP, 0, "dX", DType::Float, &x.shape)?;
        let dw = io::optional_output(ctx, OP, 1, "dW", DType::Float, &w.shape)?;
        let present: Vec<(&str, &Tensor)> =
            [("dX", &dx), ("dW", &dw)].into_iter().filter_map(|(n, t)| t.as_ref().map(|t| (n, t))).collect();
        disjoint(OP, &present, &[("dY", &dy), ("X", &x), ("W", &w)])?;
        if present.len() == 2 {
            disjoint(OP, &present[1..], &present[..1])?;
        }
        // SAFETY: float32, aligned, of the checked lengths; the inputs are only read, and
        // each output is viewed once, sharing no byte with any other view (checked above).
        let (dyv, xv, wv) = unsafe { (dy.slice::<f32>(), x.slice::<f32>(), w.slice::<f32>()) };
        let pool = OrtPool::new(ctx);
        if let Some(dx) = &dx {
            // SAFETY: as above.
            let dxv = unsafe { dx.slice_mut::<f32>() };
            input_grad(&d, dyv, wv, dxv, &pool).map_err(|e| Error::kernel(OP, e))?;
        }
        if let Some(dw) = &dw {
            // SAFETY: as above.
            let dwv = unsafe { dw.slice_mut::<f32>() };
            weight_grad(&d, xv, dyv, dwv, &pool).map_err(|e| Error::kernel(OP, e))?;
        }
        Ok(())
    }
}
