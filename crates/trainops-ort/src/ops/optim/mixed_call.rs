//! One run of an optimizer node whose input groups have different element types (the 8-bit
//! and bfloat16-state ops: float32 weights, 16- or 32-bit gradients, moments of their own
//! type), checked and planned as [`super::call::Call`] does for the float optimizers, whose
//! groups all share the weights' type. Each op checks its groups with its own function; every
//! output rewrites its input group (no flags, no copies).

use std::borrow::Cow;

use trainops_kernels::InOut;

use super::call::{broadcast_gradient, check_aligned, plan_memory, source, Snapshots};
use super::layout::{broadcastable, same_shape, Layout};
use crate::error::{Error, Result};
use crate::ffi::alias::{AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, ShapeInfer, Tensor};
use crate::ops::io;

/// Whether `dtype` may be group `k`'s element type (`want`; the gradient may be 16-bit).
pub fn fits(k: usize, want: DType, dtype: DType) -> bool {
    dtype == want || (k == 1 && matches!(dtype, DType::Float16 | DType::BFloat16))
}

/// The error for tensor `i` of group `k` having type `got` (group `k` takes `types[k]`;
/// the gradient, group 1, float32, float16 or bfloat16).
pub fn type_error(l: &Layout, types: &[DType], n: usize, k: usize, i: usize, got: DType) -> Error {
    let at = l.at(n, k, i);
    let want = if k == 1 { "tensor(float), tensor(float16) or tensor(bfloat16)".into() } else { types[k].name() };
    Error::input(l.op, at, l.input_name(at, n), want, got.name())
}

/// Shape inference: checks each known input type against `types` (see [`fits`]) and shapes
/// every output like the input it rewrites.
pub fn infer(l: &Layout, types: &[DType], ctx: &mut ShapeInfer<'_>) -> Result<()> {
    let n = l.arity(ctx.input_count()?)?;
    for i in 0..n {
        for (k, &want) in types.iter().enumerate() {
            let Some((dtype, _)) = ctx.input(l.at(n, k, i)) else { continue };
            if dtype != DType::Other(0) && !fits(k, want, dtype) {
                return Err(type_error(l, types, n, k, i, dtype));
            }
        }
        for (m, &group) in l.rewrites.iter().enumerate() {
            ctx.output_like_input(m * n + i, l.at(n, group, i))?;
        }
    }
    Ok(())
}

/// Checks group `i`'s types against `types` (see [`fits`]), that its gradient (group 1)
/// broadcasts to its weights (group 0), and that groups `like_x` are shaped like the weights.
pub fn check_types_and_shapes(
    l: &Layout,
    types: &[DType],
    n: usize,
    i: usize,
    inputs: &[Tensor],
    like_x: &[usize],
) -> Result<()> {
    let get = |k: usize| &inputs[k * n + i];
    let name = |k: usize| l.input_name(l.at(n, k, i), n);
    for (k, &want) in types.iter().enumerate() {
        if !fits(k, want, get(k).dtype) {
            return Err(type_error(l, types, n, k, i, get(k).dtype));
        }
    }
    let x = get(0);
    if !broadcastable(&get(1).shape, &x.shape) {
        let want = format!("a shape broadcastable to X_{}'s {:?}", i + 1, x.shape);
        return Err(Error::input(l.op, l.at(n, 1, i), name(1), want, format!("shape {:?}", get(1).shape)));
    }
    for &k in like_x {
        if !same_shape(&get(k).shape, &x.shape) {
            let want = format!("shape {:?} like X_{}", x.shape, i + 1);
            return Err(Error::input(l.op, l.at(n, k, i), name(k), want, format!("shape {:?}", get(k).shape)));
        }
    }
    Ok(())
}

/// Checks tensor group `i` of `n` (its types, shapes and sizes) among the node's inputs.
pub type CheckGroup = fn(&Layout, usize, usize, &[Tensor]) -> Result<()>;

/// The groups of one gradient type, viewed for a kernel (see [`MixedCall::gradients`]).
pub struct ByGradient<'v, 'c, 'a, G: Clone> {
    /// The call, now only read.
    pub call: &'v MixedCall<'c, 'a>,
    /// Group indices `i`.
    pub groups: Vec<usize>,
    /// Gradient of each group, broadcast to its weights' shape.
    pub gradients: Vec<Cow<'v, [G]>>,
}

