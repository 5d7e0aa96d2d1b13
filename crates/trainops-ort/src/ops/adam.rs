//! `ai.onnx.preview.training::Adam` (since version 1): the ONNX operator, variadic.
//!
//! Inputs `R, T, X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n`; outputs
//! `X_1_new..X_n_new, V_1_new..V_n_new, H_1_new..H_n_new`. The math is in
//! `trainops_kernels::adam`; this module checks the node, plans memory and dispatches.

use std::any::Any;
use std::borrow::Cow;

use trainops_kernels::adam::{self, AdamAttrs, AdamCoeffs, AdamTensor};
use trainops_kernels::{broadcast, Element, InOut};

use super::common::{broadcastable, required, same_shape, scalar_float, scalar_i64, Sig};
use crate::error::{Error, Result};
use crate::ffi::alias::{self, AliasPlan, OutputRegion};
use crate::ffi::pool::OrtPool;
use crate::ffi::tensor::TensorElem;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Tensor};

const OP: &str = "Adam";
const GROUPS: [&str; 4] = ["X", "G", "V", "H"];
const OUT_GROUPS: [&str; 3] = ["X", "V", "H"];

/// The op as registered in `ai.onnx.preview.training`.
pub struct Adam;

static INPUTS: [Formal; 3] =
    [Formal::One(None), Formal::One(Some(DType::Int64)), Formal::Variadic { dtype: None, min: 1 }];
static OUTPUTS: [Formal; 1] = [Formal::Variadic { dtype: None, min: 1 }];

/// Formal name of input `index` in a node of `n` tensors (`R`, `T`, `X_1`, ..., `H_n`).
fn input_name(index: usize, n: usize) -> String {
    match index {
        0 => "R".into(),
        1 => "T".into(),
        i => format!("{}_{}", GROUPS[((i - 2) / n).min(3)], (i - 2) % n + 1),
    }
}

/// Formal name of output `index` (`X_1_new`, ..., `H_n_new`).
fn output_name(index: usize, n: usize) -> String {
    format!("{}_{}_new", OUT_GROUPS[(index / n).min(2)], index % n + 1)
}

/// `n` from the input count `2 + 4n`.
fn arity(inputs: usize) -> Result<usize> {
    if inputs >= 6 && (inputs - 2) % 4 == 0 {
        Ok((inputs - 2) / 4)
    } else {
        Err(Error::Arity {
            op: OP,
            what: format!(
                "expected 2 + 4n inputs (R, T, then X_1..X_n, G_1..G_n, V_1..V_n, H_1..H_n, n >= 1), got {inputs}"
            ),
        })
    }
}

fn check_outputs(outputs: usize, n: usize) -> Result<()> {
    if outputs == 3 * n {
        return Ok(());
    }
    Err(Error::Arity {
        op: OP,
        what: format!(
            "expected 3n = {} outputs (X_new, V_new, H_new for each of n = {n} tensors), got {outputs}",
            3 * n
        ),
    })
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::Float | DType::Double)
}

/// Checks tensor group `i` (`X_i, G_i, V_i, H_i`); `shapes` is false at load time, when a
/// missing shape cannot be told from a scalar.
fn check_group(n: usize, i: usize, [x, g, v, h]: [&Sig; 4], shapes: bool) -> Result<()> {
    let at = |k: usize| 2 + k * n + i;
    let name = |k: usize| input_name(at(k), n);
    if !is_float(x.dtype) {
        return Err(Error::input(OP, at(0), name(0), "tensor(float) or tensor(double)", x.dtype.name()));
    }
    for (k, s) in [(1, g), (2, v), (3, h)] {
        if s.dtype != x.dtype {
            let want = format!("{} like X_{}", x.dtype.name(), i + 1);
            return Err(Error::input(OP, at(k), name(k), want, s.dtype.name()));
        }
    }
    if !shapes {
        return Ok(());
    }
    for (k, s) in [(2, v), (3, h)] {
        if !same_shape(&s.shape, &x.shape) {
            let want = format!("shape {:?} like X_{}", x.shape, i + 1);
            return Err(Error::input(OP, at(k), name(k), want, format!("shape {:?}", s.shape)));
        }
    }
    if !broadcastable(&g.shape, &x.shape) {
        let want = format!("a shape broadcastable to X_{}'s {:?}", i + 1, x.shape);
        return Err(Error::input(OP, at(1), name(1), want, format!("shape {:?}", g.shape)));
    }
    Ok(())
}

