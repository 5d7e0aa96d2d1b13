//! The lowering of a convolution's windows to a matrix ("im2col") and its adjoint
//! ("col2im"), N-dimensional.
//!
//! For one sample and a block of channels, row `r = c * kernel_len + kk` of the column
//! matrix holds, at column `p` (the flattened output position `o`), the input element
//! `x[c, o * strides + k(kk) * dilations - pads_begin]`, or 0 where that lies in the padding.
//!
//! im2col reads a padded copy of the sample's channels ([`Windows::pad_into`]), so every run
//! of the matrix is a plain (strided) copy with no test for the padding; col2im adds back
//! along the runs (or, for small grids, a gather table), skipping the padding. Where the
//! padded grid would be much larger than the input (pads, strides or dilations far beyond
//! the input's size), im2col reads the input itself along the runs instead: the padded copy
//! is never sized by the attributes alone.

use crate::shape;
use crate::simd::Isa;
use crate::KernelError;

/// The windows of one convolution over one input grid (all lists per spatial dimension),
/// with the runs of every kernel position worked out once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Windows {
    input: Vec<usize>,
    output: Vec<usize>,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    pads_begin: Vec<usize>,
    /// `outer` runs per kernel position (see [`Windows::runs`]), kernel position 0 first.
    table: Vec<Run>,
    /// For a small output grid (at most [`GATHER_MAX`] positions, rows of at most
    /// [`GATHER_ROW_MAX`]): per kernel position and output position, the input element
    /// read ([`PADDING`] in the padding), kernel position 0 first; empty otherwise.
    gather: Vec<u32>,
    /// Whether im2col goes through a padded copy of the input (see [`PADDED_MAX`]); the
    /// three fields below are empty when it does not.
    padded_copy: bool,
    /// The input grid with its padding made real (see [`Windows::pad_into`]): its sizes.
    padded: Vec<usize>,
    /// Per kernel position and outer output position (all dimensions but the last), the
    /// padded grid's element where that run of the column matrix starts, kernel position 0
    /// first: run element `j` reads `start + j * strides[last]`.
    starts: Vec<usize>,
    /// Per input row (all dimensions but the last, row-major), the padded grid's element
    /// where [`Windows::pad_into`] puts it.
    pad_rows: Vec<usize>,
}

/// One run of the innermost output dimension: columns `p0 .. p0 + output[last]`; those in
/// `lo..hi` read input element `src0 + o * strides[last]`, the others lie in the padding
/// (all of them when `src0` is `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    p0: usize,
    src0: Option<isize>,
    lo: usize,
    hi: usize,
}

/// Output grids up to this many positions, with rows up to [`GATHER_ROW_MAX`] long, go
/// through [`Windows`]' gather table in col2im: their runs are a few elements long, and
/// the per-run bookkeeping cost more than the additions.
const GATHER_MAX: usize = 256;
/// Measured when im2col still used the table (the BN CNN's training step, batch 256, one
/// thread): on a 4x4 grid 660 -> 478 us through it, on an 8x8 grid 156 -> 190 us.
const GATHER_ROW_MAX: usize = 4;
/// A gather table entry in the padding.
const PADDING: u32 = u32::MAX;
/// im2col copies the input into a padded grid when that grid has at most this many times
/// the input's elements plus [`PADDED_SLACK`] (every ordinary convolution: a 4x4 grid padded
/// by 1 has 36 for 16); beyond, it reads the input along the runs, so that pads, strides or
/// dilations far beyond the input never size a buffer.
const PADDED_MAX: usize = 4;
/// See [`PADDED_MAX`]: small grids (1x1 padded by 3) keep the padded copy.
const PADDED_SLACK: usize = 4096;

