//! One module per op family; each exposes its `OpSpec`s.

pub mod adam;
pub mod ceiling;
mod common;
pub mod mixed;
pub mod optimizer;
pub mod philox;
