//! The `OrtEpFactory` and the `OrtEp` it creates: devices, the custom-op domains (a CPU and
//! a device descriptor of each op), and `GetCapability`'s claim of the nodes whose device
//! kernels take their types.

use core::ffi::{c_char, CStr};
use std::sync::OnceLock;

use ort_sys as sys;

use super::abi::{self, EpFactory, Opaque};
use super::bus;
use super::{bump, c_str, cuda, memory, Backend, Device, Factory, Plugin, COUNTERS, EP_NAME, FAKE_KERNELS};
use crate::ffi::api::boundary;
use crate::ffi::op::{DeviceKernels, OpDescriptor, Placement};
use crate::ffi::{Api, DType};

/// The EP of one session.
#[repr(C)]
struct Ep {
    base: abi::Ep,
    plugin: &'static Plugin,
}

struct Domains(Vec<*mut sys::OrtCustomOpDomain>);
// SAFETY: made once, never mutated; the runtime shares them between sessions and threads.
unsafe impl Send for Domains {}
// SAFETY: as above.
unsafe impl Sync for Domains {}

static DOMAINS: OnceLock<std::result::Result<Domains, String>> = OnceLock::new();

/// # Safety
/// `this` is a pointer [`leak`] returned.
unsafe fn factory<'a>(this: *const EpFactory) -> &'a Factory {
    // SAFETY: `base` is the first field of the `#[repr(C)]` Factory.
    unsafe { &*this.cast::<Factory>() }
}

fn name_of(plugin: &Plugin, f: impl FnOnce() -> *const c_char) -> *const c_char {
    boundary(Some(plugin.api), "TrainopsExecutionProvider", f)
}

unsafe extern "system" fn get_name(_this: *const EpFactory) -> *const c_char {
    EP_NAME.as_ptr()
}

unsafe extern "system" fn get_vendor(_this: *const EpFactory) -> *const c_char {
    c"trainops".as_ptr()
}

unsafe extern "system" fn get_vendor_id(_this: *const EpFactory) -> u32 {
    0
}

unsafe extern "system" fn get_version(_this: *const EpFactory) -> *const c_char {
    const VERSION: &CStr = match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => c"0.0.0",
    };
    VERSION.as_ptr()
}

/// A new factory, owned by the runtime until `ReleaseEpFactory`.
pub fn leak(plugin: &'static Plugin, version: u32) -> *mut EpFactory {
    let base = EpFactory {
        ort_version_supported: version,
        get_name,
        get_vendor,
        get_supported_devices,
        create_ep,
        release_ep,
        get_vendor_id,
        get_version,
        validate_compiled_model: None,
        create_allocator: memory::create_allocator,
        release_allocator: memory::release_allocator,
        create_data_transfer: memory::create_data_transfer,
        is_stream_aware,
        create_sync_stream,
        get_incompatibility_details,
        create_external_resource_importer,
        get_num_custom_op_domains,
        get_custom_op_domains,
    };
    Box::into_raw(Box::new(Factory { base, plugin, devices: OnceLock::new() })).cast()
}

/// Frees a factory [`leak`] made.
///
/// # Safety
/// `this` is null or from [`leak`], released once.
pub unsafe fn release(this: *mut EpFactory) {
    if !this.is_null() {
        // SAFETY: the caller's contract; memory infos and hardware devices stay alive
        // (allocators of live sessions may still hand them out).
        drop(unsafe { Box::from_raw(this.cast::<Factory>()) });
    }
}

fn check(api: Api, call: &'static str, status: sys::OrtStatusPtr) -> crate::error::Result<()> {
    api.check("TrainopsExecutionProvider", call, status)
}

/// A key-value list of the runtime's, released on drop.
struct Pairs<'a> {
    plugin: &'a Plugin,
    raw: *mut Opaque,
}

