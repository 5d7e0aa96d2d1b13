use thiserror::Error;

/// Errors a kernel reports to its caller; the runtime layer adds the op and input names.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KernelError {
    /// A shape cannot be broadcast to the target shape under numpy's rules.
    #[error("shape {from:?} is not unidirectionally broadcastable to {to:?}")]
    NotBroadcastable {
        /// The source shape.
        from: Vec<usize>,
        /// The target shape.
        to: Vec<usize>,
    },
    /// Buffers that must have equal lengths do not.
    #[error("length mismatch: {what} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length it must have.
        expected: usize,
    },
    /// A size computed from dimensions or attributes does not fit in `usize` (or an ONNX
    /// dimension in `i64`): no tensor can have it.
    #[error("size overflow: {what}")]
    Overflow {
        /// What was being computed, with the operands.
        what: String,
    },
    /// Working memory of this many bytes could not be allocated.
    #[error("cannot allocate {bytes} bytes for {what}")]
    Allocation {
        /// Which buffer.
        what: &'static str,
        /// Its size.
        bytes: u128,
    },
}
