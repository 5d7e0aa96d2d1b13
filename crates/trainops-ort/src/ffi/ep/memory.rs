//! Device memory: the factory's allocator (`OrtAllocator`) and data transfer
//! (`OrtDataTransferImpl`), counted in [`super::COUNTERS`].
//!
//! Fake-device mode allocates host memory (aligned to 256 bytes, like `cuMemAlloc`) and copies
//! with `memmove`; CUDA mode goes through `trainops_cuda`'s driver calls.

use core::ffi::c_void;
use std::alloc::Layout;

use ort_sys as sys;

use super::abi::{self, DataTransfer, EpFactory, Opaque};
use super::{bump, Backend, Factory, Plugin, COUNTERS};
use crate::error::{Error, Result};
use crate::ffi::api::{boundary, guard};
use crate::ffi::tensor::elem_size;
use crate::ffi::DType;

/// Alignment of every device allocation.
const ALIGN: usize = 256;

#[repr(C)]
struct Allocator {
    base: sys::OrtAllocator,
    plugin: &'static Plugin,
    info: *const sys::OrtMemoryInfo,
    ordinal: u32,
}

/// A fake device block: `ALIGN` bytes of header (the size) then the data.
fn fake_alloc(size: usize) -> *mut c_void {
    let Ok(layout) = Layout::from_size_align(size.saturating_add(ALIGN), ALIGN) else {
        return core::ptr::null_mut();
    };
    // SAFETY: a non-zero size (at least ALIGN) and a valid layout.
    let base = unsafe { std::alloc::alloc(layout) };
    if base.is_null() {
        return core::ptr::null_mut();
    }
    // SAFETY: the block holds at least ALIGN >= 8 bytes, aligned for usize.
    unsafe {
        base.cast::<usize>().write(size);
        base.add(ALIGN).cast()
    }
}

/// # Safety
/// `p` came from [`fake_alloc`] and is freed once.
unsafe fn fake_free(p: *mut c_void) {
    // SAFETY: the caller's contract: the header sits ALIGN bytes before `p`.
    unsafe {
        let base = p.cast::<u8>().sub(ALIGN);
        let size = base.cast::<usize>().read();
        std::alloc::dealloc(base, Layout::from_size_align_unchecked(size + ALIGN, ALIGN));
    }
}

unsafe extern "system" fn alloc(this: *mut sys::OrtAllocator, size: usize) -> *mut c_void {
    // SAFETY: the runtime passes back our allocator (base is its first field).
    let a = unsafe { &*this.cast::<Allocator>() };
    boundary(Some(a.plugin.api), "TrainopsExecutionProvider", || {
        let p = match a.plugin.backend {
            Some(Backend::Cuda { .. }) => trainops_cuda::alloc(a.ordinal, size.max(1)).unwrap_or(core::ptr::null_mut()),
            _ => fake_alloc(size),
        };
        if !p.is_null() {
            bump(&COUNTERS.allocs);
        }
        p
    })
}

unsafe extern "system" fn reserve(this: *const sys::OrtAllocator, size: usize) -> *mut c_void {
    // SAFETY: same allocator; `alloc` only reads it.
    unsafe { alloc(this.cast_mut(), size) }
}

unsafe extern "system" fn free(this: *mut sys::OrtAllocator, p: *mut c_void) {
    if p.is_null() {
        return;
    }
    // SAFETY: the runtime passes back our allocator.
    let a = unsafe { &*this.cast::<Allocator>() };
    boundary(Some(a.plugin.api), "TrainopsExecutionProvider", || {
        bump(&COUNTERS.frees);
        match a.plugin.backend {
            Some(Backend::Cuda { .. }) => {
                // SAFETY: a block this allocator made, freed once by the runtime.
                let _ = unsafe { trainops_cuda::free(a.ordinal, p) };
            }
            // SAFETY: a block this allocator made, freed once by the runtime.
            _ => unsafe { fake_free(p) },
        }
    })
}

unsafe extern "system" fn info(this: *const sys::OrtAllocator) -> *const sys::OrtMemoryInfo {
    // SAFETY: the runtime passes back our allocator.
    unsafe { (*this.cast::<Allocator>()).info }
}

