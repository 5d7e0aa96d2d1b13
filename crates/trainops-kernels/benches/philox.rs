//! Philox4x32-10 fill throughput, in bytes of output written per second: every SIMD level
//! on one thread, the detected level on a 2-thread rayon pool, and a write-only yardstick
//! (`fill(0)`, one thread and two) of the same size. 1 MiB stays in cache; 64 MiB does not
//! fit in L2. Output buffers are allocated and touched once, outside the timed loop.
//!
//! `cargo bench -p trainops-kernels --bench philox` (about a minute on 2 cores).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rayon::prelude::*;
use trainops_kernels::random::philox::{available_levels, detected, fill_with};
use trainops_kernels::{RayonPool, Sequential};

/// Output sizes in bytes.
const SIZES: [(usize, &str); 2] = [(1 << 20, "1MiB"), (64 << 20, "64MiB")];
/// Threads of the parallel runs.
const THREADS: usize = 2;

fn philox(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(THREADS).build().expect("rayon pool");
    let state = [0x0123_4567, 0x89AB_CDEF, 0, 0, 0xDEAD_BEEF, 0x1234_5678];
    for (bytes, label) in SIZES {
        let mut out = vec![1u32; bytes / 4];
        let mut group = c.benchmark_group(format!("philox/{label}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        for level in available_levels() {
            group.bench_function(BenchmarkId::new(format!("{level:?}"), "1 thread"), |b| {
                b.iter(|| black_box(fill_with(level, black_box(&state), &mut out, &Sequential)))
            });
        }
        group.bench_function(BenchmarkId::new(format!("{:?}", detected()), format!("{THREADS} threads")), |b| {
            b.iter(|| black_box(fill_with(detected(), black_box(&state), &mut out, &RayonPool(Some(&pool)))))
        });
        group.bench_function(BenchmarkId::new("write-only fill(0)", "1 thread"), |b| {
            b.iter(|| black_box(&mut out[..]).fill(0))
        });
        group.bench_function(BenchmarkId::new("write-only fill(0)", format!("{THREADS} threads")), |b| {
            b.iter(|| {
                let half = out.len().div_ceil(THREADS);
                pool.install(|| black_box(&mut out[..]).par_chunks_mut(half).for_each(|c| c.fill(0)))
            })
        });
        group.finish();
        black_box(&out);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    targets = philox
}
criterion_main!(benches);
