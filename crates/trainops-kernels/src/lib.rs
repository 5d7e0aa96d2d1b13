//! Training-operator numerics on plain slices, with no knowledge of ONNX Runtime.
//!
//! - [`optim`]: the optimizer family (Adam, Adagrad, Momentum) behind one contract,
//!   [`optim::Optimizer`]; [`ceiling`]: the benchmarks' memory yardstick on the same contract.
//! - [`random`]: Philox4x32-10 random bits.
//! - [`grad`]: backward kernels of standard ops (activations, pooling).
//! - [`loss_scale`]: mixed precision (loss-scale rule, finiteness, 16-bit copies).
//! - [`grad`]: backward kernels of the training graph (convolution gradients).
//! - [`matmul`]: the step's matrix products, whose operands change every call.
//! - [`shape`]: overflow-checked shape arithmetic and fallible working memory, used by
//!   every kernel (and its runtime glue) before it allocates.
//! - [`simd`] picks the instruction set once; [`parallel`] cuts work into chunks run on a
//!   caller-supplied [`Parallelism`]; [`stream`]'s [`InOut`] keeps in-place updates from ever
//!   becoming overlapping references; [`elem`] loads and stores the element types.
//!
//! Every kernel has a plain scalar reference (`reference` modules), written straight from
//! the specification and used only by tests, and a fast path that the runtime layer calls.

pub mod broadcast;
pub mod ceiling;
pub mod elem;
mod error;
pub mod grad;
pub mod loss_scale;
pub mod matmul;
pub mod optim;
pub mod parallel;
pub mod random;
pub mod shape;
pub mod simd;
pub mod stream;
#[cfg(test)]
mod test_util;

pub use elem::{Compute, Element};
pub use error::KernelError;
pub use parallel::{run_chunked, Parallelism, RayonPool, Sequential, Splittable};
pub use simd::Level;
pub use stream::InOut;
