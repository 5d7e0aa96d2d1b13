//! The one error type of the runtime layer. Every message starts with the op's name and,
//! where an input is at fault, names its index, its formal name and what was expected, e.g.
//! `Adam: input 3 (G_1): expected tensor(float) like X_1, got tensor(double)`.

use thiserror::Error;

/// What went wrong in a kernel, as an ONNX Runtime user will read it.
#[derive(Debug, Error)]
pub enum Error {
    /// An input is not what the op's contract allows.
    #[error("{op}: input {index} ({name}): expected {expected}, got {got}")]
    Input {
        /// Op name.
        op: &'static str,
        /// Zero-based index among the node's inputs.
        index: usize,
        /// Formal name (`R`, `T`, `X_1`, ...).
        name: String,
        /// What the contract requires.
        expected: String,
        /// What the node has.
        got: String,
    },
    /// An output (allocated by the runtime or bound by the caller) is not what it must be.
    #[error("{op}: output {index} ({name}): expected {expected}, got {got}")]
    Output {
        /// Op name.
        op: &'static str,
        /// Zero-based index among the node's outputs.
        index: usize,
        /// Formal name (`X_1_new`, ...).
        name: String,
        /// What it must be.
        expected: String,
        /// What it is.
        got: String,
    },
    /// The node's number of inputs or outputs is not allowed.
    #[error("{op}: {what}")]
    Arity {
        /// Op name.
        op: &'static str,
        /// What is wrong, with the counts.
        what: String,
    },
    /// An attribute has the wrong type or an invalid value.
    #[error("{op}: attribute '{name}': {what}")]
    Attribute {
        /// Op name.
        op: &'static str,
        /// Attribute name.
        name: &'static str,
        /// What is wrong.
        what: String,
    },
    /// Buffers bound by the caller overlap in a way no result can be defined for.
    #[error("{op}: {what}")]
    Aliasing {
        /// Op name.
        op: &'static str,
        /// Which buffers.
        what: String,
    },
    /// A kernel refused the buffers it was given (a size no tensor can have, lengths that do
    /// not fit): the checks before it should have said so; the message says what.
    #[error("{op}: {message}")]
    Kernel {
        /// Op name.
        op: &'static str,
        /// The kernel's message.
        message: String,
    },
    /// Working memory a kernel needs could not be allocated.
    #[error("{op}: {message}")]
    Memory {
        /// Op name.
        op: &'static str,
        /// What could not be allocated, and its size.
        message: String,
    },
    /// A call into ONNX Runtime failed.
    #[error("{op}: ONNX Runtime's {call} failed: {message}")]
    Runtime {
        /// Op name.
        op: &'static str,
        /// The C API function.
        call: &'static str,
        /// The runtime's message.
        message: String,
    },
    /// A Rust panic, caught at the FFI boundary.
    #[error("{op}: internal error (a bug in trainops, please report it): {message}")]
    Panic {
        /// Op name, or `trainops` outside any op.
        op: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl Error {
    /// A bad input.
    pub fn input(
        op: &'static str,
        index: usize,
        name: impl Into<String>,
        expected: impl Into<String>,
        got: impl Into<String>,
    ) -> Self {
        Self::Input { op, index, name: name.into(), expected: expected.into(), got: got.into() }
    }

    /// ONNX Runtime's error code for this error.
    pub fn code(&self) -> ort_sys::OrtErrorCode {
        use ort_sys::OrtErrorCode::*;
        match self {
            Self::Input { .. }
            | Self::Output { .. }
            | Self::Arity { .. }
            | Self::Attribute { .. }
            | Self::Aliasing { .. }
            | Self::Kernel { .. } => ORT_INVALID_ARGUMENT,
            Self::Memory { .. } | Self::Runtime { .. } | Self::Panic { .. } => ORT_FAIL,
        }
    }

    /// A kernel's refusal as the op's error: working memory it could not get is
    /// [`Error::Memory`], anything else [`Error::Kernel`].
    pub fn kernel(op: &'static str, e: trainops_kernels::KernelError) -> Self {
        match e {
            trainops_kernels::KernelError::Allocation { .. } => Self::Memory { op, message: e.to_string() },
            _ => Self::Kernel { op, message: e.to_string() },
        }
    }
}

/// Result of the runtime layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;
