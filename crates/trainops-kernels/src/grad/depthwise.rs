//! Depthwise convolution: ONNX `Conv` (float32, NCHW, 2-d) with `group` equal to the input
//! channels `C`, `M = C * mult` filters (output channel `o` reads input channel
//! `c = o / mult`), any kernel size, strides, dilations and explicit pads. Writing
//! `ih = oh*sh + kh*dh - pt`, `iw = ow*sw + kw*dw - pl` (`pt`, `pl` the top and left pads;
//! positions outside the input read nothing):
//!
//! - [`forward`]: `Y[n, o, oh, ow] = sum_{kh, kw} W[o, 0, kh, kw] * X[n, c, ih, iw] (+ B[o])`.
//! - [`input_grad`]: `dX[n, c, ih, iw] = sum_{j < mult, kh, kw} W[c*mult + j, 0, kh, kw] *
//!   dY[n, c*mult + j, oh, ow]` over the `(oh, ow)` whose window reads `(ih, iw)`.
//! - [`weight_grad`]: `dW[o, 0, kh, kw] = sum_{n, oh, ow} dY[n, o, oh, ow] * X[n, c, ih, iw]`.
//!
//! No products and no im2col matrix: direct loops the compiler vectorises (compiled for AVX2
//! or AVX-512F where the CPU has them). The fast path copies each input plane into a
//! zero-padded buffer whose rows are grouped by their residue modulo the row stride
//! (`Padded`), so that every output of the plane reads each tap at one fixed offset from
//! `sw * v`, `v = oh * vw + ow`: the whole plane is one run of 16-wide blocks, however
//! narrow its rows (4x4 and 8x8 planes are common), the `vw - OW` extra columns per row
//! computed and dropped. The input gradient does the same over `dY` spread onto the input
//! grid by the strides (zeros between). A padded term then adds `w * 0` where the
//! definition skips it: the same bits for finite factors (a sum from `+0` is never `-0`),
//! so a plane with a non-finite weight (or, for the weight gradient, a non-finite `X` or
//! `dY` value) takes the general loops, which skip; so do geometries whose pads exceed the
//! kernel's reach or whose buffer would be large next to the planes. Each result
//! is a float32 sum in a fixed order, which [`reference`](mod@reference) spells out as plain
//! scalar loops, and the fast paths give the same bits at every SIMD level and thread count
//! (Rust never contracts `a * b + c` into a fused multiply-add, so a vector lane rounds as
//! the scalar code does):
//!
//! - forward: from `+0`, the taps in `(kh, kw)` order, skipping those outside the input;
//!   the bias added last.
//! - input gradient: from `+0`, the terms in `(j, kh, kw)` order.
//! - weight gradient: [`LANES`] partial sums per weight, term `(n, oh, ow)` going to lane
//!   `(oh * vw + ow) % LANES` (`vw = ceil((pl + IW + pr) / sw)`, the virtual row width of
//!   the fast path below), each lane in `(n, oh, ow)` order from `+0`; the lanes then
//!   added pairwise (8, 4, 2, 1 apart).
//!
//! Since taps outside the input are skipped, an infinite or NaN weight adds nothing at a
//! padded position, where a zero-padded copy of the input would give NaN. Threads: the
//! forward runs groups of whole `(n, o)` output planes as tasks, the input gradient groups
//! of `(n, c)` planes, the weight gradient groups of filters (each summing over the whole
//! batch); every result is computed by one task in the order above, so the cut changes no
//! bit. Against float64, each result is within
//! `(terms + 1) * f32::EPSILON * sum |terms|` (a float32 sum of `terms` rounded products).

use super::conv::{ConvError, ConvGeometry};
use crate::parallel::{for_each_item, Parallelism, Sequential, CHUNK, SERIAL_BELOW};
use crate::shape;
use crate::simd::{detected, Isa, Level};
use crate::KernelError;

/// Partial sums per weight in the weight gradient (one AVX-512 vector, two AVX2 ones).
pub const LANES: usize = 16;

/// The shapes of one depthwise convolution, checked: `X [batch, channels, ih, iw]`,
/// `W [channels * mult, 1, kh, kw]`, `Y [batch, channels * mult, oh, ow]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DepthwiseDims {
    batch: usize,
    channels: usize,
    mult: usize,
    input: [usize; 2],
    output: [usize; 2],
    kernel: [usize; 2],
    strides: [usize; 2],
    dilations: [usize; 2],
    /// `[top, left, bottom, right]`.
    pads: [usize; 4],
}

impl DepthwiseDims {
    /// The dims of `geo` over `batch` samples of `channels` channels on the 2-d grid `input`
    /// with `out_channels` filters. Refused, naming the attribute or saying what does not
    /// fit: a kernel other than 2-d, `group` other than `channels`, `out_channels` not a
    /// positive multiple of `channels`, a kernel larger than the padded input, a tensor
    /// size past `2^63 - 1` elements.
    pub fn new(
        geo: &ConvGeometry,
        batch: usize,
        channels: usize,
        out_channels: usize,
        input: &[usize],
    ) -> Result<Self, ConvError> {
        geo.check()?;
        if geo.kernel.len() != 2 {
            let what = format!("a depthwise convolution here is 2-d, got kernel_shape {:?}", geo.kernel);
            return Err(ConvError::Attribute { name: "kernel_shape", what });
        }
        if geo.group != channels {
            let what =
                format!("must equal the input channels ({channels}) for a depthwise convolution, got {}", geo.group);
            return Err(ConvError::Attribute { name: "group", what });
        }
        if out_channels == 0 || !out_channels.is_multiple_of(channels) {
            return Err(ConvError::Shape(format!(
                "the output channels ({out_channels}) must be a positive multiple of the input channels ({channels})"
            )));
        }
        let output = geo.output_spatial(input)?;
        let two = |v: &[usize]| [v[0], v[1]];
        let dims = Self {
            batch,
            channels,
            mult: out_channels / channels,
            input: two(input),
            output: two(&output),
            kernel: two(&geo.kernel),
            strides: two(&geo.strides),
            dilations: two(&geo.dilations),
            pads: [geo.pads[0], geo.pads[1], geo.pads[2], geo.pads[3]],
        };
        let too_big = |e: KernelError| ConvError::Shape(e.to_string());
        for (what, s) in [("X", dims.x_shape()), ("Y", dims.y_shape()), ("W", dims.w_shape())] {
            shape::count(what, &s).map_err(too_big)?;
            shape::to_i64(what, &s).map_err(too_big)?;
        }
        Ok(dims)
    }

