//! `com.trainops.bench::MemoryCeiling` (since version 1): a benchmark's yardstick, not a
//! training op. Same inputs, outputs, checks, memory plan and threads as
//! `ai.onnx.preview.training::Adam` (R and T are read and ignored), but each element only
//! does `x += g, v += g, h += g`: the memory traffic of an Adam step with no arithmetic to
//! speak of. `python -m trainops bench adam` reports Adam against it in the same run.

use trainops_kernels::adam::AdamTensor;
use trainops_kernels::{ceiling, Element};

use super::optimizer::{Call, Layout, INPUTS, OUTPUTS};
use crate::error::{Error, Result};
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer};

/// The op as registered in `com.trainops.bench`.
pub struct MemoryCeiling;

static LAYOUT: Layout =
    Layout { op: "MemoryCeiling", groups: &["X", "G", "V", "H"], gradient: 1, rewrites: &[0, 2, 3] };

impl OpSpec for MemoryCeiling {
    fn name(&self) -> &'static std::ffi::CStr {
        c"MemoryCeiling"
    }

    fn inputs(&self) -> &'static [Formal] {
        &INPUTS
    }

    fn outputs(&self) -> &'static [Formal] {
        &OUTPUTS
    }

    fn create(&self, _info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(CeilingKernel))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        LAYOUT.infer(ctx)
    }
}

struct CeilingKernel;

impl Kernel for CeilingKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let call = LAYOUT.prepare(ctx)?;
        run::<f32>(&call)?;
        run::<f64>(&call)
    }
}

fn run<T: TensorElem + Element>(call: &Call<'_, '_>) -> Result<()> {
    let (groups, streams, gradients) = call.all_views::<T, 3>()?;
    let mut tensors = Vec::with_capacity(groups.len());
    for ((&i, [x, v, h]), g) in groups.iter().zip(streams).zip(&gradients) {
        let name = LAYOUT.input_name(2 + i, call.n);
        let tensor = AdamTensor::new(x, g, v, h)
            .map_err(|e| Error::input(LAYOUT.op, 2 + i, name, "equal tensor sizes", e.to_string()))?;
        tensors.push(tensor);
    }
    ceiling::touch(tensors, &call.pool);
    Ok(())
}
