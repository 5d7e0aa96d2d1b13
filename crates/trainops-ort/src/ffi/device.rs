//! What an op may run on a device, in the op layer's terms: an op's CUDA step
//! ([`DeviceStep`], from `OpSpec::device_step`), which ops have device kernels
//! ([`DeviceTable`]) and whether this process asked for CUDA. `op.rs` and `register.rs` build
//! on these; the plugin EP (`ep/`) builds on them and on `op.rs`, never the other way.

use core::ffi::CStr;

use super::tensor::DType;
use super::Context;
use crate::error::Result;

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
    /// The smallest `T` the op takes (`Optimizer::MIN_T`: 1 for AdamW, torch's step).
    pub min_t: i64,
}

/// One call of a Philox-stream op on the device, as the op's host code plans it from the
/// node's host inputs (state, shape, ratio, training_mode): the device only draws words.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamPlan {
    /// Output dimensions (the data's, for a dropout).
    pub dims: Vec<i64>,
    /// The state of this call: counter words 0..4, key words 4..6.
    pub state: [u32; 6],
    /// The state after it (`state_out`), advanced past exactly the words drawn.
    pub next: [u32; 6],
    /// Dropout in training mode: `(keep_from, scale)`: element `i` is kept when
    /// `word(i) & 0x7FFFFF >= keep_from`, and then multiplied by `scale`; `None`: the data
    /// passes through (inference mode) or the op is raw Philox.
    pub dropout: Option<(u32, f32)>,
}

/// `PhiloxUniform`'s arithmetic for `trainops_uniform`: the output type's code (0 float32,
/// 1 float16, 2 bfloat16, 3 float64), the word bits of its uniform, and `high - low` and `low`
/// in float32 and in float64.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UniformArgs {
    /// The output type's code.
    pub dtype: i32,
    /// `u = bitcast<f32>(0x3F800000 | (word & mask) << shift) - 1`.
    pub mask: u32,
    /// See `mask`.
    pub shift: u32,
    /// `high - low` in float32.
    pub range: f32,
    /// `low`.
    pub low: f32,
    /// `f64(high) - f64(low)`.
    pub range64: f64,
    /// `f64(low)`.
    pub low64: f64,
}

/// `PhiloxNormal`'s arithmetic for `trainops_normal`: the output type's code (0 float32,
/// 1 float16, 2 bfloat16, 3 float64) and `mean`, `scale` in float32 and in float64.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormalArgs {
    /// The output type's code.
    pub dtype: i32,
    /// `mean`.
    pub mean: f32,
    /// `scale`.
    pub scale: f32,
    /// `f64(mean)`.
    pub mean64: f64,
    /// `f64(scale)`.
    pub scale64: f64,
}

/// Plans one call from the node's inputs (host memory for the planned ones).
pub type PlanFn = Box<dyn Fn(&Context<'_>) -> Result<StreamPlan> + Send + Sync>;

/// `MixedPrecisionAdam` on a CUDA device: Adam's coefficients of one call (as
/// [`DeviceStep::coeffs`], for `trainops_mp_adam`) and the type of the weights' copies.
pub struct MixedAdamStep {
    /// The coefficients of one call with learning rate `r` and update count `t`.
    pub coeffs: CoeffFn,
    /// `copy_dtype`: `None`, float16 or bfloat16.
    pub copy: Option<DType>,
}

/// How a node runs on a CUDA device.
pub enum DeviceOp {
    /// An optimizer of the family: one PTX kernel over its streams.
    Optimizer(DeviceStep),
    /// `Philox`: output 0 the words of the stream, output 1 (optional) the next state.
    Philox(PlanFn),
    /// `PhiloxDropout` on float32 data: output 0 the data, output 1 (optional) the mask,
    /// output 2 (optional) the next state.
    Dropout(PlanFn),
    /// `PhiloxUniform`: output 0 the values, output 1 (optional) the next state.
    Uniform(PlanFn, UniformArgs),
    /// `PhiloxNormal`: output 0 the values, output 1 (optional) the next state.
    Normal(PlanFn, NormalArgs),
    /// `AllFinite`: the one bool output set on the device from every input.
    AllFinite,
    /// `DynamicLossScale` with the node's rule: scale, good_steps and finite on the device.
    LossScale(trainops_kernels::loss_scale::LossScaleRule),
    /// `MixedPrecisionAdam`: float32 weights, float32/float16/bfloat16 gradients, the loss
    /// scale and the `finite` flag on the device; R and T host inputs.
    MixedAdam(MixedAdamStep),
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

/// The launch of a stream kernel over `words` words: 4-word blocks (one thread each, the
/// last one partial) and the grid (256 threads a block, at most `65535 * 8` blocks; a
/// grid-stride loop covers the rest).
pub fn launch_shape(words: usize) -> (u64, u32) {
    let blocks = words.div_ceil(4) as u64;
    let grid = blocks.div_ceil(256).clamp(1, 65_535 * 8);
    (blocks, grid as u32)
}
