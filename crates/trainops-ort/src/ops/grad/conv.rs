//! `com.trainops::ConvWeightGrad` and `com.trainops::ConvInputGrad` (since version 1): the
//! gradients of ONNX `Conv` (float32) by the kernels' `grad::conv`.
//!
//! - `ConvWeightGrad(X, dY) -> dW`: `X [N, C, in..]`, `dY [N, M, out..]`,
//!   `dW [M, C/group, kernel..]`.
//! - `ConvInputGrad(dY, W, X_shape) -> dX`: `X_shape` the int64 shape of `X`, `dX` of that
//!   shape.
//!
//! Attributes as `Conv`'s, resolved: `kernel_shape` (required by `ConvWeightGrad`, else
//! `W`'s), `strides` and `dilations` (default 1s), `pads` (begins then ends, default 0s; no
//! `auto_pad`), `group` (default 1). `dY`'s spatial shape must be the one `Conv` gives.
//!
//! Every attribute's arithmetic (padded input, dilated kernel, the output and column
//! matrix sizes) is checked by `ConvDims::new` before anything is allocated, and the
//! inputs are checked against the sizes it implies before the output is: an error names
//! the attribute or the input and what was expected.

use trainops_kernels::grad::conv::{input_grad, weight_grad, ConvDims, ConvError, ConvGeometry};

use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};
use crate::ops::grad::shape_i64;
use crate::ops::io;

/// `ConvWeightGrad` as registered in `com.trainops`.
pub struct ConvWeightGrad;
/// `ConvInputGrad` as registered in `com.trainops`.
pub struct ConvInputGrad;

static WEIGHT_INPUTS: [Formal; 2] = [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Float))];
static INPUT_INPUTS: [Formal; 3] =
    [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Float)), Formal::One(Some(DType::Int64))];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static WEIGHT_SIG: Signature = Signature { name: c"ConvWeightGrad", inputs: &WEIGHT_INPUTS, outputs: &OUTPUTS };
static INPUT_SIG: Signature = Signature { name: c"ConvInputGrad", inputs: &INPUT_INPUTS, outputs: &OUTPUTS };

/// The node's attributes; lists left out are filled in once the rank is known.
#[derive(Debug, Clone)]
struct Attrs {
    op: &'static str,
    kernel: Option<Vec<usize>>,
    strides: Option<Vec<usize>>,
    dilations: Option<Vec<usize>>,
    pads: Option<Vec<usize>>,
    group: usize,
}

fn read_attrs(op: &'static str, info: &KernelInfo<'_>, kernel_required: bool) -> Result<Attrs> {
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
    let group = info.i64_opt("group")?.unwrap_or(1);
    if group < 1 {
        return Err(Error::Attribute { op, name: "group", what: format!("expected a positive value, got {group}") });
    }
    let attrs = Attrs {
        op,
        kernel: list("kernel_shape", 1)?,
        strides: list("strides", 1)?,
        dilations: list("dilations", 1)?,
        pads: list("pads", 0)?,
        group: group as usize,
    };
    if kernel_required && attrs.kernel.is_none() {
        let what = "required (the weight's spatial shape)".to_owned();
        return Err(Error::Attribute { op, name: "kernel_shape", what });
    }
    if let Some(k) = &attrs.kernel {
        attrs.geometry(k.clone())?;
    }
    Ok(attrs)
}

impl Attrs {
    /// The geometry for `kernel`, defaults filled in, checked.
    fn geometry(&self, kernel: Vec<usize>) -> Result<ConvGeometry> {
        let d = kernel.len();
        let geo = ConvGeometry {
            strides: self.strides.clone().unwrap_or_else(|| vec![1; d]),
            dilations: self.dilations.clone().unwrap_or_else(|| vec![1; d]),
            pads: self.pads.clone().unwrap_or_else(|| vec![0; 2 * d]),
            group: self.group,
            kernel,
        };
        geo.check().map_err(|e| conv_error(self.op, e, (0, "X"), &[]))?;
        Ok(geo)
    }
}