    /// `X`'s (and `dX`'s) shape.
    pub fn x_shape(&self) -> Vec<usize> {
        vec![self.batch, self.channels, self.input[0], self.input[1]]
    }

    /// `Y`'s (and `dY`'s) shape.
    pub fn y_shape(&self) -> Vec<usize> {
        vec![self.batch, self.out_channels(), self.output[0], self.output[1]]
    }

    /// `W`'s (and `dW`'s) shape.
    pub fn w_shape(&self) -> Vec<usize> {
        vec![self.out_channels(), 1, self.kernel[0], self.kernel[1]]
    }

    /// The filters, `channels * mult`.
    pub fn out_channels(&self) -> usize {
        self.channels * self.mult
    }

    fn in_plane(&self) -> usize {
        self.input[0] * self.input[1]
    }

    fn out_plane(&self) -> usize {
        self.output[0] * self.output[1]
    }

    fn taps(&self) -> usize {
        self.kernel[0] * self.kernel[1]
    }

    /// The dilated kernel's extent minus one along `axis`.
    fn reach(&self, axis: usize) -> usize {
        (self.kernel[axis] - 1) * self.dilations[axis]
    }

    /// Columns of the virtual output row: the padded width over the column stride,
    /// rounded up (at least the output's width). The weight gradient's lanes follow it.
    fn virtual_width(&self) -> usize {
        (self.pads[1] + self.input[1] + self.pads[3]).div_ceil(self.strides[1])
    }

    /// The forward's (and the weight gradient's) padded input plane, when its buffer is
    /// small next to the tensors' planes.
    fn forward_layout(&self) -> Option<Padded> {
        let (ph, pw) = (self.pads[0] + self.input[0] + self.pads[2], self.virtual_width() * self.strides[1]);
        Padded::new(self, ph, pw, self.strides, self.virtual_width())
    }

    /// The input gradient's buffer: `dY` spread by the strides onto the input's grid,
    /// widened by the kernel's reach (stride 1 over it).
    fn input_grad_layout(&self) -> Option<Padded> {
        let (ph, pw) = (self.input[0] + self.reach(0), self.input[1] + self.reach(1));
        Padded::new(self, ph, pw, [1, 1], pw)
    }

    /// The input row read by output row `oh` at kernel row `kh`, if inside the input.
    fn in_row(&self, oh: usize, kh: usize) -> Option<usize> {
        let at = (oh * self.strides[0] + kh * self.dilations[0]).checked_sub(self.pads[0])?;
        (at < self.input[0]).then_some(at)
    }

    /// Per kernel column: `(off, lo, hi)`, output column `ow` reading input column
    /// `ow * sw + off`, inside the input for `ow` in `lo..hi`.
    fn columns(&self) -> Vec<Span> {
        (0..self.kernel[1])
            .map(|kw| {
                let off = (kw * self.dilations[1]) as i128 - self.pads[1] as i128;
                Span::of(off, self.strides[1], self.input[1], self.output[1])
            })
            .collect()
    }
}

/// Positions `t` in `lo..hi` read `src[t * step + off]` (all inside `src`).
#[derive(Debug, Clone, Copy)]
struct Span {
    off: i128,
    lo: usize,
    hi: usize,
}

impl Span {
    /// The `t < count` with `0 <= t * step + off < len`.
    fn of(off: i128, step: usize, len: usize, count: usize) -> Self {
        let step = step as i128;
        let lo = if off >= 0 { 0 } else { (-off + step - 1) / step };
        let room = len as i128 - off;
        let hi = if room <= 0 { 0 } else { (room + step - 1) / step };
        let (lo, hi) = (lo.min(count as i128) as usize, hi.min(count as i128) as usize);
        Self { off, lo, hi: hi.max(lo) }
    }

    /// The index `t` reads (`t` in `lo..hi`).
    #[inline(always)]
    fn at(&self, t: usize, step: usize) -> usize {
        ((t * step) as i128 + self.off) as usize
    }
}

/// A zero-padded plane of the fast paths: `ph` rows of `pw` columns (`pw = vw * sw`), row
/// `r` stored at slot `r / sh` of the rows with its residue `r % sh` (those of each residue
/// together), then `pw + 16 * sw` zeros of slack. Output `(oh, ow)` at virtual position
/// `v = oh * vw + ow` then reads `buf[sw * v + slot(kh * dh) * pw + kw * dw]` at tap
/// `(kh, kw)`: one contiguous (or `sw`-strided) run over the whole plane, whatever its
/// width. Positions with `ow >= OW` are computed and dropped.
#[derive(Debug, Clone, Copy)]
struct Padded {
    ph: usize,
    pw: usize,
    vw: usize,
    sh: usize,
    len: usize,
}

