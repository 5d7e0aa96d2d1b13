//! Op descriptors: a static `OrtCustomOp` per op, whose callbacks dispatch to an [`OpSpec`].
//!
//! Every callback of the struct is set: with `version >= 17` the runtime calls some of them
//! (`GetEndVersion`, for one) without checking for null, and a null there is a crash.

use core::ffi::{c_char, c_int, c_void};
use std::ffi::CStr;

use ort_sys as sys;

use super::api::{boundary, guard, API_VERSION};
use super::device::{DeviceOp, DeviceStep};
use super::{Api, Context, KernelInfo, ShapeInfer};
use crate::error::Result;
use crate::ffi::tensor::DType;

/// One formal input or output of an op.
#[derive(Debug, Clone, Copy)]
pub enum Formal {
    /// Exactly one tensor; `None` means any element type (checked by the kernel).
    One(Option<DType>),
    /// Zero or one tensor.
    Optional(Option<DType>),
    /// The rest of the node's inputs (or outputs): at least `min`, types may differ.
    Variadic {
        /// Element type, `None` for any.
        dtype: Option<DType>,
        /// Lower bound on the count of this formal alone (the runtime adds the fixed ones).
        min: usize,
    },
}

/// What the runtime sees of an op before any node: its name and formal inputs and outputs.
#[derive(Debug)]
pub struct Signature {
    /// The op's name in its domain.
    pub name: &'static CStr,
    /// The op's formal inputs, in order.
    pub inputs: &'static [Formal],
    /// The op's formal outputs, in order.
    pub outputs: &'static [Formal],
}

/// An op as registered with ONNX Runtime.
pub trait OpSpec: Sync + 'static {
    /// The op's name and formal inputs and outputs.
    fn signature(&self) -> &Signature;
    /// The op's name in its domain.
    fn name(&self) -> &'static CStr {
        self.signature().name
    }
    /// The op's formal inputs, in order.
    fn inputs(&self) -> &'static [Formal] {
        self.signature().inputs
    }
    /// The op's formal outputs, in order.
    fn outputs(&self) -> &'static [Formal] {
        self.signature().outputs
    }
    /// First opset version of the domain this op belongs to.
    fn since_version(&self) -> c_int {
        1
    }
    /// Creates the kernel of one node (reads and checks its attributes).
    fn create(&'static self, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>>;
    /// Sets output shapes at model load, best effort: ONNX Runtime ignores an error here (the
    /// kernel reports it when it runs), and ops with an optional input get no inference at all
    /// (ONNX Runtime 1.17 crashes building the context of a node whose optional input is "").
    fn infer(&self, _ctx: &mut ShapeInfer<'_>) -> Result<()> {
        Ok(())
    }
    /// Whether [`OpSpec::infer`] sets an output's element type (an output whose type no input
    /// decides needs it). On ONNX Runtime 1.24 and newer such an op gets its inference
    /// callback even with optional inputs; older runtimes ignore the type it sets (1.17, 1.18)
    /// or crash on a node whose optional input is "" (up to 1.23), so there it gets none (see
    /// `OpDescriptor::leak` and `ffi::register`).
    fn infers_output_types(&self) -> bool {
        false
    }
    /// How a node of this op runs on a CUDA device: the kernel of `trainops_cuda::PTX` and its
    /// per-call coefficients, or `None` when the op has no CUDA kernel (its nodes then stay on
    /// the CPU). Reads the node's attributes as [`OpSpec::create`] does.
    fn device_step(&'static self, _info: &KernelInfo<'_>) -> Result<Option<DeviceStep>> {
        Ok(None)
    }
    /// How a node of this op runs on a CUDA device, of any kind ([`DeviceOp`]): by default
    /// the optimizer step of [`OpSpec::device_step`].
    fn device_op(&'static self, info: &KernelInfo<'_>) -> Result<Option<DeviceOp>> {
        Ok(self.device_step(info)?.map(DeviceOp::Optimizer))
    }
    /// The op name as `&str`, for messages.
    fn op(&self) -> &'static str {
        self.name().to_str().unwrap_or("trainops op")
    }
}