/// The device ordinal of `device` when it is memory of ours (GPU, NVIDIA, an offered ordinal).
fn our_device(f: &Factory, device: *const Opaque) -> Option<u32> {
    if device.is_null() {
        return None;
    }
    let e = f.plugin().ep_api;
    // SAFETY: a memory device the runtime passed or derived from its memory info.
    let (kind, vendor, id) = unsafe {
        (
            (e.memory_device_get_device_type)(device),
            (e.memory_device_get_vendor_id)(device),
            (e.memory_device_get_device_id)(device),
        )
    };
    (kind == abi::MEMORY_DEVICE_GPU && vendor == abi::NVIDIA_VENDOR_ID && (id as usize) < f.devices().len())
        .then_some(id)
}

fn is_cpu(f: &Factory, device: *const Opaque) -> bool {
    // SAFETY: as in `our_device`.
    !device.is_null() && unsafe { (f.plugin().ep_api.memory_device_get_device_type)(device) } == abi::MEMORY_DEVICE_CPU
}

pub(super) unsafe extern "system" fn create_allocator(
    this: *mut EpFactory,
    memory_info: *const Opaque,
    _options: *const Opaque,
    out: *mut *mut sys::OrtAllocator,
) -> sys::OrtStatusPtr {
    // SAFETY: `base` is the first field of our `#[repr(C)]` factory.
    let f = unsafe { &*this.cast::<Factory>() };
    let p = f.plugin();
    guard(p.api, "TrainopsExecutionProvider", || {
        // SAFETY: the runtime's out pointer; null means "the default CPU allocator".
        unsafe { *out = core::ptr::null_mut() };
        if memory_info.is_null() {
            return Ok(());
        }
        // SAFETY: a memory info the runtime passed.
        let device = unsafe { (p.ep_api.memory_info_get_memory_device)(memory_info) };
        let Some(ordinal) = our_device(f, device) else {
            return Err(Error::Runtime {
                op: "TrainopsExecutionProvider",
                call: "CreateAllocator",
                message: "not a TrainopsExecutionProvider device memory".into(),
            });
        };
        let info = f.devices()[ordinal as usize].memory.cast_const();
        let base = sys::OrtAllocator {
            version: 18,
            Alloc: Some(alloc),
            Free: Some(free),
            Info: Some(info_fn()),
            Reserve: Some(reserve),
        };
        let a = Box::new(Allocator { base, plugin: p, info, ordinal });
        // SAFETY: the runtime's out pointer; it hands the allocator back to release_allocator.
        unsafe { *out = Box::into_raw(a).cast() };
        Ok(())
    })
}

fn info_fn() -> unsafe extern "system" fn(*const sys::OrtAllocator) -> *const sys::OrtMemoryInfo {
    info
}

pub(super) unsafe extern "system" fn release_allocator(_this: *mut EpFactory, allocator: *mut sys::OrtAllocator) {
    if !allocator.is_null() {
        // SAFETY: an allocator `create_allocator` made, released once.
        let a = unsafe { Box::from_raw(allocator.cast::<Allocator>()) };
        boundary(Some(a.plugin.api), "TrainopsExecutionProvider", move || drop(a));
    }
}

#[repr(C)]
struct Transfer {
    base: DataTransfer,
    factory: *const Factory,
}

pub(super) unsafe extern "system" fn create_data_transfer(
    this: *mut EpFactory,
    out: *mut *mut DataTransfer,
) -> sys::OrtStatusPtr {
    // SAFETY: our factory.
    let f = unsafe { &*this.cast::<Factory>() };
    guard(f.plugin().api, "TrainopsExecutionProvider", || {
        let base = DataTransfer {
            ort_version_supported: abi::EP_API_VERSION,
            release: release_transfer,
            can_copy,
            copy_tensors,
        };
        let t = Box::new(Transfer { base, factory: f });
        // SAFETY: the runtime's out pointer; released through `release_transfer`.
        unsafe { *out = Box::into_raw(t).cast() };
        Ok(())
    })
}

unsafe extern "system" fn release_transfer(this: *mut DataTransfer) {
    if !this.is_null() {
        // SAFETY: made by `create_data_transfer`, released once.
        drop(unsafe { Box::from_raw(this.cast::<Transfer>()) });
    }
}

/// # Safety
/// `this` is a transfer `create_data_transfer` made, whose factory is alive (the runtime
/// releases data transfers before their factory).
unsafe fn transfer_factory<'a>(this: *const DataTransfer) -> &'a Factory {
    // SAFETY: the caller's contract.
    unsafe { &*(*this.cast::<Transfer>()).factory }
}

