//! The CUDA device kernels behind the device registrations (the plugin EP in CUDA mode, and
//! the `CUDAExecutionProvider` registration of the custom-op library): one generic kernel for
//! the optimizer family that launches the op's PTX entry point from `trainops_cuda` on the
//! device buffers, and [`CudaStreamOp`] for Philox and PhiloxDropout (the host plans the call,
//! the device draws). UNVERIFIED on a GPU in this tree (no GPU where it was written):
//! `scripts/gpu_check` is the check to run.
//!
//! A node's inputs are `R, T` (host memory: `OrtMemTypeCPUInput`), then `N + 1` blocks of `n`
//! tensors (`X`, `G`, then the other streams); outputs are the `N` stream blocks. Every tensor
//! must be float32. Outputs not bound to their inputs are first copied from them (device to
//! device), then the kernel updates the outputs in place, on the GPU that holds the node's
//! first weight tensor.

use core::ffi::c_void;

/// The step type, re-exported where the op modules first found it.
pub use super::super::device::DeviceStep;
use super::super::device::{launch_shape, DeviceOp, NormalArgs, PlanFn, StreamPlan, UniformArgs};
use super::super::op::DeviceKernels;
use super::super::{Context, Kernel, KernelInfo, OpSpec};
pub use super::launch::StreamFrom;
use super::launch::{arg, host_r_t};
use super::mixed::{CudaAllFinite, CudaLossScale, CudaMixedAdam};
use super::staging::{device_output, Staged};
use crate::error::{Error, Result};
use crate::ffi::tensor::{DType, Tensor};

/// The CUDA kernel of one optimizer node.
pub struct CudaOptimizer {
    op: &'static str,
    step: DeviceStep,
    stream: StreamFrom,
}

impl CudaOptimizer {
    /// The kernel of a node of `spec`.
    pub fn new(spec: &'static dyn OpSpec, step: DeviceStep, stream: StreamFrom) -> Self {
        Self { op: spec.op(), step, stream }
    }

    fn float(&self, t: &Tensor, index: usize, what: &'static str) -> Result<()> {
        if t.dtype == DType::Float {
            Ok(())
        } else {
            Err(Error::input(self.op, index, what, "float32 on the CUDA device", t.dtype.name()))
        }
    }
}

impl Kernel for CudaOptimizer {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let runtime = |message: String| Error::Runtime { op: self.op, call: "CUDA", message };
        let (r, t) = host_r_t(self.op, ctx)?;
        if t < self.step.min_t {
            let want = format!("an update count >= {} (1 on the first update, as torch's step)", self.step.min_t);
            return Err(Error::input(self.op, 1, "T", want, t.to_string()));
        }
        let streams = self.step.streams;
        let count = ctx.input_count()?;
        let n = count.saturating_sub(2) / (streams + 1);
        if n == 0 || 2 + n * (streams + 1) != count {
            return Err(Error::Arity { op: self.op, what: format!("{count} inputs do not form groups") });
        }
        let (coeffs, extra) = (self.step.coeffs)(r, t);
        let stream: *mut c_void = match self.stream {
            StreamFrom::DefaultSynchronised => core::ptr::null_mut(),
            StreamFrom::ComputeStream => ctx.gpu_stream()?,
        };
        let ordinal = ctx.input_device_id(2)?;
        let function = trainops_cuda::function(ordinal, self.step.kernel).map_err(|e| runtime(e.to_string()))?;
        let mut staged = Staged::new(self.op, ordinal, stream);
        for i in 0..n {
            let x = ctx.input(2 + i)?.ok_or_else(|| runtime("missing X".into()))?;
            let g = ctx.input(2 + n + i)?.ok_or_else(|| runtime("missing G".into()))?;
            self.float(&x, 2 + i, "X")?;
            self.float(&g, 2 + n + i, "G")?;
            let mut outs = Vec::with_capacity(streams);
            for s in 0..streams {
                let at = if s == 0 { 2 + i } else { 2 + (s + 1) * n + i };
                let input =
                    if s == 0 { x.clone() } else { ctx.input(at)?.ok_or_else(|| runtime("missing stream".into()))? };
                self.float(&input, at, "stream")?;
                if input.numel != x.numel || g.numel != x.numel {
                    return Err(Error::input(self.op, at, "stream", "the size of X", input.numel.to_string()));
                }
                let out = ctx.output(s * n + i, &input.shape)?;
                device_output(self.op, ordinal, &out, s * n + i, "updated state")?;
                staged.copy_into(&out, &input, x.numel * 4)?;
                outs.push(out.ptr);
            }
            if x.numel == 0 {
                continue;
            }
            // A gradient in host memory (the CPU backward pass's) is read from a device copy.
            let g_ptr = staged.readable(&g)?;
            let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(streams + 1);
            ptrs.push(outs[0]);
            ptrs.push(g_ptr);
            ptrs.extend_from_slice(&outs[1..]);
            let mut numel = x.numel as u64;
            let mut cs = coeffs.clone();
            let mut flag = extra.unwrap_or(0);
            let mut args: Vec<*mut c_void> = ptrs.iter_mut().map(arg).collect();
            args.push(arg(&mut numel));
            args.extend(cs.iter_mut().map(arg));
            if extra.is_some() {
                args.push(arg(&mut flag));
            }
            let blocks = u32::try_from(x.numel.div_ceil(256).min(65_535 * 8)).unwrap_or(u32::MAX);
            // SAFETY: the arguments are, in order, the kernel's parameters (trainops.cu):
            // device pointers of numel float32 each, the count, the coefficients, the flag;
            // all outlive the launch, which copies them.
            unsafe { trainops_cuda::launch(ordinal, &function, blocks, stream, &mut args) }
                .map_err(|e| runtime(e.to_string()))?;
        }
        if self.stream == StreamFrom::DefaultSynchronised {
            // SAFETY: the default stream.
            unsafe { trainops_cuda::synchronize(ordinal, core::ptr::null_mut()) }
                .map_err(|e| runtime(e.to_string()))?;
        }
        Ok(())
    }
}

