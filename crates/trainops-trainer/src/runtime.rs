//! ONNX Runtime set-up: the process's one environment (ONNX Runtime loaded at run time,
//! never linked) and session builders with the trainops custom-op library registered.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ort::environment::Environment;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};

use crate::error::{Error, Result};

/// The environment variable naming ONNX Runtime's shared library (`libonnxruntime.so.*`),
/// as `ort`'s `load-dynamic` feature reads it.
pub const ORT_DYLIB_PATH: &str = "ORT_DYLIB_PATH";
/// The environment variable naming the trainops custom-op library (`libtrainops.so`), as
/// the Python package reads it.
pub const TRAINOPS_LIBRARY: &str = "TRAINOPS_LIBRARY";

/// The process's ONNX Runtime environment, created on the first call: ONNX Runtime is
/// loaded from `onnxruntime` if given, else from `$ORT_DYLIB_PATH`, else by the name
/// `libonnxruntime.so` (the dynamic loader's search path). Later calls return the same
/// environment whatever `onnxruntime` they pass (a process loads ONNX Runtime once).
pub fn environment(onnxruntime: Option<&Path>) -> Result<&'static Environment> {
    static ENV: OnceLock<std::result::Result<Environment, String>> = OnceLock::new();
    let path = onnxruntime.map(Path::to_path_buf).or_else(|| std::env::var_os(ORT_DYLIB_PATH).map(PathBuf::from));
    let result = ENV.get_or_init(|| {
        let dylib = path.clone().unwrap_or_else(|| {
            PathBuf::from(format!("{}onnxruntime{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX))
        });
        let builder = ort::init_from(&dylib).map_err(|e| {
            format!(
                "{}: {e} (point {ORT_DYLIB_PATH} at ONNX Runtime's shared library, e.g. the \
                 onnxruntime wheel's onnxruntime/capi/libonnxruntime.so.<version>)",
                dylib.display()
            )
        })?;
        builder.with_name("trainops-trainer").build().map_err(|e| format!("{}: {e}", dylib.display()))
    });
    match result {
        Ok(env) => Ok(env),
        Err(message) => {
            Err(Error::Library { what: "ONNX Runtime", path: path.unwrap_or_default(), message: message.clone() })
        }
    }
}

/// The custom-op library to register: `explicit` if given, else `$TRAINOPS_LIBRARY`, else
/// `fallback` (e.g. the manifest's `custom_op_library` beside the artifacts) when it
/// exists. `None`: none found.
pub fn find_library(explicit: Option<&Path>, fallback: Option<&Path>) -> Option<PathBuf> {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(TRAINOPS_LIBRARY).map(PathBuf::from))
        .or_else(|| fallback.filter(|p| p.is_file()).map(Path::to_path_buf))
}

/// A session builder on `env` with the trainops custom-op library at `library` registered,
/// all graph optimizations on (ONNX Runtime's default, as in Python), `threads` intra-op
/// threads and one inter-op thread (`None`: ONNX Runtime's choice).
///
/// [`Error::Library`] when the library does not exist or ONNX Runtime refuses it.
pub fn session_builder(env: &Environment, library: &Path, threads: Option<usize>) -> Result<SessionBuilder> {
    if !library.is_file() {
        return Err(Error::Library {
            what: "the trainops custom-op library",
            path: library.to_path_buf(),
            message: format!(
                "no such file (build it with `cargo build -p trainops-ort`, or point \
                 {TRAINOPS_LIBRARY} at libtrainops.so)"
            ),
        });
    }
    let mut builder = plain_builder(env, threads)?;
    builder = builder.with_operator_library(library).map_err(|e| Error::Library {
        what: "the trainops custom-op library",
        path: library.to_path_buf(),
        message: format!("ONNX Runtime refused it: {e}"),
    })?;
    Ok(builder)
}

/// A session builder as [`session_builder`] without a custom-op library.
pub fn plain_builder(env: &Environment, threads: Option<usize>) -> Result<SessionBuilder> {
    let mut builder = ort::session::Session::builder(env)?.with_optimization_level(GraphOptimizationLevel::All)?;
    if let Some(n) = threads {
        builder = builder.with_intra_threads(n)?.with_inter_threads(1)?;
    }
    Ok(builder)
}
