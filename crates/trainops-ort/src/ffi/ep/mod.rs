//! The plugin execution provider `TrainopsExecutionProvider` (ONNX Runtime 1.24 and newer):
//! `CreateEpFactories` / `ReleaseEpFactory`, one factory offering a device per GPU, an
//! allocator on its memory, CPU<->device copies, and the custom-op domains with a CPU kernel
//! and a device kernel of every op (a node the EP claims runs on the device kernel, any other
//! on the CPU kernel).
//!
//! Backends: `TRAINOPS_FAKE_DEVICE=1` labels host memory as one NVIDIA GPU (as
//! `TRAINOPS_FAKE_DEVICES=N` of them, 1 to 8, each with its own PCI bus id) and runs the CPU
//! kernels behind the device registration, so everything but the arithmetic on a GPU is
//! tested without one; otherwise the CUDA driver (`libcuda.so.1`, opened only here, on first
//! use) says how many GPUs there are. With neither, the factory offers no device.

pub mod abi;
pub mod bus;
pub mod cuda;
mod factory;
pub mod launch;
mod memory;
mod mixed;
mod staging;

use core::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use ort_sys as sys;

use super::api::{boundary, new_status};
pub use super::device::{DeviceSupport, DeviceTable};
use super::{Api, Domain, OpSpec};
use abi::{ApiExt, EpApi, EpFactory, Opaque, EP_API_VERSION};

/// The provider's name, as `ort.get_ep_devices()` lists it.
pub const EP_NAME: &CStr = c"TrainopsExecutionProvider";

/// How the "device" is driven.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Host memory labelled as `count` NVIDIA GPUs, CPU kernels behind the device
    /// registration.
    Fake {
        /// Devices offered (`TRAINOPS_FAKE_DEVICES`, default 1).
        count: u32,
    },
    /// GPUs through the CUDA driver, `count` of them.
    Cuda {
        /// Devices the driver reports.
        count: u32,
    },
}

/// The plugin's state, made once per process on the first `CreateEpFactories`.
pub struct Plugin {
    api: Api,
    ext: ApiExt,
    ep_api: &'static EpApi,
    backend: Option<Backend>,
    catalogue: fn() -> Vec<Domain>,
    table: DeviceTable,
}

// SAFETY: the plugin holds the runtime's immutable API tables (shared by the runtime between
// threads) and plain data.
unsafe impl Send for Plugin {}
// SAFETY: as above; nothing in it is mutated after construction.
unsafe impl Sync for Plugin {}

static PLUGIN: OnceLock<Plugin> = OnceLock::new();

/// The factory: the C struct first, then what its callbacks need.
#[repr(C)]
pub struct Factory {
    base: EpFactory,
    plugin: &'static Plugin,
    /// One memory info per offered device (by ordinal), made on first listing, kept for the
    /// factory's life (allocators hand them out).
    devices: OnceLock<Vec<Device>>,
}

/// One offered device.
pub struct Device {
    /// The hardware device ORT discovered (matched by PCI bus id), or one we created.
    pub hardware: *const Opaque,
    /// Its PCI bus id (`0000:65:00.0`), when known.
    pub pci_bus_id: Option<String>,
    /// Its memory, as `CreateMemoryInfo_V2` made it.
    pub memory: *mut sys::OrtMemoryInfo,
}

// SAFETY: the runtime's objects are immutable once made and shared by the runtime itself.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Factory {
    /// The devices offered, by ordinal (empty before the first listing).
    pub fn devices(&self) -> &[Device] {
        self.devices.get().map_or(&[], Vec::as_slice)
    }

    /// The plugin state.
    pub fn plugin(&self) -> &'static Plugin {
        self.plugin
    }
}

/// Counters of what the plugin EP did, for tests and benchmarks (`trainops_ep_counters`).
pub struct Counters {
    /// Device allocations made.
    pub allocs: AtomicU64,
    /// Device allocations freed.
    pub frees: AtomicU64,
    /// Tensor copies host to device.
    pub copies_to_device: AtomicU64,
    /// Tensor copies device to host.
    pub copies_to_host: AtomicU64,
    /// Tensor copies device to device.
    pub copies_on_device: AtomicU64,
    /// Runs of device kernels (nodes the EP claimed).
    pub device_runs: AtomicU64,
    /// Nodes claimed by `GetCapability`.
    pub claimed: AtomicU64,
    /// Nodes of trainops domains declined by `GetCapability`.
    pub declined: AtomicU64,
}

