//! `com.trainops::MaxPoolGrad(dY, Indices, shape) -> dX` (since version 1): MaxPool's
//! gradient, float32. `dY` and `Indices` (int64, one shape `[N, C, ...]`) are the gradient of
//! MaxPool's output and its `Indices` output (`storage_order` 0); `shape` (int64, 1-D) is
//! the shape of MaxPool's input `X`, of the same rank, with the same `N` and `C`.
//! `dX = 0; dX.flat[Indices[i]] += dY[i]` (overlapping windows add).

use trainops_kernels::grad::pool::{check_pooled, max_pool_grad, max_pool_grad_from_input, PoolGradError, Window};

use super::{float_input, no_overlap, typed_input};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

const OP: &str = "MaxPoolGrad";

/// The op as registered in `com.trainops`.
pub struct MaxPoolGrad;

static INPUTS: [Formal; 3] =
    [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Int64)), Formal::One(Some(DType::Int64))];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static SIGNATURE: Signature = Signature { name: c"MaxPoolGrad", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for MaxPoolGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, _info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(MaxPoolGradKernel))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        // dX has dY's rank, N and C; its spatial sizes are the `shape` input's values,
        // unknown at load: dimension names of this node's own (`ShapeInfer::set_output`), so
        // that two nodes' different sizes are never taken for one.
        let Some((_, dy)) = ctx.input(0) else { return Ok(()) };
        if dy.len() < 3 {
            return Ok(()); // unknown (or wrong) rank: the kernel says what it expects
        }
        let dims: Vec<Option<i64>> = (0..dy.len()).map(|i| (i < 2 && dy[i] >= 0).then_some(dy[i])).collect();
        ctx.set_output(0, DType::Float, Some(&dims))
    }
}

struct MaxPoolGradKernel;

impl Kernel for MaxPoolGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let gy_t = float_input(ctx, OP, 0, "dY")?;
        let idx_t = typed_input(ctx, OP, 1, "Indices", DType::Int64)?;
        let shape_t = typed_input(ctx, OP, 2, "shape", DType::Int64)?;
        if gy_t.shape.len() < 3 {
            let got = format!("shape {:?}", gy_t.shape);
            return Err(Error::input(OP, 0, "dY", "rank >= 3 ([N, C, spatial...])", got));
        }
        if idx_t.shape != gy_t.shape {
            let want = format!("the shape of dY, {:?}", gy_t.shape);
            return Err(Error::input(OP, 1, "Indices", want, format!("shape {:?}", idx_t.shape)));
        }
        // SAFETY: an aligned int64 tensor, never written.
        let dims = unsafe { shape_t.slice::<i64>() }.to_vec();
        let ok = shape_t.shape.len() == 1
            && dims.len() == gy_t.shape.len()
            && dims.iter().all(|&d| d >= 0)
            && dims[..2] == gy_t.shape[..2];
        if !ok {
            let want = format!(
                "a 1-D shape of rank {} with N, C = {:?} (MaxPool's input shape)",
                gy_t.shape.len(),
                &gy_t.shape[..2]
            );
            return Err(Error::input(OP, 2, "shape", want, format!("{dims:?}")));
        }
        // N * C may overflow only for an empty dY (a real one has N * C * ... elements).
        let planes = gy_t.dims()[0].checked_mul(gy_t.dims()[1]);
        let out = io::output(ctx, OP, 0, "dX", DType::Float, &dims)?;
        no_overlap(OP, &out, &[("dY", &gy_t), ("Indices", &idx_t), ("shape", &shape_t)])?;
        let planes = match planes {
            Some(p) => p,
            None if gy_t.numel == 0 && out.numel == 0 => return Ok(()),
            None => {
                let want = "an N * C (dimensions 0 and 1) that fits in 64 bits";
                return Err(Error::input(OP, 2, "shape", want, format!("{dims:?}")));
            }
        };
        // SAFETY: types, sizes and alignment checked; the output overlaps no input, and the
        // inputs are never written.
        let (gy, idx, gx) = unsafe { (gy_t.slice::<f32>(), idx_t.slice::<i64>(), out.slice_mut::<f32>()) };
        max_pool_grad(gy, idx, planes, gx, &OrtPool::new(ctx)).map_err(|e| {
            Error::input(OP, 1, "Indices", "MaxPool's Indices (storage_order 0) for an input of `shape`", e.to_string())
        })
    }
}

const OP_X: &str = "MaxPoolGradFromInput";

/// `com.trainops::MaxPoolGradFromInput(dY, X) -> dX` (since version 1): MaxPool's gradient
/// without `Indices`: each window's maximum is found again in `X`, as ONNX Runtime's
/// MaxPool finds its `Indices` (the first of equal maxima), so the forward MaxPool can run
/// without that output (its fast path). Attributes as MaxPool's: `kernel_shape` (required),
/// `strides`, `dilations` (default 1s), `pads` (explicit, default 0s; `auto_pad` is resolved
/// by the rule), `ceil_mode` (optional). `dY` is `[N, C, out...]`, `X` `[N, C, in...]` with 1 to
/// 3 spatial dims; `dY`'s spatial sizes must be MaxPool's output sizes over `X` (with
/// `ceil_mode` 0 or 1 when the attribute is absent), checked before `dX` is allocated.
pub struct MaxPoolGradFromInput;

