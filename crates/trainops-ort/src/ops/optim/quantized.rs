//! `com.trainops::Adam8bit` and `com.trainops::AdamW8bit` (since version 1): Adam (ONNX's
//! formula and attributes) and AdamW (PyTorch's formula; attributes `beta1`, `beta2`,
//! `epsilon`, `weight_decay`, `maximize`) with 8-bit blockwise-quantised moments. The
//! format and the math are `trainops_kernels::optim::quantized`.
//!
//! Inputs `R, T`, then `X_1..X_n, G_1..G_n, M_q_1..M_q_n, M_absmax_1..M_absmax_n,
//! V_q_1..V_q_n, V_absmax_1..V_absmax_n`; outputs `X_new.., M_q_new.., M_absmax_new..,
//! V_q_new.., V_absmax_new..` (each may be bound to its input's buffer). `X` float32; `G`
//! float32, float16 or bfloat16, broadcastable to `X`; `M_q`, `V_q` uint8 shaped like `X`;
//! `M_absmax`, `V_absmax` float32 with `ceil(numel(X) / 256)` elements (any shape).

use std::any::Any;
use std::borrow::Cow;

use half::{bf16, f16};
use trainops_kernels::optim::adam::Adam;
use trainops_kernels::optim::quantized::adamw::{AdamWAttrs, AdamWCoeffs, Rule};
use trainops_kernels::optim::quantized::{blocks, step, Param8bit, Quantized, BLOCK};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::{broadcast, Element, InOut};

use super::adam::read_attrs;
use super::layout::{broadcastable, optimizer_signature, same_shape, Layout};
use crate::error::{Error, Result};
use crate::ffi::alias::{self, AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::{snapshot, TensorElem};
use crate::ffi::{Context, DType, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};
use crate::ops::io;

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

/// AdamW's attributes, with PyTorch's defaults; `maximize` is 0 or 1.
pub fn read_adamw_attrs(info: &KernelInfo<'_>, op: &'static str) -> Result<AdamWAttrs> {
    let d = AdamWAttrs::default();
    let maximize = match info.i64_opt("maximize")?.unwrap_or(0) {
        0 => false,
        1 => true,
        other => {
            return Err(Error::Attribute { op, name: "maximize", what: format!("expected 0 or 1, got {other}") });
        }
    };
    Ok(AdamWAttrs {
        beta1: info.f32_or("beta1", d.beta1)?,
        beta2: info.f32_or("beta2", d.beta2)?,
        epsilon: info.f32_or("epsilon", d.epsilon)?,
        weight_decay: info.f32_or("weight_decay", d.weight_decay)?,
        maximize,
    })
}

/// A node's attributes.
enum Attrs {
    Adam(trainops_kernels::optim::adam::AdamAttrs),
    AdamW(AdamWAttrs),
}

impl OpSpec for Optim8bitOp {
    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let attrs = if self.adamw {
            Attrs::AdamW(read_adamw_attrs(info, self.layout.op)?)
        } else {
            Attrs::Adam(read_attrs(info)?)
        };
        Ok(Box::new(Optim8bitKernel { layout: &self.layout, attrs }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let l = &self.layout;
        let n = l.arity(ctx.input_count()?)?;
        for i in 0..n {
            for (k, &want) in TYPES.iter().enumerate() {
                let Some((dtype, _)) = ctx.input(l.at(n, k, i)) else { continue };
                if dtype != DType::Other(0) && !fits(k, want, dtype) {
                    return Err(type_error(l, n, k, i, dtype));
                }
            }
            for (m, &group) in l.rewrites.iter().enumerate() {
                ctx.output_like_input(m * n + i, l.at(n, group, i))?;
            }
        }
        Ok(())
    }
}

/// Whether `dtype` may be group `k`'s element type (`want`; the gradient may be 16-bit).
fn fits(k: usize, want: DType, dtype: DType) -> bool {
    dtype == want || (k == 1 && matches!(dtype, DType::Float16 | DType::BFloat16))
}

fn type_error(l: &Layout, n: usize, k: usize, i: usize, got: DType) -> Error {
    let at = l.at(n, k, i);
    let want = if k == 1 { "tensor(float), tensor(float16) or tensor(bfloat16)".into() } else { TYPES[k].name() };
    Error::input(l.op, at, l.input_name(at, n), want, got.name())
}

struct Optim8bitKernel {
    layout: &'static Layout,
    attrs: Attrs,
}

impl Kernel for Optim8bitKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let mut call = Call8bit::prepare(self.layout, ctx)?;
        match &self.attrs {
            Attrs::Adam(a) => call.run_all(&Adam::coeffs::<f32>(a, call.r, call.t)),
            Attrs::AdamW(a) => call.run_all(&AdamWCoeffs::new(a, call.r, call.t)),
        }
    }
}

/// One run of a node, checked and planned (as `super::call::Call` does for the float
/// optimizers, with this layout's types and scale lengths).
struct Call8bit<'c, 'a> {
    layout: &'static Layout,
    n: usize,
    r: f64,
    t: i64,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    plan: AliasPlan,
    snapshots: Vec<Option<Box<dyn Any>>>,
    pool: OrtPool<'c, 'a>,
}

