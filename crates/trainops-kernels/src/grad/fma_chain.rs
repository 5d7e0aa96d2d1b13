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
//! AVX-512 vectors) per panel; or, in [`product_rows`], the column matrix is the left
//! operand read where it lies in the padded input and dY the right one. The result is
//! row-major with its rows and columns padded to whole tiles, so the kernels have no edge
//! cases: the lanes past a matrix's edge may hold anything, and only reach elements of the
//! result that are thrown away.
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

/// [`pack_panel`] at SIMD level `isa`: a whole panel of [`NR`] rows at the AVX-512 level
/// goes through 16x16 transposes in registers (the byte-wise copy above wrote each step's
/// two lines eight times over and took a fifth of the 7x7 stem's weight gradient, whose dY
/// is 8 MiB); anything else through [`pack_panel`]. The same values either way.
pub(crate) fn pack_panel_at(isa: Isa, rows: &[&[f32]], width: usize, kc: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx512(t), NR, NR) = (isa, width, rows.len()) {
        assert!(rows.iter().all(|r| r.len() >= kc) && dst.len() >= kc * NR, "fma_chain: one panel");
        let whole = kc / 16 * 16;
        // SAFETY: the token proves the CPU has AVX-512F; the rows hold `kc >= whole`
        // elements and `dst` `kc * NR`, checked above.
        unsafe { pack_transposed(t, rows, whole, dst) };
        if whole < kc {
            let tail: [&[f32]; NR] = core::array::from_fn(|i| &rows[i][whole..kc]);
            pack_panel(&tail, width, kc - whole, &mut dst[whole * NR..]);
        }
        return;
    }
    pack_panel(rows, width, kc, dst);
}

/// `dst[q * NR + i] = rows[i][q]` for `q < kc` (a multiple of 16) and all [`NR`] rows, a
/// 16x16 square at a time: pairs, then quads within each 128-bit lane, then a 4x4
/// transpose of the lanes.
///
/// # Safety
///
/// AVX-512F; `rows` are [`NR`] slices of at least `kc` elements and `dst` holds `kc * NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_transposed(_: crate::simd::Avx512, rows: &[&[f32]], kc: usize, dst: &mut [f32]) {
    use core::arch::x86_64::*;
    let out = dst.as_mut_ptr();
    for q0 in (0..kc).step_by(16) {
        for h in 0..2 {
            // SAFETY: rows `16 h .. 16 h + 16` hold elements `q0 .. q0 + 16 <= kc`.
            let r: [__m512; 16] =
                core::array::from_fn(|i| unsafe { _mm512_loadu_ps(rows[16 * h + i].as_ptr().add(q0)) });
            let t: [__m512; 16] = core::array::from_fn(|k| {
                let (a, b) = (r[k & !1], r[k | 1]);
                if k % 2 == 0 {
                    _mm512_unpacklo_ps(a, b)
                } else {
                    _mm512_unpackhi_ps(a, b)
                }
            });
            // u[4 g + i], lane L: column 4 L + i of rows 4 g .. 4 g + 4.
            let u: [__m512; 16] = core::array::from_fn(|k| {
                let (g, i) = (k / 4, k % 4);
                let (x, y) = (t[4 * g + i / 2], t[4 * g + 2 + i / 2]);
                if i % 2 == 0 {
                    _mm512_shuffle_ps::<0x44>(x, y)
                } else {
                    _mm512_shuffle_ps::<0xEE>(x, y)
                }
            });
            for i in 0..4 {
                let (u0, u1, u2, u3) = (u[i], u[4 + i], u[8 + i], u[12 + i]);
                let (v0, v1) = (_mm512_shuffle_f32x4::<0x44>(u0, u1), _mm512_shuffle_f32x4::<0xEE>(u0, u1));
                let (v2, v3) = (_mm512_shuffle_f32x4::<0x44>(u2, u3), _mm512_shuffle_f32x4::<0xEE>(u2, u3));
                let cols = [
                    _mm512_shuffle_f32x4::<0x88>(v0, v2),
                    _mm512_shuffle_f32x4::<0xDD>(v0, v2),
                    _mm512_shuffle_f32x4::<0x88>(v1, v3),
                    _mm512_shuffle_f32x4::<0xDD>(v1, v3),
                ];
                for (l, col) in cols.into_iter().enumerate() {
                    // SAFETY: step q0 + 4 l + i < kc, lanes 16 h .. 16 h + 16 of NR.
                    unsafe { _mm512_storeu_ps(out.add((q0 + 4 * l + i) * NR + 16 * h), col) };
                }
            }
        }
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

/// The left operand of [`product_rows`], read where it lies instead of packed: panel `m`'s
/// row `i` holds, at the steps of piece `(at, len)` of `runs` (the pieces in order),
/// `data[bases[m][i] + at + j * step]`, `j < len`. A convolution's column matrix is such a
/// matrix in its padded input (`Windows::row_offset`, `Windows::column_runs`), so its
/// weight gradient needs no lowered copy.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub data: &'a [f32],
    pub bases: &'a [[usize; MR]],
    pub runs: &'a [(usize, usize)],
    pub step: usize,
}

