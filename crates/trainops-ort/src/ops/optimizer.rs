//! What the optimizer ops share: a few scalar inputs (`R, T`, and `loss_scale` for
//! MixedPrecisionAdam), then groups of `n` tensors each (`X..., G..., V..., H...` for Adam);
//! outputs: a few flags (`finite`), then groups that rewrite input groups
//! (`X_new..., V_new..., H_new...`), then optionally 16-bit copies of the new weights.
//!
//! A [`Layout`] names all of that; it checks a node at load and at run time. A [`Call`]
//! holds one run's checked tensors, its alias plan and its snapshots, and hands out typed
//! views, so that each op only says how to update one tensor group.
//!
//! Types: weights `X` (and every group but the gradient) float, double, float16 or
//! bfloat16; the gradient `G` of `X`'s type, or float16 / bfloat16 with float32 weights.

use std::any::Any;
use std::borrow::Cow;

use trainops_kernels::{broadcast, mixed, Element, InOut};

use super::common::{broadcastable, required, same_shape, scalar_f32, scalar_float, scalar_i64, Sig};
use crate::error::{Error, Result};
use crate::ffi::alias::{self, AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::{snapshot, TensorElem};
use crate::ffi::{Context, DType, Formal, ShapeInfer, Signature, Tensor};

/// Formal inputs of the ONNX optimizers: `R` (any float type), `T` (int64), the tensors.
const INPUTS: [Formal; 3] =
    [Formal::One(None), Formal::One(Some(DType::Int64)), Formal::Variadic { dtype: None, min: 1 }];
/// Formal outputs of the ONNX optimizers: the rewritten tensors.
const OUTPUTS: [Formal; 1] = [Formal::Variadic { dtype: None, min: 1 }];

/// The signature of an ONNX-style optimizer named `name`: `R, T`, the tensors in; the
/// rewritten tensors out (types checked at run time, see [`Layout`]).
pub const fn optimizer_signature(name: &'static std::ffi::CStr) -> Signature {
    Signature { name, inputs: &INPUTS, outputs: &OUTPUTS }
}

/// The variadic layout of one optimizer op.
#[derive(Debug)]
pub struct Layout {
    /// Op name.
    pub op: &'static str,
    /// Scalar inputs before the groups; the first two are always `R` (float or double) and
    /// `T` (int64), any further ones are float scalars.
    pub scalars: &'static [&'static str],
    /// Input group names after the scalars, e.g. `["X", "G", "V", "H"]`; group 0 is the
    /// weights.
    pub groups: &'static [&'static str],
    /// The index in `groups` of the gradient (the only group that may broadcast, and whose
    /// type may be 16-bit with float32 weights).
    pub gradient: usize,
    /// For each output group, the input group it rewrites, e.g. `[0, 2, 3]`.
    pub rewrites: &'static [usize],
    /// Bool scalar outputs before the groups (e.g. `finite`).
    pub flags: &'static [&'static str],
    /// Element types the weights may have.
    pub weights: &'static [DType],
}

/// Runs `$run::<X, G>(call, coefficients)` for every weight/gradient type pair a [`Layout`]
/// accepts (`$c32` for the pairs that compute in `f32`, `$c64` for `f64`), then checks that
/// every tensor group of the node was handled, so no output is ever left unwritten.
macro_rules! for_each_type_pair {
    ($call:expr, $run:ident, $c32:expr, $c64:expr) => {{
        $run::<f32, f32>($call, $c32)?;
        $run::<f32, half::f16>($call, $c32)?;
        $run::<f32, half::bf16>($call, $c32)?;
        $run::<half::f16, half::f16>($call, $c32)?;
        $run::<half::bf16, half::bf16>($call, $c32)?;
        $run::<f64, f64>($call, $c64)?;
        $call.check_all_handled()
    }};
}
pub(crate) use for_each_type_pair;

impl Layout {
    /// The layout of an ONNX training-domain optimizer: `R, T`, the groups, no flags.
    pub const ONNX: Layout = Layout {
        op: "",
        scalars: &["R", "T"],
        groups: &[],
        gradient: 1,
        rewrites: &[],
        flags: &[],
        weights: &[DType::Float, DType::Double, DType::Float16, DType::BFloat16],
    };
}

/// Whether gradients of type `g` may update weights of type `x`.
fn gradient_fits(x: DType, g: DType) -> bool {
    g == x || (x == DType::Float && matches!(g, DType::Float16 | DType::BFloat16))
}

