//! `com.trainops::AdamW` (since version 1): PyTorch's `torch.optim.AdamW`, variadic like
//! ONNX's Adam.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, M_1..M_n, V_1..V_n` (and `Vmax_1..Vmax_n` when
//! `amsgrad = 1`); outputs `X_1_new..X_n_new, M_1_new..M_n_new, V_1_new..V_n_new` (and
//! `Vmax_1_new..Vmax_n_new`). `T` is torch's `step`: 1 on the first update. Attributes, with
//! torch's names and defaults: `beta1 = 0.9`, `beta2 = 0.999`, `epsilon = 1e-8`,
//! `weight_decay = 1e-2`, `amsgrad = 0`, `maximize = 0`; float ones are read as the
//! decimal they were written as (`adamw::as_written`), and checked against torch's ranges by
//! `super::attrs` (the family's one reader: AdamW8bit and AdamWBf16State share the table).
//! The math is `trainops_kernels::optim::adamw`; the node plumbing the family's (`super`).

use core::marker::PhantomData;

use trainops_kernels::optim::adamw::AdamW;

use super::attrs::flag;
use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;
use crate::error::Result;
use crate::ffi::context::{KernelInfo, ShapeInfer};
use crate::ffi::op::{Kernel, OpSpec, Signature};

const OP: &str = "AdamW";

/// The op as registered in `com.trainops`: one name, two layouts (`amsgrad` picks).
pub struct AdamWOp {
    /// `amsgrad = 0`: streams `X, M, V`.
    pub plain: OptimizerOp<AdamW, 3>,
    /// `amsgrad = 1`: streams `X, M, V, Vmax`.
    pub amsgrad: OptimizerOp<AdamW, 4>,
}

/// The op as registered in `com.trainops`.
pub static ADAMW: AdamWOp = AdamWOp {
    plain: OptimizerOp {
        signature: optimizer_signature(c"AdamW"),
        layout: Layout { op: OP, groups: &["X", "G", "M", "V"], gradient: 1, rewrites: &[0, 2, 3], ..Layout::ONNX },
        kernel: PhantomData,
    },
    amsgrad: OptimizerOp {
        signature: optimizer_signature(c"AdamW"),
        layout: Layout {
            op: OP,
            groups: &["X", "G", "M", "V", "Vmax"],
            gradient: 1,
            rewrites: &[0, 2, 3, 4],
            ..Layout::ONNX
        },
        kernel: PhantomData,
    },
};

impl OpSpec for AdamWOp {
    fn signature(&self) -> &Signature {
        self.plain.signature()
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        if flag(OP, "amsgrad", info.i64_opt("amsgrad")?)? {
            self.amsgrad.create(info)
        } else {
            self.plain.create(info)
        }
    }

    fn device_step(&'static self, info: &KernelInfo<'_>) -> Result<Option<crate::ffi::device::DeviceStep>> {
        if flag(OP, "amsgrad", info.i64_opt("amsgrad")?)? {
            self.amsgrad.device_step(info)
        } else {
            self.plain.device_step(info)
        }
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        if flag(OP, "amsgrad", ctx.attr_i64(c"amsgrad"))? {
            self.amsgrad.infer(ctx)
        } else {
            self.plain.infer(ctx)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::optim::layout::testing::{check_counts, check_names, Expect};

    #[test]
    fn names_and_counts_follow_the_variadic_layout() {
        let plain = Expect {
            inputs: &["R", "T", "X_1", "X_2", "G_1", "G_2", "M_1", "M_2", "V_1", "V_2"],
            outputs: &["X_1_new", "X_2_new", "M_1_new", "M_2_new", "V_1_new", "V_2_new"],
            good: &[(6, 1), (10, 2)],
            bad: &[0, 2, 5, 7, 9],
            arity_message: "AdamW: expected 2 + 4n inputs (R, T, then X_1..X_n, G_1..G_n, M_1..M_n, V_1..V_n",
            outputs_wrong: (4, "expected 3n = 6 outputs (X_new, M_new, V_new for each of n = 2 tensors), got 4"),
        };
        check_names(&ADAMW.plain.layout, &plain);
        check_counts(&ADAMW.plain.layout, &plain);
        let amsgrad = Expect {
            inputs: &["R", "T", "X_1", "X_2", "G_1", "G_2", "M_1", "M_2", "V_1", "V_2", "Vmax_1", "Vmax_2"],
            outputs: &["X_1_new", "X_2_new", "M_1_new", "M_2_new", "V_1_new", "V_2_new", "Vmax_1_new", "Vmax_2_new"],
            good: &[(7, 1), (12, 2)],
            bad: &[0, 2, 6, 8, 10],
            arity_message:
                "AdamW: expected 2 + 5n inputs (R, T, then X_1..X_n, G_1..G_n, M_1..M_n, V_1..V_n, Vmax_1..Vmax_n",
            outputs_wrong: (
                6,
                "expected 4n = 8 outputs (X_new, M_new, V_new, Vmax_new for each of n = 2 tensors), got 6",
            ),
        };
        check_names(&ADAMW.amsgrad.layout, &amsgrad);
        check_counts(&ADAMW.amsgrad.layout, &amsgrad);
    }
}
