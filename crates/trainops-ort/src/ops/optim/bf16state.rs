//! `com.trainops::AdamBf16State` and `com.trainops::AdamWBf16State` (since version 1):
//! Adam (ONNX's formula and attributes) and AdamW (PyTorch's, `com.trainops::AdamW`'s
//! attributes without `amsgrad`) with bfloat16 moments, rounded stochastically when stored.
//! The format, the rounding and the random bits are `trainops_kernels::optim::bf16state`.
//!
//! Inputs `R, T`, then `X_1..X_n, G_1..G_n, M_1..M_n, V_1..V_n`; outputs `X_1_new..X_n_new,
//! M_1_new..M_n_new, V_1_new..V_n_new` (each may be bound to its input's buffer). `X` float32;
//! `G` float32, float16 or bfloat16, broadcastable to `X`; `M`, `V` bfloat16 shaped like `X`
//! (Adam's `V` and `H`). Attribute `seed` (int, default 0) keys the random bits; tensor
//! `X_i` (`i` from 1) is tensor `i - 1` of the counter, `T` its step word. AdamW counts `T`
//! from 1, as torch's `step`.

use half::{bf16, f16};
use trainops_kernels::optim::adam::{Adam, AdamAttrs};
use trainops_kernels::optim::adamw::AdamWCoeffs;
use trainops_kernels::optim::bf16state::{step, ParamBf16, Rule, Stochastic};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::Element;

use super::attrs::{self, AdamWNoAmsgrad};
use super::layout::{optimizer_signature, Layout};
#[cfg(test)]
use super::mixed_call::fits;
use super::mixed_call::{self, ByGradient, MixedCall};
use crate::error::{Error, Result};
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};

/// A bfloat16-state optimizer op: its signature, its variadic layout and which rule it runs.
pub struct Bf16StateOp {
    signature: Signature,
    /// Names and counts of the inputs and outputs.
    pub layout: Layout,
    adamw: bool,
}

/// The four input groups.
const GROUPS: &[&str] = &["X", "G", "M", "V"];
/// What each group's elements are (the gradient's float32 is one of three).
const TYPES: [DType; 4] = [DType::Float, DType::Float, DType::BFloat16, DType::BFloat16];

const fn layout(op: &'static str) -> Layout {
    Layout { op, groups: GROUPS, gradient: 1, rewrites: &[0, 2, 3], weights: &[DType::Float], ..Layout::ONNX }
}

/// `com.trainops::AdamBf16State`.
pub static ADAM_BF16_STATE: Bf16StateOp =
    Bf16StateOp { signature: optimizer_signature(c"AdamBf16State"), layout: layout("AdamBf16State"), adamw: false };

/// `com.trainops::AdamWBf16State`.
pub static ADAMW_BF16_STATE: Bf16StateOp =
    Bf16StateOp { signature: optimizer_signature(c"AdamWBf16State"), layout: layout("AdamWBf16State"), adamw: true };

/// A node's attributes.
enum Attrs {
    Adam(AdamAttrs),
    AdamW(trainops_kernels::optim::adamw::AdamWAttrs),
}

impl OpSpec for Bf16StateOp {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        // The family's one reader, naming this op: AdamW's table without amsgrad, or Adam's.
        let op = self.layout.op;
        let attrs = if self.adamw {
            Attrs::AdamW(attrs::read::<AdamWNoAmsgrad>(op, info)?.0)
        } else {
            Attrs::Adam(attrs::read::<AdamAttrs>(op, info)?)
        };
        let seed = info.i64_opt("seed")?.unwrap_or(0);
        Ok(Box::new(Bf16StateKernel { layout: &self.layout, attrs, seed }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        mixed_call::infer(&self.layout, &TYPES, ctx)
    }
}

struct Bf16StateKernel {
    layout: &'static Layout,
    attrs: Attrs,
    seed: i64,
}

impl Kernel for Bf16StateKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = MixedCall::prepare(self.layout, ctx, check_group)?;
        let (r, t) = (call.r, call.t);
        let bits = Stochastic::new(self.seed, call.t);
        match &self.attrs {
            Attrs::Adam(a) => run_all(&mut call, &Adam::coeffs::<f32>(a, r, t), &bits),
            Attrs::AdamW(a) => {
                if call.t < 1 {
                    let want = "an update count >= 1 (1 on the first update, as torch's step)";
                    return Err(Error::input(self.layout.op, 1, "T", want, call.t.to_string()));
                }
                run_all(&mut call, &AdamWCoeffs::<f32>::new(a, r, t), &bits)
            }
        }
    }
}

