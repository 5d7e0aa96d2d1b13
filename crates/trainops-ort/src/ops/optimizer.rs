//! What ONNX's training-domain optimizers share: inputs `R, T`, then groups of `n` tensors
//! each (`X..., G..., V..., H...` for Adam), outputs that rewrite some of those groups
//! (`X_new..., V_new..., H_new...`). A [`Layout`] names the groups; it checks a node at
//! load and at run time, and a [`Call`] holds one run's checked tensors, its alias plan and
//! its typed views, so that each op only says how to update one tensor group.

use std::any::Any;
use std::borrow::Cow;

use trainops_kernels::{broadcast, InOut};

use super::common::{broadcastable, required, same_shape, scalar_float, scalar_i64, Sig};
use crate::error::{Error, Result};
use crate::ffi::alias::{self, AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::{snapshot, TensorElem};
use crate::ffi::{Context, DType, Formal, ShapeInfer, Tensor};

/// Formal inputs of every optimizer: `R` (any float type), `T` (int64), then the tensors.
pub static INPUTS: [Formal; 3] =
    [Formal::One(None), Formal::One(Some(DType::Int64)), Formal::Variadic { dtype: None, min: 1 }];
/// Formal outputs of every optimizer: the rewritten tensors.
pub static OUTPUTS: [Formal; 1] = [Formal::Variadic { dtype: None, min: 1 }];

/// The variadic layout of one optimizer op.
#[derive(Debug)]
pub struct Layout {
    /// Op name.
    pub op: &'static str,
    /// Input group names after `R, T`, e.g. `["X", "G", "V", "H"]`; group 0 is the weights.
    pub groups: &'static [&'static str],
    /// The index in `groups` of the gradient (the only group that may broadcast).
    pub gradient: usize,
    /// For each output group, the input group it rewrites, e.g. `[0, 2, 3]`.
    pub rewrites: &'static [usize],
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::Float | DType::Double)
}

impl Layout {
    /// Formal name of input `index` in a node of `n` tensors (`R`, `T`, `X_1`, ...).
    pub fn input_name(&self, index: usize, n: usize) -> String {
        match index {
            0 => "R".into(),
            1 => "T".into(),
            i => format!("{}_{}", self.groups[((i - 2) / n).min(self.groups.len() - 1)], (i - 2) % n + 1),
        }
    }

    /// Formal name of output `index` (`X_1_new`, ...).
    pub fn output_name(&self, index: usize, n: usize) -> String {
        let group = self.rewrites[(index / n).min(self.rewrites.len() - 1)];
        format!("{}_{}_new", self.groups[group], index % n + 1)
    }

    /// `n` from the input count `2 + groups * n`.
    pub fn arity(&self, inputs: usize) -> Result<usize> {
        let k = self.groups.len();
        if inputs >= 2 + k && (inputs - 2).is_multiple_of(k) {
            return Ok((inputs - 2) / k);
        }
        let lists: Vec<String> = self.groups.iter().map(|g| format!("{g}_1..{g}_n")).collect();
        Err(Error::Arity {
            op: self.op,
            what: format!("expected 2 + {k}n inputs (R, T, then {}, n >= 1), got {inputs}", lists.join(", ")),
        })
    }

    /// Checks the output count `rewrites * n`.
    pub fn check_outputs(&self, outputs: usize, n: usize) -> Result<()> {
        let m = self.rewrites.len();
        if outputs == m * n {
            return Ok(());
        }
        let names: Vec<String> = self.rewrites.iter().map(|&g| format!("{}_new", self.groups[g])).collect();
        Err(Error::Arity {
            op: self.op,
            what: format!(
                "expected {m}n = {} outputs ({} for each of n = {n} tensors), got {outputs}",
                m * n,
                names.join(", ")
            ),
        })
    }

    /// Node index of tensor `i` of group `k`.
    fn at(&self, n: usize, k: usize, i: usize) -> usize {
        2 + k * n + i
    }

