//! Training-operator numerics on plain slices, with no knowledge of ONNX Runtime.
//!
//! Every operator has a plain scalar reference (`reference` modules), written straight from
//! the specification and used only by tests, and a fast path that the runtime layer calls.
//! Fast paths take their memory through [`InOut`] streams, so that an output bound to its own
//! input's buffer (in-place update) never becomes two overlapping Rust references, and run
//! their work through a caller-supplied [`Parallelism`], so that the host decides the threads.

pub mod adagrad;
pub mod adam;
pub mod broadcast;
pub mod ceiling;
pub mod elem;
mod error;
pub mod loss_scale;
pub mod mixed;
pub mod momentum;
pub mod parallel;
pub mod philox;
pub mod random;
pub mod simd;
pub mod stream;
#[cfg(test)]
mod test_util;

pub use elem::{Compute, Element};
pub use error::KernelError;
pub use parallel::{run_chunked, Parallelism, RayonPool, Sequential, Splittable};
pub use simd::Level;
pub use stream::InOut;