impl Windows {
    /// The windows of a kernel `kernel` with `strides`, `dilations` and `pads_begin` from grid
    /// `input` to grid `output` (each list of one length, at least 1, the caller's shapes
    /// consistent and their arithmetic checked: `ConvDims::windows` builds it). The tables are
    /// allocated fallibly.
    pub fn new(
        input: &[usize],
        output: &[usize],
        kernel: &[usize],
        strides: &[usize],
        dilations: &[usize],
        pads_begin: &[usize],
    ) -> Result<Self, KernelError> {
        let mut w = Self {
            input: input.to_vec(),
            output: output.to_vec(),
            kernel: kernel.to_vec(),
            strides: strides.to_vec(),
            dilations: dilations.to_vec(),
            pads_begin: pads_begin.to_vec(),
            table: Vec::new(),
            gather: Vec::new(),
            padded_copy: false,
            padded: Vec::new(),
            starts: Vec::new(),
            pad_rows: Vec::new(),
        };
        let (kl, p, il) = (w.kernel_len(), w.output_len(), w.input_len());
        let out_l = w.output.last().copied().unwrap_or(1).max(1);
        let runs = shape::mul("the windows' runs", kl, p / out_l)?;
        // The padded grid: wide enough for every window (padding past the input's end
        // included), and for the input itself.
        let padded: Option<Vec<usize>> = (0..w.input.len())
            .map(|a| {
                let reach = w.output[a]
                    .saturating_sub(1)
                    .checked_mul(w.strides[a])?
                    .checked_add((w.kernel[a] - 1).checked_mul(w.dilations[a])?)?
                    .checked_add(1)?;
                Some(w.pads_begin[a].checked_add(w.input[a])?.max(reach))
            })
            .collect();
        let padded_len = padded.as_deref().and_then(shape::numel);
        let bound = il.saturating_mul(PADDED_MAX).saturating_add(PADDED_SLACK);
        if let (Some(padded), Some(len)) = (padded, padded_len) {
            if len <= bound {
                w.padded_copy = true;
                w.padded = padded;
                shape::reserve(&mut w.starts, runs, "the windows' run starts")?;
                for kk in 0..kl {
                    w.padded_starts(kk);
                }
                w.pad_rows = w.padded_rows();
            }
        }
        shape::reserve(&mut w.table, runs, "the windows' runs")?;
        let mut table = core::mem::take(&mut w.table);
        for kk in 0..kl {
            w.runs(kk, |p0, src0, lo, hi| table.push(Run { p0, src0, lo, hi }));
        }
        w.table = table;
        let row = w.output.last().copied().unwrap_or(0);
        let small = p <= GATHER_MAX && row <= GATHER_ROW_MAX && il < PADDING as usize;
        if small {
            let entries = shape::mul("the windows' gather table", kl, p)?;
            shape::reserve(&mut w.gather, entries, "the windows' gather table")?;
            let (out_l, s) = (w.output[w.output.len() - 1], w.strides[w.strides.len() - 1]);
            for run in &w.table {
                w.gather.extend((0..out_l).map(|j| match run.src0 {
                    Some(src0) if (run.lo..run.hi).contains(&j) => (src0 + (j * s) as isize) as u32,
                    _ => PADDING,
                }));
            }
        }
        Ok(w)
    }

    /// Input spatial shape.
    pub fn input(&self) -> &[usize] {
        &self.input
    }

    /// Output spatial shape.
    pub fn output(&self) -> &[usize] {
        &self.output
    }

    /// Kernel spatial shape.
    pub fn kernel(&self) -> &[usize] {
        &self.kernel
    }

    /// Strides.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Dilations.
    pub fn dilations(&self) -> &[usize] {
        &self.dilations
    }

    /// Padding at the beginning of each dimension.
    pub fn pads_begin(&self) -> &[usize] {
        &self.pads_begin
    }

    /// Whether [`Windows::col2im_add`] goes through the gather table (a small output grid)
    /// rather than the runs.
    #[cfg(test)]
    pub(crate) fn gathers(&self) -> bool {
        !self.gather.is_empty()
    }

