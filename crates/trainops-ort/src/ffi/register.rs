//! Registration: one domain object per domain of the op catalogue, made once per process and
//! added to every `SessionOptions` that loads the library (the runtime keeps pointers to the
//! domains and their ops for as long as any session lives, so they are never freed).

use std::ffi::CStr;
use std::sync::Mutex;

use ort_sys as sys;

use super::api::{boundary, new_status, API_VERSION};
use super::device::{cuda_requested, DeviceTable};
use super::op::{DeviceKernels, Placement};
use super::{Api, OpDescriptor, OpSpec};
use crate::error::{Error, Result};

/// One custom-op domain of the catalogue: its name and its ops.
pub struct Domain {
    /// The domain's name, e.g. `ai.onnx.preview.training`.
    pub name: &'static CStr,
    /// Its ops.
    pub ops: Vec<&'static dyn OpSpec>,
}

struct Domains(Vec<*mut sys::OrtCustomOpDomain>);

// SAFETY: the domain objects are created once under the mutex, never mutated afterwards,
// and the runtime itself shares them between sessions on any thread.
unsafe impl Send for Domains {}

/// The first ONNX Runtime to use an inference callback for a custom op's output type safely:
/// 1.19 takes the type a callback sets when an op has several kernels, but up to 1.23 the
/// runtime crashes (null dereference) building the callback's context for a node whose
/// optional input is named "". Checked on 1.17.3, 1.18.1, 1.19.2, 1.20.1, 1.22.0, 1.23.2,
/// 1.24.4, 1.26.0, 1.28.0 and 1.31.1.
const TYPED_INFERENCE: (u32, u32) = (1, 24);

/// Whether a runtime version string (`1.19.2`, `1.20.0-dev`) is at least `(major, minor)`;
/// false when it cannot be read.
fn at_least(version: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = version.split(|c: char| !c.is_ascii_digit()).map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(a)), Some(Ok(b))) => (a, b) >= (major, minor),
        _ => false,
    }
}

static DOMAINS: Mutex<Option<Domains>> = Mutex::new(None);