impl Layout {
    fn s(&self) -> usize {
        self.scalars.len()
    }

    /// Formal name of input `index` in a node of `n` tensors (`R`, `T`, `X_1`, ...).
    pub fn input_name(&self, index: usize, n: usize) -> String {
        match self.scalars.get(index) {
            Some(name) => (*name).into(),
            None => {
                let j = index - self.s();
                format!("{}_{}", self.groups[(j / n).min(self.groups.len() - 1)], j % n + 1)
            }
        }
    }

    /// Formal name of output `index` (`finite`, `X_1_new`, ..., `X_1_copy`, ...).
    pub fn output_name(&self, index: usize, n: usize) -> String {
        if let Some(name) = self.flags.get(index) {
            return (*name).into();
        }
        let j = index - self.flags.len();
        match self.rewrites.get(j / n) {
            Some(&group) => format!("{}_{}_new", self.groups[group], j % n + 1),
            None => format!("{}_{}_copy", self.groups[0], j % n + 1),
        }
    }

    /// `n` from the input count `scalars + groups * n`.
    pub fn arity(&self, inputs: usize) -> Result<usize> {
        let (s, k) = (self.s(), self.groups.len());
        if inputs >= s + k && (inputs - s).is_multiple_of(k) {
            return Ok((inputs - s) / k);
        }
        let lists: Vec<String> = self.groups.iter().map(|g| format!("{g}_1..{g}_n")).collect();
        Err(Error::Arity {
            op: self.op,
            what: format!(
                "expected {s} + {k}n inputs ({}, then {}, n >= 1), got {inputs}",
                self.scalars.join(", "),
                lists.join(", ")
            ),
        })
    }

    /// Checks the output count `flags + (rewrites + copies) * n`.
    pub fn check_outputs(&self, outputs: usize, n: usize, copies: bool) -> Result<()> {
        let m = self.rewrites.len() + usize::from(copies);
        let f = self.flags.len();
        if outputs == f + m * n {
            return Ok(());
        }
        let mut names: Vec<String> = self.rewrites.iter().map(|&g| format!("{}_new", self.groups[g])).collect();
        if copies {
            names.push(format!("{}_copy", self.groups[0]));
        }
        let lead = if f == 0 { String::new() } else { format!("{f} + ") };
        let flags = if f == 0 { String::new() } else { format!("{}, then ", self.flags.join(", ")) };
        Err(Error::Arity {
            op: self.op,
            what: format!(
                "expected {lead}{m}n = {} outputs ({flags}{} for each of n = {n} tensors), got {outputs}",
                f + m * n,
                names.join(", ")
            ),
        })
    }

    /// Node index of tensor `i` of group `k`.
    fn at(&self, n: usize, k: usize, i: usize) -> usize {
        self.s() + k * n + i
    }

    /// Checks tensor group `i` (one signature per input group); `shapes` is false at load
    /// time, when a missing shape cannot be told from a scalar.
    pub fn check_group(&self, n: usize, i: usize, sigs: &[Sig], shapes: bool) -> Result<()> {
        let x = &sigs[0];
        let name = |k: usize| self.input_name(self.at(n, k, i), n);
        if !self.weights.contains(&x.dtype) {
            let names: Vec<String> = self.weights.iter().map(|d| d.name()).collect();
            let want = match names.split_last() {
                Some((last, [])) => last.clone(),
                Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                None => "no type".into(),
            };
            return Err(Error::input(self.op, self.at(n, 0, i), name(0), want, x.dtype.name()));
        }
        for (k, s) in sigs.iter().enumerate().skip(1) {
            let fits = if k == self.gradient { gradient_fits(x.dtype, s.dtype) } else { s.dtype == x.dtype };
            if !fits {
                let mut want = format!("{} like X_{}", x.dtype.name(), i + 1);
                if k == self.gradient && x.dtype == DType::Float {
                    want.push_str(" (or tensor(float16) / tensor(bfloat16) gradients)");
                }
                return Err(Error::input(self.op, self.at(n, k, i), name(k), want, s.dtype.name()));
            }
        }
        if !shapes {
            return Ok(());
        }
        for (k, s) in sigs.iter().enumerate().skip(1) {
            if k == self.gradient {
                if !broadcastable(&s.shape, &x.shape) {
                    let want = format!("a shape broadcastable to X_{}'s {:?}", i + 1, x.shape);
                    return Err(Error::input(self.op, self.at(n, k, i), name(k), want, format!("shape {:?}", s.shape)));
                }
            } else if !same_shape(&s.shape, &x.shape) {
                let want = format!("shape {:?} like X_{}", x.shape, i + 1);
                return Err(Error::input(self.op, self.at(n, k, i), name(k), want, format!("shape {:?}", s.shape)));
            }
        }
        Ok(())
    }