    /// Checks tensor group `i` (one signature per input group); `shapes` is false at load
    /// time, when a missing shape cannot be told from a scalar.
    pub fn check_group(&self, n: usize, i: usize, sigs: &[Sig], shapes: bool) -> Result<()> {
        let x = &sigs[0];
        let name = |k: usize| self.input_name(self.at(n, k, i), n);
        if !is_float(x.dtype) {
            return Err(Error::input(
                self.op,
                self.at(n, 0, i),
                name(0),
                "tensor(float) or tensor(double)",
                x.dtype.name(),
            ));
        }
        for (k, s) in sigs.iter().enumerate().skip(1) {
            if s.dtype != x.dtype {
                let want = format!("{} like X_{}", x.dtype.name(), i + 1);
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
            if !is_float(d) {
                let want = "a tensor(float) or tensor(double) with exactly one element";
                return Err(Error::input(self.op, 0, "R", want, d.name()));
            }
        }
        for i in 0..n {
            let sigs: Option<Vec<Sig>> = (0..self.groups.len())
                .map(|k| known(ctx.input(self.at(n, k, i))).map(|(dtype, shape)| Sig { dtype, shape }))
                .collect();
            if let Some(sigs) = sigs {
                self.check_group(n, i, &sigs, false)?;
            }
            // A rank-0 answer may mean "no shape known": leave the outputs unknown then.
            if ctx.input(2 + i).is_some_and(|(_, shape)| !shape.is_empty()) {
                for o in 0..self.rewrites.len() {
                    ctx.output_like_input(o * n + i, 2 + i)?;
                }
            }
        }
        Ok(())
    }

    /// Reads and checks one run's inputs, allocates its outputs and plans their memory.
    pub fn prepare<'c, 'a>(&'static self, ctx: &'c mut Context<'a>) -> Result<Call<'c, 'a>> {
        let (op, k) = (self.op, self.groups.len());
        let n = self.arity(ctx.input_count()?)?;
        self.check_outputs(ctx.output_count()?, n)?;
        let r = scalar_float(ctx, op, 0, "R")?;
        let t = scalar_i64(ctx, op, 1, "T")?;
        let inputs: Vec<Tensor> =
            (2..2 + k * n).map(|j| required(ctx, op, j, &self.input_name(j, n))).collect::<Result<_>>()?;
        for i in 0..n {
            let sigs: Vec<Sig> = (0..k).map(|g| Sig::of(&inputs[g * n + i])).collect();
            self.check_group(n, i, &sigs, true)?;
        }
        if let Some(j) = inputs.iter().position(|t| !t.aligned()) {
            let name = self.input_name(j + 2, n);
            return Err(Error::input(op, j + 2, name, "a buffer aligned for its type", "a misaligned one"));
        }
        let m = self.rewrites.len();
        let mut outputs = Vec::with_capacity(m * n);
        for o in 0..m * n {
            let x = &inputs[o % n];
            let out = ctx.output(o, &x.shape)?;
            if out.dtype != x.dtype || out.numel != x.numel || !out.aligned() {
                let got = format!("a {} buffer of {} elements", out.dtype.name(), out.numel);
                let want = format!("an aligned {} buffer of {} elements", x.dtype.name(), x.numel);
                return Err(Error::Output { op, index: o, name: self.output_name(o, n), expected: want, got });
            }
            outputs.push(out);
        }
        // Output o rewrites tensor o % n of input group rewrites[o / n].
        let regions: Vec<OutputRegion> = outputs
            .iter()
            .enumerate()
            .map(|(o, t)| OutputRegion {
                bytes: t.bytes(),
                own_input: Some(self.rewrites[o / n] * n + o % n),
                name: format!("output {o} ({})", self.output_name(o, n)),
            })
            .collect();
        let in_bytes: Vec<_> = inputs.iter().map(Tensor::bytes).collect();
        let plan = alias::plan(op, &in_bytes, &regions)?;
        // Copy every input an output overlaps before any output slice exists.
        let snapshots = inputs
            .iter()
            .zip(&plan.snapshot)
            .map(|(t, &s)| {
                // SAFETY: no mutable view of any buffer exists yet (outputs are viewed later).
                s.then(|| unsafe { snapshot(t) }).flatten()
            })
            .collect();
        Ok(Call { layout: self, n, r, t, inputs, outputs, plan, snapshots, pool: OrtPool::new(ctx) })
    }
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
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    plan: AliasPlan,
    snapshots: Vec<Option<Box<dyn Any>>>,
    /// The session's intra-op pool.
    pub pool: OrtPool<'c, 'a>,
}

/// The groups of one type: their indices, their streams and their gradients.
pub type AllViews<'v, T, const N: usize> = (Vec<usize>, Vec<[InOut<'v, T>; N]>, Vec<Cow<'v, [T]>>);

