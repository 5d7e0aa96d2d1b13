//! libtrainops: ONNX training operators for ONNX Runtime, as a custom-op library.
//!
//! Load it into any ONNX Runtime from 1.17 with `register_custom_ops_library` (Python),
//! `RegisterCustomOpsLibrary_V2` (C/C++) or `SessionBuilder::with_operator_library` (Rust's
//! `ort`). It exports one symbol, [`RegisterCustomOps`], which registers the op catalogue
//! (module `ops`):
//!
//! - `ai.onnx.preview.training::Adam`, `Adagrad` and `Momentum` (v1), ONNX's own operators.
//! - `com.trainops::Philox` (v1), DirectML's Philox4x32-10 random generator, and
//!   `PhiloxUniform`, `PhiloxNormal`, `PhiloxDropout` (v1): distributions from its stream.
//! - `com.trainops::MixedPrecisionAdam`, `DynamicLossScale`, `AllFinite` (v1): mixed precision.
//! - `com.trainops::ReluGrad`, `LeakyReluGrad`, `GeluGrad`, `MaxPoolGrad`,
//!   `MaxPoolGradFromInput`, `GatherGrad` and the rest of `ops::grad` (v1): backward
//!   kernels the autodiff rules emit on the CPU.
//! - `com.trainops.bench::MemoryCeiling` (v1): Adam's memory traffic, for benchmarks.
//!
//! All arithmetic lives in `trainops-kernels`; `ops` checks nodes and plans memory; `ffi` is
//! the only code that calls ONNX Runtime's C API. Both are private: what the fuzz targets
//! and their regression tests need is exported through [`fuzzing`].

mod error;
mod ffi;
mod ops;

/// The library's entry point: registers every trainops domain on `options`.
///
/// # Safety
/// Called by ONNX Runtime with its `OrtApiBase` and a valid `OrtSessionOptions`.
#[no_mangle]
pub unsafe extern "C" fn RegisterCustomOps(
    options: *mut ort_sys::OrtSessionOptions,
    api_base: *const ort_sys::OrtApiBase,
) -> ort_sys::OrtStatusPtr {
    let cuda_kernels = &ffi::ep::cuda::CUDA_EP_KERNELS;
    // SAFETY: the runtime's own arguments, passed on unchanged.
    unsafe { ffi::register::register_custom_ops(options, api_base, ops::catalogue, ops::device_support, cuda_kernels) }
}

/// The plugin execution provider's entry point (ONNX Runtime 1.24 and newer, through
/// `RegisterExecutionProviderLibrary`): one factory of `TrainopsExecutionProvider`, or none
/// when the runtime is older than 1.24.
///
/// # Safety
/// Called by ONNX Runtime with its `OrtApiBase`, an array of `max_factories` factory slots and
/// a valid `num_factories`.
#[no_mangle]
pub unsafe extern "C" fn CreateEpFactories(
    _registered_name: *const core::ffi::c_char,
    api_base: *const ort_sys::OrtApiBase,
    _default_logger: *const core::ffi::c_void,
    factories: *mut *mut core::ffi::c_void,
    max_factories: usize,
    num_factories: *mut usize,
) -> ort_sys::OrtStatusPtr {
    // SAFETY: the runtime's own arguments, passed on unchanged.
    unsafe {
        ffi::ep::create_factories(
            api_base,
            factories.cast(),
            max_factories,
            num_factories,
            ops::catalogue,
            ops::device_support,
        )
    }
}

/// Releases a factory [`CreateEpFactories`] made.
///
/// # Safety
/// `factory` is one of ours, released once.
#[no_mangle]
pub unsafe extern "C" fn ReleaseEpFactory(factory: *mut core::ffi::c_void) -> ort_sys::OrtStatusPtr {
    // SAFETY: the runtime's argument, passed on unchanged.
    unsafe { ffi::ep::release_factory(factory.cast()) }
}

/// The plugin EP's counters (allocations, frees, copies to the device, to the host, on the
/// device, device kernel runs, nodes claimed, nodes declined), written to `out[..n]`; returns
/// how many there are. For tests (`trainops.device.counters()`); not a stable API.
///
/// # Safety
/// `out` is null or valid for `n` writes.
#[no_mangle]
pub unsafe extern "C" fn trainops_ep_counters(out: *mut u64, n: usize) -> usize {
    let all = ffi::ep::counters();
    if !out.is_null() {
        for (i, v) in all.iter().take(n).enumerate() {
            // SAFETY: the caller's contract: `out` holds `n` slots.
            unsafe { *out.add(i) = *v };
        }
    }
    all.len()
}

/// Entry points for the fuzz targets (`fuzz/`) and their regression tests: the checks that
/// run before any buffer is touched, without an ONNX Runtime. Not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::error::{Error, Result};
    pub use crate::ffi::alias::{plan, AliasPlan, OutputRegion};
    pub use crate::ffi::context::numel;
    pub use crate::ffi::DType;
    pub use crate::ops::optim::layout::{broadcastable, same_shape, InputInfo, Layout};
    pub use crate::ops::random::state::{output_numel, ShapeFrom};

    /// The layouts of every optimizer-shaped op, as registered.
    pub fn layouts() -> [&'static Layout; 7] {
        crate::ops::layouts()
    }

    /// Philox's check of requested output dimensions (from the `shape` attribute when
    /// `attribute`, else from the `shape` input): the element count, or the error.
    pub fn philox_output_numel(dims: &[i64], attribute: bool) -> Result<usize> {
        output_numel("Philox", dims, if attribute { ShapeFrom::Attribute } else { ShapeFrom::Input })
    }
}
