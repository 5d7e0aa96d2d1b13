//! `PhiloxDropout` in training mode: `keep[i] = f32(word(i)) >= ratio` (compared in float64),
//! `output[i] = (data[i] * scale) * (keep[i] ? 1 : 0)` with `scale = 1 / (1 - ratio)`, in
//! float32 for float32 and 16-bit data (rounded once for the latter), float64 for double.
//! The arithmetic is plain IEEE: a dropped negative value gives -0.0, a dropped NaN or
//! infinity gives NaN. With ratio 0 nothing is dropped and the scale is 1: the output is the
//! data itself (copied, a signaling NaN as it is), and no word is drawn, the state still
//! advancing past one word per element.
//!
//! Since `f32(x)` is `(x & 0x7FFFFF) / 2^23`, the comparison is the integer one
//! `(x & 0x7FFFFF) >= ceil(ratio * 2^23)` ([`keep_from`]), which the SIMD loops use.

use half::{bf16, f16};

/// The bits of a word that make its float32 uniform.
pub use super::convert::MANTISSA;
use super::convert::{dropout_scalar, f32_of, Half};
use super::draw::{for_each_sub, split, streams, Sink, Words};
use super::philox::{self, reference as philox_ref, Level, Stores};
use crate::parallel::Splittable;
use crate::simd::Isa;
use crate::stream::Access;
use crate::{InOut, KernelError, Parallelism};

/// `ceil(ratio * 2^23)` within `[0, 2^23]`: `f32(x) >= ratio` exactly when
/// `x & MANTISSA >= keep_from(ratio)`, for any ratio in `[0, 1)` (the scaling is exact).
pub fn keep_from(ratio: f64) -> u32 {
    let t = (ratio * f64::from(1u32 << 23)).ceil();
    if t.is_nan() {
        0
    } else {
        t.clamp(0.0, f64::from(1u32 << 23)) as u32
    }
}

/// The scale of kept float32 and 16-bit elements, `1 / (1 - ratio)` in float32 (the device
/// kernels are given this value).
pub fn scale_f32(ratio: f64) -> f32 {
    1.0f32 / (1.0f32 - ratio as f32)
}