/// Which stream op a [`CudaStreamOp`] is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum StreamKind {
    Philox,
    Dropout,
    Uniform(UniformArgs),
    Normal(NormalArgs),
}

/// Philox or PhiloxDropout on the device: the op's host code plans the call from its host
/// inputs ([`StreamPlan`]); the kernel draws the words of counters `state + b` for the
/// 4-word blocks `b`, and writes `state_out` with a one-thread kernel on the same stream.
pub struct CudaStreamOp {
    op: &'static str,
    kind: StreamKind,
    plan: PlanFn,
    stream: StreamFrom,
}

/// The six state words as kernel arguments.
fn state_args(state: &mut [u32; 6]) -> impl Iterator<Item = *mut c_void> + '_ {
    state.iter_mut().map(arg)
}

impl CudaStreamOp {
    fn store_state(
        &self,
        ctx: &mut Context<'_>,
        index: usize,
        plan: &StreamPlan,
        ordinal: u32,
        stream: *mut c_void,
    ) -> Result<()> {
        let runtime = |message: String| Error::Runtime { op: self.op, call: "CUDA", message };
        if ctx.output_count()? <= index {
            return Ok(());
        }
        let Some(out) = ctx.output_opt(index, &[6])? else { return Ok(()) };
        device_output(self.op, ordinal, &out, index, "state_out")?;
        let function = trainops_cuda::function(ordinal, "trainops_store_state").map_err(|e| runtime(e.to_string()))?;
        let mut next = plan.next;
        let mut p = out.ptr;
        let mut args: Vec<*mut c_void> = vec![arg(&mut p)];
        args.extend(state_args(&mut next));
        // SAFETY: the parameters of trainops_store_state: a device pointer to six uint32 (the
        // output, checked by its shape) and six words; all outlive the launch, which copies them.
        unsafe { trainops_cuda::launch(ordinal, &function, 1, stream, &mut args) }.map_err(|e| runtime(e.to_string()))
    }
}

