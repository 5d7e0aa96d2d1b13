//! `com.trainops.bench::MemoryCeiling` (since version 1): a benchmark's yardstick, not a
//! training op. Same inputs, outputs, checks, memory plan and threads as an optimizer, but
//! each element only does `s += g` for every rewritten stream `s`: the memory traffic of an
//! optimizer step with no arithmetic to speak of. Its int attribute `streams` picks whose:
//! 3 (the default) is Adam's layout `R, T, X.., G.., V.., H..` (reads x, g, v, h; writes
//! x, v, h), 2 is Adagrad's `R, T, X.., G.., H..` (Momentum's X, V move the same bytes).
//! Every weight type of the optimizers is accepted (float, double, float16 and bfloat16 X
//! with G of the same type; float X with 16-bit G), so a 16-bit row has a 16-bit ceiling.
//! `python -m trainops bench adam` reports each optimizer against its own in the same run.

use trainops_kernels::ceiling::MemoryCeiling;

use crate::error::{Error, Result};
use crate::ffi::context::{KernelInfo, ShapeInfer};
use crate::ffi::op::{Kernel, OpSpec, Signature};
use crate::ops::optim::layout::{optimizer_signature, Layout};
use crate::ops::optim::OptimizerOp;

/// The op as registered in `com.trainops.bench`: one name, two layouts.
pub struct MemoryCeilingOp {
    /// `streams = 3` (the default): Adam's layout.
    pub three: OptimizerOp<MemoryCeiling, 3>,
    /// `streams = 2`: Adagrad's layout.
    pub two: OptimizerOp<MemoryCeiling, 2>,
}

/// The op as registered in `com.trainops.bench`.
pub static MEMORY_CEILING: MemoryCeilingOp = MemoryCeilingOp {
    three: OptimizerOp {
        signature: optimizer_signature(c"MemoryCeiling"),
        layout: Layout {
            op: "MemoryCeiling",
            groups: &["X", "G", "V", "H"],
            gradient: 1,
            rewrites: &[0, 2, 3],
            ..Layout::ONNX
        },
        kernel: core::marker::PhantomData,
    },
    two: OptimizerOp {
        signature: optimizer_signature(c"MemoryCeiling"),
        layout: Layout {
            op: "MemoryCeiling",
            groups: &["X", "G", "H"],
            gradient: 1,
            rewrites: &[0, 2],
            ..Layout::ONNX
        },
        kernel: core::marker::PhantomData,
    },
};

/// The `streams` attribute's values, checked: 2 or 3 (absent: 3).
fn two_streams(streams: Option<i64>) -> Result<bool> {
    match streams {
        None | Some(3) => Ok(false),
        Some(2) => Ok(true),
        Some(v) => {
            Err(Error::Attribute { op: "MemoryCeiling", name: "streams", what: format!("expected 2 or 3, got {v}") })
        }
    }
}

impl OpSpec for MemoryCeilingOp {
    fn signature(&self) -> &Signature {
        self.three.signature()
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        if two_streams(info.i64_opt("streams")?)? {
            self.two.create(info)
        } else {
            self.three.create(info)
        }
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        if two_streams(ctx.attr_i64(c"streams"))? {
            self.two.infer(ctx)
        } else {
            self.three.infer(ctx)
        }
    }
}
