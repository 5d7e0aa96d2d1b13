//! MaxPool's gradient: `gx = 0; gx[indices[i]] += gy[i]` for every output element `i`, where
//! `indices` is ONNX MaxPool's `Indices` output (`storage_order` 0: the flat index of the
//! chosen element in the whole input tensor). Overlapping windows add up.
//!
//! Output plane `p` (batch `n`, channel `c`) only ever points into input plane `p`, so the
//! planes are independent: the fast path runs groups of whole planes as tasks on the caller's
//! [`Parallelism`], each adding in the order of the reference, so the result equals the
//! scalar reference bit for bit. An index outside its own plane is an error (it cannot come
//! from MaxPool), reported for the first such element.

use std::sync::Mutex;

use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::shape::MAX_DIM;
use crate::Parallelism;

/// Why [`max_pool_grad`] refused its inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolGradError {
    /// A buffer's length does not fit the plane counts.
    Length {
        /// Which buffer (`indices`, `gy`, `gx`).
        what: &'static str,
        /// Its length.
        got: usize,
        /// What it must be.
        expected: usize,
    },
    /// A window attribute is malformed, or its arithmetic overflows.
    Window {
        /// The attribute (`kernel_shape`, `strides`, `dilations`, `pads`).
        name: &'static str,
        /// What is wrong, with the values.
        what: String,
    },
    /// The shapes do not fit the windows (or one another).
    Shape(String),
    /// `indices[position]` is not an element of the input plane its output element is in.
    Index {
        /// Flat position in `gy` / `indices`.
        position: usize,
        /// The index found there.
        index: i64,
        /// The plane's first flat input index.
        start: usize,
        /// One past the plane's last.
        end: usize,
    },
}

impl core::fmt::Display for PoolGradError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Length { what, got, expected } => write!(f, "{what} has {got} elements, expected {expected}"),
            Self::Window { name, what } => write!(f, "attribute '{name}': {what}"),
            Self::Shape(what) => f.write_str(what),
            Self::Index { position, index, start, end } => write!(
                f,
                "element {position} is {index}, outside its (batch, channel) plane of the input, [{start}, {end})"
            ),
        }
    }
}

impl std::error::Error for PoolGradError {}

/// Whole planes: `planes` output planes of `out` elements each, and their input planes.
struct Planes<'a> {
    gy: &'a [f32],
    indices: &'a [i64],
    gx: &'a mut [f32],
    first: usize,
    out: usize,
    inp: usize,
}

impl Splittable for Planes<'_> {
    fn len(&self) -> usize {
        self.gx.len().checked_div(self.inp).unwrap_or(0).max(self.gy.len().checked_div(self.out).unwrap_or(0))
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (gy0, gy1) = self.gy.split_at(mid * self.out);
        let (i0, i1) = self.indices.split_at(mid * self.out);
        let (gx0, gx1) = self.gx.split_at_mut(mid * self.inp);
        let (out, inp) = (self.out, self.inp);
        (
            Planes { gy: gy0, indices: i0, gx: gx0, first: self.first, out, inp },
            Planes { gy: gy1, indices: i1, gx: gx1, first: self.first + mid, out, inp },
        )
    }
}

impl Planes<'_> {
    /// Zeroes the input planes and adds every gradient in; the first bad element's error.
    fn run(self) -> Result<(), PoolGradError> {
        self.gx.fill(0.0);
        if self.out == 0 {
            return Ok(());
        }
        let planes = self.gy.chunks_exact(self.out).zip(self.indices.chunks_exact(self.out));
        for (k, (gx, (gy, idx))) in self.gx.chunks_exact_mut(self.inp.max(1)).zip(planes).enumerate() {
            let p = self.first + k;
            let start = p * self.inp;
            for (j, (&g, &i)) in gy.iter().zip(idx).enumerate() {
                // One unsigned compare catches both ends (a negative index wraps high).
                let local = (i as u64).wrapping_sub(start as u64);
                if local >= self.inp as u64 {
                    return Err(PoolGradError::Index {
                        position: p * self.out + j,
                        index: i,
                        start,
                        end: start + self.inp,
                    });
                }
                gx[local as usize] += g;
            }
        }
        if self.inp == 0 && !self.gy.is_empty() {
            let (p, start) = (self.first, self.first * self.inp);
            return Err(PoolGradError::Index { position: p * self.out, index: self.indices[0], start, end: start });
        }
        Ok(())
    }
}

