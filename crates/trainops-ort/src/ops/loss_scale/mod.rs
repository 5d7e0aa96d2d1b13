//! Mixed-precision training ops of `com.trainops`, after Keras' `mixed_float16` /
//! `mixed_bfloat16` policies: float32 variables, 16-bit compute, dynamic loss scaling.
//!
//! - `MixedPrecisionAdam`: inputs `R, T, loss_scale, X..., G..., V..., H...` (X/V/H float32,
//!   G float16, bfloat16 or float32); Adam's attributes and `copy_dtype` (0, 10 float16, 16
//!   bfloat16). Outputs `finite`, `X_new..., V_new..., H_new...` and, with a `copy_dtype`,
//!   `X_copy...`. `g = G / loss_scale`; when every `g` of the node is finite, Adam on `g`;
//!   otherwise every output equals its input (the step is skipped).
//! - `DynamicLossScale`: `(scale, good_steps, finite) -> (new_scale, new_good_steps)`.
//! - `AllFinite`: any number of float tensors -> one bool.

pub mod all_finite;
pub mod dynamic_loss_scale;
pub mod mixed_precision_adam;
