//! `com.trainops::Philox` (since version 1): DirectML's `DML_RANDOM_GENERATOR` operator with
//! `DML_RANDOM_GENERATOR_TYPE_PHILOX_4X32_10`, with the state as an ordinary tensor in and
//! out, so a graph's random bits are reproducible and independent of threads and SIMD.
//!
//! Inputs: `state` (uint32, exactly 6 elements, any shape: `[c0, c1, c2, c3, k0, k1]`),
//! `shape` (int64, 1-D; optional, exactly one of it and the `shape` attribute).
//! Outputs: `output` (uint32 of that shape), `state_out` (optional, uint32, `state`'s
//! shape: the counter advanced by `ceil(numel / 4)` blocks, mod 2^128; key unchanged).

use trainops_kernels::philox;

use super::common::required;
use crate::error::{Error, Result};
use crate::ffi::context::numel;
use crate::ffi::pool::OrtPool;
use crate::ffi::{Context, DType, Formal, Kernel, KernelInfo, OpSpec, ShapeInfer, Signature, Tensor};

const OP: &str = "Philox";

/// The most elements one call may produce: 2^31 (8 GiB of output).
pub const MAX_ELEMENTS: usize = 1 << 31;

/// The op as registered in `com.trainops`.
pub struct Philox;

static INPUTS: [Formal; 2] = [Formal::One(Some(DType::Uint32)), Formal::Optional(Some(DType::Int64))];
static OUTPUTS: [Formal; 2] = [Formal::One(Some(DType::Uint32)), Formal::Optional(Some(DType::Uint32))];

/// Where the output's dimensions come from, for messages.
#[derive(Clone, Copy)]
pub(crate) enum Source {
    Attribute,
    Input,
}

/// Checks requested output dimensions: non-negative, element count within [`MAX_ELEMENTS`].
pub(crate) fn output_numel(dims: &[i64], from: Source) -> Result<usize> {
    output_numel_for(OP, dims, from)
}

/// [`output_numel`] for any op with Philox's `shape` attribute or input 1 (the Philox
/// distributions share Philox's state and shape handling).
pub(crate) fn output_numel_for(op: &'static str, dims: &[i64], from: Source) -> Result<usize> {
    let problem = if let Some(&d) = dims.iter().find(|&&d| d < 0) {
        format!("{dims:?}, with a negative dimension {d}")
    } else {
        match numel(dims) {
            Some(n) if n <= MAX_ELEMENTS => return Ok(n),
            _ => format!("{dims:?}, more than the limit of {MAX_ELEMENTS} elements (2^31) per call"),
        }
    };
    let expected = "non-negative dimensions of at most 2^31 elements in all";
    Err(match from {
        Source::Input => Error::input(op, 1, "shape", expected, problem),
        Source::Attribute => {
            Error::Attribute { op, name: "shape", what: format!("expected {expected}, got {problem}") }
        }
    })
}

impl OpSpec for Philox {
    fn signature(&self) -> &'static Signature {
        static SIGNATURE: Signature = Signature { name: c"Philox", inputs: &INPUTS, outputs: &OUTPUTS };
        &SIGNATURE
    }

    fn create(&self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        let shape = info.i64s_opt("shape")?;
        if let Some(dims) = &shape {
            output_numel(dims, Source::Attribute)?;
        }
        Ok(Box::new(PhiloxKernel { shape }))
    }

    fn infer(&self, ctx: &mut ShapeInfer<'_>) -> Result<()> {
        if let Some((d, shape)) = ctx.input(0) {
            let n = shape.iter().try_fold(1i64, |acc, &x| if x < 0 { None } else { acc.checked_mul(x) });
            if d != DType::Uint32 || n.is_some_and(|n| n != 6 && !shape.is_empty()) {
                let got = format!("{} with shape {shape:?}", d.name());
                return Err(Error::input(OP, 0, "state", "a tensor(uint32) with exactly 6 elements", got));
            }
            if !shape.is_empty() {
                ctx.output_like_input(1, 0)?;
            }
        }
        Ok(())
    }
}

/// The kernel of one Philox node.
struct PhiloxKernel {
    /// The `shape` attribute, when the node has one.
    shape: Option<Vec<i64>>,
}

/// The six state words of input 0.
fn read_state(t: &Tensor) -> Result<[u32; 6]> {
    read_state_for(OP, 0, t)
}

