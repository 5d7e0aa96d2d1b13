//! The lowering of a convolution's windows to a matrix ("im2col") and its adjoint
//! ("col2im"), N-dimensional.
//!
//! For one sample and a block of channels, row `r = c * kernel_len + kk` of the column
//! matrix holds, at column `p` (the flattened output position `o`), the input element
//! `x[c, o * strides + k(kk) * dilations - pads_begin]`, or 0 where that lies in the padding.

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
    /// [`GATHER_ROW_MAX`]): per kernel position and output position, the input element read
    /// ([`PADDING`] in the padding), kernel position 0 first; empty otherwise.
    gather: Vec<u32>,
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

/// Output grids up to this many positions, with rows up to [`GATHER_ROW_MAX`] long, are
/// lowered through [`Windows`]' gather table: their runs are a few elements long, and a
/// memset/memcpy call per run cost more than the copy itself.
const GATHER_MAX: usize = 256;
/// Measured in the BN CNN's training step (batch 256, one thread): ConvWeightGrad on a 4x4
/// grid 660 -> 478 us through the table, on an 8x8 grid 156 -> 190 us (its 8-element runs
/// copy faster by memcpy), so rows of 8 keep the runs.
const GATHER_ROW_MAX: usize = 4;
/// A gather table entry in the padding.
const PADDING: u32 = u32::MAX;

impl Windows {
    /// The windows of a kernel `kernel` with `strides`, `dilations` and `pads_begin` from grid
    /// `input` to grid `output` (each list of one length, at least 1, the caller's shapes
    /// consistent: `ConvDims::new` builds it).
    pub fn new(
        input: &[usize],
        output: &[usize],
        kernel: &[usize],
        strides: &[usize],
        dilations: &[usize],
        pads_begin: &[usize],
    ) -> Self {
        let mut w = Self {
            input: input.to_vec(),
            output: output.to_vec(),
            kernel: kernel.to_vec(),
            strides: strides.to_vec(),
            dilations: dilations.to_vec(),
            pads_begin: pads_begin.to_vec(),
            table: Vec::new(),
            gather: Vec::new(),
        };
        let mut table = Vec::new();
        for kk in 0..w.kernel_len() {
            w.runs(kk, |p0, src0, lo, hi| table.push(Run { p0, src0, lo, hi }));
        }
        w.table = table;
        let row = w.output.last().copied().unwrap_or(0);
        let small = w.output_len() <= GATHER_MAX && row <= GATHER_ROW_MAX && w.input_len() < PADDING as usize;
        if small {
            let (out_l, s) = (w.output[w.output.len() - 1], w.strides[w.strides.len() - 1]);
            for run in &w.table {
                w.gather.extend((0..out_l).map(|j| match run.src0 {
                    Some(src0) if (run.lo..run.hi).contains(&j) => (src0 + (j * s) as isize) as u32,
                    _ => PADDING,
                }));
            }
        }
        w
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

    /// Whether [`Windows::im2col`] lowers through the gather table (a small output grid)
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
        // Kernel coordinates of `kk` (row-major over `kernel`).
        let mut k = vec![0usize; d];
        let mut rest = kk;
        for j in (0..d).rev() {
            k[j] = rest % self.kernel[j];
            rest /= self.kernel[j];
        }
        let off = |j: usize| (k[j] * self.dilations[j]) as isize - self.pads_begin[j] as isize;
        // Innermost dimension: o * s + off in [0, in) <=> lo <= o < hi.
        let (s, off_l, in_l, out_l) =
            (self.strides[last] as isize, off(last), self.input[last] as isize, self.output[last]);
        let lo = if off_l >= 0 { 0 } else { (-off_l + s - 1) / s } as usize;
        let hi = if in_l - off_l <= 0 { 0 } else { ((in_l - off_l + s - 1) / s) as usize };
        let (lo, hi) = (lo.min(out_l), hi.min(out_l));
        let (lo, hi) = if lo < hi { (lo, hi) } else { (0, 0) };
        // Input strides of the outer dimensions.
        let mut in_stride = vec![1usize; d];
        for j in (0..last).rev() {
            in_stride[j] = in_stride[j + 1] * self.input[j + 1];
        }
        let outer: usize = self.output[..last].iter().product();
        let mut o = vec![0usize; last];
        for run in 0..outer {
            let mut src = off_l;
            let mut inside = true;
            for j in 0..last {
                let i = (o[j] * self.strides[j]) as isize + off(j);
                inside &= i >= 0 && i < self.input[j] as isize;
                src += i * in_stride[j] as isize;
            }
            f(run * out_l, inside.then_some(src), lo, hi);
            // Next outer position (row-major odometer).
            for j in (0..last).rev() {
                o[j] += 1;
                if o[j] < self.output[j] {
                    break;
                }
                o[j] = 0;
            }
        }
    }

    /// Writes rows `rows` of the column matrix of `x` (`channels x input_len()` elements,
    /// channel 0 first) into `col`: row `rows.start + i` goes to `col[i * ld + col0..][..
    /// output_len()]` (so several samples can sit side by side in one matrix).
    pub fn im2col(&self, x: &[f32], rows: core::ops::Range<usize>, col: &mut [f32], ld: usize, col0: usize) {
        let (kl, p, il) = (self.kernel_len(), self.output_len(), self.input_len());
        let out_l = self.output[self.output.len() - 1];
        let s = self.strides[self.strides.len() - 1];
        if p == 0 {
            return;
        }
        for (i, r) in rows.enumerate() {
            let (c, kk) = (r / kl, r % kl);
            let xc = &x[c * il..(c + 1) * il];
            let dst = &mut col[i * ld + col0..i * ld + col0 + p];
            if !self.gather.is_empty() {
                for (v, &at) in dst.iter_mut().zip(&self.gather[kk * p..(kk + 1) * p]) {
                    *v = if at == PADDING { 0.0 } else { xc[at as usize] };
                }
                continue;
            }
            for &Run { p0, src0, lo, hi } in self.table_runs(kk) {
                let row = &mut dst[p0..p0 + out_l];
                let Some(src0) = src0 else {
                    row.fill(0.0);
                    continue;
                };
                row[..lo].fill(0.0);
                row[hi..].fill(0.0);
                if hi > lo {
                    let first = (src0 + (lo * s) as isize) as usize;
                    if s == 1 {
                        row[lo..hi].copy_from_slice(&xc[first..first + (hi - lo)]);
                    } else {
                        for (v, i) in row[lo..hi].iter_mut().zip((first..).step_by(s)) {
                            *v = xc[i];
                        }
                    }
                }
            }
        }
    }

    /// Adds the column matrix (`channels * kernel_len()` rows, row `r` at `col[r * ld +
    /// col0..][..output_len()]`) back onto the input grid `dx` (`channels x input_len()`):
    /// the adjoint of [`Windows::im2col`] (every column element to the input element it was
    /// read from).
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
