//! MaxPool's gradient from its input (`grad::pool::max_pool_grad_from_input`) at the BN CNN
//! training bench's two pooling layers (batch 256: 8 planes 8x8 -> 4x4 and 16 planes 4x4 ->
//! 2x2, 2x2 windows of stride 2), on one thread.
//!
//! `cargo bench -p trainops-kernels --bench pool_grad`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use trainops_kernels::grad::pool::{max_pool_grad_from_input, Window};
use trainops_kernels::Sequential;

fn pool_grad(c: &mut Criterion) {
    let window = Window { kernel: vec![2, 2], strides: vec![2, 2], dilations: vec![1, 1], pad_begin: vec![0, 0] };
    for (planes, side) in [(256 * 8, 8usize), (256 * 16, 4)] {
        let (inp, out) = (side * side, side * side / 4);
        // Pseudo-random data: the argmax lands anywhere in a window, as in training.
        let x: Vec<f32> = (0..planes * inp).map(|k| ((k * 7919 + 13) % 1009) as f32 / 1009.0 - 0.5).collect();
        let gy: Vec<f32> = (0..planes * out).map(|k| (k % 17) as f32 - 8.0).collect();
        let mut gx = vec![0.0; planes * inp];
        c.bench_function(&format!("max_pool_grad_from_input/2x2/{planes}x{side}x{side}"), |b| {
            b.iter(|| {
                max_pool_grad_from_input(
                    black_box(&gy),
                    black_box(&x),
                    planes,
                    &[side, side],
                    &[side / 2, side / 2],
                    &window,
                    &mut gx,
                    &Sequential,
                )
                .expect("sizes")
            })
        });
    }
}

criterion_group!(benches, pool_grad);
criterion_main!(benches);
