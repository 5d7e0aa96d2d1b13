//! The crate's one error type.

use std::path::PathBuf;

use crate::dtype::DType;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong loading artifacts, training or saving. Each message names
/// the file or tensor concerned and what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// `manifest.json` is missing, not JSON, not valid against its schema, or binds
    /// names the training model does not have: every problem found is listed, each with
    /// its key (`states[0].output`) and what was expected.
    #[error("manifest {}: {}", path.display(), problems.join("; "))]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// Each problem.
        problems: Vec<String>,
    },
    /// A checkpoint (or a batches file) is no valid safetensors file, or does not fit the
    /// manifest: every problem found is listed.
    #[error("checkpoint {}: {}", path.display(), problems.join("; "))]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// Each problem (a missing state, a dtype or shape mismatch, bad metadata, ...).
        problems: Vec<String>,
    },
    /// A batch lacks a data input the training (or eval) model needs.
    #[error("{what}: the batch has no tensor {name:?} (the model's data inputs: {expected:?})")]
    MissingInput {
        /// The call (`Trainer::step`, `Trainer::eval`).
        what: &'static str,
        /// The missing input.
        name: String,
        /// Every data input.
        expected: Vec<String>,
    },
    /// A batch has a tensor that is no data input of the model.
    #[error("{what}: {name:?} is not a data input of the model (its data inputs: {expected:?})")]
    UnknownInput {
        /// The call.
        what: &'static str,
        /// The unexpected name.
        name: String,
        /// Every data input.
        expected: Vec<String>,
    },
    /// A tensor's element type is not the one expected.
    #[error("{what}: expected {expected}, got {got}")]
    DType {
        /// The tensor (and the call).
        what: String,
        /// The dtype the manifest (or the tensor) has.
        expected: DType,
        /// The dtype given.
        got: DType,
    },
    /// A tensor's shape is not the one expected (`None`: a dynamic dimension).
    #[error("{what}: expected shape {}, got {got:?}", fmt_shape(expected))]
    Shape {
        /// The tensor (and the call).
        what: String,
        /// The manifest's shape.
        expected: Vec<Option<usize>>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// The custom-op library or ONNX Runtime itself could not be found or loaded.
    #[error("{what} {}: {message}", path.display())]
    Library {
        /// Which library (`"the trainops custom-op library"`, `"ONNX Runtime"`).
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// Why it failed, and how to point at it.
        message: String,
    },
    /// An error from ONNX Runtime (session creation, a failing node, ...).
    #[error("ONNX Runtime: {0}")]
    Ort(#[from] ort::Error),
    /// An invalid argument (a learning rate that is not finite, ...).
    #[error("{0}")]
    Invalid(String),
}

fn fmt_shape(shape: &[Option<usize>]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.map_or_else(|| "?".to_string(), |d| d.to_string())).collect();
    format!("[{}]", dims.join(", "))
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

impl From<ort::Error<ort::session::builder::SessionBuilder>> for Error {
    fn from(e: ort::Error<ort::session::builder::SessionBuilder>) -> Self {
        Error::Ort(e.into())
    }
}
