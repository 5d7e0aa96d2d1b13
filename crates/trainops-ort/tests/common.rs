//! Shared set-up of the Rust integration tests: ONNX Runtime from the onnxruntime wheel
//! (ort's `load-dynamic`), one environment per process, libtrainops registered per session.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use onnx_protobuf::{Message, TensorProto};
use ort::environment::Environment;
use ort::session::Session;
use ort::value::{DynValue, Tensor};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

/// `libonnxruntime.so.*` of the onnxruntime wheel: `$ORT_DYLIB_PATH`, which the README's
/// test command sets from the project's virtual environment.
pub fn ort_dylib() -> PathBuf {
    match std::env::var_os("ORT_DYLIB_PATH") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "ORT_DYLIB_PATH is not set: point it at the onnxruntime wheel's \
             onnxruntime/capi/libonnxruntime.so.<version>, or run scripts/test, which does"
        ),
    }
}

/// The cdylib this test run built (cargo leaves it in `target/<profile>/deps`).
pub fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let deps = exe.parent().expect("deps dir");
    [deps.join("libtrainops.so"), deps.join("../libtrainops.so")]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("libtrainops.so not found beside {}", exe.display()))
}

/// The process's one ONNX Runtime environment.
pub fn environment() -> &'static Environment {
    static ENV: OnceLock<Environment> = OnceLock::new();
    ENV.get_or_init(|| {
        ort::init_from(ort_dylib())
            .expect("load libonnxruntime")
            .with_name("trainops-tests")
            .build()
            .expect("environment")
    })
}

/// A session of `model` with libtrainops registered.
///
/// Sessions are created one at a time: ONNX Runtime adds a custom domain to ONNX's global
/// domain-version map with an unlocked check-then-insert, so the first sessions of a
/// process that register the same domains concurrently can fail with "Trying to add a
/// domain to DomainToVersion map, but the domain is already exist" (seen with 1.31.1).
pub fn session(model: &Path, threads: usize) -> ort::Result<Session> {
    static CREATE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = CREATE.lock().unwrap_or_else(|p| p.into_inner());
    Session::builder(environment())?
        .with_intra_threads(threads)?
        .with_operator_library(library())?
        .commit_from_file(model)
}

/// A tensor read from one of onnx's `.pb` files.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    /// float
    F32(Vec<f32>),
    /// double
    F64(Vec<f64>),
    /// int64
    I64(Vec<i64>),
}

/// A named tensor of a test data set.
#[derive(Debug, Clone)]
pub struct Named {
    /// Graph input or output name.
    pub name: String,
    /// Dimensions.
    pub dims: Vec<i64>,
    /// Elements.
    pub data: Data,
}

fn from_le<T, const N: usize>(raw: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N).map(|c| f(c.try_into().expect("chunk of N bytes"))).collect()
}

/// Reads a serialized `TensorProto` (raw or typed fields).
pub fn read_tensor(path: &Path) -> Named {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let t = TensorProto::parse_from_bytes(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let raw = &t.raw_data;
    let data = match t.data_type {
        1 if raw.is_empty() => Data::F32(t.float_data.clone()),
        1 => Data::F32(from_le(raw, f32::from_le_bytes)),
        11 if raw.is_empty() => Data::F64(t.double_data.clone()),
        11 => Data::F64(from_le(raw, f64::from_le_bytes)),
        7 if raw.is_empty() => Data::I64(t.int64_data.clone()),
        7 => Data::I64(from_le(raw, i64::from_le_bytes)),
        other => panic!("{}: element type {other} not used by the training cases", path.display()),
    };
    Named { name: t.name.clone(), dims: t.dims.clone(), data }
}

/// An ort value holding `t`.
pub fn to_value(t: &Named) -> DynValue {
    let shape: Vec<i64> = t.dims.clone();
    match &t.data {
        Data::F32(v) => Tensor::from_array((shape, v.clone())).expect("tensor").into_dyn(),
        Data::F64(v) => Tensor::from_array((shape, v.clone())).expect("tensor").into_dyn(),
        Data::I64(v) => Tensor::from_array((shape, v.clone())).expect("tensor").into_dyn(),
    }
}

/// The elements of an output value as `f64`, with its dims.
pub fn read_value(v: &DynValue) -> (Vec<i64>, Vec<f64>) {
    if let Ok((shape, data)) = v.try_extract_tensor::<f32>() {
        return (shape.to_vec(), data.iter().map(|&x| f64::from(x)).collect());
    }
    let (shape, data) = v.try_extract_tensor::<f64>().expect("float or double output");
    (shape.to_vec(), data.to_vec())
}