/// Where [`product_rows`] puts its chains' results when they are final: transposed, one
/// slice per column of the right operand, tile element `(i, j)` (row `i` of the left
/// operand, column `j` of the right) at `cols[j][i]`, rows past the slices' common length
/// dropped. The weight gradient computes `dW^T` and wants `dW`: each slice is a piece of a
/// row of `dW` (or of a task's block), so the tiles go there transposed from registers,
/// where transposing a block afterwards took a third of layer4's time (its reduction is
/// 128 steps, so dW-sized work weighs).
pub(crate) struct Transposed<'a, 'b> {
    pub cols: &'a mut [&'b mut [f32]],
}

/// [`product`] with the left operand read in place ([`Rows`]): `c (+)= a * b` over the
/// `kc` steps of `a.runs`, `b` [`NR`]-column panels as for [`product`], `c` (`a.bases.len() *
/// MR` rows of `c.ld`) covering `rt * NR` columns from `c.data`'s start. With `to`, the
/// results go there instead of into `c` (which is still read where `!c.first`). Every
/// element is the same chain as [`product`]'s, so the same bits; at the scalar and AVX2
/// levels it runs the scalar loop (callers choose this form for AVX-512 only).
pub(crate) fn product_rows(isa: Isa, a: Rows<'_>, b: &[f32], c: Out<'_>, to: Option<Transposed<'_, '_>>) {
    let kc: usize = a.runs.iter().map(|&(_, len)| len).sum();
    let rt = b.len() / (kc * NR).max(1);
    assert_eq!(b.len(), rt * kc * NR, "fma_chain: panels of whole steps");
    if kc == 0 || a.bases.is_empty() || rt == 0 {
        return;
    }
    let rows = a.bases.len() * MR;
    // `c` is read unless `first`, written unless `to`: otherwise it may be empty.
    if !c.first || to.is_none() {
        assert!(rt * NR <= c.ld && (rows - 1) * c.ld + rt * NR <= c.data.len(), "fma_chain: the result");
    }
    if let Some(t) = &to {
        let len = t.cols.first().map_or(0, |c| c.len());
        let same = t.cols.iter().all(|c| c.len() == len);
        assert!(t.cols.len() >= rt * NR && same && len <= rows, "fma_chain: the transposed result");
    }
    // Every element read lies in `a.data`: the largest base plus each piece's last place.
    let top = a.bases.iter().flatten().copied().max().unwrap_or(0);
    for &(at, len) in a.runs {
        let last = len.checked_sub(1).map(|l| l.checked_mul(a.step).and_then(|s| s.checked_add(top + at)));
        assert!(last.is_none_or(|e| e.is_some_and(|e| e < a.data.len())), "fma_chain: a piece past the left operand");
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F; every read and write was checked
        // above.
        Isa::Avx512(t) => unsafe { product_rows_avx512(t, kc, a, b, c, to) },
        _ => product_rows_scalar(kc, a, b, c, to),
    }
}

