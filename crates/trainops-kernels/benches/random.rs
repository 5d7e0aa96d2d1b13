//! Distribution throughput on one thread, in bytes of output written per second, beside the
//! raw Philox bits of the same byte count: uniform and normal float32, dropout on float32
//! data (out of place, no mask), every SIMD level; 1 MiB stays in cache, 64 MiB does not.
//!
//! `cargo bench -p trainops-kernels --bench random`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use trainops_kernels::random::draw::Output;
use trainops_kernels::random::philox::{self, available_levels};
use trainops_kernels::random::{dropout, normal, uniform};
use trainops_kernels::{InOut, Sequential};

/// Output sizes in bytes.
const SIZES: [(usize, &str); 2] = [(1 << 20, "1MiB"), (64 << 20, "64MiB")];

fn random(c: &mut Criterion) {
    let state = [0x0123_4567, 0x89AB_CDEF, 0, 0, 0xDEAD_BEEF, 0x1234_5678];
    for (bytes, label) in SIZES {
        let n = bytes / 4;
        let (mut bits, mut out, data) = (vec![1u32; n], vec![1f32; n], vec![1f32; n]);
        let mut group = c.benchmark_group(format!("random/{label}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        for level in available_levels() {
            let id = |what: &str| BenchmarkId::new(what.to_owned(), format!("{level:?}"));
            group.bench_function(id("philox bits"), |b| {
                b.iter(|| black_box(philox::fill_with(level, &state, &mut bits, &Sequential)))
            });
            group.bench_function(id("uniform f32"), |b| {
                b.iter(|| black_box(uniform::fill_with(level, &state, 0.0, 1.0, Output::F32(&mut out), &Sequential)))
            });
            group.bench_function(id("dropout f32"), |b| {
                b.iter(|| {
                    let d = dropout::Data::F32(InOut::split(&data, &mut out).expect("same lengths"));
                    black_box(dropout::fill_with(level, &state, 0.5, d, None, &Sequential))
                })
            });
            group.bench_function(id("normal f32"), |b| {
                b.iter(|| black_box(normal::fill_with(level, &state, 0.0, 1.0, Output::F32(&mut out), &Sequential)))
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    targets = random
}
criterion_main!(benches);
