//! Counter-based random numbers: [`philox`] (Philox4x32-10), whose state is six words a
//! graph carries as a tensor, so that bits never depend on threads or SIMD level.

pub mod philox;
