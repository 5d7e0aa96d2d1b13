//! `ai.onnx.preview.training::Adagrad` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, H_1..H_n`; outputs `X_1_new..X_n_new, H_1_new..H_n_new`.
//! The math is `trainops_kernels::optim::adagrad`; the node plumbing the family's (`super`).

use core::marker::PhantomData;

use trainops_kernels::optim::adagrad::Adagrad;

use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;

/// The op as registered in `ai.onnx.preview.training`.
pub static ADAGRAD: OptimizerOp<Adagrad, 2> = OptimizerOp {
    signature: optimizer_signature(c"Adagrad"),
    layout: Layout { op: "Adagrad", groups: &["X", "G", "H"], gradient: 1, rewrites: &[0, 2], ..Layout::ONNX },
    kernel: PhantomData,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::optim::layout::testing::{check_counts, check_names, Expect};

    const EXPECT: Expect<'static> = Expect {
        inputs: &["R", "T", "X_1", "X_2", "G_1", "G_2", "H_1", "H_2"],
        outputs: &["X_1_new", "X_2_new", "H_1_new", "H_2_new"],
        good: &[(5, 1), (8, 2)],
        bad: &[0, 2, 4, 6, 7, 9],
        arity_message: "Adagrad: expected 2 + 3n inputs (R, T, then X_1..X_n, G_1..G_n, H_1..H_n, n >= 1)",
        outputs_wrong: (3, "expected 2n = 4 outputs (X_new, H_new for each of n = 2 tensors), got 3"),
    };

    #[test]
    fn names_follow_the_variadic_layout() {
        check_names(&ADAGRAD.layout, &EXPECT);
    }

    #[test]
    fn arity_and_output_count_follow_the_variadic_layout() {
        check_counts(&ADAGRAD.layout, &EXPECT);
    }
}
