//! trainops' CUDA side, with nothing CUDA needed to build it:
//!
//! - `cuda/*.cu`: the kernels in CUDA C; `ptx/trainops.ptx` their PTX, made by
//!   `scripts/make_ptx` with NVRTC from PyPI (`--fmad=false`, IEEE division and square root)
//!   and committed; CI regenerates it and checks it matches ([`PTX`]).
//! - [`driver`]: the dozen CUDA driver calls trainops needs, from `libcuda.so.1` opened on
//!   first use with `dlopen`, so a process that never asks for a GPU never loads it.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

/// The kernels' PTX (NVRTC 12.0, `compute_70`), loaded with `cuModuleLoadData`.
pub const PTX: &str = include_str!("../ptx/trainops.ptx");

/// The kernel entry points in [`PTX`] (`extern "C"` names).
pub const KERNELS: &[&str] = &[
    "trainops_adam_f32",
    "trainops_adagrad_f32",
    "trainops_adamw_f32",
    "trainops_adamw_amsgrad_f32",
    "trainops_momentum_f32",
    "trainops_philox",
    "trainops_philox_words",
    "trainops_dropout_f32",
    "trainops_store_state",
    "trainops_uniform",
    "trainops_normal",
    "trainops_set_flag",
    "trainops_finite",
    "trainops_mp_adam",
    "trainops_cast_f16",
    "trainops_cast_bf16",
    "trainops_loss_scale",
];

/// What can go wrong talking to the driver.
#[derive(Debug, thiserror::Error, Clone)]
pub enum Error {
    /// `libcuda.so.1` is absent or lacks a symbol.
    #[error("CUDA driver not available: {0}")]
    NoDriver(String),
    /// A driver call returned an error code.
    #[error("CUDA driver call {call} failed with CUresult {code}")]
    Call {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: c_int,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuModule = *mut c_void;
type CuFunction = *mut c_void;
type CuStream = *mut c_void;
type DevicePtr = u64;

/// The driver entry points, resolved once.
pub mod driver {
    use super::*;

    /// Function pointers into `libcuda.so.1`.
    pub struct Driver {
        _lib: libloading::Library,
        pub(crate) init: unsafe extern "C" fn(c_uint) -> CuResult,
        pub(crate) device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
        pub(crate) device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
        pub(crate) device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
        pub(crate) primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
        pub(crate) ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
        pub(crate) mem_alloc: unsafe extern "C" fn(*mut DevicePtr, usize) -> CuResult,
        pub(crate) mem_free: unsafe extern "C" fn(DevicePtr) -> CuResult,
        pub(crate) memcpy: unsafe extern "C" fn(DevicePtr, DevicePtr, usize) -> CuResult,
        pub(crate) memcpy_dtod_async: unsafe extern "C" fn(DevicePtr, DevicePtr, usize, CuStream) -> CuResult,
        pub(crate) module_load_data: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
        pub(crate) module_get_function: unsafe extern "C" fn(*mut CuFunction, CuModule, *const i8) -> CuResult,
        #[allow(clippy::type_complexity)]
        pub(crate) launch_kernel: unsafe extern "C" fn(
            CuFunction,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            CuStream,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> CuResult,
        pub(crate) stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
        pub(crate) pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, DevicePtr) -> CuResult,
    }

    // SAFETY: the driver API is thread-safe; the struct holds only function pointers and the
    // library handle, never mutated.
    unsafe impl Send for Driver {}
    // SAFETY: as above.
    unsafe impl Sync for Driver {}

    static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();

    fn open() -> Result<Driver> {
        // SAFETY: loading the system's CUDA driver runs its initialisers, which are designed
        // to be dlopen'ed by any process.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| Error::NoDriver(e.to_string()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is the driver function of that name, whose C signature
                // (cuda.h, the `_v2` ABI where named) is the field's type.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| Error::NoDriver(e.to_string()))?
            };
        }
        let d = Driver {
            init: sym!("cuInit"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            device_get_pci_bus_id: sym!("cuDeviceGetPCIBusId"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            memcpy: sym!("cuMemcpy"),
            memcpy_dtod_async: sym!("cuMemcpyDtoDAsync_v2"),
            module_load_data: sym!("cuModuleLoadData"),
            module_get_function: sym!("cuModuleGetFunction"),
            launch_kernel: sym!("cuLaunchKernel"),
            stream_synchronize: sym!("cuStreamSynchronize"),
            pointer_get_attribute: sym!("cuPointerGetAttribute"),
            _lib: lib,
        };
        // SAFETY: cuInit(0) is the documented first call.
        check("cuInit", unsafe { (d.init)(0) })?;
        Ok(d)
    }

    /// The driver, opened on first call.
    pub fn get() -> Result<&'static Driver> {
        DRIVER.get_or_init(open).as_ref().map_err(Clone::clone)
    }

    pub(crate) fn check(call: &'static str, code: CuResult) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Call { call, code })
        }
    }
}