/// The kernel of one node.
pub trait Kernel: Send + Sync {
    /// Runs the node once.
    fn compute(&self, ctx: &mut Context<'_>) -> Result<()>;
}

/// A registered op: the C struct the runtime calls through, then the spec it serves.
/// `#[repr(C)]` with `base` first, so the runtime's `*const OrtCustomOp` is a pointer to us.
#[repr(C)]
pub struct OpDescriptor {
    base: sys::OrtCustomOp,
    spec: &'static dyn OpSpec,
    placement: Placement,
}

/// Which execution provider an op descriptor is registered for.
#[derive(Clone, Copy)]
pub enum Placement {
    /// ONNX Runtime's CPU execution provider (`RegisterCustomOps`, and the CPU twin of each op
    /// in the plugin EP's domains).
    Cpu,
    /// Another execution provider, by name; the formal inputs listed in `host_inputs` (R, T
    /// and other scalars) are declared `OrtMemTypeCPUInput`, so they arrive in host memory;
    /// `kernel` makes the node's kernel (the CPU kernel in fake-device mode).
    Device {
        /// The provider's name, e.g. `TrainopsExecutionProvider`.
        ep: &'static CStr,
        /// Formal inputs kept in host memory.
        host_inputs: &'static [usize],
        /// Makes the kernel of one node placed on the device.
        kernel: &'static dyn DeviceKernels,
    },
}

/// The kernels an op runs with when its node is placed on a device provider.
pub trait DeviceKernels: Sync + 'static {
    /// The kernel of one node of `spec` (attributes read through `info`).
    fn create(&self, spec: &'static dyn OpSpec, info: &KernelInfo<'_>) -> Result<Box<dyn Kernel>>;
}

// SAFETY: a descriptor is built once, never mutated, and holds only function pointers and
// a `Sync` spec, so sharing it between the runtime's threads is sound.
unsafe impl Sync for OpDescriptor {}
// SAFETY: as above; it owns no thread-bound resource.
unsafe impl Send for OpDescriptor {}

struct KernelBox {
    api: Api,
    op: &'static str,
    kernel: Box<dyn Kernel>,
}

/// # Safety
/// `op` must point to the `base` field of a live [`OpDescriptor`].
unsafe fn spec_of(op: *const sys::OrtCustomOp) -> &'static dyn OpSpec {
    // SAFETY: every OrtCustomOp we hand out is the first field of a leaked OpDescriptor.
    unsafe { (*(op as *const OpDescriptor)).spec }
}

/// Runs an infallible callback of the descriptor through the panic [`boundary`]: these
/// callbacks cannot return a status, so a panic gives the return type's harmless fallback.
fn quiet<T: super::api::Fallback>(f: impl FnOnce() -> T) -> T {
    boundary(None, "trainops", f)
}

fn formal_at(list: &'static [Formal], index: usize) -> Option<Formal> {
    list.get(index).copied()
}

fn type_of(f: Option<Formal>) -> sys::ONNXTensorElementDataType {
    let dtype = match f {
        Some(Formal::One(d) | Formal::Optional(d) | Formal::Variadic { dtype: d, .. }) => d,
        None => None,
    };
    dtype.map_or(sys::ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, DType::to_sys)
}

fn characteristic(f: Option<Formal>) -> sys::OrtCustomOpInputOutputCharacteristic {
    use sys::OrtCustomOpInputOutputCharacteristic::*;
    match f {
        Some(Formal::Optional(_)) => INPUT_OUTPUT_OPTIONAL,
        Some(Formal::Variadic { .. }) => INPUT_OUTPUT_VARIADIC,
        _ => INPUT_OUTPUT_REQUIRED,
    }
}

/// How many outputs every node of an op has: the required ones up to the first optional one,
/// and a variadic formal's minimum.
fn sure_outputs(list: &'static [Formal]) -> usize {
    let mut n = 0;
    for f in list {
        match f {
            Formal::One(_) => n += 1,
            Formal::Variadic { min, .. } => return n + min,
            Formal::Optional(_) => return n,
        }
    }
    n
}

fn variadic_min(list: &'static [Formal]) -> c_int {
    list.iter()
        .find_map(|f| match f {
            Formal::Variadic { min, .. } => Some(c_int::try_from(*min).unwrap_or(1)),
            _ => None,
        })
        .unwrap_or(1)
}

unsafe extern "system" fn get_name(op: *const sys::OrtCustomOp) -> *const c_char {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| unsafe { spec_of(op) }.name().as_ptr())
}

/// # Safety
/// `op` must point to the `base` field of a live [`OpDescriptor`].
unsafe fn placement_of(op: *const sys::OrtCustomOp) -> Placement {
    // SAFETY: every OrtCustomOp we hand out is the first field of a leaked OpDescriptor.
    unsafe { (*(op as *const OpDescriptor)).placement }
}