    /// Shape inference at load: arity, element types where known, output shapes.
    pub fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let n = self.arity(ctx.input_count()?)?;
        let known = |s: Option<(DType, Vec<i64>)>| s.filter(|(d, _)| *d != DType::Other(0));
        if let Some((d, _)) = known(ctx.input(0)) {
            if !matches!(d, DType::Float | DType::Double) {
                let want = "a tensor(float) or tensor(double) with exactly one element";
                return Err(Error::input(self.op, 0, "R", want, d.name()));
            }
        }
        let f = self.flags.len();
        for i in 0..n {
            let sigs: Option<Vec<Sig>> = (0..self.groups.len())
                .map(|k| known(ctx.input(self.at(n, k, i))).map(|(dtype, shape)| Sig { dtype, shape }))
                .collect();
            if let Some(sigs) = sigs {
                self.check_group(n, i, &sigs, false)?;
            }
            // A rank-0 answer may mean "no shape known": leave the outputs unknown then.
            if ctx.input(self.at(n, 0, i)).is_some_and(|(_, shape)| !shape.is_empty()) {
                for m in 0..self.rewrites.len() {
                    ctx.output_like_input(f + m * n + i, self.at(n, 0, i))?;
                }
            }
        }
        Ok(())
    }

    /// Reads and checks one run's inputs, allocates its outputs (flags as bool scalars;
    /// copies, when `copies` names their type, shaped like the weights) and plans their memory.
    pub fn prepare<'c, 'a>(&'static self, ctx: &'c mut Context<'a>, copies: Option<DType>) -> Result<Call<'c, 'a>> {
        let (op, k, s) = (self.op, self.groups.len(), self.s());
        let n = self.arity(ctx.input_count()?)?;
        self.check_outputs(ctx.output_count()?, n, copies.is_some())?;
        let r = scalar_float(ctx, op, 0, "R")?;
        let t = scalar_i64(ctx, op, 1, "T")?;
        let extra = (2..s).map(|j| scalar_f32(ctx, op, j, self.scalars[j])).collect::<Result<Vec<f32>>>()?;
        let inputs: Vec<Tensor> =
            (s..s + k * n).map(|j| required(ctx, op, j, &self.input_name(j, n))).collect::<Result<_>>()?;
        for i in 0..n {
            let sigs: Vec<Sig> = (0..k).map(|g| Sig::of(&inputs[g * n + i])).collect();
            self.check_group(n, i, &sigs, true)?;
        }
        if let Some(j) = inputs.iter().position(|t| !t.aligned()) {
            let name = self.input_name(j + s, n);
            return Err(Error::input(op, j + s, name, "a buffer aligned for its type", "a misaligned one"));
        }
        // Every output: its index, expected type and shape, and the input it rewrites.
        let f = self.flags.len();
        let m = self.rewrites.len();
        let mut plan_out = Vec::new();
        for o in 0..f {
            plan_out.push((o, DType::Bool, Vec::new(), None));
        }
        for j in 0..(m + usize::from(copies.is_some())) * n {
            let x = &inputs[j % n];
            let (dtype, own) = match self.rewrites.get(j / n) {
                Some(&group) => (inputs[group * n + j % n].dtype, Some(group * n + j % n)),
                None => (copies.unwrap_or(x.dtype), None),
            };
            plan_out.push((f + j, dtype, x.shape.clone(), own));
        }
        let mut outputs = Vec::with_capacity(plan_out.len());
        for (o, dtype, shape, _) in &plan_out {
            let out = ctx.output(*o, shape)?;
            let want_numel = trainops_numel(shape);
            let name = || self.output_name(*o, n);
            if out.dtype != *dtype || out.numel != want_numel {
                let got = format!("a {} buffer of {} elements", out.dtype.name(), out.numel);
                let expected = format!("a {} buffer of {want_numel} elements", dtype.name());
                return Err(Error::Output { op, index: *o, name: name(), expected, got });
            }
            if !out.aligned() {
                let (expected, got) = ("a buffer aligned for its type".into(), "a misaligned one".into());
                return Err(Error::Output { op, index: *o, name: name(), expected, got });
            }
            outputs.push(out);
        }
        let regions: Vec<OutputRegion> = outputs
            .iter()
            .zip(&plan_out)
            .map(|(t, (o, _, _, own))| OutputRegion {
                bytes: t.bytes(),
                own_input: *own,
                name: format!("output {o} ({})", self.output_name(*o, n)),
            })
            .collect();
        let in_bytes: Vec<_> = inputs.iter().map(Tensor::bytes).collect();
        let plan = alias::plan(op, &in_bytes, &regions)?;
        // Copy every input an output overlaps before any output slice exists.
        let snapshots = inputs
            .iter()
            .zip(&plan.snapshot)
            .map(|(t, &snap)| {
                // SAFETY: no mutable view of any buffer exists yet (outputs are viewed later).
                snap.then(|| unsafe { snapshot(t) }).flatten()
            })
            .collect();
        let handled = vec![false; n];
        Ok(Call { layout: self, n, r, t, extra, inputs, outputs, plan, snapshots, handled, pool: OrtPool::new(ctx) })
    }
}

