//! Times the convolution gradients on a few shapes (`cargo run --release -p trainops-kernels
//! --example conv_grad_timing`); not a test, numbers only.

use std::time::Instant;

use trainops_kernels::grad::conv::{input_grad, weight_grad, ConvDims, ConvGeometry};
use trainops_kernels::Sequential;

fn main() {
    let only = std::env::args().nth(1).unwrap_or_default();
    // (batch, channels, out_channels, grid, stride)
    for &(n, c, m, h, s) in
        &[(64, 8, 16, 4, 1), (64, 1, 8, 8, 1), (8, 16, 16, 32, 1), (8, 16, 32, 32, 2), (8, 32, 32, 16, 1)]
    {
        let geo =
            ConvGeometry { kernel: vec![3, 3], strides: vec![s, s], dilations: vec![1, 1], pads: vec![1; 4], group: 1 };
        let dims = ConvDims::new(&geo, n, c, m, &[h, h]).unwrap();
        let len = |v: Vec<usize>| v.iter().product::<usize>();
        let x = vec![0.5f32; len(dims.x_shape())];
        let dy = vec![0.25f32; len(dims.y_shape())];
        let w = vec![0.125f32; len(dims.w_shape())];
        let mut dw = vec![0f32; w.len()];
        let mut dx = vec![0f32; x.len()];
        let reps = 50;
        let reps = if only == "input" { 0 } else { reps };
        let t = Instant::now();
        for _ in 0..reps {
            weight_grad(&dims, &x, &dy, &mut dw, &Sequential).unwrap();
        }
        let tw = t.elapsed().as_secs_f64() / f64::from(reps.max(1)) * 1e6;
        let reps = if only == "weight" { 0 } else { 50 };
        let t = Instant::now();
        for _ in 0..reps {
            input_grad(&dims, &dy, &w, &mut dx, &Sequential).unwrap();
        }
        let ti = t.elapsed().as_secs_f64() / f64::from(reps.max(1)) * 1e6;
        println!("N{n} C{c} M{m} {h}x{h} s{s}: weight_grad {tw:.0} us, input_grad {ti:.0} us");
    }
}
