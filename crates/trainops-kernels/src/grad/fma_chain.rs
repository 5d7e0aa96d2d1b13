//! A matrix product whose every element is one chain of fused multiply-adds in the order
//! of the reduction: `c[i][j] = fma(a[q][i], b[q][j], c[i][j])` for `q = 0, 1, ..` and no
//! other arithmetic. The result therefore depends neither on the SIMD level (every lane of
//! a vector holds its own element's chain; the scalar level calls `f32::mul_add`, the same
//! correctly rounded operation), nor on how the product is cut into tiles, panels, blocks of
//! the reduction or threads: an element carried in memory between two blocks of `q` is
//! stored and reloaded exactly.
//!
//! The convolution's weight gradient runs on it (`dW = dY * col^T` with the reduction over
//! every sample's output positions `q`): both operands are contiguous along the reduction,
//! so they are packed into panels, `q`-major: [`MR`] rows of the left operand (`dY`'s
//! output channels, broadcast) or [`NR`] columns of the right one (`col`'s rows, two
//! AVX-512 vectors) per panel. The result is row-major with its rows and columns padded
//! to whole tiles, so the kernels have no edge cases: the lanes past a matrix's edge may
//! hold anything, and only reach elements of the result that are thrown away.
//!
//! Measured with `cargo bench -p trainops-kernels --bench conv_weight_grad`.

use crate::simd::Isa;

/// Rows of a tile (columns of the left operand per panel): the broadcast operand.
pub(crate) const MR: usize = 8;
/// Columns of a tile (of the right operand per panel): two AVX-512 vectors.
pub(crate) const NR: usize = 32;

/// Most elements of the left operand's block streamed past each right panel (4 MiB: the
/// L2 cache holds 2; measured on resnet18's input gradients, layer3's 2.3 MiB blocks ran
/// 131 GFLOP/s streamed and 122 with the left panels outermost).
const STREAM_A_MAX: usize = 1 << 20;

/// Packs `rows` (each `kc` long, at most `width` of them) into one panel: `dst[q * width +
/// i] = rows[i][q]`; the lanes past `rows.len()` are left as they are (they only reach
/// elements of the result that are thrown away).
pub(crate) fn pack_panel(rows: &[&[f32]], width: usize, kc: usize, dst: &mut [f32]) {
    assert!(rows.len() <= width && dst.len() >= kc * width, "fma_chain: one panel");
    let dst = &mut dst[..kc * width];
    // Four rows at a time: each pass writes runs of four lanes of the panel's rows.
    let mut quads = rows.chunks_exact(4);
    let mut i = 0;
    for quad in &mut quads {
        let (r0, r1, r2, r3) = (&quad[0][..kc], &quad[1][..kc], &quad[2][..kc], &quad[3][..kc]);
        for (q, lanes) in dst.chunks_exact_mut(width).enumerate() {
            lanes[i..i + 4].copy_from_slice(&[r0[q], r1[q], r2[q], r3[q]]);
        }
        i += 4;
    }
    for row in quads.remainder() {
        for (lanes, &v) in dst.chunks_exact_mut(width).zip(&row[..kc]) {
            lanes[i] = v;
        }
        i += 1;
    }
}

/// The left operand of [`product`]: `mt` panels of [`MR`] rows, step `q` of panel `m` at
/// `data[m * stride + offset + q * step..][..MR]`: `step` is `MR` for packed panels (a
/// block of the reduction inside longer panels at `offset`), or a matrix's row length
/// where its rows already hold `MR` consecutive elements of each step (no packing).
#[derive(Clone, Copy)]
pub(crate) struct Panels<'a> {
    pub data: &'a [f32],
    pub mt: usize,
    pub stride: usize,
    pub offset: usize,
    pub step: usize,
}

impl Panels<'_> {
    /// Panel `m`, from its first step's first element to its last step's last.
    #[inline(always)]
    fn panel(&self, m: usize, kc: usize) -> &[f32] {
        &self.data[m * self.stride + self.offset..][..(kc - 1) * self.step + MR]
    }
}