    /// The runs of kernel position `kk`, from the table.
    fn table_runs(&self, kk: usize) -> &[Run] {
        let outer = self.table.len() / self.kernel_len().max(1);
        &self.table[kk * outer..(kk + 1) * outer]
    }

    /// Elements of one channel of the input grid.
    pub fn input_len(&self) -> usize {
        self.input.iter().product()
    }

    /// Output positions (columns of the column matrix).
    pub fn output_len(&self) -> usize {
        self.output.iter().product()
    }

    /// Kernel positions per channel.
    pub fn kernel_len(&self) -> usize {
        self.kernel.iter().product()
    }

    /// Calls `f(p0, src0, lo, hi)` for every run of the innermost output dimension of kernel
    /// position `kk`: the run's columns are `p0 .. p0 + output[last]`; those in `lo..hi` read
    /// input element `src0 + o * strides[last]` (`o` the innermost output index, the sum never
    /// negative there), the others lie in the padding. `src0` is `None` when the whole run
    /// lies in the padding of an outer dimension.
    fn runs(&self, kk: usize, mut f: impl FnMut(usize, Option<isize>, usize, usize)) {
        let d = self.input.len();
        let last = d - 1;
        let k = coords(kk, &self.kernel);
        // In i128: pads, strides and dilations up to 2^63 - 1 cannot overflow it, and
        // `ConvDims` has checked that every position a window reaches fits in i64.
        let off = |j: usize| (k[j] as i128) * (self.dilations[j] as i128) - self.pads_begin[j] as i128;
        // Innermost dimension: o * s + off in [0, in) <=> lo <= o < hi.
        let (s, off_l, in_l, out_l) =
            (self.strides[last] as i128, off(last), self.input[last] as i128, self.output[last]);
        let ceil_div = |a: i128, b: i128| (a + b - 1) / b;
        let lo = if off_l >= 0 { 0 } else { ceil_div(-off_l, s) };
        let hi = if in_l - off_l <= 0 { 0 } else { ceil_div(in_l - off_l, s) };
        let clamp = |v: i128| usize::try_from(v.min(out_l as i128)).unwrap_or(0);
        let (lo, hi) = (clamp(lo), clamp(hi));
        let (lo, hi) = if lo < hi { (lo, hi) } else { (0, 0) };
        // Input strides of the outer dimensions.
        let mut in_stride = vec![1usize; d];
        for j in (0..last).rev() {
            in_stride[j] = in_stride[j + 1] * self.input[j + 1];
        }
        let mut run = 0;
        for_each_coord(&self.output[..last], |o| {
            let mut src = off_l;
            let mut inside = true;
            for j in 0..last {
                let i = (o[j] as i128) * (self.strides[j] as i128) + off(j);
                inside &= i >= 0 && i < self.input[j] as i128;
                if !inside {
                    break;
                }
                src += i * in_stride[j] as i128;
            }
            f(run * out_l, if inside { isize::try_from(src).ok() } else { None }, lo, hi);
            run += 1;
        });
    }

    /// Elements of one channel of the padded input grid ([`Windows::pad_into`]).
    pub fn padded_len(&self) -> usize {
        self.padded.iter().product()
    }

    /// Row-major strides of the padded grid.
    fn padded_strides(&self) -> Vec<usize> {
        let d = self.padded.len();
        let mut st = vec![1usize; d];
        for j in (0..d.saturating_sub(1)).rev() {
            st[j] = st[j + 1] * self.padded[j + 1];
        }
        st
    }

    /// Appends to `starts` the padded grid's start of every run of kernel position `kk`
    /// (outer output positions in row-major order): `sum_a (o_a * strides_a + k_a *
    /// dilations_a) * pstride_a`, the last dimension's `o` being 0. Never negative: the
    /// padded grid starts `pads_begin` before the input. Only for the padded copy, whose
    /// grid is small (every position in it fits).
    fn padded_starts(&mut self, kk: usize) {
        let d = self.input.len();
        let last = d - 1;
        let st = self.padded_strides();
        let k = coords(kk, &self.kernel);
        let k_off: usize = (0..d).map(|j| k[j] * self.dilations[j] * st[j]).sum();
        let mut starts = core::mem::take(&mut self.starts);
        for_each_coord(&self.output[..last], |o| {
            starts.push(k_off + (0..last).map(|j| o[j] * self.strides[j] * st[j]).sum::<usize>());
        });
        self.starts = starts;
    }