/// The six state words of input `index` of `op`, copied out.
pub(crate) fn read_state_for(op: &'static str, index: usize, t: &Tensor) -> Result<[u32; 6]> {
    let expected = "a tensor(uint32) with exactly 6 elements [c0, c1, c2, c3, k0, k1]";
    if t.dtype != DType::Uint32 || t.numel != 6 {
        return Err(Error::input(op, index, "state", expected, format!("{} with shape {:?}", t.dtype.name(), t.shape)));
    }
    if !t.aligned() {
        return Err(Error::input(op, index, "state", "an aligned buffer", "a misaligned one"));
    }
    // SAFETY: six uint32 elements, checked; no output view exists yet, and the words are
    // copied out before any is made.
    let words = unsafe { t.slice::<u32>() };
    Ok(words.try_into().expect("six words"))
}

/// The output dimensions of `op`, from its `shape` attribute or its `shape` input 1
/// (exactly one).
pub(crate) fn dims_for(
    op: &'static str,
    attribute: &Option<Vec<i64>>,
    ctx: &Context<'_>,
) -> Result<(Vec<i64>, Source)> {
    let input = if ctx.input_count()? > 1 { ctx.input(1)? } else { None };
    match (attribute, input) {
        (Some(dims), None) => Ok((dims.clone(), Source::Attribute)),
        (Some(_), Some(_)) => Err(Error::input(
            op,
            1,
            "shape",
            "no shape input when the node has a 'shape' attribute (give exactly one)",
            "both",
        )),
        (None, None) => Err(Error::input(
            op,
            1,
            "shape",
            "a 1-D tensor(int64), or a 'shape' attribute on the node (exactly one)",
            "neither",
        )),
        (None, Some(t)) => {
            if t.dtype != DType::Int64 || t.shape.len() != 1 {
                let got = format!("{} with shape {:?}", t.dtype.name(), t.shape);
                return Err(Error::input(op, 1, "shape", "a 1-D tensor(int64)", got));
            }
            if !t.aligned() {
                return Err(Error::input(op, 1, "shape", "an aligned buffer", "a misaligned one"));
            }
            // SAFETY: a 1-D int64 tensor, checked; no output view exists yet.
            Ok((unsafe { t.slice::<i64>() }.to_vec(), Source::Input))
        }
    }
}

impl Kernel for PhiloxKernel {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let state_t = required(ctx, OP, 0, "state")?;
        let state = read_state(&state_t)?;
        let (dims, from) = dims_for(OP, &self.shape, ctx)?;
        let count = output_numel(&dims, from)?;
        let out = ctx.output(0, &dims)?;
        let outputs = ctx.output_count()?;
        let state_out = if outputs > 1 { Some(ctx.output(1, &state_t.shape)?) } else { None };
        for (index, t, want) in [(0, Some(&out), count), (1, state_out.as_ref(), 6)] {
            if let Some(t) = t {
                if t.dtype != DType::Uint32 || t.numel != want || !t.aligned() {
                    let name = ["output", "state_out"][index];
                    let got = format!("a {} buffer of {} elements", t.dtype.name(), t.numel);
                    let expected = format!("an aligned tensor(uint32) buffer of {want} elements");
                    return Err(Error::Output { op: OP, index, name: name.into(), expected, got });
                }
            }
        }
        if let Some(s) = &state_out {
            let (a, b) = (out.bytes(), s.bytes());
            if !a.is_empty() && a.start < b.end && b.start < a.end {
                let what = "output 0 (output) and output 1 (state_out) are bound to overlapping memory".into();
                return Err(Error::Aliasing { op: OP, what });
            }
        }
        // SAFETY: the output's type and size are checked; the state was copied out, so no
        // other view of any buffer is alive; output and state_out do not overlap.
        let words = unsafe { out.slice_mut::<u32>() };
        let next = philox::fill(&state, words, &OrtPool::new(ctx));
        if let Some(s) = state_out {
            // SAFETY: six uint32 elements, checked above; `words` is no longer used, and the
            // two buffers do not overlap.
            unsafe { s.slice_mut::<u32>() }.copy_from_slice(&next);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_sizes_are_checked() {
        let s = Source::Input;
        assert_eq!(output_numel(&[2, 3], s).unwrap(), 6);
        assert_eq!(output_numel(&[], s).unwrap(), 1);
        assert_eq!(output_numel(&[0, 5], s).unwrap(), 0);
        let msg = output_numel(&[2, -1], s).unwrap_err().to_string();
        assert!(msg.starts_with("Philox: input 1 (shape): expected non-negative dimensions"), "{msg}");
        assert!(msg.ends_with("got [2, -1], with a negative dimension -1"), "{msg}");
        let msg = output_numel(&[1 << 16, 1 << 16], Source::Attribute).unwrap_err().to_string();
        assert!(msg.starts_with("Philox: attribute 'shape': expected") && msg.contains("limit"), "{msg}");
        // An element count that overflows usize is refused, not wrapped.
        assert!(output_numel(&[i64::MAX, i64::MAX], s).is_err());
        assert!(output_numel(&[1 << 31], s).is_ok());
    }
}