/// Runs `rule` over every group of `call`, by gradient type.
fn run_all<R: Rule>(call: &mut MixedCall<'_, '_>, rule: &R, bits: &Stochastic) -> Result<()> {
    run::<R, f32>(call, rule, bits)?;
    run::<R, f16>(call, rule, bits)?;
    run::<R, bf16>(call, rule, bits)
}

/// The groups whose gradients have type `G`.
fn run<R: Rule, G: TensorElem + Element<C = f32>>(
    call: &mut MixedCall<'_, '_>,
    rule: &R,
    bits: &Stochastic,
) -> Result<()> {
    let ByGradient { call: this, groups, gradients } = call.gradients::<G>()?;
    if groups.is_empty() {
        return Ok(());
    }
    let params = groups
        .iter()
        .zip(&gradients)
        .map(|(&i, g)| {
            let tensor = u32::try_from(i).expect("fewer than 2^32 tensors in a node");
            ParamBf16::new(this.stream(0, i), g, this.stream(1, i), this.stream(2, i), tensor)
                .map_err(|e| this.size_error(i, e))
        })
        .collect::<Result<Vec<_>>>()?;
    step(rule, bits, params, &this.pool);
    Ok(())
}

/// Checks group `i`'s types and shapes.
fn check_group(l: &Layout, n: usize, i: usize, inputs: &[Tensor]) -> Result<()> {
    mixed_call::check_types_and_shapes(l, &TYPES, n, i, inputs, &[2, 3])
}

/// [`mixed_call::type_error`] with this op's types.
#[cfg(test)]
fn type_error(l: &Layout, n: usize, k: usize, i: usize, got: DType) -> Error {
    mixed_call::type_error(l, &TYPES, n, k, i, got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::optim::layout::testing::{check_counts, check_names, Expect};

    const EXPECT: Expect<'static> = Expect {
        inputs: &["R", "T", "X_1", "X_2", "G_1", "G_2", "M_1", "M_2", "V_1", "V_2"],
        outputs: &["X_1_new", "X_2_new", "M_1_new", "M_2_new", "V_1_new", "V_2_new"],
        good: &[(6, 1), (10, 2)],
        bad: &[0, 2, 5, 7, 9],
        arity_message: "AdamBf16State: expected 2 + 4n inputs (R, T, then X_1..X_n, G_1..G_n, M_1..M_n, V_1..V_n",
        outputs_wrong: (4, "expected 3n = 6 outputs (X_new, M_new, V_new for each of n = 2 tensors), got 4"),
    };

    #[test]
    fn names_and_counts_follow_the_variadic_layout() {
        check_names(&ADAM_BF16_STATE.layout, &EXPECT);
        check_counts(&ADAM_BF16_STATE.layout, &EXPECT);
        assert_eq!(ADAMW_BF16_STATE.layout.input_name(4, 1), "M_1");
        assert!(ADAMW_BF16_STATE.layout.arity(7).unwrap_err().to_string().starts_with("AdamWBf16State: expected"));
    }

    #[test]
    fn types_are_float_weights_and_bfloat16_moments() {
        assert!(fits(1, DType::Float, DType::BFloat16) && fits(1, DType::Float, DType::Float16));
        assert!(!fits(2, DType::BFloat16, DType::Float) && !fits(0, DType::Float, DType::BFloat16));
        let msg = type_error(&ADAM_BF16_STATE.layout, 1, 2, 0, DType::Float).to_string();
        assert!(msg.contains("AdamBf16State") && msg.contains("M_1") && msg.contains("tensor(bfloat16)"), "{msg}");
    }
}
