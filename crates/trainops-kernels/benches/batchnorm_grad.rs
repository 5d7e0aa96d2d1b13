//! Training-mode BatchNormalization's backward (`grad::batchnorm::batch_norm_train_grad`)
//! and forward (`grad::batchnorm::forward::batch_norm_train`) at the shapes of the
//! architecture bench's CNNs, on a rayon pool of 1 and of 2 threads: the median of `reps`
//! calls, the 2-thread speed-up, and the bytes each moves at least (X and dY read, dX
//! written; X read, Y written) per second.
//!
//! `cargo bench -p trainops-kernels --bench batchnorm_grad [-- reps]`.

use std::time::Instant;

use trainops_kernels::grad::batchnorm::forward::{batch_norm_train, BnOutputs, BnParams};
use trainops_kernels::grad::batchnorm::{batch_norm_train_grad, BnGrads, BnShape};
use trainops_kernels::RayonPool;

fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let reps = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(50);
    let pools: Vec<rayon::ThreadPool> =
        [1, 2].iter().map(|&n| rayon::ThreadPoolBuilder::new().num_threads(n).build().expect("pool")).collect();
    for (n, c, s) in
        [(8, 64, 4096), (8, 64, 1024), (8, 128, 256), (16, 16, 4096), (16, 96, 256), (16, 576, 16), (16, 1024, 1)]
    {
        let shape = BnShape { n, c, s };
        let len = shape.len();
        let x: Vec<f32> = (0..len).map(|k| ((k * 7919 + 13) % 1009) as f32 / 1009.0 - 0.5).collect();
        let dy: Vec<f32> = (0..len).map(|k| ((k * 104_729 + 7) % 997) as f32 / 997.0 - 0.5).collect();
        let scale: Vec<f32> = (0..c).map(|k| 0.5 + k as f32 / c as f32).collect();
        let (mut dx, mut ds, mut db) = (vec![0f32; len], vec![0f32; c], vec![0f32; c]);
        let ms: Vec<f64> = pools
            .iter()
            .map(|p| {
                median_ms(reps, || {
                    let out = BnGrads { dx: Some(&mut dx), dscale: Some(&mut ds), dbias: Some(&mut db) };
                    batch_norm_train_grad(&dy, &x, &scale, 1e-5, shape, out, &RayonPool(Some(p))).expect("sizes");
                })
            })
            .collect();
        let gbs = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6;
        println!(
            "backward N={n:3} C={c:5} S={s:5}: {:8.3} ms  {:8.3} ms  x{:.2}  {:5.1} GB/s at 1 thread",
            ms[0],
            ms[1],
            ms[0] / ms[1],
            gbs(12 * len, ms[0])
        );
        let bias: Vec<f32> = (0..c).map(|k| k as f32 / c as f32 - 0.5).collect();
        let var = vec![1.0f32; c];
        let mut y = vec![0f32; len];
        let fwd: Vec<f64> = pools
            .iter()
            .map(|p| {
                median_ms(reps, || {
                    let params = BnParams {
                        scale: &scale,
                        bias: &bias,
                        input_mean: &bias,
                        input_var: &var,
                        epsilon: 1e-5,
                        momentum: 0.9,
                    };
                    let out = BnOutputs { y: &mut y, running_mean: Some(&mut ds), running_var: Some(&mut db) };
                    batch_norm_train(&x, params, shape, out, &RayonPool(Some(p))).expect("sizes");
                })
            })
            .collect();
        println!(
            "forward  N={n:3} C={c:5} S={s:5}: {:8.3} ms  {:8.3} ms  x{:.2}  {:5.1} GB/s at 1 thread",
            fwd[0],
            fwd[1],
            fwd[0] / fwd[1],
            gbs(8 * len, fwd[0])
        );
    }
}
