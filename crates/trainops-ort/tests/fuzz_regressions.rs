//! What the fuzz targets (`fuzz/`, run by `scripts/fuzz`) found, kept as ordinary tests.

use trainops::fuzzing::{numel, philox_output_numel, plan, OutputRegion};

/// A zero dimension makes the element count 0 wherever it stands; the count once depended
/// on the order (`[2^62, 2^62, 0]` overflowed first and was refused, `[0, 2^62, 2^62]` was 0).
#[test]
fn element_count_of_a_zero_dimension_does_not_depend_on_order() {
    let big = 1i64 << 62;
    for shape in [[big, big, 0], [0, big, big], [big, 0, big], [i64::MAX, i64::MAX, 0]] {
        assert_eq!(numel(&shape), Some(0), "{shape:?}");
        assert_eq!(philox_output_numel(&shape, false).unwrap(), 0, "{shape:?}");
        assert_eq!(philox_output_numel(&shape, true).unwrap(), 0, "{shape:?}");
    }
    assert_eq!(numel(&[big, big]), None);
    assert_eq!(numel(&[-1, 0]), None);
    assert!(philox_output_numel(&[0, -3], false).unwrap_err().to_string().contains("negative dimension -3"));
    assert!(philox_output_numel(&[big, big], true).unwrap_err().to_string().contains("limit"));
}

fn out(bytes: core::ops::Range<usize>, own: Option<usize>) -> OutputRegion {
    OutputRegion { bytes, own_input: own, name: "o".into() }
}

/// Shapes of the fuzz target's properties: scrambled (end before start) ranges are empty and
/// never panic; two inputs on one buffer with an output exactly on one of them: that one is
/// in place and the other is copied first.
#[test]
#[allow(clippy::reversed_empty_ranges)] // scrambled ranges on purpose
fn alias_plan_edge_shapes() {
    let p = plan("t", &[8..0, 0..8], &[out(4..2, Some(0)), out(0..8, Some(1))]).unwrap();
    assert_eq!(p.in_place, [false, true]);
    assert_eq!(p.snapshot, [false, false]);
    let p = plan("t", &[0..8, 0..8], &[out(0..8, Some(0))]).unwrap();
    assert_eq!(p.in_place, [true]);
    assert_eq!(p.snapshot, [false, true]);
    assert!(plan("t", &[], &[out(0..8, None), out(7..9, None)]).is_err());
}

/// PhiloxUniform with both `low` and `high` NaN (different payloads), long enough for the
/// threaded path and a SIMD tail: every element is NaN at every level, but which NaN (the
/// payload the final sum keeps) is the compiler's choice and differed between the SIMD
/// loops' scalar tails and the reference (the `distributions` fuzz target, 69,905 elements).
/// The state and every non-NaN value stay bit for bit.
#[test]
fn uniform_with_nan_low_and_high_is_nan_at_every_level() {
    use trainops_kernels::random::draw::Output;
    use trainops_kernels::random::philox::available_levels;
    use trainops_kernels::random::uniform;
    use trainops_kernels::Sequential;

    let (low, high) = (f32::from_bits(0xFFFF_FF11), f32::from_bits(0xFFFF_FFFF));
    let state = [7, 0, 0, 0, 1, 2];
    let mut want = vec![0f32; 69_905];
    let next = uniform::reference(&state, low, high, Output::F32(&mut want));
    assert!(want.iter().all(|x| x.is_nan()));
    for level in available_levels() {
        let mut got = vec![0f32; want.len()];
        assert_eq!(uniform::fill_with(level, &state, low, high, Output::F32(&mut got), &Sequential), next);
        assert!(got.iter().all(|x| x.is_nan()), "{level:?}");
    }
}
