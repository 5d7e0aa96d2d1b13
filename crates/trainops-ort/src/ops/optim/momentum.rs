//! `ai.onnx.preview.training::Momentum` (since version 1): the ONNX operator, variadic,
//! `mode` "standard" or "nesterov".
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n`; outputs `X_1_new..X_n_new, V_1_new..V_n_new`.
//! ONNX makes every attribute required (`alpha`, `beta`, `mode`, `norm_coefficient`); a
//! missing one fails the node when its kernel is created. The math is
//! `trainops_kernels::optim::momentum`; the node plumbing the family's (`super`).

use trainops_kernels::optim::momentum::{Momentum, MomentumAttrs, MomentumMode};

use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;
use crate::error::{Error, Result};
use crate::ffi::KernelInfo;

const OP: &str = "Momentum";

/// The op as registered in `ai.onnx.preview.training`.
pub static MOMENTUM: OptimizerOp<Momentum, 2> = OptimizerOp {
    signature: optimizer_signature(c"Momentum"),
    layout: Layout { op: OP, groups: &["X", "G", "V"], gradient: 1, rewrites: &[0, 2], ..Layout::ONNX },
    attrs: read_attrs,
};

/// The error for a required attribute the node does not set.
fn missing(name: &'static str, kind: &str) -> Error {
    Error::Attribute {
        op: OP,
        name,
        what: format!("required, but the node has no '{name}' attribute (ONNX gives it no default; expected {kind})"),
    }
}

/// Momentum's four attributes, all required; a missing or wrong-typed one, or an unknown
/// mode, is an error.
fn read_attrs(info: &KernelInfo<'_>) -> Result<MomentumAttrs> {
    let float = |name: &'static str| info.f32_opt(name)?.ok_or_else(|| missing(name, "a float"));
    let alpha = float("alpha")?;
    let beta = float("beta")?;
    let mode_name = info.string_opt("mode")?.ok_or_else(|| missing("mode", "a string"))?;
    let mode = MomentumMode::from_onnx(&mode_name).ok_or_else(|| Error::Attribute {
        op: OP,
        name: "mode",
        what: format!("expected \"standard\" or \"nesterov\", got {mode_name:?}"),
    })?;
    let norm_coefficient = float("norm_coefficient")?;
    Ok(MomentumAttrs { alpha, beta, mode, norm_coefficient })
}

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

    #[test]
    fn a_missing_attribute_names_itself() {
        let msg = missing("mode", "a string").to_string();
        assert!(msg.starts_with("Momentum: attribute 'mode': required"), "{msg}");
    }
}
