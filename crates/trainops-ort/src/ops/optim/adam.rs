//! `ai.onnx.preview.training::Adam` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n`; outputs
//! `X_1_new..X_n_new, V_1_new..V_n_new, H_1_new..H_n_new`. The math is
//! `trainops_kernels::optim::adam`; the node plumbing the family's (`super`), the
//! attributes' table and checks `super::attrs`'.

use core::marker::PhantomData;

use trainops_kernels::optim::adam::Adam;

use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;

/// The op as registered in `ai.onnx.preview.training`.
pub static ADAM: OptimizerOp<Adam, 3> = OptimizerOp {
    signature: optimizer_signature(c"Adam"),
    layout: Layout { op: "Adam", groups: &["X", "G", "V", "H"], gradient: 1, rewrites: &[0, 2, 3], ..Layout::ONNX },
    kernel: PhantomData,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::optim::layout::testing::{check_counts, check_names, Expect};

    const EXPECT: Expect<'static> = Expect {
        inputs: &["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2", "H_1", "H_2"],
        outputs: &["X_1_new", "X_2_new", "V_1_new", "V_2_new", "H_1_new", "H_2_new"],
        good: &[(6, 1), (10, 2)],
        bad: &[0, 2, 5, 7, 9],
        arity_message: "Adam: expected 2 + 4n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n",
        outputs_wrong: (4, "expected 3n = 6 outputs (X_new, V_new, H_new for each of n = 2 tensors), got 4"),
    };

    #[test]
    fn names_follow_the_variadic_layout() {
        check_names(&ADAM.layout, &EXPECT);
    }

    #[test]
    fn arity_and_output_count_follow_the_variadic_layout() {
        check_counts(&ADAM.layout, &EXPECT);
    }
}