impl Padded {
    /// `None` where a pad exceeds the kernel's reach (rows no window reads) or the buffer
    /// would exceed 16 times the input and output planes (plus 4096): the general loops
    /// then run instead, so no buffer is sized by the attributes alone.
    fn new(d: &DepthwiseDims, ph: usize, pw: usize, strides: [usize; 2], vw: usize) -> Option<Self> {
        let within = (0..4).all(|i| d.pads[i] <= d.reach(i % 2));
        let limit = 16 * (d.in_plane() + d.out_plane()) + 4096;
        let area = ph.checked_mul(pw).filter(|&a| a <= limit)?;
        let [sh, sw] = strides;
        within.then_some(Self { ph, pw, vw, sh, len: area + pw + LANES * sw })
    }

    /// Where padded row `r` is stored.
    fn slot(&self, r: usize) -> usize {
        let b = r % self.sh;
        b * (self.ph / self.sh) + b.min(self.ph % self.sh) + r / self.sh
    }

    /// Where each input row starts in the buffer (computed once: `slot` divides).
    fn rows(&self, d: &DepthwiseDims) -> Vec<usize> {
        (0..d.input[0]).map(|ih| self.slot(ih + d.pads[0]) * self.pw + d.pads[1]).collect()
    }

    /// Virtual output positions, whole blocks of [`LANES`].
    fn virtual_len(&self, rows: usize) -> usize {
        (rows * self.vw).div_ceil(LANES) * LANES
    }
}

/// `out[v] = sum over taps (in order) of w * buf[sw * v + off]`, plus `bias`, for every
/// `v < out.len()` (a multiple of [`LANES`]); `S` is `sw` when non-zero. Four blocks of
/// [`LANES`] at a time: four independent sums in flight hide the adds' latency (one sum
/// per block would wait on each add); each element's order is the taps' all the same.
#[inline(always)]
fn correlate<const S: usize>(buf: &[f32], taps: &[(f32, usize)], sw: usize, bias: Option<f32>, out: &mut [f32]) {
    assert!(reads_within(buf.len(), taps.iter().map(|t| t.1), sw, out.len()), "depthwise: tap outside the buffer");
    let blocks = out.len() / LANES;
    let mut b = 0;
    while b + 4 <= blocks {
        correlate_blocks::<S, 4>(buf, taps, sw, bias, b, &mut out[b * LANES..(b + 4) * LANES]);
        b += 4;
    }
    if b + 2 <= blocks {
        correlate_blocks::<S, 2>(buf, taps, sw, bias, b, &mut out[b * LANES..(b + 2) * LANES]);
        b += 2;
    }
    if b < blocks {
        correlate_blocks::<S, 1>(buf, taps, sw, bias, b, &mut out[b * LANES..(b + 1) * LANES]);
    }
}

/// Whether every tap's reads `buf[off + sw * v]`, `v < n`, lie inside a buffer of
/// `len`: checked once per plane, so that the loops of [`correlate_blocks`] and
/// [`accumulate_taps`] read without a check per block and tap (those checks were half
/// their instructions, and the weight gradient ran 2.5x slower for them).
#[inline(always)]
fn reads_within(len: usize, mut offs: impl Iterator<Item = usize>, sw: usize, n: usize) -> bool {
    n == 0 || offs.all(|o| (n - 1).checked_mul(sw).and_then(|r| r.checked_add(o)).is_some_and(|last| last < len))
}

/// [`correlate`] over the `Q` blocks from block `b` (`out` theirs; `correlate` checked
/// that their reads lie inside `buf`).
#[inline(always)]
fn correlate_blocks<const S: usize, const Q: usize>(
    buf: &[f32],
    taps: &[(f32, usize)],
    sw: usize,
    bias: Option<f32>,
    b: usize,
    out: &mut [f32],
) {
    let sw = if S == 0 { sw } else { S };
    let mut acc = [[0f32; LANES]; Q];
    for &(w, off) in taps {
        for (q, a) in acc.iter_mut().enumerate() {
            let base = off + sw * (b + q) * LANES;
            for (l, v) in a.iter_mut().enumerate() {
                // SAFETY: base + sw * l = off + sw * v for an output position v <
                // out.len(): inside `buf` by `correlate`'s assertion.
                *v += w * unsafe { *buf.get_unchecked(base + sw * l) };
            }
        }
    }
    for (o, a) in out.chunks_exact_mut(LANES).zip(acc.iter_mut()) {
        if let Some(bv) = bias {
            a.iter_mut().for_each(|v| *v += bv);
        }
        o.copy_from_slice(a);
    }
}

/// [`correlate`] specialised on the common strides.
#[inline(always)]
fn correlate_any(buf: &[f32], taps: &[(f32, usize)], sw: usize, bias: Option<f32>, out: &mut [f32]) {
    match sw {
        1 => correlate::<1>(buf, taps, sw, bias, out),
        2 => correlate::<2>(buf, taps, sw, bias, out),
        _ => correlate::<0>(buf, taps, sw, bias, out),
    }
}

/// Whether every value is finite (the fast paths add `w * 0` for a skipped term, which
/// is the skipped term's bits only for finite factors).
#[inline(always)]
fn finite(v: &[f32]) -> bool {
    v.iter().fold(true, |ok, x| ok & x.is_finite())
}

