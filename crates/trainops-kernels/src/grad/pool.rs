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

/// A spatial layout padded to 3 dimensions (leading dimensions of size 1).
fn pad3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut out = [fill; 3];
    out[3 - v.len()..].copy_from_slice(v);
    out
}

/// Per spatial dimension and output position, the range of window steps that land inside
/// the input (the same for every plane: worked out once per call).
type Spans = [Vec<(usize, usize)>; 3];

fn spans(inp: [usize; 3], out: [usize; 3], w: &[[usize; 3]; 4]) -> Spans {
    let [k, s, d, p] = w;
    let start = |a: usize, o: usize| (o * s[a]) as isize - p[a] as isize;
    core::array::from_fn(|a| {
        let inside = |o: usize, j: usize| (0..inp[a] as isize).contains(&(start(a, o) + (j * d[a]) as isize));
        (0..out[a])
            .map(|o| {
                let lo = (0..k[a]).find(|&j| inside(o, j)).unwrap_or(k[a]);
                let hi = (lo..k[a]).take_while(|&j| inside(o, j)).last().map_or(lo, |j| j + 1);
                (lo, hi)
            })
            .collect()
    })
}

/// One plane of [`max_pool_grad_from_input`]: each output element's argmax in its window
/// found as ONNX Runtime's MaxPool finds its `Indices` (scan in row-major window order,
/// starting below every finite value, taking a strictly greater one: the first of equal
/// maxima, NaN never), then `gy` added there.
fn argmax_plane(gy: &[f32], x: &[f32], gx: &mut [f32], inp: [usize; 3], w: &[[usize; 3]; 4], spans: &Spans) {
    let [_, s, d, p] = w;
    gx.fill(0.0);
    let start = |a: usize, o: usize| (o * s[a]) as isize - p[a] as isize;
    let mut j = 0;
    for (o0, &(lo0, hi0)) in spans[0].iter().enumerate() {
        for (o1, &(lo1, hi1)) in spans[1].iter().enumerate() {
            for (o2, &(lo2, hi2)) in spans[2].iter().enumerate() {
                let (mut best, mut at) = (f32::MIN, usize::MAX);
                for k0 in lo0..hi0 {
                    let i0 = (start(0, o0) + (k0 * d[0]) as isize) as usize;
                    for k1 in lo1..hi1 {
                        let i1 = (start(1, o1) + (k1 * d[1]) as isize) as usize;
                        let row = (i0 * inp[1] + i1) * inp[2];
                        let base = start(2, o2);
                        for k2 in lo2..hi2 {
                            let i = row + (base + (k2 * d[2]) as isize) as usize;
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
/// `window`'s lists); `planes = N * C`. Same bits as the `Indices` route.
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
    let lists = [&window.kernel, &window.strides, &window.dilations, &window.pad_begin];
    if !(1..=3).contains(&nd) || out_sp.len() != nd || lists.iter().any(|l| l.len() != nd) {
        return Err(PoolGradError::Length { what: "spatial dimensions", got: nd, expected: out_sp.len() });
    }
    let (inp, out) = (in_sp.iter().product::<usize>(), out_sp.iter().product::<usize>());
    for (what, buf, want) in
        [("gy", gy.len(), planes * out), ("x", x.len(), planes * inp), ("gx", gx.len(), planes * inp)]
    {
        if buf != want {
            return Err(PoolGradError::Length { what, got: buf, expected: want });
        }
    }
    if planes == 0 {
        return Ok(());
    }
    let w = [pad3(&window.kernel, 1), pad3(&window.strides, 1), pad3(&window.dilations, 1), pad3(&window.pad_begin, 0)];
    let (inp3, out3) = (pad3(in_sp, 1), pad3(out_sp, 1));
    let spans = spans(inp3, out3, &w);
    let per_plane = (out + inp).max(1);
    let work = WithInput { gy, x, gx, out, inp };
    run_chunked(vec![work], par, (CHUNK / per_plane).max(1), SERIAL_BELOW.div_ceil(per_plane), |p| {
        if p.inp == 0 {
            return;
        }
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

    #[test]
    fn bad_lengths_are_errors() {
        let w = Window { kernel: vec![2], strides: vec![2], dilations: vec![1], pad_begin: vec![0] };
        let mut gx = [0.0; 4];
        assert!(max_pool_grad_from_input(&[1.0; 2], &[0.0; 4], 1, &[4], &[2], &w, &mut gx, &Sequential).is_ok());
        assert!(max_pool_grad_from_input(&[1.0; 3], &[0.0; 4], 1, &[4], &[2], &w, &mut gx, &Sequential).is_err());
        assert!(max_pool_grad_from_input(&[1.0; 2], &[0.0; 4], 1, &[2, 2], &[2], &w, &mut gx, &Sequential).is_err());
    }
}
