//! The CUDA kernels of the mixed-precision ops (`AllFinite`, `DynamicLossScale`,
//! `MixedPrecisionAdam`): every verdict, scale and flag stays on the device, on the node's
//! stream, with no host synchronisation on the CUDA execution provider. UNVERIFIED on a GPU in
//! this tree: `tests/test_cuda_mirror.py` checks a numpy transcription of each kernel against
//! the CPU op bitwise, and `scripts/gpu_check` part 1 the PTX against the CPU op on a GPU.
//!
//! The verdict: `trainops_set_flag` writes 1 into the node's bool output, then
//! `trainops_finite` over each tensor stores 0 on any Inf or NaN (after division by the loss
//! scale for MixedPrecisionAdam); `trainops_mp_adam` then reads that byte and skips every
//! element when it is 0 (its outputs were first copied from its inputs, as the CPU's skipped
//! step leaves them).

use core::ffi::c_void;

use trainops_kernels::loss_scale::LossScaleRule;

use super::launch::{arg, host_r_t, stream_of, StreamFrom};
use super::staging::{device_output, Staged};
use crate::error::{Error, Result};
use crate::ffi::device::MixedAdamStep;
use crate::ffi::tensor::{DType, Tensor};
use crate::ffi::{Context, Kernel};

/// Threads per block of every launch; the grid-stride loops cover the rest.
const GRID_MAX: usize = 65_535 * 8;

fn grid(numel: usize) -> u32 {
    u32::try_from(numel.div_ceil(256).clamp(1, GRID_MAX)).unwrap_or(u32::MAX)
}

fn runtime(op: &'static str) -> impl Fn(trainops_cuda::Error) -> Error {
    move |e| Error::Runtime { op, call: "CUDA", message: e.to_string() }
}

/// Launches `kernel` with `args` on `stream`.
///
/// # Safety
/// `args` are, in order, the kernel's parameters (`trainops.cu`), device pointers to buffers
/// of the sizes the kernel reads and writes, alive until the node's work on `stream` is done.
unsafe fn launch(
    op: &'static str,
    ordinal: u32,
    kernel: &str,
    blocks: u32,
    stream: *mut c_void,
    args: &mut [*mut c_void],
) -> Result<()> {
    let function = trainops_cuda::function(ordinal, kernel).map_err(runtime(op))?;
    // SAFETY: the caller's contract.
    unsafe { trainops_cuda::launch(ordinal, &function, blocks, stream, args) }.map_err(runtime(op))
}

fn finish(op: &'static str, from: StreamFrom, ordinal: u32) -> Result<()> {
    if from == StreamFrom::DefaultSynchronised {
        // SAFETY: the default stream.
        unsafe { trainops_cuda::synchronize(ordinal, core::ptr::null_mut()) }.map_err(runtime(op))?;
    }
    Ok(())
}

/// The `trainops_finite` / `load_f32` type code of a tensor.
fn type_code(t: &Tensor, allow_double: bool) -> Option<i32> {
    match t.dtype {
        DType::Float => Some(0),
        DType::Float16 => Some(1),
        DType::BFloat16 => Some(2),
        DType::Double if allow_double => Some(3),
        _ => None,
    }
}

/// Sets the bool `flag` to 1, then to 0 when an element of a tensor of `tensors` (divided by
/// `*scale` when given) is not finite.
fn verdict(
    op: &'static str,
    ordinal: u32,
    stream: *mut c_void,
    flag: *mut c_void,
    tensors: &[(*mut c_void, usize, i32)],
    scale: *mut c_void,
) -> Result<()> {
    let (mut f, mut one) = (flag, 1u8);
    // SAFETY: trainops_set_flag(u8*, u8): the flag is the node's one-byte bool output.
    unsafe { launch(op, ordinal, "trainops_set_flag", 1, stream, &mut [arg(&mut f), arg(&mut one)]) }?;
    for &(ptr, numel, code) in tensors.iter().filter(|t| t.1 > 0) {
        let (mut p, mut c, mut n, mut s) = (ptr, code, numel as u64, scale);
        let mut args = [arg(&mut p), arg(&mut c), arg(&mut n), arg(&mut s), arg(&mut f)];
        // SAFETY: trainops_finite(const void*, int, u64 n, const float* or null, u8*): the
        // tensor holds n elements of the type `code` names; the scale is one float or null.
        unsafe { launch(op, ordinal, "trainops_finite", grid(numel), stream, &mut args) }?;
    }
    Ok(())
}

fn bool_output(op: &'static str, ctx: &mut Context<'_>, index: usize, name: &'static str) -> Result<Tensor> {
    let out = ctx.output(index, &[])?;
    if out.dtype != DType::Bool || out.numel != 1 {
        return Err(Error::input(op, index, name, "a tensor(bool) with one element", out.dtype.name()));
    }
    Ok(out)
}

fn input(op: &'static str, ctx: &Context<'_>, index: usize, name: &str) -> Result<Tensor> {
    ctx.input(index)?.ok_or_else(|| Error::input(op, index, name.to_string(), "a tensor", "absent"))
}

