//! What an op may run on a device, in the op layer's terms: an op's CUDA step
//! ([`DeviceStep`], from `OpSpec::device_step`), which ops have device kernels
//! ([`DeviceTable`]) and whether this process asked for CUDA. `op.rs` and `register.rs` build
//! on these; the plugin EP (`ep/`) builds on them and on `op.rs`, never the other way.

use core::ffi::CStr;

use super::tensor::DType;

/// Per-call kernel arguments after the tensors: float coefficients, then an optional int.
pub type CoeffFn = Box<dyn Fn(f64, i64) -> (Vec<f32>, Option<i32>) + Send + Sync>;

/// How a node runs on a CUDA device.
pub struct DeviceStep {
    /// Entry point in `trainops_cuda::PTX`, e.g. `trainops_adam_f32`.
    pub kernel: &'static str,
    /// The op's streams, weights first (`N`: 3 for Adam).
    pub streams: usize,
    /// The coefficients of one call with learning rate `r` and update count `t`, in the
    /// kernel's argument order.
    pub coeffs: CoeffFn,
}

/// What the device kernels of an op accept: the formal inputs kept in host memory, and the
/// element types its device inputs may have (a node with another type is left to the CPU).
#[derive(Clone, Copy, Debug)]
pub struct DeviceSupport {
    /// Formal inputs declared `OrtMemTypeCPUInput` (R, T, shapes).
    pub host_inputs: &'static [usize],
    /// Element types the device kernels take for every other input.
    pub types: &'static [DType],
    /// Whether its CUDA kernel is wired (`OpSpec::device_step`); in CUDA mode the EP claims,
    /// and the `CUDAExecutionProvider` registration covers, only these ops.
    pub cuda: bool,
}

/// Which ops have device kernels: `(domain, op) -> support`, `None` for CPU-only ops.
pub type DeviceTable = fn(&CStr, &CStr) -> Option<DeviceSupport>;

/// Whether this process asked for the CUDA kernels (`TRAINOPS_CUDA=1`): opt-in until they are
/// verified on a GPU.
pub fn cuda_requested() -> bool {
    std::env::var("TRAINOPS_CUDA").as_deref() == Ok("1")
}