impl OpSpec for Adam {
    fn name(&self) -> &'static std::ffi::CStr {
        c"Adam"
    }

    fn inputs(&self) -> &'static [Formal] {
        &INPUTS
    }

    fn outputs(&self) -> &'static [Formal] {
        &OUTPUTS
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let d = AdamAttrs::default();
        let attrs = AdamAttrs {
            alpha: info.f32_or("alpha", d.alpha)?,
            beta: info.f32_or("beta", d.beta)?,
            epsilon: info.f32_or("epsilon", d.epsilon)?,
            norm_coefficient: info.f32_or("norm_coefficient", d.norm_coefficient)?,
            norm_coefficient_post: info.f32_or("norm_coefficient_post", d.norm_coefficient_post)?,
        };
        Ok(Box::new(AdamKernel { attrs }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        let n = arity(ctx.input_count()?)?;
        let known = |s: Option<(DType, Vec<i64>)>| s.filter(|(d, _)| *d != DType::Other(0));
        if let Some((d, _)) = known(ctx.input(0)) {
            if !is_float(d) {
                return Err(Error::input(
                    OP,
                    0,
                    "R",
                    "a tensor(float) or tensor(double) with exactly one element",
                    d.name(),
                ));
            }
        }
        for i in 0..n {
            let sig = |k: usize| known(ctx.input(2 + k * n + i)).map(|(dtype, shape)| Sig { dtype, shape });
            if let [Some(x), Some(g), Some(v), Some(h)] = [sig(0), sig(1), sig(2), sig(3)] {
                check_group(n, i, [&x, &g, &v, &h], false)?;
            }
            // A rank-0 answer may mean "no shape known": leave the outputs unknown then.
            if ctx.input(2 + i).is_some_and(|(_, shape)| !shape.is_empty()) {
                for k in 0..3 {
                    ctx.output_like_input(k * n + i, 2 + i)?;
                }
            }
        }
        Ok(())
    }
}

/// The kernel of one Adam node.
struct AdamKernel {
    attrs: AdamAttrs,
}

/// Everything `run` needs about one call, checked.
struct Call<'c> {
    n: usize,
    rate: f64,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
    plan: AliasPlan,
    snapshots: Vec<Option<Box<dyn Any>>>,
    pool: OrtPool<'c, 'c>,
}

impl Kernel for AdamKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let n = arity(ctx.input_count()?)?;
        check_outputs(ctx.output_count()?, n)?;
        let r = scalar_float(ctx, OP, 0, "R")?;
        let t = scalar_i64(ctx, OP, 1, "T")?;
        let inputs: Vec<Tensor> =
            (2..2 + 4 * n).map(|k| required(ctx, OP, k, &input_name(k, n))).collect::<Result<_>>()?;
        for i in 0..n {
            let sigs = [0, 1, 2, 3].map(|k| Sig::of(&inputs[k * n + i]));
            check_group(n, i, [&sigs[0], &sigs[1], &sigs[2], &sigs[3]], true)?;
        }
        if let Some(k) = inputs.iter().position(|t| !t.aligned()) {
            return Err(Error::input(
                OP,
                k + 2,
                input_name(k + 2, n),
                "a buffer aligned for its type",
                "a misaligned one",
            ));
        }
        let mut outputs = Vec::with_capacity(3 * n);
        for o in 0..3 * n {
            let x = &inputs[o % n];
            let out = ctx.output(o, &x.shape)?;
            if out.dtype != x.dtype || out.numel != x.numel || !out.aligned() {
                let got = format!("a {} buffer of {} elements", out.dtype.name(), out.numel);
                let want = format!("an aligned {} buffer of {} elements", x.dtype.name(), x.numel);
                return Err(Error::Output { op: OP, index: o, name: output_name(o, n), expected: want, got });
            }
            outputs.push(out);
        }
        // Output o = k*n + i rewrites X_i, V_i or H_i: inputs i, 2n + i, 3n + i (after R, T).
        let own = |o: usize| [0, 2, 3][o / n] * n + o % n;
        let regions: Vec<OutputRegion> = outputs
            .iter()
            .enumerate()
            .map(|(o, t)| OutputRegion {
                bytes: t.bytes(),
                own_input: Some(own(o)),
                name: format!("output {o} ({})", output_name(o, n)),
            })
            .collect();
        let in_bytes: Vec<_> = inputs.iter().map(Tensor::bytes).collect();
        let plan = alias::plan(OP, &in_bytes, &regions)?;
        // Copy every input an output overlaps before any output slice exists.
        let snapshots = inputs
            .iter()
            .zip(&plan.snapshot)
            .map(|(t, &snap)| {
                snap.then(|| -> Box<dyn Any> {
                    // SAFETY: no mutable slice of any buffer exists yet; types were checked.
                    match t.dtype {
                        DType::Double => Box::new(unsafe { t.slice::<f64>() }.to_vec()),
                        _ => Box::new(unsafe { t.slice::<f32>() }.to_vec()),
                    }
                })
            })
            .collect();
        let rate = adam::adjusted_rate(r, t, self.attrs.alpha, self.attrs.beta);
        let call = Call { n, rate, inputs, outputs, plan, snapshots, pool: OrtPool::new(ctx) };
        self.run::<f32>(&call)?;
        self.run::<f64>(&call)
    }
}

