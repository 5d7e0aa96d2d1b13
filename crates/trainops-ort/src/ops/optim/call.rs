//! One run of an optimizer-shaped node: [`Call::prepare`] reads and checks its inputs,
//! allocates and checks its outputs, plans their memory (in place, snapshots) and then hands
//! out typed views, so that the generic run path (`super::run`) only says which kernel
//! updates a tensor group; MixedPrecisionAdam adds finiteness, skipped steps and copies.

use std::any::Any;
use std::borrow::Cow;

use trainops_kernels::{broadcast, loss_scale, Element, InOut};

use super::layout::{InputInfo, Layout};
use crate::error::{Error, Result};
use crate::ffi::alias::{self, AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::{snapshot, TensorElem};
use crate::ffi::{Context, DType, Tensor};
use crate::ops::io;

/// Per input (after the scalars): its copy, when an output overlaps it (`alias::plan`).
pub(super) type Snapshots = Vec<Option<Box<dyn Any>>>;

/// One run of an optimizer node, checked and planned.
pub struct Call<'c, 'a> {
    /// The op's layout.
    pub layout: &'static Layout,
    /// Tensors per group.
    pub n: usize,
    /// The learning rate `R`.
    pub r: f64,
    /// The update count `T`.
    pub t: i64,
    /// The scalar inputs after `R, T` (float32, e.g. `loss_scale`).
    pub extra: Vec<f32>,
    inputs: Vec<Tensor>,
    /// Flags, then rewritten groups, then copies (output order).
    outputs: Vec<Tensor>,
    plan: AliasPlan,
    snapshots: Snapshots,
    /// Per group: its outputs were handed out (see [`Call::check_all_handled`]).
    handled: Vec<bool>,
    pool: OrtPool<'c, 'a>,
}

/// The groups of one `(X, G)` type pair, viewed for a kernel: their indices, their streams
/// (one per rewritten group, in `Layout::rewrites` order) and their gradients (broadcast to
/// the weights' shape where needed), and the pool to run on.
pub struct Views<'v, 'c, 'a, X, G: Clone, const N: usize> {
    /// Group indices `i`.
    pub groups: Vec<usize>,
    /// Streams of each group.
    pub streams: Vec<[InOut<'v, X>; N]>,
    /// Gradient of each group.
    pub gradients: Vec<Cow<'v, [G]>>,
    /// The session's intra-op pool.
    pub pool: &'v OrtPool<'c, 'a>,
}

impl<'c, 'a> Call<'c, 'a> {
    /// Reads and checks one run's inputs, allocates its outputs (flags as bool scalars;
    /// copies, when `copies` names their type, shaped like the weights) and plans their memory.
    pub fn prepare(layout: &'static Layout, ctx: &'c mut Context<'a>, copies: Option<DType>) -> Result<Self> {
        let (op, k, s) = (layout.op, layout.groups.len(), layout.scalar_count());
        let n = layout.arity(ctx.input_count()?)?;
        layout.check_outputs(ctx.output_count()?, n, copies.is_some())?;
        let r = io::scalar_float(ctx, op, 0, "R")?;
        let (t, _) = io::scalar::<i64>(ctx, op, 1, "T")?;
        let extra = (2..s)
            .map(|j| io::scalar::<f32>(ctx, op, j, layout.scalars[j]).map(|(v, _)| v))
            .collect::<Result<Vec<f32>>>()?;
        let inputs: Vec<Tensor> =
            (s..s + k * n).map(|j| io::required(ctx, op, j, &layout.input_name(j, n))).collect::<Result<_>>()?;
        for i in 0..n {
            let sigs: Vec<InputInfo> = (0..k).map(|g| InputInfo::of(&inputs[g * n + i])).collect();
            layout.check_group(n, i, &sigs, true)?;
        }
        check_aligned(layout, n, &inputs)?;
        // Every output: its index, expected type and shape, and the input it rewrites.
        let f = layout.flags.len();
        let m = layout.rewrites.len();
        let mut plan_out = Vec::new();
        for o in 0..f {
            plan_out.push((o, DType::Bool, Vec::new(), None));
        }
        for j in 0..(m + usize::from(copies.is_some())) * n {
            let x = &inputs[j % n];
            let (dtype, own) = match layout.rewrites.get(j / n) {
                Some(&group) => (inputs[group * n + j % n].dtype, Some(group * n + j % n)),
                None => (copies.unwrap_or(x.dtype), None),
            };
            plan_out.push((f + j, dtype, x.shape.clone(), own));
        }
        let mut outputs = Vec::with_capacity(plan_out.len());
        for (o, dtype, shape, _) in &plan_out {
            outputs.push(io::output(ctx, op, *o, &layout.output_name(*o, n), *dtype, shape)?);
        }
        let regions: Vec<OutputRegion> = outputs
            .iter()
            .zip(&plan_out)
            .map(|(t, (o, _, _, own))| OutputRegion {
                bytes: t.bytes(),
                own_input: *own,
                name: format!("output {o} ({})", layout.output_name(*o, n)),
            })
            .collect();
        let (plan, snapshots) = plan_memory(op, &inputs, &regions)?;
        let handled = vec![false; n];
        Ok(Call { layout, n, r, t, extra, inputs, outputs, plan, snapshots, handled, pool: OrtPool::new(ctx) })
    }

    /// Output index (in `outputs`) of tensor `i` of output group `m` (after the flags).
    fn out(&self, m: usize, i: usize) -> usize {
        self.layout.flags.len() + m * self.n + i
    }

    /// The groups whose weights have type `X` and gradients type `G`.
    pub fn groups_of<X: TensorElem, G: TensorElem>(&self) -> Vec<usize> {
        let g = self.layout.gradient * self.n;
        (0..self.n).filter(|&i| self.inputs[i].dtype == X::DTYPE && self.inputs[g + i].dtype == G::DTYPE).collect()
    }

    /// Input `j` (after the scalars) as `T`, from its snapshot if it has one.
    fn source<T: TensorElem>(&self, j: usize) -> &[T] {
        source(&self.inputs, &self.snapshots, j)
    }

    /// The gradient of group `i`, broadcast to the weights' shape where needed.
    fn gradient<G: TensorElem>(&self, i: usize) -> Result<Cow<'_, [G]>> {
        broadcast_gradient(self.layout, self.n, i, &self.inputs, self.source::<G>(self.layout.gradient * self.n + i))
    }

    /// The views of every group of type pair `(X, G)`. They borrow the call mutably, so no
    /// other view of it can be alive at the same time; `N` is the number of rewritten groups.
    pub fn views<X: TensorElem, G: TensorElem, const N: usize>(&mut self) -> Result<Views<'_, 'c, 'a, X, G, N>> {
        let groups = self.groups_of::<X, G>();
        for &i in &groups {
            self.handled[i] = true;
        }
        let this: &Self = self;
        let mut streams = Vec::with_capacity(groups.len());
        let mut gradients = Vec::with_capacity(groups.len());
        for &i in &groups {
            let group_streams: Vec<InOut<'_, X>> = this
                .layout
                .rewrites
                .iter()
                .enumerate()
                .map(|(m, &group)| {
                    let o = this.out(m, i);
                    // SAFETY: outputs are pairwise disjoint (the plan checked), each is
                    // viewed once (views borrow the call mutably), and no input view
                    // overlaps it: an overlapping input is read from its snapshot, or is this
                    // very buffer, updated in place without a second view.
                    let dst = unsafe { this.outputs[o].slice_mut::<X>() };
                    if this.plan.in_place[o] {
                        InOut::in_place(dst)
                    } else {
                        InOut::split(this.source::<X>(group * this.n + i), dst).expect("output sized like its input")
                    }
                })
                .collect();
            match <[InOut<'_, X>; N]>::try_from(group_streams) {
                Ok(s) => streams.push(s),
                Err(_) => unreachable!("{} rewrites {} groups", this.layout.op, this.layout.rewrites.len()),
            }
            gradients.push(this.gradient::<G>(i)?);
        }
        Ok(Views { groups, streams, gradients, pool: &this.pool })
    }

    /// True when every gradient of type `G`, divided by `loss_scale` when given, is finite.
    pub fn gradients_finite<X: TensorElem, G: TensorElem + Element>(&mut self, loss_scale: Option<G::C>) -> bool {
        let gj = self.layout.gradient * self.n;
        let groups = self.groups_of::<X, G>();
        let grads: Vec<&[G]> = groups.iter().map(|&i| self.source::<G>(gj + i)).collect();
        loss_scale::all_finite(&grads, loss_scale, &self.pool)
    }

    /// Makes every rewritten output equal its input (a skipped step).
    pub fn keep_inputs<X: TensorElem, G: TensorElem, const N: usize>(&mut self) -> Result<()> {
        let views = self.views::<X, G, N>()?;
        for streams in views.streams {
            for mut s in streams {
                if let trainops_kernels::stream::Access::Split(src, dst) = s.access() {
                    dst.copy_from_slice(src);
                }
            }
        }
        Ok(())
    }

    /// Writes the copies of groups with weights `X`: each `X_copy` is the weights' output
    /// (`X_new`) converted to `C`.
    pub fn cast_copies<X: TensorElem + Element, C: TensorElem + Element<C = X::C>>(&mut self) -> Result<()> {
        let m = self.layout.rewrites.len();
        let groups: Vec<usize> = (0..self.n).filter(|&i| self.inputs[i].dtype == X::DTYPE).collect();
        let pairs: Vec<(&[X], &mut [C])> = groups
            .iter()
            .map(|&i| {
                // SAFETY: `&mut self` guarantees no view of this call is alive; X_new and
                // X_copy are distinct outputs, which the plan proved disjoint; each copy
                // output is viewed once here.
                unsafe { (self.outputs[self.out(0, i)].slice::<X>(), self.outputs[self.out(m, i)].slice_mut::<C>()) }
            })
            .collect();
        loss_scale::cast(pairs, &self.pool);
        Ok(())
    }

    /// An error naming the first tensor group no kernel handled (a type combination the op
    /// does not compute), so that no output is returned unwritten.
    pub fn check_all_handled(&self) -> Result<()> {
        let Some(i) = self.handled.iter().position(|&h| !h) else { return Ok(()) };
        let (l, n) = (self.layout, self.n);
        let g = self.inputs[l.gradient * n + i].dtype;
        let got = format!("{} with {} gradients", self.inputs[i].dtype.name(), g.name());
        Err(Error::input(
            l.op,
            l.scalar_count() + i,
            l.input_name(l.scalar_count() + i, n),
            "a type combination this op computes",
            got,
        ))
    }

    /// Sets flag output `k`.
    pub fn set_flag(&mut self, k: usize, value: bool) {
        // SAFETY: a bool scalar output (checked in `prepare`), disjoint from every other
        // output; `&mut self` guarantees no other view of it.
        let flag = unsafe { self.outputs[k].slice_mut::<bool>() };
        flag[0] = value;
    }
}

