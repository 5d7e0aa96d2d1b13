//! The plugin-EP ABI that `ort-sys` (pinned to the 1.17 C API) does not have: the structs a
//! plugin implements (`OrtEpFactory`, `OrtEp`, `OrtDataTransferImpl`), the prefix of
//! `OrtEpApi` we call, and the handful of `OrtApi` entries newer than 1.17, read from the
//! runtime's table by slot.
//!
//! Layouts are those of the ONNX Runtime 1.24 release headers
//! (`onnxruntime_ep_c_api.h`, `onnxruntime_c_api.h`). Every implementer struct starts with
//! `ort_version_supported`; the runtime reads no field past that version, and the structs are
//! append-only, so the version-24 prefixes below serve every runtime from 1.24 on.

use core::ffi::{c_char, c_void};

use ort_sys as sys;

/// The C API version whose layouts this module spells out.
pub const EP_API_VERSION: u32 = 24;

/// Opaque runtime objects, all passed as `void` pointers here.
pub type Opaque = c_void;

/// `OrtHardwareDeviceType_GPU`.
pub const HARDWARE_DEVICE_GPU: i32 = 1;
/// `OrtMemoryInfoDeviceType_CPU`.
pub const MEMORY_DEVICE_CPU: i32 = 0;
/// `OrtMemoryInfoDeviceType_GPU`.
pub const MEMORY_DEVICE_GPU: i32 = 1;
/// `OrtDeviceMemoryType_DEFAULT`.
pub const DEVICE_MEMORY_DEFAULT: i32 = 0;
/// `OrtDeviceAllocator`.
pub const DEVICE_ALLOCATOR: i32 = 0;
/// NVIDIA's PCI vendor id, which ONNX Runtime's own CUDA provider also uses.
pub const NVIDIA_VENDOR_ID: u32 = 0x10DE;

type Status = sys::OrtStatusPtr;

/// `OrtEpFactory` (version 24 prefix).
#[repr(C)]
pub struct EpFactory {
    pub ort_version_supported: u32,
    pub get_name: unsafe extern "system" fn(*const EpFactory) -> *const c_char,
    pub get_vendor: unsafe extern "system" fn(*const EpFactory) -> *const c_char,
    pub get_supported_devices: unsafe extern "system" fn(
        *mut EpFactory,
        *const *const Opaque,
        usize,
        *mut *mut Opaque,
        usize,
        *mut usize,
    ) -> Status,
    pub create_ep: unsafe extern "system" fn(
        *mut EpFactory,
        *const *const Opaque,
        *const *const Opaque,
        usize,
        *const Opaque,
        *const Opaque,
        *mut *mut Ep,
    ) -> Status,
    pub release_ep: unsafe extern "system" fn(*mut EpFactory, *mut Ep),
    pub get_vendor_id: unsafe extern "system" fn(*const EpFactory) -> u32,
    pub get_version: unsafe extern "system" fn(*const EpFactory) -> *const c_char,
    pub validate_compiled_model: Option<unsafe extern "system" fn()>,
    pub create_allocator:
        unsafe extern "system" fn(*mut EpFactory, *const Opaque, *const Opaque, *mut *mut sys::OrtAllocator) -> Status,
    pub release_allocator: unsafe extern "system" fn(*mut EpFactory, *mut sys::OrtAllocator),
    pub create_data_transfer: unsafe extern "system" fn(*mut EpFactory, *mut *mut DataTransfer) -> Status,
    pub is_stream_aware: unsafe extern "system" fn(*const EpFactory) -> bool,
    pub create_sync_stream:
        unsafe extern "system" fn(*mut EpFactory, *const Opaque, *const Opaque, *mut *mut Opaque) -> Status,
    pub get_incompatibility_details: unsafe extern "system" fn(*mut EpFactory, *const Opaque, *mut Opaque) -> Status,
    pub create_external_resource_importer:
        unsafe extern "system" fn(*mut EpFactory, *const Opaque, *mut *mut Opaque) -> Status,
    pub get_num_custom_op_domains: unsafe extern "system" fn(*mut EpFactory, *mut usize) -> Status,
    pub get_custom_op_domains:
        unsafe extern "system" fn(*mut EpFactory, *mut *mut sys::OrtCustomOpDomain, usize) -> Status,
}