impl<'a> Pairs<'a> {
    fn new(plugin: &'a Plugin, entries: &[(&CStr, &str)]) -> crate::error::Result<Self> {
        let mut raw: *mut Opaque = core::ptr::null_mut();
        // SAFETY: a valid out pointer.
        unsafe { (plugin.ext.create_key_value_pairs)(&mut raw) };
        let pairs = Self { plugin, raw };
        for (key, value) in entries {
            let value = std::ffi::CString::new(*value).map_err(|e| crate::error::Error::Runtime {
                op: "TrainopsExecutionProvider",
                call: "AddKeyValuePair",
                message: e.to_string(),
            })?;
            // SAFETY: a live list and NUL-terminated strings (the runtime copies them).
            unsafe { (plugin.ext.add_key_value_pair)(pairs.raw, key.as_ptr(), value.as_ptr()) };
        }
        Ok(pairs)
    }
}

impl Drop for Pairs<'_> {
    fn drop(&mut self) {
        // SAFETY: made by CreateKeyValuePairs, released once; users of it copied it.
        unsafe { (self.plugin.ext.release_key_value_pairs)(self.raw) };
    }
}

/// The `pci_bus_id` metadata of a hardware device, parsed.
fn bus_of(p: &Plugin, hw: *const Opaque) -> Option<bus::BusId> {
    // SAFETY: a live hardware device; the metadata and its strings are owned by it.
    let text = unsafe {
        let md = (p.ext.hardware_device_metadata)(hw);
        if md.is_null() {
            return None;
        }
        c_str((p.ext.get_key_value)(md, bus::KEY.as_ptr()))
    };
    bus::parse(text.to_str().ok()?)
}

/// The hardware devices to offer, one per GPU ordinal, with their bus ids: the device ONNX
/// Runtime discovered whose `pci_bus_id` is the ordinal's (the driver's
/// `cuDeviceGetPCIBusId`), never by position (ONNX Runtime's list has no order); an ordinal
/// with no such device gets one we create, with the bus id in its metadata. Fake mode creates
/// every device, each with its own made-up bus id (see `bus::fake`), read back from the
/// runtime's object.
fn hardware_devices(
    f: &Factory,
    found: &[*const Opaque],
    backend: Backend,
) -> crate::error::Result<Vec<(*const Opaque, Option<bus::BusId>)>> {
    let p = f.plugin;
    let (count, wanted): (u32, Vec<Option<bus::BusId>>) = match backend {
        Backend::Fake { count } => (count, (0..count).map(|o| Some(bus::fake(o, count))).collect()),
        Backend::Cuda { count } => {
            (count, (0..count).map(|o| trainops_cuda::pci_bus_id(o).ok().and_then(|t| bus::parse(&t))).collect())
        }
    };
    let matched = match backend {
        Backend::Fake { .. } => vec![None; wanted.len()],
        Backend::Cuda { .. } => {
            let discovered: Vec<Option<bus::BusId>> = found
                .iter()
                .map(|&hw| {
                    // SAFETY: hardware devices the runtime passed to this call.
                    let nvidia = unsafe {
                        (p.ext.hardware_device_type)(hw) == abi::HARDWARE_DEVICE_GPU
                            && (p.ext.hardware_device_vendor_id)(hw) == abi::NVIDIA_VENDOR_ID
                    };
                    if nvidia {
                        bus_of(p, hw)
                    } else {
                        None
                    }
                })
                .collect();
            bus::match_ordinals(&wanted, &discovered)
        }
    };
    let mut out = Vec::new();
    for ordinal in 0..count {
        let at = ordinal as usize;
        if let Some(i) = matched[at] {
            out.push((found[i], wanted[at]));
            continue;
        }
        let text = wanted[at].map(bus::format);
        let metadata = Pairs::new(p, &text.iter().map(|t| (bus::KEY, t.as_str())).collect::<Vec<_>>())?;
        let mut hw: *mut Opaque = core::ptr::null_mut();
        // SAFETY: valid arguments and out pointer; the runtime copies the metadata; the device
        // lives for the process.
        check(p.api, "CreateHardwareDevice", unsafe {
            (p.ep_api.create_hardware_device)(
                abi::HARDWARE_DEVICE_GPU,
                abi::NVIDIA_VENDOR_ID,
                ordinal,
                c"NVIDIA".as_ptr(),
                metadata.raw.cast_const(),
                &mut hw,
            )
        })?;
        // The bus id as the runtime's object now says it (fake mode: the reading path).
        out.push((hw.cast_const(), bus_of(p, hw)));
    }
    Ok(out)
}