fn trainops_numel(shape: &[i64]) -> usize {
    crate::ffi::context::numel(shape).unwrap_or(0)
}

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
    snapshots: Vec<Option<Box<dyn Any>>>,
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

/// One kernel work item per group, `make(streams, gradient)`; a length mismatch it reports
/// is named after the group's weights (`X_i`).
pub fn work_items<'v, 'g, X, G: Clone, W, const N: usize>(
    layout: &Layout,
    n: usize,
    groups: &[usize],
    streams: Vec<[InOut<'v, X>; N]>,
    gradients: &'g [Cow<'v, [G]>],
    make: impl Fn([InOut<'v, X>; N], &'g [G]) -> std::result::Result<W, trainops_kernels::KernelError>,
) -> Result<Vec<W>> {
    groups
        .iter()
        .zip(streams)
        .zip(gradients)
        .map(|((&i, s), g)| {
            let at = layout.s() + i;
            make(s, g)
                .map_err(|e| Error::input(layout.op, at, layout.input_name(at, n), "equal tensor sizes", e.to_string()))
        })
        .collect()
}

impl<'c, 'a> Call<'c, 'a> {
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
        match &self.snapshots[j] {
            Some(b) => b.downcast_ref::<Vec<T>>().expect("snapshot of the checked type"),
            // SAFETY: the plan proved no output overlaps this input (else it would be a
            // snapshot), and inputs are never written, so this view stays immutable.
            None => unsafe { self.inputs[j].slice::<T>() },
        }
    }

    /// The gradient of group `i`, broadcast to the weights' shape where needed.
    fn gradient<G: TensorElem>(&self, i: usize) -> Result<Cow<'_, [G]>> {
        let (l, n) = (self.layout, self.n);
        let gj = l.gradient * n + i;
        let (x, g) = (&self.inputs[i], &self.inputs[gj]);
        if g.shape == x.shape {
            return Ok(Cow::Borrowed(self.source::<G>(gj)));
        }
        let wide = broadcast::broadcast_to(self.source::<G>(gj), &g.dims(), &x.dims());
        let name = l.input_name(gj + l.s(), n);
        wide.map(Cow::Owned).map_err(|e| Error::input(l.op, gj + l.s(), name, "a broadcastable shape", e.to_string()))
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
        mixed::all_finite(&grads, loss_scale, &self.pool)
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
        mixed::cast(pairs, &self.pool);
        Ok(())
    }

    /// An error naming the first tensor group no kernel handled (a type combination the op
    /// does not compute), so that no output is returned unwritten.
    pub fn check_all_handled(&self) -> Result<()> {
        let Some(i) = self.handled.iter().position(|&h| !h) else { return Ok(()) };
        let (l, n) = (self.layout, self.n);
        let g = self.inputs[l.gradient * n + i].dtype;
        let got = format!("{} with {} gradients", self.inputs[i].dtype.name(), g.name());
        Err(Error::input(l.op, l.s() + i, l.input_name(l.s() + i, n), "a type combination this op computes", got))
    }

    /// Sets flag output `k`.
    pub fn set_flag(&mut self, k: usize, value: bool) {
        // SAFETY: a bool scalar output (checked in `prepare`), disjoint from every other
        // output; `&mut self` guarantees no other view of it.
        let flag = unsafe { self.outputs[k].slice_mut::<bool>() };
        flag[0] = value;
    }
}