/// The result of [`product`]: `a.mt * MR` rows of `ld` elements, row-major; tile `(m, r)`
/// is rows `m * MR..`, columns `r * NR..`. `first`: the chains start here (the tiles are
/// not read, as if they held zeros), else they go on from what the tiles hold.
pub(crate) struct Out<'a> {
    pub data: &'a mut [f32],
    pub ld: usize,
    pub first: bool,
}

/// `c (+)= a * b` over `kc` steps of the reduction: `b` holds `rt` panels of [`NR`] columns
/// (from [`pack_panel`]), contiguous; `c` covers `rt * NR` columns.
pub(crate) fn product(isa: Isa, kc: usize, a: Panels<'_>, b: &[f32], c: Out<'_>) {
    let rt = b.len() / (kc * NR).max(1);
    assert_eq!(b.len(), rt * kc * NR, "fma_chain: panels of whole steps");
    assert!(rt * NR <= c.ld && a.mt * MR * c.ld <= c.data.len(), "fma_chain: the result's tiles");
    if kc == 0 || a.mt == 0 || rt == 0 {
        return;
    }
    assert!(a.step >= MR, "fma_chain: the left panels' steps overlap");
    let a_end = (a.mt - 1) * a.stride + a.offset + (kc - 1) * a.step + MR;
    assert!(a_end <= a.data.len(), "fma_chain: the left panels");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(t) => unsafe { product_avx512(t, kc, a, b, c) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2 and FMA.
        Isa::Avx2(t) => unsafe { product_avx2(t, kc, a, b, c) },
        _ => product_scalar(kc, a, b, c),
    }
}

/// Every tile of [`product`]. The right operand's panel outermost: it stays in the L1 cache
/// while the left operand's panels stream past from the L2 cache (8 floats a step, against
/// 32). Where the left operand is read in place (its steps a matrix's rows apart: the
/// input gradient's `W`, 2.3-4.7 MiB a block for 256-512 channels of 3x3 kernels) or its
/// block is larger than [`STREAM_A_MAX`], the left operand's panels go outermost instead,
/// so that it comes from memory once per block, not once per panel of the right one
/// (resnet18's layer4 3x3 stride 2 input gradient: 84 -> 110 GFLOP/s). `tile(ap, bp, c, at)` with the tile's first
/// element at `c[at]`, its rows `c.ld` apart. The order of the tiles changes no result.
#[inline(always)]
fn tiles(
    kc: usize,
    a: Panels<'_>,
    b: &[f32],
    c: &mut Out<'_>,
    mut tile: impl FnMut(&[f32], &[f32], &mut Out<'_>, usize),
) {
    if a.step > MR || a.mt * kc * MR > STREAM_A_MAX {
        for m in 0..a.mt {
            let ap = a.panel(m, kc);
            for (r, bp) in b.chunks_exact(kc * NR).enumerate() {
                tile(ap, bp, c, m * MR * c.ld + r * NR);
            }
        }
    } else {
        for (r, bp) in b.chunks_exact(kc * NR).enumerate() {
            for m in 0..a.mt {
                tile(a.panel(m, kc), bp, c, m * MR * c.ld + r * NR);
            }
        }
    }
}

/// The reference: element by element, `f32::mul_add` in the order of `q`.
fn product_scalar(kc: usize, a: Panels<'_>, b: &[f32], mut c: Out<'_>) {
    let step = a.step;
    tiles(kc, a, b, &mut c, |ap, bp, c, at| {
        for i in 0..MR {
            for j in 0..NR {
                let e = &mut c.data[at + i * c.ld + j];
                let start = if c.first { 0.0 } else { *e };
                *e = (0..kc).fold(start, |acc, q| ap[q * step + i].mul_add(bp[q * NR + j], acc));
            }
        }
    });
}

/// AVX-512: the whole tile in 16 registers, a broadcast of `a` per row and two loads of
/// `b` per step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn product_avx512(_: crate::simd::Avx512, kc: usize, a: Panels<'_>, b: &[f32], mut c: Out<'_>) {
    use core::arch::x86_64::*;
    let step = a.step;
    tiles(kc, a, b, &mut c, |ap, bp, c, at| {
        let (first, ld) = (c.first, c.ld);
        let ct = &mut c.data[at..at + (MR - 1) * ld + NR];
        // SAFETY: `ap` holds (kc - 1) * step + MR elements, `bp` kc * NR (the chunks `tiles` hands
        // over) and `ct` the tile's MR rows of NR, `ld` apart, so every load and store
        // below lies inside them.
        unsafe {
            let (pa, pb, pc) = (ap.as_ptr(), bp.as_ptr(), ct.as_mut_ptr());
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            if !first {
                for (i, row) in acc.iter_mut().enumerate() {
                    row[0] = _mm512_loadu_ps(pc.add(i * ld));
                    row[1] = _mm512_loadu_ps(pc.add(i * ld + 16));
                }
            }
            for q in 0..kc {
                let b0 = _mm512_loadu_ps(pb.add(q * NR));
                let b1 = _mm512_loadu_ps(pb.add(q * NR + 16));
                for (i, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*pa.add(q * step + i));
                    row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(av, b1, row[1]);
                }
            }
            for (i, row) in acc.iter().enumerate() {
                _mm512_storeu_ps(pc.add(i * ld), row[0]);
                _mm512_storeu_ps(pc.add(i * ld + 16), row[1]);
            }
        }
    });
}