use driver::check;

/// GPUs the driver reports (opens the driver).
pub fn device_count() -> Result<u32> {
    let d = driver::get()?;
    let mut n = 0;
    // SAFETY: a valid out pointer, after cuInit.
    check("cuDeviceGetCount", unsafe { (d.device_get_count)(&mut n) })?;
    Ok(u32::try_from(n).unwrap_or(0))
}

/// The PCI bus id of GPU `ordinal` as the driver writes it (`domain:bus:device.function` in
/// hexadecimal, e.g. `0000:65:00.0`): how a CUDA ordinal is matched to the device ONNX
/// Runtime discovered (its `pci_bus_id` metadata), whatever order either lists them in.
pub fn pci_bus_id(ordinal: u32) -> Result<String> {
    let d = driver::get()?;
    let mut dev = 0;
    let mut buf = [0 as c_char; 32];
    // SAFETY: valid out pointers after cuInit; the buffer's length is passed (the driver
    // writes a NUL-terminated string of at most that many bytes).
    unsafe {
        check("cuDeviceGet", (d.device_get)(&mut dev, ordinal as c_int))?;
        check("cuDeviceGetPCIBusId", (d.device_get_pci_bus_id)(buf.as_mut_ptr(), buf.len() as c_int, dev))?;
    }
    // SAFETY: NUL-terminated by the driver within the buffer (zeroed, so a NUL is there).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

struct Contexts(Vec<(u32, usize)>);
static CONTEXTS: Mutex<Contexts> = Mutex::new(Contexts(Vec::new()));

/// Makes device `ordinal`'s primary context current on this thread (ONNX Runtime may call from
/// any thread), retaining it once per process.
fn make_current(ordinal: u32) -> Result<&'static driver::Driver> {
    let d = driver::get()?;
    let mut ctxs = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = match ctxs.0.iter().find(|(o, _)| *o == ordinal) {
        Some(&(_, c)) => c as CuContext,
        None => {
            let mut dev = 0;
            let mut ctx: CuContext = std::ptr::null_mut();
            // SAFETY: valid out pointers; the primary context is retained for the process.
            unsafe {
                check("cuDeviceGet", (d.device_get)(&mut dev, ordinal as c_int))?;
                check("cuDevicePrimaryCtxRetain", (d.primary_ctx_retain)(&mut ctx, dev))?;
            }
            ctxs.0.push((ordinal, ctx as usize));
            ctx
        }
    };
    // SAFETY: a retained primary context.
    check("cuCtxSetCurrent", unsafe { (d.ctx_set_current)(ctx) })?;
    Ok(d)
}

