//! `com.trainops::GatherGrad(shape, indices, dY, base?) -> dX` (since version 1): the
//! gradient of ONNX `Gather` on axis 0, float32. `shape` (int64, 1-D, at least one
//! element) is the shape of Gather's data, `indices` (int64, any shape) its indices, `dY`
//! the gradient of its output, of shape `indices.shape + shape[1:]`; `base` (optional, of
//! `shape`) a gradient the rows are added into (a tied embedding's other use). `dX = base`
//! (or zeros), then `dX[indices[k]] += dY[k]` for every index in order: ScatterND with
//! reduction `add`, bit for bit. A negative index counts from the end; one outside
//! `[-shape[0], shape[0])` is an error naming its position, before anything is written.

use trainops_kernels::grad::gather::gather_grad;

use super::{disjoint, float_input, typed_input};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

const OP: &str = "GatherGrad";

/// The op as registered in `com.trainops`.
pub struct GatherGrad;

static INPUTS: [Formal; 4] = [
    Formal::One(Some(DType::Int64)),
    Formal::One(Some(DType::Int64)),
    Formal::One(Some(DType::Float)),
    Formal::Optional(Some(DType::Float)),
];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static SIGNATURE: Signature = Signature { name: c"GatherGrad", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for GatherGrad {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, _info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(GatherGradKernel))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        if ctx.input(3).is_some() {
            return ctx.output_like_input(0, 3);
        }
        // dX is [shape[0]] + dY's dimensions after the indices' (the values of `shape` are
        // unknown at load: the first dimension gets a name of this node's own).
        let (Some((_, idx)), Some((_, dy))) = (ctx.input(1), ctx.input(2)) else { return Ok(()) };
        if dy.len() < idx.len() {
            return Ok(()); // the kernel says what it expects
        }
        let known = |d: i64| (d >= 0).then_some(d);
        let dims: Vec<Option<i64>> = std::iter::once(None).chain(dy[idx.len()..].iter().map(|&d| known(d))).collect();
        ctx.set_output(0, DType::Float, Some(&dims))
    }
}

struct GatherGradKernel;

impl Kernel for GatherGradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let shape_t = typed_input(ctx, OP, 0, "shape", DType::Int64)?;
        let idx_t = typed_input(ctx, OP, 1, "indices", DType::Int64)?;
        let dy_t = float_input(ctx, OP, 2, "dY")?;
        let base_t = match ctx.input(3)? {
            Some(_) => Some(float_input(ctx, OP, 3, "base")?),
            None => None,
        };
        // SAFETY: an aligned int64 tensor, never written.
        let dims = unsafe { shape_t.slice::<i64>() }.to_vec();
        if shape_t.shape.len() != 1 || dims.is_empty() || dims.iter().any(|&d| d < 0) {
            let want = "a 1-D tensor of at least one non-negative dimension (Gather's data shape)";
            return Err(Error::input(OP, 0, "shape", want, format!("{dims:?} of shape {:?}", shape_t.shape)));
        }
        let want_dy: Vec<i64> = idx_t.shape.iter().chain(&dims[1..]).copied().collect();
        if dy_t.shape != want_dy {
            let want = format!("shape {want_dy:?} (indices' shape, then shape[1:])");
            return Err(Error::input(OP, 2, "dY", want, format!("{:?}", dy_t.shape)));
        }
        if let Some(b) = &base_t {
            if b.shape != dims {
                return Err(Error::input(OP, 3, "base", format!("shape {dims:?}"), format!("{:?}", b.shape)));
            }
        }
        let rows = dims[0] as usize;
        let width = trainops_kernels::shape::numel(&dims[1..].iter().map(|&d| d as usize).collect::<Vec<_>>())
            .ok_or_else(|| {
                Error::input(OP, 0, "shape", "dimensions whose product fits in 64 bits", format!("{dims:?}"))
            })?;
        let out = io::output(ctx, OP, 0, "dX", DType::Float, &dims)?;
        let mut inputs = vec![("shape", &shape_t), ("indices", &idx_t), ("dY", &dy_t)];
        if let Some(b) = &base_t {
            inputs.push(("base", b));
        }
        disjoint(OP, &[("dX", &out)], &inputs)?;
        // SAFETY: types, sizes and alignment checked; the output overlaps no input, and the
        // inputs are never written.
        let (idx, dy, base, dx) = unsafe {
            (
                idx_t.slice::<i64>(),
                dy_t.slice::<f32>(),
                base_t.as_ref().map(|b| b.slice::<f32>()),
                out.slice_mut::<f32>(),
            )
        };
        gather_grad(rows, width, idx, dy, base, dx, &OrtPool::new(ctx))
            .map_err(|e| Error::input(OP, 1, "indices", "rows of Gather's data", e.to_string()))
    }
}