/// Copies input plane `xp` into its place in `buf`, a zero-padded plane in `lay`'s layout:
/// `buf` starts zeroed and only the input's positions are ever written, so the padding
/// stays zero from plane to plane.
/// `rows`: where each input row goes ([`Padded::rows`]).
#[inline(always)]
fn fill_padded(iw: usize, rows: &[usize], xp: &[f32], buf: &mut [f32]) {
    for (&at, row) in rows.iter().zip(xp.chunks_exact(iw.max(1))) {
        copy_row(&mut buf[at..at + iw], &row[..iw]);
    }
}

/// `dst = src` for the short rows of small planes in fixed-size moves (a `memcpy` call
/// per 4- to 16-element row cost more than the copy).
#[inline(always)]
fn copy_row(dst: &mut [f32], src: &[f32]) {
    let (n, mut i) = (src.len().min(dst.len()), 0);
    while i + 16 <= n {
        dst[i..i + 16].copy_from_slice(&src[i..i + 16]);
        i += 16;
    }
    if i + 8 <= n {
        dst[i..i + 8].copy_from_slice(&src[i..i + 8]);
        i += 8;
    }
    if i + 4 <= n {
        dst[i..i + 4].copy_from_slice(&src[i..i + 4]);
        i += 4;
    }
    if i + 2 <= n {
        dst[i..i + 2].copy_from_slice(&src[i..i + 2]);
        i += 2;
    }
    if i < n {
        dst[i] = src[i];
    }
}

/// One term source of a gathered row: `w * src[t * step + off]` for `t` in its span.
#[derive(Clone, Copy)]
struct Tap<'a> {
    w: f32,
    src: &'a [f32],
    span: Span,
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { what, got, expected })
    }
}

/// Elements of a shape [`DepthwiseDims::new`] has checked (no overflow).
fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// Multiply-adds a task aims at.
const TASK_WORK: usize = 8 * CHUNK;

/// `len` units of `work` each, grouped into tasks of about [`TASK_WORK`] (the grouping
/// depends on the shapes only).
fn per_task(work: usize) -> usize {
    (TASK_WORK / work.max(1)).max(1)
}

