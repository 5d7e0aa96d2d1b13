//! `RegisterCustomOps`: one domain object per domain, made once per process and added to
//! every `SessionOptions` that loads the library (the runtime keeps pointers to the domains
//! and their ops for as long as any session lives, so they are never freed).

use std::ffi::CStr;
use std::sync::{Mutex, OnceLock};

use ort_sys as sys;

use crate::error::{Error, Result};
use crate::ffi::api::API_VERSION;
use crate::ffi::op::{registration_panic, too_old_status};
use crate::ffi::{Api, OpDescriptor, OpSpec};
use crate::ops;

/// Every op the library registers, by domain.
pub fn domains() -> Vec<(&'static CStr, Vec<&'static dyn OpSpec>)> {
    vec![
        (
            c"ai.onnx.preview.training",
            vec![&ops::adam::Adam as &'static dyn OpSpec, &ops::adagrad::Adagrad, &ops::momentum::Momentum],
        ),
        (
            c"com.trainops",
            [
                &ops::philox::Philox as &'static dyn OpSpec,
                &ops::random::PhiloxDropout,
                &ops::mixed::MixedPrecisionAdam,
                &ops::mixed::DynamicLossScale,
                &ops::mixed::AllFinite,
            ]
            .into_iter()
            .chain(ops::random::DIST_OPS.iter().map(|op| *op as &'static dyn OpSpec))
            .collect(),
        ),
        (c"com.trainops.bench", vec![&ops::ceiling::MemoryCeiling as &'static dyn OpSpec]),
    ]
}

struct Domains(Vec<*mut sys::OrtCustomOpDomain>);

// SAFETY: the domain objects are created once under the mutex, never mutated afterwards,
// and the runtime itself shares them between sessions on any thread.
unsafe impl Send for Domains {}

static API: OnceLock<Api> = OnceLock::new();
static DOMAINS: Mutex<Option<Domains>> = Mutex::new(None);

/// The API table of the runtime that loaded the library, once `RegisterCustomOps` ran.
pub fn api() -> Option<Api> {
    API.get().copied()
}

fn create_domains(api: Api) -> Result<Domains> {
    let raw = api.raw();
    let mut made = Vec::new();
    for (name, specs) in domains() {
        let mut domain: *mut sys::OrtCustomOpDomain = core::ptr::null_mut();
        // SAFETY: a valid NUL-terminated name and out pointer.
        api.check("trainops", "CreateCustomOpDomain", unsafe {
            (raw.CreateCustomOpDomain)(name.as_ptr(), &mut domain)
        })?;
        for spec in specs {
            let op = OpDescriptor::leak(spec);
            // SAFETY: `domain` was just created; `op` is leaked, so it outlives the domain.
            api.check("trainops", "CustomOpDomain_Add", unsafe { (raw.CustomOpDomain_Add)(domain, op.as_raw()) })?;
        }
        made.push(domain);
    }
    Ok(Domains(made))
}

fn register(options: *mut sys::OrtSessionOptions, api: Api) -> Result<()> {
    let _ = API.set(api);
    let mut guard = DOMAINS.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        *guard = Some(create_domains(api)?);
    }
    let domains = guard.as_ref().map(|d| d.0.clone()).unwrap_or_default();
    drop(guard);
    for domain in domains {
        // SAFETY: `options` comes from the runtime's caller; `domain` lives for the process.
        api.check("trainops", "AddCustomOpDomain", unsafe { (api.raw().AddCustomOpDomain)(options, domain) })?;
    }
    Ok(())
}

/// The library's entry point: registers every trainops domain on `options`.
///
/// Returns an error status (never aborts) when the runtime is older than 1.17, when an
/// argument is null, or when the runtime refuses a domain (for instance when the library is
/// registered twice on one `SessionOptions`).
///
/// # Safety
/// Called by ONNX Runtime with its `OrtApiBase` and a valid `OrtSessionOptions`.
#[no_mangle]
pub unsafe extern "C" fn RegisterCustomOps(
    options: *mut sys::OrtSessionOptions,
    api_base: *const sys::OrtApiBase,
) -> sys::OrtStatusPtr {
    if api_base.is_null() {
        // No API to make an error status with; the runtime never passes null, so this only
        // happens when called by hand, wrongly: register nothing.
        return sys::OrtStatusPtr::default();
    }
    let outcome = std::panic::catch_unwind(|| {
        // SAFETY: the runtime passes its own OrtApiBase, valid for the process.
        let base = unsafe { &*api_base };
        // SAFETY: GetApi may be called with any version; it returns null when unsupported.
        let table = unsafe { (base.GetApi)(API_VERSION) };
        if table.is_null() {
            // SAFETY: version 1 exists in every runtime and starts with CreateStatus; the
            // version string is a static NUL-terminated string of the runtime.
            let (v1, version) =
                unsafe { ((base.GetApi)(1), CStr::from_ptr((base.GetVersionString)()).to_string_lossy().into_owned()) };
            if v1.is_null() {
                return sys::OrtStatusPtr::default();
            }
            // SAFETY: checked non-null above.
            return too_old_status(unsafe { &*v1 }, &version);
        }
        // SAFETY: non-null table of at least API_VERSION, owned by the runtime.
        let api = unsafe { Api::from_raw(table) };
        if options.is_null() {
            return api.status(&Error::Arity {
                op: "trainops",
                what: "RegisterCustomOps called with null SessionOptions".into(),
            });
        }
        match register(options, api) {
            Ok(()) => sys::OrtStatusPtr::default(),
            Err(e) => api.status(&e),
        }
    });
    outcome.unwrap_or_else(|payload| match api() {
        Some(api) => {
            crate::ffi::api::new_status(api.raw(), sys::OrtErrorCode::ORT_FAIL, &registration_panic(&*payload))
        }
        None => sys::OrtStatusPtr::default(),
    })
}