unsafe extern "system" fn get_ep(op: *const sys::OrtCustomOp) -> *const c_char {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| match unsafe { placement_of(op) } {
        Placement::Cpu => c"CPUExecutionProvider".as_ptr(),
        Placement::Device { ep, .. } => ep.as_ptr(),
    })
}

unsafe extern "system" fn input_type(op: *const sys::OrtCustomOp, i: usize) -> sys::ONNXTensorElementDataType {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| type_of(formal_at(unsafe { spec_of(op) }.inputs(), i)))
}

unsafe extern "system" fn input_count(op: *const sys::OrtCustomOp) -> usize {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| unsafe { spec_of(op) }.inputs().len())
}

unsafe extern "system" fn output_type(op: *const sys::OrtCustomOp, i: usize) -> sys::ONNXTensorElementDataType {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| type_of(formal_at(unsafe { spec_of(op) }.outputs(), i)))
}

unsafe extern "system" fn output_count(op: *const sys::OrtCustomOp) -> usize {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| unsafe { spec_of(op) }.outputs().len())
}

unsafe extern "system" fn input_characteristic(
    op: *const sys::OrtCustomOp,
    i: usize,
) -> sys::OrtCustomOpInputOutputCharacteristic {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| characteristic(formal_at(unsafe { spec_of(op) }.inputs(), i)))
}

unsafe extern "system" fn output_characteristic(
    op: *const sys::OrtCustomOp,
    i: usize,
) -> sys::OrtCustomOpInputOutputCharacteristic {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| characteristic(formal_at(unsafe { spec_of(op) }.outputs(), i)))
}

unsafe extern "system" fn input_min_arity(op: *const sys::OrtCustomOp) -> c_int {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| variadic_min(unsafe { spec_of(op) }.inputs()))
}

unsafe extern "system" fn output_min_arity(op: *const sys::OrtCustomOp) -> c_int {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| variadic_min(unsafe { spec_of(op) }.outputs()))
}

unsafe extern "system" fn heterogeneous(_op: *const sys::OrtCustomOp) -> c_int {
    0
}

unsafe extern "system" fn start_version(op: *const sys::OrtCustomOp) -> c_int {
    // SAFETY: the runtime passes back the pointer we registered.
    quiet(|| unsafe { spec_of(op) }.since_version())
}

unsafe extern "system" fn end_version(_op: *const sys::OrtCustomOp) -> c_int {
    c_int::MAX
}

unsafe extern "system" fn memory_type(op: *const sys::OrtCustomOp, i: usize) -> sys::OrtMemType {
    // SAFETY: the runtime passes back the pointer we registered.
    let host = quiet(|| match unsafe { placement_of(op) } {
        Placement::Device { host_inputs, .. } => usize::from(host_inputs.contains(&i)),
        Placement::Cpu => 0,
    });
    if host == 1 {
        sys::OrtMemType::OrtMemTypeCPUInput
    } else {
        sys::OrtMemType::OrtMemTypeDefault
    }
}

unsafe extern "system" fn create_kernel(
    op: *const sys::OrtCustomOp,
    api: *const sys::OrtApi,
    info: *const sys::OrtKernelInfo,
    kernel: *mut *mut c_void,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes its own API table, which it checked is at least the
    // version our descriptor declares (17), and the pointer we registered.
    let (api, spec, placement) = unsafe { (Api::from_raw(api), spec_of(op), placement_of(op)) };
    let name = spec.op();
    guard(api, name, || {
        // SAFETY: `info` is valid during this call, and so is the wrapper.
        let info = unsafe { KernelInfo::new(api, name, info) };
        let made = match placement {
            Placement::Cpu => spec.create(&info)?,
            Placement::Device { kernel: kernels, .. } => kernels.create(spec, &info)?,
        };
        let boxed = Box::new(KernelBox { api, op: name, kernel: made });
        // SAFETY: `kernel` is the runtime's out pointer; it hands the box back to
        // `compute_kernel` and `destroy_kernel`.
        unsafe { *kernel = Box::into_raw(boxed).cast() };
        Ok(())
    })
}

