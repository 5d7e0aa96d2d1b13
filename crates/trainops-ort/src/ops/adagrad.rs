//! `ai.onnx.preview.training::Adagrad` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, H_1..H_n`; outputs `X_1_new..X_n_new, H_1_new..H_n_new`.
//! The math is in `trainops_kernels::adagrad`; the node plumbing in [`super::optimizer`].

use trainops_kernels::adagrad::{self, AdagradAttrs, AdagradCoeffs, AdagradTensor};
use trainops_kernels::Element;

use super::optimizer::{for_each_type_pair, optimizer_signature, work_items, Call, Layout};
use crate::error::Result;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};

/// The op as registered in `ai.onnx.preview.training`.
pub struct Adagrad;

/// Adagrad's variadic layout.
pub static LAYOUT: Layout =
    Layout { op: "Adagrad", groups: &["X", "G", "H"], gradient: 1, rewrites: &[0, 2], ..Layout::ONNX };

impl OpSpec for Adagrad {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = optimizer_signature(c"Adagrad");
        &SIGNATURE
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(AdagradKernel { attrs: read_attrs(info)? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        LAYOUT.infer(ctx)
    }
}

/// Adagrad's three attributes, with ONNX's defaults; a wrong-typed one is an error.
fn read_attrs(info: &KernelInfo<'_>) -> Result<AdagradAttrs> {
    let d = AdagradAttrs::default();
    Ok(AdagradAttrs {
        decay_factor: info.f32_or("decay_factor", d.decay_factor)?,
        epsilon: info.f32_or("epsilon", d.epsilon)?,
        norm_coefficient: info.f32_or("norm_coefficient", d.norm_coefficient)?,
    })
}

/// The kernel of one Adagrad node.
struct AdagradKernel {
    attrs: AdagradAttrs,
}

impl Kernel for AdagradKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = LAYOUT.prepare(ctx, None)?;
        let rate = adagrad::adjusted_rate(call.r, call.t, self.attrs.decay_factor);
        let c32 = AdagradCoeffs::<f32>::new(&self.attrs, rate);
        let c64 = AdagradCoeffs::<f64>::new(&self.attrs, rate);
        for_each_type_pair!(&mut call, run, &c32, &c64)
    }
}

/// Runs Adagrad on the groups with weights `X` and gradients `G` (none: nothing to do).
fn run<X, G>(call: &mut Call<'_, '_>, c: &AdagradCoeffs<X::C>) -> Result<()>
where
    X: TensorElem + Element,
    G: TensorElem + Element<C = X::C>,
{
    let n = call.n;
    let views = call.views::<X, G, 2>()?;
    let tensors = work_items(&LAYOUT, n, &views.groups, views.streams, &views.gradients, |[x, h], g| {
        AdagradTensor::new(x, g, h)
    })?;
    adagrad::step(c, tensors, views.pool);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..8).map(|k| LAYOUT.input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "H_1", "H_2"]);
        let outs: Vec<String> = (0..4).map(|k| LAYOUT.output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "H_1_new", "H_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_three_n() {
        assert_eq!(LAYOUT.arity(5).unwrap(), 1);
        assert_eq!(LAYOUT.arity(8).unwrap(), 2);
        for bad in [0, 2, 4, 6, 7, 9] {
            let msg = LAYOUT.arity(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with("Adagrad: expected 2 + 3n inputs (R, T, then X_1..X_n, G_1..G_n, H_1..H_n, n >= 1)"),
                "{msg}"
            );
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        let msg = LAYOUT.check_outputs(3, 2, false).unwrap_err().to_string();
        assert!(msg.contains("expected 2n = 4 outputs (X_new, H_new for each of n = 2 tensors), got 3"), "{msg}");
    }
}