/// An error naming the first input (after the scalars) whose buffer is misaligned for its type.
pub(super) fn check_aligned(layout: &Layout, n: usize, inputs: &[Tensor]) -> Result<()> {
    let s = layout.scalar_count();
    if let Some(j) = inputs.iter().position(|t| !t.aligned()) {
        let name = layout.input_name(j + s, n);
        return Err(Error::input(layout.op, j + s, name, "a buffer aligned for its type", "a misaligned one"));
    }
    Ok(())
}

/// Plans the outputs' memory against the inputs (`alias::plan`), then copies every input an
/// output overlaps before any output slice exists: the plan and one snapshot per input.
pub(super) fn plan_memory(
    op: &'static str,
    inputs: &[Tensor],
    regions: &[OutputRegion],
) -> Result<(AliasPlan, Snapshots)> {
    let in_bytes: Vec<_> = inputs.iter().map(Tensor::bytes).collect();
    let plan = alias::plan(op, &in_bytes, regions)?;
    let snapshots = inputs
        .iter()
        .zip(&plan.snapshot)
        .map(|(t, &snap)| {
            // SAFETY: no mutable view of any buffer exists yet (outputs are viewed later).
            snap.then(|| unsafe { snapshot(t) }).flatten()
        })
        .collect();
    Ok((plan, snapshots))
}

