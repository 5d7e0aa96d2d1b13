//! `ai.onnx.preview.training::Adagrad` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, H_1..H_n`; outputs `X_1_new..X_n_new, H_1_new..H_n_new`.
//! The math is `trainops_kernels::optim::adagrad`; the node plumbing the family's (`super`).

use trainops_kernels::optim::adagrad::{Adagrad, AdagradAttrs};

use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;
use crate::error::Result;
use crate::ffi::KernelInfo;

/// The op as registered in `ai.onnx.preview.training`.
pub static ADAGRAD: OptimizerOp<Adagrad, 2> = OptimizerOp {
    signature: optimizer_signature(c"Adagrad"),
    layout: Layout { op: "Adagrad", groups: &["X", "G", "H"], gradient: 1, rewrites: &[0, 2], ..Layout::ONNX },
    attrs: read_attrs,
};

/// Adagrad's three attributes, with ONNX's defaults; a wrong-typed one is an error.
fn read_attrs(info: &KernelInfo<'_>) -> Result<AdagradAttrs> {
    let d = AdagradAttrs::default();
    Ok(AdagradAttrs {
        decay_factor: info.f32_or("decay_factor", d.decay_factor)?,
        epsilon: info.f32_or("epsilon", d.epsilon)?,
        norm_coefficient: info.f32_or("norm_coefficient", d.norm_coefficient)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..8).map(|k| ADAGRAD.layout.input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "H_1", "H_2"]);
        let outs: Vec<String> = (0..4).map(|k| ADAGRAD.layout.output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "H_1_new", "H_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_three_n() {
        assert_eq!(ADAGRAD.layout.arity(5).unwrap(), 1);
        assert_eq!(ADAGRAD.layout.arity(8).unwrap(), 2);
        for bad in [0, 2, 4, 6, 7, 9] {
            let msg = ADAGRAD.layout.arity(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with("Adagrad: expected 2 + 3n inputs (R, T, then X_1..X_n, G_1..G_n, H_1..H_n, n >= 1)"),
                "{msg}"
            );
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        let msg = ADAGRAD.layout.check_outputs(3, 2, false).unwrap_err().to_string();
        assert!(msg.contains("expected 2n = 4 outputs (X_new, H_new for each of n = 2 tensors), got 3"), "{msg}");
    }
}