/// `OrtEp` (version 24 prefix).
#[repr(C)]
pub struct Ep {
    pub ort_version_supported: u32,
    pub get_name: unsafe extern "system" fn(*const Ep) -> *const c_char,
    pub get_capability: unsafe extern "system" fn(*mut Ep, *const Opaque, *mut Opaque) -> Status,
    pub compile: unsafe extern "system" fn(
        *mut Ep,
        *const *const Opaque,
        *const *const Opaque,
        usize,
        *mut *mut Opaque,
        *mut *mut Opaque,
    ) -> Status,
    pub release_node_compute_infos: unsafe extern "system" fn(*mut Ep, *mut *mut Opaque, usize),
    pub get_preferred_data_layout: Option<unsafe extern "system" fn()>,
    pub should_convert_data_layout: Option<unsafe extern "system" fn()>,
    pub set_dynamic_options: Option<unsafe extern "system" fn()>,
    pub on_run_start: Option<unsafe extern "system" fn()>,
    pub on_run_end: Option<unsafe extern "system" fn()>,
    pub create_allocator: Option<unsafe extern "system" fn()>,
    pub create_sync_stream: Option<unsafe extern "system" fn()>,
    pub get_compiled_model_compatibility_info: Option<unsafe extern "system" fn()>,
    pub get_kernel_registry: Option<unsafe extern "system" fn()>,
    /// Entries of later versions (IsConcurrentRunSupported, Sync, CreateProfiler, graph
    /// capture, GetAvailableResource), all optional: null, for a runtime that reads past the
    /// version we declare.
    pub later: [Option<unsafe extern "system" fn()>; 8],
}

/// `OrtDataTransferImpl`.
#[repr(C)]
pub struct DataTransfer {
    pub ort_version_supported: u32,
    pub release: unsafe extern "system" fn(*mut DataTransfer),
    pub can_copy: unsafe extern "system" fn(*const DataTransfer, *const Opaque, *const Opaque) -> bool,
    pub copy_tensors: unsafe extern "system" fn(
        *mut DataTransfer,
        *const *const sys::OrtValue,
        *const *mut sys::OrtValue,
        *const *mut Opaque,
        usize,
    ) -> Status,
}

/// The prefix of `OrtEpApi` trainops calls (its first 17 entries, in release order).
#[repr(C)]
pub struct EpApi {
    pub create_ep_device: unsafe extern "system" fn(
        *mut EpFactory,
        *const Opaque,
        *const Opaque,
        *const Opaque,
        *mut *mut Opaque,
    ) -> Status,
    pub release_ep_device: unsafe extern "system" fn(*mut Opaque),
    pub add_nodes_to_fuse: unsafe extern "system" fn(*mut Opaque, *const *const Opaque, usize, *const Opaque) -> Status,
    pub add_single_node: unsafe extern "system" fn(*mut Opaque, *const Opaque) -> Status,
    pub node_compute_context_node_name: unsafe extern "system" fn(*const Opaque) -> *const c_char,
    pub ep_device_add_allocator_info: unsafe extern "system" fn(*mut Opaque, *const Opaque) -> Status,
    pub memory_info_get_memory_device: unsafe extern "system" fn(*const Opaque) -> *const Opaque,
    pub value_get_memory_device: unsafe extern "system" fn(*const sys::OrtValue) -> *const Opaque,
    pub memory_device_are_equal: unsafe extern "system" fn(*const Opaque, *const Opaque) -> bool,
    pub memory_device_get_device_type: unsafe extern "system" fn(*const Opaque) -> i32,
    pub memory_device_get_memory_type: unsafe extern "system" fn(*const Opaque) -> i32,
    pub memory_device_get_vendor_id: unsafe extern "system" fn(*const Opaque) -> u32,
    pub memory_device_get_device_id: unsafe extern "system" fn(*const Opaque) -> u32,
    pub sync_stream_get_impl: unsafe extern "system" fn(*const Opaque) -> *const Opaque,
    pub sync_stream_get_sync_id: unsafe extern "system" fn(*const Opaque) -> u64,
    pub get_sync_id_for_last_wait: unsafe extern "system" fn(*const Opaque, *const Opaque) -> u64,
    pub create_hardware_device:
        unsafe extern "system" fn(i32, u32, u32, *const c_char, *const Opaque, *mut *mut Opaque) -> Status,
}

