//! One module per op family; each exposes its `OpSpec`s.

pub mod adagrad;
pub mod adam;
pub mod ceiling;
pub mod common;
pub mod mixed;
pub mod momentum;
pub mod optimizer;
pub mod philox;
pub mod random;
