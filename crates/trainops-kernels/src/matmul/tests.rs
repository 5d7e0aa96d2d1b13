use super::*;
use crate::simd::available_levels;
use crate::test_util::uniform;
use crate::{KernelError, RayonPool, Sequential};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut u = uniform(seed);
    (0..n).map(|_| u() as f32).collect()
}

/// Shapes around every block edge: partial strips and panels, more than one depth block
/// (KC) and column block (NC), a row count past MC, and the degenerate ones.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (13, 45, 7),
    (12, 32, 256),
    (MC + 5, 3 * 32 + 7, KC + 3),
    (3, NC + 33, 2 * KC + 1),
    (40, 70, 600),
    (5, 9, 0),
];

/// Every level and thread count gives the reference's bits, for every layout, alpha and
/// bias; and the reference is within float32's `k`-term bound of a float64 product.
#[test]
fn matches_the_reference_bitwise_and_float64_within_bound() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for &(m, n, k) in SHAPES {
        for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
            let d = Dims { m, n, k, trans_a, trans_b };
            let a = random(m * k, (m * 7 + k) as u64);
            let b = random(k * n, (n * 5 + k + 1) as u64);
            let bias = random(n, 99);
            for (alpha, bias) in [(1.0, None), (0.5, Some(&bias[..])), (-1.25, None)] {
                let mut want = vec![0.0f32; m * n];
                reference::matmul(d, &a, &b, alpha, bias, &mut want);
                let (lda, ldb) = (d.a_strides(), d.b_strides());
                for i in 0..m {
                    for j in 0..n {
                        let terms: Vec<f64> = (0..k)
                            .map(|q| f64::from(a[i * lda.0 + q * lda.1]) * f64::from(b[q * ldb.0 + j * ldb.1]))
                            .collect();
                        let exact =
                            f64::from(alpha) * terms.iter().sum::<f64>() + bias.map_or(0.0, |b| f64::from(b[j]));
                        let mag = f64::from(alpha.abs()) * terms.iter().map(|t| t.abs()).sum::<f64>()
                            + bias.map_or(0.0, |b| f64::from(b[j].abs()));
                        // k roundings of the chain, one of alpha, one of the bias.
                        let g = (k + 2) as f64 * f64::from(f32::EPSILON) / 2.0;
                        let got = f64::from(want[i * n + j]);
                        assert!(
                            (got - exact).abs() <= 1.01 * g * mag + f64::from(f32::MIN_POSITIVE),
                            "{d:?} ({i}, {j})"
                        );
                    }
                }
                for level in available_levels() {
                    LEVEL.with(|l| l.set(Some(level)));
                    // the kernel's blocks, and small ones that cut every product many ways
                    for blocks in [(KC, MC, NC, PACK_A_FROM), (16, 8, 64, 0), (16, 8, 64, usize::MAX)] {
                        BLOCKS.with(|b| b.set(blocks));
                        for par in [&Sequential as &dyn Parallelism, &RayonPool(Some(&pool))] {
                            let mut c = vec![f32::NAN; m * n];
                            matmul(par, d, &a, &b, alpha, bias, &mut c).unwrap();
                            let same = c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                            assert!(same, "{level:?} {blocks:?} {d:?} alpha {alpha} bias {}", bias.is_some());
                        }
                    }
                    BLOCKS.with(|b| b.set((KC, MC, NC, PACK_A_FROM)));
                    LEVEL.with(|l| l.set(None));
                }
            }
        }
    }
}

/// Wrong lengths are refused before anything is written.
#[test]
fn wrong_lengths_are_refused_and_c_untouched() {
    let d = Dims { m: 2, n: 3, k: 4, trans_a: false, trans_b: true };
    let (a, b) = (vec![1.0f32; 8], vec![1.0f32; 12]);
    let mut c = vec![7.0f32; 6];
    let e = matmul(&Sequential, d, &a[..7], &b, 1.0, None, &mut c).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "A", got: 7, expected: 8 });
    let e = matmul(&Sequential, d, &a, &b, 1.0, Some(&[0.0; 2]), &mut c).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "bias", got: 2, expected: 3 });
    let e = matmul(&Sequential, d, &a, &b, 1.0, None, &mut c[..5]).unwrap_err();
    assert_eq!(e, KernelError::LengthMismatch { what: "C", got: 5, expected: 6 });
    assert!(c.iter().all(|&v| v == 7.0));
    // The sum of four ones.
    matmul(&Sequential, d, &a, &b, 1.0, None, &mut c).unwrap();
    assert!(c.iter().all(|&v| v == 4.0));
}

#[cfg(test)]
mod speed {
    use super::*;

    /// GFLOP/s on the products a language model's and ViT's steps run, with the kernel's
    /// blocks and BLIS's usual larger ones (`MM=mxnxk` runs one shape; `cargo test --release
    /// -p trainops-kernels matmul::tests::speed -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn rates() {
        for &(m, n, k, ta, tb) in &[
            (1024, 960, 49152, false, false),
            (1024, 4096, 960, false, true),
            (2048, 960, 1024, true, false),
            (1024, 2560, 960, false, false),
            (520, 1536, 384, false, true),
            (520, 384, 1536, false, false),
            (1536, 384, 520, true, false),
            (2048, 2048, 2048, false, false),
            (384, 96, 8192, true, false),
            (768, 192, 2048, true, false),
        ] {
            let d = Dims { m, n, k, trans_a: ta, trans_b: tb };
            if std::env::var("MM").is_ok_and(|f| f != format!("{m}x{n}x{k}")) {
                continue;
            }
            let a = vec![0.5f32; m * k];
            let b = vec![0.25f32; k * n];
            let mut c = vec![0.0f32; m * n];
            matmul(&Sequential, d, &a, &b, 1.0, None, &mut c).unwrap();
            let reps = (1usize << 31) / (m * k * n) + 1;
            BLOCKS.with(|b| b.set((KC, MC, NC, PACK_A_FROM)));
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                matmul(&Sequential, d, &a, &b, 1.0, None, &mut c).unwrap();
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            println!("{m}x{n}x{k} {ta} {tb}: {:.0} GFLOP/s", 2.0 * (m * k * n) as f64 / s / 1e9);
        }
    }
}
