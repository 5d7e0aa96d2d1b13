//! Random-number ops of `com.trainops`, whose generator state is an ordinary tensor:
//! [`philox`] (the raw bits) and [`distributions`] (PhiloxUniform, PhiloxNormal,
//! PhiloxDropout from the same stream). [`state`] is what every such op shares: reading the six state
//! words, the output's dimensions (a `shape` attribute or a `shape` input, exactly one),
//! their size limit, and the checked `output` / `state_out` pair. [`device`] plans Philox and
//! PhiloxDropout calls for the CUDA kernels.

pub mod device;
pub mod distributions;
pub mod philox;
pub mod state;