/// The `OrtApi` entries newer than 1.17 that the plugin EP calls, by their slot in the table
/// (the index of the field in the release header's `struct OrtApi`).
#[derive(Clone, Copy)]
pub struct ApiExt {
    pub get_value_info_type_info: unsafe extern "system" fn(*const Opaque, *mut *const sys::OrtTypeInfo) -> Status,
    pub hardware_device_type: unsafe extern "system" fn(*const Opaque) -> i32,
    pub hardware_device_vendor_id: unsafe extern "system" fn(*const Opaque) -> u32,
    pub get_ep_api: unsafe extern "system" fn() -> *const EpApi,
    pub create_memory_info_v2: unsafe extern "system" fn(
        *const c_char,
        i32,
        u32,
        i32,
        i32,
        usize,
        i32,
        *mut *mut sys::OrtMemoryInfo,
    ) -> Status,
    pub graph_get_num_nodes: unsafe extern "system" fn(*const Opaque, *mut usize) -> Status,
    pub graph_get_nodes: unsafe extern "system" fn(*const Opaque, *mut *const Opaque, usize) -> Status,
    pub node_get_operator_type: unsafe extern "system" fn(*const Opaque, *mut *const c_char) -> Status,
    pub node_get_domain: unsafe extern "system" fn(*const Opaque, *mut *const c_char) -> Status,
    pub node_get_num_inputs: unsafe extern "system" fn(*const Opaque, *mut usize) -> Status,
    pub node_get_inputs: unsafe extern "system" fn(*const Opaque, *mut *const Opaque, usize) -> Status,
    pub create_key_value_pairs: unsafe extern "system" fn(*mut *mut Opaque),
    pub add_key_value_pair: unsafe extern "system" fn(*mut Opaque, *const c_char, *const c_char),
    pub get_key_value: unsafe extern "system" fn(*const Opaque, *const c_char) -> *const c_char,
    pub release_key_value_pairs: unsafe extern "system" fn(*mut Opaque),
    pub hardware_device_metadata: unsafe extern "system" fn(*const Opaque) -> *const Opaque,
}

/// Slots in `OrtApi`: the field offsets of ort-sys 2.0.0-rc.15's `OrtApi` with `api-24`, divided
/// by 8 (`offset_of!`), which follows the release headers.
mod slot {
    pub const GET_VALUE_INFO_TYPE_INFO: usize = 290;
    pub const CREATE_KEY_VALUE_PAIRS: usize = 295;
    pub const ADD_KEY_VALUE_PAIR: usize = 296;
    pub const GET_KEY_VALUE: usize = 297;
    pub const RELEASE_KEY_VALUE_PAIRS: usize = 300;
    pub const HARDWARE_DEVICE_METADATA: usize = 311;
    pub const HARDWARE_DEVICE_TYPE: usize = 307;
    pub const HARDWARE_DEVICE_VENDOR_ID: usize = 308;
    pub const GET_EP_API: usize = 317;
    pub const CREATE_MEMORY_INFO_V2: usize = 320;
    pub const GRAPH_GET_NUM_NODES: usize = 344;
    pub const GRAPH_GET_NODES: usize = 345;
    pub const NODE_GET_OPERATOR_TYPE: usize = 350;
    pub const NODE_GET_DOMAIN: usize = 351;
    pub const NODE_GET_NUM_INPUTS: usize = 353;
    pub const NODE_GET_INPUTS: usize = 354;
}

impl ApiExt {
    /// Reads the entries from `table`.
    ///
    /// # Safety
    /// `table` is the runtime's `OrtApi` of version [`EP_API_VERSION`] or newer.
    pub unsafe fn read(table: *const sys::OrtApi) -> Self {
        let slots = table.cast::<*const c_void>();
        /// Slot `slot` of the table, read as the function-pointer type `F`.
        ///
        /// # Safety
        /// The table holds a non-null function of type `F` at `slot`.
        unsafe fn read<F: Copy>(slots: *const *const c_void, slot: usize) -> F {
            // SAFETY: the caller's contract; function pointers have a data pointer's size.
            unsafe { slots.add(slot).cast::<F>().read() }
        }
        macro_rules! entry {
            ($slot:expr) => {
                // SAFETY: the caller guarantees a table of at least version 24, which holds a
                // non-null function of the field's signature at this slot (release header).
                unsafe { read(slots, $slot) }
            };
        }
        Self {
            get_value_info_type_info: entry!(slot::GET_VALUE_INFO_TYPE_INFO),
            hardware_device_type: entry!(slot::HARDWARE_DEVICE_TYPE),
            hardware_device_vendor_id: entry!(slot::HARDWARE_DEVICE_VENDOR_ID),
            get_ep_api: entry!(slot::GET_EP_API),
            create_memory_info_v2: entry!(slot::CREATE_MEMORY_INFO_V2),
            graph_get_num_nodes: entry!(slot::GRAPH_GET_NUM_NODES),
            graph_get_nodes: entry!(slot::GRAPH_GET_NODES),
            node_get_operator_type: entry!(slot::NODE_GET_OPERATOR_TYPE),
            node_get_domain: entry!(slot::NODE_GET_DOMAIN),
            node_get_num_inputs: entry!(slot::NODE_GET_NUM_INPUTS),
            node_get_inputs: entry!(slot::NODE_GET_INPUTS),
            create_key_value_pairs: entry!(slot::CREATE_KEY_VALUE_PAIRS),
            add_key_value_pair: entry!(slot::ADD_KEY_VALUE_PAIR),
            get_key_value: entry!(slot::GET_KEY_VALUE),
            release_key_value_pairs: entry!(slot::RELEASE_KEY_VALUE_PAIRS),
            hardware_device_metadata: entry!(slot::HARDWARE_DEVICE_METADATA),
        }
    }
}