    /// Appends channels `x` (`channels x input_len()` elements) to `xp` as im2col reads
    /// them: as padded grids (`channels x padded_len()`: zeros around, the input
    /// `pads_begin` in), so that the column matrix reads every element with no test for the
    /// padding; or, where the padded grid would be too large, as they are. The memory is
    /// reserved fallibly.
    pub fn pad_into(&self, x: &[f32], xp: &mut Vec<f32>) -> Result<(), KernelError> {
        if !self.padded_copy {
            shape::reserve(xp, x.len(), "the input's channels")?;
            xp.extend_from_slice(x);
            return Ok(());
        }
        let (il, pl) = (self.input_len(), self.padded_len());
        let channels = x.len().checked_div(il).unwrap_or(0);
        let at0 = xp.len();
        shape::resize(xp, at0 + channels * pl, "the padded input")?;
        if il == 0 {
            return Ok(());
        }
        let row = self.input[self.input.len() - 1];
        for (xc, xpc) in x.chunks_exact(il).zip(xp[at0..].chunks_exact_mut(pl)) {
            for (src, &at) in xc.chunks_exact(row).zip(&self.pad_rows) {
                copy_short(&mut xpc[at..at + row], src);
            }
        }
        Ok(())
    }

    /// The padded grid's element where each input row starts (the `pad_rows` table).
    fn padded_rows(&self) -> Vec<usize> {
        let d = self.input.len();
        let last = d - 1;
        let st = self.padded_strides();
        let mut starts = Vec::new();
        for_each_coord(&self.input[..last], |i| {
            let inner: usize = (0..last).map(|j| (i[j] + self.pads_begin[j]) * st[j]).sum();
            starts.push(inner + self.pads_begin[last]);
        });
        starts
    }

    /// Writes rows `rows` of the column matrices of `samples` samples side by side into
    /// `col`: `xp` holds each sample's channels as [`Windows::pad_into`] made them (sample 0
    /// first, each from channel `c0` on: row `r = c * kernel_len() + kk` reads channel `c -
    /// c0`); row `rows.start + i` of sample `n` goes to `col[i * ld + n *
    /// output_len()..][..output_len()]`. From the padded copy every run is a plain (strided)
    /// copy; without it, the runs are read from the input with zeros in the padding. Row by
    /// row, every sample in turn: a row's bookkeeping is paid once, not once per sample.
    pub fn im2col(
        &self,
        xp: &[f32],
        samples: usize,
        c0: usize,
        rows: core::ops::Range<usize>,
        col: &mut [f32],
        ld: usize,
    ) {
        let (kl, p) = (self.kernel_len(), self.output_len());
        let out_l = self.output[self.output.len() - 1];
        let s = self.strides[self.strides.len() - 1];
        if p == 0 || samples == 0 {
            return;
        }
        // The elements of one channel in `xp`.
        let grid = if self.padded_copy { self.padded_len() } else { self.input_len() };
        let outer = p / out_l;
        let per_sample = xp.len() / samples;
        for (i, r) in rows.enumerate() {
            let (c, kk) = (r / kl - c0, r % kl);
            let dst_row = &mut col[i * ld..i * ld + samples * p];
            if grid == 0 {
                dst_row.fill(0.0);
                continue;
            }
            let per_sample_row =
                dst_row.chunks_exact_mut(p).zip(xp.chunks_exact(per_sample).map(|xs| &xs[c * grid..(c + 1) * grid]));
            if self.padded_copy {
                let starts = &self.starts[kk * outer..(kk + 1) * outer];
                for (dst, xpc) in per_sample_row {
                    for (run, &at) in dst.chunks_exact_mut(out_l).zip(starts) {
                        if s == 1 {
                            copy_short(run, &xpc[at..at + out_l]);
                        } else {
                            for (v, &e) in run.iter_mut().zip(xpc[at..].iter().step_by(s)) {
                                *v = e;
                            }
                        }
                    }
                }
                continue;
            }
            for (dst, xc) in per_sample_row {
                for &Run { p0, src0, lo, hi } in self.table_runs(kk) {
                    let run = &mut dst[p0..p0 + out_l];
                    match src0 {
                        Some(src0) if hi > lo => {
                            run[..lo].fill(0.0);
                            run[hi..].fill(0.0);
                            let first = (src0 + (lo * s) as isize) as usize;
                            for (v, &e) in run[lo..hi].iter_mut().zip(xc[first..].iter().step_by(s)) {
                                *v = e;
                            }
                        }
                        _ => run.fill(0.0),
                    }
                }
            }
        }
    }

