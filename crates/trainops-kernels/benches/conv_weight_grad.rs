//! The convolution's weight gradient (`grad::conv::weight_grad`) on resnet18's convolutions
//! at 3x128x128, batch 8 (every distinct shape of the network, with how many times a step
//! runs it), at 1 and 2 threads: GFLOP/s per shape (2 x the multiply-adds) and the weighted
//! sum, the weight gradients' time in one training step.
//!
//! `cargo bench -p trainops-kernels --bench conv_weight_grad [-- REPS] [FILTER] [--dx]`
//! (best of REPS, 5 unless given, after one untimed call; only the shapes whose name holds
//! FILTER; `--dx`: the input gradient, `grad::conv::input_grad`, instead). Plain timing rather than criterion: runs of old
//! and new builds are meant to be interleaved on a shared machine.

use std::hint::black_box;
use std::time::Instant;

use trainops_kernels::grad::conv::{input_grad, weight_grad, ConvDims, ConvGeometry};
use trainops_kernels::{Parallelism, RayonPool, Sequential};

/// (name, uses per step, in channels, out channels, input side, kernel, stride, pad).
type Shape = (&'static str, usize, usize, usize, usize, usize, usize, usize);

const SHAPES: [Shape; 11] = [
    ("stem 7x7 s2 3->64 @128", 1, 3, 64, 128, 7, 2, 3),
    ("layer1 3x3 64->64 @32", 4, 64, 64, 32, 3, 1, 1),
    ("layer2 3x3 s2 64->128 @32", 1, 64, 128, 32, 3, 2, 1),
    ("layer2 3x3 128->128 @16", 3, 128, 128, 16, 3, 1, 1),
    ("layer2 1x1 s2 64->128 @32", 1, 64, 128, 32, 1, 2, 0),
    ("layer3 3x3 s2 128->256 @16", 1, 128, 256, 16, 3, 2, 1),
    ("layer3 3x3 256->256 @8", 3, 256, 256, 8, 3, 1, 1),
    ("layer3 1x1 s2 128->256 @16", 1, 128, 256, 16, 1, 2, 0),
    ("layer4 3x3 s2 256->512 @8", 1, 256, 512, 8, 3, 2, 1),
    ("layer4 3x3 512->512 @4", 3, 512, 512, 4, 3, 1, 1),
    ("layer4 1x1 s2 256->512 @8", 1, 256, 512, 8, 1, 2, 0),
];
const BATCH: usize = 8;

fn main() {
    let reps: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(5);
    let dx_mode = std::env::args().any(|a| a == "--dx");
    let filter = std::env::args().skip(1).find(|a| a.parse::<usize>().is_err() && !a.starts_with('-'));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
    let two = RayonPool(Some(&pool));
    let pars: [(&str, &dyn Parallelism); 2] = [("1 thread", &Sequential), ("2 threads", &two)];
    for (label, par) in pars {
        let mut step = 0.0;
        println!("{label}:");
        for (name, uses, c, m, side, k, s, p) in SHAPES {
            if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
                continue;
            }
            let geo = ConvGeometry {
                kernel: vec![k, k],
                strides: vec![s, s],
                dilations: vec![1, 1],
                pads: vec![p; 4],
                group: 1,
            };
            let dims = ConvDims::new(&geo, BATCH, c, m, &[side, side]).expect("shapes");
            let len = |s: Vec<usize>| s.iter().product::<usize>();
            let (xl, yl, wl) = (len(dims.x_shape()), len(dims.y_shape()), len(dims.w_shape()));
            let x: Vec<f32> = (0..xl).map(|i| ((i * 7919 + 13) % 1009) as f32 / 1009.0 - 0.5).collect();
            let dy: Vec<f32> = (0..yl).map(|i| ((i * 104_729 + 7) % 997) as f32 / 997.0 - 0.5).collect();
            let mut dw = vec![0f32; wl];
            let mut dx = vec![0f32; xl];
            let flops = 2.0 * (wl * yl / m) as f64;
            let mut best = f64::INFINITY;
            for _ in 0..=reps {
                let t = Instant::now();
                if dx_mode {
                    input_grad(&dims, black_box(&dy), black_box(&dw), &mut dx, par).expect("sizes");
                } else {
                    weight_grad(&dims, black_box(&x), black_box(&dy), &mut dw, par).expect("sizes");
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            black_box((&dw, &dx));
            step += uses as f64 * best;
            println!("  {name:<28} x{uses}  {:8.3} ms  {:6.1} GFLOP/s", best * 1e3, flops / best / 1e9);
        }
        let what = if dx_mode { "input" } else { "weight" };
        println!("  {what} gradients of one step: {:.1} ms", step * 1e3);
    }
}
