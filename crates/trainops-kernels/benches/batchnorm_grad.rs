//! Training-mode BatchNormalization's backward (`grad::batchnorm::batch_norm_train_grad`) at
//! the shapes of the architecture bench's CNNs, on a rayon pool of 1 and of 2 threads: the
//! median of `reps` calls and the 2-thread speed-up.
//!
//! `cargo bench -p trainops-kernels --bench batchnorm_grad [-- reps]`.

use std::time::Instant;

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
        println!("N={n:3} C={c:5} S={s:5}: {:8.3} ms  {:8.3} ms  x{:.2}", ms[0], ms[1], ms[0] / ms[1]);
    }
}
