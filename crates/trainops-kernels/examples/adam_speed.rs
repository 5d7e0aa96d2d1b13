//! Quick look at Adam kernel speed against the memory ceiling (`ceiling::touch`: reads 4
//! arrays, writes 3 in place), single-threaded and on a 2-thread rayon pool. Not a test: timings are noisy.
//! `cargo run --release -p trainops-kernels --example adam_speed [N]`

use std::hint::black_box;
use std::time::Instant;

use trainops_kernels::adam::{step_with, AdamAttrs, AdamCoeffs, AdamTensor};
use trainops_kernels::ceiling::touch;
use trainops_kernels::simd::available_levels;
use trainops_kernels::{InOut, Parallelism, RayonPool, Sequential};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(16_000_000);
    let (mut x, g, mut v, mut h) = (vec![1.0f32; n], vec![0.5f32; n], vec![0.1f32; n], vec![0.2f32; n]);
    let c = AdamCoeffs::<f32>::new(&AdamAttrs::default(), 1e-3);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let pars: [(&str, &dyn Parallelism); 2] = [("1 thread", &Sequential), ("2 threads", &RayonPool(Some(&pool)))];
    let bytes = 28.0 * n as f64;
    for (pname, par) in pars {
        let mut rows: Vec<(String, Vec<f64>)> = Vec::new();
        for _ in 0..7 {
            let t0 = Instant::now();
            let t =
                AdamTensor::new(InOut::in_place(&mut x), &g, InOut::in_place(&mut v), InOut::in_place(&mut h)).unwrap();
            touch(vec![t], par);
            black_box(&x);
            push(&mut rows, "ceiling (4 reads, 3 writes)", t0.elapsed().as_secs_f64());
            for level in available_levels() {
                let t0 = Instant::now();
                let t = AdamTensor::new(InOut::in_place(&mut x), &g, InOut::in_place(&mut v), InOut::in_place(&mut h))
                    .unwrap();
                step_with(level, &c, vec![t], par);
                black_box(&x);
                push(&mut rows, &format!("adam {level:?}"), t0.elapsed().as_secs_f64());
            }
        }
        for (name, times) in rows {
            let m = median(times);
            println!("n={n} {pname:>9} {name:<28} {:8.3} ms {:6.2} GB/s", m * 1e3, bytes / m / 1e9);
        }
    }
}

fn push(rows: &mut Vec<(String, Vec<f64>)>, name: &str, t: f64) {
    match rows.iter_mut().find(|(n, _)| n == name) {
        Some((_, v)) => v.push(t),
        None => rows.push((name.to_owned(), vec![t])),
    }
}
