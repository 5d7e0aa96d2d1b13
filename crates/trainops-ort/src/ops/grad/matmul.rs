//! `com.trainops::BlockedMatMul(A, B) -> Y` (since version 1), attributes `transA` and
//! `transB` (0 or 1, default 0): `Y = op(A) op(B)` in float32 on trainops' blocked product
//! (`trainops_kernels::matmul`: every element an FMA chain over the depth in order, the same
//! bits at any thread count). A is `[..., m, k]` (its leading axes are rows of Y), or `[k,
//! m]` with `transA` (rank 2 only); B is `[k, n]`, or `[n, k]` with `transB`. Y is A's leading
//! axes and `[m, n]`. The autodiff emits it for the products onnxruntime's MLAS runs slowest
//! with operands given as inputs: a weight's gradient `X^T dY` and a product over a deep
//! axis (a language model's output layer).

use trainops_kernels::matmul::{matmul, Dims};

use super::{disjoint, float_input, shape_i64};
use crate::error::{Error, Result};
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature};
use crate::ops::io;

const OP: &str = "BlockedMatMul";

/// The op as registered in `com.trainops`.
pub struct BlockedMatMul;

static INPUTS: [Formal; 2] = [Formal::One(Some(DType::Float)), Formal::One(Some(DType::Float))];
static OUTPUTS: [Formal; 1] = [Formal::One(Some(DType::Float))];
static SIGNATURE: Signature = Signature { name: c"BlockedMatMul", inputs: &INPUTS, outputs: &OUTPUTS };

/// A 0/1 attribute, checked.
fn flag(info: &KernelInfo<'_>, name: &'static str) -> Result<bool> {
    match info.i64_opt(name)?.unwrap_or(0) {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(Error::Attribute { op: OP, name, what: format!("expected 0 or 1, got {v}") }),
    }
}

impl OpSpec for BlockedMatMul {
    fn signature(&self) -> &Signature {
        &SIGNATURE
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        Ok(Box::new(BlockedMatMulKernel { trans_a: flag(info, "transA")?, trans_b: flag(info, "transB")? }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let (trans_a, trans_b) = (ctx.attr_i64(c"transA").unwrap_or(0) == 1, ctx.attr_i64(c"transB").unwrap_or(0) == 1);
        let (Some((_, a)), Some((_, b))) = (ctx.input(0), ctx.input(1)) else { return Ok(()) };
        if a.len() < 2 || b.len() != 2 || (trans_a && a.len() != 2) {
            return Ok(()); // the kernel says what it expects
        }
        let known = |d: i64| (d >= 0).then_some(d);
        let mut dims: Vec<Option<i64>> = match trans_a {
            true => vec![known(a[1])],
            false => a[..a.len() - 1].iter().map(|&d| known(d)).collect(),
        };
        dims.push(known(if trans_b { b[0] } else { b[1] }));
        ctx.set_output(0, DType::Float, Some(&dims))
    }
}

struct BlockedMatMulKernel {
    trans_a: bool,
    trans_b: bool,
}

impl Kernel for BlockedMatMulKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let a = float_input(ctx, OP, 0, "A")?;
        let b = float_input(ctx, OP, 1, "B")?;
        let (ad, bd) = (a.dims(), b.dims());
        let a_want = if self.trans_a { "rank 2 (attribute transA = 1)" } else { "rank >= 2" };
        if ad.len() < 2 || (self.trans_a && ad.len() != 2) {
            return Err(Error::input(OP, 0, "A", a_want, format!("shape {:?}", a.shape)));
        }
        if bd.len() != 2 {
            return Err(Error::input(OP, 1, "B", "rank 2", format!("shape {:?}", b.shape)));
        }
        let (rows, k) = match self.trans_a {
            true => (ad[1], ad[0]),
            false => {
                let lead = &ad[..ad.len() - 1];
                let m = trainops_kernels::shape::numel(lead).ok_or_else(|| {
                    Error::input(OP, 0, "A", "dimensions whose product fits in 64 bits", format!("shape {:?}", a.shape))
                })?;
                (m, ad[ad.len() - 1])
            }
        };
        let (kb, n) = if self.trans_b { (bd[1], bd[0]) } else { (bd[0], bd[1]) };
        if kb != k {
            let side = if self.trans_b { "[n, k]" } else { "[k, n]" };
            let want = format!("{side} with k = {k} (A's {} axis)", if self.trans_a { "first" } else { "last" });
            return Err(Error::input(OP, 1, "B", want, format!("shape {:?}", b.shape)));
        }
        let mut out_dims: Vec<usize> = if self.trans_a { vec![rows] } else { ad[..ad.len() - 1].to_vec() };
        out_dims.push(n);
        let out = io::output(ctx, OP, 0, "Y", DType::Float, &shape_i64(OP, 0, "A", &out_dims)?)?;
        disjoint(OP, &[("Y", &out)], &[("A", &a), ("B", &b)])?;
        // SAFETY: float32 and aligned (checked); the output overlaps no input (checked).
        let (av, bv, y) = unsafe { (a.slice::<f32>(), b.slice::<f32>(), out.slice_mut::<f32>()) };
        let dims = Dims { m: rows, n, k, trans_a: self.trans_a, trans_b: self.trans_b };
        matmul(&OrtPool::new(ctx), dims, av, bv, 1.0, None, y).map_err(|e| Error::kernel(OP, e))
    }
}
