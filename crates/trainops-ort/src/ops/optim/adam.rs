//! `ai.onnx.preview.training::Adam` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n`; outputs
//! `X_1_new..X_n_new, V_1_new..V_n_new, H_1_new..H_n_new`. The math is
//! `trainops_kernels::optim::adam`; the node plumbing the family's (`super`).

use trainops_kernels::optim::adam::{Adam, AdamAttrs};

use super::layout::{optimizer_signature, Layout};
use super::OptimizerOp;
use crate::error::Result;
use crate::ffi::KernelInfo;

/// The op as registered in `ai.onnx.preview.training`.
pub static ADAM: OptimizerOp<Adam, 3> = OptimizerOp {
    signature: optimizer_signature(c"Adam"),
    layout: Layout { op: "Adam", groups: &["X", "G", "V", "H"], gradient: 1, rewrites: &[0, 2, 3], ..Layout::ONNX },
    attrs: read_attrs,
};

/// Adam's five attributes, with ONNX's defaults; a wrong-typed one is an error.
pub fn read_attrs(info: &KernelInfo<'_>) -> Result<AdamAttrs> {
    let d = AdamAttrs::default();
    Ok(AdamAttrs {
        alpha: info.f32_or("alpha", d.alpha)?,
        beta: info.f32_or("beta", d.beta)?,
        epsilon: info.f32_or("epsilon", d.epsilon)?,
        norm_coefficient: info.f32_or("norm_coefficient", d.norm_coefficient)?,
        norm_coefficient_post: info.f32_or("norm_coefficient_post", d.norm_coefficient_post)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..10).map(|k| ADAM.layout.input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2", "H_1", "H_2"]);
        let outs: Vec<String> = (0..6).map(|k| ADAM.layout.output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "V_1_new", "V_2_new", "H_1_new", "H_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_four_n() {
        assert_eq!(ADAM.layout.arity(6).unwrap(), 1);
        assert_eq!(ADAM.layout.arity(10).unwrap(), 2);
        for bad in [0, 2, 5, 7, 9] {
            let msg = ADAM.layout.arity(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with("Adam: expected 2 + 4n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n"),
                "{msg}"
            );
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        let msg = ADAM.layout.check_outputs(4, 2, false).unwrap_err().to_string();
        assert!(
            msg.contains("expected 3n = 6 outputs (X_new, V_new, H_new for each of n = 2 tensors), got 4"),
            "{msg}"
        );
    }
}
