//! One module per op family; each exposes its `OpSpec`s.

pub mod adam;
mod common;
pub mod optimizer;
pub mod philox;
