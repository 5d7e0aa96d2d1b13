//! The fast convolution gradients against the float64 six-loop reference, on edge shapes
//! and random data; the reference against the forward convolution (adjoint identities).

use super::*;
use crate::parallel::{RayonPool, Sequential};
use crate::test_util::uniform;

struct Case {
    name: &'static str,
    batch: usize,
    channels: usize,
    out_channels: usize,
    input: Vec<usize>,
    geo: ConvGeometry,
}

#[allow(clippy::too_many_arguments)] // one row of the table below
fn case(
    name: &'static str,
    (batch, channels, out_channels): (usize, usize, usize),
    input: &[usize],
    kernel: &[usize],
    strides: &[usize],
    dilations: &[usize],
    pads: &[usize],
    group: usize,
) -> Case {
    let geo = ConvGeometry {
        kernel: kernel.to_vec(),
        strides: strides.to_vec(),
        dilations: dilations.to_vec(),
        pads: pads.to_vec(),
        group,
    };
    Case { name, batch, channels, out_channels, input: input.to_vec(), geo }
}

fn cases() -> Vec<Case> {
    vec![
        case("2d 3x3 pad 1", (2, 3, 4), &[5, 6], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("1x1 kernel", (2, 5, 3), &[4, 3], &[1, 1], &[1, 1], &[1, 1], &[0, 0, 0, 0], 1),
        case("1x1 stride 2", (3, 4, 6), &[7, 5], &[1, 1], &[2, 2], &[1, 1], &[0, 0, 0, 0], 1),
        case("stride 2 pad 1", (2, 3, 5), &[9, 8], &[3, 3], &[2, 2], &[1, 1], &[1, 1, 1, 1], 1),
        case("dilation 2", (2, 2, 3), &[9, 7], &[3, 2], &[1, 1], &[2, 2], &[2, 1, 2, 1], 1),
        case("asymmetric pads", (2, 3, 2), &[6, 5], &[3, 3], &[2, 1], &[1, 1], &[0, 2, 1, 0], 1),
        case("pads wider than kernel", (1, 2, 2), &[3, 3], &[2, 2], &[1, 1], &[1, 1], &[3, 0, 0, 3], 1),
        case("groups 2", (2, 4, 6), &[6, 6], &[3, 3], &[1, 2], &[1, 1], &[1, 1, 1, 1], 2),
        case("depthwise", (2, 5, 5), &[7, 6], &[3, 3], &[2, 1], &[1, 2], &[1, 2, 1, 0], 5),
        case("depthwise x2", (2, 3, 6), &[5, 5], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 3),
        case("batch 1 odd", (1, 3, 7), &[11, 13], &[5, 3], &[3, 2], &[1, 1], &[2, 1, 2, 1], 1),
        case("empty batch", (0, 3, 4), &[5, 5], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("kernel = input", (2, 2, 3), &[4, 3], &[4, 3], &[1, 1], &[1, 1], &[0, 0, 0, 0], 1),
        case("stride past the end", (2, 2, 2), &[8, 7], &[2, 2], &[3, 3], &[1, 1], &[0, 0, 0, 0], 1),
        case("1-d", (3, 4, 5), &[17], &[3], &[2], &[1], &[1, 2], 1),
        case("1-d dilated grouped", (2, 4, 2), &[15], &[3], &[1], &[3], &[2, 0], 2),
        case("1-d length 1", (2, 1, 1), &[1], &[1], &[1], &[1], &[0, 0], 1),
        case("3-d", (2, 2, 3), &[4, 5, 3], &[2, 3, 2], &[1, 2, 1], &[1, 1, 2], &[1, 0, 1, 0, 1, 1], 1),
        // Samples side by side in one column matrix (4 per chunk), the last chunk short.
        case("chunked samples", (6, 4, 8), &[8, 8], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("chunked grouped", (5, 4, 4), &[8, 8], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 2),
        // Big enough to cut the weight gradient into column blocks (SPLIT_ABOVE).
        case("split blocks", (4, 16, 32), &[16, 16], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("split blocks, groups", (2, 32, 64), &[12, 12], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 2),
        // Too few column tiles (a pointwise convolution): dW's rows are cut too, the last
        // row block short (140 output channels: 18 panels, the last of 4 rows).
        // Few chunks of samples: the input gradient is cut into blocks of input channels,
        // 7 or 8 channels of 9 rows each, so blocks share panels of the column matrix.
        case("split channels", (2, 60, 32), &[8, 8], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("split rows, pointwise", (2, 40, 140), &[16, 16], &[1, 1], &[1, 1], &[1, 1], &[0, 0, 0, 0], 1),
        // A stem: one column tile and two panels of rows make one task, so the samples
        // are cut into 4 parts (of 9 samples: the first part holds three).
        case("split samples, stem", (9, 3, 16), &[48, 48], &[3, 3], &[2, 2], &[1, 1], &[1, 1, 1, 1], 1),
        // Output grids above GATHER_MAX positions: col2im's runs path.
        // Whole panels of 32 output channels: at the AVX-512 level the weight gradient
        // reads its column matrix in place (a 3x3 layer, a 7x7 stride 2 stem of 5 column
        // blocks, a strided pointwise one, row blocks of 64 channels, dilated, a stem cut
        // into sample parts, 1-d, 3-d).
        case("in place, 3x3", (3, 8, 64), &[10, 9], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("in place, 7x7 stem", (2, 3, 32), &[20, 18], &[7, 7], &[2, 2], &[1, 1], &[3, 3, 3, 3], 1),
        case("in place, 1x1 stride 2", (2, 24, 64), &[9, 7], &[1, 1], &[2, 2], &[1, 1], &[0, 0, 0, 0], 1),
        case("in place, row blocks", (4, 16, 128), &[16, 16], &[1, 1], &[1, 1], &[1, 1], &[0, 0, 0, 0], 1),
        case("in place, dilated", (2, 5, 32), &[11, 12], &[3, 2], &[1, 2], &[2, 3], &[2, 1, 0, 2], 1),
        case("in place, 1-d", (3, 4, 32), &[40], &[3], &[2], &[1], &[1, 1], 1),
        case("in place, split samples", (9, 3, 32), &[48, 48], &[3, 3], &[2, 2], &[1, 1], &[1, 1, 1, 1], 1),
        case("in place, 3-d", (2, 3, 32), &[5, 6, 4], &[3, 3, 3], &[1, 1, 1], &[1, 1, 1], &[1, 1, 1, 1, 1, 1], 1),
        case("large grid runs", (2, 2, 3), &[20, 19], &[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], 1),
        case("large grid stride 2", (1, 3, 2), &[41, 37], &[3, 2], &[2, 2], &[1, 2], &[2, 0, 1, 1], 1),
        case("1-d long", (2, 2, 3), &[300], &[5], &[1], &[2], &[3, 1], 1),
        case("3-d large", (1, 2, 2), &[8, 7, 9], &[3, 3, 3], &[1, 1, 1], &[1, 1, 1], &[1, 1, 1, 1, 1, 1], 1),
        // Pads far beyond the input (strides keep the output small): im2col reads the input
        // along the runs instead of a padded copy of 10^8 elements per channel.
        case("huge pads", (2, 3, 2), &[5, 5], &[3, 2], &[4000, 3000], &[1, 2], &[5000, 4000, 5000, 4000], 1),
        case("huge dilation", (2, 2, 3), &[7, 6], &[2, 3], &[1, 2], &[3000, 2], &[3000, 1, 0, 1], 1),
        case("1-d huge pads", (3, 2, 2), &[9], &[3], &[7000], &[1], &[7000, 7000], 2),
    ]
}

/// Both paths of col2im are exercised: the gather table (small grids) and the runs.
#[test]
fn cases_cover_both_lowerings() {
    let lowered = |c: &Case| {
        ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap().windows().unwrap().gathers()
    };
    let all = cases();
    assert!(all.iter().any(lowered), "no case is lowered through the gather table");
    assert!(all.iter().filter(|c| !lowered(c)).count() >= 4, "too few cases on the runs path");
}

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut u = uniform(seed);
    (0..len).map(|_| (2.0 * u()) as f32).collect()
}

/// `|got - want| <= terms * eps * mag` element by element (the float32 summation bound).
fn within(name: &str, what: &str, got: &[f32], want: &[f64], mag: &[f64], terms: usize) {
    assert_eq!(got.len(), want.len(), "{name}: {what} length");
    let eps = f64::from(f32::EPSILON) * terms.max(1) as f64;
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= eps * m + f64::MIN_POSITIVE, "{name}: {what}[{i}] = {g}, reference {w} (bound {})", eps * m);
    }
}

#[test]
fn fast_matches_reference() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for (seed, c) in cases().into_iter().enumerate() {
        let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input)
            .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let (xl, yl, wl): (usize, usize, usize) =
            (dims.x_shape().iter().product(), dims.y_shape().iter().product(), dims.w_shape().iter().product());
        let x = random(xl, 3 * seed as u64 + 1);
        let dy = random(yl, 3 * seed as u64 + 2);
        let w = random(wl, 3 * seed as u64 + 3);
        let (want_dw, mag_dw) = reference::weight_grad(&dims, &x, &dy);
        let (want_dx, mag_dx) = reference::input_grad(&dims, &dy, &w);
        let dw_terms = c.batch * dims.output_len;
        let dx_terms = dims.mg() * dims.kernel_len;

        let mut dw = vec![f32::NAN; wl];
        weight_grad(&dims, &x, &dy, &mut dw, &Sequential).unwrap();
        within(c.name, "dW", &dw, &want_dw, &mag_dw, dw_terms);
        let mut dx = vec![f32::NAN; xl];
        input_grad(&dims, &dy, &w, &mut dx, &Sequential).unwrap();
        within(c.name, "dX", &dx, &want_dx, &mag_dx, dx_terms);

        // Threads change nothing, bit for bit.
        let mut dw_t = vec![f32::NAN; wl];
        weight_grad(&dims, &x, &dy, &mut dw_t, &RayonPool(Some(&pool))).unwrap();
        assert!(dw.iter().zip(&dw_t).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: dW threaded", c.name);
        let mut dx_t = vec![f32::NAN; xl];
        input_grad(&dims, &dy, &w, &mut dx_t, &RayonPool(Some(&pool))).unwrap();
        assert!(dx.iter().zip(&dx_t).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: dX threaded", c.name);
    }
}

/// Every SIMD level gives both gradients bit for bit (one fused chain per element of the
/// product in the same order at every level), on one thread and on three.
#[test]
fn gradients_are_the_same_at_every_level() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for (seed, c) in cases().into_iter().enumerate() {
        let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
        let x = random(dims.x_shape().iter().product(), 50 + seed as u64);
        let dy = random(dims.y_shape().iter().product(), 90 + seed as u64);
        let wl: usize = dims.w_shape().iter().product();
        let w = random(wl, 70 + seed as u64);
        let xl: usize = dims.x_shape().iter().product();
        let mut want = vec![f32::NAN; wl];
        weight_grad_at(Level::Scalar, &dims, &x, &dy, &mut want, &Sequential).unwrap();
        let mut want_dx = vec![f32::NAN; xl];
        input_grad_at(Level::Scalar, &dims, &dy, &w, &mut want_dx, &Sequential).unwrap();
        for level in crate::simd::available_levels() {
            for threaded in [false, true] {
                let mut got = vec![f32::NAN; wl];
                let par: &dyn Parallelism = if threaded { &RayonPool(Some(&pool)) } else { &Sequential };
                weight_grad_at(level, &dims, &x, &dy, &mut got, par).unwrap();
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{}: dW at {level:?} (threaded {threaded}) differs from the scalar level", c.name);
                let mut got = vec![f32::NAN; xl];
                input_grad_at(level, &dims, &dy, &w, &mut got, par).unwrap();
                let same = got.iter().zip(&want_dx).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{}: dX at {level:?} (threaded {threaded}) differs from the scalar level", c.name);
            }
        }
    }
}

/// The cases named "in place" (and only those of them at the AVX-512 level) read the
/// column matrix in place, the row blocks' case in two blocks of 64 channels; row blocks of
/// 40 and 24 channels (not whole panels of 32), 48 channels, or no padded copy keep the
/// lowering.
#[test]
fn whole_channel_panels_read_the_columns_in_place() {
    for c in cases() {
        let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
        let panels = row_blocks(&dims, blocks(&dims).len());
        let padded = dims.windows().unwrap().pads_a_copy();
        if c.name.starts_with("in place") {
            assert!(in_place_shapes(padded, dims.mg(), &panels), "{}", c.name);
        }
        if c.name == "in place, row blocks" {
            assert_eq!(panels, vec![0..8, 8..16]);
        }
        // Cut into sample parts: each part's block is added into dW (not written there).
        if c.name == "in place, split samples" {
            assert_eq!(sample_parts(&dims, panels.len() * blocks(&dims).len()).len(), SAMPLE_PARTS);
        }
    }
    assert!(in_place_shapes(true, 64, &[0..4, 4..8]));
    assert!(!in_place_shapes(true, 64, &[0..5, 5..8]));
    assert!(!in_place_shapes(true, 48, &[0..3, 3..6]));
    assert!(!in_place_shapes(false, 64, &[0..4, 4..8]));
}

/// The cases with pads far beyond the input really skip the padded copy (else the runs
/// path of im2col goes untested), and the ordinary ones keep it.
#[test]
fn huge_padding_reads_the_input_along_the_runs() {
    for c in cases() {
        let w = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap().windows().unwrap();
        assert_eq!(!w.pads_a_copy(), c.name.contains("huge"), "{}", c.name);
    }
}

/// Small grids put several samples in one column matrix, the last chunk short here.
#[test]
fn small_grids_chunk_samples() {
    let c = cases().into_iter().find(|c| c.name == "chunked samples").unwrap();
    let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
    assert_eq!(samples_per_chunk(&dims), 4);
}

/// The split case really is split (else the block path goes untested).
#[test]
fn large_weight_gradients_are_cut_into_blocks() {
    let c = cases().into_iter().find(|c| c.name == "split blocks").unwrap();
    let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
    assert_eq!(samples_per_chunk(&dims), 1);
    let b = blocks(&dims);
    assert!(b.len() > 1, "{}: {b:?}", c.name);
    assert_eq!(b.first().unwrap().start, 0);
    assert_eq!(b.last().unwrap().end, dims.k());
    assert!(b.windows(2).all(|p| p[0].end == p[1].start));
}

/// A weight gradient with few column tiles is cut along its rows too (else a pointwise
/// convolution runs as one or two uneven tasks), in blocks of whole panels covering every
/// row once; a weight gradient whose columns make tasks enough keeps its rows whole.
#[test]
fn few_column_tiles_cut_the_rows() {
    let c = cases().into_iter().find(|c| c.name == "split rows, pointwise").unwrap();
    let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
    let cols = blocks(&dims);
    assert_eq!(cols, vec![0..32, 32..40]);
    let rows = row_blocks(&dims, cols.len());
    assert_eq!(rows, vec![0..9, 9..18]);
    let big = ConvDims::new(&c.geo, 8, 512, 64, &[8, 8]).unwrap();
    assert_eq!(row_blocks(&big, blocks(&big).len()).len(), 1);
    // Few panels: no row cut (each row block lowers the columns again).
    let narrow = ConvDims::new(&c.geo, 64, 16, 32, &[16, 16]).unwrap();
    assert_eq!(row_blocks(&narrow, blocks(&narrow).len()).len(), 1);
}

/// A weight gradient whose blocks make one task (a stem convolution) is cut along its
/// samples too, in parts of whole chunks covering every sample once, in order; one whose
/// blocks make two tasks or more, or too small to split, keeps its samples whole.
#[test]
fn few_tasks_cut_the_samples() {
    let c = cases().into_iter().find(|c| c.name == "split samples, stem").unwrap();
    let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
    let (cols, rows) = (blocks(&dims), row_blocks(&dims, 1));
    assert_eq!((cols.len(), rows.len()), (1, 1));
    let parts = sample_parts(&dims, 1);
    assert_eq!(parts, vec![0..3, 3..5, 5..7, 7..9]);
    assert_eq!(sample_parts(&dims, 2), vec![0..9]);
    let layer = cases().into_iter().find(|c| c.name == "split blocks").unwrap();
    let layer = ConvDims::new(&layer.geo, layer.batch, layer.channels, layer.out_channels, &layer.input).unwrap();
    assert_eq!(sample_parts(&layer, 8), vec![0..4]);
    let small = cases().into_iter().find(|c| c.name == "2d 3x3 pad 1").unwrap();
    let small = ConvDims::new(&small.geo, small.batch, small.channels, small.out_channels, &small.input).unwrap();
    assert_eq!(sample_parts(&small, 1), vec![0..2]);
}

/// The input gradient of few sample chunks is cut into channel blocks covering every
/// channel once; the grouped split case too.
#[test]
fn few_sample_chunks_cut_the_channels() {
    for (name, count) in [("split channels", 8), ("split blocks, groups", 2)] {
        let c = cases().into_iter().find(|c| c.name == name).unwrap();
        let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
        let b = channel_blocks(&dims);
        assert_eq!(b.len(), count, "{name}: {b:?}");
        assert_eq!((b.first().unwrap().start, b.last().unwrap().end), (0, dims.cg()), "{name}");
        assert!(b.windows(2).all(|p| p[0].end == p[1].start), "{name}");
    }
}

/// The reference is the adjoint of the forward convolution:
/// `<conv(X, W), dY> = <X, dX(dY, W)> = <W, dW(X, dY)>`.
#[test]
fn reference_is_the_adjoint_of_the_forward_convolution() {
    for (seed, c) in cases().into_iter().enumerate() {
        let dims = ConvDims::new(&c.geo, c.batch, c.channels, c.out_channels, &c.input).unwrap();
        let x = random(dims.x_shape().iter().product(), 100 + seed as u64);
        let dy = random(dims.y_shape().iter().product(), 200 + seed as u64);
        let w = random(dims.w_shape().iter().product(), 300 + seed as u64);
        let y = reference::forward(&dims, &x, &w);
        let lhs: f64 = y.iter().zip(&dy).map(|(a, b)| a * f64::from(*b)).sum();
        let dx = reference::input_grad(&dims, &dy, &w).0;
        let dw = reference::weight_grad(&dims, &x, &dy).0;
        let via_x: f64 = dx.iter().zip(&x).map(|(a, b)| a * f64::from(*b)).sum();
        let via_w: f64 = dw.iter().zip(&w).map(|(a, b)| a * f64::from(*b)).sum();
        let tol = 1e-9 * (1.0 + lhs.abs());
        assert!((lhs - via_x).abs() <= tol && (lhs - via_w).abs() <= tol, "{}: {lhs} {via_x} {via_w}", c.name);
    }
}

/// A hand-computed 1-d case: x = [1, 2, 3], w = [1, 10], no pads: y = [21, 32].
#[test]
fn tiny_published_by_hand() {
    let geo = ConvGeometry { kernel: vec![2], strides: vec![1], dilations: vec![1], pads: vec![0, 0], group: 1 };
    let dims = ConvDims::new(&geo, 1, 1, 1, &[3]).unwrap();
    assert_eq!(dims.y_shape(), vec![1, 1, 2]);
    let (x, w, dy) = ([1f32, 2.0, 3.0], [1f32, 10.0], [1f32, 100.0]);
    let mut dw = [0f32; 2];
    weight_grad(&dims, &x, &dy, &mut dw, &Sequential).unwrap();
    assert_eq!(dw, [1.0 + 200.0, 2.0 + 300.0]);
    let mut dx = [0f32; 3];
    input_grad(&dims, &dy, &w, &mut dx, &Sequential).unwrap();
    assert_eq!(dx, [1.0, 10.0 + 100.0, 1000.0]);
}

#[test]
fn bad_shapes_are_refused() {
    let geo = |pads: Vec<usize>, group| ConvGeometry {
        kernel: vec![3, 3],
        strides: vec![1, 1],
        dilations: vec![1, 1],
        pads,
        group,
    };
    let msg = |e: ConvError| e.to_string();
    let e = msg(ConvDims::new(&geo(vec![0; 4], 2), 1, 3, 4, &[5, 5]).unwrap_err());
    assert!(e.contains("group 2 must divide"), "{e}");
    let e = msg(ConvDims::new(&geo(vec![0; 4], 1), 1, 3, 4, &[2, 5]).unwrap_err());
    assert!(e.contains("does not fit"), "{e}");
    let e = ConvDims::new(&geo(vec![0; 3], 1), 1, 3, 4, &[5, 5]).unwrap_err();
    assert!(matches!(&e, ConvError::Attribute { name: "pads", what } if what.contains("must have 4 values")), "{e}");
    let e = msg(ConvDims::new(&geo(vec![0; 4], 1), 1, 3, 4, &[5]).unwrap_err());
    assert!(e.contains("1 spatial dimensions"), "{e}");
    let mut g = geo(vec![0; 4], 1);
    g.strides = vec![1, 0];
    let e = ConvDims::new(&g, 1, 3, 4, &[5, 5]).unwrap_err();
    assert_eq!(e, ConvError::Attribute { name: "strides", what: "must be positive, got [1, 0]".into() });
    // Buffers of the wrong length.
    let dims = ConvDims::new(&geo(vec![1; 4], 1), 1, 1, 1, &[3, 3]).unwrap();
    let err = weight_grad(&dims, &[0.0; 8], &[0.0; 9], &mut [0.0; 9], &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "X", got: 8, expected: 9 });
    let err = input_grad(&dims, &[0.0; 9], &[0.0; 9], &mut [0.0; 10], &Sequential).unwrap_err();
    assert_eq!(err, KernelError::LengthMismatch { what: "dX", got: 10, expected: 9 });
}

/// Attributes whose arithmetic overflows are refused by name before anything is sized by
/// them: pads of 2^62 once aborted (a padded grid sized by them), dilations of 2^62 panicked.
#[test]
fn attribute_overflow_is_refused_by_name() {
    const BIG: usize = 1 << 62;
    let geo =
        |kernel: Vec<usize>, strides, dilations, pads| ConvGeometry { kernel, strides, dilations, pads, group: 1 };
    // pads [2^62, 0, 2^62, 0] on a 5x5 input: the output would have 2^63 + 3 rows.
    let g = geo(vec![3, 3], vec![1, 1], vec![1, 1], vec![BIG, 0, BIG, 0]);
    let e = ConvDims::new(&g, 2, 3, 4, &[5, 5]).unwrap_err();
    assert_eq!(
        e,
        ConvError::Attribute {
            name: "pads",
            what: format!("dimension 0: the input (5) padded by {BIG} + {BIG} exceeds 2^63 - 1"),
        }
    );
    // dilations [2^62, 1], kernel [5, 3]: (5 - 1) * 2^62 overflows.
    let g = geo(vec![5, 3], vec![1, 1], vec![BIG, 1], vec![0; 4]);
    let e = ConvDims::new(&g, 2, 3, 4, &[5, 5]).unwrap_err();
    assert_eq!(
        e,
        ConvError::Attribute {
            name: "dilations",
            what: format!("dimension 0: the dilated kernel ((5 - 1) * {BIG} + 1) exceeds 2^63 - 1"),
        }
    );
    // Values past int64.
    let g = geo(vec![3], vec![usize::MAX], vec![1], vec![0, 0]);
    let e = ConvDims::new(&g, 1, 1, 1, &[5]).unwrap_err();
    assert!(matches!(e, ConvError::Attribute { name: "strides", .. }), "{e}");
    // Padding the output can take (huge strides keep it at one window), but whose padded
    // grid no memory holds: a result, through the runs (all zeros but the one window).
    let g = geo(vec![3, 3], vec![BIG, BIG], vec![1, 1], vec![BIG - 10, 0, 0, 0]);
    let dims = ConvDims::new(&g, 1, 1, 1, &[5, 5]).unwrap();
    assert_eq!(dims.y_shape(), vec![1, 1, 1, 1]);
    let (x, dy) = (random(25, 1), [2.0f32]);
    let mut dw = [f32::NAN; 9];
    weight_grad(&dims, &x, &dy, &mut dw, &Sequential).unwrap();
    assert!(dw.iter().all(|&v| v == 0.0), "{dw:?}");
    // A kernel whose element count overflows.
    let g = geo(vec![1 << 32, 1 << 32], vec![1, 1], vec![1, 1], vec![1 << 32, 1 << 32, 0, 0]);
    let e = ConvDims::new(&g, 1, 1, 1, &[1, 1]).unwrap_err();
    assert!(matches!(e, ConvError::Attribute { name: "kernel_shape", .. }), "{e}");
}

/// Empty tensors (no samples, no channels, an input grid of no element) give zeros or
/// nothing, whatever the other dimensions, without building the windows.
#[test]
fn empty_tensors_need_no_windows() {
    let g = ConvGeometry {
        kernel: vec![3, 3],
        strides: vec![1, 1],
        dilations: vec![1, 1],
        pads: vec![2, 1, 2, 1],
        group: 1,
    };
    // An input grid of no element: every window reads padding, so dW = 0.
    let dims = ConvDims::new(&g, 2, 2, 3, &[0, 4]).unwrap();
    assert_eq!(dims.y_shape(), vec![2, 3, 2, 4]);
    let mut dw = vec![f32::NAN; 3 * 2 * 9];
    weight_grad(&dims, &[], &random(48, 2), &mut dw, &Sequential).unwrap();
    assert!(dw.iter().all(|&v| v == 0.0));
    let dims = ConvDims::new(&g, 0, 2, 3, &[5, 5]).unwrap();
    let mut dw = vec![f32::NAN; 3 * 2 * 9];
    weight_grad(&dims, &[], &[], &mut dw, &Sequential).unwrap();
    assert!(dw.iter().all(|&v| v == 0.0));
    let mut dx = vec![];
    input_grad(&dims, &[], &vec![0.0; 54], &mut dx, &Sequential).unwrap();
}