/// `$name(isa, args..)` runs `$body(args..)` compiled for `isa`'s instruction set: the
/// same operations (Rust never contracts `a * b + c`), wider vectors. The body is inlined
/// into a function with the target features enabled (a closure called from such a
/// function would keep the baseline's code).
macro_rules! at_level {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(isa: Isa, $($arg: $ty),*) {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512(t) => {
                    #[target_feature(enable = "avx512f")]
                    #[allow(clippy::too_many_arguments)]
                    fn go(_: crate::simd::Avx512, $($arg: $ty),*) {
                        $body($($arg),*)
                    }
                    // SAFETY: the token proves the CPU has AVX-512F.
                    unsafe { go(t, $($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2(t) => {
                    #[target_feature(enable = "avx2,fma")]
                    #[allow(clippy::too_many_arguments)]
                    fn go(_: crate::simd::Avx2, $($arg: $ty),*) {
                        $body($($arg),*)
                    }
                    // SAFETY: the token proves the CPU has AVX2 and FMA.
                    unsafe { go(t, $($arg),*) }
                }
                _ => $body($($arg),*),
            }
        }
    };
}

at_level!(forward_planes_at, forward_planes, (d: &DepthwiseDims, x: &[f32], w: &[f32], bias: Option<&[f32]>, cols: &[Span], p0: usize, planes: &mut [f32]));
at_level!(input_grad_planes_at, input_grad_planes, (d: &DepthwiseDims, dy: &[f32], w: &[f32], residues: &[(usize, Vec<Option<Span>>)], q0: usize, planes: &mut [f32]));
at_level!(weight_grad_filters_at, weight_grad_filters, (d: &DepthwiseDims, x: &[f32], dy: &[f32], cols: &[Span], o0: usize, out: &mut [f32]));

/// The sequential runner below `serial_below` units of work, else `par`.
fn runner<'p>(par: &'p dyn Parallelism, work: usize, seq: &'p Sequential) -> &'p dyn Parallelism {
    if work < 8 * SERIAL_BELOW {
        seq
    } else {
        par
    }
}

/// `out[first + t * ostep] = sum over taps (in order, those whose span holds t) of
/// w * src[t * istep + off]`, plus `bias`, for `t < count`. `IS` is `istep` when
/// non-zero (a constant the loops specialise on).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather<const IS: usize>(
    out: &mut [f32],
    first: usize,
    ostep: usize,
    count: usize,
    taps: &[Tap<'_>],
    istep: usize,
    bias: Option<f32>,
) {
    let istep = if IS == 0 { istep } else { IS };
    let (mut lo, mut hi) = (0, count);
    for tap in taps {
        lo = lo.max(tap.span.lo);
        hi = hi.min(tap.span.hi);
    }
    let one = |out: &mut [f32], t: usize| {
        let mut acc = 0f32;
        for tap in taps {
            if (tap.span.lo..tap.span.hi).contains(&t) {
                acc += tap.w * tap.src[tap.span.at(t, istep)];
            }
        }
        if let Some(b) = bias {
            acc += b;
        }
        out[first + t * ostep] = acc;
    };
    if lo >= hi {
        (0..count).for_each(|t| one(out, t));
        return;
    }
    (0..lo).for_each(|t| one(out, t));
    let mut t = lo;
    while t + LANES <= hi {
        let mut acc = [0f32; LANES];
        for tap in taps {
            let s = &tap.src[tap.span.at(t, istep)..][..(LANES - 1) * istep + 1];
            for (l, a) in acc.iter_mut().enumerate() {
                *a += tap.w * s[l * istep];
            }
        }
        if let Some(b) = bias {
            acc.iter_mut().for_each(|a| *a += b);
        }
        if ostep == 1 {
            out[first + t..][..LANES].copy_from_slice(&acc);
        } else {
            for (l, a) in acc.into_iter().enumerate() {
                out[first + (t + l) * ostep] = a;
            }
        }
        t += LANES;
    }
    (t..count).for_each(|t| one(out, t));
}

/// [`gather`] specialised on the common input steps.
#[inline(always)]
fn gather_any(
    out: &mut [f32],
    first: usize,
    ostep: usize,
    count: usize,
    taps: &[Tap<'_>],
    istep: usize,
    bias: Option<f32>,
) {
    match istep {
        1 => gather::<1>(out, first, ostep, count, taps, istep, bias),
        2 => gather::<2>(out, first, ostep, count, taps, istep, bias),
        _ => gather::<0>(out, first, ostep, count, taps, istep, bias),
    }
}

/// The depthwise convolution's output (see the module text) at the widest SIMD level.
pub fn forward(
    d: &DepthwiseDims,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    forward_at(detected(), d, x, w, bias, y, par)
}

/// [`forward`] at SIMD level `level` (scalar where the CPU lacks it).
pub fn forward_at(
    level: Level,
    d: &DepthwiseDims,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check_len("X", x.len(), numel(&d.x_shape()))?;
    check_len("W", w.len(), numel(&d.w_shape()))?;
    check_len("Y", y.len(), numel(&d.y_shape()))?;
    if let Some(b) = bias {
        check_len("B", b.len(), d.out_channels())?;
    }
    let plane = d.out_plane();
    if y.is_empty() {
        return Ok(());
    }
    let cols = d.columns();
    let per = per_task(plane * d.taps());
    let items: Vec<(usize, &mut [f32])> = y.chunks_mut(per * plane).enumerate().map(|(i, c)| (i * per, c)).collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let seq = Sequential;
    let par = runner(par, numel(&d.y_shape()).saturating_mul(d.taps()), &seq);
    for_each_item(par, items, |(p0, planes)| {
        forward_planes_at(isa, d, x, w, bias, &cols, p0, planes);
    });
    Ok(())
}

/// Output planes `p0..` (`planes`): by the padded layout where there is one and the
/// plane's filter is finite, else row by row with the taps inside the input.
#[inline(always)]
fn forward_planes(
    d: &DepthwiseDims,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    cols: &[Span],
    p0: usize,
    planes: &mut [f32],
) {
    let (m, kk, [_, iw], [oh_len, ow]) = (d.out_channels(), d.taps(), d.input, d.output);
    let lay = d.forward_layout();
    let (mut buf, mut vout, rows) = match &lay {
        Some(l) => (vec![0f32; l.len], vec![0f32; l.virtual_len(oh_len)], l.rows(d)),
        None => (Vec::new(), Vec::new(), Vec::new()),
    };
    let mut taps: Vec<Tap<'_>> = Vec::with_capacity(kk);
    let mut fast_taps: Vec<(f32, usize)> = Vec::with_capacity(kk);
    for (k, yp) in planes.chunks_exact_mut(d.out_plane()).enumerate() {
        let (n, o) = ((p0 + k) / m, (p0 + k) % m);
        let xp = &x[(n * d.channels + o / d.mult) * d.in_plane()..][..d.in_plane()];
        let wk = &w[o * kk..][..kk];
        let b = bias.map(|b| b[o]);
        if let Some(lay) = lay.as_ref().filter(|_| finite(wk)) {
            fill_padded(iw, &rows, xp, &mut buf);
            fast_taps.clear();
            for kh in 0..d.kernel[0] {
                let row = lay.slot(kh * d.dilations[0]) * lay.pw;
                for kw in 0..d.kernel[1] {
                    fast_taps.push((wk[kh * d.kernel[1] + kw], row + kw * d.dilations[1]));
                }
            }
            correlate_any(&buf, &fast_taps, d.strides[1], b, &mut vout);
            for (yrow, vrow) in yp.chunks_exact_mut(ow).zip(vout.chunks(lay.vw)) {
                copy_row(yrow, &vrow[..ow]);
            }
            continue;
        }
        for (oh, yrow) in yp.chunks_exact_mut(ow).enumerate() {
            taps.clear();
            for kh in 0..d.kernel[0] {
                let Some(ih) = d.in_row(oh, kh) else { continue };
                let src = &xp[ih * iw..][..iw];
                for (kw, &span) in cols.iter().enumerate() {
                    taps.push(Tap { w: wk[kh * d.kernel[1] + kw], src, span });
                }
            }
            gather_any(yrow, 0, 1, ow, &taps, d.strides[1], b);
        }
    }
}

/// The input gradient `dX` (see the module text) at the widest SIMD level.
pub fn input_grad(
    d: &DepthwiseDims,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    input_grad_at(detected(), d, dy, w, dx, par)
}

/// [`input_grad`] at SIMD level `level` (scalar where the CPU lacks it).
pub fn input_grad_at(
    level: Level,
    d: &DepthwiseDims,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check_len("dY", dy.len(), numel(&d.y_shape()))?;
    check_len("W", w.len(), numel(&d.w_shape()))?;
    check_len("dX", dx.len(), numel(&d.x_shape()))?;
    let plane = d.in_plane();
    if dx.is_empty() {
        return Ok(());
    }
    // Per residue r < sw of the input column and kernel column kw: the span of dY's
    // columns (step 1) feeding dX columns r, r + sw, ..; None where none can.
    let (sw, iw) = (d.strides[1], d.input[1]);
    let residues: Vec<(usize, Vec<Option<Span>>)> = (0..sw.min(iw))
        .map(|r| {
            let count = (iw - r).div_ceil(sw);
            let spans = (0..d.kernel[1])
                .map(|kw| {
                    let num = r as i128 + d.pads[1] as i128 - (kw * d.dilations[1]) as i128;
                    (num.rem_euclid(sw as i128) == 0)
                        .then(|| Span::of(num.div_euclid(sw as i128), 1, d.output[1], count))
                })
                .collect();
            (count, spans)
        })
        .collect();
    let per = per_task(plane * d.taps() * d.mult);
    let items: Vec<(usize, &mut [f32])> = dx.chunks_mut(per * plane).enumerate().map(|(i, c)| (i * per, c)).collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let seq = Sequential;
    let par = runner(par, numel(&d.y_shape()).saturating_mul(d.taps()), &seq);
    for_each_item(par, items, |(q0, planes)| {
        input_grad_planes_at(isa, d, dy, w, &residues, q0, planes);
    });
    Ok(())
}

/// The dY row feeding input row `ih` at kernel row `kh`, if any.
fn out_row(d: &DepthwiseDims, ih: usize, kh: usize) -> Option<usize> {
    let num = (ih + d.pads[0]).checked_sub(kh * d.dilations[0])?;
    (num.is_multiple_of(d.strides[0]) && num / d.strides[0] < d.output[0]).then_some(num / d.strides[0])
}

/// Input-gradient planes `q0..` (`planes`): by the spread layout where there is one and the
/// channel's filters are finite, else row by row.
#[inline(always)]
fn input_grad_planes(
    d: &DepthwiseDims,
    dy: &[f32],
    w: &[f32],
    residues: &[(usize, Vec<Option<Span>>)],
    q0: usize,
    planes: &mut [f32],
) {
    let (kk, ow, iw, sw) = (d.taps(), d.output[1], d.input[1], d.strides[1]);
    let lay = d.input_grad_layout();
    let (mut buf, mut vout) = match &lay {
        Some(l) => (vec![0f32; l.len * d.mult], vec![0f32; l.virtual_len(d.input[0])]),
        None => (Vec::new(), Vec::new()),
    };
    let mut taps: Vec<Tap<'_>> = Vec::with_capacity(kk * d.mult);
    let mut fast_taps: Vec<(f32, usize)> = Vec::with_capacity(kk * d.mult);
    for (k, xp) in planes.chunks_exact_mut(d.in_plane()).enumerate() {
        let (n, c) = ((q0 + k) / d.channels, (q0 + k) % d.channels);
        let wc = &w[c * d.mult * kk..][..d.mult * kk];
        if let Some(lay) = lay.as_ref().filter(|_| finite(wc)) {
            // dY[oh, ow] at (oh*sh + reach_h - pt, ow*sw + reach_w - pl); dX[ih, iw] then
            // reads it at tap (kh, kw) from (ih + reach_h - kh*dh, iw + reach_w - kw*dw).
            let (top, left) = (d.reach(0) - d.pads[0], d.reach(1) - d.pads[1]);
            fast_taps.clear();
            for j in 0..d.mult {
                let o = c * d.mult + j;
                let ub = &mut buf[j * lay.len..][..lay.len];
                // The positions written are the same for every plane: the rest stays zero.
                let yp = &dy[(n * d.out_channels() + o) * d.out_plane()..][..d.out_plane()];
                for (oh, yrow) in yp.chunks_exact(ow).enumerate() {
                    let at = (oh * d.strides[0] + top) * lay.pw + left;
                    if sw == 1 {
                        copy_row(&mut ub[at..at + ow], yrow);
                    } else {
                        for (owi, &g) in yrow.iter().enumerate() {
                            ub[at + owi * sw] = g;
                        }
                    }
                }
                for kh in 0..d.kernel[0] {
                    for kw in 0..d.kernel[1] {
                        let off = (d.reach(0) - kh * d.dilations[0]) * lay.pw + d.reach(1) - kw * d.dilations[1];
                        fast_taps.push((wc[j * kk + kh * d.kernel[1] + kw], j * lay.len + off));
                    }
                }
            }
            correlate::<1>(&buf, &fast_taps, 1, None, &mut vout);
            for (xrow, vrow) in xp.chunks_exact_mut(iw).zip(vout.chunks(lay.vw)) {
                copy_row(xrow, &vrow[..iw]);
            }
            continue;
        }
        for (ih, xrow) in xp.chunks_exact_mut(iw).enumerate() {
            for (r, (count, spans)) in residues.iter().enumerate() {
                taps.clear();
                for j in 0..d.mult {
                    let o = c * d.mult + j;
                    let yp = &dy[(n * d.out_channels() + o) * d.out_plane()..][..d.out_plane()];
                    for kh in 0..d.kernel[0] {
                        let Some(oh) = out_row(d, ih, kh) else { continue };
                        let src = &yp[oh * ow..][..ow];
                        for (kw, span) in spans.iter().enumerate() {
                            if let Some(span) = *span {
                                taps.push(Tap { w: w[o * kk + kh * d.kernel[1] + kw], src, span });
                            }
                        }
                    }
                }
                gather_any(xrow, r, sw, *count, &taps, 1, None);
            }
        }
    }
}

/// The weight gradient `dW` (see the module text) at the widest SIMD level.
pub fn weight_grad(
    d: &DepthwiseDims,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    weight_grad_at(detected(), d, x, dy, dw, par)
}

/// [`weight_grad`] at SIMD level `level` (scalar where the CPU lacks it).
pub fn weight_grad_at(
    level: Level,
    d: &DepthwiseDims,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), KernelError> {
    check_len("X", x.len(), numel(&d.x_shape()))?;
    check_len("dY", dy.len(), numel(&d.y_shape()))?;
    check_len("dW", dw.len(), numel(&d.w_shape()))?;
    let cols = d.columns();
    let per_channel = d.mult * d.taps();
    let work = d.batch.saturating_mul(d.out_plane()).saturating_mul(per_channel);
    let per = per_task(work);
    let items: Vec<(usize, &mut [f32])> =
        dw.chunks_mut(per * per_channel).enumerate().map(|(i, c)| (i * per * d.mult, c)).collect();
    let isa = level.isa().unwrap_or(Isa::Scalar);
    let seq = Sequential;
    let par = runner(par, work.saturating_mul(d.channels), &seq);
    for_each_item(par, items, |(o0, out)| {
        weight_grad_filters_at(isa, d, x, dy, &cols, o0, out);
    });
    Ok(())
}

/// Lane sums added pairwise: 8 apart, then 4, 2, 1.
#[inline(always)]
fn fold(mut a: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for l in 0..half {
            a[l] += a[l + half];
        }
        half /= 2;
    }
    a[0]
}

/// `acc[tap][v % LANES] += dyv[v] * buf[sw * v + off_tap]` for every virtual position `v`
/// (`dyv` whole blocks of [`LANES`]), in `v` order; `S` is `sw` when non-zero. Four taps
/// at a time, their lanes held in registers over the plane (four independent sums in
/// flight; dY's blocks stay in L1).
#[inline(always)]
fn accumulate<const S: usize>(acc: &mut [[f32; LANES]], buf: &[f32], dyv: &[f32], offs: &[usize], sw: usize) {
    assert!(reads_within(buf.len(), offs.iter().copied(), sw, dyv.len()), "depthwise: tap outside the buffer");
    let mut accs = acc.chunks_exact_mut(4);
    let mut offs4 = offs.chunks_exact(4);
    for (a, o) in (&mut accs).zip(&mut offs4) {
        accumulate_taps::<S, 4>(a, buf, dyv, o, sw);
    }
    for (a, &o) in accs.into_remainder().iter_mut().zip(offs4.remainder()) {
        accumulate_taps::<S, 1>(core::slice::from_mut(a), buf, dyv, &[o], sw);
    }
}

/// [`accumulate`] for `Q` taps (`accumulate` checked that their reads lie inside `buf`).
#[inline(always)]
fn accumulate_taps<const S: usize, const Q: usize>(
    acc: &mut [[f32; LANES]],
    buf: &[f32],
    dyv: &[f32],
    offs: &[usize],
    sw: usize,
) {
    let sw = if S == 0 { sw } else { S };
    let offs: [usize; Q] = core::array::from_fn(|q| offs[q]);
    let mut a: [[f32; LANES]; Q] = core::array::from_fn(|q| acc[q]);
    for (b, ds) in dyv.chunks_exact(LANES).enumerate() {
        for (aq, &off) in a.iter_mut().zip(&offs) {
            let base = off + sw * b * LANES;
            for (l, v) in aq.iter_mut().enumerate() {
                // SAFETY: base + sw * l = off + sw * v for a position v < dyv.len(): inside
                // `buf` by `accumulate`'s assertion.
                *v += ds[l] * unsafe { *buf.get_unchecked(base + sw * l) };
            }
        }
    }
    acc[..Q].copy_from_slice(&a);
}

/// Filters `o0..` (`out`, theirs of dW): per sample, by the padded layout where there is
/// one and the sample's planes are finite, else term by term; the same lanes either way.
#[inline(always)]
fn weight_grad_filters(d: &DepthwiseDims, x: &[f32], dy: &[f32], cols: &[Span], o0: usize, out: &mut [f32]) {
    let (kk, kw_len, iw, ow, sw) = (d.taps(), d.kernel[1], d.input[1], d.output[1], d.strides[1]);
    let vw = d.virtual_width();
    let lay = d.forward_layout();
    let (mut buf, mut dyv, rows) = match &lay {
        Some(l) => (vec![0f32; l.len], vec![0f32; l.virtual_len(d.output[0])], l.rows(d)),
        None => (Vec::new(), Vec::new(), Vec::new()),
    };
    let offs: Vec<usize> = match &lay {
        Some(l) => {
            (0..kk).map(|t| l.slot((t / kw_len) * d.dilations[0]) * l.pw + (t % kw_len) * d.dilations[1]).collect()
        }
        None => Vec::new(),
    };
    let mut acc = vec![[0f32; LANES]; kk];
    for (k, dwo) in out.chunks_exact_mut(kk).enumerate() {
        let o = o0 + k;
        let c = o / d.mult;
        acc.iter_mut().for_each(|a| *a = [0f32; LANES]);
        for n in 0..d.batch {
            let xp = &x[(n * d.channels + c) * d.in_plane()..][..d.in_plane()];
            let yp = &dy[(n * d.out_channels() + o) * d.out_plane()..][..d.out_plane()];
            if let Some(lay) = lay.as_ref().filter(|_| finite(xp) && finite(yp)) {
                fill_padded(iw, &rows, xp, &mut buf);
                for (vrow, yrow) in dyv.chunks_mut(lay.vw).zip(yp.chunks_exact(ow)) {
                    copy_row(&mut vrow[..ow], yrow);
                }
                match sw {
                    1 => accumulate::<1>(&mut acc, &buf, &dyv, &offs, sw),
                    2 => accumulate::<2>(&mut acc, &buf, &dyv, &offs, sw),
                    _ => accumulate::<0>(&mut acc, &buf, &dyv, &offs, sw),
                }
                continue;
            }
            for (oh, yrow) in yp.chunks_exact(ow).enumerate() {
                // Lane of (oh, ow): (oh * vw + ow) % LANES, without the product's overflow.
                let base = (oh % LANES) * (vw % LANES);
                for kh in 0..d.kernel[0] {
                    let Some(ih) = d.in_row(oh, kh) else { continue };
                    let xrow = &xp[ih * iw..][..iw];
                    for (kw, span) in cols.iter().enumerate() {
                        let a = &mut acc[kh * kw_len + kw];
                        for t in span.lo..span.hi {
                            a[(base + t) % LANES] += yrow[t] * xrow[span.at(t, sw)];
                        }
                    }
                }
            }
        }
        for (v, a) in dwo.iter_mut().zip(&acc) {
            *v = fold(*a);
        }
    }
}

/// Plain scalar loops computing each result in the order the module text defines: the
/// fast paths must give these bits.
pub mod reference {
    use super::{DepthwiseDims, LANES};

    fn at(n: usize, ch: usize, chans: usize, plane: [usize; 2], h: usize, w: usize) -> usize {
        ((n * chans + ch) * plane[0] + h) * plane[1] + w
    }

    /// The input position `(ih, iw)` output `(oh, ow)` reads at tap `(kh, kw)`, if inside.
    fn input_at(d: &DepthwiseDims, oh: usize, ow: usize, kh: usize, kw: usize) -> Option<(usize, usize)> {
        let ih = (oh * d.strides[0] + kh * d.dilations[0]) as i128 - d.pads[0] as i128;
        let iw = (ow * d.strides[1] + kw * d.dilations[1]) as i128 - d.pads[1] as i128;
        let inside = (0..d.input[0] as i128).contains(&ih) && (0..d.input[1] as i128).contains(&iw);
        inside.then_some((ih as usize, iw as usize))
    }

    /// `Y` (and `B` added last).
    pub fn forward(d: &DepthwiseDims, x: &[f32], w: &[f32], bias: Option<&[f32]>, y: &mut [f32]) {
        let (m, [kh_len, kw_len]) = (d.out_channels(), d.kernel);
        for n in 0..d.batch {
            for o in 0..m {
                for oh in 0..d.output[0] {
                    for ow in 0..d.output[1] {
                        let mut acc = 0f32;
                        for kh in 0..kh_len {
                            for kw in 0..kw_len {
                                if let Some((ih, iw)) = input_at(d, oh, ow, kh, kw) {
                                    let xv = x[at(n, o / d.mult, d.channels, d.input, ih, iw)];
                                    acc += w[(o * kh_len + kh) * kw_len + kw] * xv;
                                }
                            }
                        }
                        if let Some(b) = bias {
                            acc += b[o];
                        }
                        y[at(n, o, m, d.output, oh, ow)] = acc;
                    }
                }
            }
        }
    }

    /// `dX`: terms in `(j, kh, kw)` order.
    pub fn input_grad(d: &DepthwiseDims, dy: &[f32], w: &[f32], dx: &mut [f32]) {
        let (m, [kh_len, kw_len]) = (d.out_channels(), d.kernel);
        let source = |i: usize, k: usize, axis: usize| -> Option<usize> {
            let num = (i + d.pads[axis]) as i128 - (k * d.dilations[axis]) as i128;
            let s = d.strides[axis] as i128;
            (num >= 0 && num % s == 0 && num / s < d.output[axis] as i128).then_some((num / s) as usize)
        };
        for n in 0..d.batch {
            for c in 0..d.channels {
                for ih in 0..d.input[0] {
                    for iw in 0..d.input[1] {
                        let mut acc = 0f32;
                        for j in 0..d.mult {
                            let o = c * d.mult + j;
                            for kh in 0..kh_len {
                                for kw in 0..kw_len {
                                    if let (Some(oh), Some(ow)) = (source(ih, kh, 0), source(iw, kw, 1)) {
                                        let g = dy[at(n, o, m, d.output, oh, ow)];
                                        acc += w[(o * kh_len + kh) * kw_len + kw] * g;
                                    }
                                }
                            }
                        }
                        dx[at(n, c, d.channels, d.input, ih, iw)] = acc;
                    }
                }
            }
        }
    }

    /// `dW`: [`LANES`] partial sums per weight, term `(n, oh, ow)` in lane
    /// `(oh * vw + ow) % LANES`, then added 8, 4, 2, 1 apart.
    pub fn weight_grad(d: &DepthwiseDims, x: &[f32], dy: &[f32], dw: &mut [f32]) {
        let (m, [kh_len, kw_len]) = (d.out_channels(), d.kernel);
        for o in 0..m {
            for kh in 0..kh_len {
                for kw in 0..kw_len {
                    let vw = d.virtual_width();
                    let mut lanes = [0f32; LANES];
                    for n in 0..d.batch {
                        for oh in 0..d.output[0] {
                            for ow in 0..d.output[1] {
                                if let Some((ih, iw)) = input_at(d, oh, ow, kh, kw) {
                                    let g = dy[at(n, o, m, d.output, oh, ow)];
                                    let xv = x[at(n, o / d.mult, d.channels, d.input, ih, iw)];
                                    lanes[((oh % LANES) * (vw % LANES) + ow) % LANES] += g * xv;
                                }
                            }
                        }
                    }
                    let mut half = LANES / 2;
                    while half > 0 {
                        for l in 0..half {
                            lanes[l] += lanes[l + half];
                        }
                        half /= 2;
                    }
                    dw[(o * kh_len + kh) * kw_len + kw] = lanes[0];
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "depthwise_tests.rs"]
mod tests;