fn create_domains(
    api: Api,
    catalogue: Vec<Domain>,
    typed_inference: bool,
    cuda: Option<(DeviceTable, &'static dyn DeviceKernels)>,
) -> Result<Domains> {
    let raw = api.raw();
    let mut made = Vec::new();
    for Domain { name, ops } in catalogue {
        let mut domain: *mut sys::OrtCustomOpDomain = core::ptr::null_mut();
        // SAFETY: a valid NUL-terminated name and out pointer.
        api.check("trainops", "CreateCustomOpDomain", unsafe {
            (raw.CreateCustomOpDomain)(name.as_ptr(), &mut domain)
        })?;
        for spec in ops {
            let mut descriptors = vec![OpDescriptor::leak(spec, typed_inference)];
            // Door 3: the same op for ONNX Runtime's CUDA execution provider, when asked for.
            if let Some((support, kernel)) =
                cuda.and_then(|(table, kernel)| Some((table(name, spec.name())?, kernel))).filter(|(s, _)| s.cuda)
            {
                let placement =
                    Placement::Device { ep: c"CUDAExecutionProvider", host_inputs: support.host_inputs, kernel };
                descriptors.push(OpDescriptor::leak_placed(spec, placement, typed_inference));
            }
            for op in descriptors {
                // SAFETY: `domain` was just created; `op` is leaked, so it outlives the domain.
                api.check("trainops", "CustomOpDomain_Add", unsafe { (raw.CustomOpDomain_Add)(domain, op.as_raw()) })?;
            }
        }
        made.push(domain);
    }
    Ok(Domains(made))
}

fn add_domains(
    options: *mut sys::OrtSessionOptions,
    api: Api,
    catalogue: fn() -> Vec<Domain>,
    typed_inference: bool,
    cuda: (DeviceTable, &'static dyn DeviceKernels),
) -> Result<()> {
    super::api::set_global(api);
    let mut guard = DOMAINS.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        let cuda = cuda_requested().then_some(cuda);
        *guard = Some(create_domains(api, catalogue(), typed_inference, cuda)?);
    }
    let domains = guard.as_ref().map(|d| d.0.clone()).unwrap_or_default();
    drop(guard);
    for domain in domains {
        // SAFETY: `options` comes from the runtime's caller; `domain` lives for the process.
        api.check("trainops", "AddCustomOpDomain", unsafe { (api.raw().AddCustomOpDomain)(options, domain) })?;
    }
    Ok(())
}

/// The body of `RegisterCustomOps`: registers every domain of `catalogue` (called once per
/// process) on `options`, inside the panic boundary. With `TRAINOPS_CUDA=1` the ops `cuda`
/// marks as having a CUDA kernel are also registered for `CUDAExecutionProvider`, their
/// device kernels made by `cuda_kernels` (the caller's: this module knows nothing of the EP).
///
/// Returns an error status (never aborts) when the runtime is older than 1.17, when an
/// argument is null, or when the runtime refuses a domain (for instance when the library is
/// registered twice on one `SessionOptions`).
///
/// # Safety
/// `api_base` is null or the runtime's `OrtApiBase`; `options` is null or a valid
/// `OrtSessionOptions` of that runtime.
pub unsafe fn register_custom_ops(
    options: *mut sys::OrtSessionOptions,
    api_base: *const sys::OrtApiBase,
    catalogue: fn() -> Vec<Domain>,
    cuda: DeviceTable,
    cuda_kernels: &'static dyn DeviceKernels,
) -> sys::OrtStatusPtr {
    if api_base.is_null() {
        // No API to make an error status with; the runtime never passes null, so this only
        // happens when called by hand, wrongly: register nothing.
        return sys::OrtStatusPtr::default();
    }
    // SAFETY: the runtime passes its own OrtApiBase, valid for the process.
    let base = unsafe { &*api_base };
    // SAFETY: GetApi may be called with any version; it returns null when unsupported.
    let table = unsafe { (base.GetApi)(API_VERSION) };
    if table.is_null() {
        // No table of our version to make a status with: version 1's, if any.
        return boundary(None, "trainops", || {
            // SAFETY: version 1 exists in every runtime and starts with CreateStatus; the
            // version string is a static NUL-terminated string of the runtime.
            let (v1, version) =
                unsafe { ((base.GetApi)(1), CStr::from_ptr((base.GetVersionString)()).to_string_lossy().into_owned()) };
            if v1.is_null() {
                return sys::OrtStatusPtr::default();
            }
            let message = format!(
                "trainops needs ONNX Runtime 1.17 or newer (C API version {API_VERSION}); this process runs ONNX Runtime {version}"
            );
            // SAFETY: checked non-null above.
            new_status(unsafe { &*v1 }, sys::OrtErrorCode::ORT_FAIL, &message)
        });
    }
    // SAFETY: non-null table of at least API_VERSION, owned by the runtime.
    let api = unsafe { Api::from_raw(table) };
    boundary(Some(api), "trainops", || {
        // SAFETY: the version string is a static NUL-terminated string of the runtime. (Asking
        // GetApi for a newer table instead would print an error on older runtimes.)
        let version = unsafe { CStr::from_ptr((base.GetVersionString)()) }.to_string_lossy().into_owned();
        let typed_inference = at_least(&version, TYPED_INFERENCE);
        if options.is_null() {
            return api.status(&Error::Arity {
                op: "trainops",
                what: "RegisterCustomOps called with null SessionOptions".into(),
            });
        }
        match add_domains(options, api, catalogue, typed_inference, (cuda, cuda_kernels)) {
            Ok(()) => sys::OrtStatusPtr::default(),
            Err(e) => api.status(&e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::at_least;

    #[test]
    fn versions_compare_by_major_and_minor() {
        assert!(at_least("1.19.2", (1, 19)) && at_least("1.31.1", (1, 19)) && at_least("2.0.0", (1, 19)));
        assert!(at_least("1.20.0-dev", (1, 19)));
        assert!(!at_least("1.18.1", (1, 19)) && !at_least("1.17.3", (1, 19)));
        assert!(!at_least("", (1, 19)) && !at_least("dev", (1, 19)));
    }
}
