//! `com.trainops.bench::MemoryCeiling` (since version 1): a benchmark's yardstick, not a
//! training op. Same inputs, outputs, checks, memory plan and threads as
//! `ai.onnx.preview.training::Adam` (R and T are read and ignored), but each element only
//! does `x += g, v += g, h += g`: the memory traffic of an Adam step with no arithmetic to
//! speak of. `python -m trainops bench adam` reports Adam against it in the same run.

use trainops_kernels::adam::AdamTensor;
use trainops_kernels::{ceiling, Element};

use super::optimizer::{for_each_type_pair, optimizer_signature, work_items, Call, Layout};
use crate::error::Result;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};

/// The op as registered in `com.trainops.bench`.
pub struct MemoryCeiling;

static LAYOUT: Layout =
    Layout { op: "MemoryCeiling", groups: &["X", "G", "V", "H"], gradient: 1, rewrites: &[0, 2, 3], ..Layout::ONNX };

impl OpSpec for MemoryCeiling {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = optimizer_signature(c"MemoryCeiling");
        &SIGNATURE
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
        let mut call = LAYOUT.prepare(ctx, None)?;
        for_each_type_pair!(&mut call, run, &(), &())
    }
}

fn run<T: TensorElem + Element, G: TensorElem + Element<C = T::C>>(call: &mut Call<'_, '_>, _: &()) -> Result<()> {
    let n = call.n;
    let views = call.views::<T, G, 3>()?;
    let tensors = work_items(&LAYOUT, n, &views.groups, views.streams, &views.gradients, |[x, v, h], g| {
        AdamTensor::new(x, g, v, h)
    })?;
    ceiling::touch(tensors, views.pool);
    Ok(())
}