impl Kernel for CudaStreamOp {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let runtime = |message: String| Error::Runtime { op: self.op, call: "CUDA", message };
        let plan = (self.plan)(ctx)?;
        let stream: *mut c_void = match self.stream {
            StreamFrom::DefaultSynchronised => core::ptr::null_mut(),
            StreamFrom::ComputeStream => ctx.gpu_stream()?,
        };
        let out = ctx.output(0, &plan.dims)?;
        let ordinal = ctx.output_device_id(0, &plan.dims)?;
        device_output(self.op, ordinal, &out, 0, "output")?;
        let mut staged = Staged::new(self.op, ordinal, stream);
        let (_, grid) = launch_shape(out.numel);
        let mut numel = out.numel as u64;
        let mut state = plan.state;
        match self.kind {
            StreamKind::Philox => {
                if out.numel > 0 {
                    let function = trainops_cuda::function(ordinal, "trainops_philox_words")
                        .map_err(|e| runtime(e.to_string()))?;
                    let mut p = out.ptr;
                    let mut args: Vec<*mut c_void> = vec![arg(&mut p), arg(&mut numel)];
                    args.extend(state_args(&mut state));
                    // SAFETY: trainops_philox_words(u32* out, u64 n, six u32): the output holds
                    // n uint32; the arguments outlive the launch.
                    unsafe { trainops_cuda::launch(ordinal, &function, grid, stream, &mut args) }
                        .map_err(|e| runtime(e.to_string()))?;
                }
                self.store_state(ctx, 1, &plan, ordinal, stream)?;
            }
            StreamKind::Uniform(u) => {
                let words = out.numel * if u.dtype == 3 { 2 } else { 1 };
                if words > 0 {
                    let function =
                        trainops_cuda::function(ordinal, "trainops_uniform").map_err(|e| runtime(e.to_string()))?;
                    let (_, grid) = launch_shape(words);
                    let (mut p, mut code, mut count) = (out.ptr, u.dtype, words as u64);
                    let (mut mask, mut shift, mut range, mut low, mut range64, mut low64) =
                        (u.mask, u.shift, u.range, u.low, u.range64, u.low64);
                    let mut args: Vec<*mut c_void> = vec![arg(&mut p), arg(&mut code), arg(&mut count)];
                    args.extend(state_args(&mut state));
                    args.extend([arg(&mut mask), arg(&mut shift), arg(&mut range), arg(&mut low)]);
                    args.extend([arg(&mut range64), arg(&mut low64)]);
                    // SAFETY: trainops_uniform(void* out, int dtype, u64 words, six u32, u32 mask,
                    // u32 shift, float range, float low, double range64, double low64): the
                    // output holds `words` (float64: words / 2) elements of the type `dtype`
                    // names (the node's registration); the arguments outlive the launch.
                    unsafe { trainops_cuda::launch(ordinal, &function, grid, stream, &mut args) }
                        .map_err(|e| runtime(e.to_string()))?;
                }
                self.store_state(ctx, 1, &plan, ordinal, stream)?;
            }
            StreamKind::Normal(a) => {
                if out.numel > 0 {
                    let function =
                        trainops_cuda::function(ordinal, "trainops_normal").map_err(|e| runtime(e.to_string()))?;
                    // One thread per 4-word block: four elements, two for float64.
                    let per_block = if a.dtype == 3 { 2 } else { 4 };
                    let (_, grid) = launch_shape(out.numel.div_ceil(per_block) * 4);
                    let (mut p, mut code) = (out.ptr, a.dtype);
                    let (mut mean, mut scale, mut mean64, mut scale64) = (a.mean, a.scale, a.mean64, a.scale64);
                    let mut args: Vec<*mut c_void> = vec![arg(&mut p), arg(&mut code), arg(&mut numel)];
                    args.extend(state_args(&mut state));
                    args.extend([arg(&mut mean), arg(&mut scale), arg(&mut mean64), arg(&mut scale64)]);
                    // SAFETY: trainops_normal(void* out, int dtype, u64 n, six u32, float mean,
                    // float scale, double mean64, double scale64): the output holds n elements of
                    // the type `dtype` names (the node's registration); the arguments outlive the
                    // launch, which copies them.
                    unsafe { trainops_cuda::launch(ordinal, &function, grid, stream, &mut args) }
                        .map_err(|e| runtime(e.to_string()))?;
                }
                self.store_state(ctx, 1, &plan, ordinal, stream)?;
            }
            StreamKind::Dropout => {
                let data = ctx.input(0)?.ok_or_else(|| runtime("missing data".into()))?;
                let mask = if ctx.output_count()? > 1 { ctx.output_opt(1, &plan.dims)? } else { None };
                if let Some(m) = &mask {
                    if m.dtype != DType::Bool || m.numel != out.numel {
                        return Err(Error::input(
                            self.op,
                            1,
                            "mask",
                            "tensor(bool) of the data's shape",
                            m.dtype.name(),
                        ));
                    }
                }
                if out.numel > 0 {
                    let (mut from, mut scale) = plan.dropout.unwrap_or((0, 1.0));
                    if let Some(m) = &mask {
                        device_output(self.op, ordinal, m, 1, "mask")?;
                    }
                    let mut src = staged.readable(&data)?;
                    let mut dst = out.ptr;
                    let mut mask_ptr: *mut c_void = mask.as_ref().map_or(core::ptr::null_mut(), |m| m.ptr);
                    let function =
                        trainops_cuda::function(ordinal, "trainops_dropout_f32").map_err(|e| runtime(e.to_string()))?;
                    let mut args: Vec<*mut c_void> =
                        vec![arg(&mut src), arg(&mut dst), arg(&mut mask_ptr), arg(&mut numel)];
                    args.extend(state_args(&mut state));
                    args.push(arg(&mut from));
                    args.push(arg(&mut scale));
                    // SAFETY: trainops_dropout_f32(const float*, float*, u8* or null, u64 n,
                    // six u32, u32 keep_from, float scale): data and output hold n float32 (the
                    // same buffer in place, else disjoint), the mask n bools; inference mode is
                    // keep_from 0, scale 1 (every element kept, multiplied by 1: the data).
                    unsafe { trainops_cuda::launch(ordinal, &function, grid, stream, &mut args) }
                        .map_err(|e| runtime(e.to_string()))?;
                }
                self.store_state(ctx, 2, &plan, ordinal, stream)?;
            }
        }
        if self.stream == StreamFrom::DefaultSynchronised {
            // SAFETY: the default stream.
            unsafe { trainops_cuda::synchronize(ordinal, core::ptr::null_mut()) }
                .map_err(|e| runtime(e.to_string()))?;
        }
        Ok(())
    }
}

