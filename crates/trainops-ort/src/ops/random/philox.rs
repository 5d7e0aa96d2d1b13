//! `com.trainops::Philox` (since version 1): DirectML's `DML_RANDOM_GENERATOR` operator with
//! `DML_RANDOM_GENERATOR_TYPE_PHILOX_4X32_10`, with the state as an ordinary tensor in and
//! out, so a graph's random bits are reproducible and independent of threads and SIMD.
//!
//! Inputs: `state`, `shape` (optional); attribute `shape`; outputs `output` (uint32 of the
//! requested shape), `state_out` (optional: the counter advanced by `ceil(numel / 4)`
//! blocks, mod 2^128; key unchanged). The shared handling is [`super::state`].

use trainops_kernels::random::philox;

use super::state::{self, OutputShape, Outputs};
use crate::error::Result;
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};

const OP: &str = "Philox";

/// The op as registered in `com.trainops`.
pub struct Philox;

static INPUTS: [Formal; 2] = [Formal::One(Some(DType::Uint32)), Formal::Optional(Some(DType::Int64))];
static OUTPUTS: [Formal; 2] = [Formal::One(Some(DType::Uint32)), Formal::Optional(Some(DType::Uint32))];
static SIGNATURE: Signature = Signature { name: c"Philox", inputs: &INPUTS, outputs: &OUTPUTS };

impl OpSpec for Philox {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(PhiloxKernel { shape: OutputShape::from_node(OP, info)? }))
    }

    fn device_op(&'static self, info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceOp>> {
        let shape = OutputShape::from_node(OP, info)?;
        Ok(Some(crate::ffi::device::DeviceOp::Philox(super::device::philox(shape))))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        state::infer(OP, ctx)
    }
}

/// The kernel of one Philox node.
struct PhiloxKernel {
    shape: OutputShape,
}

impl Kernel for PhiloxKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let (state, state_t) = state::read_state(ctx, OP)?;
        let (dims, _) = self.shape.dims(ctx)?;
        let outputs = Outputs::new(ctx, OP, DType::Uint32, &dims, &state_t)?;
        // SAFETY: the output's type and size are checked; the state was copied out, so no
        // other view of any buffer is alive; output and state_out do not overlap.
        let words = unsafe { outputs.output.slice_mut::<u32>() };
        let next = philox::fill(&state, words, &OrtPool::new(ctx));
        outputs.write_state(&next);
        Ok(())
    }
}