impl AdamKernel {
    /// Runs the groups whose weights are of type `T`.
    fn run<T: TensorElem + Element>(&self, call: &Call<'_>) -> Result<()> {
        let n = call.n;
        let groups: Vec<usize> = (0..n).filter(|&i| call.inputs[i].dtype == T::DTYPE).collect();
        if groups.is_empty() {
            return Ok(());
        }
        // The bytes of input k, from its snapshot if it has one.
        let src = |k: usize| -> &[T] {
            match &call.snapshots[k] {
                Some(b) => b.downcast_ref::<Vec<T>>().expect("snapshot of the checked type"),
                // SAFETY: the plan proved no output overlaps this input (else it would be a
                // snapshot), and inputs are never written, so this view stays immutable.
                None => unsafe { call.inputs[k].slice::<T>() },
            }
        };
        let gs = groups
            .iter()
            .map(|&i| {
                let (x, g) = (&call.inputs[i], &call.inputs[n + i]);
                if g.shape == x.shape {
                    Ok(Cow::Borrowed(src(n + i)))
                } else {
                    broadcast::broadcast_to(src(n + i), &g.dims(), &x.dims()).map(Cow::Owned).map_err(|e| {
                        Error::input(OP, 2 + n + i, input_name(2 + n + i, n), "a broadcastable shape", e.to_string())
                    })
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let stream = |o: usize, k: usize| -> InOut<'_, T> {
            // SAFETY: outputs are pairwise disjoint (the plan checked), each is viewed once,
            // and no input view overlaps it: an overlapping input is read from its snapshot,
            // or is this very buffer, updated in place without a second view.
            let dst = unsafe { call.outputs[o].slice_mut::<T>() };
            if call.plan.in_place[o] {
                InOut::in_place(dst)
            } else {
                InOut::split(src(k), dst).expect("output sized like its input")
            }
        };
        let tensors = groups
            .iter()
            .zip(&gs)
            .map(|(&i, g)| {
                AdamTensor::new(stream(i, i), g, stream(n + i, 2 * n + i), stream(2 * n + i, 3 * n + i))
                    .map_err(|e| Error::input(OP, 2 + i, input_name(2 + i, n), "equal tensor sizes", e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let coeffs = AdamCoeffs::<T::C>::new(&self.attrs, call.rate);
        adam::step(&coeffs, tensors, &call.pool);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_variadic_layout() {
        let names: Vec<String> = (0..10).map(|k| input_name(k, 2)).collect();
        assert_eq!(names, ["R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2", "H_1", "H_2"]);
        let outs: Vec<String> = (0..6).map(|k| output_name(k, 2)).collect();
        assert_eq!(outs, ["X_1_new", "X_2_new", "V_1_new", "V_2_new", "H_1_new", "H_2_new"]);
    }

    #[test]
    fn arity_is_two_plus_four_n() {
        assert_eq!(arity(6).unwrap(), 1);
        assert_eq!(arity(10).unwrap(), 2);
        for bad in [0, 2, 5, 7, 9] {
            let msg = arity(bad).unwrap_err().to_string();
            assert!(msg.starts_with("Adam: expected 2 + 4n inputs"), "{msg}");
            assert!(msg.ends_with(&format!("got {bad}")), "{msg}");
        }
        assert!(check_outputs(4, 2).unwrap_err().to_string().contains("expected 3n = 6 outputs"));
    }
}
