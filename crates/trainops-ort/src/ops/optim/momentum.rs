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

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..8).map(|k| MOMENTUM.layout.input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2"]);
        let outs: Vec<String> = (0..4).map(|k| MOMENTUM.layout.output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "V_1_new", "V_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_three_n() {
        assert_eq!(MOMENTUM.layout.arity(5).unwrap(), 1);
        assert_eq!(MOMENTUM.layout.arity(11).unwrap(), 3);
        for bad in [0, 2, 4, 6, 7, 10] {
            let msg = MOMENTUM.layout.arity(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with("Momentum: expected 2 + 3n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, n >= 1)"),
                "{msg}"
            );
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        let msg = MOMENTUM.layout.check_outputs(5, 2, false).unwrap_err().to_string();
        assert!(msg.contains("expected 2n = 4 outputs (X_new, V_new for each of n = 2 tensors), got 5"), "{msg}");
    }

    #[test]
    fn a_missing_attribute_names_itself() {
        let msg = missing("mode", "a string").to_string();
        assert!(msg.starts_with("Momentum: attribute 'mode': required"), "{msg}");
    }
}
