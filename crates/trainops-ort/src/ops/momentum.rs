//! `ai.onnx.preview.training::Momentum` (since version 1): the ONNX operator, variadic,
//! `mode` "standard" or "nesterov".
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n`; outputs `X_1_new..X_n_new, V_1_new..V_n_new`.
//! ONNX makes every attribute required (`alpha`, `beta`, `mode`, `norm_coefficient`); a
//! missing one fails the node when its kernel is created. The math is in
//! `trainops_kernels::momentum`; the node plumbing in [`super::optimizer`].

use trainops_kernels::momentum::{self, MomentumAttrs, MomentumCoeffs, MomentumMode, MomentumTensor};
use trainops_kernels::Element;

use super::optimizer::{for_each_type_pair, optimizer_signature, work_items, Call, Layout};
use crate::error::{Error, Result};
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};

/// The op as registered in `ai.onnx.preview.training`.
pub struct Momentum;

/// Momentum's variadic layout.
pub static LAYOUT: Layout =
    Layout { op: "Momentum", groups: &["X", "G", "V"], gradient: 1, rewrites: &[0, 2], ..Layout::ONNX };

impl OpSpec for Momentum {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = optimizer_signature(c"Momentum");
        &SIGNATURE
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(MomentumKernel { attrs: read_attrs(info)? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        LAYOUT.infer(ctx)
    }
}

/// The error for a required attribute the node does not set.
fn missing(name: &'static str, kind: &str) -> Error {
    Error::Attribute {
        op: LAYOUT.op,
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
        op: LAYOUT.op,
        name: "mode",
        what: format!("expected \"standard\" or \"nesterov\", got {mode_name:?}"),
    })?;
    let norm_coefficient = float("norm_coefficient")?;
    Ok(MomentumAttrs { alpha, beta, mode, norm_coefficient })
}

/// The kernel of one Momentum node.
struct MomentumKernel {
    attrs: MomentumAttrs,
}

impl Kernel for MomentumKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = LAYOUT.prepare(ctx, None)?;
        let c32 = MomentumCoeffs::<f32>::new(&self.attrs, call.r, call.t);
        let c64 = MomentumCoeffs::<f64>::new(&self.attrs, call.r, call.t);
        for_each_type_pair!(&mut call, run, &c32, &c64)
    }
}

/// Runs Momentum on the groups with weights `X` and gradients `G` (none: nothing to do).
fn run<X, G>(call: &mut Call<'_, '_>, c: &MomentumCoeffs<X::C>) -> Result<()>
where
    X: TensorElem + Element,
    G: TensorElem + Element<C = X::C>,
{
    let n = call.n;
    let views = call.views::<X, G, 2>()?;
    let tensors = work_items(&LAYOUT, n, &views.groups, views.streams, &views.gradients, |[x, v], g| {
        MomentumTensor::new(x, g, v)
    })?;
    momentum::step(c, tensors, views.pool);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..8).map(|k| LAYOUT.input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2"]);
        let outs: Vec<String> = (0..4).map(|k| LAYOUT.output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "V_1_new", "V_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_three_n() {
        assert_eq!(LAYOUT.arity(5).unwrap(), 1);
        assert_eq!(LAYOUT.arity(11).unwrap(), 3);
        for bad in [0, 2, 4, 6, 7, 10] {
            let msg = LAYOUT.arity(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with("Momentum: expected 2 + 3n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, n >= 1)"),
                "{msg}"
            );
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        let msg = LAYOUT.check_outputs(5, 2, false).unwrap_err().to_string();
        assert!(msg.contains("expected 2n = 4 outputs (X_new, V_new for each of n = 2 tensors), got 5"), "{msg}");
    }

    #[test]
    fn a_missing_attribute_names_itself() {
        let msg = missing("mode", "a string").to_string();
        assert!(msg.starts_with("Momentum: attribute 'mode': required"), "{msg}");
    }
}