    /// Columns `q0 .. q0 + kc` of rows `rows` of the column matrices of samples side by
    /// side (as [`Windows::im2col`] lays them out: column `n * output_len() + p`), given as
    /// the pieces [`Windows::column_runs`] made of them, straight into panels of `width`
    /// rows, `q`-major: row `rows.start + i`, column `q0 + q` goes to
    /// `dst[(i / width) * kc * width + q * width + i % width]`; the lanes past the last row
    /// are left as they are. `xp` as for [`Windows::im2col`]; only from the padded copy (the
    /// caller checks [`Windows::pads_a_copy`]), where every piece is a strided read with no
    /// test for the padding.
    pub(crate) fn im2col_panels(
        &self,
        isa: Isa,
        xp: &[f32],
        (c0, rows): (usize, core::ops::Range<usize>),
        runs: &[(usize, usize)],
        width: usize,
        dst: &mut [f32],
    ) {
        assert!(self.padded_copy, "im2col_panels reads the padded copy");
        let s = self.last_stride();
        let kc: usize = runs.iter().map(|&(_, len)| len).sum();
        if kc == 0 {
            return;
        }
        let nb = rows.len();
        for (t, panel) in dst.chunks_exact_mut(kc * width).take(nb.div_ceil(width)).enumerate() {
            let first = rows.start + t * width;
            let offsets = (first..rows.end.min(first + width)).map(|r| self.row_offset(r, c0));
            #[cfg(target_arch = "x86_64")]
            if let (Isa::Avx512(token), GATHER_LANES) = (isa, width) {
                if xp.len() <= i32::MAX as usize {
                    let mut base = [0i32; GATHER_LANES];
                    let mut lanes = 0;
                    for (b, off) in base.iter_mut().zip(offsets) {
                        *b = off as i32;
                        lanes += 1;
                    }
                    // Lanes past the last row read the first row's elements.
                    let b0 = base[0];
                    base[lanes..].fill(b0);
                    let top = base[..lanes].iter().copied().max().unwrap_or(0) as usize;
                    let mut q = 0;
                    for &(at, len) in runs {
                        // Every element the piece reads lies in `xp` (which fits i32).
                        assert!(top + at + (len - 1) * s < xp.len(), "im2col_panels: a run past the input");
                        let at = base.map(|b| b + at as i32);
                        // The step wraps only where the piece has one element (else the
                        // assertion above bounds it by the input's length).
                        let step = s as i32;
                        // SAFETY: the token proves the CPU has AVX-512F.
                        unsafe { gather_runs(token, xp, &at, step, &mut panel[q * width..(q + len) * width]) };
                        q += len;
                    }
                    continue;
                }
            }
            for (i, off) in offsets.enumerate() {
                // Along the columns, one piece at a time.
                let mut q = 0;
                for &(at, len) in runs {
                    let at = off + at;
                    let lanes = panel[q * width + i..].iter_mut().step_by(width);
                    if s == 1 {
                        lanes.zip(&xp[at..at + len]).for_each(|(v, &e)| *v = e);
                    } else {
                        lanes.zip(xp[at..at + (len - 1) * s + 1].iter().step_by(s)).for_each(|(v, &e)| *v = e);
                    }
                    q += len;
                }
            }
        }
    }

