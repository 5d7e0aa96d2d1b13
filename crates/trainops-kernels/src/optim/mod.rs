//! The optimizer family: one contract, [`Optimizer`], implemented by [`adam::Adam`],
//! [`adamw::AdamW`] (PyTorch's, three streams or four with amsgrad),
//! [`adagrad::Adagrad`] and [`momentum::Momentum`] (and by the benchmark yardstick
//! [`crate::ceiling::MemoryCeiling`]).
//!
//! An ONNX optimizer rewrites `N` streams per parameter tensor (the weights first, then its
//! state: Adam `X, V, H`, Adagrad `X, H`, Momentum `X, V`) from one gradient `G`. Its
//! attributes ([`Optimizer::Attrs`]) become per-call coefficients ([`Optimizer::coeffs`],
//! formed in `f64` and rounded once to the compute type), and each element is updated by
//! [`Optimizer::update`]. [`Optimizer::step`] runs a whole node: its [`Param`]s are cut into
//! [`CHUNK`]-element pieces run on the caller's [`Parallelism`], each
//! piece by [`Optimizer::chunk`] (the portable loop unless the optimizer has SIMD kernels).
//! [`Optimizer::reference`] is the plain scalar reference, written from onnx's, that the
//! tests hold every fast path to.
//!
//! Adding an optimizer: a folder here with the kernel (`mod.rs`: attributes, coefficients,
//! `impl Optimizer`), its `reference.rs` and its `tests.rs` (the shared harness,
//! instantiated with `optimizer_harness!`); then its op file in the ORT crate.

pub mod adagrad;
pub mod adam;
pub mod adamw;
pub mod bf16state;
#[cfg(test)]
pub(crate) mod harness;
pub mod momentum;
pub mod quantized;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use core::fmt::Debug;

use crate::parallel::{run_chunked, Splittable, CHUNK, SERIAL_BELOW};
use crate::simd::{detected, Level};
use crate::{Compute, Element, InOut, KernelError, Parallelism};

/// One parameter tensor of an optimizer node: the `N` streams the optimizer rewrites
/// (weights first, in [`Optimizer::STREAMS`] order) and the gradient, already broadcast to
/// the weights' shape. Built by [`Optimizer::param`], which checks the lengths.
pub struct Param<'a, X, G, const N: usize> {
    /// The rewritten streams: `X`, then the optimizer's state.
    pub streams: [InOut<'a, X>; N],
    /// Gradient `G`, one element per weight.
    pub g: &'a [G],
}

impl<X: Element, G: Element, const N: usize> Splittable for Param<'_, X, G, N> {
    fn len(&self) -> usize {
        self.g.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (g0, g1) = self.g.split_at(mid);
        let mut tails = Vec::with_capacity(N);
        let heads = self.streams.map(|s| {
            let (head, tail) = s.split_at(mid);
            tails.push(tail);
            head
        });
        let Ok(tails) = <[InOut<'_, X>; N]>::try_from(tails) else { unreachable!("one tail per stream") };
        (Param { streams: heads, g: g0 }, Param { streams: tails, g: g1 })
    }
}

/// An ONNX training optimizer with `N` rewritten streams per tensor.
pub trait Optimizer<const N: usize>: Sized + Send + Sync + 'static {
    /// The op's attributes (ONNX's defaults, where it gives any, are the `Default`).
    type Attrs: Copy + Debug + Send + Sync;
    /// The per-call scalars of the update, rounded once to the compute type `C`.
    type Coeffs<C: Compute>: Copy + Debug + Send + Sync;
    /// The streams' names, weights first (`["X", "V", "H"]`): for length errors and tests.
    const STREAMS: [&'static str; N];
    /// The smallest update count `T` the op accepts (AdamW counts from 1, as torch's
    /// `step`); the op refuses a smaller one with a clear error.
    const MIN_T: i64 = i64::MIN;

    /// The coefficients of one call with learning rate `r` and update count `t`.
    fn coeffs<C: Compute>(attrs: &Self::Attrs, r: f64, t: i64) -> Self::Coeffs<C>;

    /// The update of one element: the streams' values (weights first) and the gradient to
    /// the streams' new values.
    fn update<C: Compute>(c: &Self::Coeffs<C>, streams: [C; N], g: C) -> [C; N];

    /// The plain scalar reference on one tensor's slices (`g` has the weights' shape): the
    /// new value of every stream. Shares no code with the fast path but the conversions.
    fn reference<X: Element, G: Element<C = X::C>>(
        attrs: &Self::Attrs,
        r: f64,
        t: i64,
        streams: [&[X]; N],
        g: &[G],
    ) -> [Vec<X>; N];

    /// Updates one chunk with the kernel of `level` (available: checked by
    /// [`Optimizer::step_with`]). The portable loop unless an optimizer has SIMD kernels.
    fn chunk<X: Element, G: Element<C = X::C>>(level: Level, c: &Self::Coeffs<X::C>, p: Param<'_, X, G, N>) {
        let _ = level;
        portable(c, p, Self::update);
    }

    /// One tensor of a node: checks that every stream has the gradient's length.
    fn param<'a, X: Element, G: Element>(
        streams: [InOut<'a, X>; N],
        g: &'a [G],
    ) -> Result<Param<'a, X, G, N>, KernelError> {
        let n = streams[0].len();
        if g.len() != n {
            return Err(KernelError::LengthMismatch { what: "G", got: g.len(), expected: n });
        }
        for (k, s) in streams.iter().enumerate().skip(1) {
            if s.len() != n {
                return Err(KernelError::LengthMismatch { what: Self::STREAMS[k], got: s.len(), expected: n });
            }
        }
        Ok(Param { streams, g })
    }

    /// One step over every tensor of a node, with the [`detected`] kernel level. Each
    /// element's result depends neither on how the work is split nor on the level, so the
    /// output is bitwise identical for any `par` and any CPU.
    fn step<X: Element, G: Element<C = X::C>>(
        c: &Self::Coeffs<X::C>,
        params: Vec<Param<'_, X, G, N>>,
        par: &dyn Parallelism,
    ) {
        Self::step_with(detected(), c, params, par);
    }

    /// [`Optimizer::step`] with a given level (tests and benchmarks force each one).
    ///
    /// # Panics
    /// When `level` is not available on this CPU.
    fn step_with<X: Element, G: Element<C = X::C>>(
        level: Level,
        c: &Self::Coeffs<X::C>,
        params: Vec<Param<'_, X, G, N>>,
        par: &dyn Parallelism,
    ) {
        assert!(level.is_available(), "kernel level {level:?} is not available on this CPU");
        run_chunked(params, par, CHUNK, SERIAL_BELOW, |p| Self::chunk(level, c, p));
    }
}

/// The portable kernel over one chunk: `update` (an optimizer's [`Optimizer::update`], or a
/// specialisation of it) element by element; 16-bit types compute in `f32` and are stored
/// round-to-nearest-even.
#[inline(always)]
pub fn portable<K, X: Element, G: Element<C = X::C>, const N: usize>(
    c: &K,
    p: Param<'_, X, G, N>,
    update: impl Fn(&K, [X::C; N], X::C) -> [X::C; N],
) {
    let Param { mut streams, g } = p;
    let n = streams[0].len();
    // One index for the streams and the gradient, and the writes by constant stream index:
    // the loop the kernels had before the contract (callgrind counts the same instructions).
    #[allow(clippy::needless_range_loop)]
    for i in 0..n {
        let new = update(c, core::array::from_fn(|k| streams[k].get(i).load()), g[i].load());
        for k in 0..N {
            streams[k].set(i, X::store(new[k]));
        }
    }
}
