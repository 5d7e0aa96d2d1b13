//! The runtime's API table, statuses, and the panic boundary.

use core::ffi::{c_char, c_int};
use std::any::Any;
use std::ffi::{CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use ort_sys as sys;

use crate::error::{Error, Result};

/// The C API version trainops is built against: ONNX Runtime 1.17.
pub const API_VERSION: u32 = 17;

static GLOBAL: OnceLock<Api> = OnceLock::new();

/// Records the API table of the runtime that loaded the library (registration and the
/// plugin EP's entry both call it; the first table wins).
pub fn set_global(api: Api) {
    let _ = GLOBAL.set(api);
}

/// The API table of the runtime that loaded the library, once registration ran (for
/// callbacks that get no context to read it from, such as shape inference).
pub fn global() -> Option<Api> {
    GLOBAL.get().copied()
}

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
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// Runs `f`, catching a panic as its payload: the library's only `catch_unwind`. Every
/// `extern` entry point goes through [`boundary`] (or [`guard`]), which use it; the thread
/// pool's task trampoline uses it directly, to re-raise the panic on the kernel's thread.
pub fn catch<T>(f: impl FnOnce() -> T) -> std::result::Result<T, Box<dyn Any + Send>> {
    catch_unwind(AssertUnwindSafe(f))
}

/// What an `extern` entry point returns when its body panicked (after rustls-ffi's
/// `PanicOrDefault`): a harmless value chosen by the return type, or an error status.
pub trait Fallback {
    /// The value for a panic, described by `error` (an [`Error::Panic`]).
    fn fallback(api: Option<Api>, error: &Error) -> Self;
}

impl Fallback for sys::OrtStatusPtr {
    /// An error status naming the panic, when there is an API to make one with.
    fn fallback(api: Option<Api>, error: &Error) -> Self {
        api.map_or_else(sys::OrtStatusPtr::default, |api| api.status(error))
    }
}

impl Fallback for () {
    fn fallback(_: Option<Api>, _: &Error) -> Self {}
}

impl Fallback for usize {
    /// No inputs or outputs.
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        0
    }
}

impl Fallback for bool {
    /// No: cannot copy, not stream aware.
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        false
    }
}

impl Fallback for u32 {
    /// Zero (no vendor).
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        0
    }
}

impl<T> Fallback for *mut T {
    /// Null: no memory, no object.
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        core::ptr::null_mut()
    }
}

impl Fallback for c_int {
    /// A minimum arity or start version of 1.
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        1
    }
}

impl Fallback for *const c_char {
    /// A name that is never registered.
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        c"trainops".as_ptr()
    }
}

impl Fallback for sys::ONNXTensorElementDataType {
    /// Any type (the kernel checks types when it runs).
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        sys::ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED
    }
}

impl Fallback for sys::OrtCustomOpInputOutputCharacteristic {
    /// Required.
    fn fallback(_: Option<Api>, _: &Error) -> Self {
        sys::OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
    }
}

/// The panic boundary: runs the body of an `extern` entry point so that no panic unwinds
/// into the runtime (which would abort the host process); a panic gives `T`'s [`Fallback`].
pub fn boundary<T: Fallback>(api: Option<Api>, op: &'static str, f: impl FnOnce() -> T) -> T {
    catch(f).unwrap_or_else(|payload| T::fallback(api, &Error::Panic { op, message: panic_message(&*payload) }))
}

/// [`boundary`] for a fallible body: an error, like a panic, becomes an error status.
pub fn guard(api: Api, op: &'static str, f: impl FnOnce() -> Result<()>) -> sys::OrtStatusPtr {
    boundary(Some(api), op, || match f() {
        Ok(()) => sys::OrtStatusPtr::default(),
        Err(e) => api.status(&e),
    })
}
