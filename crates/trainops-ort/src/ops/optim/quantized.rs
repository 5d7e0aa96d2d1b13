//! `com.trainops::Adam8bit` and `com.trainops::AdamW8bit` (since version 1): Adam (ONNX's
//! formula and attributes) and AdamW (PyTorch's formula; attributes `beta1`, `beta2`,
//! `epsilon`, `weight_decay`, `maximize`; no `amsgrad`) with 8-bit blockwise-quantised
//! moments; the attributes checked as Adam's and AdamW's (`super::attrs`). The format and
//! the math are `trainops_kernels::optim::quantized`.
//!
//! Inputs `R, T`, then `X_1..X_n, G_1..G_n, M_q_1..M_q_n, M_absmax_1..M_absmax_n,
//! V_q_1..V_q_n, V_absmax_1..V_absmax_n`; outputs `X_new.., M_q_new.., M_absmax_new..,
//! V_q_new.., V_absmax_new..` (each may be bound to its input's buffer). `X` float32; `G`
//! float32, float16 or bfloat16, broadcastable to `X`; `M_q`, `V_q` uint8 shaped like `X`;
//! `M_absmax`, `V_absmax` float32 with `ceil(numel(X) / 256)` elements (any shape).

use half::{bf16, f16};
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::quantized::adamw::{AdamWAttrs, AdamWCoeffs, Rule};
use trainops_kernels::optim::quantized::{blocks, step, Param8bit, Quantized, BLOCK};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::Element;

use super::attrs;
use super::layout::{optimizer_signature, Layout};
use super::mixed_call::{self, ByGradient, MixedCall};
use crate::error::{Error, Result};
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};

/// An 8-bit optimizer op: its signature, its variadic layout and which rule it runs.
pub struct Optim8bitOp {
    signature: Signature,
    /// Names and counts of the inputs and outputs.
    pub layout: Layout,
    adamw: bool,
}

/// The six input groups: weights, gradient, then each moment's codes and scales.
const GROUPS: &[&str] = &["X", "G", "M_q", "M_absmax", "V_q", "V_absmax"];
/// What each group's elements are (the gradient's float32 is one of three).
const TYPES: [DType; 6] = [DType::Float, DType::Float, DType::Uint8, DType::Float, DType::Uint8, DType::Float];

/// `com.trainops::Adam8bit`.
pub static ADAM_8BIT: Optim8bitOp = Optim8bitOp {
    signature: optimizer_signature(c"Adam8bit"),
    layout: Layout {
        op: "Adam8bit",
        groups: GROUPS,
        gradient: 1,
        rewrites: &[0, 2, 3, 4, 5],
        weights: &[DType::Float],
        ..Layout::ONNX
    },
    adamw: false,
};

/// `com.trainops::AdamW8bit`.
pub static ADAMW_8BIT: Optim8bitOp = Optim8bitOp {
    signature: optimizer_signature(c"AdamW8bit"),
    layout: Layout {
        op: "AdamW8bit",
        groups: GROUPS,
        gradient: 1,
        rewrites: &[0, 2, 3, 4, 5],
        weights: &[DType::Float],
        ..Layout::ONNX
    },
    adamw: true,
};

/// A node's attributes.
enum Attrs {
    Adam(AdamAttrs),
    AdamW(AdamWAttrs),
}

impl OpSpec for Optim8bitOp {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        // The family's one reader: AdamW's table (torch's ranges, amsgrad refused) or Adam's.
        let op = self.layout.op;
        let attrs = if self.adamw {
            Attrs::AdamW(attrs::read::<AdamWAttrs>(op, info)?)
        } else {
            Attrs::Adam(attrs::read::<AdamAttrs>(op, info)?)
        };
        Ok(Box::new(Optim8bitKernel { layout: &self.layout, attrs }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        mixed_call::infer(&self.layout, &TYPES, ctx)
    }
}

struct Optim8bitKernel {
    layout: &'static Layout,
    attrs: Attrs,
}

impl Kernel for Optim8bitKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = MixedCall::prepare(self.layout, ctx, check_group)?;
        let (r, t) = (call.r, call.t);
        match &self.attrs {
            Attrs::Adam(a) => run_all(&mut call, &Adam::coeffs::<f32>(a, r, t)),
            Attrs::AdamW(a) => run_all(&mut call, &AdamWCoeffs::new(a, r, t)),
        }
    }
}