fn make_devices(f: &Factory, found: &[*const Opaque], backend: Backend) -> crate::error::Result<Vec<Device>> {
    let p = f.plugin;
    let mut out = Vec::new();
    for (ordinal, (hardware, bus_id)) in hardware_devices(f, found, backend)?.into_iter().enumerate() {
        let mut memory: *mut sys::OrtMemoryInfo = core::ptr::null_mut();
        let name = match backend {
            Backend::Fake { .. } => c"TrainopsFakeDevice",
            Backend::Cuda { .. } => c"TrainopsCuda",
        };
        // SAFETY: valid arguments and out pointer; the info is kept for the process.
        check(p.api, "CreateMemoryInfo_V2", unsafe {
            (p.ext.create_memory_info_v2)(
                name.as_ptr(),
                abi::MEMORY_DEVICE_GPU,
                abi::NVIDIA_VENDOR_ID,
                i32::try_from(ordinal).unwrap_or(0),
                abi::DEVICE_MEMORY_DEFAULT,
                0,
                abi::DEVICE_ALLOCATOR,
                &mut memory,
            )
        })?;
        out.push(Device { hardware, pci_bus_id: bus_id.map(bus::format), memory });
    }
    Ok(out)
}

unsafe extern "system" fn get_supported_devices(
    this: *mut EpFactory,
    devices: *const *const Opaque,
    num_devices: usize,
    ep_devices: *mut *mut Opaque,
    max_ep_devices: usize,
    num_ep_devices: *mut usize,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our factory.
    let f = unsafe { factory(this) };
    let p = f.plugin;
    crate::ffi::api::guard(p.api, "TrainopsExecutionProvider", || {
        // SAFETY: the runtime's out pointer.
        unsafe { *num_ep_devices = 0 };
        let Some(backend) = p.backend else { return Ok(()) };
        let found = if devices.is_null() {
            &[][..]
        } else {
            // SAFETY: the runtime's array of `num_devices` hardware devices.
            unsafe { core::slice::from_raw_parts(devices, num_devices) }
        };
        let list = match f.devices.get() {
            Some(list) => list,
            None => {
                let made = make_devices(f, found, backend)?;
                f.devices.get_or_init(|| made)
            }
        };
        let mut n = 0;
        for (ordinal, d) in list.iter().enumerate().take(max_ep_devices) {
            let mut ep_device: *mut Opaque = core::ptr::null_mut();
            // The EP device's metadata: its CUDA ordinal and PCI bus id (Python:
            // `OrtEpDevice.ep_metadata`), so callers pick a GPU by bus, not by list position.
            let ordinal = ordinal.to_string();
            let mut entries = vec![(c"device_id", ordinal.as_str())];
            if let Some(b) = &d.pci_bus_id {
                entries.push((bus::KEY, b.as_str()));
            }
            let metadata = Pairs::new(p, &entries)?;
            // SAFETY: our factory, a live hardware device, metadata the runtime copies, no
            // options.
            check(p.api, "CreateEpDevice", unsafe {
                (p.ep_api.create_ep_device)(
                    this,
                    d.hardware,
                    metadata.raw.cast_const(),
                    core::ptr::null(),
                    &mut ep_device,
                )
            })?;
            // SAFETY: the device just made and our memory info (copied by the runtime).
            check(p.api, "EpDevice_AddAllocatorInfo", unsafe {
                (p.ep_api.ep_device_add_allocator_info)(ep_device, d.memory.cast_const().cast())
            })?;
            // SAFETY: the runtime's array has `max_ep_devices` slots; it owns the device now.
            unsafe { *ep_devices.add(n) = ep_device };
            n += 1;
        }
        // SAFETY: the runtime's out pointer.
        unsafe { *num_ep_devices = n };
        Ok(())
    })
}

