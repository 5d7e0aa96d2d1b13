//! Distributions from Philox words (`com.trainops::PhiloxUniform`, `PhiloxNormal`,
//! `PhiloxDropout`): element `i` is a pure function of the Philox stream's words, so every
//! level and every split over threads gives the same result (bit for bit for [`uniform`] and
//! [`dropout`]).

pub mod draw;
pub mod dropout;
pub mod normal;
pub mod uniform;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
