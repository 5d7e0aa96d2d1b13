//! The runtime's API table, statuses, and the panic boundary.

use std::ffi::{CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use ort_sys as sys;

use crate::error::{Error, Result};

/// The C API version trainops is built against: ONNX Runtime 1.17.
pub const API_VERSION: u32 = 17;

/// ONNX Runtime's API table, valid while the runtime is loaded (it outlives every session
/// and therefore every call into this library).
#[derive(Clone, Copy)]
pub struct Api(&'static sys::OrtApi);

impl Api {
    /// Wraps a table the runtime handed us.
    ///
    /// # Safety
    /// `api` must be non-null and point to the runtime's `OrtApi` of at least version
    /// [`API_VERSION`], valid for the rest of the process.
    pub unsafe fn from_raw(api: *const sys::OrtApi) -> Self {
        // SAFETY: the caller guarantees a valid table of at least API_VERSION that lives on.
        Self(unsafe { &*api })
    }

    /// The table itself.
    pub fn raw(self) -> &'static sys::OrtApi {
        self.0
    }

    /// Turns a status returned by `call` into a `Result`, releasing it.
    pub fn check(self, op: &'static str, call: &'static str, status: sys::OrtStatusPtr) -> Result<()> {
        if status.0.is_null() {
            return Ok(());
        }
        // SAFETY: a non-null status from this runtime; its message is a NUL-terminated string
        // owned by the status, copied before the status is released exactly once.
        let message = unsafe {
            let msg = CStr::from_ptr((self.0.GetErrorMessage)(status.0)).to_string_lossy().into_owned();
            (self.0.ReleaseStatus)(status.0);
            msg
        };
        Err(Error::Runtime { op, call, message })
    }

    /// A new status for `err`, owned by the runtime from here on.
    pub fn status(self, err: &Error) -> sys::OrtStatusPtr {
        new_status(self.0, err.code(), &err.to_string())
    }
}

/// `CreateStatus` with any message (interior NULs are replaced).
pub fn new_status(api: &sys::OrtApi, code: sys::OrtErrorCode, msg: &str) -> sys::OrtStatusPtr {
    let msg = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // SAFETY: `CreateStatus` is entry 0 of every version of the table and copies the message.
    unsafe { (api.CreateStatus)(code, msg.as_ptr()) }
}

/// The message of a caught panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// Runs `f` so that neither an error nor a panic escapes: both become an error status.
/// Every `extern` entry point of the library goes through here.
pub fn guard(api: Api, op: &'static str, f: impl FnOnce() -> Result<()>) -> sys::OrtStatusPtr {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => sys::OrtStatusPtr::default(),
        Ok(Err(e)) => api.status(&e),
        Err(payload) => api.status(&Error::Panic { op, message: panic_message(&*payload) }),
    }
}