/// Input `j` (after the scalars) as `T`, from its snapshot if it has one.
pub(super) fn source<'t, T: TensorElem>(
    inputs: &'t [Tensor],
    snapshots: &'t [Option<Box<dyn Any>>],
    j: usize,
) -> &'t [T] {
    match &snapshots[j] {
        Some(b) => b.downcast_ref::<Vec<T>>().expect("snapshot of the checked type"),
        // SAFETY: the plan proved no output overlaps this input (else it would be a
        // snapshot), and inputs are never written, so this view stays immutable.
        None => unsafe { inputs[j].slice::<T>() },
    }
}

/// Group `i`'s gradient `src`, broadcast to its weights' shape where needed.
pub(super) fn broadcast_gradient<'t, G: TensorElem>(
    l: &Layout,
    n: usize,
    i: usize,
    inputs: &[Tensor],
    src: &'t [G],
) -> Result<Cow<'t, [G]>> {
    let gj = l.gradient * n + i;
    let (x, g) = (&inputs[i], &inputs[gj]);
    if g.shape == x.shape {
        return Ok(Cow::Borrowed(src));
    }
    let wide = broadcast::broadcast_to(src, &g.dims(), &x.dims());
    let name = l.input_name(gj + l.scalar_count(), n);
    wide.map(Cow::Owned)
        .map_err(|e| Error::input(l.op, gj + l.scalar_count(), name, "a broadcastable shape", e.to_string()))
}
