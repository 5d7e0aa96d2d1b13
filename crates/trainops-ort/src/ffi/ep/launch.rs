//! What every CUDA kernel of the device doors shares: the stream it runs on, kernel-argument
//! slots, and the optimizers' host inputs `R` and `T`.

use core::ffi::c_void;

use crate::error::{Error, Result};
use crate::ffi::tensor::DType;
use crate::ffi::Context;

/// Where kernels are launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFrom {
    /// The legacy default stream, synchronised before the kernel returns (the plugin EP is not
    /// stream aware: its work must be complete when the callback returns).
    DefaultSynchronised,
    /// The CUDA execution provider's compute stream (`KernelContext_GetGPUComputeStream`);
    /// ONNX Runtime orders later work on it.
    ComputeStream,
}

/// A raw kernel-argument slot.
pub fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// `R` (float or double) and `T` (int64), inputs 0 and 1 of an optimizer node, in host memory
/// (`OrtMemTypeCPUInput`).
pub fn host_r_t(op: &'static str, ctx: &Context<'_>) -> Result<(f64, i64)> {
    let scalar = |index: usize| ctx.input(index)?.ok_or_else(|| Error::input(op, index, "R/T", "a scalar", "absent"));
    let (r_t, t_t) = (scalar(0)?, scalar(1)?);
    // SAFETY: R and T are OrtMemTypeCPUInput: host memory, read-only here.
    let r = unsafe {
        match r_t.dtype {
            DType::Float => f64::from(*r_t.slice::<f32>().first().unwrap_or(&0.0)),
            DType::Double => *r_t.slice::<f64>().first().unwrap_or(&0.0),
            other => return Err(Error::input(op, 0, "R", "float or double", other.name())),
        }
    };
    // SAFETY: as above.
    let t = unsafe {
        match t_t.dtype {
            DType::Int64 => *t_t.slice::<i64>().first().unwrap_or(&0),
            other => return Err(Error::input(op, 1, "T", "int64", other.name())),
        }
    };
    Ok((r, t))
}

/// The stream a kernel of this call runs on.
pub fn stream_of(ctx: &Context<'_>, from: StreamFrom) -> Result<*mut c_void> {
    match from {
        StreamFrom::DefaultSynchronised => Ok(core::ptr::null_mut()),
        StreamFrom::ComputeStream => ctx.gpu_stream(),
    }
}
