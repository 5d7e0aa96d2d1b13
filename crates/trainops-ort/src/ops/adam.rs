//! `ai.onnx.preview.training::Adam` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n`; outputs
//! `X_1_new..X_n_new, V_1_new..V_n_new, H_1_new..H_n_new`. The math is in
//! `trainops_kernels::adam`; the node plumbing in [`super::optimizer`].

use trainops_kernels::adam::{self, AdamAttrs, AdamCoeffs, AdamKernel as AdamSimd, AdamTensor};
use trainops_kernels::Element;

use super::optimizer::{for_each_type_pair, optimizer_signature, work_items, Call, Layout};
use crate::error::Result;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};

/// The op as registered in `ai.onnx.preview.training`.
pub struct Adam;

/// Adam's variadic layout.
pub static LAYOUT: Layout =
    Layout { op: "Adam", groups: &["X", "G", "V", "H"], gradient: 1, rewrites: &[0, 2, 3], ..Layout::ONNX };

impl OpSpec for Adam {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = optimizer_signature(c"Adam");
        &SIGNATURE
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(AdamKernel { attrs: read_attrs(info)? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        LAYOUT.infer(ctx)
    }
}

/// Adam's five attributes, with ONNX's defaults; a wrong-typed one is an error.
pub(crate) fn read_attrs(info: &KernelInfo<'_>) -> Result<AdamAttrs> {
    let d = AdamAttrs::default();
    Ok(AdamAttrs {
        alpha: info.f32_or("alpha", d.alpha)?,
        beta: info.f32_or("beta", d.beta)?,
        epsilon: info.f32_or("epsilon", d.epsilon)?,
        norm_coefficient: info.f32_or("norm_coefficient", d.norm_coefficient)?,
        norm_coefficient_post: info.f32_or("norm_coefficient_post", d.norm_coefficient_post)?,
    })
}

/// The kernel of one Adam node.
struct AdamKernel {
    attrs: AdamAttrs,
}

impl Kernel for AdamKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = LAYOUT.prepare(ctx, None)?;
        let rate = adam::adjusted_rate(call.r, call.t, self.attrs.alpha, self.attrs.beta);
        let (c32, c64) = (AdamCoeffs::new(&self.attrs, rate), AdamCoeffs::new(&self.attrs, rate));
        for_each_type_pair!(&mut call, run, &c32, &c64)
    }
}

/// Runs Adam on the groups with weights `X` and gradients `G` (none: nothing to do).
pub(crate) fn run<X, G>(call: &mut Call<'_, '_>, c: &AdamCoeffs<X::C>) -> Result<()>
where
    X: TensorElem + AdamSimd<G>,
    G: TensorElem + Element<C = X::C>,
{
    let n = call.n;
    let views = call.views::<X, G, 3>()?;
    let tensors = work_items(&LAYOUT, n, &views.groups, views.streams, &views.gradients, |[x, v, h], g| {
        AdamTensor::new(x, g, v, h)
    })?;
    adam::step(c, tensors, views.pool);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..10).map(|k| LAYOUT.input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2", "H_1", "H_2"]);
        let outs: Vec<String> = (0..6).map(|k| LAYOUT.output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "V_1_new", "V_2_new", "H_1_new", "H_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_four_n() {
        assert_eq!(LAYOUT.arity(6).unwrap(), 1);
        assert_eq!(LAYOUT.arity(10).unwrap(), 2);
        for bad in [0, 2, 5, 7, 9] {
            let msg = LAYOUT.arity(bad).unwrap_err().to_string();
            assert!(
                msg.starts_with("Adam: expected 2 + 4n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n"),
                "{msg}"
            );
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        let msg = LAYOUT.check_outputs(4, 2, false).unwrap_err().to_string();
        assert!(
            msg.contains("expected 3n = 6 outputs (X_new, V_new, H_new for each of n = 2 tensors), got 4"),
            "{msg}"
        );
    }
}