/// A one-element input of type `dtype` on the device.
fn scalar_input(op: &'static str, ctx: &Context<'_>, index: usize, name: &'static str, dtype: DType) -> Result<Tensor> {
    let t = input(op, ctx, index, name)?;
    if t.dtype != dtype || t.numel != 1 {
        let got = format!("{} with shape {:?}", t.dtype.name(), t.shape);
        return Err(Error::input(op, index, name, format!("a {} with one element", dtype.name()), got));
    }
    Ok(t)
}

/// `AllFinite` on the device.
pub struct CudaAllFinite {
    pub(super) op: &'static str,
    pub(super) stream: StreamFrom,
}

impl Kernel for CudaAllFinite {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = self.op;
        let count = ctx.input_count()?;
        let mut tensors = Vec::with_capacity(count);
        for k in 0..count {
            let name = format!("X_{}", k + 1);
            let t = input(op, ctx, k, &name)?;
            let want = "tensor(float), tensor(double), tensor(float16) or tensor(bfloat16)";
            let code = type_code(&t, true).ok_or_else(|| Error::input(op, k, name, want, t.dtype.name()))?;
            tensors.push((t, code));
        }
        let stream = stream_of(ctx, self.stream)?;
        let ordinal = ctx.input_device_id(0)?;
        let out = bool_output(op, ctx, 0, "finite")?;
        device_output(op, ordinal, &out, 0, "finite")?;
        let mut staged = Staged::new(op, ordinal, stream);
        let mut read = Vec::with_capacity(tensors.len());
        for (t, code) in &tensors {
            read.push((staged.readable(t)?, t.numel, *code));
        }
        verdict(op, ordinal, stream, out.ptr, &read, core::ptr::null_mut())?;
        finish(op, self.stream, ordinal)
    }
}

/// `DynamicLossScale` on the device: one thread applies the node's rule.
pub struct CudaLossScale {
    pub(super) op: &'static str,
    pub(super) rule: LossScaleRule,
    pub(super) stream: StreamFrom,
}

impl Kernel for CudaLossScale {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = self.op;
        let scale = scalar_input(op, ctx, 0, "scale", DType::Float)?;
        let good = scalar_input(op, ctx, 1, "good_steps", DType::Int64)?;
        let finite = scalar_input(op, ctx, 2, "finite", DType::Bool)?;
        let stream = stream_of(ctx, self.stream)?;
        let ordinal = ctx.input_device_id(0)?;
        let out_scale = ctx.output(0, &scale.shape)?;
        let out_good = ctx.output(1, &good.shape)?;
        device_output(op, ordinal, &out_scale, 0, "scale_out")?;
        device_output(op, ordinal, &out_good, 1, "good_steps_out")?;
        let mut staged = Staged::new(op, ordinal, stream);
        let (s, g, f) = (staged.readable(&scale)?, staged.readable(&good)?, staged.readable(&finite)?);
        let r = self.rule;
        let (mut s, mut g, mut f, mut os, mut og) = (s, g, f, out_scale.ptr, out_good.ptr);
        let (mut interval, mut growth, mut backoff, mut min) =
            (r.growth_interval, r.growth_factor, r.backoff_factor, r.min_scale);
        let mut args = [
            arg(&mut s),
            arg(&mut g),
            arg(&mut f),
            arg(&mut os),
            arg(&mut og),
            arg(&mut interval),
            arg(&mut growth),
            arg(&mut backoff),
            arg(&mut min),
        ];
        // SAFETY: trainops_loss_scale(const float*, const i64*, const u8*, float*, i64*, i64,
        // float, float, float): one-element device buffers of those types (checked above; the
        // outputs have the inputs' shapes), then the rule; one thread reads before it writes.
        unsafe { launch(op, ordinal, "trainops_loss_scale", 1, stream, &mut args) }?;
        finish(op, self.stream, ordinal)
    }
}

/// `MixedPrecisionAdam` on the device.
pub struct CudaMixedAdam {
    pub(super) op: &'static str,
    pub(super) step: MixedAdamStep,
    pub(super) stream: StreamFrom,
}

/// One group of a node: X, G (with its type code), V, H.
struct Group {
    x: Tensor,
    g: Tensor,
    code: i32,
    v: Tensor,
    h: Tensor,
}

impl CudaMixedAdam {
    fn groups(&self, ctx: &Context<'_>, n: usize) -> Result<Vec<Group>> {
        let op = self.op;
        let float = |t: &Tensor, index: usize, name: &'static str| {
            if t.dtype == DType::Float {
                Ok(())
            } else {
                Err(Error::input(op, index, name, "tensor(float) on the CUDA device", t.dtype.name()))
            }
        };
        (0..n)
            .map(|i| {
                let at = |k: usize| 3 + k * n + i;
                let (x, g, v, h) = (
                    input(op, ctx, at(0), "X")?,
                    input(op, ctx, at(1), "G")?,
                    input(op, ctx, at(2), "V")?,
                    input(op, ctx, at(3), "H")?,
                );
                float(&x, at(0), "X")?;
                float(&v, at(2), "V")?;
                float(&h, at(3), "H")?;
                let want = "tensor(float), tensor(float16) or tensor(bfloat16)";
                let code = type_code(&g, false).ok_or_else(|| Error::input(op, at(1), "G", want, g.dtype.name()))?;
                for (t, k, name) in [(&g, 1, "G"), (&v, 2, "V"), (&h, 3, "H")] {
                    if t.numel != x.numel {
                        let got = format!("{:?}", t.shape);
                        return Err(Error::input(op, at(k), name, format!("the shape of X {:?}", x.shape), got));
                    }
                }
                Ok(Group { x, g, code, v, h })
            })
            .collect()
    }
}