unsafe extern "system" fn create_ep(
    this: *mut EpFactory,
    _devices: *const *const Opaque,
    _metadata: *const *const Opaque,
    _num_devices: usize,
    _options: *const Opaque,
    _logger: *const Opaque,
    ep: *mut *mut abi::Ep,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our factory.
    let f = unsafe { factory(this) };
    let p = f.plugin;
    crate::ffi::api::guard(p.api, "TrainopsExecutionProvider", || {
        let base = abi::Ep {
            ort_version_supported: f.base.ort_version_supported,
            get_name: ep_get_name,
            get_capability,
            compile,
            release_node_compute_infos,
            get_preferred_data_layout: None,
            should_convert_data_layout: None,
            set_dynamic_options: None,
            on_run_start: None,
            on_run_end: None,
            create_allocator: None,
            create_sync_stream: None,
            get_compiled_model_compatibility_info: None,
            get_kernel_registry: None,
            later: [None; 8],
        };
        // SAFETY: the runtime's out pointer; it hands the EP back to `release_ep`.
        unsafe { *ep = Box::into_raw(Box::new(Ep { base, plugin: p })).cast() };
        Ok(())
    })
}

unsafe extern "system" fn release_ep(_this: *mut EpFactory, ep: *mut abi::Ep) {
    if !ep.is_null() {
        // SAFETY: an EP `create_ep` made, released once by the runtime.
        let ep = unsafe { Box::from_raw(ep.cast::<Ep>()) };
        boundary(Some(ep.plugin.api), "TrainopsExecutionProvider", move || drop(ep));
    }
}

unsafe extern "system" fn is_stream_aware(_this: *const EpFactory) -> bool {
    false
}

unsafe extern "system" fn create_sync_stream(
    _this: *mut EpFactory,
    _device: *const Opaque,
    _options: *const Opaque,
    stream: *mut *mut Opaque,
) -> sys::OrtStatusPtr {
    if !stream.is_null() {
        // SAFETY: the runtime's out pointer: no stream (not stream aware).
        unsafe { *stream = core::ptr::null_mut() };
    }
    sys::OrtStatusPtr::default()
}

unsafe extern "system" fn get_incompatibility_details(
    _this: *mut EpFactory,
    _hw: *const Opaque,
    _details: *mut Opaque,
) -> sys::OrtStatusPtr {
    sys::OrtStatusPtr::default()
}

unsafe extern "system" fn create_external_resource_importer(
    this: *mut EpFactory,
    _device: *const Opaque,
    out: *mut *mut Opaque,
) -> sys::OrtStatusPtr {
    if !out.is_null() {
        // SAFETY: the runtime's out pointer.
        unsafe { *out = core::ptr::null_mut() };
    }
    // SAFETY: the runtime passes back our factory.
    let p = unsafe { factory(this) }.plugin;
    new_not_implemented(p.api, "TrainopsExecutionProvider imports no external resources")
}

fn new_not_implemented(api: Api, msg: &str) -> sys::OrtStatusPtr {
    crate::ffi::api::new_status(api.raw(), sys::OrtErrorCode::ORT_NOT_IMPLEMENTED, msg)
}

