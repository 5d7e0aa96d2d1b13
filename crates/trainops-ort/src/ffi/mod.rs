//! The only code that touches ONNX Runtime's C API: the API table, statuses, the panic
//! boundary, tensors of a kernel context, kernel info, shape inference and op descriptors.

pub mod alias;
pub mod api;
pub mod context;
pub mod op;
pub mod pool;
pub mod tensor;

pub use api::Api;
pub use context::{Context, KernelInfo, ShapeInfer};
pub use op::{Formal, Kernel, OpDescriptor, OpSpec, Signature};
pub use tensor::{DType, Tensor};