unsafe extern "system" fn can_copy(this: *const DataTransfer, src: *const Opaque, dst: *const Opaque) -> bool {
    // SAFETY: the runtime passes back our transfer.
    let f = unsafe { transfer_factory(this) };
    boundary(Some(f.plugin().api), "TrainopsExecutionProvider", || {
        let (s, d) = (our_device(f, src), our_device(f, dst));
        match (s, d) {
            (Some(_), Some(_)) => true,
            (Some(_), None) => is_cpu(f, dst),
            (None, Some(_)) => is_cpu(f, src),
            (None, None) => false,
        }
    })
}

/// A tensor's data pointer and byte size.
fn tensor_bytes(p: &Plugin, value: *const sys::OrtValue) -> Result<(*mut c_void, usize)> {
    let raw = p.api.raw();
    let op = "TrainopsExecutionProvider";
    let mut data: *mut c_void = core::ptr::null_mut();
    let mut info: *mut sys::OrtTensorTypeAndShapeInfo = core::ptr::null_mut();
    // SAFETY: a tensor value the runtime passed; out pointers valid; `info` released below.
    unsafe {
        p.api.check(op, "GetTensorMutableData", (raw.GetTensorMutableData)(value.cast_mut(), &mut data))?;
        p.api.check(op, "GetTensorTypeAndShape", (raw.GetTensorTypeAndShape)(value, &mut info))?;
    }
    let mut count = 0usize;
    let mut elem = sys::ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    // SAFETY: the info just made, released exactly once.
    let read = unsafe {
        let r = p
            .api
            .check(op, "GetTensorShapeElementCount", (raw.GetTensorShapeElementCount)(info, &mut count))
            .and_then(|()| p.api.check(op, "GetTensorElementType", (raw.GetTensorElementType)(info, &mut elem)));
        (raw.ReleaseTensorTypeAndShapeInfo)(info);
        r
    };
    read?;
    let size = elem_size(DType::from_raw(elem as i32));
    if size == 0 {
        return Err(Error::Runtime { op, call: "CopyTensors", message: "unsupported element type".into() });
    }
    Ok((data, count.saturating_mul(size)))
}

unsafe extern "system" fn copy_tensors(
    this: *mut DataTransfer,
    src: *const *const sys::OrtValue,
    dst: *const *mut sys::OrtValue,
    _streams: *const *mut Opaque,
    n: usize,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our transfer.
    let f = unsafe { transfer_factory(this) };
    let p = f.plugin();
    guard(p.api, "TrainopsExecutionProvider", || {
        for i in 0..n {
            // SAFETY: the runtime's arrays of `n` values.
            let (s, d) = unsafe { (*src.add(i), *dst.add(i)) };
            let (sp, sn) = tensor_bytes(p, s)?;
            let (dp, dn) = tensor_bytes(p, d)?;
            if sn != dn {
                return Err(Error::Runtime {
                    op: "TrainopsExecutionProvider",
                    call: "CopyTensors",
                    message: format!("source has {sn} bytes, destination {dn}"),
                });
            }
            // SAFETY: values of tensors the runtime passed.
            let (sd, dd) = unsafe { ((p.ep_api.value_get_memory_device)(s), (p.ep_api.value_get_memory_device)(d)) };
            let (from_dev, to_dev) = (our_device(f, sd).is_some(), our_device(f, dd).is_some());
            let counter = match (from_dev, to_dev) {
                (true, true) => &COUNTERS.copies_on_device,
                (true, false) => &COUNTERS.copies_to_host,
                _ => &COUNTERS.copies_to_device,
            };
            bump(counter);
            if sn == 0 {
                continue;
            }
            match p.backend {
                // SAFETY: both buffers hold `sn` bytes (checked equal), host or device memory.
                Some(Backend::Cuda { .. }) => unsafe {
                    let ordinal = our_device(f, dd).or(our_device(f, sd)).unwrap_or(0);
                    trainops_cuda::copy(ordinal, dp, sp.cast_const(), sn)
                }
                .map_err(|e| Error::Runtime {
                    op: "TrainopsExecutionProvider",
                    call: "CopyTensors",
                    message: e.to_string(),
                })?,
                // SAFETY: both buffers hold `sn` bytes (checked equal); fake device memory is
                // host memory; `copy` allows overlap.
                _ => unsafe { core::ptr::copy(sp.cast::<u8>(), dp.cast::<u8>(), sn) },
            }
        }
        Ok(())
    })
}