    /// The column matrix read where it lies in the padded copy, for products that take their
    /// operand from `xp` instead of a lowered copy: row `r` of a block whose channels start
    /// at `c0` holds, at column `j` of piece `(at, len)` of [`Windows::column_runs`],
    /// `xp[row_offset(r, c0) + at + j * strides[last]]`. The split comes from the run
    /// starts [`Windows::im2col`] reads: a run's start is its kernel position's offset plus
    /// its outer output position's, and kernel position 0 and outer position 0 both have
    /// offset 0. Only from the padded copy.
    pub(crate) fn row_offset(&self, r: usize, c0: usize) -> usize {
        assert!(self.padded_copy, "row_offset reads the padded copy");
        let (kl, outer) = (self.kernel_len(), self.output_len() / self.output[self.output.len() - 1].max(1));
        (r / kl - c0) * self.padded_len() + self.starts[(r % kl) * outer]
    }

    /// Columns `q0 .. q0 + kc` of the column matrices of samples side by side (column `n *
    /// output_len() + p`, samples `per_sample` elements of `xp` apart; see
    /// [`Windows::row_offset`]) as pieces `(at, len)`: column `j < len` of a piece lies at
    /// `at + j * strides[last]`. In column order, into `runs` (cleared first).
    pub(crate) fn column_runs(&self, per_sample: usize, (q0, kc): (usize, usize), runs: &mut Vec<(usize, usize)>) {
        assert!(self.padded_copy, "column_runs reads the padded copy");
        runs.clear();
        let (p, out_l, s) = (self.output_len(), self.output[self.output.len() - 1], self.last_stride());
        if p == 0 {
            return;
        }
        let mut q = 0;
        while q < kc {
            let (n, pp) = ((q0 + q) / p, (q0 + q) % p);
            let (run, j0) = (pp / out_l, pp % out_l);
            let len = (out_l - j0).min(kc - q);
            let at = n * per_sample + self.starts[run] + j0 * s;
            // A piece that goes on where the last one ended (a pointwise convolution's rows
            // follow one another) joins it: fewer, longer pieces.
            match runs.last_mut() {
                Some((a0, l0)) if *a0 + *l0 * s == at => *l0 += len,
                _ => runs.push((at, len)),
            }
            q += len;
        }
    }

    /// The stride of the innermost dimension.
    pub(crate) fn last_stride(&self) -> usize {
        self.strides[self.strides.len() - 1]
    }

    /// Adds the column matrix (`channels * kernel_len()` rows, row `r` at `col[r * ld +
    /// col0..][..output_len()]`) back onto the input grid `dx` (`channels x input_len()`):
    /// the adjoint of [`Windows::im2col`] (every column element to the input element
    /// it was read from).
    pub fn col2im_add(&self, col: &[f32], ld: usize, col0: usize, dx: &mut [f32]) {
        let (kl, p, il) = (self.kernel_len(), self.output_len(), self.input_len());
        let s = self.strides[self.strides.len() - 1];
        if p == 0 || il == 0 {
            return;
        }
        let channels = dx.len() / il;
        for r in 0..channels * kl {
            let src = &col[r * ld + col0..r * ld + col0 + p];
            let (c, kk) = (r / kl, r % kl);
            let dxc = &mut dx[c * il..(c + 1) * il];
            if !self.gather.is_empty() {
                // The runs' order (output positions ascending), so the same sums.
                for (&v, &at) in src.iter().zip(&self.gather[kk * p..(kk + 1) * p]) {
                    if at != PADDING {
                        dxc[at as usize] += v;
                    }
                }
                continue;
            }
            for &Run { p0, src0, lo, hi } in self.table_runs(kk) {
                let Some(dst0) = src0 else { continue };
                if hi > lo {
                    let first = (dst0 + (lo * s) as isize) as usize;
                    let from = &src[p0 + lo..p0 + hi];
                    if s == 1 {
                        for (d, v) in dxc[first..first + (hi - lo)].iter_mut().zip(from) {
                            *d += v;
                        }
                    } else {
                        for (i, v) in (first..).step_by(s).zip(from) {
                            dxc[i] += v;
                        }
                    }
                }
            }
        }
    }
}

