//! The alias plan (`trainops::fuzzing::plan`) on arbitrary byte ranges: it never panics; when it plans, the
//! non-empty outputs are pairwise disjoint, an output is computed in place only in exactly
//! its own input's buffer (and that input is not copied), and every other overlap between
//! an output and an input makes that input a snapshot; when it refuses, two non-empty
//! outputs really overlap.
#![no_main]

use core::ops::Range;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use trainops::fuzzing::{plan, OutputRegion};

#[derive(Debug, Arbitrary)]
struct Region {
    start: u16,
    len: u8,
    /// Scrambled ranges (end before start) must not panic either.
    reversed: bool,
}

#[derive(Debug, Arbitrary)]
struct Out {
    region: Region,
    own: Option<u8>,
    /// Put the output exactly on its own input's range.
    exact: bool,
}

#[derive(Debug, Arbitrary)]
struct Case {
    inputs: Vec<Region>,
    outputs: Vec<Out>,
}

fn range(r: &Region) -> Range<usize> {
    let (a, b) = (usize::from(r.start), usize::from(r.start) + usize::from(r.len));
    if r.reversed {
        b..a
    } else {
        a..b
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < a.end && b.start < b.end && a.start < b.end && b.start < a.end
}

fuzz_target!(|case: Case| {
    let inputs: Vec<Range<usize>> = case.inputs.iter().take(16).map(range).collect();
    let outputs: Vec<OutputRegion> = case
        .outputs
        .iter()
        .take(16)
        .enumerate()
        .map(|(o, out)| {
            let own = out.own.map(|k| usize::from(k) % inputs.len().max(1)).filter(|_| !inputs.is_empty());
            let bytes = match own {
                Some(k) if out.exact => inputs[k].clone(),
                _ => range(&out.region),
            };
            OutputRegion { bytes, own_input: own, name: format!("output {o}") }
        })
        .collect();
    let clash =
        (0..outputs.len()).any(|a| (a + 1..outputs.len()).any(|b| overlaps(&outputs[a].bytes, &outputs[b].bytes)));
    match plan("Fuzz", &inputs, &outputs) {
        Err(e) => {
            assert!(clash, "refused outputs that do not overlap: {e}");
            assert!(e.to_string().starts_with("Fuzz: output "), "{e}");
        }
        Ok(p) => {
            assert!(!clash, "accepted overlapping outputs");
            assert_eq!(p.in_place.len(), outputs.len());
            assert_eq!(p.snapshot.len(), inputs.len());
            for (o, out) in outputs.iter().enumerate() {
                if p.in_place[o] {
                    let k = out.own_input.expect("in place without an own input");
                    assert_eq!(out.bytes, inputs[k], "in place on a non-exact overlap");
                    assert!(!p.snapshot[k], "in place on a copied input");
                }
                for (k, inp) in inputs.iter().enumerate() {
                    if overlaps(&out.bytes, inp) {
                        let own_exact = p.in_place[o] && out.own_input == Some(k);
                        assert!(own_exact || p.snapshot[k], "output {o} overwrites input {k}, which is not copied");
                    }
                }
            }
        }
    }
});
