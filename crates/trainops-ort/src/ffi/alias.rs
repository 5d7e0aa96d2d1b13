//! Which outputs share memory with which inputs, decided before any slice is made.
//!
//! An output bound to exactly its own input's buffer (IOBinding's in-place update) is
//! computed in place. Any other overlap between an output and an input makes that input a
//! *snapshot*: it is copied before anything is written, so results equal the out-of-place
//! ones. Outputs that overlap each other have no defined result and are an error.

use core::ops::Range;

use crate::error::{Error, Result};

/// An output's buffer and the position (in the `inputs` list) of the input it rewrites.
#[derive(Debug, Clone)]
pub struct OutputRegion {
    /// The output's bytes.
    pub bytes: Range<usize>,
    /// Its own input, if any.
    pub own_input: Option<usize>,
    /// Name for messages, e.g. `output 0 (X_1_new)`.
    pub name: String,
}

/// The decision for every input and output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AliasPlan {
    /// Per output: computed in place in its own input's buffer.
    pub in_place: Vec<bool>,
    /// Per input: copied before any output is written.
    pub snapshot: Vec<bool>,
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// Plans a call. `inputs` are the inputs' byte ranges. O((inputs + outputs) log outputs).
pub fn plan(op: &'static str, inputs: &[Range<usize>], outputs: &[OutputRegion]) -> Result<AliasPlan> {
    let mut order: Vec<usize> = (0..outputs.len()).filter(|&o| !outputs[o].bytes.is_empty()).collect();
    order.sort_by_key(|&o| outputs[o].bytes.start);
    // Sorted by start, the outputs are pairwise disjoint exactly when neighbours are; one
    // that starts inside an earlier one's range is caught against the widest so far.
    let mut widest: Option<usize> = None;
    for &o in &order {
        if let Some(w) = widest {
            if overlaps(&outputs[w].bytes, &outputs[o].bytes) {
                return Err(Error::Aliasing {
                    op,
                    what: format!("{} and {} are bound to overlapping memory", outputs[w].name, outputs[o].name),
                });
            }
        }
        if widest.is_none_or(|w| outputs[o].bytes.end > outputs[w].bytes.end) {
            widest = Some(o);
        }
    }
    let mut snapshot = vec![false; inputs.len()];
    let mut exact = vec![false; outputs.len()];
    for (k, inp) in inputs.iter().enumerate() {
        if inp.is_empty() {
            continue;
        }
        let first = order.partition_point(|&o| outputs[o].bytes.end <= inp.start);
        for &o in order[first..].iter().take_while(|&&o| outputs[o].bytes.start < inp.end) {
            if outputs[o].own_input == Some(k) && outputs[o].bytes == *inp {
                exact[o] = true;
            } else {
                snapshot[k] = true;
            }
        }
    }
    let in_place = (0..outputs.len()).map(|o| exact[o] && outputs[o].own_input.is_some_and(|k| !snapshot[k])).collect();
    Ok(AliasPlan { in_place, snapshot })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(bytes: Range<usize>, own: usize) -> OutputRegion {
        OutputRegion { bytes, own_input: Some(own), name: format!("output for {own}") }
    }

    #[test]
    fn separate_buffers_need_nothing() {
        let p = plan("t", &[0..8, 8..16], &[out(100..108, 0), out(200..208, 1)]).unwrap();
        assert_eq!(p, AliasPlan { in_place: vec![false, false], snapshot: vec![false, false] });
    }

    #[test]
    fn exact_self_binding_is_in_place() {
        let p = plan("t", &[0..8, 8..16], &[out(0..8, 0), out(200..208, 1)]).unwrap();
        assert_eq!(p, AliasPlan { in_place: vec![true, false], snapshot: vec![false, false] });
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one input's byte range, not a range of items
    fn binding_over_another_input_snapshots_it() {
        // Output 0 is written over input 1 (not its own): input 1 must be copied first.
        let p = plan("t", &[0..8, 8..16], &[out(8..16, 0), out(200..208, 1)]).unwrap();
        assert_eq!(p, AliasPlan { in_place: vec![false, false], snapshot: vec![false, true] });
        // Partial overlap with its own input is not in place either.
        let p = plan("t", &[0..8], &[out(4..12, 0)]).unwrap();
        assert_eq!(p, AliasPlan { in_place: vec![false], snapshot: vec![true] });
    }

    #[test]
    fn overlapping_outputs_are_an_error() {
        assert!(plan("t", &[0..8, 8..16], &[out(100..140, 0), out(110..120, 1)]).is_err());
        assert!(plan("t", &[0..8, 8..16], &[out(100..108, 0), out(100..108, 1)]).is_err());
        // Empty buffers share addresses freely.
        assert!(plan("t", &[0..0, 0..0], &[out(5..5, 0), out(5..5, 1)]).is_ok());
    }
}
