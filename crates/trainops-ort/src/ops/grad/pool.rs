//! `com.trainops::MaxPoolGrad(dY, Indices, shape) -> dX` (since version 1): MaxPool's
//! gradient, float32. `dY` and `Indices` (int64, one shape `[N, C, ...]`) are the gradient of
//! MaxPool's output and its `Indices` output (`storage_order` 0); `shape` (int64, 1-D) is
//! the shape of MaxPool's input `X`, of the same rank, with the same `N` and `C`.
//! `dX = 0; dX.flat[Indices[i]] += dY[i]` (overlapping windows add).

use trainops_kernels::grad::pool::max_pool_grad;

use super::{float_input, no_overlap, typed_input};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, Signature};
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

    // No `infer`: the output's sizes are a tensor's values, unknown at load, and unknown
    // dimensions get names per op, not per node (ONNX Runtime would then share the buffers
    // of two nodes' outputs); an info without dimensions would say "scalar". The type
    // comes from the signature, the shape stays unknown.
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
        let planes = usize::try_from(dims[0] * dims[1]).unwrap_or(usize::MAX);
        let out = io::output(ctx, OP, 0, "dX", DType::Float, &dims)?;
        no_overlap(OP, &out, &[("dY", &gy_t), ("Indices", &idx_t), ("shape", &shape_t)])?;
        // SAFETY: types, sizes and alignment checked; the output overlaps no input, and the
        // inputs are never written.
        let (gy, idx, gx) = unsafe { (gy_t.slice::<f32>(), idx_t.slice::<i64>(), out.slice_mut::<f32>()) };
        max_pool_grad(gy, idx, planes, gx, &OrtPool::new(ctx)).map_err(|e| {
            Error::input(OP, 1, "Indices", "MaxPool's Indices (storage_order 0) for an input of `shape`", e.to_string())
        })
    }
}