/// The process's counters.
pub static COUNTERS: Counters = Counters {
    allocs: AtomicU64::new(0),
    frees: AtomicU64::new(0),
    copies_to_device: AtomicU64::new(0),
    copies_to_host: AtomicU64::new(0),
    copies_on_device: AtomicU64::new(0),
    device_runs: AtomicU64::new(0),
    claimed: AtomicU64::new(0),
    declined: AtomicU64::new(0),
};

/// The counters in [`Counters`]' field order.
pub fn counters() -> [u64; 8] {
    let c = &COUNTERS;
    [
        &c.allocs,
        &c.frees,
        &c.copies_to_device,
        &c.copies_to_host,
        &c.copies_on_device,
        &c.device_runs,
        &c.claimed,
        &c.declined,
    ]
    .map(|a| a.load(Ordering::Relaxed))
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// `major.minor` of a version string such as `1.24.4`.
pub fn parse_version(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.split('.');
    let major = parts.next()?.trim().parse().ok()?;
    let minor: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
    Some((major, minor.parse().ok()?))
}

/// The API version to use with a runtime of version `runtime`: the lower of its minor number
/// and the layouts we were written against, or `None` below 1.24 (no plugin-EP kernels).
pub fn negotiate(runtime: (u32, u32)) -> Option<u32> {
    match runtime {
        (1, minor) if minor >= EP_API_VERSION => Some(EP_API_VERSION.min(minor)),
        (major, _) if major > 1 => Some(EP_API_VERSION),
        _ => None,
    }
}

/// The backend this process uses: fake when `TRAINOPS_FAKE_DEVICE=1`; the CUDA driver when
/// `TRAINOPS_CUDA=1` (opt-in until its device kernels are wired and verified on a GPU) and
/// it loads and reports a GPU; else none. Only this function opens `libcuda.so.1`, and only
/// when the plugin EP is registered with CUDA mode asked for.
fn pick_backend() -> Option<Backend> {
    if std::env::var("TRAINOPS_FAKE_DEVICE").as_deref() == Ok("1") {
        let count = fake_count(std::env::var("TRAINOPS_FAKE_DEVICES").ok().as_deref());
        return Some(Backend::Fake { count });
    }
    if std::env::var("TRAINOPS_CUDA").as_deref() != Ok("1") {
        return None;
    }
    let count = trainops_cuda::device_count().ok()?;
    (count > 0).then_some(Backend::Cuda { count })
}

/// How many fake devices `TRAINOPS_FAKE_DEVICES` asks for: 1 to 8, 1 when unset or unreadable.
pub fn fake_count(value: Option<&str>) -> u32 {
    value.and_then(|v| v.trim().parse::<u32>().ok()).filter(|n| (1..=8).contains(n)).unwrap_or(1)
}

/// The body of `CreateEpFactories`.
///
/// # Safety
/// The runtime's arguments: `api_base` its `OrtApiBase`; `factories` an array of
/// `max_factories` slots; `num_factories` a valid out pointer.
pub unsafe fn create_factories(
    api_base: *const sys::OrtApiBase,
    factories: *mut *mut abi::EpFactory,
    max_factories: usize,
    num_factories: *mut usize,
    catalogue: fn() -> Vec<Domain>,
    table: DeviceTable,
) -> sys::OrtStatusPtr {
    if api_base.is_null() || num_factories.is_null() {
        return sys::OrtStatusPtr::default();
    }
    // SAFETY: checked non-null; the runtime's out pointer.
    unsafe { *num_factories = 0 };
    // SAFETY: the runtime's own base, valid for the process; the version string is static.
    let (base, version) = unsafe {
        let base = &*api_base;
        (base, CStr::from_ptr((base.GetVersionString)()).to_string_lossy().into_owned())
    };
    // Below 1.24 GetApi(24) would print an error: read the version first and offer nothing.
    let Some(api_version) = parse_version(&version).and_then(negotiate) else {
        return sys::OrtStatusPtr::default();
    };
    // SAFETY: GetApi accepts any version; the runtime is at least `api_version`.
    let table_ptr = unsafe { (base.GetApi)(api_version) };
    if table_ptr.is_null() {
        return sys::OrtStatusPtr::default();
    }
    // SAFETY: a non-null table of version >= 24 >= 17, owned by the runtime for the process.
    let api = unsafe { Api::from_raw(table_ptr) };
    boundary(Some(api), "TrainopsExecutionProvider", || {
        let plugin = PLUGIN.get_or_init(|| {
            // SAFETY: a table of version >= 24 (negotiated above).
            let ext = unsafe { ApiExt::read(table_ptr) };
            // SAFETY: GetEpApi returns the runtime's static EP API table of this version.
            let ep_api = unsafe { &*(ext.get_ep_api)() };
            super::api::set_global(api);
            Plugin { api, ext, ep_api, backend: pick_backend(), catalogue, table }
        });
        if max_factories == 0 || factories.is_null() {
            return sys::OrtStatusPtr::default();
        }
        let factory = factory::leak(plugin, api_version);
        // SAFETY: the runtime's array has at least one slot; it hands the factory back to
        // `ReleaseEpFactory`.
        unsafe {
            *factories = factory;
            *num_factories = 1;
        }
        sys::OrtStatusPtr::default()
    })
}

/// The body of `ReleaseEpFactory`.
///
/// # Safety
/// `factory` is null or a factory [`create_factories`] returned, released once.
pub unsafe fn release_factory(factory: *mut abi::EpFactory) -> sys::OrtStatusPtr {
    let api = PLUGIN.get().map(|p| p.api);
    boundary(api, "TrainopsExecutionProvider", || {
        // SAFETY: the caller's contract.
        unsafe { factory::release(factory) };
        sys::OrtStatusPtr::default()
    })
}

impl Plugin {
    /// The device support of an op for this process's backend: CUDA mode drops the ops whose
    /// CUDA kernel is not wired.
    fn device_support(&self, domain: &CStr, op: &CStr) -> Option<DeviceSupport> {
        let support = (self.table)(domain, op)?;
        match self.backend {
            Some(Backend::Cuda { .. }) if !support.cuda => None,
            _ => Some(support),
        }
    }

    fn status(&self, msg: &str) -> sys::OrtStatusPtr {
        new_status(self.api.raw(), sys::OrtErrorCode::ORT_FAIL, msg)
    }
}

/// A C string the runtime gave us, or "" when null.
///
/// # Safety
/// `p` is null or a NUL-terminated string valid for `'a`.
unsafe fn c_str<'a>(p: *const c_char) -> &'a CStr {
    if p.is_null() {
        c""
    } else {
        // SAFETY: the caller's contract.
        unsafe { CStr::from_ptr(p) }
    }
}

/// The device kernels of fake-device mode: the op's own CPU kernel (device memory is host
/// memory), counted.
struct FakeKernels;

struct Counted(Box<dyn super::Kernel>);

impl super::Kernel for Counted {
    fn compute(&self, ctx: &mut super::Context<'_>) -> crate::error::Result<()> {
        bump(&COUNTERS.device_runs);
        self.0.compute(ctx)
    }
}

impl super::op::DeviceKernels for FakeKernels {
    fn create(
        &self,
        spec: &'static dyn OpSpec,
        info: &super::KernelInfo<'_>,
    ) -> crate::error::Result<Box<dyn super::Kernel>> {
        Ok(Box::new(Counted(spec.create(info)?)))
    }
}

static FAKE_KERNELS: FakeKernels = FakeKernels;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_negotiate() {
        assert_eq!(parse_version("1.24.4"), Some((1, 24)));
        assert_eq!(parse_version("1.32.0"), Some((1, 32)));
        assert_eq!(parse_version("1.25.0-dev"), Some((1, 25)));
        assert_eq!(parse_version("garbage"), None);
        assert_eq!(negotiate((1, 17)), None);
        assert_eq!(negotiate((1, 23)), None);
        assert_eq!(negotiate((1, 24)), Some(24));
        assert_eq!(negotiate((1, 32)), Some(24));
        assert_eq!(negotiate((2, 0)), Some(24));
    }

    #[test]
    fn fake_device_count_is_one_to_eight() {
        assert_eq!(fake_count(None), 1);
        assert_eq!(fake_count(Some("2")), 2);
        assert_eq!(fake_count(Some(" 8 ")), 8);
        for bad in ["0", "9", "-1", "two", ""] {
            assert_eq!(fake_count(Some(bad)), 1, "{bad:?}");
        }
    }
}
