//! Host inputs of the device kernels, read through device memory.
//!
//! onnxruntime does not always hand a device kernel device memory: on an NVIDIA H200 with
//! onnxruntime 1.30, the plugin EP's optimizer in a Trainer got the CPU's gradients (and,
//! before the weights' host aliases, a weight's host copy) as host buffers. A kernel
//! reading one faults and leaves the device's context unusable; [`Staged`] copies such an
//! input to a device buffer first, and [`device_output`] refuses an output in host memory.

use core::ffi::c_void;

use crate::error::{Error, Result};
use crate::ffi::tensor::Tensor;

/// Whether the CUDA driver knows `t`'s buffer (device, managed or registered host memory).
/// On an H200, onnxruntime 1.30 handed the plugin EP's optimizer a host copy of a weight the
/// CPU forward pass also reads, and the gradient the CPU backward pass made in host memory
/// (the Trainer placement): a kernel reading such a pointer faults and leaves the device's
/// context unusable, so the device kernels stage host inputs through device memory
/// ([`Staged`]) and refuse a host output ([`device_output`]).
fn known(op: &'static str, ordinal: u32, t: &Tensor) -> Result<bool> {
    if t.numel == 0 {
        return Ok(true);
    }
    trainops_cuda::known_to_driver(ordinal, t.ptr).map_err(|e| Error::Runtime {
        op,
        call: "CUDA",
        message: e.to_string(),
    })
}

/// An error naming output `index` when its buffer is host memory (a kernel would fault
/// writing it).
pub(super) fn device_output(op: &'static str, ordinal: u32, t: &Tensor, index: usize, name: &str) -> Result<()> {
    if known(op, ordinal, t)? {
        return Ok(());
    }
    let (expected, got) = ("a buffer in the CUDA device's memory".to_string(), "host memory".to_string());
    Err(Error::Output { op, index, name: name.to_string(), expected, got })
}

/// Device buffers a node borrowed for host inputs: freed once the node's work on `stream` is
/// done (when dropped, on every path out of the node).
pub(super) struct Staged {
    op: &'static str,
    ordinal: u32,
    stream: *mut c_void,
    buffers: Vec<*mut c_void>,
}

impl Staged {
    pub(super) fn new(op: &'static str, ordinal: u32, stream: *mut c_void) -> Self {
        Self { op, ordinal, stream, buffers: Vec::new() }
    }

    /// Where a kernel may read `t`: its own buffer when the driver knows it, else a device
    /// copy of it, complete on return.
    pub(super) fn readable(&mut self, t: &Tensor) -> Result<*mut c_void> {
        if known(self.op, self.ordinal, t)? {
            return Ok(t.ptr);
        }
        let bytes = t.numel * t.elem_size;
        let failed = |e: trainops_cuda::Error| Error::Runtime {
            op: self.op,
            call: "CUDA",
            message: format!("{e} (copying a host input of {bytes} bytes to the device)"),
        };
        let p = trainops_cuda::alloc(self.ordinal, bytes).map_err(failed)?;
        self.buffers.push(p);
        // SAFETY: `p` is a fresh device buffer of `bytes` bytes; `t.ptr` is host memory of
        // `bytes` bytes (numel elements of elem_size) alive for the call.
        unsafe { trainops_cuda::copy(self.ordinal, p, t.ptr, bytes) }.map_err(failed)?;
        Ok(p)
    }

    /// `input` copied into `out` (device memory, `bytes` long) before the node's kernels:
    /// ordered on the stream when the driver knows `input`, else after the stream's earlier
    /// work, from the host.
    pub(super) fn copy_into(&mut self, out: &Tensor, input: &Tensor, bytes: usize) -> Result<()> {
        let failed = |e: trainops_cuda::Error| Error::Runtime {
            op: self.op,
            call: "CUDA",
            message: format!("{e} ({bytes} bytes from {:p} to {:p})", input.ptr, out.ptr),
        };
        if bytes == 0 || out.ptr == input.ptr {
            return Ok(());
        }
        if known(self.op, self.ordinal, input)? {
            // SAFETY: both are device buffers of `bytes` bytes, alive until the node's work on
            // `stream` is done; the copy is ordered before the kernel.
            return unsafe { trainops_cuda::copy_on(self.ordinal, out.ptr, input.ptr, bytes, self.stream) }
                .map_err(failed);
        }
        // SAFETY: the node's stream (or null, the legacy default one).
        unsafe { trainops_cuda::synchronize(self.ordinal, self.stream) }.map_err(failed)?;
        // SAFETY: `out` is device memory and `input` host memory of `bytes` bytes each, alive
        // for the call.
        unsafe { trainops_cuda::copy(self.ordinal, out.ptr, input.ptr, bytes) }.map_err(failed)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.buffers.is_empty() {
            return;
        }
        // SAFETY: the node's stream (or null, the legacy default one); waiting for it keeps
        // the buffers alive until the kernels that read them are done. Errors here would
        // also surface at the node's own synchronisation: nothing more to do with them.
        let _ = unsafe { trainops_cuda::synchronize(self.ordinal, self.stream) };
        for &p in &self.buffers {
            // SAFETY: allocated by `readable` on this ordinal, freed once, no longer read.
            let _ = unsafe { trainops_cuda::free(self.ordinal, p) };
        }
    }
}