/// The tiles of [`product_rows`], right panel outermost (it stays in the L1 cache while
/// the left operand's rows are read from the L2 cache); the reference loop.
fn product_rows_scalar(kc: usize, a: Rows<'_>, b: &[f32], c: Out<'_>, mut to: Option<Transposed<'_, '_>>) {
    for (r, bp) in b.chunks_exact(kc * NR).enumerate() {
        for (m, base) in a.bases.iter().enumerate() {
            for (i, &row) in base.iter().enumerate() {
                for j in 0..NR {
                    let e = (m * MR + i) * c.ld + r * NR + j;
                    let start = if c.first { 0.0 } else { c.data[e] };
                    let places = a.runs.iter().flat_map(|&(at, len)| (0..len).map(move |t| at + t * a.step));
                    let v =
                        places.enumerate().fold(start, |acc, (q, at)| a.data[row + at].mul_add(bp[q * NR + j], acc));
                    match &mut to {
                        Some(t) => {
                            if let Some(d) = t.cols[r * NR + j].get_mut(m * MR + i) {
                                *d = v;
                            }
                        }
                        None => c.data[e] = v,
                    }
                }
            }
        }
    }
}

/// AVX-512: as [`product_avx512`], the broadcasts read from the rows' places.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn product_rows_avx512(
    _: crate::simd::Avx512,
    kc: usize,
    a: Rows<'_>,
    b: &[f32],
    c: Out<'_>,
    to: Option<Transposed<'_, '_>>,
) {
    use core::arch::x86_64::*;
    let (first, ld) = (c.first, c.ld);
    // The transposed result's columns, and how many rows they hold.
    let (outs, kept): (Vec<*mut f32>, usize) = match to {
        Some(t) => (t.cols.iter_mut().map(|c| c.as_mut_ptr()).collect(), t.cols.first().map_or(0, |c| c.len())),
        None => (Vec::new(), 0),
    };
    for (r, bp) in b.chunks_exact(kc * NR).enumerate() {
        for (m, base) in a.bases.iter().enumerate() {
            // SAFETY: `product_rows` checked that every `base[i] + at + t * step` (`t <
            // len`, every piece `(at, len)`) lies in `a.data`,
            // that the tile's MR rows of NR, `ld` apart from `m * MR * ld + r * NR`, lie in
            // `c.data`, and with `to` that it has NR columns for every tile, all `kept` long:
            // `store_transposed` writes rows `m * MR ..` of them below `kept`; `bp` holds kc
            // * NR elements.
            unsafe {
                let pd = a.data.as_ptr();
                let rows: [*const f32; MR] = base.map(|o| pd.add(o));
                // `pc` is only dereferenced where `c` was checked (read unless `first`,
                // written unless `to`); `wrapping_add` keeps its computation defined
                // where `c` is empty.
                let (pb, pc) = (bp.as_ptr(), c.data.as_mut_ptr().wrapping_add(m * MR * ld + r * NR));
                let mut acc = [[_mm512_setzero_ps(); 2]; MR];
                if !first {
                    for (i, row) in acc.iter_mut().enumerate() {
                        row[0] = _mm512_loadu_ps(pc.add(i * ld));
                        row[1] = _mm512_loadu_ps(pc.add(i * ld + 16));
                    }
                }
                let mut pb = pb;
                for &(at, len) in a.runs {
                    for t in 0..len {
                        let e = at + t * a.step;
                        let b0 = _mm512_loadu_ps(pb);
                        let b1 = _mm512_loadu_ps(pb.add(16));
                        for (row, &p) in acc.iter_mut().zip(&rows) {
                            let av = _mm512_set1_ps(*p.add(e));
                            row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                            row[1] = _mm512_fmadd_ps(av, b1, row[1]);
                        }
                        pb = pb.add(NR);
                    }
                }
                if outs.is_empty() {
                    for (i, row) in acc.iter().enumerate() {
                        _mm512_storeu_ps(pc.add(i * ld), row[0]);
                        _mm512_storeu_ps(pc.add(i * ld + 16), row[1]);
                    }
                } else {
                    let valid = kept.saturating_sub(m * MR).min(MR);
                    for h in 0..2 {
                        let cols: [*mut f32; 16] =
                            core::array::from_fn(|j| outs[r * NR + 16 * h + j].wrapping_add(m * MR));
                        store_transposed(acc.map(|row| row[h]), cols, valid);
                    }
                }
            }
        }
    }
}

