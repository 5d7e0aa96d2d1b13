//! `com.trainops.bench::MemoryCeiling` (since version 1): a benchmark's yardstick, not a
//! training op. Same inputs, outputs, checks, memory plan and threads as
//! `ai.onnx.preview.training::Adam` (R and T are read and ignored), but each element only
//! does `x += g, v += g, h += g`: the memory traffic of an Adam step with no arithmetic to
//! speak of. `python -m trainops bench adam` reports Adam against it in the same run.

use trainops_kernels::ceiling::MemoryCeiling;

use crate::ops::optim::layout::{optimizer_signature, Layout};
use crate::ops::optim::OptimizerOp;

/// The op as registered in `com.trainops.bench`.
pub static MEMORY_CEILING: OptimizerOp<MemoryCeiling, 3> = OptimizerOp {
    signature: optimizer_signature(c"MemoryCeiling"),
    layout: Layout {
        op: "MemoryCeiling",
        groups: &["X", "G", "V", "H"],
        gradient: 1,
        rewrites: &[0, 2, 3],
        ..Layout::ONNX
    },
    attrs: |_| Ok(()),
};