/// AVX2 and FMA: the tile in four passes of two rows (8 registers), four loads of `b` per
/// step of a pass.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn product_avx2(_: crate::simd::Avx2, kc: usize, a: Panels<'_>, b: &[f32], mut c: Out<'_>) {
    use core::arch::x86_64::*;
    const ROWS: usize = 2;
    let step = a.step;
    tiles(kc, a, b, &mut c, |ap, bp, c, at| {
        let (first, ld) = (c.first, c.ld);
        let ct = &mut c.data[at..at + (MR - 1) * ld + NR];
        for i0 in (0..MR).step_by(ROWS) {
            // SAFETY: as in `product_avx512`: rows i0 .. i0 + 2 <= MR of the tile, NR
            // columns, kc steps, all inside the slices above.
            unsafe {
                let (pa, pb, pc) = (ap.as_ptr(), bp.as_ptr(), ct.as_mut_ptr());
                let mut acc = [[_mm256_setzero_ps(); 4]; ROWS];
                if !first {
                    for (i, row) in acc.iter_mut().enumerate() {
                        for (v, r) in row.iter_mut().enumerate() {
                            *r = _mm256_loadu_ps(pc.add((i0 + i) * ld + 8 * v));
                        }
                    }
                }
                for q in 0..kc {
                    let bv = [0, 1, 2, 3].map(|v| _mm256_loadu_ps(pb.add(q * NR + 8 * v)));
                    for (i, row) in acc.iter_mut().enumerate() {
                        let av = _mm256_set1_ps(*pa.add(q * step + i0 + i));
                        for (r, bv) in row.iter_mut().zip(bv) {
                            *r = _mm256_fmadd_ps(av, bv, *r);
                        }
                    }
                }
                for (i, row) in acc.iter().enumerate() {
                    for (v, r) in row.iter().enumerate() {
                        _mm256_storeu_ps(pc.add((i0 + i) * ld + 8 * v), *r);
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::available_levels;
    use proptest::prelude::*;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// Packs `a [rows x k]` and `b [cols x k]` (both contiguous along the reduction), `a`
    /// whole and `b` in blocks of `kc`, runs the product at `isa`, returns `c [rows x cols]`.
    /// Stale lanes and rows past the edges hold NaN, which must not reach the kept elements.
    fn run(isa: Isa, a: &[f32], b: &[f32], rows: usize, cols: usize, k: usize, kc: usize) -> Vec<f32> {
        let (mt, rt) = (rows.div_ceil(MR), cols.div_ceil(NR));
        let ld = rt * NR + 3;
        let mut c = vec![f32::NAN; mt * MR * ld];
        let mut ap = vec![f32::NAN; mt * k * MR];
        for (m, panel) in ap.chunks_exact_mut((k * MR).max(1)).enumerate().take(mt) {
            let src: Vec<&[f32]> = (m * MR..rows.min((m + 1) * MR)).map(|i| &a[i * k..(i + 1) * k]).collect();
            pack_panel(&src, MR, k, panel);
        }
        for q0 in (0..k).step_by(kc.max(1)) {
            let n = kc.min(k - q0);
            let mut bp = vec![f32::NAN; rt * n * NR];
            for (t, panel) in bp.chunks_exact_mut((n * NR).max(1)).enumerate().take(rt) {
                let src: Vec<&[f32]> =
                    (t * NR..cols.min((t + 1) * NR)).map(|j| &b[j * k + q0..j * k + q0 + n]).collect();
                pack_panel(&src, NR, n, panel);
            }
            let a = Panels { data: &ap, mt, stride: k * MR, offset: q0 * MR, step: MR };
            product(isa, n, a, &bp, Out { data: &mut c, ld, first: q0 == 0 });
        }
        let mut out = vec![0f32; rows * cols];
        for r in 0..rows {
            for m in 0..cols {
                // k = 0: no step ran, the chains are empty (zero).
                out[r * cols + m] = if k == 0 { 0.0 } else { c[r * ld + m] };
            }
        }
        out
    }

    /// One fused chain per element, in order, whatever the level and the blocking.
    fn chain(a: &[f32], b: &[f32], rows: usize, cols: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; rows * cols];
        for r in 0..rows {
            for m in 0..cols {
                out[r * cols + m] = (0..k).fold(0f32, |acc, q| a[r * k + q].mul_add(b[m * k + q], acc));
            }
        }
        out
    }

    proptest! {
        /// Edge lengths around the tile sizes and blocks of the reduction: every level and
        /// blocking gives the in-order chain bit for bit, and the chain is the float64
        /// product within `k` roundings of the terms' absolute sum.
        #[test]
        fn every_level_and_blocking_is_the_chain(
            rows in 1usize..30, cols in 1usize..70, k in 0usize..40, kc in 1usize..45, seed in 0u32..1000,
        ) {
            let (a, b) = (data(rows * k, seed), data(cols * k, seed ^ 0x5555));
            let want = chain(&a, &b, rows, cols, k);
            for level in available_levels() {
                let got = run(level.isa().unwrap(), &a, &b, rows, cols, k, kc);
                prop_assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{level:?}");
                // The left operand read in place (whole panels of its transpose, a step a
                // row), as the input gradient reads W.
                let full = rows / MR * MR;
                if full > 0 && k > 0 {
                    let at: Vec<f32> = (0..k * full).map(|e| a[(e % full) * k + e / full]).collect();
                    let ld = cols.div_ceil(NR) * NR;
                    let mut c = vec![f32::NAN; full * ld];
                    for q0 in (0..k).step_by(kc) {
                        let n = kc.min(k - q0);
                        let mut bp = vec![f32::NAN; cols.div_ceil(NR) * n * NR];
                        for (t, panel) in bp.chunks_exact_mut(n * NR).enumerate() {
                            let src: Vec<&[f32]> =
                                (t * NR..cols.min((t + 1) * NR)).map(|j| &b[j * k + q0..j * k + q0 + n]).collect();
                            pack_panel(&src, NR, n, panel);
                        }
                        let ap = Panels { data: &at, mt: full / MR, stride: MR, offset: q0 * full, step: full };
                        product(level.isa().unwrap(), n, ap, &bp, Out { data: &mut c, ld, first: q0 == 0 });
                    }
                    for r in 0..full {
                        for m in 0..cols {
                            prop_assert_eq!(c[r * ld + m].to_bits(), want[r * cols + m].to_bits(), "{:?} in place", level);
                        }
                    }
                }
            }
            for r in 0..rows {
                for m in 0..cols {
                    let terms = (0..k).map(|q| f64::from(a[r * k + q]) * f64::from(b[m * k + q]));
                    let (exact, mag) = terms.fold((0f64, 0f64), |(s, t), v| (s + v, t + v.abs()));
                    let err = (f64::from(want[r * cols + m]) - exact).abs();
                    prop_assert!(err <= k as f64 * f64::from(f32::EPSILON) * mag, "{err} > {k} eps {mag}");
                }
            }
        }
    }
}
