//! Mixed precision after Keras' policies: the dynamic loss-scale rule ([`LossScaleRule`]),
//! one finiteness verdict over many gradients unscaled by the loss scale ([`all_finite`]),
//! and the 16-bit copies of new weights ([`cast`]). MixedPrecisionAdam's update itself is
//! Adam's ([`crate::optim::adam::AdamCoeffs::with_loss_scale`]).

mod finite;
mod rule;

pub use finite::{all_finite, cast};
pub use rule::LossScaleRule;