/// The CUDA kernel of a node of `spec`, on `stream`, or an error naming `door` when the op
/// has none.
fn cuda_kernel(
    spec: &'static dyn OpSpec,
    info: &KernelInfo<'_>,
    stream: StreamFrom,
    door: &'static str,
) -> Result<Box<dyn Kernel>> {
    let op = spec.op();
    match spec.device_op(info)? {
        Some(DeviceOp::Optimizer(step)) => Ok(Box::new(CudaOptimizer::new(spec, step, stream))),
        Some(DeviceOp::Philox(plan)) => Ok(Box::new(CudaStreamOp { op, kind: StreamKind::Philox, plan, stream })),
        Some(DeviceOp::Dropout(plan)) => Ok(Box::new(CudaStreamOp { op, kind: StreamKind::Dropout, plan, stream })),
        Some(DeviceOp::Uniform(plan, args)) => {
            Ok(Box::new(CudaStreamOp { op, kind: StreamKind::Uniform(args), plan, stream }))
        }
        Some(DeviceOp::Normal(plan, args)) => {
            Ok(Box::new(CudaStreamOp { op, kind: StreamKind::Normal(args), plan, stream }))
        }
        Some(DeviceOp::AllFinite) => Ok(Box::new(CudaAllFinite { op, stream })),
        Some(DeviceOp::LossScale(rule)) => Ok(Box::new(CudaLossScale { op, rule, stream })),
        Some(DeviceOp::MixedAdam(step)) => Ok(Box::new(CudaMixedAdam { op, step, stream })),
        None => Err(Error::Runtime {
            op,
            call: door,
            message: "this op has no CUDA kernel yet; its nodes belong on the CPU".into(),
        }),
    }
}

/// The device kernels of the `CUDAExecutionProvider` registration: the op's CUDA kernel on the
/// provider's compute stream.
pub struct CudaEpKernels;

impl DeviceKernels for CudaEpKernels {
    fn create(&self, spec: &'static dyn OpSpec, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        cuda_kernel(spec, info, StreamFrom::ComputeStream, "CUDAExecutionProvider")
    }
}

/// The one instance.
pub static CUDA_EP_KERNELS: CudaEpKernels = CudaEpKernels;

/// Device kernels of CUDA mode: the op's CUDA kernel, launched on the default stream and
/// synchronised (the plugin EP is not stream aware).
struct CudaKernels;

impl DeviceKernels for CudaKernels {
    fn create(&self, spec: &'static dyn OpSpec, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>> {
        cuda_kernel(spec, info, StreamFrom::DefaultSynchronised, "TrainopsExecutionProvider")
    }
}

static CUDA_KERNELS: CudaKernels = CudaKernels;

/// The device kernels of CUDA mode.
pub fn cuda_kernels() -> &'static dyn DeviceKernels {
    &CUDA_KERNELS
}