unsafe extern "system" fn compute_kernel(kernel: *mut c_void, ctx: *mut sys::OrtKernelContext) -> sys::OrtStatusPtr {
    // SAFETY: `kernel` is the box `create_kernel` made, alive until `destroy_kernel`; the
    // runtime may call compute from several threads at once, so it is only borrowed shared.
    let k = unsafe { &*(kernel as *const KernelBox) };
    guard(k.api, k.op, || {
        // SAFETY: `ctx` is the context of this call.
        let mut ctx = unsafe { Context::new(k.api, k.op, ctx) };
        k.kernel.compute(&mut ctx)
    })
}

unsafe extern "system" fn destroy_kernel(kernel: *mut c_void) {
    if kernel.is_null() {
        return;
    }
    // SAFETY: the runtime destroys each kernel it created exactly once.
    let boxed = unsafe { Box::from_raw(kernel as *mut KernelBox) };
    // A panicking destructor must not unwind into the runtime.
    boundary(Some(boxed.api), boxed.op, move || drop(boxed));
}

unsafe extern "system" fn infer_shape(
    op: *const sys::OrtCustomOp,
    ctx: *mut sys::OrtShapeInferContext,
) -> sys::OrtStatusPtr {
    let Some(api) = super::api::global() else {
        return sys::OrtStatusPtr::default();
    };
    // SAFETY: the runtime passes back the pointer we registered.
    let spec = unsafe { spec_of(op) };
    let name = spec.op();
    // ONNX Runtime (1.17 to 1.31 at least) ignores the status this callback returns and never
    // releases it: an error status fails nothing and leaks (one per node load, seen with
    // valgrind). Inference is best effort; the kernel makes the same checks when it runs and
    // reports them then. So errors and panics end here, and the answer is always "ok".
    boundary(Some(api), name, || {
        // SAFETY: `ctx` is valid for this call.
        let mut ctx = unsafe { ShapeInfer::new(api, name, ctx, sure_outputs(spec.outputs())) };
        let _ = spec.infer(&mut ctx);
    });
    sys::OrtStatusPtr::default()
}

impl OpDescriptor {
    /// The descriptor of `spec`, leaked: the runtime keeps pointers to it for as long as
    /// any session lives, which may be the whole process.
    /// `typed_inference`: the runtime (1.24+) takes output types from inference callbacks and
    /// builds their context safely.
    pub fn leak(spec: &'static dyn OpSpec, typed_inference: bool) -> &'static OpDescriptor {
        Self::leak_placed(spec, Placement::Cpu, typed_inference)
    }

    /// The descriptor of `spec` for the provider `placement` names, leaked like [`Self::leak`].
    pub fn leak_placed(
        spec: &'static dyn OpSpec,
        placement: Placement,
        typed_inference: bool,
    ) -> &'static OpDescriptor {
        let base = sys::OrtCustomOp {
            version: API_VERSION,
            CreateKernel: None,
            GetName: Some(get_name),
            GetExecutionProviderType: Some(get_ep),
            GetInputType: Some(input_type),
            GetInputTypeCount: Some(input_count),
            GetOutputType: Some(output_type),
            GetOutputTypeCount: Some(output_count),
            KernelCompute: None,
            KernelDestroy: Some(destroy_kernel),
            GetInputCharacteristic: Some(input_characteristic),
            GetOutputCharacteristic: Some(output_characteristic),
            GetInputMemoryType: Some(memory_type),
            GetVariadicInputMinArity: Some(input_min_arity),
            GetVariadicInputHomogeneity: Some(heterogeneous),
            GetVariadicOutputMinArity: Some(output_min_arity),
            GetVariadicOutputHomogeneity: Some(heterogeneous),
            CreateKernelV2: Some(create_kernel),
            KernelComputeV2: Some(compute_kernel),
            // ONNX Runtime 1.17 dereferences a null type while building the inference
            // context of a node whose optional input is given as "": no inference for such ops.
            // Ops that must set an output's type keep it where the runtime uses the type and
            // builds that context safely (1.24+).
            InferOutputShapeFn: if (spec.infers_output_types() && typed_inference)
                || !spec.inputs().iter().any(|f| matches!(f, Formal::Optional(_)))
            {
                Some(infer_shape)
            } else {
                None
            },
            GetStartVersion: Some(start_version),
            GetEndVersion: Some(end_version),
        };
        Box::leak(Box::new(OpDescriptor { base, spec, placement }))
    }

    /// The pointer to hand to `CustomOpDomain_Add`.
    pub fn as_raw(&'static self) -> *const sys::OrtCustomOp {
        &self.base
    }
}