/// The data of a dropout: read, then written (in place or to a separate buffer).
pub enum Data<'a> {
    /// float
    F32(InOut<'a, f32>),
    /// double
    F64(InOut<'a, f64>),
    /// float16
    F16(InOut<'a, f16>),
    /// bfloat16
    BF16(InOut<'a, bf16>),
}

impl Data<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(d) => d.len(),
            Data::F64(d) => d.len(),
            Data::F16(d) => d.len(),
            Data::BF16(d) => d.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One piece of a dropout: data and, when wanted, the mask.
struct Work<'a, T> {
    data: InOut<'a, T>,
    mask: Option<&'a mut [bool]>,
    /// Whether the data output and the mask stream (decided on the whole tensors).
    stream: (bool, bool),
}

impl<T: Copy + Send + Sync> Splittable for Work<'_, T> {
    fn len(&self) -> usize {
        self.data.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.data.split_at(mid);
        let (ma, mb) = match self.mask {
            Some(m) => {
                let (x, y) = m.split_at_mut(mid);
                (Some(x), Some(y))
            }
            None => (None, None),
        };
        (Work { data: a, mask: ma, stream: self.stream }, Work { data: b, mask: mb, stream: self.stream })
    }
}

/// Not training: `output = data`, `mask` all true; no words consumed.
pub fn pass_through(data: Data<'_>, mask: Option<&mut [bool]>) -> Result<(), KernelError> {
    check_mask(&data, mask.as_deref())?;
    fn copy<T: Copy>(mut d: InOut<'_, T>) {
        if let Access::Split(src, dst) = d.access() {
            dst.copy_from_slice(src);
        }
    }
    match data {
        Data::F32(d) => copy(d),
        Data::F64(d) => copy(d),
        Data::F16(d) => copy(d),
        Data::BF16(d) => copy(d),
    }
    if let Some(m) = mask {
        m.fill(true);
    }
    Ok(())
}

fn check_mask(data: &Data<'_>, mask: Option<&[bool]>) -> Result<(), KernelError> {
    match mask {
        Some(m) if m.len() != data.len() => {
            Err(KernelError::LengthMismatch { what: "mask", got: m.len(), expected: data.len() })
        }
        _ => Ok(()),
    }
}

/// Training-mode dropout at the [`philox::detected`] level; returns the next state.
/// `ratio` must be in `[0, 1)` (the caller checks; others are clamped to keep-all/drop-all).
pub fn fill(
    state: &[u32; 6],
    ratio: f64,
    data: Data<'_>,
    mask: Option<&mut [bool]>,
    par: &dyn Parallelism,
) -> Result<[u32; 6], KernelError> {
    fill_with(philox::detected(), state, ratio, data, mask, par)
}

/// [`fill`] at a given level.
///
/// # Panics
///
/// When `level` is not available on this CPU.
pub fn fill_with(
    level: Level,
    state: &[u32; 6],
    ratio: f64,
    data: Data<'_>,
    mask: Option<&mut [bool]>,
    par: &dyn Parallelism,
) -> Result<[u32; 6], KernelError> {
    check_mask(&data, mask.as_deref())?;
    let isa = level.isa().unwrap_or_else(|| panic!("dropout: {level:?} is not available on this CPU"));
    let from = keep_from(ratio);
    if from == 0 {
        // Ratio 0 (torch's default `nn.Dropout(p=0.0)`, exported in training mode): every
        // element is kept and the scale is 1, so the output is the data; the words are not
        // drawn, the state advances past them all the same.
        return Ok(match data {
            Data::F32(d) => keep_all(state, work(isa, d, mask), par),
            Data::F64(d) => keep_all(state, work(isa, d, mask), par),
            Data::F16(d) => keep_all(state, work(isa, d, mask), par),
            Data::BF16(d) => keep_all(state, work(isa, d, mask), par),
        });
    }
    let scale32 = scale_f32(ratio);
    Ok(match data {
        Data::F32(d) => split(state, work(isa, d, mask), Words::One, 0, par, |s, w| {
            piece(level, isa, s, w, from, |words, d| drop_f32(isa, words, d, from, scale32))
        }),
        Data::F64(d) => {
            let scale = 1.0 / (1.0 - ratio);
            split(state, work(isa, d, mask), Words::One, 0, par, |s, w| {
                piece(level, isa, s, w, from, |words, d| drop_f64(isa, words, d, from, scale))
            })
        }
        Data::F16(d) => {
            split(state, work(isa, d, mask), Words::One, 0, par, |s, w| half_piece(level, isa, s, w, from, scale32))
        }
        Data::BF16(d) => {
            split(state, work(isa, d, mask), Words::One, 0, par, |s, w| half_piece(level, isa, s, w, from, scale32))
        }
    })
}

/// Ratio 0: the data copied to the output (nothing where in place) and the mask all true,
/// in pieces across the threads; returns the state after one word per element.
fn keep_all<T: Copy + Send + Sync>(state: &[u32; 6], work: Work<'_, T>, par: &dyn Parallelism) -> [u32; 6] {
    split(state, work, Words::One, 0, par, |_, w| {
        let Work { mut data, mask, .. } = w;
        if let Access::Split(src, dst) = data.access() {
            dst.copy_from_slice(src);
        }
        if let Some(m) = mask {
            m.fill(true);
        }
    })
}

/// A node's whole work, with its store policy: an out-of-place data output of
/// [`philox::STREAM_BYTES`] or more streams (as Philox's own output does), and so does a mask
/// of that many bytes; an in-place output keeps normal stores (its lines were just read).
fn work<'a, T: Copy>(isa: Isa, mut data: InOut<'a, T>, mask: Option<&'a mut [bool]>) -> Work<'a, T> {
    let split = matches!(data.access(), Access::Split(..));
    let stream = (
        split && streams::<T>(isa, Stores::Auto, data.len()),
        mask.as_deref().is_some_and(|m| streams::<bool>(isa, Stores::Auto, m.len())),
    );
    Work { data, mask, stream }
}

/// One piece, a sub-chunk at a time: `f(words, data)` on the data, then the mask; a
/// streamed output through an L1 buffer copied out with non-temporal stores (see
/// [`Sink`]), fenced before the piece returns.
fn piece<T: Copy + Default + Send + Sync>(
    level: Level,
    isa: Isa,
    state: &[u32; 6],
    work: Work<'_, T>,
    from: u32,
    mut f: impl FnMut(&[u32], InOut<'_, T>),
) {
    let Work { data, mut mask, stream } = work;
    let mut data_sink = Sink::<T>::new(isa, stream.0);
    let mut mask_sink = Sink::<bool>::new(isa, stream.1);
    let mut rest = Some(data);
    for_each_sub(level, state, rest.as_ref().map_or(0, InOut::len), Words::One, |words, start, n| {
        let (mut head, tail) = rest.take().expect("the rest of the piece").split_at(n);
        rest = Some(tail);
        let streamed = stream.0
            && match head.access() {
                Access::Split(src, dst) => {
                    data_sink.write(dst, |o| f(words, InOut::split(src, o).expect("a sub-chunk and its buffer")));
                    true
                }
                Access::InPlace(_) => false,
            };
        if !streamed {
            f(words, head);
        }
        if let Some(m) = mask.as_deref_mut() {
            mask_sink.write(&mut m[start..start + n], |o| mask_into(words, o, from));
        }
    });
}

/// A 16-bit piece: widened to float32 (exact), dropped out in float32, rounded once.
fn half_piece<H: Half + Default>(level: Level, isa: Isa, state: &[u32; 6], work: Work<'_, H>, from: u32, scale: f32) {
    let mut tmp = [0f32; super::draw::SUB];
    piece(level, isa, state, work, from, |words, mut d| {
        let n = d.len();
        let t = &mut tmp[..n];
        match d.access() {
            Access::InPlace(buf) => {
                H::load(buf, t);
                drop_f32(isa, words, InOut::in_place(t), from, scale);
                H::store(t, buf);
            }
            Access::Split(src, dst) => {
                H::load(src, t);
                drop_f32(isa, words, InOut::in_place(t), from, scale);
                H::store(t, dst);
            }
        }
    });
}

fn mask_into(words: &[u32], mask: &mut [bool], from: u32) {
    for (m, &x) in mask.iter_mut().zip(words) {
        *m = x & MANTISSA >= from;
    }
}

fn drop_f32(isa: Isa, words: &[u32], data: InOut<'_, f32>, from: u32, scale: f32) {
    match isa {
        Isa::Scalar => dropout_scalar(words, data, from, scale),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(token) => unsafe { super::x86::dropout_f32_avx2(token, words, data, from, scale) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(token) => unsafe { super::x86::dropout_f32_avx512(token, words, data, from, scale) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    }
}

fn drop_f64(isa: Isa, words: &[u32], data: InOut<'_, f64>, from: u32, scale: f64) {
    match isa {
        Isa::Scalar => dropout_scalar(words, data, from, scale),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2.
        Isa::Avx2(token) => unsafe { super::x86::dropout_f64_avx2(token, words, data, from, scale) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX-512F.
        Isa::Avx512(token) => unsafe { super::x86::dropout_f64_avx512(token, words, data, from, scale) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2(_) | Isa::Avx512(_) => unreachable!("SIMD levels are never available off x86_64"),
    }
}

/// The contract's keep decisions for `n` elements, written out on Philox's scalar reference
/// with the float64 comparison, for tests; and the next state.
pub fn reference_keep(state: &[u32; 6], ratio: f64, n: usize) -> (Vec<bool>, [u32; 6]) {
    let mut words = vec![0u32; n];
    let next = philox_ref::fill(state, &mut words);
    (words.iter().map(|&x| f64::from(f32_of(x)) >= ratio).collect(), next)
}
