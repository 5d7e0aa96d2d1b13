//! The only code that touches ONNX Runtime's C API: the API table and statuses, the one
//! panic boundary ([`api::boundary`]), registration of the op catalogue ([`register`]), op
//! descriptors ([`op`]), what they know of devices ([`device`]), the plugin execution provider
//! ([`ep`], built on `op` and `device`; neither `op` nor `register` imports it), a kernel
//! call's context and tensors, the alias plan of a call's buffers and the session's thread
//! pool.

pub mod alias;
pub mod api;
pub mod context;
pub mod device;
pub mod ep;
pub mod op;
pub mod pool;
pub mod register;
pub mod tensor;

pub use api::Api;
pub use context::{Context, KernelInfo, ShapeInfer};
pub use op::{Formal, Kernel, OpDescriptor, OpSpec, Signature};
pub use register::Domain;
pub use tensor::{DType, Tensor};
