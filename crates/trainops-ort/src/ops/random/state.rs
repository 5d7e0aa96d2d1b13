//! What every random op of the family shares: input 0 `state` (uint32, exactly 6 elements,
//! any shape: `[c0, c1, c2, c3, k0, k1]`), the output's dimensions from exactly one of the
//! `shape` attribute and input 1 `shape` (int64, 1-D, optional), at most [`MAX_ELEMENTS`];
//! output 0 `output` and the optional output 1 `state_out` (uint32, `state`'s shape),
//! checked and disjoint. The generator itself is the kernels' `random::philox`.

use crate::error::{Error, Result};
use crate::ffi::context::numel;
use crate::ffi::{Context, DType, KernelInfo, ShapeInfer, Tensor};
use crate::ops::io;

/// The most elements one call may produce: 2^31 (8 GiB of uint32 output).
pub const MAX_ELEMENTS: usize = 1 << 31;

/// Where the output's dimensions come from, for messages.
#[derive(Debug, Clone, Copy)]
pub enum ShapeFrom {
    /// The node's `shape` attribute.
    Attribute,
    /// Input 1, `shape`.
    Input,
}

/// Checks requested output dimensions of op `op`: non-negative, element count within
/// `MAX_ELEMENTS` (2^31).
pub fn output_numel(op: &'static str, dims: &[i64], from: ShapeFrom) -> Result<usize> {
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
        ShapeFrom::Input => Error::input(op, 1, "shape", expected, problem),
        ShapeFrom::Attribute => {
            Error::Attribute { op, name: "shape", what: format!("expected {expected}, got {problem}") }
        }
    })
}

/// A node's `shape` attribute, read (and checked) when its kernel is created.
#[derive(Debug, Clone)]
pub struct OutputShape {
    op: &'static str,
    attribute: Option<Vec<i64>>,
}

impl OutputShape {
    /// Reads the `shape` attribute of op `op`'s node, if it has one.
    pub fn from_node(op: &'static str, info: &KernelInfo<'_>) -> Result<Self> {
        let attribute = info.i64s_opt("shape")?;
        if let Some(dims) = &attribute {
            output_numel(op, dims, ShapeFrom::Attribute)?;
        }
        Ok(Self { op, attribute })
    }

    /// The output dimensions of this call, from the attribute or the `shape` input (exactly
    /// one), and their element count.
    pub fn dims(&self, ctx: &Context<'_>) -> Result<(Vec<i64>, usize)> {
        let op = self.op;
        let input = if ctx.input_count()? > 1 { ctx.input(1)? } else { None };
        let (dims, from) = match (&self.attribute, input) {
            (Some(dims), None) => (dims.clone(), ShapeFrom::Attribute),
            (Some(_), Some(_)) => {
                let want = "no shape input when the node has a 'shape' attribute (give exactly one)";
                return Err(Error::input(op, 1, "shape", want, "both"));
            }
            (None, None) => {
                let want = "a 1-D tensor(int64), or a 'shape' attribute on the node (exactly one)";
                return Err(Error::input(op, 1, "shape", want, "neither"));
            }
            (None, Some(t)) => {
                if t.dtype != DType::Int64 || t.shape.len() != 1 {
                    let got = format!("{} with shape {:?}", t.dtype.name(), t.shape);
                    return Err(Error::input(op, 1, "shape", "a 1-D tensor(int64)", got));
                }
                if !t.aligned() {
                    return Err(Error::input(op, 1, "shape", "an aligned buffer", "a misaligned one"));
                }
                // SAFETY: a 1-D int64 tensor, checked; no output view exists yet.
                (unsafe { t.slice::<i64>() }.to_vec(), ShapeFrom::Input)
            }
        };
        let count = output_numel(op, &dims, from)?;
        Ok((dims, count))
    }
}

