//! The optimizer family's ops: ONNX's `Adam`, `Adagrad` and `Momentum`, and PyTorch's
//! `AdamW` (`com.trainops`; one file each: the attributes and the layout), all served by one generic op, [`OptimizerOp`], and one
//! generic run path, [`run`]. MemoryCeiling (`ops::bench`) is one more [`OptimizerOp`];
//! MixedPrecisionAdam (`ops::loss_scale`) has its own kernel around [`Call`] and [`run`].
//! The math is the kernels crate's `trainops_kernels::optim`.
//!
//! A call: [`Call::prepare`] checks the node and plans its memory; then, for each weight /
//! gradient type pair, [`run`] views that pair's tensor groups as the kernels' `Param`s
//! and runs the optimizer's `step` on the session's thread pool.

pub mod adagrad;
pub mod adam;
pub mod adamw;
pub mod attrs;
pub mod bf16state;
pub mod call;
pub mod device;
pub mod layout;
mod mixed_call;
pub mod momentum;
pub mod quantized;

use core::marker::PhantomData;

use half::{bf16, f16};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::Element;

use self::attrs::FromNode;
use self::call::{Call, Views};
use self::layout::Layout;
use crate::error::{Error, Result};
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};

/// An ONNX-style optimizer op of `N` rewritten streams per tensor, computed by kernel `O`;
/// its attributes are `O::Attrs`, read and checked by [`attrs::read`] (the family's one
/// path).
pub struct OptimizerOp<O: Optimizer<N>, const N: usize> {
    /// Name and formal inputs and outputs.
    pub signature: Signature,
    /// The variadic layout.
    pub layout: Layout,
    /// The kernel.
    pub kernel: PhantomData<O>,
}

impl<O: Optimizer<N> + device::OnDevice<N>, const N: usize> OpSpec for OptimizerOp<O, N>
where
    O::Attrs: FromNode,
{
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn device_step(&'static self, info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceStep>> {
        Ok(O::device(&attrs::read::<O::Attrs>(self.layout.op, info)?))
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attrs = attrs::read::<O::Attrs>(self.layout.op, info)?;
        Ok(Box::new(OptimizerKernel::<O, N> { layout: &self.layout, attrs }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        self.layout.infer(ctx)
    }
}

/// The kernel of one node of an [`OptimizerOp`].
struct OptimizerKernel<O: Optimizer<N>, const N: usize> {
    layout: &'static Layout,
    attrs: O::Attrs,
}

impl<O: Optimizer<N>, const N: usize> Kernel for OptimizerKernel<O, N> {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = Call::prepare(self.layout, ctx, None)?;
        if call.t < O::MIN_T {
            let want = format!("an update count >= {} (1 on the first update, as torch's step)", O::MIN_T);
            return Err(Error::input(self.layout.op, 1, "T", want, call.t.to_string()));
        }
        let c32 = O::coeffs::<f32>(&self.attrs, call.r, call.t);
        let c64 = O::coeffs::<f64>(&self.attrs, call.r, call.t);
        run::<O, f32, f32, N>(&mut call, &c32)?;
        run::<O, f32, f16, N>(&mut call, &c32)?;
        run::<O, f32, bf16, N>(&mut call, &c32)?;
        run::<O, f16, f16, N>(&mut call, &c32)?;
        run::<O, bf16, bf16, N>(&mut call, &c32)?;
        run::<O, f64, f64, N>(&mut call, &c64)?;
        // No output is ever returned unwritten.
        call.check_all_handled()
    }
}

/// Runs optimizer `O` with coefficients `c` on the tensor groups of `call` whose weights
/// have type `X` and gradients type `G` (none: nothing to do).
pub fn run<O, X, G, const N: usize>(call: &mut Call<'_, '_>, c: &O::Coeffs<X::C>) -> Result<()>
where
    O: Optimizer<N>,
    X: TensorElem + Element,
    G: TensorElem + Element<C = X::C>,
{
    let (layout, n) = (call.layout, call.n);
    let Views { groups, streams, gradients, pool } = call.views::<X, G, N>()?;
    let params = groups
        .iter()
        .zip(streams)
        .zip(&gradients)
        .map(|((&i, s), g)| {
            // A length mismatch is named after the group's weights (`X_i`).
            let at = layout.scalar_count() + i;
            O::param(s, g)
                .map_err(|e| Error::input(layout.op, at, layout.input_name(at, n), "equal tensor sizes", e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    O::step(c, params, pool);
    Ok(())
}