/// Input `index`, a float32 tensor of rank at least 3 (`[N, C, spatial..]`), aligned.
fn float_input(ctx: &Context<'_>, op: &'static str, index: usize, name: &str, layout: &str) -> Result<Tensor> {
    let t = io::required(ctx, op, index, name)?;
    if t.dtype != DType::Float || t.shape.len() < 3 {
        let want = format!("a tensor(float) of rank >= 3 ({layout})");
        return Err(Error::input(op, index, name, want, format!("{} with shape {:?}", t.dtype.name(), t.shape)));
    }
    if !t.aligned() {
        return Err(Error::input(op, index, name, "a buffer aligned for its type", "a misaligned one"));
    }
    Ok(t)
}

/// A refusal of the kernels' convolution checks as the op's error: an attribute by name, a
/// shape as input `at` (`x_shape` its shape).
fn conv_error(op: &'static str, e: ConvError, at: (usize, &str), x_shape: &[usize]) -> Error {
    match e {
        ConvError::Attribute { name, what } => Error::Attribute { op, name, what },
        ConvError::Shape(what) => {
            Error::input(op, at.0, at.1, format!("a shape that fits the convolution: {what}"), format!("{x_shape:?}"))
        }
    }
}

/// The dims of a convolution of `geo` on `x_shape` with `out_channels` filters, every size
/// checked; an error names the attribute, or input `index` (`name`), that does not fit.
fn dims(op: &'static str, geo: &ConvGeometry, x_shape: &[usize], m: usize, at: (usize, &str)) -> Result<ConvDims> {
    ConvDims::new(geo, x_shape[0], x_shape[1], m, &x_shape[2..]).map_err(|e| conv_error(op, e, at, x_shape))
}

/// `got` must equal `want`, else an error naming input `index`.
fn same_shape(op: &'static str, index: usize, name: &str, got: &Tensor, want: &[usize], why: &str) -> Result<()> {
    if got.dims() != want {
        return Err(Error::input(op, index, name, format!("shape {want:?} ({why})"), format!("{:?}", got.shape)));
    }
    Ok(())
}

impl OpSpec for ConvWeightGrad {
    fn signature(&self) -> &Signature {
        &WEIGHT_SIG
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attrs = read_attrs(self.op(), info, true)?;
        let geo = attrs.geometry(attrs.kernel.clone().unwrap_or_default())?;
        Ok(Box::new(WeightKernel { geo }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let (Some(k), Some((_, x)), Some((_, dy))) = (ctx.attr_i64s(c"kernel_shape"), ctx.input(0), ctx.input(1))
        else {
            return Ok(());
        };
        let group = ctx.attr_i64(c"group").unwrap_or(1).max(1);
        if k.iter().any(|&d| d < 1) {
            return Ok(()); // the kernel refuses the node when it is created
        }
        let known = |d: i64| (d >= 0).then_some(d);
        let c = x.get(1).copied().and_then(known).map(|c| c / group);
        let dims: Vec<Option<i64>> =
            [dy.get(1).copied().and_then(known), c].into_iter().chain(k.into_iter().map(Some)).collect();
        // Unknown M or C get dimension names of this node's own (`set_output`).
        ctx.set_output(0, DType::Float, Some(&dims))
    }
}

struct WeightKernel {
    geo: ConvGeometry,
}

impl Kernel for WeightKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        const OP: &str = "ConvWeightGrad";
        let x = float_input(ctx, OP, 0, "X", "N, C, spatial..")?;
        let dy = float_input(ctx, OP, 1, "dY", "N, M, spatial..")?;
        let (xs, ys) = (x.dims(), dy.dims());
        if xs.len() != self.geo.kernel.len() + 2 {
            let want = format!("rank {} (kernel_shape {:?})", self.geo.kernel.len() + 2, self.geo.kernel);
            return Err(Error::input(OP, 0, "X", want, format!("shape {:?}", x.shape)));
        }
        let dims = dims(OP, &self.geo, &xs, ys[1], (0, "X"))?;
        same_shape(OP, 1, "dY", &dy, &dims.y_shape(), "the convolution's output on X")?;
        let w_shape = shape_i64(OP, 0, "X", &dims.w_shape())?;
        let out = io::output(ctx, OP, 0, "dW", DType::Float, &w_shape)?;
        // SAFETY: types, lengths and alignment checked; inputs are only read, and the output
        // is a buffer of its own (the runtime never aliases a custom op's output with an input).
        let (xv, dyv, dw) = unsafe { (x.slice::<f32>(), dy.slice::<f32>(), out.slice_mut::<f32>()) };
        let pool = OrtPool::new(ctx);
        weight_grad(&dims, xv, dyv, dw, &pool).map_err(|e| Error::kernel(OP, e))
    }
}

