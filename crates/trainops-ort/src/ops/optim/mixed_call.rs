//! One run of an optimizer node whose input groups have different element types (the 8-bit
//! and bfloat16-state ops: float32 weights, 16- or 32-bit gradients, moments of their own
//! type), checked and planned as [`super::call::Call`] does for the float optimizers, whose
//! groups all share the weights' type. Each op checks its groups with its own function; every
//! output rewrites its input group (no flags, no copies).

use std::borrow::Cow;

use trainops_kernels::InOut;

use super::call::{broadcast_gradient, check_aligned, plan_memory, source, Snapshots};
use super::layout::Layout;
use crate::error::{Error, Result};
use crate::ffi::alias::{AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, Tensor};
use crate::ops::io;

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