/// Runs `rule` over every group of `call`, by gradient type.
fn run_all<R: Rule>(call: &mut MixedCall<'_, '_>, rule: &R) -> Result<()> {
    run::<R, f32>(call, rule)?;
    run::<R, f16>(call, rule)?;
    run::<R, bf16>(call, rule)
}

/// The groups whose gradients have type `G`.
fn run<R: Rule, G: TensorElem + Element<C = f32>>(call: &mut MixedCall<'_, '_>, rule: &R) -> Result<()> {
    let ByGradient { call: this, groups, gradients } = call.gradients::<G>()?;
    if groups.is_empty() {
        return Ok(());
    }
    let params = groups
        .iter()
        .zip(&gradients)
        .map(|(&i, g)| {
            let m = Quantized { codes: this.stream(1, i), absmax: this.stream(2, i) };
            let v = Quantized { codes: this.stream(3, i), absmax: this.stream(4, i) };
            Param8bit::new(this.stream(0, i), g, m, v).map_err(|e| this.size_error(i, e))
        })
        .collect::<Result<Vec<_>>>()?;
    step(rule, params, &this.pool);
    Ok(())
}

/// Checks group `i`'s types, shapes and scale lengths.
fn check_group(l: &Layout, n: usize, i: usize, inputs: &[Tensor]) -> Result<()> {
    mixed_call::check_types_and_shapes(l, &TYPES, n, i, inputs, &[2, 4])?;
    let get = |k: usize| &inputs[k * n + i];
    let name = |k: usize| l.input_name(l.at(n, k, i), n);
    let x = get(0);
    let scales = blocks(x.numel);
    for k in [3, 5] {
        if get(k).numel != scales {
            let want = format!(
                "a tensor(float) with {scales} elements (one per {BLOCK} elements of X_{}, which has {})",
                i + 1,
                x.numel
            );
            return Err(Error::input(l.op, l.at(n, k, i), name(k), want, format!("shape {:?}", get(k).shape)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::optim::layout::testing::{check_counts, check_names, Expect};

    const EXPECT: Expect<'static> = Expect {
        inputs: &[
            "R",
            "T",
            "X_1",
            "X_2",
            "G_1",
            "G_2",
            "M_q_1",
            "M_q_2",
            "M_absmax_1",
            "M_absmax_2",
            "V_q_1",
            "V_q_2",
            "V_absmax_1",
            "V_absmax_2",
        ],
        outputs: &[
            "X_1_new",
            "X_2_new",
            "M_q_1_new",
            "M_q_2_new",
            "M_absmax_1_new",
            "M_absmax_2_new",
            "V_q_1_new",
            "V_q_2_new",
            "V_absmax_1_new",
            "V_absmax_2_new",
        ],
        good: &[(8, 1), (14, 2)],
        bad: &[0, 2, 7, 9, 13],
        arity_message: "Adam8bit: expected 2 + 6n inputs (R, T, then X_1..X_n, G_1..G_n, M_q_1..M_q_n",
        outputs_wrong: (4, "expected 5n = 10 outputs (X_new, M_q_new, M_absmax_new, V_q_new, V_absmax_new for each"),
    };

    #[test]
    fn names_and_counts_follow_the_variadic_layout() {
        check_names(&ADAM_8BIT.layout, &EXPECT);
        check_counts(&ADAM_8BIT.layout, &EXPECT);
        assert_eq!(ADAMW_8BIT.layout.input_name(4, 1), "M_q_1");
    }
}