/// One tensor group's typed views: a stream per rewritten group, and the gradient with the
/// weights' shape.
pub struct GroupViews<'v, T: Clone> {
    /// In `Layout::rewrites` order (e.g. X, V, H for Adam).
    pub streams: Vec<InOut<'v, T>>,
    /// The gradient, broadcast to the weights' shape where needed.
    pub gradient: Cow<'v, [T]>,
}

impl Call<'_, '_> {
    /// The groups whose weights have type `T`.
    pub fn groups_of<T: TensorElem>(&self) -> Vec<usize> {
        (0..self.n).filter(|&i| self.inputs[i].dtype == T::DTYPE).collect()
    }

    /// Input `j` (after `R, T`) as `T`, from its snapshot if it has one.
    fn source<T: TensorElem>(&self, j: usize) -> &[T] {
        match &self.snapshots[j] {
            Some(b) => b.downcast_ref::<Vec<T>>().expect("snapshot of the checked type"),
            // SAFETY: the plan proved no output overlaps this input (else it would be a
            // snapshot), and inputs are never written, so this view stays immutable.
            None => unsafe { self.inputs[j].slice::<T>() },
        }
    }

    /// The typed views of group `i`; each group is viewed at most once per call.
    pub fn views<T: TensorElem>(&self, i: usize) -> Result<GroupViews<'_, T>> {
        let (l, n) = (self.layout, self.n);
        let (x, g) = (&self.inputs[i], &self.inputs[l.gradient * n + i]);
        let gj = l.gradient * n + i;
        let gradient = if g.shape == x.shape {
            Cow::Borrowed(self.source::<T>(gj))
        } else {
            let wide = broadcast::broadcast_to(self.source::<T>(gj), &g.dims(), &x.dims());
            Cow::Owned(wide.map_err(|e| {
                Error::input(l.op, gj + 2, l.input_name(gj + 2, n), "a broadcastable shape", e.to_string())
            })?)
        };
        let streams = l
            .rewrites
            .iter()
            .enumerate()
            .map(|(m, &group)| {
                let o = m * n + i;
                // SAFETY: outputs are pairwise disjoint (the plan checked), each is viewed
                // once, and no input view overlaps it: an overlapping input is read from its
                // snapshot, or is this very buffer, updated in place without a second view.
                let dst = unsafe { self.outputs[o].slice_mut::<T>() };
                if self.plan.in_place[o] {
                    InOut::in_place(dst)
                } else {
                    InOut::split(self.source::<T>(group * n + i), dst).expect("output sized like its input")
                }
            })
            .collect();
        Ok(GroupViews { streams, gradient })
    }

    /// The views of every group whose weights have type `T`, split into the streams (by
    /// group) and the gradients (by group), so that kernels can borrow the gradients while
    /// taking the streams. `N` is the number of rewritten groups.
    pub fn all_views<T: TensorElem, const N: usize>(&self) -> Result<AllViews<'_, T, N>> {
        let groups = self.groups_of::<T>();
        let mut streams = Vec::with_capacity(groups.len());
        let mut gradients = Vec::with_capacity(groups.len());
        for &i in &groups {
            let v = self.views::<T>(i)?;
            match <[InOut<'_, T>; N]>::try_from(v.streams) {
                Ok(s) => streams.push(s),
                Err(_) => unreachable!("{} rewrites {} groups", self.layout.op, self.layout.rewrites.len()),
            }
            gradients.push(v.gradient);
        }
        Ok((groups, streams, gradients))
    }
}
