//! `com.trainops::ReluGrad(dY, X)`, `LeakyReluGrad(dY, X; alpha)`, `GeluGrad(dY, X;
//! approximate)`, `HardSigmoidGrad(dY, X; alpha, beta)`, `HardSwishGrad(dY, X)` and
//! `SiluGrad(dY, X)` (since version 1): float32 `dX = dY * f'(X)`, `dY` and `X` of one shape
//! (no broadcasting). `X` of ReluGrad may be Relu's output `Y` (`Y > 0` exactly when `X >
//! 0`); SiluGrad's `f` is `X * sigmoid(X)`.

use trainops_kernels::grad::activation::{self as kernels, Gelu};
use trainops_kernels::KernelError;

use super::{float_input, no_overlap};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

static INPUTS: [Formal; 2] = [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Float))];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];

/// Which activation a node differentiates, with its attributes.
#[derive(Clone, Copy)]
enum Act {
    Relu,
    LeakyRelu(f32),
    Gelu(Gelu),
    HardSigmoid(f32, f32),
    HardSwish,
    Silu,
}

/// One of the ops as registered in `com.trainops`.
pub struct ActivationGrad {
    signature: Signature,
}

/// `ReluGrad(dY, X) -> dX`.
pub static RELU_GRAD: ActivationGrad =
    ActivationGrad { signature: Signature { name: c"ReluGrad", inputs: &INPUTS, outputs: &OUTPUTS } };
/// `LeakyReluGrad(dY, X; alpha = 0.01) -> dX`.
pub static LEAKY_RELU_GRAD: ActivationGrad =
    ActivationGrad { signature: Signature { name: c"LeakyReluGrad", inputs: &INPUTS, outputs: &OUTPUTS } };
/// `GeluGrad(dY, X; approximate = "none") -> dX`.
pub static GELU_GRAD: ActivationGrad =
    ActivationGrad { signature: Signature { name: c"GeluGrad", inputs: &INPUTS, outputs: &OUTPUTS } };

/// `HardSigmoidGrad(dY, X; alpha = 0.2, beta = 0.5) -> dX`.
pub static HARD_SIGMOID_GRAD: ActivationGrad =
    ActivationGrad { signature: Signature { name: c"HardSigmoidGrad", inputs: &INPUTS, outputs: &OUTPUTS } };
/// `HardSwishGrad(dY, X) -> dX`.
pub static HARD_SWISH_GRAD: ActivationGrad =
    ActivationGrad { signature: Signature { name: c"HardSwishGrad", inputs: &INPUTS, outputs: &OUTPUTS } };
/// `SiluGrad(dY, X) -> dX`.
pub static SILU_GRAD: ActivationGrad =
    ActivationGrad { signature: Signature { name: c"SiluGrad", inputs: &INPUTS, outputs: &OUTPUTS } };

/// A float attribute that must be finite.
fn finite(info: &KernelInfo<'_>, op: &'static str, name: &'static str, default: f32) -> Result<f32> {
    let v = info.f32_or(name, default)?;
    if !v.is_finite() {
        return Err(Error::Attribute { op, name, what: format!("expected a finite value, got {v}") });
    }
    Ok(v)
}

impl OpSpec for ActivationGrad {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let op = self.op();
        let act = match op {
            "LeakyReluGrad" => Act::LeakyRelu(finite(info, op, "alpha", 0.01)?),
            "HardSigmoidGrad" => Act::HardSigmoid(finite(info, op, "alpha", 0.2)?, finite(info, op, "beta", 0.5)?),
            "HardSwishGrad" => Act::HardSwish,
            "SiluGrad" => Act::Silu,
            "GeluGrad" => match info.string_opt("approximate")?.as_deref() {
                None | Some("none") => Act::Gelu(Gelu::Erf),
                Some("tanh") => Act::Gelu(Gelu::Tanh),
                Some(other) => {
                    let what = format!("expected \"none\" or \"tanh\", got {other:?}");
                    return Err(Error::Attribute { op, name: "approximate", what });
                }
            },
            _ => Act::Relu,
        };
        Ok(Box::new(ActivationKernel { op, act }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        ctx.output_like_input(0, 1)
    }
}

struct ActivationKernel {
    op: &'static str,
    act: Act,
}

impl Kernel for ActivationKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = self.op;
        let gy_t = float_input(ctx, op, 0, "dY")?;
        let x_t = float_input(ctx, op, 1, "X")?;
        if gy_t.shape != x_t.shape {
            let want = format!("the shape of dY, {:?}", gy_t.shape);
            return Err(Error::input(op, 1, "X", want, format!("shape {:?}", x_t.shape)));
        }
        let out = io::output(ctx, op, 0, "dX", DType::Float, &x_t.shape)?;
        no_overlap(op, &out, &[("dY", &gy_t), ("X", &x_t)])?;
        // SAFETY: types, sizes and alignment checked; the output overlaps no input, and the
        // inputs are never written.
        let (gy, x, gx) = unsafe { (gy_t.slice::<f32>(), x_t.slice::<f32>(), out.slice_mut::<f32>()) };
        let pool = OrtPool::new(ctx);
        let done = match self.act {
            Act::Relu => kernels::relu_grad(gy, x, gx, &pool),
            Act::LeakyRelu(alpha) => kernels::leaky_relu_grad(gy, x, alpha, gx, &pool),
            Act::Gelu(g) => kernels::gelu_grad(gy, x, g, gx, &pool),
            Act::HardSigmoid(alpha, beta) => kernels::hard_sigmoid_grad(gy, x, alpha, beta, gx, &pool),
            Act::HardSwish => kernels::hard_swish_grad(gy, x, gx, &pool),
            Act::Silu => kernels::silu_grad(gy, x, gx, &pool),
        };
        done.map_err(|e: KernelError| Error::input(op, 1, "X", "as many elements as dY", e.to_string()))
    }
}
