//! The optimizer family on a CUDA device: which PTX kernel each optimizer runs and its
//! per-call coefficients in the kernel's argument order (`crates/trainops-cuda/cuda/
//! trainops.cu`). The coefficients are the kernels crate's own (`Optimizer::coeffs`, rounded
//! to float once, as the CPU reference does), so a device step does the CPU's operations on
//! the CPU's values.

use trainops_kernels::ceiling::MemoryCeiling;
use trainops_kernels::optim::adagrad::Adagrad;
use trainops_kernels::optim::adam::Adam;
use trainops_kernels::optim::adamw::{AdamW, AdamWAttrs, AdamWCoeffs};
use trainops_kernels::optim::momentum::{Momentum, MomentumMode};
use trainops_kernels::optim::Optimizer;

use crate::ffi::device::DeviceStep;

/// An optimizer's CUDA kernel, if it has one.
pub trait OnDevice<const N: usize>: Optimizer<N> {
    /// The kernel and coefficients of a node with attributes `attrs`.
    fn device(_attrs: &Self::Attrs) -> Option<DeviceStep> {
        None
    }
}

impl OnDevice<3> for Adam {
    fn device(attrs: &Self::Attrs) -> Option<DeviceStep> {
        let attrs = *attrs;
        Some(DeviceStep {
            kernel: "trainops_adam_f32",
            streams: 3,
            min_t: <Adam as Optimizer<3>>::MIN_T,
            coeffs: Box::new(move |r, t| {
                let c = Adam::coeffs::<f32>(&attrs, r, t);
                (vec![c.norm, c.alpha, c.one_minus_alpha, c.beta, c.one_minus_beta, c.epsilon, c.rate, c.keep], None)
            }),
        })
    }
}

impl OnDevice<2> for Adagrad {
    fn device(attrs: &Self::Attrs) -> Option<DeviceStep> {
        let attrs = *attrs;
        Some(DeviceStep {
            kernel: "trainops_adagrad_f32",
            streams: 2,
            min_t: <Adagrad as Optimizer<2>>::MIN_T,
            coeffs: Box::new(move |r, t| {
                let c = Adagrad::coeffs::<f32>(&attrs, r, t);
                (vec![c.norm, c.epsilon, c.rate], None)
            }),
        })
    }
}

impl OnDevice<2> for Momentum {
    fn device(attrs: &Self::Attrs) -> Option<DeviceStep> {
        let attrs = *attrs;
        Some(DeviceStep {
            kernel: "trainops_momentum_f32",
            streams: 2,
            min_t: <Momentum as Optimizer<2>>::MIN_T,
            coeffs: Box::new(move |r, t| {
                let c = Momentum::coeffs::<f32>(&attrs, r, t);
                let nesterov = i32::from(matches!(c.mode, MomentumMode::Nesterov));
                (vec![c.norm, c.alpha, c.beta, c.rate], Some(nesterov))
            }),
        })
    }
}

/// AdamW's step on the device: its coefficients in `trainops_adamw_*_f32`'s order, and the
/// flags (bit 0 maximize, bit 1 lerp from the end).
fn adamw_step<const N: usize>(attrs: &AdamWAttrs, kernel: &'static str) -> DeviceStep {
    let attrs = *attrs;
    DeviceStep {
        kernel,
        streams: N,
        min_t: <AdamW as Optimizer<3>>::MIN_T,
        coeffs: Box::new(move |r, t| {
            let c = AdamWCoeffs::<f32>::new(&attrs, r, t);
            let flags = i32::from(c.maximize) | i32::from(c.lerp_from_end) << 1;
            let cs = vec![c.decay, c.lerp, c.beta2, c.one_minus_beta2, c.bias_correction2_sqrt, c.epsilon, c.step_size];
            (cs, Some(flags))
        }),
    }
}

impl OnDevice<3> for AdamW {
    fn device(attrs: &Self::Attrs) -> Option<DeviceStep> {
        Some(adamw_step::<3>(attrs, "trainops_adamw_f32"))
    }
}

impl OnDevice<4> for AdamW {
    fn device(attrs: &Self::Attrs) -> Option<DeviceStep> {
        Some(adamw_step::<4>(attrs, "trainops_adamw_amsgrad_f32"))
    }
}

/// A benchmark yardstick: CPU only.
impl OnDevice<3> for MemoryCeiling {}
impl OnDevice<2> for MemoryCeiling {}
