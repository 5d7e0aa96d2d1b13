//! Who runs a kernel's tasks: the host passes a [`Parallelism`] in (the ONNX Runtime layer
//! passes the session's own intra-op pool), so the kernels never start threads of their own
//! and never oversubscribe the cores.

use std::sync::Mutex;

/// Elements per task when a node's work is spread over threads (every chunked kernel: the
/// optimizers, the finiteness check and casts, Philox's output words).
pub const CHUNK: usize = 1 << 15;
/// Below this many elements in a whole node, everything runs on the calling thread.
pub const SERIAL_BELOW: usize = 1 << 16;

/// Runs `f(0) .. f(tasks - 1)`, each exactly once, possibly concurrently, and returns when
/// all have finished.
pub trait Parallelism: Sync {
    /// Runs every task index in `0..tasks`.
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync));
}

/// Every task on the calling thread, in order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sequential;

impl Parallelism for Sequential {
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        (0..tasks).for_each(f);
    }
}

/// Tasks on a rayon pool: the given one, or rayon's global pool when `None`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RayonPool<'p>(pub Option<&'p rayon::ThreadPool>);

impl Parallelism for RayonPool<'_> {
    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        use rayon::prelude::*;
        let go = || (0..tasks).into_par_iter().for_each(f);
        match self.0 {
            Some(pool) => pool.install(go),
            None => go(),
        }
    }
}

/// Hands each work item to exactly one task. Items are moved out through a `Mutex<Option<_>>`
/// each, so disjoint mutable chunks reach the tasks without any `unsafe`; the lock is taken
/// once per item, which is nothing next to the work an item holds.
pub(crate) fn for_each_item<W: Send>(par: &dyn Parallelism, items: Vec<W>, f: impl Fn(W) + Sync) {
    if items.len() <= 1 {
        items.into_iter().for_each(f);
        return;
    }
    let slots: Vec<Mutex<Option<W>>> = items.into_iter().map(|w| Mutex::new(Some(w))).collect();
    par.run(slots.len(), &|i| {
        let item = slots[i].lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(w) = item {
            f(w);
        }
    });
}

/// Work that can be cut into pieces at any element boundary (a tensor group of an
/// optimizer: every stream split at the same index).
pub trait Splittable: Send + Sized {
    /// Number of elements.
    fn len(&self) -> usize;
    /// The first `mid` elements and the rest.
    fn split_at(self, mid: usize) -> (Self, Self);
    /// True when there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Runs `f` over all of `work`: on the calling thread when there are fewer than
/// `serial_below` elements in all, else cut into pieces of at most `chunk` elements that run
/// as tasks of `par`. Elementwise kernels give the same bits however the work is cut.
pub fn run_chunked<W: Splittable>(
    work: Vec<W>,
    par: &dyn Parallelism,
    chunk: usize,
    serial_below: usize,
    f: impl Fn(W) + Sync,
) {
    let total: usize = work.iter().map(W::len).sum();
    if total < serial_below {
        work.into_iter().for_each(f);
        return;
    }
    let mut items = Vec::with_capacity(total / chunk.max(1) + work.len());
    for mut w in work {
        while w.len() > chunk {
            let (head, tail) = w.split_at(chunk);
            items.push(head);
            w = tail;
        }
        if !w.is_empty() {
            items.push(w);
        }
    }
    for_each_item(par, items, f);
}
