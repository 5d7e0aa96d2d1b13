//! `ai.onnx.preview.training::Momentum` (since version 1): the ONNX operator, variadic,
//! `mode` "standard" or "nesterov".
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n`; outputs `X_1_new..X_n_new, V_1_new..V_n_new`.
//! ONNX makes every attribute required (`alpha`, `beta`, `mode`, `norm_coefficient`); a
//! missing one fails the node when its kernel is created. The math is
//! `trainops_kernels::optim::momentum`; the node plumbing the family's (`super`).

use core::marker::PhantomData;

use trainops_kernels::optim::momentum::Momentum;

use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;

const OP: &str = "Momentum";

/// The op as registered in `ai.onnx.preview.training`; its attributes (all required, `mode`
/// "standard" or "nesterov") are read by `super::attrs`.
pub static MOMENTUM: OptimizerOp<Momentum, 2> = OptimizerOp {
    signature: optimizer_signature(c"Momentum"),
    layout: Layout { op: OP, groups: &["X", "G", "V"], gradient: 1, rewrites: &[0, 2], ..Layout::ONNX },
    kernel: PhantomData,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::optim::layout::testing::{check_counts, check_names, Expect};

    const EXPECT: Expect<'static> = Expect {
        inputs: &["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2"],
        outputs: &["X_1_new", "X_2_new", "V_1_new", "V_2_new"],
        good: &[(5, 1), (11, 3)],
        bad: &[0, 2, 4, 6, 7, 10],
        arity_message: "Momentum: expected 2 + 3n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, n >= 1)",
        outputs_wrong: (5, "expected 2n = 4 outputs (X_new, V_new for each of n = 2 tensors), got 5"),
    };

    #[test]
    fn names_follow_the_variadic_layout() {
        check_names(&MOMENTUM.layout, &EXPECT);
    }

    #[test]
    fn arity_and_output_count_follow_the_variadic_layout() {
        check_counts(&MOMENTUM.layout, &EXPECT);
    }
}