impl<'c, 'a> Call8bit<'c, 'a> {
    fn prepare(layout: &'static Layout, ctx: &'c mut Context<'a>) -> Result<Self> {
        let (op, s, k) = (layout.op, layout.scalar_count(), GROUPS.len());
        let n = layout.arity(ctx.input_count()?)?;
        layout.check_outputs(ctx.output_count()?, n, false)?;
        let r = io::scalar_float(ctx, op, 0, "R")?;
        let (t, _) = io::scalar::<i64>(ctx, op, 1, "T")?;
        let inputs: Vec<Tensor> =
            (s..s + k * n).map(|j| io::required(ctx, op, j, &layout.input_name(j, n))).collect::<Result<_>>()?;
        for i in 0..n {
            check_group(layout, n, i, &inputs)?;
        }
        if let Some(j) = inputs.iter().position(|t| !t.aligned()) {
            return Err(Error::input(
                op,
                j + s,
                layout.input_name(j + s, n),
                "a buffer aligned for its type",
                "a misaligned one",
            ));
        }
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
        let in_bytes: Vec<_> = inputs.iter().map(Tensor::bytes).collect();
        let plan = alias::plan(op, &in_bytes, &regions)?;
        let snapshots = inputs
            .iter()
            .zip(&plan.snapshot)
            .map(|(t, &snap)| {
                // SAFETY: no mutable view of any buffer exists yet (outputs are viewed later).
                snap.then(|| unsafe { snapshot(t) }).flatten()
            })
            .collect();
        Ok(Call8bit { layout, n, r, t, inputs, outputs, plan, snapshots, pool: OrtPool::new(ctx) })
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

    /// The stream of output group `m`, tensor `i`.
    fn stream<T: TensorElem>(&self, m: usize, i: usize) -> InOut<'_, T> {
        let o = m * self.n + i;
        // SAFETY: outputs are pairwise disjoint (the plan checked), each is viewed once
        // (`run` takes `&mut self` and views each group once), and no input view overlaps
        // it: an overlapping input is read from its snapshot, or is this very buffer,
        // updated in place without a second view.
        let dst = unsafe { self.outputs[o].slice_mut::<T>() };
        if self.plan.in_place[o] {
            InOut::in_place(dst)
        } else {
            let src = self.source::<T>(self.layout.rewrites[m] * self.n + i);
            InOut::split(src, dst).expect("output sized like its input")
        }
    }

    /// Every group, by gradient type.
    fn run_all<R: Rule>(&mut self, rule: &R) -> Result<()> {
        self.run::<R, f32>(rule)?;
        self.run::<R, f16>(rule)?;
        self.run::<R, bf16>(rule)
    }

    /// The groups whose gradients have type `G`.
    fn run<R: Rule, G: TensorElem + Element<C = f32>>(&mut self, rule: &R) -> Result<()> {
        let (l, n) = (self.layout, self.n);
        let groups: Vec<usize> = (0..n).filter(|&i| self.inputs[n + i].dtype == G::DTYPE).collect();
        if groups.is_empty() {
            return Ok(());
        }
        let this: &Self = self;
        let mut gradients: Vec<Cow<'_, [G]>> = Vec::with_capacity(groups.len());
        for &i in &groups {
            let (x, g) = (&this.inputs[i], &this.inputs[n + i]);
            let src = this.source::<G>(n + i);
            gradients.push(if g.shape == x.shape {
                Cow::Borrowed(src)
            } else {
                let at = l.at(n, 1, i);
                let wide = broadcast::broadcast_to(src, &g.dims(), &x.dims())
                    .map_err(|e| Error::input(l.op, at, l.input_name(at, n), "a broadcastable shape", e.to_string()))?;
                Cow::Owned(wide)
            });
        }
        let params = groups
            .iter()
            .zip(&gradients)
            .map(|(&i, g)| {
                let m = Quantized { codes: this.stream(1, i), absmax: this.stream(2, i) };
                let v = Quantized { codes: this.stream(3, i), absmax: this.stream(4, i) };
                Param8bit::new(this.stream(0, i), g, m, v).map_err(|e| {
                    let at = l.at(n, 0, i);
                    Error::input(l.op, at, l.input_name(at, n), "consistent tensor sizes", e.to_string())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        step(rule, params, &this.pool);
        Ok(())
    }
}

/// Checks group `i`'s types, shapes and scale lengths.
fn check_group(l: &Layout, n: usize, i: usize, inputs: &[Tensor]) -> Result<()> {
    let get = |k: usize| &inputs[k * n + i];
    let name = |k: usize| l.input_name(l.at(n, k, i), n);
    for (k, &want) in TYPES.iter().enumerate() {
        if !fits(k, want, get(k).dtype) {
            return Err(type_error(l, n, k, i, get(k).dtype));
        }
    }
    let x = get(0);
    if !broadcastable(&get(1).shape, &x.shape) {
        let want = format!("a shape broadcastable to X_{}'s {:?}", i + 1, x.shape);
        return Err(Error::input(l.op, l.at(n, 1, i), name(1), want, format!("shape {:?}", get(1).shape)));
    }
    for k in [2, 4] {
        if !same_shape(&get(k).shape, &x.shape) {
            let want = format!("shape {:?} like X_{}", x.shape, i + 1);
            return Err(Error::input(l.op, l.at(n, k, i), name(k), want, format!("shape {:?}", get(k).shape)));
        }
    }
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
