//! `com.trainops::AllFinite` (since version 1): any number of float tensors -> one bool,
//! true when every element of every tensor is finite.

use half::{bf16, f16};
use trainops_kernels::{loss_scale, Element};

use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, Signature, Tensor};
use crate::ops::io;

const OP: &str = "AllFinite";

/// The op as registered in `com.trainops`.
pub struct AllFinite;

static INPUTS: [Formal; 1] = [Formal::Variadic { dtype: None, min: 1 }];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Bool))];
static SIGNATURE: Signature = Signature { name: c"AllFinite", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for AllFinite {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, _info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(AllFiniteKernel))
    }

    fn device_op(&'static self, _info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceOp>> {
        Ok(Some(crate::ffi::device::DeviceOp::AllFinite))
    }
}

struct AllFiniteKernel;

/// True when every tensor of type `T` among `inputs` is finite.
fn finite_of<T: TensorElem + Element>(inputs: &[Tensor], pool: &OrtPool<'_, '_>) -> bool {
    // SAFETY: types checked by the filter; inputs are never written, and the output (a
    // single bool) is written only after this returns.
    let slices: Vec<&[T]> = inputs.iter().filter(|t| t.dtype == T::DTYPE).map(|t| unsafe { t.slice::<T>() }).collect();
    slices.is_empty() || loss_scale::all_finite(&slices, None, pool)
}

impl Kernel for AllFiniteKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let count = ctx.input_count()?;
        let inputs =
            (0..count).map(|k| io::required(ctx, OP, k, &format!("X_{}", k + 1))).collect::<Result<Vec<_>>>()?;
        for (k, t) in inputs.iter().enumerate() {
            let name = format!("X_{}", k + 1);
            if !matches!(t.dtype, DType::Float | DType::Double | DType::Float16 | DType::BFloat16) {
                let want = "tensor(float), tensor(double), tensor(float16) or tensor(bfloat16)";
                return Err(Error::input(OP, k, name, want, t.dtype.name()));
            }
            if !t.aligned() {
                return Err(Error::input(OP, k, name, "a buffer aligned for its type", "a misaligned one"));
            }
        }
        let finite = {
            let pool = OrtPool::new(ctx);
            finite_of::<f32>(&inputs, &pool)
                && finite_of::<f64>(&inputs, &pool)
                && finite_of::<f16>(&inputs, &pool)
                && finite_of::<bf16>(&inputs, &pool)
        };
        let out = io::output(ctx, OP, 0, "finite", DType::Bool, &[])?;
        // SAFETY: one bool, checked; every input was read already.
        unsafe { out.slice_mut::<bool>()[0] = finite };
        Ok(())
    }
}