/// One run of a mixed-type optimizer node, checked and planned.
pub struct MixedCall<'c, 'a> {
    /// The op's layout.
    pub layout: &'static Layout,
    /// Tensors per group.
    pub n: usize,
    /// The learning rate `R`.
    pub r: f64,
    /// The update count `T`.
    pub t: i64,
    inputs: Vec<Tensor>,
    /// The rewritten groups, in `Layout::rewrites` order.
    outputs: Vec<Tensor>,
    plan: AliasPlan,
    snapshots: Snapshots,
    /// The session's intra-op pool.
    pub pool: OrtPool<'c, 'a>,
}

impl<'c, 'a> MixedCall<'c, 'a> {
    /// Reads one run's inputs, checks each tensor group with `check_group`, allocates its
    /// outputs (each typed and shaped like the input it rewrites) and plans their memory.
    pub fn prepare(layout: &'static Layout, ctx: &'c mut Context<'a>, check_group: CheckGroup) -> Result<Self> {
        let (op, s, k) = (layout.op, layout.scalar_count(), layout.groups.len());
        let n = layout.arity(ctx.input_count()?)?;
        layout.check_outputs(ctx.output_count()?, n, false)?;
        let r = io::scalar_float(ctx, op, 0, "R")?;
        let (t, _) = io::scalar::<i64>(ctx, op, 1, "T")?;
        let inputs: Vec<Tensor> =
            (s..s + k * n).map(|j| io::required(ctx, op, j, &layout.input_name(j, n))).collect::<Result<_>>()?;
        for i in 0..n {
            check_group(layout, n, i, &inputs)?;
        }
        check_aligned(layout, n, &inputs)?;
        let mut outputs = Vec::with_capacity(layout.rewrites.len() * n);
        let mut regions = Vec::with_capacity(outputs.capacity());
        for (m, &group) in layout.rewrites.iter().enumerate() {
            for i in 0..n {
                let (o, own) = (m * n + i, group * n + i);
                let name = layout.output_name(o, n);
                let src = &inputs[own];
                let out = io::output(ctx, op, o, &name, src.dtype, &src.shape)?;
                regions.push(OutputRegion {
                    bytes: out.bytes(),
                    own_input: Some(own),
                    name: format!("output {o} ({name})"),
                });
                outputs.push(out);
            }
        }
        let (plan, snapshots) = plan_memory(op, &inputs, &regions)?;
        Ok(MixedCall { layout, n, r, t, inputs, outputs, plan, snapshots, pool: OrtPool::new(ctx) })
    }

    /// The stream of output group `m`, tensor `i`. The caller views each output once per
    /// `&mut self` borrow (one kernel step over each group).
    pub fn stream<T: TensorElem>(&self, m: usize, i: usize) -> InOut<'_, T> {
        let o = m * self.n + i;
        // SAFETY: outputs are pairwise disjoint (the plan checked), each is viewed once
        // (`gradients` takes `&mut self` and its caller views each group once), and no
        // input view overlaps it: an overlapping input is read from its snapshot, or is
        // this very buffer, updated in place without a second view.
        let dst = unsafe { self.outputs[o].slice_mut::<T>() };
        if self.plan.in_place[o] {
            InOut::in_place(dst)
        } else {
            let src = source::<T>(&self.inputs, &self.snapshots, self.layout.rewrites[m] * self.n + i);
            InOut::split(src, dst).expect("output sized like its input")
        }
    }

    /// The groups whose gradients have type `G` and their gradients, broadcast to the
    /// weights' shape where needed; the call is then only read, through `&Self`, so that
    /// [`MixedCall::stream`] views each group's outputs once.
    pub fn gradients<G: TensorElem>(&mut self) -> Result<ByGradient<'_, 'c, 'a, G>> {
        let (l, n) = (self.layout, self.n);
        let this: &Self = self;
        let gj = l.gradient * n;
        let groups: Vec<usize> = (0..n).filter(|&i| this.inputs[gj + i].dtype == G::DTYPE).collect();
        let mut gradients: Vec<Cow<'_, [G]>> = Vec::with_capacity(groups.len());
        for &i in &groups {
            let src = source::<G>(&this.inputs, &this.snapshots, gj + i);
            gradients.push(broadcast_gradient(l, n, i, &this.inputs, src)?);
        }
        Ok(ByGradient { call: this, groups, gradients })
    }

    /// The error for group `i`'s tensors of inconsistent sizes, named after its weights.
    pub fn size_error(&self, i: usize, e: impl ToString) -> Error {
        let (l, n) = (self.layout, self.n);
        let at = l.at(n, 0, i);
        Error::input(l.op, at, l.input_name(at, n), "consistent tensor sizes", e.to_string())
    }
}
