//! Adam kernel throughput, in bytes moved per second (28 per float32 parameter: reads x, g,
//! v, h; writes x, v, h), in place: every SIMD level on one thread, the detected level on a
//! 2-thread rayon pool, and the memory ceiling (`ceiling::MemoryCeiling`, the same traffic with no
//! arithmetic) on one thread and two. 1e4 parameters stay in L1/L2, 1e6 in L2/L3, 16e6 do not.
//!
//! `cargo bench -p trainops-kernels --bench adam` (about a minute on 2 cores).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use trainops_kernels::ceiling::MemoryCeiling;
use trainops_kernels::optim::adam::{Adam, AdamAttrs, AdamCoeffs};
use trainops_kernels::optim::Optimizer;
use trainops_kernels::simd::{available_levels, detected};
use trainops_kernels::{InOut, Parallelism, RayonPool, Sequential};

/// Parameter counts.
const SIZES: [(usize, &str); 3] = [(10_000, "1e4"), (1_000_000, "1e6"), (16_000_000, "16e6")];
/// Threads of the parallel runs.
const THREADS: usize = 2;

fn adam(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(THREADS).build().expect("rayon pool");
    let coeffs = AdamCoeffs::<f32>::new(&AdamAttrs::default(), 1e-3);
    for (n, label) in SIZES {
        let (mut x, g, mut v, mut h) = (vec![1.0f32; n], vec![1e-3f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        let mut group = c.benchmark_group(format!("adam/{label}"));
        group.throughput(Throughput::Bytes(28 * n as u64));
        let two = RayonPool(Some(&pool));
        let mut runs: Vec<(String, Option<trainops_kernels::Level>, &dyn Parallelism)> =
            available_levels().into_iter().map(|l| (format!("{l:?}, 1 thread"), Some(l), &Sequential as _)).collect();
        runs.push((format!("{:?}, {THREADS} threads", detected()), Some(detected()), &two));
        runs.push(("memory ceiling, 1 thread".into(), None, &Sequential));
        runs.push((format!("memory ceiling, {THREADS} threads"), None, &two));
        for (name, level, par) in runs {
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    let streams = [InOut::in_place(&mut x), InOut::in_place(&mut v), InOut::in_place(&mut h)];
                    let t = Adam::param(streams, &g).expect("equal lengths");
                    match level {
                        Some(l) => Adam::step_with(l, &coeffs, vec![t], par),
                        None => MemoryCeiling::step(&Default::default(), vec![t], par),
                    }
                    black_box(&x);
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    targets = adam
}
criterion_main!(benches);
