//! The plain definition [`super::matmul`] must reproduce bit for bit: every element an FMA
//! chain over `k` ascending from zero, then `alpha` (skipped at 1), then the bias.

use super::Dims;

/// `c = alpha op(a) op(b) + bias`, one element at a time.
pub fn matmul(d: Dims, a: &[f32], b: &[f32], alpha: f32, bias: Option<&[f32]>, c: &mut [f32]) {
    let (lda, ldb) = (d.a_strides(), d.b_strides());
    for i in 0..d.m {
        for j in 0..d.n {
            let mut acc = 0.0f32;
            for kk in 0..d.k {
                acc = a[i * lda.0 + kk * lda.1].mul_add(b[kk * ldb.0 + j * ldb.1], acc);
            }
            if alpha != 1.0 {
                acc *= alpha;
            }
            c[i * d.n + j] = bias.map_or(acc, |b| acc + b[j]);
        }
    }
}