impl Kernel for CudaMixedAdam {
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()> {
        let op = self.op;
        let (r, t) = host_r_t(op, ctx)?;
        let count = ctx.input_count()?;
        let n = count.saturating_sub(3) / 4;
        if n == 0 || 3 + 4 * n != count {
            return Err(Error::Arity { op, what: format!("{count} inputs do not form R, T, loss_scale and groups") });
        }
        let copies = usize::from(self.step.copy.is_some());
        let outputs = ctx.output_count()?;
        if outputs != 1 + (3 + copies) * n {
            let what = format!("{outputs} outputs for {n} groups (expected {})", 1 + (3 + copies) * n);
            return Err(Error::Arity { op, what });
        }
        let scale = scalar_input(op, ctx, 2, "loss_scale", DType::Float)?;
        let groups = self.groups(ctx, n)?;
        let stream = stream_of(ctx, self.stream)?;
        let ordinal = ctx.input_device_id(3)?;
        let finite = bool_output(op, ctx, 0, "finite")?;
        device_output(op, ordinal, &finite, 0, "finite")?;
        let mut staged = Staged::new(op, ordinal, stream);
        let scale_ptr = staged.readable(&scale)?;
        let mut grads = Vec::with_capacity(groups.len());
        for g in &groups {
            grads.push((staged.readable(&g.g)?, g.g.numel, g.code));
        }
        verdict(op, ordinal, stream, finite.ptr, &grads, scale_ptr)?;
        let (coeffs, _) = (self.step.coeffs)(r, t);
        for (i, grp) in groups.iter().enumerate() {
            let mut outs = [core::ptr::null_mut(); 3];
            for (s, input) in [&grp.x, &grp.v, &grp.h].into_iter().enumerate() {
                let out = ctx.output(1 + s * n + i, &input.shape)?;
                if out.dtype != DType::Float || out.numel != input.numel {
                    let want = "tensor(float) of its input's shape";
                    return Err(Error::input(op, 1 + s * n + i, "output", want, out.dtype.name()));
                }
                device_output(op, ordinal, &out, 1 + s * n + i, "output")?;
                staged.copy_into(&out, input, input.numel * 4)?;
                outs[s] = out.ptr;
            }
            let numel = grp.x.numel;
            if numel > 0 {
                let [mut x, mut v, mut h] = outs;
                let (mut g, mut code, mut count, mut sc, mut fl) =
                    (grads[i].0, grp.code, numel as u64, scale_ptr, finite.ptr);
                let mut cs = coeffs.clone();
                let mut args =
                    vec![arg(&mut x), arg(&mut g), arg(&mut code), arg(&mut v), arg(&mut h), arg(&mut count)];
                args.extend([arg(&mut sc), arg(&mut fl)]);
                args.extend(cs.iter_mut().map(arg));
                // SAFETY: trainops_mp_adam(float* x, const void* g, int, float* v, float* h, u64 n,
                // const float* scale, const u8* finite, eight floats): X/V/H outputs of n float32,
                // G of n elements of the coded type, the one-float scale, the bool output; the
                // coefficients are Adam's eight, in the kernel's order.
                unsafe { launch(op, ordinal, "trainops_mp_adam", grid(numel), stream, &mut args) }?;
            }
            if let Some(copy) = self.step.copy {
                let out = ctx.output(1 + 3 * n + i, &grp.x.shape)?;
                if out.dtype != copy || out.numel != numel {
                    return Err(Error::input(op, 1 + 3 * n + i, "X_copy", copy.name(), out.dtype.name()));
                }
                device_output(op, ordinal, &out, 1 + 3 * n + i, "X_copy")?;
                if numel > 0 {
                    let kernel = if copy == DType::Float16 { "trainops_cast_f16" } else { "trainops_cast_bf16" };
                    let (mut src, mut dst, mut count) = (outs[0], out.ptr, numel as u64);
                    // SAFETY: trainops_cast_*(const float*, u16*, u64 n): X_new holds n float32,
                    // X_copy n 16-bit values (checked), distinct outputs.
                    unsafe {
                        launch(
                            op,
                            ordinal,
                            kernel,
                            grid(numel),
                            stream,
                            &mut [arg(&mut src), arg(&mut dst), arg(&mut count)],
                        )
                    }?;
                }
            }
        }
        finish(op, self.stream, ordinal)
    }
}
