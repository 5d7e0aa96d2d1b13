//! The session's own intra-op thread pool as a kernel [`Parallelism`]: the library adds no
//! threads of its own, so it follows `intra_op_num_threads` and never oversubscribes.

use core::ffi::c_void;
use std::any::Any;
use std::panic::resume_unwind;
use std::sync::Mutex;

use trainops_kernels::Parallelism;

use super::api::catch;
use super::Context;

/// ONNX Runtime's `KernelContext_ParallelFor` for the current call.
pub struct OrtPool<'c, 'a> {
    ctx: &'c Context<'a>,
}

impl<'c, 'a> OrtPool<'c, 'a> {
    /// The pool of the call `ctx` belongs to.
    pub fn new(ctx: &'c Context<'a>) -> Self {
        Self { ctx }
    }
}

// SAFETY: `KernelContext_ParallelFor` may be called from the kernel's thread with the
// context of the call in progress; the pool value is only ever used during that call.
unsafe impl Sync for OrtPool<'_, '_> {}

struct Job<'f> {
    f: &'f (dyn Fn(usize) + Sync),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

unsafe extern "C" fn run_one(data: *mut c_void, index: usize) {
    // SAFETY: `data` is the `Job` that `run` keeps alive until ParallelFor returns.
    let job = unsafe { &*(data as *const Job<'_>) };
    // Not the entry boundary: the panic is kept and re-raised on the kernel's thread, where
    // the kernel's own boundary turns it into an error status.
    if let Err(payload) = catch(|| (job.f)(index)) {
        let mut slot = job.panic.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(payload);
    }
}

impl Parallelism for OrtPool<'_, '_> {
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks <= 1 {
            (0..tasks).for_each(f);
            return;
        }
        let job = Job { f, panic: Mutex::new(None) };
        let api = self.ctx.api();
        // SAFETY: a valid context of the call in progress; `job` outlives the call, which
        // returns only after every index has run; `run_one` never unwinds.
        let status = unsafe {
            (api.raw().KernelContext_ParallelFor)(self.ctx.raw(), run_one, tasks, 0, (&raw const job) as *mut c_void)
        };
        if api.check("trainops", "KernelContext_ParallelFor", status).is_err() {
            // The runtime refuses before running anything: run on this thread instead.
            (0..tasks).for_each(f);
        }
        if let Some(payload) = job.panic.into_inner().unwrap_or_else(|p| p.into_inner()) {
            resume_unwind(payload);
        }
    }
}