/// The custom-op domains the EP supplies: every op's CPU descriptor, and beside it the device
/// descriptor of each op the device table lists.
fn domains(p: &'static Plugin) -> crate::error::Result<&'static [*mut sys::OrtCustomOpDomain]> {
    let made = DOMAINS.get_or_init(|| {
        let raw = p.api.raw();
        let kernels: &'static dyn DeviceKernels = match p.backend {
            Some(Backend::Cuda { .. }) => cuda::cuda_kernels(),
            _ => &FAKE_KERNELS,
        };
        let mut list = Vec::new();
        for domain in (p.catalogue)() {
            let mut d: *mut sys::OrtCustomOpDomain = core::ptr::null_mut();
            // SAFETY: a valid NUL-terminated name and out pointer.
            check(p.api, "CreateCustomOpDomain", unsafe { (raw.CreateCustomOpDomain)(domain.name.as_ptr(), &mut d) })
                .map_err(|e| e.to_string())?;
            for spec in domain.ops {
                let mut descriptors = vec![OpDescriptor::leak(spec, true)];
                if let Some(support) = p.device_support(domain.name, spec.name()) {
                    let placement =
                        Placement::Device { ep: EP_NAME, host_inputs: support.host_inputs, kernel: kernels };
                    descriptors.push(OpDescriptor::leak_placed(spec, placement, true));
                }
                for op in descriptors {
                    // SAFETY: `d` was just made; `op` is leaked, so it outlives the domain.
                    check(p.api, "CustomOpDomain_Add", unsafe { (raw.CustomOpDomain_Add)(d, op.as_raw()) })
                        .map_err(|e| e.to_string())?;
                }
            }
            list.push(d);
        }
        Ok(Domains(list))
    });
    made.as_ref().map(|d| d.0.as_slice()).map_err(|message| crate::error::Error::Runtime {
        op: "TrainopsExecutionProvider",
        call: "custom-op domains",
        message: message.clone(),
    })
}

unsafe extern "system" fn get_num_custom_op_domains(this: *mut EpFactory, n: *mut usize) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our factory.
    let p = unsafe { factory(this) }.plugin;
    crate::ffi::api::guard(p.api, "TrainopsExecutionProvider", || {
        let list = domains(p)?;
        // SAFETY: the runtime's out pointer.
        unsafe { *n = list.len() };
        Ok(())
    })
}

unsafe extern "system" fn get_custom_op_domains(
    this: *mut EpFactory,
    out: *mut *mut sys::OrtCustomOpDomain,
    n: usize,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our factory.
    let p = unsafe { factory(this) }.plugin;
    crate::ffi::api::guard(p.api, "TrainopsExecutionProvider", || {
        let list = domains(p)?;
        for (i, d) in list.iter().take(n).enumerate() {
            // SAFETY: the runtime's array of `n` slots; the domains live for the process.
            unsafe { *out.add(i) = *d };
        }
        Ok(())
    })
}

/// # Safety
/// `this` is an EP [`create_ep`] made.
unsafe fn ep<'a>(this: *const abi::Ep) -> &'a Ep {
    // SAFETY: `base` is the first field of the `#[repr(C)]` Ep.
    unsafe { &*this.cast::<Ep>() }
}

unsafe extern "system" fn ep_get_name(this: *const abi::Ep) -> *const c_char {
    // SAFETY: the runtime passes back our EP.
    let p = unsafe { ep(this) }.plugin;
    name_of(p, || EP_NAME.as_ptr())
}

/// The element type of a node input, when it is a tensor.
fn input_type(p: &Plugin, value_info: *const Opaque) -> Option<DType> {
    let raw = p.api.raw();
    let mut type_info: *const sys::OrtTypeInfo = core::ptr::null();
    // SAFETY: a value info of a node of the graph being partitioned; out pointer valid.
    let status = unsafe { (p.ext.get_value_info_type_info)(value_info, &mut type_info) };
    p.api.check("TrainopsExecutionProvider", "GetValueInfoTypeInfo", status).ok()?;
    let mut tensor: *const sys::OrtTensorTypeAndShapeInfo = core::ptr::null();
    // SAFETY: the type info just read, owned by the value info.
    let status = unsafe { (raw.CastTypeInfoToTensorInfo)(type_info, &mut tensor) };
    p.api.check("TrainopsExecutionProvider", "CastTypeInfoToTensorInfo", status).ok()?;
    if tensor.is_null() {
        return None;
    }
    let mut elem = sys::ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    // SAFETY: a tensor info owned by the type info.
    let status = unsafe { (raw.GetTensorElementType)(tensor, &mut elem) };
    p.api.check("TrainopsExecutionProvider", "GetTensorElementType", status).ok()?;
    Some(DType::from_raw(elem as i32))
}