/// The six state words of input 0, copied out, and the tensor.
pub fn read_state(ctx: &Context<'_>, op: &'static str) -> Result<([u32; 6], Tensor)> {
    let t = io::exact(ctx, op, 0, "state", &[DType::Uint32], 6, " [c0, c1, c2, c3, k0, k1]")?;
    // SAFETY: six uint32 elements, checked and aligned; no output view exists yet, and the
    // words are copied out before any is made.
    let words: [u32; 6] = unsafe { t.slice::<u32>() }.try_into().expect("six words");
    Ok((words, t))
}

/// Shape inference at load: `state` must be six uint32 where known; `state_out` takes its shape.
pub fn infer(op: &'static str, ctx: &mut ShapeInfer<'_>) -> Result<()> {
    if let Some((d, shape)) = ctx.input(0) {
        let n = shape.iter().try_fold(1i64, |acc, &x| if x < 0 { None } else { acc.checked_mul(x) });
        if d != DType::Uint32 || n.is_some_and(|n| n != 6 && !shape.is_empty()) {
            let got = format!("{} with shape {shape:?}", d.name());
            return Err(Error::input(op, 0, "state", "a tensor(uint32) with exactly 6 elements", got));
        }
        if !shape.is_empty() {
            ctx.output_like_input(1, 0)?;
        }
    }
    Ok(())
}

/// A random op's outputs: `output` and, when the node has it, `state_out`.
pub struct Outputs {
    /// Output 0.
    pub output: Tensor,
    /// Output 1, optional.
    pub state_out: Option<Tensor>,
}

impl Outputs {
    /// Allocates output 0 (`dtype`, `dims`) and, unless the node leaves it out, `state_out`
    /// (like `state`); checks them and that they do not overlap.
    pub fn new(ctx: &mut Context<'_>, op: &'static str, dtype: DType, dims: &[i64], state: &Tensor) -> Result<Self> {
        let output = io::output(ctx, op, 0, "output", dtype, dims)?;
        // Absent when the node has one output or names output 1 "" (the runtime then gives
        // no value for it).
        let state_out = io::optional_output(ctx, op, 1, "state_out", DType::Uint32, &state.shape)?;
        if let Some(s) = &state_out {
            let (a, b) = (output.bytes(), s.bytes());
            if !a.is_empty() && a.start < b.end && b.start < a.end {
                let what = "output 0 (output) and output 1 (state_out) are bound to overlapping memory".into();
                return Err(Error::Aliasing { op, what });
            }
        }
        Ok(Self { output, state_out })
    }

    /// Writes the next state into `state_out`, if the node has it. Call once the output's
    /// view is no longer used.
    pub fn write_state(&self, next: &[u32; 6]) {
        if let Some(s) = &self.state_out {
            // SAFETY: six uint32 elements (checked in `new`), disjoint from `output`, whose
            // view the caller no longer uses; no other view of this buffer exists.
            unsafe { s.slice_mut::<u32>() }.copy_from_slice(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_sizes_are_checked() {
        let s = ShapeFrom::Input;
        assert_eq!(output_numel("Philox", &[2, 3], s).unwrap(), 6);
        assert_eq!(output_numel("Philox", &[], s).unwrap(), 1);
        assert_eq!(output_numel("Philox", &[0, 5], s).unwrap(), 0);
        let msg = output_numel("Philox", &[2, -1], s).unwrap_err().to_string();
        assert!(msg.starts_with("Philox: input 1 (shape): expected non-negative dimensions"), "{msg}");
        assert!(msg.ends_with("got [2, -1], with a negative dimension -1"), "{msg}");
        let msg = output_numel("Philox", &[1 << 16, 1 << 16], ShapeFrom::Attribute).unwrap_err().to_string();
        assert!(msg.starts_with("Philox: attribute 'shape': expected") && msg.contains("limit"), "{msg}");
        // An element count that overflows usize is refused, not wrapped.
        assert!(output_numel("Philox", &[i64::MAX, i64::MAX], s).is_err());
        assert!(output_numel("Philox", &[1 << 31], s).is_ok());
    }
}