/// A window attribute the kernels refuse, as the op's attribute error.
fn pool_error(e: PoolGradError) -> Error {
    match e {
        PoolGradError::Window { name, what } => Error::Attribute { op: OP_X, name, what },
        other => Error::Kernel { op: OP_X, message: other.to_string() },
    }
}

static INPUTS_X: [Formal; 2] = [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Float))];
static SIGNATURE_X: Signature = Signature { name: c"MaxPoolGradFromInput", inputs: &INPUTS_X, outputs: &OUTPUTS };

impl OpSpec for MaxPoolGradFromInput {
    fn signature(&self) -> &Signature {
        &SIGNATURE_X
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attr = |name: &'static str, what: String| Error::Attribute { op: OP_X, name, what };
        let kernel = info.i64s_opt("kernel_shape")?.ok_or_else(|| attr("kernel_shape", "is required".into()))?;
        let n = kernel.len();
        if !(1..=3).contains(&n) {
            return Err(attr("kernel_shape", format!("expected 1 to 3 sizes, got {kernel:?}")));
        }
        let list = |name: &'static str, len: usize, default: i64, min: i64| -> Result<Vec<usize>> {
            let v = info.i64s_opt(name)?.unwrap_or_else(|| vec![default; len]);
            if v.len() != len || v.iter().any(|&e| e < min) {
                return Err(attr(name, format!("expected {len} values >= {min}, got {v:?}")));
            }
            Ok(v.into_iter().map(|e| e as usize).collect())
        };
        let pads = list("pads", 2 * n, 0, 0)?;
        let window = Window {
            kernel: list("kernel_shape", n, 1, 1)?,
            strides: list("strides", n, 1, 1)?,
            dilations: list("dilations", n, 1, 1)?,
            pad_begin: pads[..n].to_vec(),
        };
        window.check().map_err(pool_error)?;
        let ceil_mode = match info.i64_opt("ceil_mode")? {
            None => None,
            Some(0) => Some(false),
            Some(1) => Some(true),
            Some(v) => return Err(attr("ceil_mode", format!("expected 0 or 1, got {v}"))),
        };
        Ok(Box::new(FromInputKernel { window, pad_end: pads[n..].to_vec(), ceil_mode }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)
    }
}

struct FromInputKernel {
    window: Window,
    pad_end: Vec<usize>,
    ceil_mode: Option<bool>,
}

impl Kernel for FromInputKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let gy_t = float_input(ctx, OP_X, 0, "dY")?;
        let x_t = float_input(ctx, OP_X, 1, "X")?;
        let rank = 2 + self.window.kernel.len();
        if gy_t.shape.len() != rank {
            let want = format!("rank {rank} (N, C and one size per kernel_shape entry)");
            return Err(Error::input(OP_X, 0, "dY", want, format!("shape {:?}", gy_t.shape)));
        }
        if x_t.shape.len() != rank || x_t.shape[..2] != gy_t.shape[..2] {
            let want = format!("rank {rank} with N, C = {:?} (those of dY)", &gy_t.shape[..2]);
            return Err(Error::input(OP_X, 1, "X", want, format!("shape {:?}", x_t.shape)));
        }
        let (gy_d, x_d) = (gy_t.dims(), x_t.dims());
        // dY must be MaxPool's output over X: its windows' count, every size checked.
        check_pooled(&self.window, &self.pad_end, &x_d[2..], &gy_d[2..], self.ceil_mode).map_err(|e| match e {
            PoolGradError::Shape(what) => Error::input(OP_X, 0, "dY", what, format!("shape {:?}", gy_t.shape)),
            other => pool_error(other),
        })?;
        // N * C overflows only for an empty X (a real one has N * C * ... elements).
        let planes = x_d[0].checked_mul(x_d[1]);
        let out = io::output(ctx, OP_X, 0, "dX", DType::Float, &x_t.shape)?;
        no_overlap(OP_X, &out, &[("dY", &gy_t), ("X", &x_t)])?;
        // SAFETY: types, sizes and alignment checked; the output overlaps no input, and the
        // inputs are never written.
        let (gy, x, gx) = unsafe { (gy_t.slice::<f32>(), x_t.slice::<f32>(), out.slice_mut::<f32>()) };
        let Some(planes) = planes else { return Ok(()) };
        max_pool_grad_from_input(gy, x, planes, &x_d[2..], &gy_d[2..], &self.window, gx, &OrtPool::new(ctx))
            .map_err(|e| Error::input(OP_X, 0, "dY", "sizes consistent with X", e.to_string()))
    }
}
