//! The variadic layout of an optimizer-shaped op: a few scalar inputs (`R, T`, and
//! `loss_scale` for MixedPrecisionAdam), then groups of `n` tensors each (`X..., G...,
//! V..., H...` for Adam); outputs: a few flags (`finite`), then groups that rewrite input
//! groups (`X_new..., V_new..., H_new...`), then optionally 16-bit copies of the new weights.
//!
//! A [`Layout`] names all of that and checks a node at load ([`Layout::infer`]) and at run
//! time ([`super::call::Call::prepare`]).
//!
//! Types: weights `X` (and every group but the gradient) float, double, float16 or
//! bfloat16; the gradient `G` of `X`'s type, or float16 / bfloat16 with float32 weights.

use crate::error::{Error, Result};
use crate::ffi::{DType, Formal, ShapeInfer, Signature, Tensor};

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
    /// How many scalar inputs precede the tensor groups (`R, T`, ...).
    pub fn scalar_count(&self) -> usize {
        self.scalars.len()
    }

    /// Formal name of input `index` in a node of `n` tensors (`R`, `T`, `X_1`, ...).
    pub fn input_name(&self, index: usize, n: usize) -> String {
        match self.scalars.get(index) {
            Some(name) => (*name).into(),
            None => {
                let j = index - self.scalar_count();
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
        let (s, k) = (self.scalar_count(), self.groups.len());
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
    pub fn at(&self, n: usize, k: usize, i: usize) -> usize {
        self.scalar_count() + k * n + i
    }

    /// Checks tensor group `i` (one signature per input group); `shapes` is false at load
    /// time, when a missing shape cannot be told from a scalar.
    pub fn check_group(&self, n: usize, i: usize, sigs: &[InputInfo], shapes: bool) -> Result<()> {
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
            let sigs: Option<Vec<InputInfo>> = (0..self.groups.len())
                .map(|k| known(ctx.input(self.at(n, k, i))).map(|(dtype, shape)| InputInfo { dtype, shape }))
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
}

/// What is known of an input at load time or at run time: its type and shape, where a
/// negative dimension is unknown.
#[derive(Debug, Clone)]
pub struct InputInfo {
    /// Element type.
    pub dtype: DType,
    /// Dimensions; `-1` (or any negative) for unknown.
    pub shape: Vec<i64>,
}

impl InputInfo {
    /// Of a run-time tensor.
    pub fn of(t: &Tensor) -> Self {
        Self { dtype: t.dtype, shape: t.shape.clone() }
    }
}

/// True when `from` broadcasts one way to `to` (numpy rules, right-aligned). Unknown
/// dimensions are assumed to fit.
pub fn broadcastable(from: &[i64], to: &[i64]) -> bool {
    from.len() <= to.len() && from.iter().rev().zip(to.iter().rev()).all(|(&f, &t)| f == t || f == 1 || f < 0 || t < 0)
}

/// True when two shapes may be equal (unknown dimensions match anything).
pub fn same_shape(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x == y || x < 0 || y < 0)
}