impl OpSpec for ConvInputGrad {
    fn signature(&self) -> &Signature {
        &INPUT_SIG
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(InputKernel { attrs: read_attrs(self.op(), info, false)? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        // dX has dY's rank and batch; the other sizes are X_shape's values, which inference
        // cannot see: unknowns, named for this node alone (`ShapeInfer::set_output`).
        let Some((_, dy)) = ctx.input(0) else { return Ok(()) };
        if dy.len() < 3 {
            return Ok(()); // unknown (or wrong) rank: the kernel says what it expects
        }
        let dims: Vec<Option<i64>> = (0..dy.len()).map(|i| (i == 0 && dy[0] >= 0).then_some(dy[0])).collect();
        ctx.set_output(0, DType::Float, Some(&dims))
    }
}

struct InputKernel {
    attrs: Attrs,
}

impl Kernel for InputKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        const OP: &str = "ConvInputGrad";
        let dy = float_input(ctx, OP, 0, "dY", "N, M, spatial..")?;
        let w = float_input(ctx, OP, 1, "W", "M, C/group, kernel..")?;
        let shape = io::required(ctx, OP, 2, "X_shape")?;
        let rank = dy.shape.len();
        if shape.dtype != DType::Int64 || shape.shape.len() != 1 || shape.numel != rank || !shape.aligned() {
            let want = format!("a 1-d tensor(int64) of {rank} elements (X's shape; dY has rank {rank})");
            return Err(Error::input(
                OP,
                2,
                "X_shape",
                want,
                format!("{} with shape {:?}", shape.dtype.name(), shape.shape),
            ));
        }
        // SAFETY: an aligned int64 tensor (checked), never written.
        let xs = unsafe { shape.slice::<i64>() };
        if xs.iter().any(|&d| d < 0) {
            return Err(Error::input(OP, 2, "X_shape", "non-negative dimensions", format!("{xs:?}")));
        }
        let xs: Vec<usize> = xs.iter().map(|&d| d as usize).collect();
        if w.shape.len() != rank {
            return Err(Error::input(OP, 1, "W", format!("rank {rank} like dY"), format!("shape {:?}", w.shape)));
        }
        let wd = w.dims();
        let kernel = self.attrs.kernel.clone().unwrap_or_else(|| wd[2..].to_vec());
        let geo = self.attrs.geometry(kernel)?;
        if geo.kernel.len() + 2 != rank {
            let want = format!("rank {} (kernel_shape {:?})", geo.kernel.len() + 2, geo.kernel);
            return Err(Error::input(OP, 0, "dY", want, format!("shape {:?}", dy.shape)));
        }
        let dims = dims(OP, &geo, &xs, wd[0], (2, "X_shape"))?;
        same_shape(OP, 1, "W", &w, &dims.w_shape(), "M, C/group, kernel_shape..")?;
        same_shape(OP, 0, "dY", &dy, &dims.y_shape(), "the convolution's output on X_shape")?;
        let x_shape = shape_i64(OP, 2, "X_shape", &xs)?;
        let out = io::output(ctx, OP, 0, "dX", DType::Float, &x_shape)?;
        // SAFETY: types, lengths and alignment checked; inputs are only read, and the output
        // is a buffer of its own.
        let (dyv, wv, dx) = unsafe { (dy.slice::<f32>(), w.slice::<f32>(), out.slice_mut::<f32>()) };
        let pool = OrtPool::new(ctx);
        input_grad(&dims, dyv, wv, dx, &pool).map_err(|e| Error::kernel(OP, e))
    }
}