impl Windows {
    /// Whether im2col goes through a padded copy of the input.
    pub(crate) fn pads_a_copy(&self) -> bool {
        self.padded_copy
    }
}

/// Rows of a panel gathered at once by [`gather_runs`].
const GATHER_LANES: usize = 32;

/// `dst[j * 32 + i] = xp[at[i] + j * s]` for every `j < dst.len() / 32`: one run of the
/// output's innermost dimension for the 32 rows of a panel, two 16-lane gathers a column.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn gather_runs(_: crate::simd::Avx512, xp: &[f32], at: &[i32; GATHER_LANES], s: i32, dst: &mut [f32]) {
    use core::arch::x86_64::*;
    let len = dst.len() / GATHER_LANES;
    // SAFETY: `at` (16 lanes at a time) and `dst` (its whole columns) are read and written
    // inside their lengths; every gathered element, `at[i] + j * s` for `j < len`, lies in
    // `xp`, which the caller asserted for every lane (indices non-negative, below
    // `xp.len() <= i32::MAX`).
    unsafe {
        let step = _mm512_set1_epi32(s);
        let mut i0 = _mm512_loadu_si512(at.as_ptr().cast());
        let mut i1 = _mm512_loadu_si512(at.as_ptr().add(16).cast());
        let out = dst.as_mut_ptr();
        for j in 0..len {
            _mm512_storeu_ps(out.add(j * GATHER_LANES), _mm512_i32gather_ps::<4>(i0, xp.as_ptr()));
            _mm512_storeu_ps(out.add(j * GATHER_LANES + 16), _mm512_i32gather_ps::<4>(i1, xp.as_ptr()));
            i0 = _mm512_add_epi32(i0, step);
            i1 = _mm512_add_epi32(i1, step);
        }
    }
}

/// `dst = src` (equal lengths) in 4-element moves: for the few-element rows of small grids
/// a `memcpy` call (what a plain copy loop becomes) costs more than the copy.
fn copy_short(dst: &mut [f32], src: &[f32]) {
    let (mut d, mut s) = (dst.chunks_exact_mut(4), src.chunks_exact(4));
    for (d4, s4) in (&mut d).zip(&mut s) {
        d4.copy_from_slice(s4);
    }
    for (d1, s1) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *d1 = *s1;
    }
}

/// The coordinates of flat index `index` in a row-major grid of sizes `dims`.
fn coords(mut index: usize, dims: &[usize]) -> Vec<usize> {
    let mut c = vec![0usize; dims.len()];
    for j in (0..dims.len()).rev() {
        c[j] = index % dims[j];
        index /= dims[j];
    }
    c
}

/// Calls `f` with every coordinate of a grid of sizes `dims`, in row-major order (once, with
/// no coordinates, for no dimensions; never for a grid with a size 0).
fn for_each_coord(dims: &[usize], mut f: impl FnMut(&[usize])) {
    let total: usize = dims.iter().product();
    let mut c = vec![0usize; dims.len()];
    for _ in 0..total {
        f(&c);
        for j in (0..dims.len()).rev() {
            c[j] += 1;
            if c[j] < dims[j] {
                break;
            }
            c[j] = 0;
        }
    }
}
