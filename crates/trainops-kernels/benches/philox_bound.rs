//! The compute bound of Philox4x32-10 on this core, from the throughput of its operations:
//! a micro-benchmark of the 32x32->64 multiply (`vpmuludq`, 512- and 256-bit) and of one
//! whole vector round, next to the clock, then the bounds they give in GB/s of output.
//!
//! `cargo bench -p trainops-kernels --bench philox_bound -- [REPEATS]`
//!
//! A block is 4 words (16 bytes) and takes 10 rounds of 2 multiplies: 20 products. A
//! `vpmuludq` makes one 64-bit product per 64-bit lane (8 in a 512-bit register, 4 in a 256-bit
//! one), so the multiply bound is `products per second / 20 * 16` bytes per second per core.
//! A round of the AVX-512 kernel (`random/philox/x86.rs`) on 8 blocks is 2 multiplies, 2
//! shuffles (the products' high halves to the low ones) and 2 three-way XORs; the round bound
//! is `rounds per second * 8 / 10 * 16`. Each figure is the best of REPEATS timings (default
//! 5), so that other processes on a shared machine lower it as little as possible. x86_64 with
//! AVX-512F only; elsewhere it says so and exits.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::asm;
    use core::arch::x86_64::*;
    use std::time::Instant;

    const ITERS: u64 = 20_000_000;

    /// Best (highest) rate in operations per second of `f`, which runs `ops` operations.
    fn best(repeats: usize, ops: f64, f: impl Fn()) -> f64 {
        (0..repeats)
            .map(|_| {
                let t = Instant::now();
                f();
                ops / t.elapsed().as_secs_f64()
            })
            .fold(0.0, f64::max)
    }

    /// A chain of dependent 512-bit integer additions (latency 1): the clock while 512-bit
    /// integer work runs.
    #[target_feature(enable = "avx512f")]
    fn clock_chain(n: u64) {
        let mut a = _mm512_set1_epi64(1);
        let b = _mm512_set1_epi64(3);
        for _ in 0..n {
            // SAFETY: register-only instructions of AVX-512F, which this function enables.
            unsafe {
                asm!("vpaddq {a}, {a}, {b}", "vpaddq {a}, {a}, {b}", "vpaddq {a}, {a}, {b}", "vpaddq {a}, {a}, {b}",
                    a = inout(zmm_reg) a, b = in(zmm_reg) b, options(pure, nomem, nostack));
            }
        }
        std::hint::black_box(a);
    }

    /// 16 independent chains of `vpmuludq` on 512-bit registers (16 chains cover its latency).
    #[target_feature(enable = "avx512f")]
    fn mul512(n: u64) {
        let m = _mm512_set1_epi32(0xD251_1F53u32 as i32);
        let mut a = [_mm512_set1_epi32(3); 16];
        for _ in 0..n {
            for x in &mut a {
                // SAFETY: a register-only instruction of AVX-512F, which this function enables.
                unsafe {
                    asm!("vpmuludq {a}, {a}, {m}", a = inout(zmm_reg) *x, m = in(zmm_reg) m, options(pure, nomem, nostack))
                };
            }
        }
        std::hint::black_box(a);
    }

    /// 16 independent chains of `vpmuludq` on 256-bit registers.
    #[target_feature(enable = "avx2")]
    fn mul256(n: u64) {
        let m = _mm256_set1_epi32(0xD251_1F53u32 as i32);
        let mut a = [_mm256_set1_epi32(3); 16];
        for _ in 0..n {
            for x in &mut a {
                // SAFETY: a register-only instruction of AVX2, which this function enables.
                unsafe {
                    asm!("vpmuludq {a}, {a}, {m}", a = inout(ymm_reg) *x, m = in(ymm_reg) m, options(pure, nomem, nostack))
                };
            }
        }
        std::hint::black_box(a);
    }

    /// Philox rounds on 7 independent sets of 8 blocks (as the kernel's batch), each round
    /// the kernel's 6 instructions on words 0 and 2 (words 1 and 3 are the products).
    #[target_feature(enable = "avx512f")]
    fn rounds512(n: u64) {
        let m = _mm512_set1_epi32(0xD251_1F53u32 as i32);
        let k = _mm512_set1_epi32(0x9E37_79B9u32 as i32);
        let mut c = [[_mm512_set1_epi32(3); 2]; 7];
        let mut p = [[_mm512_set1_epi32(5); 2]; 7];
        for _ in 0..n {
            for (c, p) in c.iter_mut().zip(&mut p) {
                // SAFETY: register-only instructions of AVX-512F, which this function enables.
                unsafe {
                    asm!(
                        "vpmuludq {p0}, {c0}, {m}",
                        "vpmuludq {p1}, {c1}, {m}",
                        "vpshufd {c0}, {p1}, 0xF5",
                        "vpternlogq {c0}, {p0}, {k}, 0x96",
                        "vpshufd {c1}, {p0}, 0xF5",
                        "vpternlogq {c1}, {p1}, {k}, 0x96",
                        c0 = inout(zmm_reg) c[0], c1 = inout(zmm_reg) c[1],
                        p0 = inout(zmm_reg) p[0], p1 = inout(zmm_reg) p[1],
                        m = in(zmm_reg) m, k = in(zmm_reg) k, options(pure, nomem, nostack)
                    );
                }
            }
        }
        std::hint::black_box((c, p));
    }

    pub fn main() {
        let repeats = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(5usize);
        if !(std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx2")) {
            println!("philox_bound: needs AVX-512F (and AVX2); this CPU lacks them");
            return;
        }
        let n = ITERS;
        // SAFETY: AVX-512F was detected above.
        let ghz = best(repeats, 4.0 * n as f64, || unsafe { clock_chain(n) }) / 1e9;
        // SAFETY: AVX-512F was detected above.
        let m512 = best(repeats, 16.0 * (n / 4) as f64, || unsafe { mul512(n / 4) });
        // SAFETY: AVX2 was detected above.
        let m256 = best(repeats, 16.0 * (n / 4) as f64, || unsafe { mul256(n / 4) });
        // SAFETY: AVX-512F was detected above.
        let r512 = best(repeats, 7.0 * (n / 4) as f64, || unsafe { rounds512(n / 4) });
        let products = (8.0 * m512).max(4.0 * m256);
        println!("clock with 512-bit integer work (dependent vpaddq zmm): {ghz:.2} GHz");
        println!(
            "vpmuludq zmm: {:.2} G/s ({:.2} per cycle), {:.1} G products/s",
            m512 / 1e9,
            m512 / 1e9 / ghz,
            8.0 * m512 / 1e9
        );
        println!(
            "vpmuludq ymm: {:.2} G/s ({:.2} per cycle), {:.1} G products/s",
            m256 / 1e9,
            m256 / 1e9 / ghz,
            4.0 * m256 / 1e9
        );
        println!(
            "round of 8 blocks (2 vpmuludq, 2 vpshufd, 2 vpternlogq): {:.2} G/s, {:.2} cycles each",
            r512 / 1e9,
            ghz * 1e9 / r512
        );
        println!(
            "per core: multiply bound {:.1} GB/s (20 products per 16-byte block), round bound {:.1} GB/s",
            products / 20.0 * 16.0 / 1e9,
            r512 * 8.0 / 10.0 * 16.0 / 1e9
        );
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
    #[cfg(not(target_arch = "x86_64"))]
    println!("philox_bound: x86_64 only");
}