/// Whether the driver knows `p` (device, managed or registered host memory: what a kernel
/// on GPU `ordinal` may be handed), false for ordinary host memory: the driver's
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` of it, refused with `CUDA_ERROR_INVALID_VALUE` for
/// memory it did not allocate or register.
pub fn known_to_driver(ordinal: u32, p: *const c_void) -> Result<bool> {
    const MEMORY_TYPE: c_int = 2; // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    const INVALID_VALUE: CuResult = 1; // CUDA_ERROR_INVALID_VALUE
    let d = make_current(ordinal)?;
    let mut kind: c_uint = 0;
    // SAFETY: an out pointer of the attribute's type (CUmemorytype, an unsigned int); the
    // driver only reads its own tables for the address, whatever it is.
    match unsafe { (d.pointer_get_attribute)((&raw mut kind).cast(), MEMORY_TYPE, p as DevicePtr) } {
        0 => Ok(true),
        INVALID_VALUE => Ok(false),
        code => check("cuPointerGetAttribute", code).map(|()| false),
    }
}

/// `bytes` of device memory on GPU `ordinal`.
pub fn alloc(ordinal: u32, bytes: usize) -> Result<*mut c_void> {
    let d = make_current(ordinal)?;
    let mut p: DevicePtr = 0;
    // SAFETY: a valid out pointer in a current context.
    check("cuMemAlloc", unsafe { (d.mem_alloc)(&mut p, bytes) })?;
    Ok(p as *mut c_void)
}

/// Frees memory [`alloc`] returned.
///
/// # Safety
/// `p` came from [`alloc`] on `ordinal` and is freed once.
pub unsafe fn free(ordinal: u32, p: *mut c_void) -> Result<()> {
    let d = make_current(ordinal)?;
    // SAFETY: the caller's contract.
    check("cuMemFree", unsafe { (d.mem_free)(p as DevicePtr) })
}

/// Copies `bytes` between any two of host and device memory (unified addressing), with GPU
/// `ordinal`'s context current, complete on return.
///
/// # Safety
/// `dst` and `src` are host or device memory valid for `bytes` bytes.
pub unsafe fn copy(ordinal: u32, dst: *mut c_void, src: *const c_void, bytes: usize) -> Result<()> {
    let d = make_current(ordinal)?;
    // SAFETY: the caller's contract.
    check("cuMemcpy", unsafe { (d.memcpy)(dst as DevicePtr, src as DevicePtr, bytes) })
}

/// Copies `bytes` from device to device on `stream` (null: the legacy default stream),
/// ordered with the stream's other work.
///
/// # Safety
/// `dst` and `src` are device memory of GPU `ordinal` valid for `bytes` bytes until the copy
/// is done; `stream` is null or a live stream of its primary context.
pub unsafe fn copy_on(
    ordinal: u32,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: *mut c_void,
) -> Result<()> {
    let d = make_current(ordinal)?;
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoDAsync", unsafe { (d.memcpy_dtod_async)(dst as DevicePtr, src as DevicePtr, bytes, stream) })
}

/// A kernel of [`PTX`] on GPU `ordinal`.
pub struct Function(CuFunction);

// SAFETY: a CUfunction handle may be launched from any thread with its context current.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

static MODULES: Mutex<Vec<(u32, usize)>> = Mutex::new(Vec::new());

/// Looks up kernel `name` of [`PTX`], loading the module on GPU `ordinal` on first use.
pub fn function(ordinal: u32, name: &str) -> Result<Function> {
    let d = make_current(ordinal)?;
    let mut modules = MODULES.lock().unwrap_or_else(|p| p.into_inner());
    let module = match modules.iter().find(|(o, _)| *o == ordinal) {
        Some(&(_, m)) => m as CuModule,
        None => {
            let image = CString::new(PTX).map_err(|e| Error::NoDriver(e.to_string()))?;
            let mut m: CuModule = std::ptr::null_mut();
            // SAFETY: a NUL-terminated PTX image; the module lives for the process.
            check("cuModuleLoadData", unsafe { (d.module_load_data)(&mut m, image.as_ptr().cast()) })?;
            modules.push((ordinal, m as usize));
            m
        }
    };
    let cname = CString::new(name).map_err(|e| Error::NoDriver(e.to_string()))?;
    let mut f: CuFunction = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    check("cuModuleGetFunction", unsafe { (d.module_get_function)(&mut f, module, cname.as_ptr()) })?;
    Ok(Function(f))
}

/// Launches `f` with `blocks` x 256 threads on `stream` (null: the legacy default stream).
///
/// # Safety
/// `args` point to values of the kernel's parameter types, in order; device pointers among
/// them are valid for the kernel's accesses.
pub unsafe fn launch(
    ordinal: u32,
    f: &Function,
    blocks: u32,
    stream: *mut c_void,
    args: &mut [*mut c_void],
) -> Result<()> {
    let d = make_current(ordinal)?;
    // SAFETY: the caller's contract on `args`; a function of a loaded module.
    check("cuLaunchKernel", unsafe {
        (d.launch_kernel)(f.0, blocks.max(1), 1, 1, 256, 1, 1, 0, stream, args.as_mut_ptr(), std::ptr::null_mut())
    })
}

/// Waits for `stream`.
///
/// # Safety
/// `stream` is null or a live stream of device `ordinal`'s primary context.
pub unsafe fn synchronize(ordinal: u32, stream: *mut c_void) -> Result<()> {
    let d = make_current(ordinal)?;
    // SAFETY: the caller's contract.
    check("cuStreamSynchronize", unsafe { (d.stream_synchronize)(stream) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_has_every_kernel_and_targets_an_old_isa() {
        assert!(PTX.contains(".version 8.0"), "PTX from NVRTC 12.0 (ISA 8.0), loadable by drivers from R525");
        for k in KERNELS {
            assert!(PTX.contains(&format!(".entry {k}(")), "{k} missing from the PTX");
        }
        // No contracted multiply-add: the kernels must match the CPU's scalar reference. The
        // exceptions: AdamW, whose CPU reference fuses on purpose (torch's lerp and addcmul:
        // `mul_add`), written as `__fmaf_rn` there; and PhiloxNormal's float64 `log`, `sin` and
        // `cos`, CUDA's own (libdevice, fma inside), which is why it is bounded against the
        // CPU's glibc results rather than bitwise (docs/gpu.md).
        for entry in PTX.split(".entry ").skip(1) {
            let name = entry.split('(').next().unwrap_or("");
            assert_eq!(entry.contains("fma.rn.f32"), name.starts_with("trainops_adamw"), "fma in {name}");
            assert_eq!(entry.contains("fma.rn.f64"), name == "trainops_normal", "float64 fma in {name}");
        }
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On a machine without libcuda this is NoDriver; with one, a count.
        match device_count() {
            Ok(_) | Err(Error::NoDriver(_)) | Err(Error::Call { .. }) => {}
        }
    }
}