/// Stores 8 rows of 16 as 16 columns of `valid <= 8`: `cols[j][i] = rows[i][j]` for `i <
/// valid` (rows past `valid` are dropped). Per 128-bit lane `L`, unpacks and shuffles
/// gather column `4L + c`'s rows 0-3 in `u[c]` and rows 4-7 in `v[c]`; a lane shuffle then
/// puts columns `c` and `4 + c` (and `8 + c`, `12 + c`) whole in the halves of one register
/// each.
///
/// # Safety
///
/// AVX-512F; `cols[j][..valid]` writable for every `j < 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_transposed(rows: [core::arch::x86_64::__m512; MR], cols: [*mut f32; 16], valid: usize) {
    use core::arch::x86_64::*;
    let [r0, r1, r2, r3, r4, r5, r6, r7] = rows;
    let quads = |a: __m512, b: __m512, c: __m512, d: __m512| {
        let (t0, t1) = (_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let (t2, t3) = (_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        [
            _mm512_shuffle_ps::<0x44>(t0, t2),
            _mm512_shuffle_ps::<0xEE>(t0, t2),
            _mm512_shuffle_ps::<0x44>(t1, t3),
            _mm512_shuffle_ps::<0xEE>(t1, t3),
        ]
    };
    let (u, v) = (quads(r0, r1, r2, r3), quads(r4, r5, r6, r7));
    let half = |x: __m512, hi: bool| {
        let x = _mm512_castps_pd(x);
        _mm256_castpd_ps(if hi { _mm512_extractf64x4_pd::<1>(x) } else { _mm512_castpd512_pd256(x) })
    };
    for c in 0..4 {
        // [u.L0, u.L1, v.L0, v.L1] then [u.L0, v.L0, u.L1, v.L1]: columns c and 4 + c.
        let lo = _mm512_shuffle_f32x4::<0x44>(u[c], v[c]);
        let lo = _mm512_shuffle_f32x4::<0xD8>(lo, lo);
        // [u.L2, u.L3, v.L2, v.L3] then [u.L2, v.L2, u.L3, v.L3]: columns 8 + c and 12 + c.
        let hi = _mm512_shuffle_f32x4::<0xEE>(u[c], v[c]);
        let hi = _mm512_shuffle_f32x4::<0xD8>(hi, hi);
        for (j, x) in
            [(c, half(lo, false)), (4 + c, half(lo, true)), (8 + c, half(hi, false)), (12 + c, half(hi, true))]
        {
            // SAFETY: `cols[j][..valid]` is writable (the caller); a partial column goes
            // through a local copy.
            unsafe {
                if valid == MR {
                    _mm256_storeu_ps(cols[j], x);
                } else {
                    let mut tmp = [0f32; MR];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), x);
                    core::ptr::copy_nonoverlapping(tmp.as_ptr(), cols[j], valid);
                }
            }
        }
    }
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

    /// The transposing pack gives the plain pack's panel on edge lengths, and leaves the
    /// elements past the panel alone.
    #[test]
    fn packing_is_the_same_at_every_level() {
        for kc in [0, 1, 15, 16, 17, 31, 32, 33, 100, 257] {
            let src: Vec<Vec<f32>> = (0..NR).map(|i| data(kc + 3, i as u32 * 31 + kc as u32)).collect();
            let rows: Vec<&[f32]> = src.iter().map(|r| &r[..kc + 3]).collect();
            let mut want = vec![f32::NAN; kc * NR + 5];
            pack_panel(&rows, NR, kc, &mut want);
            for level in available_levels() {
                let mut got = vec![f32::NAN; kc * NR + 5];
                pack_panel_at(level.isa().unwrap(), &rows, NR, kc, &mut got);
                assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{level:?}, kc {kc}");
            }
        }
    }

    proptest! {
        /// The left operand read in place, in pieces of up to `len` steps `step` apart, over
        /// two blocks of the reduction: every level gives the in-order chain bit for bit,
        /// transposed into columns that keep all rows or fewer (and nothing past them).
        #[test]
        fn rows_read_in_place_are_the_chain(
            panels in 1usize..4, cols in 1usize..3, k in 1usize..40, len in 1usize..9, step in 1usize..4,
            split in 0usize..40, dropped in 0usize..8, seed in 0u32..1000,
        ) {
            let rows = panels * MR;
            let buf = data(rows * 7 + k * 4 * step + 11, seed);
            // Row i starts at 7 i; step q of the reduction at piece q / len, element q % len.
            let place = |q: usize| (q / len) * (len * step + 3) + (q % len) * step;
            let a: Vec<f32> = (0..rows * k).map(|e| buf[7 * (e / k) + place(e % k)]).collect();
            let b = data(cols * NR * k, seed ^ 0x3333);
            let want = chain(&a, &b, rows, cols * NR, k);
            let bases: Vec<[usize; MR]> = (0..panels).map(|m| core::array::from_fn(|i| 7 * (m * MR + i))).collect();
            let split = split.min(k - 1);
            for level in available_levels() {
                let isa = level.isa().unwrap();
                let ld = cols * NR + 1;
                // The transposed result: `rows - dropped` of each column kept.
                let kept = rows - dropped;
                let (mut c, mut t) = (vec![f32::NAN; rows * ld], vec![f32::NAN; cols * NR * (rows + 2)]);
                for (q0, q1, last) in [(0, split, false), (split, k, true)] {
                    let runs: Vec<(usize, usize)> = (q0..q1)
                        .filter(|&q| q == q0 || q % len == 0)
                        .map(|q| (place(q), (len - q % len).min(q1 - q)))
                        .collect();
                    let mut bp = vec![f32::NAN; cols * (q1 - q0) * NR];
                    for (r, panel) in bp.chunks_exact_mut(((q1 - q0) * NR).max(1)).enumerate().take(cols) {
                        let src: Vec<&[f32]> = (r * NR..(r + 1) * NR).map(|j| &b[j * k + q0..j * k + q1]).collect();
                        pack_panel(&src, NR, q1 - q0, panel);
                    }
                    let rows_a = Rows { data: &buf, bases: &bases, runs: &runs, step };
                    let mut pieces: Vec<&mut [f32]> = t.chunks_exact_mut(rows + 2).map(|r| &mut r[..kept]).collect();
                    let to = last.then(|| Transposed { cols: &mut pieces });
                    product_rows(isa, rows_a, &bp, Out { data: &mut c, ld, first: q0 == 0 }, to);
                }
                for j in 0..cols * NR {
                    for i in 0..rows {
                        let got = t[j * (rows + 2) + i];
                        if i < kept {
                            prop_assert_eq!(got.to_bits(), want[i * cols * NR + j].to_bits(), "{:?}", level);
                        } else {
                            prop_assert!(got.is_nan(), "{:?}: row {} past the kept ones written", level, i);
                        }
                    }
                }
            }
        }
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