/// Whether the EP runs `node`: an op of the device table whose device inputs all have types
/// its device kernels take.
fn claims(p: &Plugin, node: *const Opaque) -> crate::error::Result<Option<bool>> {
    let mut domain: *const c_char = core::ptr::null();
    let mut op: *const c_char = core::ptr::null();
    // SAFETY: a node of the graph being partitioned; out pointers valid.
    unsafe {
        check(p.api, "Node_GetDomain", (p.ext.node_get_domain)(node, &mut domain))?;
        check(p.api, "Node_GetOperatorType", (p.ext.node_get_operator_type)(node, &mut op))?;
    }
    // SAFETY: NUL-terminated strings owned by the node.
    let (domain, op) = unsafe { (c_str(domain), c_str(op)) };
    static NAMES: OnceLock<Vec<(&'static CStr, &'static CStr)>> = OnceLock::new();
    let names = NAMES
        .get_or_init(|| (p.catalogue)().iter().flat_map(|d| d.ops.iter().map(move |s| (d.name, s.name()))).collect());
    let ours = names.iter().any(|&(d, o)| d == domain && o == op);
    if !ours {
        return Ok(None);
    }
    let Some(support) = p.device_support(domain, op) else { return Ok(Some(false)) };
    let mut n = 0usize;
    // SAFETY: as above.
    check(p.api, "Node_GetNumInputs", unsafe { (p.ext.node_get_num_inputs)(node, &mut n) })?;
    let mut inputs = vec![core::ptr::null::<Opaque>(); n];
    // SAFETY: an array of `n` slots.
    check(p.api, "Node_GetInputs", unsafe { (p.ext.node_get_inputs)(node, inputs.as_mut_ptr(), n) })?;
    for (i, &vi) in inputs.iter().enumerate() {
        if vi.is_null() || support.host_inputs.contains(&i) {
            continue;
        }
        match input_type(p, vi) {
            Some(t) if support.types.contains(&t) => {}
            _ => return Ok(Some(false)),
        }
    }
    Ok(Some(true))
}

unsafe extern "system" fn get_capability(
    this: *mut abi::Ep,
    graph: *const Opaque,
    info: *mut Opaque,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our EP.
    let p = unsafe { ep(this) }.plugin;
    crate::ffi::api::guard(p.api, "TrainopsExecutionProvider", || {
        let mut n = 0usize;
        // SAFETY: the graph being partitioned; out pointer valid.
        check(p.api, "Graph_GetNumNodes", unsafe { (p.ext.graph_get_num_nodes)(graph, &mut n) })?;
        let mut nodes = vec![core::ptr::null::<Opaque>(); n];
        // SAFETY: an array of `n` slots.
        check(p.api, "Graph_GetNodes", unsafe { (p.ext.graph_get_nodes)(graph, nodes.as_mut_ptr(), n) })?;
        for node in nodes {
            match claims(p, node)? {
                Some(true) => {
                    // SAFETY: the runtime's support info and a node of its graph.
                    check(p.api, "EpGraphSupportInfo_AddSingleNode", unsafe {
                        (p.ep_api.add_single_node)(info, node)
                    })?;
                    bump(&COUNTERS.claimed);
                }
                Some(false) => bump(&COUNTERS.declined),
                None => {}
            }
        }
        Ok(())
    })
}

unsafe extern "system" fn compile(
    this: *mut abi::Ep,
    _graphs: *const *const Opaque,
    _fused: *const *const Opaque,
    _count: usize,
    _infos: *mut *mut Opaque,
    _ep_context: *mut *mut Opaque,
) -> sys::OrtStatusPtr {
    // SAFETY: the runtime passes back our EP.
    let p = unsafe { ep(this) }.plugin;
    p.status("TrainopsExecutionProvider compiles nothing: its nodes run on registered kernels")
}

unsafe extern "system" fn release_node_compute_infos(_this: *mut abi::Ep, _infos: *mut *mut Opaque, _n: usize) {}