fn check(gy: &[f32], indices: &[i64], planes: usize, gx: &[f32]) -> Result<(usize, usize), PoolGradError> {
    if indices.len() != gy.len() {
        return Err(PoolGradError::Length { what: "indices", got: indices.len(), expected: gy.len() });
    }
    let out = gy.len().checked_div(planes).unwrap_or(0);
    let inp = gx.len().checked_div(planes).unwrap_or(0);
    // out * planes <= gy.len() and inp * planes <= gx.len(): no overflow.
    if out * planes != gy.len() {
        return Err(PoolGradError::Length { what: "gy", got: gy.len(), expected: out * planes });
    }
    if inp * planes != gx.len() {
        return Err(PoolGradError::Length { what: "gx", got: gx.len(), expected: inp * planes });
    }
    Ok((out, inp))
}

/// MaxPool's gradient into `gx` (the input's `N*C` planes of `gx.len() / planes` elements),
/// from `gy` and `indices` (`planes` output planes of `gy.len() / planes` elements).
pub fn max_pool_grad(
    gy: &[f32],
    indices: &[i64],
    planes: usize,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), PoolGradError> {
    let (out, inp) = check(gy, indices, planes, gx)?;
    if planes == 0 {
        return Ok(());
    }
    // Work is counted in planes: a task holds about CHUNK elements of gy and gx together.
    let per_plane = (out + inp).max(1);
    let chunk = (CHUNK / per_plane).max(1);
    let serial_below = SERIAL_BELOW.div_ceil(per_plane);
    let first_error: Mutex<Option<PoolGradError>> = Mutex::new(None);
    let work = Planes { gy, indices, gx, first: 0, out, inp };
    run_chunked(vec![work], par, chunk, serial_below, |w| {
        if let Err(e) = w.run() {
            let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
            let earlier = |a: &PoolGradError, b: &PoolGradError| match (a, b) {
                (PoolGradError::Index { position: x, .. }, PoolGradError::Index { position: y, .. }) => x < y,
                _ => false,
            };
            if slot.as_ref().is_none_or(|s| earlier(&e, s)) {
                *slot = Some(e);
            }
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The plain scalar reference, straight from the definition, for the tests.
pub mod reference {
    /// `gx` of `len` zeros with `gy[i]` added at `indices[i]`, in order; `None` for an index
    /// outside `0..len` (the reference does not check planes).
    pub fn max_pool_grad(gy: &[f32], indices: &[i64], len: usize) -> Option<Vec<f32>> {
        let mut gx = vec![0.0f32; len];
        for (&g, &i) in gy.iter().zip(indices) {
            *gx.get_mut(usize::try_from(i).ok()?)? += g;
        }
        Some(gx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::uniform;
    use crate::{RayonPool, Sequential};

    /// Indices as MaxPool would make them for random windows: each output element of plane
    /// `p` points at a random element of input plane `p` (repeats included: overlap).
    fn case(planes: usize, out: usize, inp: usize, seed: u64) -> (Vec<f32>, Vec<i64>) {
        let mut u = uniform(seed);
        let gy = (0..planes * out).map(|_| (u() * 8.0) as f32).collect();
        let idx = (0..planes * out)
            .map(|k| ((k / out) * inp + ((u() + 0.5) * inp as f64) as usize % inp.max(1)) as i64)
            .collect();
        (gy, idx)
    }

    #[test]
    fn equals_reference_bit_for_bit() {
        let shapes =
            [(0, 0, 0), (1, 1, 1), (1, 0, 4), (3, 1, 4), (2, 7, 9), (5, 16, 64), (64, 256, 1024), (7, 4096, 16384)];
        for (seed, &(planes, out, inp)) in shapes.iter().enumerate() {
            let (gy, idx) = case(planes, out, inp, seed as u64);
            let want = reference::max_pool_grad(&gy, &idx, planes * inp).unwrap();
            for par in [&Sequential as &dyn Parallelism, &RayonPool(None)] {
                let mut gx = vec![f32::NAN; planes * inp];
                max_pool_grad(&gy, &idx, planes, &mut gx, par).unwrap();
                let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(b(&gx), b(&want), "{planes}x{out}->{inp}");
            }
        }
    }

    #[test]
    fn overlapping_windows_add() {
        // 1-D, kernel 3, stride 1 over [1, 5, 2, 4]: maxima at 1, 1 -> gx[1] = gy0 + gy1.
        let mut gx = [9.0; 4];
        max_pool_grad(&[0.5, 0.25], &[1, 1], 1, &mut gx, &Sequential).unwrap();
        assert_eq!(gx, [0.0, 0.75, 0.0, 0.0]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut gx = [0.0; 8];
        // Plane 1 is [4, 8): index 3 belongs to plane 0.
        let e = max_pool_grad(&[1.0, 1.0], &[0, 3], 2, &mut gx, &Sequential).unwrap_err();
        assert_eq!(e, PoolGradError::Index { position: 1, index: 3, start: 4, end: 8 });
        assert!(max_pool_grad(&[1.0, 1.0], &[0, -1], 1, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad(&[1.0, 1.0], &[0], 1, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad(&[1.0, 1.0, 1.0], &[0, 1, 2], 2, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad(&[1.0], &[0], 1, &mut [], &Sequential).is_err());
        // Many tasks, several bad: the first is reported.
        let (gy, mut idx) = case(64, 256, 1024, 9);
        idx[12_000] = -5;
        idx[3_000] = 1 << 40;
        let mut gx = vec![0.0; 64 * 1024];
        let e = max_pool_grad(&gy, &idx, 64, &mut gx, &RayonPool(None)).unwrap_err();
        assert!(matches!(e, PoolGradError::Index { position: 3_000, .. }), "{e}");
    }
}

/// A MaxPool's windows, per spatial dimension (at most 3): for output position `o`, the
/// input positions `o * stride + j * dilation - pad_begin`, `j < kernel`, those inside the
/// input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// Window size.
    pub kernel: Vec<usize>,
    /// Step between windows.
    pub strides: Vec<usize>,
    /// Step inside a window.
    pub dilations: Vec<usize>,
    /// Padding before the first element.
    pub pad_begin: Vec<usize>,
}

fn window_error(name: &'static str, what: String) -> PoolGradError {
    PoolGradError::Window { name, what }
}

impl Window {
    /// Checks 1 to 3 spatial dimensions, one value per dimension in every list, kernel
    /// sizes, strides and dilations positive, every value at most `2^63 - 1`; the error
    /// names the attribute.
    pub fn check(&self) -> Result<(), PoolGradError> {
        let n = self.kernel.len();
        if !(1..=3).contains(&n) {
            return Err(window_error("kernel_shape", format!("expected 1 to 3 sizes, got {:?}", self.kernel)));
        }
        for (name, list, min) in [
            ("kernel_shape", &self.kernel, 1),
            ("strides", &self.strides, 1),
            ("dilations", &self.dilations, 1),
            ("pads", &self.pad_begin, 0),
        ] {
            if list.len() != n || list.iter().any(|&v| v < min || v > MAX_DIM) {
                let what = format!("expected {n} values in [{min}, 2^63 - 1], got {list:?}");
                return Err(window_error(name, what));
            }
        }
        Ok(())
    }

    /// The output sizes MaxPool gives over input sizes `in_sp` with end pads `pad_end`: per
    /// dimension, `(floor, ceil)` for `ceil_mode` 0 and 1 (ONNX's formula; a runtime that
    /// drops a last window starting in the end padding gives `floor` where `ceil` would
    /// exceed it by one). Every step is overflow-checked; a dilated window larger than the
    /// padded input is an error, as it is for MaxPool.
    pub fn output_sizes(&self, pad_end: &[usize], in_sp: &[usize]) -> Result<Vec<(usize, usize)>, PoolGradError> {
        self.check()?;
        let n = self.kernel.len();
        if pad_end.len() != n || pad_end.iter().any(|&v| v > MAX_DIM) {
            let what = format!(
                "expected {} values in [0, 2^63 - 1], got {:?}",
                2 * n,
                [&self.pad_begin[..], pad_end].concat()
            );
            return Err(window_error("pads", what));
        }
        if in_sp.len() != n {
            let what = format!("the input has {} spatial dimensions, kernel_shape {n}", in_sp.len());
            return Err(PoolGradError::Shape(what));
        }
        (0..n)
            .map(|j| {
                let (pb, pe) = (self.pad_begin[j], pad_end[j]);
                let padded = in_sp[j].checked_add(pb).and_then(|v| v.checked_add(pe)).filter(|&v| v <= MAX_DIM);
                let padded = padded.ok_or_else(|| {
                    let what =
                        format!("dimension {j}: the input ({}) padded by {pb} + {pe} exceeds 2^63 - 1", in_sp[j]);
                    window_error("pads", what)
                })?;
                let (k, d) = (self.kernel[j], self.dilations[j]);
                let window = (k - 1).checked_mul(d).filter(|&v| v < MAX_DIM).ok_or_else(|| {
                    let what = format!("dimension {j}: the dilated window (({k} - 1) * {d} + 1) exceeds 2^63 - 1");
                    window_error("dilations", what)
                })? + 1;
                let span = padded.checked_sub(window).ok_or_else(|| {
                    PoolGradError::Shape(format!(
                        "dimension {j}: the window (kernel {k}, dilation {d}: {window} elements) is larger than the \
                         padded input ({} + {pb} + {pe} = {padded})",
                        in_sp[j]
                    ))
                })?;
                let s = self.strides[j];
                Ok((span / s + 1, span.div_ceil(s) + 1))
            })
            .collect()
    }
}

/// Checks that `out_sp` is an output MaxPool with `window` and end pads `pad_end` can give
/// over `in_sp`: with `ceil_mode` `Some(false)` the floor sizes, `Some(true)` the ceil sizes
/// (or the floor where a runtime drops a last window starting in the padding), `None`
/// either, per dimension. The error says which sizes were possible (the caller adds what it
/// got).
pub fn check_pooled(
    window: &Window,
    pad_end: &[usize],
    in_sp: &[usize],
    out_sp: &[usize],
    ceil_mode: Option<bool>,
) -> Result<(), PoolGradError> {
    let sizes = window.output_sizes(pad_end, in_sp)?;
    let fits = out_sp.len() == sizes.len()
        && out_sp.iter().zip(&sizes).zip(in_sp).zip(&window.pad_begin).zip(&window.strides).all(
            |((((&o, &(floor, ceil)), &inp), &pb), &s)| match ceil_mode {
                Some(false) => o == floor,
                // A last window must start inside the input or its begin padding (ONNX
                // Runtime drops one that starts in the end padding).
                Some(true) => o == ceil || (o == floor && (ceil - 1).saturating_mul(s) >= inp.saturating_add(pb)),
                None => o == floor || o == ceil,
            },
        );
    if fits {
        return Ok(());
    }
    let floor: Vec<usize> = sizes.iter().map(|s| s.0).collect();
    let ceil: Vec<usize> = sizes.iter().map(|s| s.1).collect();
    let want = match ceil_mode {
        Some(false) => format!("{floor:?} (ceil_mode 0)"),
        Some(true) => format!("{ceil:?} (ceil_mode 1)"),
        None if floor == ceil => format!("{floor:?}"),
        None => format!("{floor:?} (ceil_mode 0) or {ceil:?} (ceil_mode 1), per dimension"),
    };
    Err(PoolGradError::Shape(format!("spatial sizes {want} (MaxPool's output over the input's {in_sp:?})")))
}

/// A spatial layout padded to 3 dimensions (leading dimensions of size 1).
fn pad3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut out = [fill; 3];
    out[3 - v.len()..].copy_from_slice(v);
    out
}

/// Per spatial dimension and output position, the range of window steps that land inside
/// the input and the input position of the first (the same for every plane: worked out
/// once per call).
type Spans = [Vec<(usize, usize, usize)>; 3];

/// [`Spans`] in closed form, in `i128` (values up to `2^63 - 1` cannot overflow it): a
/// window's first step inside the input is `ceil(-start / d)`, its first past the input's
/// end `ceil((in - start) / d)`, both clamped to `[0, k]`.
fn spans(inp: [usize; 3], out: [usize; 3], w: &[[usize; 3]; 4]) -> Spans {
    let [k, s, d, p] = w;
    let ceil_div = |a: i128, b: i128| if a <= 0 { 0 } else { (a + b - 1) / b };
    core::array::from_fn(|a| {
        let (k, d, i) = (k[a] as i128, d[a] as i128, inp[a] as i128);
        (0..out[a])
            .map(|o| {
                let start = (o as i128) * (s[a] as i128) - p[a] as i128;
                let lo = ceil_div(-start, d).min(k);
                let hi = ceil_div(i - start, d).min(k);
                if lo < hi {
                    // Inside the input: fits usize.
                    (lo as usize, hi as usize, (start + lo * d) as usize)
                } else {
                    (0, 0, 0)
                }
            })
            .collect()
    })
}

/// One plane of [`max_pool_grad_from_input`]: each output element's argmax in its window
/// found as ONNX Runtime's MaxPool finds its `Indices` (scan in row-major window order,
/// starting below every finite value, taking a strictly greater one: the first of equal
/// maxima, NaN never), then `gy` added there.
fn argmax_plane(gy: &[f32], x: &[f32], gx: &mut [f32], inp: [usize; 3], w: &[[usize; 3]; 4], spans: &Spans) {
    let [_, _, d, _] = w;
    gx.fill(0.0);
    let mut j = 0;
    for &(lo0, hi0, first0) in &spans[0] {
        for &(lo1, hi1, first1) in &spans[1] {
            for &(lo2, hi2, first2) in &spans[2] {
                let (mut best, mut at) = (f32::MIN, usize::MAX);
                for k0 in lo0..hi0 {
                    let i0 = first0 + (k0 - lo0) * d[0];
                    for k1 in lo1..hi1 {
                        let i1 = first1 + (k1 - lo1) * d[1];
                        let row = (i0 * inp[1] + i1) * inp[2];
                        for k2 in lo2..hi2 {
                            let i = row + first2 + (k2 - lo2) * d[2];
                            let v = x[i];
                            // Branch-free: random data would mispredict a branch half the time.
                            let better = v > best;
                            best = if better { v } else { best };
                            at = if better { i } else { at };
                        }
                    }
                }
                if let Some(g) = gx.get_mut(at) {
                    *g += gy[j];
                }
                j += 1;
            }
        }
    }
}

/// MaxPool's gradient from its input `x` (no `Indices`): `gx = 0`, then each `gy` element
/// added at its window's maximum, chosen as ONNX Runtime's MaxPool chooses its `Indices`
/// (the first of equal maxima in row-major window order; a window of only NaN and `-inf`
/// gets none). `in_sp` / `out_sp`: the spatial sizes of `x` and `gy` (1 to 3 dimensions, as
/// `window`'s lists, [checked](Window::check); that `out_sp` is MaxPool's output over
/// `in_sp` is the caller's to check, with [`check_pooled`]: any sizes are safe here); `planes
/// = N * C`. Same bits as the `Indices` route.
#[allow(clippy::too_many_arguments)]
pub fn max_pool_grad_from_input(
    gy: &[f32],
    x: &[f32],
    planes: usize,
    in_sp: &[usize],
    out_sp: &[usize],
    window: &Window,
    gx: &mut [f32],
    par: &dyn Parallelism,
) -> Result<(), PoolGradError> {
    let nd = in_sp.len();
    window.check()?;
    if nd != window.kernel.len() || out_sp.len() != nd {
        return Err(PoolGradError::Length { what: "spatial dimensions", got: nd, expected: window.kernel.len() });
    }
    let count = |what: &'static str, dims: &[usize]| {
        crate::shape::count(what, dims).map_err(|e| PoolGradError::Shape(e.to_string()))
    };
    let (inp, out) = (count("x's planes", in_sp)?, count("gy's planes", out_sp)?);
    for (what, buf, want) in [("gy", gy.len(), out), ("x", x.len(), inp), ("gx", gx.len(), inp)] {
        let want = want.checked_mul(planes).ok_or_else(|| PoolGradError::Shape(format!("{what}: size overflow")))?;
        if buf != want {
            return Err(PoolGradError::Length { what, got: buf, expected: want });
        }
    }
    if planes == 0 || inp == 0 {
        // No planes, or planes of no element (x and gx empty; any gy has nowhere to go).
        return Ok(());
    }
    if out == 0 {
        gx.fill(0.0);
        return Ok(());
    }
    let w = [pad3(&window.kernel, 1), pad3(&window.strides, 1), pad3(&window.dilations, 1), pad3(&window.pad_begin, 0)];
    let (inp3, out3) = (pad3(in_sp, 1), pad3(out_sp, 1));
    let spans = spans(inp3, out3, &w);
    let per_plane = (out + inp).max(1);
    let work = WithInput { gy, x, gx, out, inp };
    run_chunked(vec![work], par, (CHUNK / per_plane).max(1), SERIAL_BELOW.div_ceil(per_plane), |p| {
        let planes = p.gy.chunks_exact(p.out.max(1)).zip(p.x.chunks_exact(p.inp));
        for (gx, (gy, x)) in p.gx.chunks_exact_mut(p.inp).zip(planes) {
            argmax_plane(gy, x, gx, inp3, &w, &spans);
        }
    });
    Ok(())
}

/// Whole planes of [`max_pool_grad_from_input`].
struct WithInput<'a> {
    gy: &'a [f32],
    x: &'a [f32],
    gx: &'a mut [f32],
    out: usize,
    inp: usize,
}

impl Splittable for WithInput<'_> {
    fn len(&self) -> usize {
        self.gx.len().checked_div(self.inp).unwrap_or(0)
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (gy0, gy1) = self.gy.split_at(mid * self.out);
        let (x0, x1) = self.x.split_at(mid * self.inp);
        let (gx0, gx1) = self.gx.split_at_mut(mid * self.inp);
        let (out, inp) = (self.out, self.inp);
        (WithInput { gy: gy0, x: x0, gx: gx0, out, inp }, WithInput { gy: gy1, x: x1, gx: gx1, out, inp })
    }
}

#[cfg(test)]
mod from_input_tests {
    use super::*;
    use crate::test_util::uniform;
    use crate::{RayonPool, Sequential};

    /// A 2-D reference written apart: ORT's MaxPool2D loop (hstart, clipped ends), its
    /// Indices, then the scatter of the reference above.
    fn reference_2d(
        gy: &[f32],
        x: &[f32],
        planes: usize,
        hw: (usize, usize),
        ohw: (usize, usize),
        w: &Window,
    ) -> Vec<f32> {
        let (h, wd) = hw;
        let mut idx = Vec::new();
        for p in 0..planes {
            for ph in 0..ohw.0 {
                for pw in 0..ohw.1 {
                    let hs = (ph * w.strides[0]) as i64 - w.pad_begin[0] as i64;
                    let ws = (pw * w.strides[1]) as i64 - w.pad_begin[1] as i64;
                    let (mut best, mut at) = (f32::MIN, -1i64);
                    for kh in 0..w.kernel[0] as i64 {
                        for kw in 0..w.kernel[1] as i64 {
                            let (hh, ww) = (hs + kh * w.dilations[0] as i64, ws + kw * w.dilations[1] as i64);
                            if (0..h as i64).contains(&hh) && (0..wd as i64).contains(&ww) {
                                let i = (p * h * wd) as i64 + hh * wd as i64 + ww;
                                if x[i as usize] > best {
                                    best = x[i as usize];
                                    at = i;
                                }
                            }
                        }
                    }
                    idx.push(at);
                }
            }
        }
        if idx.iter().all(|&i| i >= 0) {
            return reference::max_pool_grad(gy, &idx, planes * h * wd).unwrap();
        }
        // A window of only NaN and -inf chose nothing: its gradient goes nowhere.
        let mut gx = vec![0f32; planes * h * wd];
        for (g, &i) in gy.iter().zip(&idx) {
            if let Ok(i) = usize::try_from(i) {
                gx[i] += g;
            }
        }
        gx
    }

    #[test]
    fn equals_the_indices_route_with_ties_and_padding() {
        let cases = [
            (3, (8, 8), [2, 2], [2, 2], [1, 1], [0, 0]),
            (2, (9, 7), [3, 3], [1, 1], [1, 1], [1, 1]),
            (4, (11, 9), [2, 3], [2, 1], [2, 1], [1, 0]),
            (64, (16, 16), [3, 3], [2, 2], [1, 1], [1, 1]),
            // 2x2 stride 2: odd grids leave a row / column out; tiny grids; with padding.
            (5, (9, 7), [2, 2], [2, 2], [1, 1], [0, 0]),
            (3, (2, 2), [2, 2], [2, 2], [1, 1], [0, 0]),
            (2, (3, 5), [2, 2], [2, 2], [1, 1], [0, 0]),
            (2, (6, 6), [2, 2], [2, 2], [1, 1], [1, 1]),
        ];
        for (seed, &(planes, (h, wd), k, s, d, p)) in cases.iter().enumerate() {
            let w = Window { kernel: k.to_vec(), strides: s.to_vec(), dilations: d.to_vec(), pad_begin: p.to_vec() };
            let oh = (h + 2 * p[0] - (k[0] - 1) * d[0] - 1) / s[0] + 1;
            let ow = (wd + 2 * p[1] - (k[1] - 1) * d[1] - 1) / s[1] + 1;
            let mut u = uniform(seed as u64);
            // Relu-like data: many exact zeros, so windows tie.
            let x: Vec<f32> = (0..planes * h * wd).map(|_| (u() as f32).max(0.0)).collect();
            let gy: Vec<f32> = (0..planes * oh * ow).map(|_| u() as f32).collect();
            let want = reference_2d(&gy, &x, planes, (h, wd), (oh, ow), &w);
            for par in [&Sequential as &dyn Parallelism, &RayonPool(None)] {
                let mut gx = vec![f32::NAN; x.len()];
                max_pool_grad_from_input(&gy, &x, planes, &[h, wd], &[oh, ow], &w, &mut gx, par).unwrap();
                assert_eq!(
                    gx.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    /// 2x2 windows on NaN, infinities, `f32::MIN` and signed zeros (ties, windows
    /// that choose nothing, -0.0 gradients) against the reference, bit for bit.
    #[test]
    fn special_values_match_the_reference() {
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, f32::MIN, -0.0, 0.0, 1.0, -1.0];
        let (planes, h, wd) = (4, 6, 8);
        let mut u = uniform(7);
        let pick = |u: &mut dyn FnMut() -> f64| specials[((u() + 0.5) * 8.0) as usize % specials.len()];
        let x: Vec<f32> = (0..planes * h * wd).map(|_| pick(&mut u)).collect();
        let gy: Vec<f32> = (0..planes * 12).map(|_| pick(&mut u)).collect();
        let w = Window { kernel: vec![2, 2], strides: vec![2, 2], dilations: vec![1, 1], pad_begin: vec![0, 0] };
        let want = reference_2d(&gy, &x, planes, (h, wd), (3, 4), &w);
        let mut gx = vec![f32::NAN; x.len()];
        max_pool_grad_from_input(&gy, &x, planes, &[h, wd], &[3, 4], &w, &mut gx, &Sequential).unwrap();
        assert_eq!(
            gx.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// The pooled output's shape is MaxPool's: more windows than it can give (a
    /// `[1, 2, 3, 2]` gradient for a 4x4 input, kernel 2, stride 2) are refused, naming the
    /// sizes it can give.
    #[test]
    fn only_maxpools_output_sizes_pass() {
        let w = Window { kernel: vec![2, 2], strides: vec![2, 2], dilations: vec![1, 1], pad_begin: vec![0, 0] };
        assert!(check_pooled(&w, &[0, 0], &[4, 4], &[2, 2], None).is_ok());
        let e = check_pooled(&w, &[0, 0], &[4, 4], &[3, 2], None).unwrap_err();
        assert_eq!(e, PoolGradError::Shape("spatial sizes [2, 2] (MaxPool's output over the input's [4, 4])".into()));
        // 5x5, kernel 2, stride 2: 2 windows (floor) or 3 (ceil_mode).
        assert!(check_pooled(&w, &[0, 0], &[5, 5], &[3, 2], None).is_ok());
        assert!(check_pooled(&w, &[0, 0], &[5, 5], &[3, 3], Some(true)).is_ok());
        let e = check_pooled(&w, &[0, 0], &[5, 5], &[3, 3], Some(false)).unwrap_err().to_string();
        assert!(e.starts_with("spatial sizes [2, 2] (ceil_mode 0) (MaxPool"), "{e}");
        let e = check_pooled(&w, &[0, 0], &[5, 5], &[4, 2], None).unwrap_err().to_string();
        assert!(e.contains("[2, 2] (ceil_mode 0) or [3, 3] (ceil_mode 1)"), "{e}");
        // ceil_mode's last window starting in the end padding: ONNX Runtime drops it.
        let w1 = Window { kernel: vec![2], strides: vec![2], dilations: vec![1], pad_begin: vec![1] };
        assert_eq!(w1.output_sizes(&[2], &[4]).unwrap(), vec![(3, 4)]);
        assert!(check_pooled(&w1, &[2], &[4], &[3], Some(true)).is_ok());
        assert!(check_pooled(&w1, &[2], &[4], &[4], Some(true)).is_ok());
        // Without that, ceil_mode 1 is the ceil sizes only.
        assert!(check_pooled(&w, &[0, 0], &[5, 5], &[2, 3], Some(true)).is_err());
        // A window larger than the padded input: as MaxPool, an error.
        let e = check_pooled(&w, &[0, 0], &[1, 4], &[1, 2], None).unwrap_err().to_string();
        assert!(e.contains("larger than the padded input"), "{e}");
    }

    /// Attributes up to 2^63 - 1: their arithmetic is checked, the windows found in closed
    /// form (a search over 2^40 kernel steps would not end), and what is left is exact.
    #[test]
    fn huge_attributes_are_checked_or_exact() {
        const BIG: usize = 1 << 62;
        let w = Window { kernel: vec![2, 2], strides: vec![1, 1], dilations: vec![1, 1], pad_begin: vec![BIG, 0] };
        let e = w.output_sizes(&[BIG, 0], &[4, 4]).unwrap_err();
        assert_eq!(
            e,
            PoolGradError::Window {
                name: "pads",
                what: format!("dimension 0: the input (4) padded by {BIG} + {BIG} exceeds 2^63 - 1"),
            }
        );
        let w = Window { kernel: vec![5, 2], strides: vec![1, 1], dilations: vec![BIG, 1], pad_begin: vec![0, 0] };
        assert!(matches!(w.output_sizes(&[0, 0], &[4, 4]), Err(PoolGradError::Window { name: "dilations", .. })));
        assert!(matches!(
            Window { kernel: vec![2], strides: vec![usize::MAX], dilations: vec![1], pad_begin: vec![0] }.check(),
            Err(PoolGradError::Window { name: "strides", .. })
        ));
        // A kernel of 2^40 steps whose windows hold the whole input once: pads 2^40 each
        // side, stride 2^41: one window, the input's argmax.
        let big = 1usize << 40;
        let w = Window { kernel: vec![big], strides: vec![2 * big], dilations: vec![1], pad_begin: vec![big - 2] };
        assert_eq!(w.output_sizes(&[big], &[4]).unwrap(), vec![(1, 2)]);
        let x = [1.0f32, 5.0, 3.0, 4.0];
        let mut gx = [f32::NAN; 4];
        max_pool_grad_from_input(&[2.0], &x, 1, &[4], &[1], &w, &mut gx, &Sequential).unwrap();
        assert_eq!(gx, [0.0, 2.0, 0.0, 0.0]);
        // Windows past the input's end get no gradient; any output size is safe.
        let w = Window { kernel: vec![2], strides: vec![BIG], dilations: vec![BIG], pad_begin: vec![0] };
        let mut gx = [f32::NAN; 4];
        max_pool_grad_from_input(&[1.0, 7.0, 9.0], &x, 1, &[4], &[3], &w, &mut gx, &Sequential).unwrap();
        assert_eq!(gx, [1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let w = Window { kernel: vec![2], strides: vec![2], dilations: vec![1], pad_begin: vec![0] };
        let mut gx = [0.0; 4];
        assert!(max_pool_grad_from_input(&[1.0; 2], &[0.0; 4], 1, &[4], &[2], &w, &mut gx, &Sequential).is_ok());
        assert!(max_pool_grad_from_input(&[1.0; 3], &[0.0; 4], 1, &[4], &[2], &w, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad_from_input(&[1.0; 2], &[0.0; 4], 1, &[2, 2], &[2], &w, &mut gx, &Sequential).is_err());
    }
}
